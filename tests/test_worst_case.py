"""Worst case per sample over attacks (blackboxbench/worst_case.py): the pure function against counts worked out by
hand, the grouping of runs end to end against the records themselves, and its place among a config's outputs."""
import csv
import json
import shutil

import pytest

from blackboxbench.cli import main
from blackboxbench.config import load_config
from blackboxbench.errors import ConfigError
from blackboxbench.stats import wilson
from blackboxbench.worst_case import worst_case, worst_case_path


def _records(outcomes):
    """{index: record} from {index: "m" (misclassified, not attacked) / "f" (fooled) / "r" (robust)}."""
    return {i: {"attacked": o != "m", "success": o == "f"} for i, o in outcomes.items()}


def test_worst_case_counts():
    # sample: 0 robust to both, 1 fooled by A only, 2 by B only, 3 by both, 4 misclassified, 5 only A recorded it
    a = _records({0: "r", 1: "f", 2: "r", 3: "f", 4: "m", 5: "f"})
    b = _records({0: "r", 1: "r", 2: "f", 3: "f", 4: "m"})
    c = _records({0: "r", 1: "r", 2: "r", 3: "r", 4: "m"})
    row = worst_case([("A", a), ("B", b), ("C", c)])
    assert row["n"] == 5 and row["n_runs"] == 3  # index 5 is not in every run
    assert row["clean_acc"] == 4 / 5
    assert row["robust_acc"] == 1 / 5  # sample 0 only; 4 is misclassified, so not robust
    assert (row["robust_acc_low"], row["robust_acc_high"]) == wilson(1, 5)
    assert row["asr_any"] == 3 / 4
    assert (row["best_run"], row["best_asr"], row["complement"]) == ("A", 2 / 4, 1 / 4)  # B ties A; the first wins
    assert row["only_fooled_by"] == {"A": 1, "B": 1, "C": 0}


def test_worst_case_of_one_run_and_of_none():
    row = worst_case([("A", _records({0: "f", 1: "r"}))])
    assert (row["robust_acc"], row["asr_any"], row["best_asr"], row["complement"]) == (0.5, 0.5, 0.5, 0.0)
    row = worst_case([("A", _records({0: "m"}))])  # nothing attacked: the rates over attacked samples are None
    assert (row["robust_acc"], row["asr_any"], row["best_asr"]) == (0.0, None, None)
    assert worst_case([])["n"] == 0 and worst_case([])["robust_acc"] is None



def test_a_transfer_sample_left_unattacked_is_not_correct_for_any_target():
    """A transfer record with ``attacked`` false (its target label is its own label) counts as not correct for every
    target, even where that target classified it correctly when clean, as a query run's unattacked sample does: it
    must not become a robust sample of the worst case."""
    from blackboxbench.worst_case import _views

    summary = {"family": "transfer", "per_target": {"m": {"defense": "none"}}}
    records = {0: {"attacked": False, "targets": {"m": {"clean_correct": True, "success": False}}},
               1: {"attacked": True, "targets": {"m": {"clean_correct": True, "success": False}}},
               2: {"attacked": True, "targets": {"m": {"clean_correct": False, "success": True}}},
               3: {"attacked": True, "targets": {"m": {"clean_correct": True, "success": True}}}}
    [(view, per)] = _views(summary, records)
    assert view["target_model"] == "m"
    assert per == {0: {"attacked": False, "success": False}, 1: {"attacked": True, "success": False},
                   2: {"attacked": False, "success": False}, 3: {"attacked": True, "success": True}}
    row = worst_case([("A", per)])
    assert (row["clean_acc"], row["robust_acc"], row["asr_any"]) == (2 / 4, 1 / 4, 1 / 2)


def test_worst_case_matches_a_brute_force_over_random_runs():
    """Random runs that recorded overlapping sets of samples: per sample, robust iff every run recorded and attacked
    it and none fooled it; the union, best single run, complement and only-fooled-by counts, sample by sample."""
    import random

    rnd = random.Random(7)
    for _ in range(200):
        k, pool = rnd.randint(1, 4), list(range(rnd.randint(0, 25)))
        runs = [(f"r{j}", {i: {"attacked": (a := rnd.random() < 0.85), "success": a and rnd.random() < 0.4}
                           for i in pool if rnd.random() < 0.95}) for j in range(k)]
        row = worst_case(runs)
        common = [i for i in pool if all(i in rec for _, rec in runs)]
        correct = [i for i in common if all(rec[i]["attacked"] for _, rec in runs)]
        broke = {i: [m for m, rec in runs if rec[i]["success"]] for i in correct}
        robust = [i for i in correct if not broke[i]]
        assert row["n"] == len(common)
        assert row["robust_acc"] == (len(robust) / len(common) if common else None)
        assert (row["robust_acc_low"], row["robust_acc_high"]) == wilson(len(robust), len(common))
        assert row["clean_acc"] == (len(correct) / len(common) if common else None)
        fooled = {m: sum(m in broke[i] for i in correct) for m, _ in runs}
        best = max(fooled.values())
        assert fooled[row["best_run"]] == best and row["best_run"] == next(m for m, _ in runs if fooled[m] == best)
        if correct:
            assert row["asr_any"] == (len(correct) - len(robust)) / len(correct)
            assert row["complement"] == (len(correct) - len(robust) - best) / len(correct)
        else:
            assert row["asr_any"] is row["best_asr"] is row["complement"] is None
        assert row["only_fooled_by"] == {m: sum(broke[i] == [m] for i in correct) for m, _ in runs}


