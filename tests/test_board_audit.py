"""The leaderboard, the robustness board, the worst case, the summaries and the plots against an independent
recomputation from the runs' ``records.jsonl`` (this file's own arithmetic, not the library's helpers).

Real small result folders (digits, 6-10 images, budgets of 3-60 queries; a few seconds on one core): score and
decision runs, two runs of one config under different names, a randomized defense with a majority success rule, a
targeted run, a run where no sample succeeds, one where every sample is misclassified when clean, a sweep (grid of
eps x seed), a transfer run with three targets (one behind RND) and a targeted one with two, a detection run
(untrained tiny detectors) and a run resumed after an interruption; a copy of the query runs in a second results
directory (one config run twice).
"""
import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from blackboxbench.cli import main
from blackboxbench.leaderboard import columns
from blackboxbench.prep.data import Dataset, digits
from blackboxbench.registry import DATASET, FAMILY
from test_engine import noisy_digits_mlp

Z95 = 1.959963984540054  # the 97.5 % quantile of the standard normal


@DATASET.register("test_board_shifted_digits", source="test")
def shifted_digits(data_root=None, *, n=None):
    """The digits with every label moved to the next class: the digits MLP misclassifies every image."""
    d = digits(n=n)
    return Dataset("test_board_shifted_digits", d.x, (d.y + 1) % 10, 10)


QUERY = """
dataset: {name: digits, n: 10}
model: digits_mlp
threat: {norm: linf, eps: 0.1, max_queries: 60}
batch_size: 5
device: cpu
output_dir: OUT/q
runs:
  - {attack: square_linf}
  - {attack: square_linf, name: square_dup}
  - {attack: rays}
  - {attack: square_linf, defense: {name: rnd, sigma: 0.05}, threat: {success_rule: {name: majority, draws: 3}}}
  - {attack: square_linf, threat: {targeted: true, target_label: random}}
  - {attack: square_linf, threat: {targeted: true, target_label: least_likely}}
  - {attack: square_linf, name: square_none, threat: {eps: 0.004, max_queries: 3}}
  - {attack: square_linf, name: square_miscls, dataset: {name: test_board_shifted_digits, n: 6}}
"""
SWEEP = """
dataset: {name: digits, n: 8}
model: digits_mlp
attack: simba_dct
threat: {norm: linf, max_queries: 40}
batch_size: 4
device: cpu
output_dir: OUT/sweep
grid: {threat.eps: [0.05, 0.1], seed: [0, 1]}
"""
TRANSFER = """
dataset: {name: digits, n: 10}
attack: i_fgsm
surrogates: [digits_cnn]
threat: {norm: linf, eps: 0.1}
batch_size: 5
device: cpu
output_dir: OUT/t
runs:
  - {targets: [digits_mlp, digits_lenet, {name: digits_mlp, defense: {name: rnd, sigma: 0.05}}]}
  - {targets: [digits_mlp, digits_lenet], threat: {eps: 0.2, targeted: true, target_label: random}}
"""
DETECTION = """
dataset: {name: shapes, n: 4, seed: 0}
attack: tog_untargeted
surrogates: [{name: shapes_fcos, pretrained: false}]
targets: [{name: shapes_fcos, pretrained: false}, {name: shapes_fcos_b, pretrained: false}]
batch_size: 2
device: cpu
output_dir: OUT/d
"""
NOISY = noisy_digits_mlp  # test_noisy_digits_mlp (registered once, in test_engine): the randomized surrogate below
SURROGATE = """
dataset: {name: digits, n: 6}
model: digits_cnn
surrogates: [test_noisy_digits_mlp]
attack: prgf
threat: {norm: linf, eps: 0.1, max_queries: 30}
batch_size: 3
device: cpu
output_dir: OUT/s
"""
RESUMED = """
dataset: {name: digits, n: 10}
model: digits_mlp
attack: simba_pixel
threat: {norm: linf, eps: 0.1, max_queries: 50}
batch_size: 3
device: cpu
output_dir: OUT/resumed
"""


