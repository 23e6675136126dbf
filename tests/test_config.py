"""Malformed configs fail up front with one line naming the file and key, exit code 2, no traceback."""
import sys
import textwrap
import time
from pathlib import Path

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
    ("plot over the leaderboard",
     GOOD + "leaderboard: OUT/board.csv\nplots: [{recipe: aev_bar, output: OUT/board.png}]\n",
     "plots[0].output", "which leaderboard writes too: give one of them another path"),
    ("robustness chart as its CSV", GOOD + "robustness: OUT/r.png\n", "robustness",
     "the robustness output is the CSV's path; its chart is written next to it as .png"),
    ("robustness over the leaderboard", GOOD + "leaderboard: OUT/b.csv\nrobustness: OUT/b.csv\n", "robustness",
     "which leaderboard writes too"),
    ("grid of a whole-file key", GOOD + "grid: {cascade: [true, false]}\n", "grid.cascade",
     "applies to the whole file: the grid varies the keys of a run"),
    ("unknown threat key", GOOD.replace("max_queries: 10", "max_querys: 10"), "threat.max_querys", "max_queries"),
    ("wrong type", GOOD + "batch_size: many\n", "batch_size", "expected int"),
    ("bool is not int", GOOD + "seed: true\n", "seed", "expected int"),
    ("eps out of range", GOOD.replace("8/255", "2"), "threat.eps", "out of range"),
    ("linf eps in grey levels", GOOD.replace("8/255", "8"), "threat.eps", "did you mean 8/255?"),
    ("eps not a number", GOOD.replace("8/255", "eight"), "threat.eps", "cannot"),
    ("negative budget", GOOD.replace("max_queries: 10", "max_queries: 0"), "threat.max_queries", ">= 1"),
    ("budget in YAML's 1e4", GOOD.replace("max_queries: 10", "max_queries: 1e4"), "threat.max_queries",
     "expected int, got str '1e4' (YAML reads 1e4 as text: write 10000)"),
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
    assert main(["run", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: a directory, not a YAML file"


def test_set_override_is_validated(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")))
    assert main(["run", str(path), "--set", "threat.eps=3", "--quiet"]) == 2
    assert "threat.eps" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("8/255", 8 / 255), ("0.03", 0.03), ("eps/10", 0.1), (" -(1+2)*eps ", -3),
                                        ("+1e-3", 0.001), (1, 1), (2.5, 2.5), ("1_000", 1000),
                                        ("16/255 - 8/255", 8 / 255), ("2*3 - 1", 5)])
def test_parse_number(text, value):
    assert parse_number(text, {"eps": 1.0}) == pytest.approx(value)


@pytest.mark.parametrize("text", ["__import__('os')", "eps", "1/0", "[1]", True, "True", "2**-3", "9**9**9", "1j",
                                  "nan", "inf", "1e999", "1e308*10", float("nan"), float("inf"), 10 ** 400,
                                  "1" * 65, "(8/255", "", "8 /", "x.y", "abs(-1)", "1 if 1 else 2", "\0", "1\n+2",
                                  None, [1]])
def test_parse_number_rejects(text):
    with pytest.raises(ValueError):
        parse_number(text)


def test_parse_number_is_quick_on_huge_expressions():
    """No exponent: the largest value 64 characters can write is a product of literals, evaluated at once. Timed on
    this thread's CPU clock, not the wall clock: a loaded machine can leave the test unscheduled for over 0.1 s."""
    start = time.thread_time()
    with pytest.raises(ValueError):
        parse_number("9" * 20 + "*" + "9" * 20 + "*" + "9" * 20 + "*1e300")
    assert parse_number("9" * 31 + "*" + "9" * 31) > 0 and time.thread_time() - start < 0.1


# ---------------------------------------------------------------- fuzz: malformed configs, each a one-line error
REPO = Path(__file__).resolve().parent.parent
TRANSFER_MODELS = "surrogates: [digits_cnn]\ntargets: [digits_mlp]"
SCORE_THREAT = "{norm: linf, eps: 8/255, max_queries: 10}"


def cfg(attack="square_linf", threat=SCORE_THREAT, models="model: digits_mlp", extra="",
        dataset="{name: digits, n: 4}"):
    return f"dataset: {dataset}\n{models}\nattack: {attack}\nthreat: {threat}\noutput_dir: OUT\n{extra}\n"


def tcfg(attack="mi_di_ti_fgsm", threat="{norm: linf, eps: 8/255}", extra="", models=TRANSFER_MODELS):
    return cfg(attack, threat, models, extra)


def dcfg(attack="hsja_linf", threat=SCORE_THREAT, extra=""):
    return cfg(attack, threat, extra=extra)


def blocks(recipe, kind, spec):
    return f"{{recipe: {recipe}, blocks: {{{kind}: {spec}}}}}"


def case(desc, text, key, phrase, sets=(), files=None):
    """A malformed config (YAML text or bytes; OUT and TMP name tmp_path/out and tmp_path), the key path and the
    phrase its one-line error must hold; ``sets``: --set overrides; ``files``: other files to write first."""
    return pytest.param(text, key, phrase, tuple(sets), files or {}, id=desc)


INLINE = "{name: mine, family: score, norms: NORMS, targeted: TARGETED, blocks: {init: clean_start, perturb: nes, " \
         "accept: margin_step}EXTRA}"


def inline(norms="[linf]", targeted="false", extra=""):
    return INLINE.replace("NORMS", norms).replace("TARGETED", targeted).replace("EXTRA", extra)


def plugin(code):
    return {"plug.py": textwrap.dedent(code)}


PLUGGED = cfg(extra="plugins: [plug.py]")
TARGETED = "{norm: linf, eps: 8/255, max_queries: 10, targeted: true, target_label: LABEL}"
LONG = "1+" * 40 + "1"

FUZZ = [
    # unknown keys, at every level
    case("unknown top key", cfg(extra="outputdir: x"), "outputdir", "did you mean: output_dir"),
    case("unknown threat key", cfg(threat="{norm: linf, eps: 8/255, max_queries: 10, epss: 1}"), "threat.epss",
         "unknown key"),
    case("unknown key in runs[1]", cfg(extra="runs: [{seed: 1}, {sed: 2}]"), "runs[1].sed", "did you mean: seed"),
    case("unknown attack override", cfg(attack="{recipe: square_linf, hyperr: {}}"), "attack.hyperr",
         "unknown override"),
    case("unknown block param", cfg(attack=blocks("square_linf", "perturb", "{p_int: 0.1}")),
         "attack.blocks.perturb.p_int", "did you mean: p_init"),
    case("unknown block kind", cfg(attack=blocks("square_linf", "perturbb", "{name: square_linf}")),
         "attack.blocks.perturbb", "did you mean: perturb"),
    case("unknown block name", cfg(attack=blocks("square_linf", "perturb", "{name: square_lnf}")),
         "attack.blocks.perturb", "did you mean: square_linf"),
    case("unknown transfer block param", tcfg(blocks("mi_di_ti_fgsm", "transform", "[{name: di, probb: 1}]")),
         "attack.blocks.transform[0].probb", "did you mean: prob"),
    case("unknown model param", cfg(models="model: {name: digits_mlp, pretrain: true}"), "model.pretrain",
         "did you mean: pretrained"),
    case("unknown dataset param", cfg(dataset="{name: digits, n: 4, splitt: test}"), "dataset.splitt",
         "did you mean: split"),
    case("unknown surrogate param", tcfg(models="surrogates: [{name: digits_cnn, depth: 2}]\ntargets: [digits_mlp]"),
         "surrogates[0].depth", "unknown parameter"),
    case("unknown target model", tcfg(models="surrogates: [digits_cnn]\ntargets: [digits_mlp, digits_lenett]"),
         "targets[1]", "did you mean: digits_lenet"),
    case("two targets, one label", tcfg(models="surrogates: [digits_cnn]\ntargets: [digits_mlp, digits_mlp]"),
         "targets[1]", "same label 'digits_mlp' as targets[0]: their results would merge"),
    case("target label not text", tcfg(models="surrogates: [digits_cnn]\ntargets: [{name: digits_mlp, label: 3}]"),
         "targets[0].label", "expected a non-empty string, got 3"),
    case("unknown target_label param", cfg(threat=TARGETED.replace("LABEL", "{name: specified, labl: 3}")),
         "threat.target_label.labl", "did you mean: label"),
    case("unknown success_rule key", cfg(threat="{norm: linf, max_queries: 10, success_rule: {name: majority, "
                                               "drawz: 3}}"), "threat.success_rule.drawz", "unknown key"),
    case("unknown inline recipe key", cfg(attack=inline(extra=", extra: 1")), "attack.extra", "unknown key"),
    case("unknown asset param", cfg(extra="assets: {m: {name: model, sepc: digits_mlp}}"), "assets.m.sepc",
         "did you mean: spec"),
    case("unknown asset kind", cfg(extra="assets: {m: {name: modell, spec: digits_mlp}}"), "assets.m",
         "did you mean: model"),
    case("unknown hyper key", tcfg("{recipe: i_fgsm, hyper: {iters: 3}}"), "attack.hyper.iters", "unknown key"),
    # wrong types of every top-level key
    case("name not str", cfg(extra="name: 5"), "name", "expected str"),
    case("plugins not list", cfg(extra="plugins: x.py"), "plugins", "expected list"),
    case("data_root not str", cfg(extra="data_root: 5"), "data_root", "expected str"),
    case("output_dir not str", cfg().replace("output_dir: OUT", "output_dir: [OUT]"), "output_dir", "expected str"),
    case("seed not int", cfg(extra="seed: zero"), "seed", "expected int"),
    case("seed float", cfg(extra="seed: 1.5"), "seed", "expected int"),
    case("device not str", cfg(extra="device: 1"), "device", "expected str"),
    case("batch_size float", cfg(extra="batch_size: 2.5"), "batch_size", "expected int"),
    case("batch_size bool", cfg(extra="batch_size: true"), "batch_size", "expected int"),
    case("dataset not spec", cfg(dataset="5"), "dataset", "expected str/dict"),
    case("dataset without name", cfg(dataset="{n: 4}"), "dataset", "a mapping with 'name'"),
    case("attack not spec", cfg(attack="5"), "attack", "expected str/dict"),
    case("threat not mapping", cfg(threat="[linf]"), "threat", "expected dict"),
    case("save_adv not bool", cfg(extra="save_adv: 'yes'"), "save_adv", "expected bool"),
    case("assets not mapping", cfg(extra="assets: [1]"), "assets", "expected dict"),
    case("compile not bool", cfg(extra="compile: 1"), "compile", "expected bool"),
    case("fuse not bool", cfg(extra="fuse: yes please"), "fuse", "expected bool"),
    case("model not spec", cfg(models="model: 5"), "model", "expected str/dict"),
    case("surrogates not list", tcfg(models="surrogates: digits_cnn\ntargets: [digits_mlp]"), "surrogates",
         "expected list"),
    case("targets not list", tcfg(models="surrogates: [digits_cnn]\ntargets: 5"), "targets", "expected list"),
    case("runs not list", cfg(extra="runs: {a: 1}"), "runs", "expected list"),
    case("run not mapping", cfg(extra="runs: [5]"), "runs[0]", "each run must be a mapping"),
    case("leaderboard not str", cfg(extra="leaderboard: 5"), "leaderboard", "expected str"),
    # wrong types of threat keys
    case("norm not str", cfg(threat="{norm: 5}"), "threat.norm", "expected str"),
    case("targeted not bool", cfg(threat="{targeted: 'yes'}"), "threat.targeted", "expected bool"),
    case("max_queries float", cfg(threat="{max_queries: 1.5}"), "threat.max_queries", "expected int"),
    case("feedback not str", cfg(threat="{feedback: 1}"), "threat.feedback", "expected str"),
    case("success_rule not spec", cfg(threat="{success_rule: 5}"), "threat.success_rule", "expected str/dict"),
    case("eps list", cfg(threat="{eps: [1]}"), "threat.eps", "expected int/float/str"),
    case("eps bool", cfg(threat="{eps: true}"), "threat.eps", "expected int/float/str"),
    case("target_label not spec", cfg(threat=TARGETED.replace("LABEL", "5")), "threat.target_label",
         "expected str/dict"),
    # out-of-range numbers
    case("seed negative", cfg(extra="seed: -1"), "seed", "must be in [0, 2**63)"),
    case("seed huge", cfg(extra="seed: 99999999999999999999"), "seed", "64 bits"),
    case("seed 2**63", cfg(extra="seed: 9223372036854775808"), "seed", "64 bits"),
    case("batch_size 0", cfg(extra="batch_size: 0"), "batch_size", "must be >= 1"),
    case("dataset n 0", cfg(dataset="{name: digits, n: 0}"), "dataset.n", "positive integer"),
    case("max_queries huge", cfg(threat="{max_queries: 99999999999999999999}"), "threat.max_queries", "64 bits"),
    case("eps 0", cfg(threat="{eps: 0}"), "threat.eps", "out of range"),
    case("eps negative", cfg(threat="{eps: -0.1}"), "threat.eps", "out of range"),
    case("eps below the uint8 grid", cfg(threat="{eps: 1/512}"), "threat.eps", "no pixel can move on the uint8 grid"),
    case("linf eps above 1", cfg(threat="{eps: 1.5}"), "threat.eps", "linf eps must be in [1/255, 1]"),
    case("l2 eps 1e40", cfg("square_l2", "{norm: l2, eps: 1.0e+40}"), "threat.eps",
         "l2 eps must be in [1/255, 10000]"),
    case("l2 eps 2e4", cfg("square_l2", "{norm: l2, eps: 20000}"), "threat.eps", "[1/255, 10000]"),
    case("eps .inf", cfg(threat="{eps: .inf}"), "threat.eps", "finite"),
    case("eps .nan", cfg(threat="{eps: .nan}"), "threat.eps", "finite"),
    case("eps 'nan'", cfg(threat="{eps: nan}"), "threat.eps", "cannot evaluate"),
    case("eps 9**9**9", cfg(threat="{eps: '9**9**9'}"), "threat.eps", "cannot evaluate"),
    case("eps __import__", cfg(threat="{eps: \"__import__('os')\"}"), "threat.eps", "cannot evaluate"),
    case("eps long string", cfg(threat=f"{{eps: '{LONG}'}}"), "threat.eps", "(at most 64)"),
    case("eps division by zero", cfg(threat="{eps: 8/0}"), "threat.eps", "division by zero"),
    case("eps 1e999", cfg(threat="{eps: '1e999'}"), "threat.eps", "finite"),
    case("eps syntax error", cfg(threat="{eps: '(8/255'}"), "threat.eps", "cannot parse"),
    case("eps names itself", cfg(threat="{eps: eps/2}"), "threat.eps", "cannot evaluate"),
    case("eps 'True'", cfg(threat="{eps: 'True'}"), "threat.eps", "cannot evaluate"),
    case("max_queries 0 (runs[0])", cfg(extra="runs: [{threat: {max_queries: 0}}]"), "threat.max_queries", ">= 1"),
    # bad norms, feedback, success rules, targets
    case("success_rule even draws", cfg(threat="{success_rule: {name: majority, draws: 4}}"),
         "threat.success_rule.draws", "odd integer >= 3"),
    case("success_rule unknown", cfg(threat="{success_rule: magority}"), "threat.success_rule", "must be one of"),
    case("feedback unknown", cfg(threat="{feedback: labels}"), "threat.feedback", "must be 'score' or 'label'"),
    case("norm upper case", cfg(threat="{norm: L2}"), "threat.norm", "must be one of linf, l2"),
    case("norm unsupported by rays", dcfg("rays", "{norm: l2, max_queries: 10}"), "threat.norm", "supports norms"),
    case("target_label untargeted", cfg(threat="{norm: linf, max_queries: 10, target_label: median}"),
         "threat.target_label", "only for targeted attacks"),
    case("specified label negative", cfg(threat=TARGETED.replace("LABEL", "{name: specified, label: -1}")),
         "threat.target_label.label", "must be in [0, inf), got -1"),
    case("specified label float", cfg(threat=TARGETED.replace("LABEL", "{name: specified, label: 2.5}")),
         "threat.target_label.label", "expected an integer"),
    # block parameters of a few recipes: types and declared ranges
    case("p_init negative", cfg(blocks("square_linf", "perturb", "{p_init: -1}")), "attack.blocks.perturb.p_init",
         "must be in (0, 1], got -1"),
    case("p_init 0", cfg(blocks("square_linf", "perturb", "{p_init: 0}")), "attack.blocks.perturb.p_init",
         "must be in (0, 1]"),
    case("p_init above 1", cfg(blocks("square_linf", "perturb", "{p_init: 1.5}")), "attack.blocks.perturb.p_init",
         "must be in (0, 1], got 1.5"),
    case("p_init abc", cfg(blocks("square_linf", "perturb", "{p_init: abc}")), "attack.blocks.perturb.p_init",
         "cannot evaluate 'abc'"),
    case("p_init bool", cfg(blocks("square_linf", "perturb", "{p_init: true}")), "attack.blocks.perturb.p_init",
         "expected a number, got bool"),
    case("p_init nan", cfg(blocks("square_linf", "perturb", "{p_init: .nan}")), "attack.blocks.perturb.p_init",
         "must be finite"),
    case("p_init list", cfg(blocks("square_linf", "perturb", "{p_init: [0.1]}")), "attack.blocks.perturb.p_init",
         "expected a number, got list"),
    case("p_init eps/0", cfg(blocks("square_linf", "perturb", "{p_init: eps/0}")), "attack.blocks.perturb.p_init",
         "division by zero"),
    case("p_init per setting, bad", cfg(blocks("square_linf", "perturb", "{p_init: {linf: 2, l2: 0.1}}")),
         "attack.blocks.perturb.p_init", "must be in (0, 1], got 2"),
    case("n_iters 0", cfg(blocks("square_l2", "perturb", "{n_iters: 0}"), "{norm: l2, max_queries: 10}"),
         "attack.blocks.perturb.n_iters", "must be in [1, inf), got 0"),
    case("n_iters float", cfg(blocks("square_linf", "perturb", "{n_iters: 2.5}")), "attack.blocks.perturb.n_iters",
         "expected an integer"),
    case("n_iters huge", cfg(blocks("square_linf", "perturb", "{n_iters: 99999999999999999999}")),
         "attack.blocks.perturb.n_iters", "64-bit"),
    case("nes q 0", cfg(blocks("nes", "perturb", "{q: 0}")), "attack.blocks.perturb.q", "[1, inf)"),
    case("nes q float", cfg(blocks("nes", "perturb", "{q: 1.5}")), "attack.blocks.perturb.q", "expected an integer"),
    case("nes fd_eta 0", cfg(blocks("nes", "perturb", "{fd_eta: 0}")), "attack.blocks.perturb.fd_eta", "(0, 1]"),
    case("nes lr negative", cfg(blocks("nes", "perturb", "{lr: -1}")), "attack.blocks.perturb.lr", "(0, inf)"),
    case("simba freq_dims 0", cfg(blocks("simba_dct", "init", "{freq_dims: 0}")), "attack.blocks.init.freq_dims",
         "[1, inf)"),
    case("simba stride negative", cfg(blocks("simba_dct", "init", "{stride: -1}")), "attack.blocks.init.stride",
         "[1, inf)"),
    case("simba_dct step 0", cfg(blocks("simba_dct", "perturb", "{step: 0}")), "attack.blocks.perturb.step",
         "(0, inf)"),
    case("simba_pixel step 2", cfg(blocks("simba_pixel", "perturb", "{step: 2}")), "attack.blocks.perturb.step",
         "(0, 1]"),
    case("hsja gamma 0", dcfg(blocks("hsja_linf", "init", "{gamma: 0}")), "attack.blocks.init.gamma", "(0, inf)"),
    case("hsja init_tries negative", dcfg(blocks("hsja_linf", "init", "{init_tries: -1}")),
         "attack.blocks.init.init_tries", "[0, inf)"),
    case("hsja init_num_evals 0", dcfg(blocks("hsja_linf", "perturb", "{init_num_evals: 0}")),
         "attack.blocks.perturb.init_num_evals", "[1, inf)"),
    case("hsja max_num_evals 0", dcfg(blocks("hsja_linf", "perturb", "{max_num_evals: 0}")),
         "attack.blocks.perturb.max_num_evals", "[1, inf)"),
    case("hsja stepsize_search unknown", dcfg(blocks("hsja_linf", "perturb", "{stepsize_search: golden_section}")),
         "attack.blocks.perturb.stepsize_search", "must be one of geometric_progression"),
    case("hsja stepsize_search int", dcfg(blocks("hsja_linf", "perturb", "{stepsize_search: 5}")),
         "attack.blocks.perturb.stepsize_search", "expected a string"),
    case("momentum decay negative", tcfg(blocks("mi_di_ti_fgsm", "direction", "[{name: momentum, decay: -1}]")),
         "attack.blocks.direction[0].decay", "[0, inf)"),
    case("ti kernel_size even", tcfg(blocks("mi_di_ti_fgsm", "gradient", "[{name: ti, kernel_size: 4}]")),
         "attack.blocks.gradient[0].kernel_size", "must be an odd integer in [1, inf), got 4"),
    case("ti kernel_size 0", tcfg(blocks("ti_fgsm", "gradient", "[{name: ti, kernel_size: 0}]")),
         "attack.blocks.gradient[0].kernel_size", "odd integer"),
    case("ti nsig 0", tcfg(blocks("ti_fgsm", "gradient", "[{name: ti, nsig: 0}]")), "attack.blocks.gradient[0].nsig",
         "(0, inf)"),
    case("di resize_rate 1", tcfg(blocks("di2_fgsm", "transform", "[{name: di, resize_rate: 1.0}]")),
         "attack.blocks.transform[0].resize_rate", "(1, inf)"),
    case("di prob above 1", tcfg(blocks("di2_fgsm", "transform", "[{name: di, prob: 1.5}]")),
         "attack.blocks.transform[0].prob", "[0, 1]"),
    case("ensemble weight negative", tcfg(blocks("ens_logit", "refine", "[{name: logit_ensemble, weights: [-1]}]")),
         "attack.blocks.refine[0].weights", "each value must be a number in [0, inf)"),
    case("ensemble weights not list", tcfg(blocks("ens_logit", "refine", "[{name: logit_ensemble, weights: abc}]")),
         "attack.blocks.refine[0].weights", "expected a list"),
    case("hyper iterations 0", tcfg("{recipe: i_fgsm, hyper: {iterations: 0}}"), "attack.hyper.iterations",
         "positive integer"),
    case("hyper iterations float", tcfg("{recipe: i_fgsm, hyper: {iterations: 2.5}}"), "attack.hyper.iterations",
         "positive integer"),
    case("hyper alpha 0", tcfg("{recipe: i_fgsm, hyper: {alpha: 0}}"), "attack.hyper", "alpha must be > 0"),
    case("hyper alpha 9**9", tcfg("{recipe: i_fgsm, hyper: {alpha: '9**9'}}"), "attack.hyper.alpha",
         "cannot evaluate"),
    case("hyper alpha inf", tcfg("{recipe: i_fgsm, hyper: {alpha: .inf}}"), "attack.hyper.alpha", "finite"),
    case("hyper random_start negative", tcfg("{recipe: pgd, hyper: {random_start: -1}}"), "attack.hyper",
         "random_start >= 0"),
    case("hyper copies_per_forward 1.5", tcfg("{recipe: si_fgsm, hyper: {copies_per_forward: 1.5}}"),
         "attack.hyper.copies_per_forward", "integer >= 0"),
    case("model pretrained not bool", cfg(models="model: {name: digits_mlp, pretrained: 'yes'}"),
         "model.pretrained", "expected a boolean"),
    case("timm num_classes 0", cfg(models="model: {name: timm, arch: resnet18, num_classes: 0}"),
         "model.num_classes", "must be in [1, inf), got 0"),
    case("timm std 0", cfg(models="model: {name: timm, arch: resnet18, std: [0, 1, 1]}"), "model.std",
         "each value must be a number in (0, inf)"),
    case("plugin block param type", tcfg(blocks("i_fgsm", "transform", "[{name: gaussian_noise, std: true}]"),
                                         extra=f"plugins: [{REPO / 'examples' / 'gaussian_noise.py'}]"),
         "attack.blocks.transform[0].std", "expected a number, got bool"),
    # recipes and overrides of the wrong shape
    case("block name not str", cfg(blocks("square_linf", "perturb", "{name: [1]}")), "attack.blocks.perturb",
         "expected a block name"),
    case("transform not a list", tcfg(blocks("di2_fgsm", "transform", "di")), "attack.blocks.transform",
         "must be a list of blocks"),
    case("blocks override a list", cfg(attack="{recipe: square_linf, blocks: [1]}"), "attack.blocks", "expected dict"),
    case("recipe not str", cfg(attack="{recipe: [1]}"), "attack.recipe", "expected a recipe name"),
    case("inline norms empty", cfg(attack=inline(norms="[]")), "attack.norms", "non-empty list of norms"),
    case("inline norms unknown", cfg(attack=inline(norms="[l3]")), "attack.norms", "non-empty list of norms"),
    case("inline targeted not bool", cfg(attack=inline(targeted="'yes'")), "attack.targeted", "expected bool"),
    case("inline family unknown", cfg(attack=inline().replace("family: score", "family: scor")), "attack.family",
         "did you mean: score"),
    case("attack name with slash", cfg(attack="{recipe: square_linf, name: a/b}"), "attack.name", "plain name"),
    case("name escapes output_dir", cfg(extra="name: ../x"), "name", "plain name"),
    case("score hyper", cfg(attack="{recipe: square_linf, hyper: {iterations: 3}}"), "attack.hyper.iterations",
         "unknown key; allowed: eot"),
    case("score eot zero", cfg(attack="{recipe: square_linf, hyper: {eot: 0}}"), "attack.hyper.eot",
         "positive integer"),
    case("unknown defense", cfg(extra="defense: rdn"), "defense", "unknown defense 'rdn' (did you mean: rnd?)"),
    case("defense param range", cfg(extra="defense: {name: rnd, sigma: -1}"), "defense.sigma", "[0, 1]"),
    case("defense list item", cfg(extra="defense: [jpeg, {name: aaa_sine, itr: 3}]"), "defense[1].itr",
         "unknown parameter"),
    case("defense on a transfer run", tcfg(extra="defense: rnd"), "defense", "not used by transfer attacks"),
    case("defense on a surrogate", tcfg(models="surrogates: [{name: digits_mlp, defense: rnd}]\n"
                                            "targets: [digits_cnn]"), "surrogates[0].defense", "not a surrogate"),
    case("unknown target defense", tcfg(models="surrogates: [digits_mlp]\ntargets: [{name: digits_cnn, "
                                               "defense: jpg}]"), "targets[0].defense", "unknown defense"),
    # keys of another family
    case("targets for a score attack", cfg(extra="targets: [digits_mlp]"), "targets", "not used by score attacks"),
    case("max_queries for transfer", tcfg(threat="{norm: linf, max_queries: 10}"), "threat.max_queries",
         "only for decision, score attacks"),
    case("transfer without targets", tcfg(models="surrogates: [digits_cnn]"), "targets", "needs 'targets'"),
    # YAML itself
    case("duplicate top key", cfg(extra="seed: 1\nseed: 2"), "seed", "duplicate key on line"),
    case("duplicate nested key", cfg(threat="{norm: linf, norm: l2}"), "threat.norm", "duplicate key"),
    case("duplicate key in runs", cfg(extra="runs:\n  - seed: 1\n    seed: 2"), "runs[0].seed", "duplicate key"),
    case("non-UTF-8", cfg(extra="name: caf\xe9").encode("latin-1"), "", "not UTF-8 text (byte 0xe9"),
    case("bad date", cfg(extra="seed: 2001-13-01"), "", "invalid YAML (ValueError: month must be in 1..12)"),
    case("two documents", cfg() + "---\nseed: 1\n", "", "invalid YAML"),
    case("top-level list", "- a\n- b\n", "", "the top level must be a mapping"),
    case("empty file", "", "", "the top level must be a mapping"),
    case("nested too deeply", cfg(extra="seed: " + "[" * 5000 + "]" * 5000), "", "nested too deeply"),
    case("tab indentation", "dataset:\n\tname: digits\n", "", "invalid YAML"),
    case("unhashable key", cfg(extra="? [a, b]\n: 1"), "", "unhashable key"),
    case("python tag", cfg(extra="seed: !!python/object/apply:os.system ['true']"), "", "invalid YAML"),
    # --set
    case("--set invalid YAML", cfg(), "threat", "--set value is not valid YAML", sets=["threat={norm: linf"]),
    case("--set without =", cfg(), "", "--set expects key=value", sets=["seed"]),
    case("--set inside a scalar", cfg(), "threat.eps.x", "cannot set inside a non-mapping", sets=["threat.eps.x=1"]),
    case("--set inside a string spec", cfg(), "attack.blocks.perturb.p_init", "cannot set inside a non-mapping",
         sets=["attack.blocks.perturb.p_init=abc"]),
    case("--set empty key", cfg(), "", "empty key name", sets=["=1"]),
    case("--set empty part", cfg(), "threat..eps", "empty key name", sets=["threat..eps=1"]),
    case("--set seed out of range", cfg(), "seed", "must be in [0, 2**63)", sets=["seed=-5"]),
    case("--set duplicate key", cfg(), "threat.norm", "duplicate key", sets=["threat={norm: linf, norm: l2}"]),
    case("--set unknown key", cfg(), "sed", "did you mean: seed", sets=["sed=1"]),
    # plugins
    case("plugin calls sys.exit", PLUGGED, "plugins[0]", "it called sys.exit(3)",
         files=plugin("import sys\nsys.exit(3)\n")),
    case("plugin raises KeyboardInterrupt", PLUGGED, "plugins[0]", "KeyboardInterrupt",
         files=plugin("raise KeyboardInterrupt\n")),
    case("plugin raises", PLUGGED, "plugins[0]", "ValueError: bad thing",
         files=plugin("raise ValueError('bad\\nthing')\n")),
    case("plugin syntax error", PLUGGED, "plugins[0]", "SyntaxError", files=plugin("def (:\n")),
    case("plugin duplicate block", PLUGGED, "plugins[0]", "duplicate perturb 'square_linf'", files=plugin("""
         from blackboxbench.registry import PERTURB
         PERTURB.register("square_linf")(lambda ctx, state: state)
         """)),
    case("plugin bad ranges", PLUGGED, "plugins[0]", "range '(0, 1'", files=plugin("""
         from blackboxbench.registry import PERTURB
         @PERTURB.register("fuzz_bad_range", ranges={"p": "(0, 1"})
         def fuzz_bad_range(ctx, state, *, p=0.5):
             return state
         """)),
    case("plugin not a string", cfg(extra="plugins: [5]"), "plugins[0]", "expected a module name"),
    case("plugin module missing", cfg(extra="plugins: [no_such_module_xyz]"), "plugins[0]", "ModuleNotFoundError"),
    case("second plugin fails", cfg(extra="plugins: [ok.py, plug.py]"), "plugins[1]", "RuntimeError: second",
         files={"ok.py": "X = 1\n", "plug.py": "raise RuntimeError('second')\n"}),
    # output_dir must be usable before anything is created
    case("output_dir is a file", cfg().replace("OUT", "TMP/afile"), "output_dir", "exists and is not a directory",
         files={"afile": "x"}),
    case("output_dir under a file", cfg().replace("OUT", "TMP/afile/sub"), "output_dir",
         "is not a directory, so nothing can be created under it", files={"afile": "x"}),
    case("output_dir in /proc", cfg().replace("OUT", "/proc/bbb_out"), "output_dir", "virtual filesystem"),
    case("output_dir in /sys", cfg().replace("OUT", "/sys/kernel/bbb_out"), "output_dir", "virtual filesystem"),
    case("output_dir in /dev", cfg().replace("OUT", "/dev/shm/bbb_out"), "output_dir", "virtual filesystem"),
    case("output_dir empty", cfg().replace("OUT", "''"), "output_dir", "not a usable directory path"),
    case("output_dir NUL", cfg().replace("OUT", '"TMP/a\\0b"'), "output_dir", "not a usable directory path"),
    case("output_dir too long", cfg().replace("OUT", "TMP/" + "x" * 300), "output_dir", "path too long"),
    # at run time, still before anything is created
    case("dataset split unknown", cfg(dataset="{name: digits, n: 4, split: validation}"), "dataset",
         "split must be 'train' or 'test'"),
]


def _run_case(tmp_path, text, sets, files):
    """Run the CLI on a malformed config -> (exit status, stderr)."""
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    path = tmp_path / "cfg.yaml"
    if isinstance(text, str):
        text = text.replace("OUT", str(tmp_path / "out")).replace("TMP", str(tmp_path)).encode()
    path.write_bytes(text)
    args = ["run", str(path), "--quiet"] + [a for s in sets for a in ("--set", s)]
    return main(args), path


def _outcome(tmp_path, capsys, text, key, phrase, sets, files):
    """(outcome, detail): 'one-line' (status 2, one line naming the file, key and phrase, nothing created),
    'traceback' (an exception escaped main, or a traceback was printed), 'accepted' (status 0) or 'other'."""
    try:
        status, path = _run_case(tmp_path, text, sets, files)
    except BaseException as e:  # noqa: BLE001 - whatever escapes main counts as a traceback
        capsys.readouterr()
        return "traceback", f"{type(e).__name__}: {e}"
    err = capsys.readouterr().err.strip()
    if status == 0:
        return "accepted", err
    if "Traceback" in err:
        return "traceback", err
    ok = status == 2 and "\n" not in err and str(path) in err and key in err and phrase in err
    return ("one-line", "") if ok and not (tmp_path / "out").exists() else ("other", f"status {status}: {err}")


@pytest.mark.parametrize("text,key,expect,sets,files", FUZZ)
def test_fuzz_one_line(tmp_path, capsys, text, key, expect, sets, files):
    status, path = _run_case(tmp_path, text, sets, files)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    assert str(path) in err and key in err and expect in err, err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_fuzz_tally(tmp_path_factory, capsys):
    """Every fuzz case again, tallied (cases tried / one-line errors / tracebacks / silently accepted / other):
    all of them must be one-line errors."""
    tally, details = {"one-line": 0, "traceback": 0, "accepted": 0, "other": 0}, []
    for i, p in enumerate(FUZZ):
        outcome, detail = _outcome(tmp_path_factory.mktemp(f"fuzz{i}"), capsys, *p.values)
        tally[outcome] += 1
        if outcome != "one-line":
            details.append(f"{p.id}: {outcome}: {detail}")
    assert len(FUZZ) >= 80 and tally == {"one-line": len(FUZZ), "traceback": 0, "accepted": 0, "other": 0}, \
        (tally, details)


# ---------------------------------------------------------------- every leaf of the data-free configs, mutated
MUTANTS = ["zzz", -1, 0, 10 ** 9, 1.5, [], {}, None, True, "8/0", [1, "a"], {"name": "zzz"}]


def _leaves(node, path=()):
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield path + (k,)
        yield from _leaves(v, path + (k,))


@pytest.mark.parametrize("config", ["quickstart.yaml", "plugin_example.yaml"])
def test_every_mutated_leaf_builds_or_fails_in_one_line(tmp_path, config):
    """Each key of a shipped config that needs no data root (each nested key and list item too) set to each of
    twelve wrong values: the config loads and its runs build (models, attacks, assets), or the error is one
    BenchError line naming the file; never another exception. (The same sweep over the CIFAR-10, detection,
    defense and TFLite configs, 13,752 cases with the data root, found none either; it is too slow for CI.)"""
    import copy

    import yaml

    from blackboxbench.config import load_config
    from blackboxbench.errors import BenchError
    from blackboxbench.runner import Runner

    src = REPO / "configs" / config
    base = yaml.safe_load(src.read_text())
    for key in ("plots", "leaderboard"):  # file outputs: written after the runs, not built here
        base.pop(key, None)
    if "plugins" in base:
        base["plugins"] = [str((src.parent / p).resolve()) for p in base["plugins"]]
    cases, bad = 0, []
    for path in _leaves(base):
        if path[0] == "output_dir":
            continue
        for value in MUTANTS:
            doc = copy.deepcopy(base)
            node = doc
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            doc["output_dir"] = str(tmp_path / "out")
            cfg = tmp_path / config
            cfg.write_text(yaml.safe_dump(doc))
            cases += 1
            try:
                [Runner(e, progress=False) for e in load_config(cfg)[0]]
            except BenchError as e:
                if "\n" in str(e) or str(cfg) not in str(e):
                    bad.append((path, value, str(e)))
            except Exception as e:  # noqa: BLE001  (the defect this test looks for)
                bad.append((path, value, f"{type(e).__name__}: {e}"))
    assert cases >= 200 and not bad, bad[:5]


# ---------------------------------------------------------------- plugins that fail leave nothing behind
HALF_PLUGIN = """
from blackboxbench.registry import MODEL, PERTURB, TRANSFORM

@PERTURB.register("half_plugin_perturb_{tag}")
def p(ctx, state):
    return state

@TRANSFORM.register("half_plugin_transform_{tag}", ranges={{"s": "[0, 1]"}})
def t(ctx, x, *, s=0.5):
    return x

MODEL.register("half_plugin_model_{tag}")(lambda data_root: None)
{failure}
"""
FAILURES = {"exception": "raise RuntimeError('boom')", "exit0": "import sys; sys.exit(0)",
            "exit3": "raise SystemExit(3)", "interrupt": "raise KeyboardInterrupt"}


def _registered(tag):
    from blackboxbench.registry import MODEL, PERTURB, TRANSFORM

    return [n for reg, n in ((PERTURB, "perturb"), (TRANSFORM, "transform"), (MODEL, "model"))
            if f"half_plugin_{n}_{tag}" in reg]


def _plugin_modules(path):
    return [m for m, mod in list(sys.modules.items()) if getattr(mod, "__file__", None) == str(path)]


@pytest.mark.parametrize("failure", FAILURES, ids=list(FAILURES))
def test_failed_plugin_leaves_nothing(tmp_path, capsys, failure):
    from blackboxbench.config import import_plugins
    from blackboxbench.registry import restore, snapshot

    tag = f"{failure}_{tmp_path.name}".replace("-", "_")
    plug = tmp_path / "half.py"
    plug.write_text(HALF_PLUGIN.format(tag=tag, failure=FAILURES[failure]))
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "plugins: [half.py]\n")
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{path}:plugins[0]: cannot import plugin 'half.py'" in err, err
    assert "re-run" not in err and not (tmp_path / "out").exists()
    assert _registered(tag) == [] and _plugin_modules(plug) == []
    # fixed, the same file imports cleanly (nothing of the failed attempt is in the way)
    plug.write_text(HALF_PLUGIN.format(tag=tag, failure=""))
    before = snapshot()
    try:
        import_plugins(["half.py"], str(path), tmp_path)
        assert _registered(tag) == ["perturb", "transform", "model"] and len(_plugin_modules(plug)) == 1
    finally:
        restore(before)
        for m in _plugin_modules(plug):
            del sys.modules[m]


