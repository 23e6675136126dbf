"""Leaderboard export from hand-written run directories: bad runs are skipped with a one-line reason (never a
traceback, never the end of the export), rows are sorted best first with non-finite values last, and text cells
are guarded against spreadsheet formulas."""
import csv
import json

import pytest

import blackboxbench  # noqa: F401  (registers the families, hence the columns)
from blackboxbench.cli import main
from blackboxbench.errors import BenchError
from blackboxbench.leaderboard import UNFINISHED, columns, export_csv, sort_key

TRUNCATED = '{\n  "attack": "square",\n  "family": "score",\n  "asr": '


def summary(run, asr, aqn=None, attack="square", family="score", **kw):
    return {"run": run, "attack": attack, "family": family, "asr": asr, "aqn": aqn, "n": 10, "eps": 0.05,
            "targeted": False, "norm": "linf", **kw}


def make_run(root, name, content=None, records=True):
    """A run directory: config.yaml, records.jsonl (unless ``records`` is False) and, unless ``content`` is
    None, a summary.json (a dict or list is written as JSON, str as text, bytes as they are)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("attack: square\n")
    if records:
        (d / "records.jsonl").write_text('{"index": 0}\n')
    if content is not None:
        data = content if isinstance(content, (str, bytes)) else json.dumps(content)
        (d / "summary.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    return d


GOOD = {  # run name -> summary; expected order: asr high first, aqn low first (missing last), run name
    "g_best": summary("g_best", 1.0, 200.0),
    "f_fast": summary("f_fast", 0.9, 50.0),
    "e_slow": summary("e_slow", 0.9, 120.0),
    "d_noaqn": summary("d_noaqn", 0.9, None),
    "c_nanaqn": summary("c_nanaqn", 0.9, float("nan")),
    "b_low": summary("b_low", 0.25, 10.0, family="transfer", surrogates="digits_cnn"),
    "a_nan": summary("a_nan", float("nan"), 1.0),
    "h_inf": summary("h_inf", float("inf"), 1.0),
    "i_null": summary("i_null", None, None),
}
ORDER = ["g_best", "f_fast", "e_slow", "c_nanaqn", "d_noaqn", "b_low", "a_nan", "h_inf", "i_null"]

BAD = {  # run name -> (summary.json content or None, reason; one ending in "..." is the reason's start)
    "x_truncated": (TRUNCATED, "summary.json is not valid JSON (line 4)"),
    "x_empty": ("", "summary.json is not valid JSON (line 1)"),
    "x_list": ([summary("x", 0.5)], "summary.json holds a list, not an object"),
    "x_number": (3.5, "summary.json holds a number, not an object"),
    "x_string": ("\"done\"", "summary.json holds a string, not an object"),
    "x_latin1": ('{"attack": "caf\xe9", "family": "score", "asr": 0.5}'.encode("latin-1"),
                 "summary.json is not UTF-8 text (byte 15)"),
    "x_surrogate": ('{"attack": "\\ud800", "family": "score", "asr": 0.5}',
                    "summary.json holds an unpaired surrogate escape (\\ud800)"),
    "x_deep": ("[" * 100000 + "]" * 100000, "summary.json is not valid JSON (maximum recursion depth ..."),
    "x_bigint": ('{"attack": "a", "family": "score", "asr": 1' + "0" * 5000 + "}",
                 "summary.json is not valid JSON (Exceeds the limit ..."),
    "x_strasr": (summary("x", "0.9"), "summary.json: asr is a string, not a number or null"),
    "x_boolasr": (summary("x", True), "summary.json: asr is a boolean, not a number or null"),
    "x_listasr": (summary("x", [0.9]), "summary.json: asr is a list, not a number or null"),
    "x_numattack": (summary("x", 0.9, attack=7), "summary.json: attack is a number, not a string"),
    "x_missing": ({"run": "x", "asr": 0.5, "aqn": 3}, "summary.json lacks attack, family"),
    "x_noasr": ({"attack": "square", "family": "score"}, "summary.json lacks asr"),
    "x_killed": (None, UNFINISHED),
}


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    for name, s in GOOD.items():
        make_run(root, name, s)
    for name, (content, _) in BAD.items():
        make_run(root, name, content)
    make_run(root, "x_configonly", records=False)  # killed before its first record
    (root / "x_recordsonly").mkdir()  # killed after a resume wiped its config? only records remain
    (root / "x_recordsonly" / "records.jsonl").write_text('{"index": 0}\n')
    (root / "notes").mkdir()  # not a run directory: ignored
    (root / "notes" / "README.txt").write_text("hand-written notes\n")
    return root


def read_csv(path):
    return list(csv.DictReader(path.open(newline="", encoding="utf-8")))


def test_export_keeps_every_good_run_and_lists_every_bad_one(results, tmp_path):
    out = tmp_path / "board" / "lb.csv"
    rows, skipped = export_csv(results, out)
    assert [r["run"] for r in rows] == ORDER
    assert [r["run"] for r in read_csv(out)] == ORDER
    reasons = {s.run.name: s.reason for s in skipped}
    expected = {name: reason for name, (_, reason) in BAD.items()}
    expected.update(x_configonly=UNFINISHED, x_recordsonly=UNFINISHED)
    assert sorted(reasons) == sorted(expected)
    for name, reason in expected.items():
        assert reasons[name].startswith(reason[:-3]) if reason.endswith("...") else reasons[name] == reason
    assert str(skipped[0]) == f"skipped {results / skipped[0].run.name}: {skipped[0].reason}"
    assert all("\n" not in str(s) for s in skipped)


def test_csv_values(results, tmp_path):
    out = tmp_path / "lb.csv"
    export_csv(results, out)
    rows = {r["run"]: r for r in read_csv(out)}
    assert list(rows["g_best"]) == [c for c, _ in columns()]
    assert float(rows["f_fast"]["asr"]) == 0.9 and float(rows["f_fast"]["aqn"]) == 50.0
    assert rows["d_noaqn"]["aqn"] == "" and rows["i_null"]["asr"] == ""  # missing values: empty cells
    assert rows["a_nan"]["asr"] == "nan" and rows["h_inf"]["asr"] == "inf"
    assert rows["b_low"]["family"] == "transfer" and rows["b_low"]["surrogates"] == "digits_cnn"
    assert rows["g_best"]["targeted"] == "False" and rows["g_best"]["eps"] == "0.05"


def test_nan_asr_never_sorts_first():
    d = dict(columns())
    rows = [summary("z", 0.1), summary("nan", float("nan")), summary("inf", float("inf")),
            summary("-inf", float("-inf")), summary("none", None), {"run": "absent"}, summary("bool", True),
            summary("a", 0.1, 5), summary("zero", 0)]
    assert [r["run"] for r in sorted(rows, key=lambda r: sort_key(r, d))] == \
        ["a", "z", "zero", "-inf", "absent", "bool", "inf", "nan", "none"]


def test_sort_follows_declared_directions():
    d = dict(columns())
    assert (d["asr"], d["aqn"]) == ("higher", "lower")
    rows = [summary("r1", 0.5, 10), summary("r2", 0.5, 5), summary("r3", 0.6, 1000)]
    assert [r["run"] for r in sorted(rows, key=lambda r: sort_key(r, d))] == ["r3", "r2", "r1"]
    flipped = {"asr": "lower", "aqn": "higher"}
    assert [r["run"] for r in sorted(rows, key=lambda r: sort_key(r, flipped))] == ["r1", "r2", "r3"]


@pytest.mark.parametrize("text", ["=HYPERLINK(\"http://evil\",\"x\")", "+1+2", "-2+3", "@SUM(A1)", "\tx=1",
                                  "\rcmd"])
def test_formula_guard(tmp_path, text):
    make_run(tmp_path / "res", "r", summary("r", 0.5, attack=text, surrogates=text))
    out = tmp_path / "lb.csv"
    export_csv(tmp_path / "res", out)
    (row,) = read_csv(out)
    assert row["attack"] == "'" + text and row["surrogates"] == "'" + text


def test_numbers_stay_numbers(tmp_path):
    make_run(tmp_path / "res", "r", summary("r", 0.5, aqn=-0.5, eps=-2, attack="-0.5", targeted=True,
                                            dataset="a=b"))
    out = tmp_path / "lb.csv"
    export_csv(tmp_path / "res", out)
    (row,) = read_csv(out)
    assert row["aqn"] == "-0.5" and row["eps"] == "-2"  # numbers: no quote
    assert row["attack"] == "'-0.5"  # text that looks like a formula: quoted
    assert row["targeted"] == "True" and row["dataset"] == "a=b"
    raw = out.read_text().splitlines()[1]
    assert ",-0.5," in raw and ",-2," in raw


def test_overlapping_roots_count_each_run_once(results, tmp_path):
    make_run(results / "sub", "nested", summary("nested", 0.7))
    rows, skipped = export_csv([results, results / "sub"], tmp_path / "lb.csv")
    assert sorted(r["run"] for r in rows) == sorted([*ORDER, "nested"])
    assert len(skipped) == len(BAD) + 2


def test_run_name_defaults_to_directory(tmp_path):
    s = summary(None, 0.5)
    del s["run"]
    make_run(tmp_path / "res", "named_by_dir", s)
    rows, _ = export_csv(tmp_path / "res", tmp_path / "lb.csv")
    assert rows[0]["run"] == "named_by_dir" and read_csv(tmp_path / "lb.csv")[0]["run"] == "named_by_dir"


def test_missing_and_empty_results(tmp_path):
    with pytest.raises(BenchError, match="results directory not found"):
        export_csv(tmp_path / "nope", tmp_path / "lb.csv")
    (tmp_path / "file").write_text("x")
    with pytest.raises(BenchError, match="results directory is not a directory"):
        export_csv(tmp_path / "file", tmp_path / "lb.csv")
    (tmp_path / "empty").mkdir()
    rows, skipped = export_csv(tmp_path / "empty", tmp_path / "lb.csv")
    assert rows == [] and skipped == []
    assert (tmp_path / "lb.csv").read_text().splitlines() == [",".join(c for c, _ in columns())]


def test_cli_lists_skipped_runs_and_exits_0(results, tmp_path, capsys):
    out = tmp_path / "lb.csv"
    assert main(["leaderboard", str(results), "-o", str(out)]) == 0
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == len(BAD) + 2 and all(line.startswith(f"skipped {results}/") for line in lines)
    assert f"skipped {results / 'x_truncated'}: summary.json is not valid JSON (line 4)" in lines
    assert f"skipped {results / 'x_killed'}: {UNFINISHED}" in lines
    assert "Traceback" not in cap.err + cap.out
    assert f"leaderboard: {out} ({len(ORDER)} runs)" in cap.out
    assert [r["run"] for r in read_csv(out)] == ORDER


def test_cli_empty_and_missing_results(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "lb.csv"
    assert main(["leaderboard", str(tmp_path / "empty"), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert err == f"note: no finished run to export; {out} holds only the header\n"
    assert len(out.read_text().splitlines()) == 1
    assert main(["leaderboard", str(tmp_path / "nope"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: results directory not found: {tmp_path / 'nope'}\n"


def test_cli_robustness_of_results_without_a_query_run(tmp_path, capsys):
    """No query run below the directory: the CSV's header, a note, no chart
    and exit 0, as the leaderboard (the chart once failed inside matplotlib's legend with no bar to label)."""
    (tmp_path / "empty").mkdir()
    out = tmp_path / "rob.csv"
    assert main(["robustness", str(tmp_path / "empty"), "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.err == f"note: no finished query run; {out} holds only the header and no chart was drawn\n"
    assert len(out.read_text().splitlines()) == 1 and not out.with_suffix(".png").exists()
    assert main(["robustness", str(tmp_path / "nope"), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"error: results directory not found: {tmp_path / 'nope'}\n"


def test_cli_unwritable_output(results, tmp_path, capsys):
    (tmp_path / "dir.csv").mkdir()
    assert main(["leaderboard", str(results), "-o", str(tmp_path / "dir.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the leaderboard {tmp_path / 'dir.csv'}: ") and err.count("\n") == 1


def test_terminal_table_per_family():
    """Rows of two families print as two tables, each with its family's headers (detection: mAP drops, not ASR)."""
    from blackboxbench.cli import format_table

    rows = [{"family": "score", "attack": "square_linf", "asr": 0.5, "clean_acc": 0.9},
            {"family": "detection", "attack": "dag", "clean_acc": 0.8, "mean_drop_map": 0.25},
            {"family": "score", "attack": "nes", "asr": 0.75}]
    first, second = format_table(rows).split("\n\n")
    assert "ASR" in first.splitlines()[0] and [ln.split()[0] for ln in first.splitlines()[2:]] == ["square_linf", "nes"]
    assert "mAP drop" in second.splitlines()[0] and "ASR" not in second and "0.25" in second.splitlines()[2]
    with_interval = format_table([{**rows[0], "asr_low": 0.2366, "asr_high": 0.7634}]).splitlines()
    assert "ASR 95 %" in with_interval[0] and "0.23-0.77" in with_interval[2] and " - " in first.splitlines()[2]
    edge = format_table([{**rows[0], "asr": 0.3447, "asr_low": 0.2700, "asr_high": 0.344709}]).splitlines()[2]
    assert "0.3447" in edge and "0.27-0.35" in edge  # rounded outwards: the interval shown holds the estimate


def test_a_config_name_labels_the_run_and_fills_the_name_column(tmp_path):
    """A run's config ``name`` is its label in the terminal table and a column of the CSV (the attack stays)."""
    from blackboxbench.cli import format_table

    rows = [{"family": "score", "attack": "square_linf", "name": "sq_fast", "asr": 0.5},
            {"family": "score", "attack": "nes", "name": None, "asr": 0.75}]
    assert [ln.split()[0] for ln in format_table(rows).splitlines()[2:]] == ["sq_fast", "nes"]
    rule = [{"family": "score", "attack": "sq", "eps": 0.03, "defense": "rnd", "success_rule": r, "asr": a}
            for r, a in ((None, 0.9), ("majority(5)", 0.5))]  # alike in every setting the table shows
    assert [ln.split("  ")[0] for ln in format_table(rule).splitlines()[2:]] == ["sq", "sq rule majority(5)"]
    names = [c for c, _ in columns()]
    assert names[:2] == ["attack", "name"]


def test_run_labels_keep_every_run_apart():
    """Figure labels: the name, else the attack; where runs of a group (same label and ``within``) share a
    ``clash`` value, the settings they differ in are added to every run of the group (eps, a success rule...), and
    runs that differ in none get their config hash."""
    from blackboxbench.leaderboard import run_labels

    def r(run, attack, eps, norm="linf", defense="none", name=None, h="h", rule=None):
        return {"run": run, "attack": attack, "eps": eps, "norm": norm, "defense": defense, "name": name,
                "config_hash": h, "success_rule": rule}

    rows = [r("a", "sq", 4 / 255), r("b", "sq", 8 / 255, defense="rnd"), r("c", "sq", 4 / 255, defense="rnd"),
            r("d", "sq", 1.0, norm="l2"), r("e", "nes", 0.03, h="h1"), r("f", "nes", 0.03, h="h2"),
            r("g", "nes", 0.03, defense="rnd", name="mine"), r("i", "rs", 0.03), r("j", "rs", 0.03, defense="rnd"),
            r("k", "rs", 0.03, defense="rnd", rule="majority(5)")]
    got = run_labels(rows, within=lambda x: x["norm"], clash=lambda x: x["defense"])
    assert got == ["sq eps 4/255", "sq eps 8/255", "sq eps 4/255", "sq", "nes h1", "nes h2", "mine", "rs", "rs",
                   "rs rule majority(5)"]
    both = [{**rows[0], "targeted": t, "eot": k} for t in (False, True) for k in (1, 4)]
    assert run_labels(both, clash=lambda x: None) == \
        ["sq EOT 1 untargeted", "sq EOT 4 untargeted", "sq EOT 1 targeted", "sq EOT 4 targeted"]
    sizes = [{**rows[0], "dataset": "imagefolder", "dataset_params": p} for p in ("size 32", "size 64", None)]
    assert run_labels(sizes, clash=lambda x: None) == ["sq data size 32", "sq data size 64", "sq"]


def test_robustness_chart_draws_every_run(tmp_path, monkeypatch):
    """Two runs of one attack, norm and defense at different eps are two groups of bars, not one overwritten."""
    from blackboxbench import robustness

    drawn = []
    import matplotlib.axes
    real = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, xs, vals, *a, **k: drawn.append(list(vals)) or
                        real(self, xs, vals, *a, **k))
    rows = [{"run": "a", "attack": "sq", "eps": 4 / 255, "norm": "linf", "defense": "none", "asr": 0.4, "aqn": 10},
            {"run": "b", "attack": "sq", "eps": 8 / 255, "norm": "linf", "defense": "none", "asr": 0.9, "aqn": 5}]
    robustness.chart(rows, tmp_path / "r.png")
    assert drawn[0] == [0.4, 0.9] and (tmp_path / "r.png").is_file()


def test_robustness_output_is_the_csv_path(tmp_path, capsys):
    """A .png as the robustness output would be the CSV and then its own chart: refused in one line."""
    from blackboxbench.cli import main
    assert main(["robustness", str(tmp_path), "-o", str(tmp_path / "r.png")]) == 2
    assert capsys.readouterr().err == ("error: the robustness output is the CSV's path; its chart is written next to "
                                       f"it as .png (got {tmp_path / 'r.png'})\n")
    assert not (tmp_path / "r.png").exists()


def test_robustness_rows_put_undefended_first_and_adversarially_trained_last():
    """Within one attack the robustness rows go: no defense, the other defenses by name, then an adversarially
    trained target (``at``, ``at+...``) last; the chart's legend cuts every part of a stacked defense at its
    parameters."""
    from blackboxbench.robustness import _order, short_defense

    defenses = ["rnd(sigma=0.02)", "at", "aaa_linear(x=1)", "none", "at+rnd(sigma=0.02)", None]
    rows = [{"attack": "sq", "norm": "linf", "eps": 0.05, "targeted": False, "defense": d} for d in defenses]
    assert [r["defense"] for r in _order(rows)][2:] == ["aaa_linear(x=1)", "rnd(sigma=0.02)", "at",
                                                         "at+rnd(sigma=0.02)"]
    assert {r["defense"] for r in _order(rows)[:2]} == {"none", None}  # no defense: first
    # the attack comes before the defense
    other = {"attack": "a_first", "norm": "linf", "eps": 0.05, "targeted": False, "defense": "at"}
    assert _order([*rows, other])[0] is other
    assert short_defense("at+rnd(sigma=0.02)") == "at+rnd"
    assert short_defense("aaa_linear(x=1)+rnd(sigma=0.02)") == "aaa_linear+rnd"
    assert short_defense("aaa_linear(x=1, y=(2, 3))") == "aaa_linear" and short_defense(None) == "none"


def test_robustness_columns_put_plugin_metrics_before_the_run_naming_ones():
    """The mean of a metric the summaries list that the robustness COLUMNS lack (a plugin's) comes before the
    three columns that name the run, which stay last; a metric already a column is not added twice."""
    from blackboxbench.robustness import COLUMNS, columns

    got = columns([{"metrics": ["l1dist", "ssim"]}, {"metrics": ["l1dist", "l2"]}])
    assert got == COLUMNS[:-3] + ("mean_l1dist", "mean_l2") + ("wall_time", "config_hash", "run")
