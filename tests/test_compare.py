"""Paired comparison of two runs (blackboxbench/compare.py, ``blackboxbench compare``): the exact sign test against
a reference from binomial coefficients, the paired counts against the records, query and transfer runs end to end,
and one-line errors for runs that do not pair."""
import json
import math
import shutil
from pathlib import Path

import pytest

from blackboxbench.cli import main
from blackboxbench.compare import compare_runs, format_comparison, paired_queries, paired_success
from blackboxbench.stats import sign_test_p


def _reference_p(k1, k2):
    n, k = k1 + k2, min(k1, k2)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


@pytest.mark.parametrize("k1,k2", [(0, 0), (0, 1), (0, 5), (3, 3), (1, 9), (9, 1), (12, 30), (56, 0), (400, 460)])
def test_sign_test_matches_binomial_coefficients(k1, k2):
    assert sign_test_p(k1, k2) == pytest.approx(_reference_p(k1, k2), rel=1e-9, abs=1e-300)


def test_paired_counts():
    s = paired_success([True, True, False, False, True], [True, False, True, False, False])
    assert (s["n"], s["a_only"], s["b_only"], s["asr_a"], s["asr_b"]) == (5, 2, 1, 0.6, 0.4)
    assert s["p"] == pytest.approx(_reference_p(2, 1))
    q = paired_queries([10, 20, 30, 40], [20, 20, 15, 400])
    assert (q["a_fewer"], q["b_fewer"], q["ties"], q["median_a"], q["median_b"]) == (2, 1, 1, 25, 20)
    assert q["median_ratio"] == 1.5  # ratios B / A: 2, 1, 0.5, 10
    assert paired_queries([], []) == {"n": 0}


def test_a_target_without_paired_samples_is_said_not_formatted():
    """A transfer target that misclassifies every paired sample when clean has no rates: its line says so, the
    other target's line carries the test."""
    rows = [{"target": "t1", "success": paired_success([], [])},
            {"target": "t2", "success": paired_success([True, False], [False, False])}]
    lines = format_comparison({"a": "x", "b": "y", "same": {}, "differs": {}, "rows": rows})
    assert lines[3] == "target t1: no sample that both runs attacked counts (the target misclassifies them clean)"
    assert lines[4].startswith("target t2: success on the 2 samples both attacked: ASR A 0.500, B 0.000")


def _run(tmp_path, text, name):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(text + f"output_dir: {tmp_path / name}\n")
    assert main(["run", str(cfg), "--quiet"]) == 0
    return sorted((tmp_path / name).iterdir())


def _records(run):
    return {r["index"]: r for r in map(json.loads, (Path(run) / "records.jsonl").read_text().splitlines())}


