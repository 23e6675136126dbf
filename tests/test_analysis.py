"""The AEV analysis tools (line, scatter, bar, bubble, heatmap; BlackboxBench Tab. III): the aggregation against an
independent NumPy reference, per-target rows of transfer runs, the same rows from a results directory and from its
leaderboard CSV, every registered tool and every catalog recipe writing a PNG and its numbers, one-line errors, and
one end-to-end plot of real runs."""
import json
import math
import re

import numpy as np
import pytest

import blackboxbench  # noqa: F401  (registers the tools)
from blackboxbench import catalog
from blackboxbench.analysis.aev import _yerr, aggregate, load_rows, select, summary_rows
from blackboxbench.analysis.recipes import plot as run_recipe
from blackboxbench.cli import main
from blackboxbench.config import load_yaml
from blackboxbench.errors import BenchError
from blackboxbench.leaderboard import export_csv
from blackboxbench.plotting import read_csv
from blackboxbench.registry import ANALYSIS

PNG = b"\x89PNG\r\n\x1a\n"


def query_summary(run, attack, eps, asr, aqn, l2):
    return {"run": run, "attack": attack, "family": "score", "target_model": "m1", "surrogates": None,
            "norm": "linf", "eps": eps, "targeted": False, "asr": asr, "aqn": aqn, "mean_l2": l2, "n": 10}


def transfer_summary(run, attack, surrogate, per_target):
    return {"run": run, "attack": attack, "family": "transfer", "target_model": "+".join(per_target),
            "surrogates": surrogate, "norm": "linf", "eps": 0.03, "targeted": False, "n": 10, "mean_l2": 1.0,
            "asr": float(np.mean([v["asr"] for v in per_target.values()])), "aqn": None,
            "per_target": {t: {"asr": v["asr"], "clean_acc": 0.9, "n": 9, "defense": "none"}
                           for t, v in per_target.items()}}


SUMMARIES = [
    query_summary("q1", "square", 0.01, 0.4, 300.0, 0.5),
    query_summary("q2", "square", 0.03, 0.9, 120.0, 1.1),
    query_summary("q3", "nes", 0.01, 0.2, 900.0, 0.4),
    query_summary("q4", "nes", 0.03, 0.7, 400.0, 1.0),
    query_summary("q5", "nes", 0.03, 0.8, 350.0, 1.2),  # a second seed: aggregated with q4
    transfer_summary("t1", "i_fgsm", "r20", {"r32": {"asr": 0.8}, "r44": {"asr": 0.6}}),
    transfer_summary("t2", "mi_fgsm", "r20", {"r32": {"asr": 0.9}, "r44": {"asr": 0.7}}),
    transfer_summary("t3", "mi_fgsm", "r32", {"r20": {"asr": 0.5}, "r44": {"asr": 0.3}}),
]


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    for s in SUMMARIES:
        d = root / s["run"]
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(s))
    return root


def test_aggregate_against_numpy():
    rows = [{"a": "p", "x": 2, "y": 1.0}, {"a": "p", "x": 1, "y": 2.0}, {"a": "p", "x": 2, "y": 4.0},
            {"a": "q", "x": 1, "y": 3.0}, {"a": "q", "x": 1, "y": 5.0}, {"a": "q", "x": 1, "y": 10.0},
            {"a": "q", "x": 2, "y": None}, {"a": "q", "x": 2, "y": float("nan")}, {"a": "q", "x": 2, "y": True},
            {"a": "q", "x": None, "y": 7.0}, {"a": "q", "y": 8.0}]
    got = aggregate(rows, "x", "y", "a")
    assert [(r["hue"], r["x"]) for r in got] == [("p", 1), ("p", 2), ("q", 1)]  # x ascending; no number, no group
    ref = {("p", 1): [2.0], ("p", 2): [1.0, 4.0], ("q", 1): [3.0, 5.0, 10.0]}
    for r in got:
        v = np.array(ref[(r["hue"], r["x"])])
        assert r["n"] == len(v) and math.isclose(r["mean"], v.mean())
        assert math.isclose(r["std"], v.std(ddof=1) if len(v) > 1 else 0.0)
    text = aggregate([{"x": "b", "y": 1}, {"x": "a", "y": 2}], "x", "y")
    assert [r["x"] for r in text] == ["b", "a"]  # text in order of first appearance
    with pytest.raises(BenchError, match="no row has a number in 'y'"):
        aggregate([{"x": 1, "y": None}], "x", "y")