CONFIG = """
dataset: {name: digits, n: 12}
model: digits_mlp
threat: {norm: linf, eps: 0.1, max_queries: 150}
batch_size: 6
device: cpu
seed: 1
output_dir: OUT
robustness: OUT/board.csv
runs:
  - {attack: square_linf}
  - {attack: simba_dct}
  - {attack: square_linf, name: square_seed2, seed: 2}
  - {attack: square_linf, threat: {eps: 0.2}}
"""


def test_groups_runs_on_the_same_images_and_threat(tmp_path, capsys):
    """Three runs at eps 0.1 form one group (another attack, another seed), the eps 0.2 run its own; the robust
    accuracy equals the count from the runs' records."""
    out = tmp_path / "out"
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.replace("OUT", str(out)))
    assert main(["run", str(path), "--quiet"]) == 0
    assert f"worst case per sample: {out / 'board_worst_case.csv'} (2 groups" in capsys.readouterr().out
    rows = list(csv.DictReader((out / "board_worst_case.csv").open()))
    assert [(r["eps"], r["n_runs"]) for r in rows] in ([("0.1", "3"), ("0.2", "1")], [("0.2", "1"), ("0.1", "3")])
    row = next(r for r in rows if r["eps"] == "0.1")
    records = {}
    for d in out.iterdir():
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
        if summary and summary["eps"] == 0.1:
            records[summary["name"] or summary["attack"]] = [json.loads(x) for x in (d / "records.jsonl").open()]
    assert sorted(records) == ["simba_dct", "square_linf", "square_seed2"]
    assert sorted(row["runs"].split("; ")) == sorted(records)
    robust = {i for i in range(12) if all(any(r["index"] == i and r["attacked"] and not r["success"] for r in recs)
                                          for recs in records.values())}
    assert float(row["robust_acc"]) == pytest.approx(len(robust) / 12)
    fooled = {r["index"] for recs in records.values() for r in recs if r["success"]}
    correct = {r["index"] for r in records["square_linf"] if r["attacked"]}
    assert float(row["asr_any"]) == pytest.approx(len(fooled) / len(correct))
    assert fooled and len(robust) + len(fooled) == len(correct)
    bad = next(d for d in out.iterdir() if d.name.startswith("simba_dct"))
    lines = (bad / "records.jsonl").read_text().splitlines()
    (bad / "records.jsonl").write_text("\n".join([lines[0].replace('"success": ', '"success":  ')[:-3] + '0"}']
                                                  + lines[1:]) + "\n")  # a record whose checksum fails
    assert main(["robustness", str(out), "-o", str(tmp_path / "again.csv")]) == 0
    err = capsys.readouterr().err
    assert f"skipped {bad}: left out of the worst case: " in err and "checksum" in err
    again = list(csv.DictReader((tmp_path / "again_worst_case.csv").open()))
    assert sorted(r["n_runs"] for r in again) == ["1", "2"]


def test_worst_case_path_is_an_output_of_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    board = tmp_path / "o" / "board_worst_case.csv"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "o")) + f"leaderboard: {board}\n")
    with pytest.raises(ConfigError, match="robustness: writes .*board_worst_case.csv, which leaderboard writes too"):
        load_config(path)
    assert worst_case_path("a/b.csv").as_posix() == "a/b_worst_case.csv"


TRANSFER = """
dataset: {name: digits, n: 10}
surrogates: [digits_cnn]
targets: [digits_mlp, digits_resnet]
threat: {norm: linf, eps: 0.1}
batch_size: 10
device: cpu
output_dir: OUT
runs:
  - {attack: i_fgsm}
  - {attack: mi_fgsm}
"""


