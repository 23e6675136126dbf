"""Paired comparison of two runs on the same images: is attack A better than attack B, beyond chance?

Two runs of one dataset attack the same samples (a sample's index names the same image in both), so their
records pair up. Comparing their ASR and AQN as two independent numbers wastes that pairing and, for AQN, compares
means over different samples (each attack's own successes). Here:

* **Success**: over the samples both runs attacked, the samples only A fooled and only B fooled, and McNemar's
  exact test (:func:`blackboxbench.stats.sign_test_p`, on the discordant pairs).
* **Queries** (query families): over the samples both fooled, each attack's mean and median queries, how often each
  needed fewer, the sign test on those pairs, and the median ratio B / A.

A transfer run pairs per target (the samples attacked in both runs that the target classified correctly when clean
in both: behind a randomized defense the clean check is a draw of each run's own streams). A
detection run has no per-image success: per target, each run's relative mAP drop on the images both attacked and a
paired bootstrap interval of the difference (:func:`blackboxbench.detection.family.paired_drop`). The two runs
should differ in the attack (or one setting) only: the settings that differ are listed with the result; runs of
different datasets or families do not pair and are a one-line error.
"""
import statistics
from pathlib import Path

from .config import load_yaml
from .errors import BenchError
from .leaderboard import MARKERS, label, read_summary
from .registry import FAMILY
from .robustness import QUERY_FAMILIES
from .runner import read_records
from .stats import sign_test_p

SETTINGS = ("dataset", "target_model", "surrogates", "defense", "norm", "eps", "targeted", "budget", "feedback",
            "success_rule", "seed", "n")
# threat keys that SETTINGS already shows (from the summary); any other threat key that differs is listed from the
# runs' config.yaml (a detector's score_thr / max_det, a target-label mode...)
SHOWN_THREAT = ("norm", "eps", "targeted", "max_queries", "feedback", "success_rule")
PAIRED_FAMILIES = ("score", "decision", "transfer", "detection")


def paired_success(a, b):
    """``a``, ``b``: the success (bool) of each paired sample -> counts, rates and McNemar's exact p-value."""
    n = len(a)
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = sum(y and not x for x, y in zip(a, b))
    return {"n": n, "asr_a": sum(a) / n if n else None, "asr_b": sum(b) / n if n else None, "a_only": a_only,
            "b_only": b_only, "p": sign_test_p(a_only, b_only)}


def paired_queries(qa, qb):
    """Query counts of the samples both runs fooled -> means, medians, who needed fewer, the sign test's p-value
    (ties left out) and the median of the ratios B / A."""
    n = len(qa)
    if not n:
        return {"n": 0}
    a_fewer = sum(x < y for x, y in zip(qa, qb))
    b_fewer = sum(y < x for x, y in zip(qa, qb))
    ratios = [y / x for x, y in zip(qa, qb) if x > 0]
    return {"n": n, "mean_a": statistics.fmean(qa), "mean_b": statistics.fmean(qb),
            "median_a": statistics.median(qa), "median_b": statistics.median(qb), "a_fewer": a_fewer,
            "b_fewer": b_fewer, "ties": n - a_fewer - b_fewer, "p": sign_test_p(a_fewer, b_fewer),
            "median_ratio": statistics.median(ratios) if ratios else None}


def run_config(run_dir):
    """The resolved config a run wrote (``config.yaml``); {} when it is missing or unreadable."""
    try:
        cfg = load_yaml(Path(run_dir) / "config.yaml")
    except BenchError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _mapping(cfg, key):
    v = cfg.get(key)
    return v if isinstance(v, dict) else None


def image_difference(ca, cb):
    """The dataset parameters (other than ``n``) in which two run configs differ: they name other images under one
    sample index (a generated dataset's seed, another file); '' when none or unknown."""
    da, db = _mapping(ca, "dataset"), _mapping(cb, "dataset")
    if da is None or db is None:
        return ""
    return ", ".join(f"dataset.{k} {da.get(k)!r} / {db.get(k)!r}" for k in sorted(da.keys() | db.keys())
                     if k != "n" and da.get(k) != db.get(k))


def threat_differences(ca, cb):
    """{``threat.<key>``: (A's, B's)} of the threat keys outside :data:`SHOWN_THREAT` that differ."""
    ta, tb = _mapping(ca, "threat") or {}, _mapping(cb, "threat") or {}
    return {f"threat.{k}": (ta.get(k), tb.get(k)) for k in sorted(ta.keys() | tb.keys())
            if k not in SHOWN_THREAT and ta.get(k) != tb.get(k)}


def load_run(run_dir):
    """``(summary, records)`` of a finished run directory, records keyed by sample index; one-line errors."""
    d = Path(run_dir)
    if not d.is_dir() or not any((d / m).exists() for m in MARKERS):
        inside = d.is_dir() and any(d.rglob("summary.json"))
        raise BenchError(f"not a run directory: {d}" + (" (a results directory: give two of the run folders inside "
                                                         "it)" if inside else ""))
    summary, reason = read_summary(d)
    if reason:
        raise BenchError(f"{d}: {reason}")
    if not isinstance(summary.get("dataset"), str):  # what pairs two runs' samples; the leaderboard needs it not
        raise BenchError(f"{d}: summary.json lacks the dataset (a string) that pairs its samples with another run's")
    family = summary.get("family")
    if family not in PAIRED_FAMILIES or family not in FAMILY:
        raise BenchError(f"{d}: a {family} run; compare pairs the runs of the families {', '.join(PAIRED_FAMILIES)}")
    records = read_records(d / "records.jsonl", FAMILY.get(family).schema(), summary.get("config_hash"))
    return summary, records