def test_failed_plugin_module_leaves_sys_modules(tmp_path, monkeypatch, capsys):
    (tmp_path / "bbb_failing_plugin_mod.py").write_text("x = 1\nraise ImportError('needs a missing library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "plugins: [bbb_failing_plugin_mod]\n")
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "plugins[0]" in err and "ImportError: needs a missing library" in err, err
    assert "bbb_failing_plugin_mod" not in sys.modules


# ---------------------------------------------------------------- what still works
def test_block_params_take_arithmetic_and_settings(tmp_path):
    from blackboxbench.config import load_config
    from blackboxbench.runner import prepare

    path = tmp_path / "cfg.yaml"
    path.write_text(cfg(blocks("square_linf", "perturb", "{p_init: eps/2, n_iters: 2*50}"),
                        "{norm: linf, eps: 0.1, max_queries: 10}"))
    (exp,), _ = load_config(path)
    plan = prepare(exp)
    assert plan.attack.perturb.keywords == {"p_init": pytest.approx(0.05), "n_iters": 100}
    assert not (tmp_path / "out").exists()


def test_output_dir_checks_create_nothing(tmp_path):
    from blackboxbench.config import check_output_dir

    check_output_dir(str(tmp_path), "cfg")  # an existing directory
    check_output_dir(str(tmp_path / "a" / "b" / "c"), "cfg")  # under an existing one
    check_output_dir("relative/results", "cfg")
    assert list(tmp_path.iterdir()) == []


def test_yaml_merge_keys_and_aliases_are_not_duplicates():
    from blackboxbench.config import parse_yaml

    data = parse_yaml("a: &x {p: 1, q: 2}\nb:\n  <<: *x\n  p: 3\nc: [*x, *x]\n", "cfg")
    assert data["b"] == {"p": 3, "q": 2} and data["c"] == [{"p": 1, "q": 2}] * 2


def test_set_overrides_parse_values(tmp_path):
    from blackboxbench.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")))
    (exp,), _ = load_config(path, ["threat.eps=4/255", "seed=7", "threat.norm= linf", "dataset={name: digits}"])
    assert exp["threat"]["eps"] == "4/255" and exp["seed"] == 7 and exp["threat"]["norm"] == "linf"
    assert exp["dataset"] == {"name": "digits"}


def test_set_reaches_file_keys(tmp_path):
    """--set sets whole-file keys too: the board, the plots, the grid (a dotted grid key), one backend field."""
    from blackboxbench.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "backend: serial\n")
    exps, opts = load_config(path, ["leaderboard=b.csv", "grid.threat.eps=[1/255, 2/255]", "share_forwards=true",
                                    "backend.threads=1", "plots=[{recipe: aev_scatter, output: p.png}]"])
    assert opts["leaderboard"] == "b.csv" and opts["share_forwards"] is True and opts["backend"]["threads"] == 1
    assert [e["threat"]["eps"] for e in exps] == ["1/255", "2/255"] and opts["plots"][0]["output"] == "p.png"
    for e in exps:
        assert not {"leaderboard", "grid", "plots", "backend", "share_forwards"} & set(e)