def _run(root, name, text):
    path = root / f"{name}.yaml"
    path.write_text(text.replace("OUT", str(root / "runs")))
    assert main(["run", str(path), "--quiet"]) == 0


@pytest.fixture(scope="module")
def results(tmp_path_factory, data_root):
    """The root of every run (``runs``) and a second results directory (``again``) holding a copy of the query runs."""
    root = tmp_path_factory.mktemp("board")
    for name, text in (("query", QUERY), ("sweep", SWEEP), ("transfer", TRANSFER), ("detection", DETECTION),
                       ("surrogate", SURROGATE), ("resumed", RESUMED)):
        _run(root, name, text)
    # the interruption: the resumed run keeps its first 4 records (written as samples finish), loses its summary
    (run,) = (root / "runs" / "resumed").iterdir()
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(lines[:4]))
    (run / "summary.json").unlink()
    _run(root, "resumed", RESUMED)
    assert len((run / "records.jsonl").read_text().splitlines()) == 10
    shutil.copytree(root / "runs" / "q", root / "again" / "q")
    return root


def runs_below(*roots):
    """{run directory: (summary, records, config)} of every finished run below ``roots``."""
    out = {}
    for root in roots:
        for s in sorted(Path(root).rglob("summary.json")):
            d = s.parent
            records = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
            import yaml
            out[d] = (json.loads(s.read_text()), records, yaml.safe_load((d / "config.yaml").read_text()))
    return out


def wilson(k, n):
    if n == 0:
        return None, None
    p, z2 = k / n, Z95 ** 2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def median_bounds(values):
    """The distribution-free interval of a median: the order statistics v_(k), v_(n+1-k), k the largest with
    P(Binomial(n, 1/2) <= k - 1) <= 0.025."""
    v, n = sorted(values), len(values)
    k, total = 0, 0.0
    for j in range(n + 1):
        total += math.comb(n, j) / 2 ** n
        if total > 0.025:
            break
        k = j + 1
    return (float(v[k - 1]), float(v[n - k])) if k >= 1 else (None, None)


def mean(v):
    return sum(v) / len(v) if v else None