def test_transfer_runs_group_per_target(tmp_path, capsys):
    out = tmp_path / "out"
    path = tmp_path / "t.yaml"
    path.write_text(TRANSFER.replace("OUT", str(out)))
    assert main(["run", str(path), "--quiet"]) == 0
    assert main(["robustness", str(out), "-o", str(tmp_path / "r.csv")]) == 0
    rows = {r["target_model"]: r for r in csv.DictReader((tmp_path / "r_worst_case.csv").open())}
    assert sorted(rows) == ["digits_mlp", "digits_resnet"]
    runs = [[json.loads(x) for x in (d / "records.jsonl").open()] for d in out.iterdir() if d.is_dir()]
    assert len(runs) == 2
    for target, row in rows.items():
        assert row["n_runs"] == "2" and row["budget"] == ""
        per = [{r["index"]: r["targets"][target] for r in recs} for recs in runs]
        robust = [i for i in range(10) if all(p[i]["clean_correct"] and not p[i]["success"] for p in per)]
        assert float(row["robust_acc"]) == pytest.approx(len(robust) / 10)
        correct = [i for i in range(10) if all(p[i]["clean_correct"] for p in per)]
        assert float(row["clean_acc"]) == pytest.approx(len(correct) / 10)


CASCADE = """
dataset: {name: digits, n: 20}
model: test_digits_mlp_f64
threat: {norm: linf, eps: 0.12, max_queries: 300}
batch_size: 20
device: cpu
seed: 0
output_dir: OUT
robustness: OUT/board.csv
CASCADE
runs:
  - {attack: simba_dct}
  - {attack: square_linf}
  - {attack: rays}
  - {attack: square_linf, threat: {eps: 0.2}}
"""