def test_set_can_switch_the_board_off(tmp_path):
    from blackboxbench.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "leaderboard: b.csv\nrobustness: r.csv\n")
    _, opts = load_config(path, ["leaderboard=null", "robustness=null"])
    assert opts["leaderboard"] is None and opts["robustness"] is None


def test_set_output_dir_moves_the_board_and_plots(tmp_path):
    """A redirected output_dir takes the file's board, robustness CSV and plots with it (inside the old folder: same
    place under the new one; elsewhere: the new folder, same name), unless --set names them too."""
    from blackboxbench.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", "res/a") + "leaderboard: res/a/sub/board.csv\nrobustness: elsewhere/r.csv\n"
                    "plots:\n  - {recipe: aev_scatter, output: res/a/plot.png}\n")
    new = str(tmp_path / "b")
    (exp,), opts = load_config(path, [f"output_dir={new}"])
    assert exp["output_dir"] == new and opts["leaderboard"] == f"{new}/sub/board.csv"
    assert opts["robustness"] == f"{new}/r.csv" and opts["plots"][0]["output"] == f"{new}/plot.png"
    _, opts = load_config(path, [f"output_dir={new}", "leaderboard=keep.csv"])
    assert opts["leaderboard"] == "keep.csv" and opts["robustness"] == f"{new}/r.csv"
    _, opts = load_config(path, [])
    assert opts["leaderboard"] == "res/a/sub/board.csv" and opts["plots"][0]["output"] == "res/a/plot.png"


