"""Worst case per sample over the attacks (AutoAttack's robust accuracy): a sample is robust only if no attack
fooled it.

One attack's ASR says how often that attack wins; an evaluator asks how many images survive every attack at the same
threat. The query runs below a results directory are grouped by what they attacked: the same images (dataset and its
parameters), the same target model and defense, the same norm, eps, targeted mode and target labels
(``target_label``: ``random``, ``least_likely``...), query budget and success rule. Runs that differ in the attack,
its settings, the seed or the EOT option fall into one group; a group of one run is kept (its worst case is its
own). A transfer run joins one group per target (its budget and success rule are empty, so transfer and query runs
form separate groups), whatever its surrogates. Within a group the samples are the indices every run recorded, and
per sample:

* **correct**: every run attacked it (the target, defended if so, classified it correctly on the clean check);
* **robust**: correct, and no run's success (the oracle's confirmation on the returned image) fooled it.

A row gives the group's robust accuracy ``robust / n`` with its Wilson 95 % interval (a misclassified sample counts
as not robust, as in AutoAttack), the clean accuracy ``correct / n``, the ASR of the union ``fooled by any /
correct``, the best single run's ASR on the same samples and what the others add to it (``complement``), and per
run the samples only it fooled. For a randomized target (``randomized``), a one-draw success (success rule
``single``) overstates the attack: read the worst case of a ``majority`` run.

In a group of a config's ``cascade`` (``cascade`` true: a later run attacked only what the earlier ones left
robust) a later run's skipped samples count as fooled, so its worst case holds even without the earlier runs'
folders; the best run, ``complement`` and ``only_fooled_by`` are left empty: no run there attacked every sample.
"""
import json
from pathlib import Path

from .compare import load_run
from .errors import BenchError
from .leaderboard import Skipped, label, read_summary, run_dirs, to_csv
from .robustness import QUERY_FAMILIES
from .stats import wilson

FAMILIES = (*QUERY_FAMILIES, "transfer")
GROUP = ("dataset", "dataset_params", "target_model", "defense", "norm", "eps", "targeted", "target_label", "budget",
         "success_rule")
COLUMNS = (*GROUP, "n", "n_runs", "clean_acc", "robust_acc", "robust_acc_low", "robust_acc_high", "asr_any",
           "best_run", "best_asr", "complement", "only_fooled_by", "randomized", "cascade", "runs")


def worst_case(runs):
    """The worst case over ``runs``, pairs ``(name, records)`` with records keyed by sample index (dicts with
    ``attacked`` and ``success``), on the indices every run recorded. Returns a dict of the :data:`COLUMNS` after
    :data:`GROUP` (``only_fooled_by``: {name: samples only that run fooled}); rates are None without samples."""
    names = [name for name, _ in runs]
    common = sorted(set.intersection(*(set(records) for _, records in runs))) if runs else []
    correct = [i for i in common if all(records[i]["attacked"] for _, records in runs)]
    fooled = {name: {i for i in correct if records[i]["success"]} for name, records in runs}
    any_fooled = set().union(*fooled.values())
    n, robust = len(common), len(correct) - len(any_fooled)
    low, high = wilson(robust, n)
    best = max(names, key=lambda m: len(fooled[m]), default=None)
    rate = (lambda k: k / len(correct)) if correct else (lambda k: None)
    only = {m: len(fooled[m] - set().union(*(fooled[o] for o in names if o != m))) for m in names}
    return {"n": n, "n_runs": len(runs), "clean_acc": len(correct) / n if n else None,
            "robust_acc": robust / n if n else None, "robust_acc_low": low, "robust_acc_high": high,
            "asr_any": rate(len(any_fooled)), "best_run": best, "best_asr": rate(len(fooled[best])) if best else None,
            "complement": rate(len(any_fooled) - len(fooled[best])) if best else None, "only_fooled_by": only}


def _key(summary):
    return tuple(json.dumps(summary.get(k), sort_keys=True) for k in GROUP)


def _randomized(summary, target, defense):
    """``target`` when the run found that target randomized, itself or behind its defenses (``<target>+rnd(...)``;
    the ``defense`` cell may start with the target's own tag, ``at+``), else None: a randomized surrogate leaves the
    target's verdicts as they are."""
    found, parts = f", {summary.get('randomized_models') or ''}, ", str(defense).split("+")
    names = [target] + [f"{target}+{'+'.join(parts[k:])}" for k in range(len(parts))]
    return target if any(f", {m}, " in found for m in names) else None