def test_error_bars_are_std_or_one_run_s_interval():
    """Several runs at a point: mean -+ std; one run whose summary gives the interval of y: that interval (and a
    run without one, 0 wide); the bars drawn are never negative."""
    rows = [{"x": 1, "y": 0.6, "y_low": 0.5, "y_high": 0.7}, {"x": 1, "y": 0.8, "y_low": 0.7, "y_high": 0.9},
            {"x": 2, "y": 0.4, "y_low": 0.3, "y_high": 0.55}, {"x": 3, "y": 0.2, "y_low": None, "y_high": 0.3}]
    got = aggregate(rows, "x", "y")
    std = np.std([0.6, 0.8], ddof=1)
    assert [v for r in got for v in (r["low"], r["high"])] == pytest.approx([0.7 - std, 0.7 + std, 0.3, 0.55, 0.2,
                                                                             0.2])
    assert np.allclose(_yerr(got[1:2]), [[0.1], [0.15]])
    bars = _yerr([{"mean": 0.5, "low": 0.6, "high": 0.4}, {"mean": 0.5, "low": None, "high": 0.7}])
    assert np.allclose(bars, [[0.0, 0.0], [0.0, 0.2]])  # wrong side or missing: no bar on that side


def test_read_csv_reads_cells_back_as_the_library_wrote_them(tmp_path):
    """A cell the leaderboard wrote reads back as its value: numbers as numbers, True / False as booleans, empty as
    None, a formula-guarded text without its leading quote, and JSON that is not a number (a list, a quoted string,
    null) as the text it is."""
    path = tmp_path / "t.csv"
    path.write_text("a,b,c,d,e,f,g,h\n3,0.5,True,,'=cmd,\"[1, 2]\",\"\"\"q\"\"\",null\n", encoding="utf-8")
    (row,) = read_csv(path)
    assert row == {"a": 3, "b": 0.5, "c": True, "d": None, "e": "=cmd", "f": "[1, 2]", "g": '"q"', "h": "null"}
    assert isinstance(row["a"], int) and row["c"] is True


def test_text_cells_round_trip_through_the_csv(tmp_path):
    """Text the library writes reads back unchanged, a leading quote included: the guard quotes a formula-like text
    and a text that itself starts with a quote, and the reader takes one quote off (a spreadsheet shows both as
    written)."""
    from blackboxbench.leaderboard import cell, to_csv

    texts = ["=cmd", "-1 run", "'quoted", "''twice", "plain", "it's"]
    path = tmp_path / "t.csv"
    path.write_text(to_csv([{f"c{i}": t for i, t in enumerate(texts)}], [f"c{i}" for i in range(len(texts))]),
                    encoding="utf-8")
    (row,) = read_csv(path)
    assert list(row.values()) == texts
    assert cell("'quoted") == "''quoted" and cell("plain") == "plain"


def test_lists_and_mappings_group_by_their_json_text():
    rows = [{"x": ["a", "b"], "y": 1.0}, {"x": ["a", "b"], "y": 3.0}, {"x": {"k": 1}, "y": 5.0}]
    got = aggregate(rows, "x", "y")
    assert [(r["x"], r["mean"], r["n"]) for r in got] == [('["a", "b"]', 2.0, 2), ('{"k": 1}', 5.0, 1)]


def test_transfer_runs_give_one_row_per_target():
    rows = summary_rows(SUMMARIES)
    t1 = [r for r in rows if r["run"] == "t1"]
    assert [(r["target_model"], r["asr"]) for r in t1] == [("r32", 0.8), ("r44", 0.6)]
    assert all("per_target" not in r and r["surrogates"] == "r20" for r in t1)
    assert [r["asr"] for r in rows if r["run"] == "q2"] == [0.9]