@pytest.mark.parametrize("sets,key,expect", [
    (["leaderbord=x.csv"], "leaderbord", "did you mean: leaderboard"),
    (["run=[]"], ":run:", "did you mean: runs"),
    (["plots.x=1"], "plots.x", "takes a whole value"),
    (["output_dir=5"], "output_dir", "expected str"),
    (["grid.threat.eps=3"], "grid.threat.eps", "non-empty list"),
])
def test_bad_file_key_sets_are_one_line(tmp_path, capsys, sets, key, expect):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")))
    assert main(["run", str(path), "--quiet", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and key in err and expect in err, err


def test_file_key_inside_a_run_says_where_it_belongs(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "runs:\n  - {leaderboard: x.csv}\n")
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "runs[0].leaderboard" in err and "top level" in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is available")
def test_cuda_without_device_is_a_config_error(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "device: cuda\n")
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}:device: 'cuda' requested but no CUDA device" in err and not (tmp_path / "out").exists()


def test_an_error_in_one_run_of_several_says_which(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"dataset: {{name: digits, n: 4}}\nthreat: {{norm: linf, eps: 0.2, max_queries: 50}}\n"
                    f"output_dir: {tmp_path / 'out'}\nruns:\n  - {{attack: square_linf, model: digits_mlp}}\n"
                    "  - {attack: i_fgsm, surrogates: [digits_cnn], targets: [digits_mlp]}\n")
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {path}:threat.max_queries: only for decision, score attacks (in run 2 of 2: attack "
                   "i_fgsm)"), err


def test_a_bad_data_root_from_the_environment_blames_the_environment(tmp_path, capsys, monkeypatch):
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")))
    monkeypatch.setenv("BLACKBOXBENCH_DATA", str(tmp_path / "nope"))
    assert main(["run", str(path), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: environment variable BLACKBOXBENCH_DATA: data root "
                                               f"{tmp_path / 'nope'} is not a directory")


def test_a_mapping_spec_takes_the_colon_form(tmp_path, capsys):
    """``{name: "timm:resnet18", pretrained: false}`` is ``timm:resnet18`` with a parameter (it was an unknown
    model 'timm:resnet18'); an arch given twice is a one-line error."""
    from blackboxbench.config import load_config
    path = tmp_path / "c.yaml"
    path.write_text('dataset: {name: digits, n: 2}\nmodel: {name: "timm:resnet18", pretrained: false}\n'
                    f"attack: square_linf\noutput_dir: {tmp_path / 'o'}\n")
    (exp,), _ = load_config(path)
    assert exp["model"] == {"name": "timm", "arch": "resnet18", "pretrained": False}
    path.write_text(path.read_text().replace("pretrained: false", "arch: vgg11"))
    assert main(["run", str(path), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "model.arch: arch given twice: in name 'timm:resnet18' and as arch 'vgg11'")


@pytest.mark.parametrize("extra,key,expect", [
    ("leaderboard: CFG/board.csv", "leaderboard", "cfg.yaml exists and is not a directory"),
    ("robustness: TMP/rob.csv", "robustness", "TMP/rob.csv is a directory"),
    ("plots: [{recipe: aev_bar, output: TMP/ro/asr.png}]", "plots[0].output", "TMP/ro is not writable"),
])
def test_board_and_plots_are_checked_before_any_run(tmp_path, capsys, monkeypatch, extra, key, expect):
    """The files written after the runs (leaderboard, robustness CSV, plots) fail up front, naming the file and
    the key, not after the runs with a line naming neither."""
    import os
    (tmp_path / "rob.csv").mkdir()
    (tmp_path / "ro").mkdir()
    access = os.access  # root writes anywhere: this folder says it is read-only
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and str(p) != str(tmp_path / "ro"))
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out"))
                    + extra.replace("CFG", str(path)).replace("TMP", str(tmp_path)) + "\n")
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{path}:{key}: " in err and expect.replace("TMP", str(tmp_path)) in err, err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_an_l2_ball_holding_every_image_warns(tmp_path, capsys):
    """L2 eps 8 on the 8x8 digits is the whole [0, 1] cube: a run, with one warning naming the key."""
    import warnings
    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")).replace("square_linf", "square_l2")
                    .replace("norm: linf, eps: 8/255", "norm: l2, eps: 8").replace("n: 4", "n: 2"))
    with pytest.warns(UserWarning, match=r"threat.eps: l2 eps 8 is at least the diameter of the \[0, 1\] image "
                                         r"cube \(8 for 1x8x8 images\)"):
        assert main(["run", str(path), "--quiet"]) == 0
    path.write_text(path.read_text().replace("eps: 8", "eps: 1"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["run", str(path), "--quiet"]) == 0
    assert not [w for w in caught if "diameter" in str(w.message)]


def test_a_model_that_cannot_take_the_images_is_the_error_alone(tmp_path, capsys):
    """Grey 16 x 16 images into a CIFAR zoo model: the one-line error, without the warning that the model was
    trained on another size before it (two lines)."""
    import warnings
    from PIL import Image
    import numpy as np
    (tmp_path / "imf" / "a").mkdir(parents=True)
    Image.fromarray(np.full((16, 16), 30, dtype=np.uint8)).save(tmp_path / "imf" / "a" / "0.png")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: imagefolder, path: {tmp_path / 'imf'}, classes: {{a: 1}}, grayscale: true}}\n"
                   "model: {name: cifar_resnet20, pretrained: false}\nattack: square_linf\n"
                   f"output_dir: {tmp_path / 'o'}\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["run", str(cfg), "--quiet"]) == 2
    assert not [str(w.message) for w in caught if "was trained on" in str(w.message)]
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{cfg}:model: the model cannot take the images" in err, err


