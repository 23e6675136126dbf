"""Worst case per sample over attacks (blackboxbench/worst_case.py): the pure function against counts worked out by
hand, the grouping of runs end to end against the records themselves, and its place among a config's outputs."""
import csv
import json

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


def test_worst_case_path_is_an_output_of_the_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "o")) + f"leaderboard: {tmp_path / 'o'}/board_worst_case.csv\n")
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