def test_results_directory_and_its_leaderboard_agree(results, tmp_path):
    export_csv(results, tmp_path / "board.csv")
    from_csv, skipped = load_rows(tmp_path / "board.csv")
    from_dir, _ = load_rows(results)
    assert skipped == []
    for run in ("q1", "q2", "q3", "q4", "q5"):
        (a,), (b,) = [r for r in from_csv if r["run"] == run], [r for r in from_dir if r["run"] == run]
        assert {k: a[k] for k in ("attack", "eps", "asr", "aqn", "targeted")} == \
               {k: b[k] for k in ("attack", "eps", "asr", "aqn", "targeted")}
    assert isinstance(from_csv[0]["eps"], float) and from_csv[0]["targeted"] is False


def test_select_numbers_text_and_lists():
    rows = summary_rows(SUMMARIES)
    assert {r["run"] for r in select(rows, {"eps": 0.03, "family": "score"})} == {"q2", "q4", "q5"}
    assert {r["run"] for r in select(rows, {"attack": ["square", "i_fgsm"]})} == {"q1", "q2", "t1"}
    with pytest.raises(BenchError, match="no column 'atack' in the results .did you mean: attack"):
        select(rows, {"atack": "nes"})
    # a number matches within rounding (0.1 + 0.2 is not 0.3 in floats), not a different number
    eps = [{"run": "a", "eps": 0.3}, {"run": "b", "eps": 0.3 * (1 + 1e-5)}]
    assert 0.1 + 0.2 != 0.3 and [r["run"] for r in select(eps, {"eps": 0.1 + 0.2})] == ["a"]


RESULT_TOOLS = [n for n in ANALYSIS.names() if ANALYSIS.get(n).registry_meta.get("inputs", "results") == "results"]
RECIPES = sorted(n for n, p in catalog.entries("analysis").items() if load_yaml(p)["tool"] in RESULT_TOOLS)
TOOL_PARAMS = {"aev_line": {"x": "eps", "y": "asr", "hue": "label"},
               "aev_bar": {"x": "target_model", "y": "asr", "hue": "label"},
               "aev_scatter": {"x": "aqn", "y": "asr", "hue": "label"},
               "aev_bubble": {"x": "aqn", "y": "asr", "size": "mean_l2", "hue": "label"},
               "aev_heatmap": {"x": "target_model", "y": "asr", "hue": "surrogates"}}


def test_every_tool_has_a_recipe_and_test_parameters():
    tools = sorted(load_yaml(p)["tool"] for p in catalog.entries("analysis").values())
    assert tools == ANALYSIS.names()  # one recipe per tool, results and model tools alike
    assert sorted(TOOL_PARAMS) == RESULT_TOOLS == sorted(load_yaml(catalog.find(n, "analysis"))["tool"]
                                                          for n in RECIPES)


@pytest.mark.parametrize("name", RESULT_TOOLS)
def test_every_tool_writes_its_figure_and_numbers(name, results, tmp_path):
    rows, _ = load_rows(results)
    header, body, draw = ANALYSIS.get(name)(rows, **TOOL_PARAMS[name])
    assert body and all(len(line) == len(header) for line in body)
    path = draw(tmp_path / f"{name}.png", name)
    assert path.read_bytes()[:8] == PNG


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_runs_on_a_results_directory(recipe, results, tmp_path):
    where = {"family": "transfer"} if recipe == "aev_heatmap" else {"family": "score"}
    png, table, n, _ = run_recipe(recipe, results, tmp_path / "out" / recipe, where=where)
    assert png.read_bytes()[:8] == PNG and n > 0
    header = table.read_text().splitlines()[0].split(",")
    params = load_yaml(catalog.find(recipe, "analysis"))["params"]
    assert params["x"] in header[0] + " " + " ".join(header)


def test_line_numbers(results, tmp_path):
    _, table, _, _ = run_recipe("aev_line", results, tmp_path / "line", where={"family": "score"})
    got = read_csv(table)
    assert [(r["label"], r["eps"], r["n"]) for r in got] == [
        ("square", 0.01, 1), ("square", 0.03, 1), ("nes", 0.01, 1), ("nes", 0.03, 2)]
    assert math.isclose(got[3]["mean"], 0.75) and math.isclose(got[3]["std"], np.std([0.7, 0.8], ddof=1))