def test_a_run_merges_into_the_file_mappings(tmp_path):
    """A run's mapping merges key by key into the file's (``threat: {eps: ...}`` keeps the file's norm and budget),
    and one run's merge leaves the next run's view of the file as it was."""
    from blackboxbench.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(GOOD.replace("OUT", str(tmp_path / "out")) + "runs: [{threat: {eps: 4/255}}, {dataset: {n: 2}}]\n")
    (a, b), _ = load_config(path)
    assert a["threat"] == {"norm": "linf", "eps": "4/255", "max_queries": 10} and a["dataset"] == {"name": "digits",
                                                                                                   "n": 4}
    assert b["threat"] == {"norm": "linf", "eps": "8/255", "max_queries": 10} and b["dataset"] == {"name": "digits",
                                                                                                   "n": 2}


def test_recipe_overrides_merge_into_the_recipe():
    """A config's ``attack`` override of a catalog recipe: a block of the same name (or no name) keeps the recipe's
    other parameters, a block of another name replaces it whole, ``hyper`` merges key by key; the recipe itself is
    left as it was. A setting-keyed value resolves for the threat's norm or targeted mode."""
    from blackboxbench.builder import _merge_recipe, resolve_setting

    base = {"name": "r", "blocks": {"perturb": {"name": "square", "p_init": 0.05, "n": 3},
                                    "init": {"name": "stripes", "w": 2}, "accept": {"name": "greedy", "t": 1}},
            "hyper": {"a": 1, "b": 2}}
    over = {"blocks": {"perturb": {"p_init": 0.1}, "init": {"name": "zero", "k": 1},
                       "accept": {"name": "greedy", "t": 3}}, "hyper": {"b": 5}}
    got = _merge_recipe(base, over)
    assert got["blocks"] == {"perturb": {"name": "square", "p_init": 0.1, "n": 3}, "init": {"name": "zero", "k": 1},
                             "accept": {"name": "greedy", "t": 3}}
    assert got["hyper"] == {"a": 1, "b": 5} and base["hyper"] == {"a": 1, "b": 2}
    assert base["blocks"]["perturb"] == {"name": "square", "p_init": 0.05, "n": 3}
    linf, l2t = {"norm": "linf", "targeted": False}, {"norm": "l2", "targeted": True}
    assert resolve_setting({"linf": 1, "l2": 2}, l2t) == 2
    assert resolve_setting({"untargeted": 100, "targeted": 300}, l2t) == 300
    assert resolve_setting({"untargeted": 100, "targeted": 300}, linf) == 100
    assert resolve_setting({"linf": 1, "p": 2}, l2t) == {"linf": 1, "p": 2}  # not a setting-keyed mapping
    with pytest.raises(ValueError, match="no value for this setting"):
        resolve_setting({"linf": 1}, l2t)


def test_set_value_may_hold_an_equals_sign_and_the_grey_level_hint_is_for_grey_levels_only(tmp_path, capsys):
    """``--set key=value`` splits at the first ``=`` (a value may hold one); the "did you mean N/255" hint of a linf
    eps out of range is for 1 < eps <= 255 (grey levels), not for any large number."""
    from blackboxbench.config import parse_assignment

    assert parse_assignment("name=a=b", "cfg") == ("name", "a=b")
    path = tmp_path / "cfg.yaml"
    for eps, hint in (("8", True), ("300", False)):
        path.write_text(GOOD.replace("OUT", str(tmp_path / "out")).replace("8/255", eps))
        assert main(["run", str(path), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "threat.eps" in err and ("did you mean" in err) == hint, err
