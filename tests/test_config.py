"""Malformed configs fail up front with one line naming the file and key, exit code 2, no traceback."""
import textwrap

import pytest

from blackboxbench.cli import main
from blackboxbench.config import parse_number

GOOD = """
dataset: {name: digits, n: 4}
model: digits_mlp
attack: square_linf
threat: {norm: linf, eps: 8/255, max_queries: 10}
output_dir: OUT
"""

CASES = [
    # (description, yaml text, expected key in the message, expected text)
    ("unknown top-level key", GOOD + "seeed: 1\n", "seeed", "did you mean: seed"),
    ("unknown threat key", GOOD.replace("max_queries: 10", "max_querys: 10"), "threat.max_querys", "max_queries"),
    ("wrong type", GOOD + "batch_size: many\n", "batch_size", "expected int"),
    ("bool is not int", GOOD + "seed: true\n", "seed", "expected int"),
    ("eps out of range", GOOD.replace("8/255", "2"), "threat.eps", "out of range"),
    ("eps not a number", GOOD.replace("8/255", "eight"), "threat.eps", "cannot"),
    ("negative budget", GOOD.replace("max_queries: 10", "max_queries: 0"), "threat.max_queries", ">= 1"),
    ("unknown norm", GOOD.replace("norm: linf", "norm: l3"), "threat.norm", "must be one of"),
    ("norm unsupported by recipe", GOOD.replace("norm: linf", "norm: l2").replace("8/255", "1"), "threat.norm",
     "supports norms"),
    ("unknown attack", GOOD.replace("square_linf", "sqare_linf"), "attack", "did you mean: square_linf"),
    ("unknown dataset", GOOD.replace("name: digits", "name: digitz"), "dataset", "did you mean: digits"),
    ("unknown model", GOOD.replace("digits_mlp", "digits_mpl"), "model", "did you mean: digits_mlp"),
    ("unknown block parameter", GOOD.replace("attack: square_linf",
                                             "attack: {recipe: square_linf, blocks: {perturb: {p_int: 0.1}}}"),
     "attack.blocks.perturb", "p_init"),
    ("unknown device", GOOD + "device: tpu\n", "device", "must be one of"),
    ("missing dataset", GOOD.replace("dataset: {name: digits, n: 4}\n", ""), "dataset", "missing"),
    ("bad dataset size", GOOD.replace("n: 4", "n: -3"), "dataset.n", "positive"),
    ("feedback label for a score attack", GOOD.replace("max_queries: 10", "max_queries: 10, feedback: label"),
     "threat.feedback", "needs feedback 'score'"),
    ("transfer without surrogates", GOOD.replace("square_linf", "mi_fgsm").replace(", max_queries: 10", ""),
     "surrogates", "needs"),
    ("bad target label mode", GOOD.replace("eps: 8/255", "eps: 8/255, targeted: true, target_label: medain"),
     "threat.target_label", "did you mean: median"),
    ("invalid yaml", "dataset: [digits\n", "", "invalid YAML"),
    ("unknown key inside runs", GOOD + "runs:\n  - {atack: square_linf}\n", "runs[0].atack", "did you mean"),
    ("missing plugin file", GOOD + "plugins: [nothere.py]\n", "plugins[0]", "not found"),
    ("missing data root", GOOD.replace("name: digits, n: 4", "name: cifar10, n: 4") + "data_root: /nonexistent\n",
     "data_root", "/nonexistent"),
    ("model unknown parameter", GOOD.replace("model: digits_mlp", "model: {name: digits_mlp, depth: 3}"), "model",
     "unknown parameter"),
]


@pytest.mark.parametrize("desc,text,key,expect", CASES, ids=[c[0] for c in CASES])
def test_bad_config_one_line(tmp_path, capsys, desc, text, key, expect):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text).replace("OUT", str(tmp_path / "out")))
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert str(path) in err and key in err and expect in err, err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_missing_config_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_set_override_is_validated(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")))
    assert main(["run", str(path), "--set", "threat.eps=3", "--quiet"]) == 2
    assert "threat.eps" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("8/255", 8 / 255), ("0.03", 0.03), ("eps/10", 0.1), ("2**-3", 0.125),
                                        (1, 1)])
def test_parse_number(text, value):
    assert parse_number(text, {"eps": 1.0}) == pytest.approx(value)


@pytest.mark.parametrize("text", ["__import__('os')", "eps", "1/0", "[1]", True])
def test_parse_number_rejects(text):
    with pytest.raises(ValueError):
        parse_number(text)