def compare_runs(run_a, run_b):
    """The paired comparison of two run directories: ``{"a", "b", "same", "differs", "rows"}``; one row per
    target of a transfer run, one row for a query run (``target`` None)."""
    (sa, ra), (sb, rb) = load_run(run_a), load_run(run_b)
    if sa["dataset"] != sb["dataset"]:
        raise BenchError(f"the runs attack different datasets ({sa['dataset']}, {sb['dataset']}): their samples "
                         "do not pair")
    ca, cb = run_config(run_a), run_config(run_b)
    if other := image_difference(ca, cb):
        raise BenchError(f"the runs attack different images ({other}): their samples do not pair")
    kind = [("query" if s["family"] in QUERY_FAMILIES else s["family"]) for s in (sa, sb)]
    if kind[0] != kind[1]:
        raise BenchError(f"a {sa['family']} run and a {sb['family']} run: compare runs of the query families, two "
                         "transfer runs or two detection runs")
    both = sorted(i for i in ra.keys() & rb.keys() if ra[i]["attacked"] and rb[i]["attacked"])
    targets = [t for t in ra[both[0]]["targets"] if t in rb[both[0]]["targets"]] if both and kind[0] != "query" \
        else []
    rows = []
    if kind[0] == "query":
        rows.append(_row(None, [(ra[i], rb[i]) for i in both], lambda r: r["success"], lambda r: r["queries"]))
    elif kind[0] == "transfer":
        for t in targets:
            # the target's clean check in both runs: behind a randomized defense it is a draw of each run's streams
            pairs = [(ra[i], rb[i]) for i in both
                     if ra[i]["targets"][t]["clean_correct"] and rb[i]["targets"][t]["clean_correct"]]
            rows.append(_row(t, pairs, lambda r, t=t: r["targets"][t]["success"], None))
    else:
        from .detection.family import paired_drop
        rows = [{"target": t, "drop": paired_drop([(ra[i], rb[i]) for i in both], t)} for t in targets]
    if not any((row.get("success") or row.get("drop"))["n"] for row in rows):
        raise BenchError("the runs share no attacked sample (or no target): nothing to pair")
    same = {k: sa.get(k) for k in SETTINGS if sa.get(k) == sb.get(k)}
    differs = {k: (sa.get(k), sb.get(k)) for k in SETTINGS if sa.get(k) != sb.get(k)}
    differs.update(threat_differences(ca, cb))
    return {"a": _name(sa, run_a), "b": _name(sb, run_b), "same": same, "differs": differs, "rows": rows}


def _row(target, pairs, success, queries):
    row = {"target": target, "success": paired_success([success(x) for x, _ in pairs], [success(y) for _, y in pairs])}
    if queries is not None:
        fooled = [(queries(x), queries(y)) for x, y in pairs if success(x) and success(y)]
        row["queries"] = paired_queries([q for q, _ in fooled], [q for _, q in fooled])
    return row


def _name(summary, run_dir):
    return f"{label(summary)} ({Path(run_dir).name})"


def _drop_line(d):
    def f(v):
        return "-" if v is None else f"{v:.3f}"
    interval = "-" if d["low"] is None else f"{d['low']:.3f} to {d['high']:.3f}"
    verdict = "" if d["low"] is None else (" (B drops more)" if d["low"] > 0 else " (A drops more)" if d["high"] < 0
                                           else " (no difference shown)")
    return (f"relative mAP drop on the {d['n']} images both attacked: A {f(d['drop_a'])}, B {f(d['drop_b'])}; "
            f"B - A {f(d['diff'])}, paired bootstrap 95 % {interval}{verdict}")


def format_comparison(result):
    """The comparison as text lines (``blackboxbench compare``)."""
    lines = [f"A: {result['a']}", f"B: {result['b']}",
             "same: " + (", ".join(f"{k} {v}" for k, v in result["same"].items()) or "-")]
    if result["differs"]:
        lines.append("differs: " + ", ".join(f"{k} {a} / {b}" for k, (a, b) in result["differs"].items()))
    for row in result["rows"]:
        head = f"target {row['target']}: " if row["target"] is not None else ""
        if "drop" in row:
            lines.append(head + _drop_line(row["drop"]))
            continue
        s = row["success"]
        if not s["n"]:
            lines.append(f"{head}no sample that both runs attacked counts (the target misclassifies them clean)")
            continue
        lines.append(f"{head}success on the {s['n']} samples both attacked: ASR A {s['asr_a']:.3f}, B "
                     f"{s['asr_b']:.3f}; only A fooled {s['a_only']}, only B {s['b_only']}; McNemar exact p = "
                     f"{s['p']:.3g}")
        q = row.get("queries")
        if q and q["n"]:
            ratio = "-" if q["median_ratio"] is None else f"{q['median_ratio']:.3g}"
            lines.append(f"queries on the {q['n']} samples both fooled: mean A {q['mean_a']:.1f}, B {q['mean_b']:.1f}; "
                         f"median A {q['median_a']:g}, B {q['median_b']:g}; A fewer on {q['a_fewer']}, B fewer on "
                         f"{q['b_fewer']}, ties {q['ties']}; sign test p = {q['p']:.3g}; median ratio B / A {ratio}")
        elif q is not None:
            lines.append("queries: no sample fooled by both")
    return lines