def test_compare_query_runs(tmp_path, capsys):
    runs = _run(tmp_path, "dataset: {name: digits, n: 30}\nmodel: digits_mlp\nthreat: {norm: linf, eps: 0.15, "
                "max_queries: 150}\nruns: [{attack: square_linf}, {attack: simba_pixel}]\n", "q")
    simba, square = runs  # sorted by directory name
    capsys.readouterr()
    assert main(["compare", str(square), str(simba), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ra, rb = _records(square), _records(simba)
    both = [i for i in ra if ra[i]["attacked"] and rb[i]["attacked"]]
    s = got["rows"][0]["success"]
    assert s["n"] == len(both) > 0
    assert s["a_only"] == sum(ra[i]["success"] and not rb[i]["success"] for i in both)
    assert s["b_only"] == sum(rb[i]["success"] and not ra[i]["success"] for i in both)
    fooled = [i for i in both if ra[i]["success"] and rb[i]["success"]]
    q = got["rows"][0]["queries"]
    assert q["n"] == len(fooled) > 0 and q["a_fewer"] == sum(ra[i]["queries"] < rb[i]["queries"] for i in fooled)
    assert got["same"]["eps"] == 0.15 and got["differs"] == {}
    # samples pair by index, not by their place in the file (records are written in the order samples finish)
    shuffled = tmp_path / "shuffled" / simba.name
    shutil.copytree(simba, shuffled)
    lines = (shuffled / "records.jsonl").read_text().splitlines()
    (shuffled / "records.jsonl").write_text("\n".join(lines[::-1]) + "\n")
    assert lines[0] != lines[-1] and compare_runs(square, shuffled)["rows"] == got["rows"]
    s_ab, s_ba = got["rows"][0]["success"], compare_runs(simba, square)["rows"][0]["success"]
    assert (s_ba["a_only"], s_ba["b_only"], s_ba["p"]) == (s_ab["b_only"], s_ab["a_only"], s_ab["p"])
    assert main(["compare", str(square), str(simba)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("A: square_linf") and any("McNemar exact p" in ln for ln in text)


def test_compare_transfer_runs_pairs_per_target(tmp_path):
    runs = _run(tmp_path, "dataset: {name: digits, n: 24}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp, "
                "digits_cnn]\nthreat: {norm: linf, eps: 0.15}\nruns: [{attack: i_fgsm}, {attack: mi_fgsm}]\n", "t")
    got = compare_runs(*runs)
    assert [r["target"] for r in got["rows"]] == ["digits_mlp", "digits_cnn"]
    ra, rb = _records(runs[0]), _records(runs[1])
    for row in got["rows"]:
        t = row["target"]
        valid = [i for i in ra if ra[i]["attacked"] and rb[i]["attacked"] and ra[i]["targets"][t]["clean_correct"]]
        assert row["success"]["n"] == len(valid)
        assert row["success"]["a_only"] == sum(ra[i]["targets"][t]["success"] and not rb[i]["targets"][t]["success"]
                                               for i in valid)
        assert "queries" not in row



def test_transfer_pairs_need_the_clean_check_of_both_runs(tmp_path):
    """Behind RND a transfer target's clean check is a draw of each run's own streams: two seeds disagree on some
    images. A pair counts only where both runs' checks passed, so A against B is B against A mirrored (before: A's
    check alone, 22 pairs one way and 20 the other, B "fooling" images its target had misclassified clean)."""
    runs = _run(tmp_path, "dataset: {name: digits, n: 24}\nsurrogates: [digits_cnn]\ntargets: [{name: digits_mlp, "
                "defense: {name: rnd, sigma: 0.25}}]\nthreat: {norm: linf, eps: 0.15}\nruns: [{attack: i_fgsm, "
                "seed: 0}, {attack: i_fgsm, name: i_fgsm_s1, seed: 1}]\n", "r")
    ra, rb = _records(runs[0]), _records(runs[1])
    t = "digits_mlp+rnd"
    ok = [i for i in ra if ra[i]["attacked"] and rb[i]["attacked"] and ra[i]["targets"][t]["clean_correct"]
          and rb[i]["targets"][t]["clean_correct"]]
    assert any(ra[i]["targets"][t]["clean_correct"] != rb[i]["targets"][t]["clean_correct"] for i in ra)
    ab, ba = (compare_runs(*r)["rows"][0]["success"] for r in (runs, runs[::-1]))
    assert ab["n"] == ba["n"] == len(ok)
    assert ab["a_only"] == sum(ra[i]["targets"][t]["success"] and not rb[i]["targets"][t]["success"] for i in ok)
    assert (ab["a_only"], ab["b_only"], ab["asr_a"]) == (ba["b_only"], ba["a_only"], ba["asr_b"])


def test_runs_that_do_not_pair_are_one_line_errors(tmp_path, capsys):
    (q,) = _run(tmp_path, "dataset: {name: digits, n: 6}\nmodel: digits_mlp\nattack: square_linf\n"
                "threat: {norm: linf, eps: 0.1, max_queries: 20}\n", "a")
    (t,) = _run(tmp_path, "dataset: {name: digits, n: 6}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]\n"
                "attack: i_fgsm\nthreat: {norm: linf, eps: 0.1}\n", "b")
    other = tmp_path / "c" / q.name  # the same run, said to be of another dataset
    shutil.copytree(q, other)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "dataset": "mnist"}))
    unfinished = tmp_path / "u" / "run"
    unfinished.mkdir(parents=True)
    (unfinished / "config.yaml").write_text("{}\n")
    capsys.readouterr()
    for a, b, message in [(q, t, "a score run and a transfer run: compare runs of the query families, two "
                                 "transfer runs or two detection runs"),
                          (q, unfinished, f"{unfinished}: unfinished (no summary.json); re-run its config to "
                                          "finish it"),
                          (q, tmp_path / "nope", f"not a run directory: {tmp_path / 'nope'}"),
                          (q, q.parent, f"not a run directory: {q.parent} (a results directory: give two of the run "
                                        "folders inside it)"),
                          (q, other, "the runs attack different datasets (digits, mnist): their samples do not "
                                     "pair")]:
        assert main(["compare", str(a), str(b)]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"


def test_compare_detection_runs_pairs_the_mAP_drop_per_target(tmp_path, capsys):
    """Two detection runs (TOG vanishing at 8/255 and 2/255) on the same 6 shapes: per target, each run's relative
    mAP drop equals its summary's, B - A is their difference with a paired bootstrap interval around it; the same
    run against itself differs by 0 in every resample; swapping the runs flips the sign."""
    from blackboxbench.compare import load_run
    from blackboxbench.detection.family import paired_drop

    dirs = []
    for name, eps in (("strong", "8/255"), ("weak", "2/255")):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"dataset: {{name: shapes, n: 6, seed: 0}}\nsurrogates: [shapes_fcos]\ntargets: [shapes_fcos]\n"
                       f"attack: tog_vanishing\nname: {name}\nthreat: {{eps: {eps}}}\ndevice: cpu\n"
                       f"output_dir: {tmp_path / 'out'}\n")
        assert main(["run", str(cfg), "--quiet"]) == 0
        dirs.append(next((tmp_path / "out").glob(f"{name}_*")))
    capsys.readouterr()
    result = compare_runs(*dirs)
    (row,) = result["rows"]
    summaries = [json.loads((d / "summary.json").read_text())["per_target"]["shapes_fcos"] for d in dirs]
    d = row["drop"]
    assert row["target"] == "shapes_fcos" and d["n"] == 6
    assert d["drop_a"] == pytest.approx(summaries[0]["drop_map"])
    assert d["drop_b"] == pytest.approx(summaries[1]["drop_map"])
    assert d["diff"] == pytest.approx(d["drop_b"] - d["drop_a"]) and d["low"] <= d["diff"] <= d["high"]
    assert result["differs"]["eps"] == (pytest.approx(8 / 255), pytest.approx(2 / 255))
    assert compare_runs(dirs[1], dirs[0])["rows"][0]["drop"]["diff"] == pytest.approx(-d["diff"])
    _, recs = load_run(dirs[0])
    same = paired_drop([(recs[i], recs[i]) for i in sorted(recs)], "shapes_fcos")
    assert (same["diff"], same["low"], same["high"]) == (0.0, 0.0, 0.0)
    assert main(["compare", str(dirs[0]), str(dirs[1])]) == 0
    out = capsys.readouterr().out
    assert "A: strong (" in out and "target shapes_fcos: relative mAP drop on the 6 images both attacked" in out
    # the detectors' post-processing is a setting that differs; other shapes images do not pair at all
    cfg = tmp_path / "weak.yaml"
    cfg.write_text(cfg.read_text().replace("{eps: 2/255}", "{eps: 2/255, score_thr: 0.6}"))
    assert main(["run", str(cfg), "--quiet"]) == 0
    (post,) = set((tmp_path / "out").glob("weak_*")) - set(dirs)
    assert compare_runs(dirs[1], post)["differs"] == {"threat.score_thr": (None, 0.6)}  # None: its own
    cfg.write_text(cfg.read_text().replace("seed: 0", "seed: 1"))
    assert main(["run", str(cfg), "--quiet"]) == 0
    (other,) = set((tmp_path / "out").glob("weak_*")) - set(dirs) - {post}
    capsys.readouterr()
    assert main(["compare", str(dirs[1]), str(other)]) == 2
    assert capsys.readouterr().err == ("error: the runs attack different images (dataset.seed 0 / 1): their samples "
                                       "do not pair\n")


def test_paired_queries_ties_means_and_medians():
    """Ties are left out of the sign test (not counted for either side); means, medians and the median ratio B / A
    on data where a mean and a median differ."""
    q = paired_queries([1, 1, 1, 1, 1, 1, 5, 5], [2, 2, 2, 2, 2, 2, 5, 5])
    assert (q["n"], q["a_fewer"], q["b_fewer"], q["ties"]) == (8, 6, 0, 2)
    assert q["p"] == pytest.approx(_reference_p(6, 0)) and q["p"] == pytest.approx(2 / 2 ** 6)
    assert (q["mean_a"], q["mean_b"], q["median_a"], q["median_b"]) == (2.0, 2.75, 1, 2)
    assert q["median_ratio"] == 2.0  # ratios B / A: six 2s, two 1s


def test_compare_pairs_only_the_samples_both_runs_attacked(monkeypatch):
    """A sample pairs when both runs recorded and attacked it: one that only B attacked (A's clean check failed) or
    only one run recorded stays out of the success counts and of the query pairs."""
    from blackboxbench import compare

    def rec(attacked, success, queries):
        return {"attacked": attacked, "success": success, "queries": queries}

    runs = {"a": ({"attack": "sa", "family": "score", "dataset": "digits", "asr": 0.5, "eps": 0.1, "seed": 0},
                  {0: rec(True, True, 10), 1: rec(True, False, 100), 2: rec(False, False, 0), 3: rec(True, True, 30),
                   5: rec(True, True, 3)}),
            "b": ({"attack": "sb", "family": "decision", "dataset": "digits", "asr": 0.5, "eps": 0.1, "seed": 1},
                  {0: rec(True, False, 100), 1: rec(True, True, 20), 2: rec(True, True, 7), 3: rec(True, True, 60),
                   4: rec(True, True, 1)})}
    monkeypatch.setattr(compare, "load_run", lambda d: runs[Path(d).name])
    got = compare_runs("nowhere/a", "nowhere/b")
    (row,) = got["rows"]
    assert got["same"]["eps"] == 0.1 and "seed" not in got["same"] and got["differs"]["seed"] == (0, 1)
    s, q = row["success"], row["queries"]
    assert (s["n"], s["a_only"], s["b_only"], s["asr_a"], s["asr_b"]) == (3, 1, 1, 2 / 3, 2 / 3)
    assert (q["n"], q["mean_a"], q["mean_b"]) == (1, 30, 60)  # sample 3, the one both fooled


def test_image_and_threat_differences():
    """Runs of different ``dataset.n`` still pair (the first images are the same), any other dataset parameter
    names other images; the threat keys that the settings line already shows are not listed again."""
    from blackboxbench.compare import image_difference, threat_differences

    a = {"dataset": {"name": "digits", "n": 20, "seed": 0}, "threat": {"eps": 0.1, "norm": "linf", "score_thr": 0.3}}
    b = {"dataset": {"name": "digits", "n": 30, "seed": 0}, "threat": {"eps": 0.2, "norm": "l2", "max_det": 5}}
    assert image_difference(a, b) == ""
    assert image_difference(a, {"dataset": {"name": "digits", "n": 20, "seed": 1}}) == "dataset.seed 0 / 1"
    assert threat_differences(a, b) == {"threat.max_det": (None, 5), "threat.score_thr": (0.3, None)}


def test_detection_line_says_which_run_drops_more():
    """The verdict of a detection row follows its paired interval of B - A: above 0, B drops more; below 0, A does;
    across 0, no difference shown."""
    def line(low, high):
        d = {"n": 6, "drop_a": 0.2, "drop_b": 0.3, "diff": (low + high) / 2, "low": low, "high": high}
        result = {"a": "x", "b": "y", "same": {}, "differs": {}, "rows": [{"target": "t", "drop": d}]}
        return format_comparison(result)[-1]

    assert line(0.05, 0.15).endswith("0.050 to 0.150 (B drops more)")
    assert line(-0.15, -0.05).endswith("(A drops more)")
    assert line(-0.05, 0.15).endswith("(no difference shown)")