def _views(summary, records):
    """``[(settings, records)]`` with records reduced to ``attacked`` and ``success``: a query run once, a sample
    a cascade's earlier run fooled (``fooled_by``) counted as attacked and fooled; a transfer run once per target,
    as if that target had been attacked alone (the target's clean check for ``attacked``, its answer on the
    returned image for ``success``); ``randomized_models`` reduced to the target's (:func:`_randomized`)."""
    if summary["family"] in QUERY_FAMILIES:
        return [({**summary, "randomized_models": _randomized(summary, summary.get("target_model"),
                                                              summary.get("defense"))},
                 {i: {"attacked": r["attacked"] or bool(r.get("fooled_by")),
                      "success": r["success"] or bool(r.get("fooled_by"))} for i, r in records.items()})]
    views = []
    for target in summary.get("per_target") or {}:
        per = {i: r["targets"].get(target) or {"clean_correct": False, "success": False} for i, r in records.items()}
        defense = summary["per_target"][target].get("defense")
        views.append(({**summary, "target_model": target, "defense": defense,
                       "randomized_models": _randomized(summary, target, defense)},
                      {i: {"attacked": records[i]["attacked"] and t["clean_correct"],
                           "success": records[i]["attacked"] and t["clean_correct"] and t["success"]}
                       for i, t in per.items()}))
    return views


def worst_case_rows(results_dirs):
    """``(rows, skipped)``: one row per group of the finished query and transfer runs below the results directory
    (or directories), in the order of their first run directory (a transfer run joins one group per target); each
    row the group's settings, :func:`worst_case` and ``runs`` (the runs' names: the config's ``name`` else the
    attack, with the run directory where two share one, its path where two directories share a name). A run whose
    records cannot be read is left out and listed in ``skipped``."""
    groups, skipped = {}, []
    for d in run_dirs(results_dirs):
        summary, reason = read_summary(d)
        if reason or summary.get("family") not in FAMILIES:
            continue
        try:
            views = _views(*load_run(d))
        except BenchError as e:  # records that cannot be read: the run is left out, and said so
            skipped.append(Skipped(d, f"left out of the worst case: {e}"))
            continue
        for view, records in views:
            groups.setdefault(_key(view), []).append((view, records, d))
    rows = []
    for members in groups.values():
        taken = [label(s) for s, _, _ in members]
        names = [m if taken.count(m) == 1 else f"{m} ({d.name})" for m, (_, _, d) in zip(taken, members)]
        # one run directory's name under two results directories (a copy of a run): its path tells them apart
        names = [m if names.count(m) == 1 else f"{label(s)} ({d})" for m, (s, _, d) in zip(names, members)]
        row = {k: members[0][0].get(k) for k in GROUP}
        row.update(worst_case([(m, records) for m, (_, records, _) in zip(names, members)]))
        row["only_fooled_by"] = "; ".join(f"{m} {k}" for m, k in row["only_fooled_by"].items())
        row["randomized"] = any(s.get("randomized_models") for s, _, _ in members)
        row["cascade"] = any(s.get("cascade_after") for s, _, _ in members)
        if row["cascade"]:  # a later run attacked only what the earlier left: no run's own ASR to compare
            row.update(best_run=None, best_asr=None, complement=None, only_fooled_by=None)
        row["runs"] = "; ".join(names)
        rows.append(row)
    return rows, skipped


def worst_case_path(out_csv):
    """The worst-case CSV written beside the robustness CSV ``out_csv``: ``<stem>_worst_case.csv``."""
    out = Path(out_csv)
    return out.with_name(f"{out.stem}_worst_case.csv")


def export(results_dirs, out_csv):
    """Write the worst-case CSV; returns its rows and the runs left out (:class:`~.leaderboard.Skipped`)."""
    rows, skipped = worst_case_rows(results_dirs)
    out = Path(out_csv)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_csv(rows, COLUMNS), encoding="utf-8")
    except OSError as e:
        raise BenchError(f"cannot write the worst-case table {out}: {e.strerror or e}") from None
    return rows, skipped