def _cascade_run(tmp_path, name, cascade):
    import test_engine  # noqa: F401  (registers test_digits_mlp_f64, a batch-invariant target)

    out = tmp_path / name
    path = tmp_path / f"{name}.yaml"
    path.write_text(CASCADE.replace("OUT", str(out)).replace("CASCADE", f"cascade: {str(cascade).lower()}"))
    assert main(["run", str(path), "--quiet"]) == 0
    runs = {}
    for d in out.iterdir():
        if (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            runs[(s["attack"], s["eps"])] = (s, {r["index"]: r for r in map(json.loads, (d / "records.jsonl").open())})
    rows = {r["eps"]: r for r in csv.DictReader((out / "board_worst_case.csv").open())}
    return runs, rows


def test_cascade_attacks_only_what_earlier_runs_left_robust(tmp_path):
    """AutoAttack's order: a run skips the samples an earlier run of the same images, target and threat fooled.
    On a batch-invariant target the worst case is the one of the runs made alone (a sample's result does not
    depend on which others are attacked with it), for fewer queries; a run of another eps is not in the cascade."""
    alone, rows_alone = _cascade_run(tmp_path, "alone", False)
    cascade, rows_cascade = _cascade_run(tmp_path, "cascade", True)
    assert rows_cascade["0.12"]["robust_acc"] == rows_alone["0.12"]["robust_acc"]
    assert rows_cascade["0.12"]["asr_any"] == rows_alone["0.12"]["asr_any"]
    assert 0 < float(rows_alone["0.12"]["robust_acc"]) < float(rows_alone["0.12"]["clean_acc"])
    fooled = {}  # sample -> the first run (in the file's order) that fooled it alone
    after = {"simba_dct": None, "square_linf": "simba_dct", "rays": "simba_dct, square_linf"}
    for attack in ("simba_dct", "square_linf", "rays"):
        s, records = cascade[(attack, 0.12)]
        _, records_alone = alone[(attack, 0.12)]
        assert s["cascade_after"] == after[attack]
        assert sum("fooled_by" in r for r in records.values()) == len(fooled)
        for i, r in records.items():
            if i in fooled:
                assert not r["attacked"] and r["fooled_by"] == fooled[i]
            else:
                assert "fooled_by" not in r
                assert {k: v for k, v in r.items() if k not in ("time", "check")} == \
                    {k: v for k, v in records_alone[i].items() if k not in ("time", "check")}
        for i, r in records_alone.items():
            if r["success"]:
                fooled.setdefault(i, attack)
    def spent(runs):
        return sum(r["queries"] for (_, e), (_, recs) in runs.items() if e == 0.12 for r in recs.values())

    assert spent(cascade) < spent(alone)
    assert len(fooled) > 1 and float(rows_cascade["0.12"]["n_runs"]) == 3
    assert rows_cascade["0.12"]["cascade"] == "True" and rows_cascade["0.12"]["best_run"] == ""
    assert rows_alone["0.12"]["cascade"] == "False" and rows_alone["0.12"]["best_run"] in after
    first = next(d for d in (tmp_path / "cascade").iterdir() if d.name.startswith("simba_dct"))
    shutil.rmtree(first)  # the later runs' records still say what the first fooled
    assert main(["robustness", str(tmp_path / "cascade"), "-o", str(tmp_path / "again.csv")]) == 0
    again = {r["eps"]: r for r in csv.DictReader((tmp_path / "again_worst_case.csv").open())}
    assert again["0.12"]["robust_acc"] == rows_alone["0.12"]["robust_acc"] and again["0.12"]["n_runs"] == "2"
    s, records = cascade[("square_linf", 0.2)]  # another threat: its own group, the run made alone
    assert s["cascade_after"] is None and s["run"] == alone[("square_linf", 0.2)][0]["run"]
    def same(recs):
        return {i: {k: v for k, v in r.items() if k not in ("time", "check")} for i, r in recs.items()}

    assert same(records) == same(alone[("square_linf", 0.2)][1])


@pytest.mark.parametrize("extra,message", [
    ("backend: processes\n", "cascade runs the runs one after another, in the file's order: backend serial"),
    ("share_forwards: true\n", "cascade runs the runs one after another; share_forwards runs them together")])
def test_cascade_needs_the_runs_in_order(tmp_path, extra, message):
    path = tmp_path / "c.yaml"
    path.write_text(CASCADE.replace("OUT", str(tmp_path / "o")).replace("CASCADE", "cascade: true\n" + extra))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_run_that_attacks_no_sample_keeps_its_success_rule():
    """A cascade's later run may find every sample fooled: its summary still states the rule (the worst case
    groups by it)."""
    from blackboxbench.evaluation import summarize_query

    r = {"index": 0, "label": 0, "target": None, "clean_correct": True, "attacked": False, "success": False,
         "queries": 0, "l2": 0.0, "linf": 0.0, "ssim": 1.0, "lpips": None, "time": 0.0, "audit_adv": None,
         "reeval_adv": None, "reeval_votes": None, "stalled": False, "success_rule": "majority of 5",
         "fooled_by": "square_linf", "clean_correct_defended": None}
    s = summarize_query([r])
    assert s["success_rule"] == "majority of 5" and s["n_attacked"] == 0 and s["asr"] is None


def test_rows_keep_runs_of_one_label_apart_and_group_by_target_label(monkeypatch):
    """Two runs of one attack (two seeds) are two members of their group, each named with its directory: their
    union of fooled samples counts both. Runs that differ only in the target-label mode are two groups. A group is
    randomized when one of its runs found its defended target randomized (``m+rnd(...)``)."""
    from pathlib import Path

    from blackboxbench import worst_case as wc

    def summary(d, **kw):
        return {"attack": "sq", "family": "score", "dataset": "digits", "target_model": "m", "defense": "none",
                "norm": "linf", "eps": 0.1, "targeted": False, "target_label": None, "budget": 100,
                "success_rule": "single", "run": d, **kw}

    runs = {"r1": (summary("r1"), _records({0: "f", 1: "r", 2: "r"})),
            "r2": (summary("r2", defense="rnd(sigma=0.1)", randomized_models="m+rnd(sigma=0.1)"),
                   _records({0: "r", 1: "f", 2: "r"})),
            "r3": (summary("r3", defense="rnd(sigma=0.1)"), _records({0: "f", 1: "r", 2: "r"})),
            "t1": (summary("t1", targeted=True, target_label={"name": "random"}), _records({0: "f", 1: "r"})),
            "t2": (summary("t2", targeted=True, target_label={"name": "least_likely"}), _records({0: "r", 1: "r"}))}
    monkeypatch.setattr(wc, "run_dirs", lambda results: [Path("res") / d for d in runs])
    monkeypatch.setattr(wc, "read_summary", lambda d: (runs[d.name][0], None))
    monkeypatch.setattr(wc, "load_run", lambda d: runs[d.name])
    rows, skipped = wc.worst_case_rows("res")
    assert skipped == [] and [r["runs"] for r in rows] == ["sq", "sq (r2); sq (r3)", "sq", "sq"]
    plain, rnd, t1, t2 = rows
    assert (rnd["n_runs"], rnd["robust_acc"], rnd["asr_any"]) == (2, 1 / 3, 2 / 3)  # r2 fooled 1, r3 fooled 0
    assert rnd["only_fooled_by"] == "sq (r2) 1; sq (r3) 1"
    assert (rnd["randomized"], plain["randomized"]) == (True, False)
    assert (t1["target_label"], t1["robust_acc"]) == ({"name": "random"}, 1 / 2)
    assert (t2["target_label"], t2["robust_acc"]) == ({"name": "least_likely"}, 1.0)