def median(v):
    s = sorted(v)
    return None if not s else float(s[len(s) // 2]) if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def expected_query(records):
    """A query run's summary figures, from its records alone."""
    attacked = [r for r in records if r["attacked"]]
    wins = [r for r in attacked if r["success"]]
    q = [r["queries"] for r in wins]
    low, high = wilson(len(wins), len(attacked))
    out = {"n": len(records), "clean_acc": sum(r["clean_correct"] for r in records) / len(records),
           "n_attacked": len(attacked), "n_success": len(wins),
           "asr": len(wins) / len(attacked) if attacked else None, "asr_low": low, "asr_high": high,
           "aqn": mean(q), "mqn": median(q), "mean_queries_all": mean([r["queries"] for r in attacked]),
           "n_stalled": sum(r["stalled"] for r in attacked),
           "n_audit_disagree": sum(r["audit_adv"] != r["success"] for r in attacked),
           "asr_reeval_undefended": mean([float(bool(r["audit_adv"])) for r in attacked]),
           "attack_time": sum(r["time"] for r in records)}
    out["mqn_low"], out["mqn_high"] = median_bounds(q)
    for m in ("l2", "linf", "ssim"):
        out[f"mean_{m}"], out[f"median_{m}"] = mean([r[m] for r in wins]), median([r[m] for r in wins])
    defended = [r["clean_correct_defended"] for r in records if r["clean_correct_defended"] is not None]
    out["clean_acc_defended"] = mean([float(d) for d in defended])
    reeval = [r["reeval_adv"] for r in attacked if r["reeval_adv"] is not None]
    out["asr_reeval_defended"] = mean([float(a) for a in reeval]) if reeval else None
    out["reeval_gap"] = len(wins) - sum(reeval) if reeval else None
    return out


def expected_transfer(records):
    """A transfer run's per-target and averaged figures, from its records alone."""
    per = {}
    for t in records[0]["targets"]:
        valid = [r for r in records if r["attacked"] and r["targets"][t]["clean_correct"]]
        wins = sum(r["targets"][t]["success"] for r in valid)
        low, high = wilson(wins, len(valid))
        per[t] = {"clean_acc": sum(r["targets"][t]["clean_correct"] for r in records) / len(records),
                  "asr": wins / len(valid) if valid else None, "asr_low": low, "asr_high": high, "n": len(valid)}
    attacked = [r for r in records if r["attacked"]]
    out = {"n": len(records), "n_attacked": len(attacked), "per_target": per,
           "asr": mean([p["asr"] for p in per.values() if p["asr"] is not None]),
           "clean_acc": mean([p["clean_acc"] for p in per.values()]),
           "surrogate_clean_acc": sum(r["clean_correct"] for r in records) / len(records)}
    for m in ("l2", "linf", "ssim"):
        out[f"mean_{m}"], out[f"median_{m}"] = mean([r[m] for r in attacked]), median([r[m] for r in attacked])
    return out


def same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def check_figures(summary, expected, where):
    for k, v in expected.items():
        if isinstance(v, dict):
            for t, sub in v.items():
                check_figures(summary[k][t], sub, f"{where} {k}[{t}]")
        else:
            assert same(summary[k], v), f"{where}: {k} is {summary[k]!r}, the records give {v!r}"


def test_every_summary_equals_its_records(results):
    runs = runs_below(results / "runs")
    families = {}
    for d, (s, records, cfg) in runs.items():
        families.setdefault(s["family"], []).append(d)
        assert [r["index"] for r in sorted(records, key=lambda r: r["index"])] == list(range(s["n"]))
        if s["family"] in ("score", "decision"):
            expected = expected_query(records)
            check_figures(s, expected, d.name)
            # ASR over the attacked samples, which are the clean-correct ones (untargeted) or the clean-correct ones
            # whose target is not their label (targeted), as README says
            for r in records:
                assert r["attacked"] == (r["clean_correct"] and r["target"] != r["label"])
            if expected["aqn"] is not None and len([r for r in records if r["success"]]) >= 2:
                assert s["aqn_low"] <= s["aqn"] <= s["aqn_high"]
            else:
                assert s["aqn_low"] is s["aqn_high"] is None
        elif s["family"] == "transfer":
            check_figures(s, expected_transfer(records), d.name)
            assert s["asr_low"] <= s["asr"] <= s["asr_high"]
        else:
            attacked = [r for r in records if r["attacked"]]
            per = s["per_target"]
            assert s["n_attacked"] == len(attacked) and s["n"] == len(records)
            assert same(s["time_per_image"], mean([r["time"] for r in attacked]))
            assert same(s["mean_ssim"], mean([r["ssim"] for r in attacked]))
            assert same(s["clean_acc"], mean([p["clean_map"] for p in per.values()]))
            drops = [p["drop_map"] for p in per.values() if p["drop_map"] is not None]
            assert s["asr"] == s["mean_drop_map"] and same(s["asr"], mean(drops)) or s["asr"] is mean(drops) is None
        # identity of the run, from its resolved config
        assert s["attack"] == cfg["attack"]["name"] and s["name"] == cfg["name"]
        assert (s["norm"], s["eps"], s["targeted"]) == (cfg["threat"]["norm"], cfg["threat"]["eps"],
                                                        cfg["threat"]["targeted"])
        assert s["budget"] == cfg["threat"].get("max_queries")
        assert s["target_label"] == (cfg["threat"]["target_label"] or {}).get("name")  # random, least_likely...
        if s["family"] in ("score", "decision"):
            assert s["target_model"] == cfg["model"]["name"]
            assert s["defense"] == ("rnd(sigma=0.05)" if cfg.get("defense") else "none")
            assert bool(s["randomized_models"]) == bool(cfg.get("defense") or cfg.get("surrogates"))
    assert sorted(families) == ["decision", "detection", "score", "transfer"]
    assert len(families["score"]) == 13


def test_special_runs(results):
    """The runs where nothing succeeds and where nothing is attacked, the defended and the resumed run."""
    by = {(s["name"] or s["attack"], s["defense"], s["targeted"]): (s, rec) for s, rec, _ in
          runs_below(results / "runs" / "q", results / "runs" / "resumed").values()}
    s, _ = by["square_none", "none", False]
    assert (s["asr"], s["n_success"], s["aqn"], s["mqn"], s["mean_l2"]) == (0.0, 0, None, None, None)
    s, rec = by["square_miscls", "none", False]
    assert s["clean_acc"] == 0.0 and s["n_attacked"] == 0 and not any(r["attacked"] for r in rec)
    assert s["asr"] is s["asr_low"] is s["aqn"] is s["mean_queries_all"] is None
    s, rec = by["square_linf", "rnd(sigma=0.05)", False]
    assert s["success_rule"] == "majority of 3" and all(r["reeval_adv"] is not None for r in rec if r["attacked"])
    s, rec = by["simba_pixel", "none", False]
    assert s["n"] == len(rec) == 10


def read(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def cell_value(text):
    """A cell as the leaderboard wrote it: empty for None, numbers as numbers, True / False, else text."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def expected_order(rows):
    """Best first: ASR high to low, then AQN low to high, a missing value last; then the run name."""
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return sorted(rows, key=lambda r: ((0, -r["asr"]) if num(r["asr"]) else (1, 0),
                                       (0, r["aqn"]) if num(r["aqn"]) else (1, 0), r["run"]))


DIRECTIONS = {"asr": "higher", "aqn": "lower", "mqn": "lower", "mean_l2": "lower", "median_l2": "lower",
              "mean_linf": "lower", "median_linf": "lower", "mean_ssim": "higher", "median_ssim": "higher",
              "mean_lpips": "lower", "median_lpips": "lower", "n_audit_disagree": "lower",
              "mean_drop_map": "higher", "mean_drop_ap_loc": "higher", "mean_drop_csr": "higher",
              "mean_goal_rate": "higher", "time_per_image": "lower", "asr_low": None, "asr_high": None,
              "clean_acc": None, "eps": None, "run": None}


def test_leaderboard_equals_the_summaries_and_the_records(results, tmp_path, capsys):
    out = tmp_path / "board.csv"
    assert main(["leaderboard", str(results), "-o", str(out)]) == 0
    capsys.readouterr()
    runs = runs_below(results / "runs", results / "again")
    rows = read(out)
    assert len(rows) == len(runs) == 16 + 8 + 1
    names = [c for c, _ in columns()]
    assert list(rows[0]) == names
    directions = dict(columns())
    assert {c: directions[c] for c in DIRECTIONS} == DIRECTIONS
    for family in FAMILY.names():  # no family's column gets another family's direction
        assert all(directions[c] == d for c, d in FAMILY.get(family).columns), family
    seen = {}
    for row in rows:
        d = next(d for d in runs if d.name == row["run"] and d not in seen.values() and
                 runs[d][0]["config_hash"] == row["config_hash"])
        seen[len(seen)] = d
        s = runs[d][0]
        for c in names:
            v = s.get(c)
            if isinstance(v, float) and not math.isfinite(v):
                assert row[c] == str(v)
            elif isinstance(v, (dict, list)):
                continue
            else:
                assert same(cell_value(row[c]), v) or str(v) == row[c], f"{d.name}: {c} {row[c]!r} != {v!r}"
        # a duplicated run of one config keeps its own row; its figures equal the first copy's
    got = [(r["run"], r["config_hash"]) for r in rows]
    want = expected_order([{**runs[d][0], "run": d.name} for d in runs])
    assert [r["run"] for r in want] == [g for g, _ in got]
    assert sum(r["run"].startswith("square_dup") for r in rows) == 2
    # the settings columns tell apart every two runs of different configs (not only their hash)
    identity = ("attack", "name", "dataset", "dataset_params", "target_model", "defense", "surrogates", "norm", "eps",
                "targeted", "target_label", "budget", "success_rule", "eot", "seed", "n")
    hashes = {}
    for r in rows:
        hashes.setdefault(tuple(r[c] for c in identity), set()).add(r["config_hash"])
    assert all(len(h) == 1 for h in hashes.values()), [k for k, h in hashes.items() if len(h) > 1]


def test_csv_files_round_trip_with_one_line_ending(results, tmp_path, capsys):
    """Every board the library writes uses one line ending (CRLF, Python's csv default), and reads back to the same
    cells; an undefined mean is an empty cell, never 'None' or 'nan'."""
    board, rob = tmp_path / "board.csv", tmp_path / "rob.csv"
    assert main(["leaderboard", str(results / "runs"), "-o", str(board)]) == 0
    assert main(["robustness", str(results / "runs"), "-o", str(rob)]) == 0
    assert main(["plot", str(results / "runs"), "-r", "aev_line", "-o", str(tmp_path / "fig.png")]) == 0
    capsys.readouterr()
    for path in (board, rob, tmp_path / "rob_worst_case.csv", tmp_path / "fig.csv", tmp_path / "board_detection.csv"):
        raw = path.read_bytes()
        assert raw.count(b"\r\n") == raw.count(b"\n") == len(read(path)) + 1, path.name
        for r in read(path):
            assert "None" not in r.values() and "nan" not in r.values(), path.name
    (d,) = (results / "runs" / "d").iterdir()
    per = json.loads((d / "summary.json").read_text())["per_target"]
    for r in read(tmp_path / "board_detection.csv"):  # one row per target detector, its own figures
        for c in ("clean_map", "adv_map", "drop_map", "clean_csr", "adv_csr", "clean_n_det", "adv_n_det"):
            assert same(cell_value(r[c]), per[r["target"]][c]), (r["target"], c)
    none = next(r for r in read(board) if r["name"] == "square_none")
    assert none["aqn"] == none["mqn"] == none["mean_l2"] == "" and none["asr"] == "0.0"


def test_robustness_board_equals_the_records(results, tmp_path, capsys):
    out = tmp_path / "rob.csv"
    assert main(["robustness", str(results / "runs"), "-o", str(out)]) == 0
    capsys.readouterr()
    runs = {d.name: v for d, v in runs_below(results / "runs").items() if v[0]["family"] in ("score", "decision")}
    rows = read(out)
    assert sorted(r["run"] for r in rows) == sorted(runs)
    for r in rows:
        s, records, _ = runs[r["run"]]
        e = expected_query(records)
        for c in ("n_attacked", "asr", "asr_low", "asr_high", "aqn", "mqn", "mean_queries_all", "clean_acc",
                  "clean_acc_defended", "asr_reeval_defended", "asr_reeval_undefended", "reeval_gap", "mean_ssim",
                  "mean_l2", "mean_linf"):
            assert same(cell_value(r[c]), e[c]), f"{r['run']}: {c} {r[c]!r} != {e[c]!r}"
        for c in ("attack", "name", "norm", "eps", "targeted", "target_model", "defense", "success_rule", "eot",
                  "config_hash"):
            assert same(cell_value(r[c]), s[c]) or str(s[c]) == r[c], c
    # ordered by attack, then defense (none first)
    keys = [(r["attack"], r["norm"], float(r["eps"]), r["targeted"] == "True", r["defense"] != "none") for r in rows]
    assert keys == sorted(keys)
    assert out.with_suffix(".png").stat().st_size > 0


def test_worst_case_equals_the_records(results, tmp_path, capsys):
    """Both results directories: the copies of the query runs join their groups as runs of their own; each group's
    line on the terminal names what sets it apart (targeted, budget, success rule)."""
    out = tmp_path / "rob.csv"
    assert main(["robustness", str(results), "-o", str(out)]) == 0
    lines = [ln.split(": robust accuracy")[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")]
    assert len(lines) == len(set(lines)) == 8, lines  # the query groups (each with its copy)
    assert "  digits: digits_mlp (none) linf 0.1 targeted (least_likely) 60 queries" in lines
    runs = runs_below(results / "runs", results / "again")
    rows = read(tmp_path / "rob_worst_case.csv")
    # my own grouping: a query run by its images, target, defense and threat; a transfer run once per target
    groups = {}
    for d, (s, records, cfg) in runs.items():
        if s["family"] in ("score", "decision"):
            views = [(s["target_model"], s["defense"], s["budget"], s["success_rule"],
                      {r["index"]: (r["attacked"], r["success"]) for r in records},
                      bool(cfg.get("defense")))]  # RND; the surrogate of the prgf run is randomized, its target not
        elif s["family"] == "transfer":
            views = [(t, p["defense"], None, None,
                      {r["index"]: (r["attacked"] and r["targets"][t]["clean_correct"],
                                    r["attacked"] and r["targets"][t]["clean_correct"] and r["targets"][t]["success"])
                       for r in records}, p["defense"] != "none")
                     for t, p in s["per_target"].items()]
        else:
            continue
        for target, defense, budget, rule, per, randomized in views:
            key = (s["dataset"], target, defense, s["norm"], s["eps"], s["targeted"],
                   (cfg["threat"].get("target_label") or {}).get("name"), budget, rule)
            groups.setdefault(key, []).append((per, randomized))
    assert len(rows) == len(groups)
    for row in rows:
        key = (row["dataset"], row["target_model"], row["defense"], row["norm"], float(row["eps"]),
               row["targeted"] == "True", cell_value(row["target_label"]), cell_value(row["budget"]),
               cell_value(row["success_rule"]))
        members = groups[key]
        common = set.intersection(*(set(p) for p, _ in members))
        correct = [i for i in common if all(p[i][0] for p, _ in members)]
        robust = [i for i in correct if not any(p[i][1] for p, _ in members)]
        assert int(row["n"]) == len(common) and int(row["n_runs"]) == len(members)
        assert same(cell_value(row["robust_acc"]), len(robust) / len(common))
        assert same(cell_value(row["clean_acc"]), len(correct) / len(common))
        assert same(cell_value(row["robust_acc_low"]), wilson(len(robust), len(common))[0])
        assert cell_value(row["asr_any"]) == (None if not correct else
                                              pytest.approx((len(correct) - len(robust)) / len(correct)))
        fooled = [{i for i in correct if p[i][1]} for p, _ in members]
        only = [len(f - set().union(*(g for j, g in enumerate(fooled) if j != k))) for k, f in enumerate(fooled)]
        listed = row["only_fooled_by"].split("; ")
        assert len(set(m.rsplit(" ", 1)[0] for m in listed)) == len(members), row["only_fooled_by"]
        assert sorted(int(m.rsplit(" ", 1)[1]) for m in listed) == sorted(only), row["only_fooled_by"]
        best = max(len(f) for f in fooled)
        assert cell_value(row["best_asr"]) == (pytest.approx(best / len(correct)) if correct else None)
        assert len(row["runs"].split("; ")) == len(set(row["runs"].split("; "))) == len(members)
        assert (row["randomized"] == "True") == any(r for _, r in members), \
            f"{row['target_model']} ({row['defense']}): randomized {row['randomized']}"


def test_plots_of_nan_zero_and_single_runs(results, tmp_path, capsys):
    """Every AEV recipe draws the runs (NaN and None figures, zero successes, a single run) and writes its files;
    a figure no run has a number for is one line, never a traceback."""
    for recipe in ("aev_line", "aev_scatter", "aev_bar", "aev_bubble", "aev_heatmap"):
        out = tmp_path / f"{recipe}.png"
        assert main(["plot", str(results / "runs"), "-r", recipe, "-o", str(out)]) == 0, recipe
        assert out.stat().st_size > 0 and out.with_suffix(".csv").is_file()
    single = tmp_path / "single.png"
    assert main(["plot", str(results / "runs" / "q"), "-r", "aev_line", "--where", "name=square_none", "-o",
                 str(single)]) == 0 and single.is_file()
    line = read(single.with_suffix(".csv"))
    assert [(r["label"], r["mean"], r["n"]) for r in line] == [("square_none", "0.0", "1")]
    capsys.readouterr()
    assert main(["plot", str(results / "runs" / "q"), "-r", "aev_line", "--y", "aqn", "--where", "name=square_none",
                 "-o", str(tmp_path / "none.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    # a heatmap of query runs only (no surrogates, its default rows): the reason in one line, not a missing column
    assert main(["plot", str(results / "runs" / "q"), "-r", "aev_heatmap", "--where", "attack=rays", "-o",
                 str(tmp_path / "heat.png")]) == 2
    assert capsys.readouterr().err == ("error: no row has a value in 'surrogates', the heatmap's rows (a query run "
                                       "has no surrogates)\n")
    # a leaderboard CSV with NaN cells plots too
    board = tmp_path / "board.csv"
    assert main(["leaderboard", str(results / "runs"), "-o", str(board)]) == 0
    text = board.read_text().replace(",0.0,", ",nan,", 1)
    board.write_text(text)
    assert main(["plot", str(board), "-r", "aev_bar", "--y", "asr", "-o", str(tmp_path / "nan.png")]) == 0
    assert (tmp_path / "nan.png").is_file()


def test_an_older_result_folder_still_loads(results, tmp_path, capsys):
    """Summaries and records without the fields added later (metrics, name, budget, success rule, cascade,
    randomized models, dataset parameters; per-record SSIM, LPIPS, success rule, re-evaluation) still make every
    board and plot, or stop in one line."""
    old = tmp_path / "old"
    shutil.copytree(results / "runs" / "q", old / "q")
    shutil.copytree(results / "runs" / "t", old / "t")
    for s in old.rglob("summary.json"):
        data = json.loads(s.read_text())
        for k in ("metrics", "name", "budget", "success_rule", "cascade_after", "randomized_models",
                  "dataset_params", "trained_on", "mean_queries_all", "eot", "mean_ssim", "median_ssim"):
            data.pop(k, None)
        s.write_text(json.dumps(data))
        rec = s.parent / "records.jsonl"
        lines = [json.loads(x) for x in rec.read_text().splitlines()]
        for r in lines:
            for k in ("ssim", "lpips", "success_rule", "reeval_adv", "reeval_votes", "check"):
                r.pop(k, None)
        rec.write_text("".join(json.dumps(r) + "\n" for r in lines))
    for argv in (["leaderboard", str(old), "-o", str(tmp_path / "b.csv")],
                 ["robustness", str(old), "-o", str(tmp_path / "r.csv")],
                 ["plot", str(old), "-r", "aev_bar", "-o", str(tmp_path / "p.png")]):
        rc = main(argv)
        cap = capsys.readouterr()
        assert "Traceback" not in cap.err + cap.out
        assert rc == 0 or (rc == 2 and cap.err.count("\n") == 1), (argv[0], cap.err)
    assert len(read(tmp_path / "b.csv")) == 10


def test_a_randomized_target_is_told_from_its_neighbours():
    """The worst case's ``randomized``: the target itself, or behind its defenses (after an ``at`` tag), in the run's
    ``randomized_models``; never another target whose label starts alike, nor a surrogate."""
    from blackboxbench.worst_case import _randomized

    s = {"randomized_models": "digits_mlp+rnd+rnd(sigma=0.05), noisy_surrogate"}
    assert _randomized(s, "digits_mlp+rnd", "rnd(sigma=0.05)") == "digits_mlp+rnd"
    assert _randomized(s, "digits_mlp", "none") is None and _randomized(s, "digits_cnn", "none") is None
    at = {"randomized_models": "cifar_resnet4b_adv+rnd(sigma=0.02)"}
    assert _randomized(at, "cifar_resnet4b_adv", "at+rnd(sigma=0.02)") == "cifar_resnet4b_adv"
    assert _randomized({"randomized_models": "m"}, "m", "none") == "m" and _randomized({}, "m", "none") is None