def test_given_where_overrides_the_recipe_s_and_the_table_is_formula_guarded(results, tmp_path):
    """A ``where`` given to plot overrides the same key of the recipe's own ``where`` (the recipe's other keys
    still apply); a text cell of the numbers CSV that a spreadsheet would run as a formula gets a leading quote."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\ntool: aev_line\npaper: p\nparams: {x: eps, y: asr, hue: label}\n"
                      "where: {eps: 0.03, attack: square}\n")
    _, table, used, _ = run_recipe(str(recipe), results, tmp_path / "line", where={"attack": "nes"})
    assert used == 2 and [(r["label"], r["eps"]) for r in read_csv(table)] == [("nes", 0.03)]  # q4, q5
    s = {**query_summary("q7", "=cmd()", 0.03, 0.5, 10.0, 1.0)}
    (results / "q7").mkdir()
    (results / "q7" / "summary.json").write_text(json.dumps(s))
    _, table, _, _ = run_recipe(str(recipe), results, tmp_path / "line2", where={"attack": "=cmd()"})
    assert table.read_text(encoding="utf-8").splitlines()[1].startswith("'=cmd()")


@pytest.mark.parametrize("source", ["dir", "csv"])
def test_default_hue_keeps_named_configs_of_one_attack_apart(results, tmp_path, source):
    """Two configs of one attack under different names (``name``) are two lines by default, from a results
    directory and from a leaderboard CSV alike; a run without a name keeps its attack as its label."""
    s = {**query_summary("q6", "nes", 0.03, 0.1, 800.0, 1.0), "name": "nes_small_step"}
    (results / "q6").mkdir()
    (results / "q6" / "summary.json").write_text(json.dumps(s))
    src = results
    if source == "csv":
        src = tmp_path / "lb.csv"
        assert main(["leaderboard", str(results), "-o", str(src)]) == 0
    _, table, _, _ = run_recipe("aev_line", src, tmp_path / "line", where={"family": "score"})
    got = [(r["label"], r["eps"], r["n"]) for r in read_csv(table)]
    assert ("nes", 0.03, 2) in got and ("nes_small_step", 0.03, 1) in got, got


def test_heatmap_gray_cells_and_average(results, tmp_path):
    _, table, _, _ = run_recipe("aev_heatmap", results, tmp_path / "heat", where={"attack": "mi_fgsm"})
    got = {r["surrogates \\ target_model"]: r for r in read_csv(table)}
    assert list(got["r20"]) == ["surrogates \\ target_model", "r32", "r44", "r20", "average"]
    assert got["r20"]["r20"] is None and got["r32"]["r32"] is None  # a missing combination stays empty (gray)
    assert math.isclose(got["r20"]["average"], 0.8) and math.isclose(got["r32"]["average"], 0.4)
    _, table, _, _ = run_recipe("aev_heatmap", results, tmp_path / "all")  # query runs too: no surrogate, no row
    assert [r["surrogates \\ target_model"] for r in read_csv(table)] == ["r20", "r32"]


# a hand-made leaderboard of transfer ASRs: models ra, rb of family R and va of family V; (rb, rb) has two runs
FAMILY_ROWS = [{"surrogates": s, "target_model": t, "asr": a, "label": f"atk_{s}"}
               for s, t, a in [("ra", "ra", 1.0), ("ra", "rb", 0.6), ("ra", "va", 0.2), ("rb", "ra", 0.8),
                               ("rb", "rb", 1.0), ("rb", "rb", 0.9), ("rb", "va", 0.3), ("va", "ra", 0.1),
                               ("va", "va", 0.9)]]


def test_heatmap_averaged_per_model_family():
    """Figs. 14 and 33, second row: the mean of each (surrogate family, target family) block of the ASR matrix,
    by hand. The cells, each the mean of its runs: ra: 1.0 0.6 0.2 / rb: 0.8 0.95 0.3 / va: 0.1 - 0.9."""
    heat = ANALYSIS.get("aev_heatmap")
    fam = {"ra": "R", "rb": "R", "va": "V"}
    header, body, _ = heat(FAMILY_ROWS, x="target_model", y="asr", hue="surrogates", families=fam)
    assert header == ["surrogates \\ target_model, averaged per family", "R", "V", "average"]
    want = {"R": [(1.0 + 0.6 + 0.8 + 0.95) / 4, (0.2 + 0.3) / 2], "V": [0.1, 0.9]}  # cells, not runs: R-R not 0.86
    for line in body:
        assert line[1:] == pytest.approx(want[line[0]] + [np.mean(want[line[0]])])
    assert [line[0] for line in body] == ["R", "V"]
    _, body, _ = heat(FAMILY_ROWS, x="target_model", y="asr", hue="surrogates", families=fam, self_pairs=False,
                      average=False)
    assert body == [["R", pytest.approx((0.6 + 0.8) / 2), pytest.approx(0.25)], ["V", pytest.approx(0.1), None]]
    _, body, _ = heat(FAMILY_ROWS, x="target_model", y="asr", hue="surrogates", families={"va": "V"},
                      average=False)  # a value the mapping leaves out stays a group of its own
    assert [line[0] for line in body] == ["ra", "rb", "V"] and body[2][1:] == [0.1, None, 0.9]


def test_heatmap_rows_averaged_per_column_family():
    """``families`` naming a column (an attack's category): the attacks' rows averaged per category, columns kept."""
    rows = [{**r, "category": "gradient" if r["surrogates"] in ("ra", "rb") else "input"} for r in FAMILY_ROWS]
    header, body, _ = ANALYSIS.get("aev_heatmap")(rows, x="target_model", y="asr", hue="label", families="category",
                                                  average=False)
    assert header[1:] == ["ra", "rb", "va"]
    assert body == [["gradient", pytest.approx(0.9), pytest.approx((0.6 + 0.95) / 2), pytest.approx(0.25)],
                    ["input", pytest.approx(0.1), None, pytest.approx(0.9)]]
    rows[0]["category"] = "other"
    with pytest.raises(BenchError, match="families: the runs of label 'atk_ra' have several values in column "
                                         "'category' .gradient, other."):
        ANALYSIS.get("aev_heatmap")(rows, x="target_model", y="asr", hue="label", families="category")


@pytest.mark.parametrize("families,message", [
    ({"ra": "R", "rc": "R"}, "families: 'rc' is no value of surrogates or target_model in these results"),
    (["ra", "rb"], "families: expected a mapping {value of surrogates or target_model: family name}"),
    ({"ra": 3}, "families: expected a mapping"),
    ({}, "families: expected a mapping"),
    ("categry", "no column 'categry' in the results"),
])
def test_heatmap_families_errors(families, message):
    with pytest.raises(BenchError, match=re.escape(message)):
        ANALYSIS.get("aev_heatmap")(FAMILY_ROWS, x="target_model", y="asr", hue="surrogates", families=families)


def test_heatmap_families_from_the_command_line(tmp_path):
    board = tmp_path / "board.csv"
    keys = ["surrogates", "target_model", "asr", "label"]
    board.write_text("\n".join([",".join(keys)] + [",".join(str(r[k]) for k in keys) for r in FAMILY_ROWS]) + "\n")
    assert main(["plot", str(board), "-r", "aev_heatmap", "--param", "families={ra: R, rb: R, va: V}",
                 "-o", str(tmp_path / "fam.png")]) == 0
    got = {r["surrogates \\ target_model, averaged per family"]: r for r in read_csv(tmp_path / "fam.csv")}
    assert got["V"]["R"] == pytest.approx(0.1) and got["R"]["average"] == pytest.approx((0.8375 + 0.25) / 2)
    assert (tmp_path / "fam.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("args,message", [
    (["-r", "aev_line", "--y", "asrr"], "no column 'asrr' in the results (did you mean: asr"),
    (["-r", "aev_lin"], "unknown analysis recipe 'aev_lin' (did you mean: aev_line"),
    (["-r", "aev_line", "--param", "colour=red"], "params.colour: unknown parameter of block 'aev_line'"),
    (["-r", "aev_line", "--where", "eps=0.5"], "matches where {'eps': 0.5}"),
    (["-r", "aev_line", "--where", "eps"], "--where expects key=value"),
    (["-r", "aev_line", "--where", "nrom=linf"], "command line (--where):nrom: no column 'nrom' in the results (did "
                                                 "you mean: norm"),
    (["-r", "aev_bubble", "--size", "attack"], "no row has numbers in all of 'aqn', 'asr', 'attack'"),
])
def test_cli_errors_are_one_line(results, tmp_path, capsys, args, message):
    assert main(["plot", str(results), "-o", str(tmp_path / "p.png"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "p.png").exists()


def test_cli_missing_results_and_bad_recipe_file(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nothing"), "-r", "aev_line"]) == 2
    assert "results not found" in capsys.readouterr().err
    bad = tmp_path / "mine.yaml"
    bad.write_text("name: mine\ntool: aev_line\npaper: p\nparams: {x: eps, y: asr}\ncolour: red\n")
    assert main(["plot", str(tmp_path), "-r", str(bad)]) == 2
    assert "mine.yaml:colour: unknown key" in capsys.readouterr().err
    config = tmp_path / "config.yaml"  # a config given where the results go: its lines are not a CSV's rows
    config.write_text("# a comment line as the header\nruns:\n  - {attack: rays, model: m}\n")
    assert main(["plot", str(config), "-r", "aev_line"]) == 2
    assert capsys.readouterr().err == (f"error: {config}: line 3 has more cells than the header's 1: not a "
                                       "leaderboard or report CSV\n")
    bad.write_text("name: mine\ntool: aev_lines\npaper: p\n")
    assert main(["plot", str(tmp_path), "-r", str(bad)]) == 2
    assert "mine.yaml:tool: unknown analysis 'aev_lines' (did you mean: aev_line" in capsys.readouterr().err


def test_cli_where_reads_arithmetic(results, tmp_path, capsys):
    assert main(["plot", str(results), "-r", "aev_bar", "--x", "attack", "--where", "eps=3/100",
                 "--where", "family=score", "-o", str(tmp_path / "bar.png")]) == 0
    assert "(3 result rows)" in capsys.readouterr().out
    assert [r["attack"] for r in read_csv(tmp_path / "bar.csv")] == ["square", "nes"]


def test_plot_of_real_runs(tmp_path, capsys):
    """Two eps of one attack on the embedded digits with a ``plots:`` entry, then the same recipe from the command
    line on the results directory."""
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 8}}\noutput_dir: {tmp_path / 'results'}\nmodel: digits_mlp\n"
                   "attack: square_linf\nruns:\n  - threat: {norm: linf, eps: 0.1, max_queries: 200}\n"
                   "  - threat: {norm: linf, eps: 0.3, max_queries: 200}\n"
                   f"plots:\n  - {{recipe: aev_line, output: {tmp_path / 'cfg_line.png'}, where: {{norm: linf}}}}\n")
    assert main(["run", str(cfg), "--quiet"]) == 0
    asr = {s["eps"]: s["asr"] for s in map(json.loads, (p.read_text() for p in
                                                         (tmp_path / "results").rglob("summary.json")))}
    assert main(["plot", str(tmp_path / "results"), "-r", "aev_line", "-o", str(tmp_path / "line.png")]) == 0
    for name in ("line", "cfg_line"):
        got = read_csv(tmp_path / f"{name}.csv")
        assert [(r["label"], r["eps"], r["mean"]) for r in got] == [("square_linf", e, asr[e]) for e in (0.1, 0.3)]
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("entry,message", [
    ("{recipe: aev_lines, output: a.png}", "plots[0].recipe: unknown analysis recipe 'aev_lines'"),
    ("{recipe: aev_line, output: a.png, params: {colour: red}}", "plots[0].params.colour: unknown parameter"),
    ("{recipe: fullgrad, output: a.png}", "tool 'fullgrad' reads model, not results"),
    ("{recipe: aev_line, outputs: a.png}", "plots[0].outputs: unknown key (did you mean: output?)"),
    ("{recipe: aev_line}", "plots[0].output: required: a string"),
    ("aev_line", "plots[0]: must be a mapping"),
])
def test_config_plots_are_checked_before_any_run(tmp_path, capsys, entry, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 4}}\noutput_dir: {tmp_path / 'results'}\nmodel: digits_mlp\n"
                   f"attack: square_linf\nplots: [{entry}]\n")
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("command,inputs", [("plot", "results"), ("analyze", "model")])
def test_help_names_every_recipe_of_its_command(capsys, command, inputs):
    """`blackboxbench plot --help` / `analyze --help` name every catalog recipe whose tool reads their inputs."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = [n for n, p in catalog.entries("analysis").items()
             if ANALYSIS.get(load_yaml(p)["tool"]).registry_meta.get("inputs", "results") == inputs]
    assert names and all(n in text for n in names), (names, text)
