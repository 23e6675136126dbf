"""Bad input through the real entry points, generated for every catalog entry (a new recipe, defense, analysis
recipe or shipped config is covered automatically): each mutation must exit with status 2 and exactly one line on
stderr naming the file and the key path, never a traceback and never a silent acceptance.

Parse and build only: ``blackboxbench run`` is called with the runner's ``run_all`` (and the sweep's ``run_sweep``)
replaced by a stub that records the acceptance, so no data is read and no attack runs."""
import copy
import inspect
from pathlib import Path

import pytest
import yaml

from blackboxbench import catalog
from blackboxbench.builder import build_attack, validate_recipe
from blackboxbench.cli import main
from blackboxbench.config import finish_threat, load_yaml
from blackboxbench.registry import ANALYSIS as ANALYSIS_TOOLS, DEFENSE, FAMILY, block_params, is_numeric

REPO = Path(__file__).resolve().parent.parent
RECIPES = catalog.entries("attacks")
ANALYSIS = catalog.entries("analysis")
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
OTHER_FAMILY = {"score": "mi_fgsm", "decision": "mi_fgsm", "transfer": "square_linf", "detection": "square_linf"}


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    """``cli(doc_or_text, *args)`` -> (status, stderr, config path): ``blackboxbench run`` on the config (a mapping
    dumped as YAML, or YAML text), every check done, the runs themselves stubbed."""
    import blackboxbench.runner as runner
    import blackboxbench.sweep as sweep

    monkeypatch.setattr(runner, "run_all", lambda *a, **k: [])
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: [])
    path = tmp_path / "cfg.yaml"

    def call(doc, *args, command="run"):
        path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
        try:
            status = main([command, str(path), "--quiet", *args] if command == "run" else [command, *args])
        except BaseException as e:  # noqa: BLE001 - anything escaping main is the defect looked for
            capsys.readouterr()
            return "traceback", f"{type(e).__name__}: {e}", path
        return status, capsys.readouterr().err.strip(), path

    return call


def one_line(result, key, source=None):
    """None when ``result`` is a one-line error (status 2) naming ``source`` (default: the config) and ``key``."""
    status, err, path = result
    source = str(path) if source is None else source
    if status == 2 and "\n" not in err and "Traceback" not in err and source in err and f":{key}" in err:
        return None
    return f"status {status}: {err!r}"


def typo(key):
    return key[:-1] if len(key) > 3 else key + "x"


def base_doc(name, out):
    """A config that builds ``name`` on the embedded digits (or shapes) data: its models, the surrogates and
    assets its blocks declare they need."""
    recipe = load_yaml(RECIPES[name])
    family = validate_recipe(recipe, str(RECIPES[name]))
    doc = {"dataset": {"name": "digits", "n": 2}, "attack": name, "device": "cpu", "output_dir": str(out)}
    if recipe["family"] in ("score", "decision"):
        doc["model"] = "digits_mlp"
    elif recipe["family"] == "transfer":
        doc.update(surrogates=["digits_resnet"], targets=["digits_mlp"])
    else:
        doc.update(dataset={"name": "shapes", "n": 2}, surrogates=["shapes_fcos"], targets=["shapes_fcos_b"])
    attack = build_attack(recipe, finish_threat({}, recipe, family, "x"), str(RECIPES[name]))
    for need in attack.meta["needs"]:
        doc.setdefault(need, ["digits_cnn"])
    if attack.meta["assets"]:
        doc["assets"] = {a: {"name": kind} for a, (_, kind) in attack.meta["assets"].items()}
    return recipe, doc


def _specs(recipe):
    """[(kind, index in a list kind or None, spec mapping)] of a recipe's blocks."""
    out = []
    for kind, spec in recipe["blocks"].items():
        for i, s in (enumerate(spec) if isinstance(spec, list) else [(None, spec)]):
            out.append((kind, i, s if isinstance(s, dict) else {"name": s}))
    return out


def _override(name, recipe, kind, i, spec):
    """``attack:`` overriding one block of the recipe (a list kind: the whole list, that item replaced)."""
    value = spec
    if i is not None:
        value = copy.deepcopy(recipe["blocks"][kind])
        value[i] = spec
    return {"recipe": name, "blocks": {kind: value}}


def mutations(name, out):
    """[(description, config mapping, key path the error must name)] of one recipe."""
    recipe, doc = base_doc(name, out)
    fam = FAMILY.get(recipe["family"])
    found = []

    def add(desc, key, **changes):
        d = copy.deepcopy(doc)
        for k, v in changes.items():
            if v is KeyError:
                del d[k]
            else:
                d[k] = v
        found.append((desc, d, key))

    for k in doc:
        d = copy.deepcopy(doc)
        d[typo(k)] = d.pop(k)
        found.append((f"misspelt top-level key {k}", d, typo(k)))
    for k in ["dataset", "attack"] + [k for k in fam.model_keys if fam.model_keys[k].required]:
        add(f"missing {k}", k, **{k: KeyError})
    for k in ["dataset", "attack", "threat", "device", "seed", "batch_size", *fam.model_keys]:
        for v in (None, "", [], {}) if k in ("dataset", "attack", *fam.model_keys) else (None, ""):
            if (k in fam.model_keys and not fam.model_keys[k].required and v in ([], None)) or (k, v) == ("threat", {}):
                continue  # an optional list of models may be empty; an empty threat takes the defaults
            add(f"{k}={v!r}", k, **{k: v})
    for kind, i, spec in _specs(recipe):
        key = f"attack.blocks.{kind}" + ("" if i is None else f"[{i}]")
        add(f"unknown block at {key}", key, attack=_override(name, recipe, kind, i, {**spec, "name": "zzz_nope"}))
        fn = fam.blocks[kind].registry.get(spec["name"])
        for p, default in block_params(fn).items():
            if p in spec:
                bad = {(typo(q) if q == p else q): v for q, v in spec.items()}
                add(f"misspelt parameter {key}.{p}", f"{key}.{typo(p)}",
                    attack=_override(name, recipe, kind, i, bad))
            if default is inspect.Parameter.empty:
                continue
            values = ["eight"] if is_numeric(fn, p) else [3] if isinstance(default, str) else \
                ["yes"] if isinstance(default, bool) else []
            values += [] if default is None else [None]
            for v in values:
                add(f"{key}.{p}={v!r}", f"{key}.{p}", attack=_override(name, recipe, kind, i, {**spec, p: v}))
    big = 2 if recipe["norms"][0] == "linf" else 2e5
    for v in (-0.1, 0, big, "eight", [0.1], None, ""):
        add(f"eps={v!r}", "threat.eps", threat={"eps": v})
    add("unknown norm", "threat.norm", threat={"norm": "l3"})
    add("norm None", "threat.norm", threat={"norm": None})
    for k in ("norm", "eps", "targeted"):
        add(f"misspelt threat.{k}", f"threat.{typo(k)}", threat={typo(k): 1})
    if "max_queries" in fam.threat_keys:
        for v in (-5, 0, "abc", [10], None, 1.5, "1e4"):
            add(f"max_queries={v!r}", "threat.max_queries", threat={"max_queries": v})
    if not recipe["targeted"]:
        add("targeted on a recipe that cannot be", "threat.targeted", threat={"targeted": True})
    add("recipe of another family", "", attack=OTHER_FAMILY[recipe["family"]])
    add("unknown hyper key", "attack.hyper.zzz", attack={"recipe": name, "hyper": {"zzz": 1}})
    add("misspelt override", "attack.blokcs", attack={"recipe": name, "blokcs": {}})
    add("unknown block kind", "attack.blocks.zzzkind", attack={"recipe": name, "blocks": {"zzzkind": {"name": "x"}}})
    return doc, found


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_mutated_is_a_one_line_error(cli, tmp_path, name):
    doc, found = mutations(name, tmp_path / "out")
    result = cli(doc)
    assert result[:2] == (0, ""), result  # the base config builds
    doc["threat"] = {"eps": "8/255" if load_yaml(RECIPES[name])["norms"][0] == "linf" else 1}
    assert cli(doc)[0] == 0  # eps as arithmetic is accepted
    bad = [f"{desc}: {problem}" for desc, d, key in found if (problem := one_line(cli(d), key))]
    assert len(found) > 20 and not bad, bad[:5]
    assert not (tmp_path / "out").exists()


def test_a_recipe_inlined_and_mutated_is_a_one_line_error(cli, tmp_path):
    """An inline recipe (the whole mapping in the config): every recipe key misspelt, missing or of a wrong type."""
    recipe, doc = base_doc("square_linf", tmp_path / "out")
    bad = []
    for key in recipe:
        for desc, value, where in ((f"misspelt {key}", "typo", f"attack.{typo(key)}"),
                                   (f"missing {key}", "missing", f"attack.{key}"),
                                   (f"{key} a list", [1], f"attack.{key}"), (f"{key} None", None, f"attack.{key}")):
            r = dict(recipe)
            if value in ("typo", "missing"):
                v = r.pop(key)
                if value == "typo":
                    r[typo(key)] = v
                elif key not in ("name", "family", "norms", "targeted", "blocks"):
                    continue  # optional
            else:
                if key in ("paper", "defaults", "notes"):
                    continue  # documentation text
                r[key] = value
            if problem := one_line(cli({**doc, "attack": r}), where):
                bad.append(f"{desc}: {problem}")
    assert not bad, bad


@pytest.mark.parametrize("kind", ["transform", "gradient", "direction", "refine", "auxiliary"])
@pytest.mark.parametrize("value", [{}, "", 0, False, None, {"name": "di"}])
def test_a_list_of_blocks_takes_a_list(cli, tmp_path, kind, value):
    """A transfer recipe's list kinds take a list ([] for none): ``transform: {}`` (or '', 0, false, null) was
    silently read as no transform at all."""
    _, doc = base_doc("mi_di_ti_fgsm", tmp_path / "out")
    doc["attack"] = {"recipe": "mi_di_ti_fgsm", "blocks": {kind: value}}
    result = cli(doc)
    assert one_line(result, f"attack.blocks.{kind}", "mi_di_ti_fgsm.yaml") is None, result
    assert "must be a list of blocks" in result[1]
    doc["attack"] = {"recipe": "mi_di_ti_fgsm", "blocks": {kind: []}}
    assert cli(doc)[0] == 0


@pytest.mark.parametrize("name", DEFENSE.names())
def test_every_defense_mutated_is_a_one_line_error(cli, tmp_path, name):
    _, doc = base_doc("square_linf", tmp_path / "out")
    assert cli({**doc, "defense": name})[0] == 0
    fn = DEFENSE.get(name)
    cases = [("misspelt name", typo(name), "defense"), ("a list of one misspelt", [typo(name)], "defense[0]")]
    for p, default in block_params(fn).items():
        cases.append((f"misspelt {p}", {"name": name, typo(p): default}, f"defense.{typo(p)}"))
        for v in (["eight", [1]] if is_numeric(fn, p) else [[1], 3] if isinstance(default, (str, bool)) else []):
            cases.append((f"{p}={v!r}", {"name": name, p: v}, f"defense.{p}"))
    bad = [f"{desc}: {problem}" for desc, value, key in cases if (problem := one_line(cli({**doc, "defense": value}),
                                                                                      key))]
    assert not bad, bad


@pytest.mark.parametrize("value", ["", {}, {"sigma": 0.1}])
def test_an_empty_defense_is_refused(cli, tmp_path, value):
    """``defense: ''`` or ``{}`` named no defense and the run went undefended, silently."""
    _, doc = base_doc("square_linf", tmp_path / "out")
    assert one_line(cli({**doc, "defense": value}), "defense") is None
    assert cli({**doc, "defense": []})[0] == 0  # an empty list: no defense


@pytest.mark.parametrize("key", ["leaderboard", "robustness", "lpips_path", "data_root"])
def test_an_empty_path_is_refused(cli, tmp_path, key):
    """An empty path ('') read as 'none' (a board never written, the default LPIPS trunk, the environment's data
    root); null says none."""
    _, doc = base_doc("square_linf", tmp_path / "out")
    result = cli({**doc, key: ""})
    assert one_line(result, key) is None and "empty" in result[1], result
    assert cli({**doc, key: None})[0] == 0


def test_an_empty_plot_output_is_a_one_line_error(cli, tmp_path):
    _, doc = base_doc("square_linf", tmp_path / "out")
    result = cli({**doc, "plots": [{"recipe": "aev_bar", "output": ""}]})
    assert one_line(result, "plots[0].output") is None, result


@pytest.mark.parametrize("grid,key", [({"sed": [1, 2]}, "grid.sed"), ({"threat.epz": [0.1]}, "grid.threat.epz"),
                                      ({"leaderboard": ["a.csv"]}, "grid.leaderboard")])
def test_a_misspelt_grid_key_is_named_as_written(cli, tmp_path, grid, key):
    """The grid's keys were checked after expansion, under a name the file does not have (runs[0].sed)."""
    _, doc = base_doc("square_linf", tmp_path / "out")
    result = cli({**doc, "grid": grid})
    assert one_line(result, key) is None and "runs[0]" not in result[1], result


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_mutated_is_a_one_line_error(cli, tmp_path, path):
    """Each shipped config, copied: every top-level key misspelt, each run's keys misspelt, its attack unknown,
    its eps and norm wrong; and the YAML broken (a tab, a duplicate key, a list, an empty file)."""
    base = load_yaml(path)
    if "plugins" in base:
        base["plugins"] = [str((path.parent / p).resolve()) for p in base["plugins"]]
    base.update(output_dir=str(tmp_path / "out"))
    for key in ("leaderboard", "robustness", "plots"):
        base.pop(key, None)
    assert cli(base)[0] == 0
    cases = []
    for k in base:
        d = copy.deepcopy(base)
        d[typo(k)] = d.pop(k)
        cases.append((f"misspelt {k}", d, typo(k)))
    runs = base.get("runs") or []
    for i, run in list(enumerate(runs))[:1] + list(enumerate(runs))[1:][-1:]:  # the first and the last
        for k in run:
            d = copy.deepcopy(base)
            d["runs"][i] = {(typo(q) if q == k else q): v for q, v in run.items()}
            cases.append((f"runs[{i}] misspelt {k}", d, f"runs[{i}].{typo(k)}"))
    where = next((f"runs[{i}]" for i, r in enumerate(base.get("runs") or []) if "attack" in r), None)
    d = copy.deepcopy(base)
    (d["runs"][int(where[5:-1])] if where else d)["attack"] = "zzz_nope"
    cases.append(("unknown attack", d, "attack"))
    for k, v in (("eps", "eight"), ("norm", "l3"), ("eps", [1]), ("targeted", "yes")):
        d = copy.deepcopy(base)
        d.setdefault("threat", {})[k] = v
        for r in d.get("runs") or []:
            (r.get("threat") or {}).pop(k, None)
        cases.append((f"threat.{k}={v!r}", d, f"threat.{k}"))
    text = yaml.safe_dump(base, sort_keys=False)
    first = text.splitlines()[0].split(":")[0]
    cases += [("duplicate key", text + f"{first}: x\n", first), ("tab", "dataset:\n\tname: digits\n" + text, ""),
              ("a list", "- " + text.replace("\n", "\n  "), ""), ("empty", "", ""), ("syntax", text + "x: [1\n", "")]
    bad = [f"{desc}: {problem}" for desc, d, key in cases if (problem := one_line(cli(d), key))]
    assert not bad, bad
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(ANALYSIS))
def test_every_analysis_recipe_mutated_is_a_one_line_error(cli, tmp_path, name):
    """A misspelt --param names the command line (not the recipe file); a copy of the recipe with a misspelt,
    missing or mistyped key names the copy and the key."""
    recipe = load_yaml(ANALYSIS[name])
    tool_inputs = ANALYSIS_TOOLS.get(recipe["tool"]).registry_meta.get("inputs", "results")
    command = (["analyze", "--model", "digits_mlp", "--dataset", "digits", "-o", str(tmp_path / "a.png"), "-r"]
               if tool_inputs == "model" else ["plot", str(tmp_path / "none"), "-o", str(tmp_path / "p.png"), "-r"])

    def run(recipe_arg, *extra):
        return cli("", *command[1:], recipe_arg, *extra, command=command[0])[:2]

    status, err = run(name, "--param", "zzz_param=1")
    assert status == 2 and "\n" not in err and "command line (--param)" in err and "zzz_param" in err, err
    assert str(ANALYSIS[name]) not in err, err
    bad = []
    copy_path = tmp_path / f"{name}.yaml"
    for desc, change, key in [("misspelt tool", ("tool", "zzz_tool"), "tool"), ("tool None", ("tool", None), "tool"),
                              ("params a list", ("params", [1]), "params"), ("misspelt key", ("parms", {}), "parms"),
                              ("misspelt param", ("params", {"zzz": 1}), "params.zzz")]:
        r = {**recipe, change[0]: change[1]}
        copy_path.write_text(yaml.safe_dump(r))
        status, err = run(str(copy_path))
        if not (status == 2 and "\n" not in err and str(copy_path) in err and key in err):
            bad.append(f"{desc}: status {status}: {err!r}")
    copy_path.write_text(yaml.safe_dump(recipe) + "tool: again\n")
    status, err = run(str(copy_path))
    if not (status == 2 and "duplicate key" in err and "\n" not in err):
        bad.append(f"duplicate key: status {status}: {err!r}")
    assert not bad, bad


# ---------------------------------------------------------------- at load time: paths, model names, shapes
BAD_MODELS = '''
import torch
from blackboxbench.registry import MODEL


class Odd(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode, self.lin = mode, torch.nn.Linear(64, 10)

    def forward(self, x):
        out = self.lin(x.flatten(1))
        return {"one_row": out[:1], "double_rows": torch.cat([out, out]), "int": out.long()}[self.mode]


for mode in ("one_row", "double_rows", "int"):
    MODEL.register(f"audit_{mode}")(lambda data_root, *, pretrained=True, mode=mode: Odd(mode))
'''


def _run(tmp_path, capsys, doc):
    """The real ``blackboxbench run`` (the models and data load; a config that passes would run its attack)."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"device": "cpu", "output_dir": str(tmp_path / "out"), **doc}))
    try:
        status = main(["run", str(path), "--quiet"])
    except BaseException as e:  # noqa: BLE001
        return "traceback", f"{type(e).__name__}: {e}", path
    return status, capsys.readouterr().err.strip(), path


@pytest.mark.parametrize("mode,key,phrase", [
    ("one_row", "model", "answers 1 row of class scores for 3 images"),
    ("double_rows", "model", "answers 6 rows of class scores for 3 images"),
    ("one_row", "surrogates[0]", "answers 1 row of class scores for 3 images"),
    ("int", "surrogates[0]", "torch.int64 class scores"),
])
def test_a_model_answering_the_wrong_rows_is_refused(tmp_path, capsys, mode, key, phrase):
    """A model answering one row whatever the batch ran silently (every image read the first one's scores); two
    rows per image, or integer logits on a surrogate, were tracebacks deep inside the attack."""
    import sys

    from blackboxbench.registry import restore, snapshot

    plugin = tmp_path / "bad_models.py"
    plugin.write_text(BAD_MODELS)
    doc = {"plugins": [str(plugin)], "dataset": {"name": "digits", "n": 3}}
    if key == "model":
        doc.update(model=f"audit_{mode}", attack="square_linf", threat={"max_queries": 5})
    else:
        doc.update(surrogates=[f"audit_{mode}"], targets=["digits_cnn"], attack="i_fgsm")
    before = snapshot()
    try:
        result = _run(tmp_path, capsys, doc)
    finally:  # the plugin's models leave the registry with its module
        restore(before)
        for name in [m for m, mod in sys.modules.items() if getattr(mod, "__file__", None) == str(plugin)]:
            del sys.modules[name]
    assert one_line(result, key) is None and phrase in result[1], result
    assert not (tmp_path / "out").exists()


def _files(tmp_path):
    d = tmp_path / "files"
    (d / "dir.pt").mkdir(parents=True)
    (d / "dir.npz").mkdir()
    (d / "corrupt.pt").write_bytes(b"\x80\x02garbage" * 10)
    (d / "corrupt.npz").write_bytes(b"PK\x03\x04garbage" * 10)
    (d / "afile").write_text("x")
    return d


@pytest.mark.parametrize("case,key,phrase", [
    ("imagefolder path is a file", "dataset", "image folder FILES/afile is not a directory"),
    ("dataset file is a directory", "dataset", "file FILES/dir.npz is a directory, not a file"),
    ("checkpoint is a directory", "model", "checkpoint FILES/dir.pt is a directory, not a file"),
    ("asset is a directory", "assets.t", "asset file FILES/dir.pt is a directory, not a file"),
    ("asset npz corrupt", "assets.t", "asset file FILES/corrupt.npz is not an npz of arrays"),
    ("lpips corrupt", "lpips_path", "lpips: cannot read FILES/corrupt.pt (UnpicklingError)"),
    ("torchvision detector as a classifier", "model",
     "torchvision:fasterrcnn_resnet50_fpn is a detection model, not an image classifier"),
])
def test_bad_paths_and_names_at_load_time_are_one_line(tmp_path, capsys, case, key, phrase):
    """Each was a traceback (NotADirectoryError, BadZipFile, UnpicklingError, a URLError: torchvision reaching
    online for a detector's backbone) or a misleading 'missing' for a folder given where a file belongs."""
    d = _files(tmp_path)
    doc = {"dataset": {"name": "digits", "n": 2}, "model": "digits_mlp", "attack": "square_linf",
           "threat": {"max_queries": 5}}
    doc.update({
        "imagefolder path is a file": {"dataset": {"name": "imagefolder", "path": str(d / "afile"), "classes": ["a"]}},
        "dataset file is a directory": {"dataset": {"name": "mnist", "file": str(d / "dir.npz")}},
        "checkpoint is a directory": {"model": {"name": "checkpoint", "path": str(d / "dir.pt"),
                                                "arch": "digits_mlp"}},
        "asset is a directory": {"assets": {"t": {"name": "tensors", "path": str(d / "dir.pt")}}},
        "asset npz corrupt": {"assets": {"t": {"name": "tensors", "path": str(d / "corrupt.npz")}}},
        "lpips corrupt": {"lpips_path": str(d / "corrupt.pt")},
        "torchvision detector as a classifier": {"model": "torchvision:fasterrcnn_resnet50_fpn"},
    }[case])
    result = _run(tmp_path, capsys, doc)
    assert one_line(result, key) is None and phrase.replace("FILES", str(d)) in result[1], result
    assert not (tmp_path / "out").exists()


def test_a_torchscript_checkpoint_prints_no_deprecation_line(tmp_path, capsys):
    """torch.jit.load's FutureWarning was a second stderr line under every error (and every run) of a TorchScript
    checkpoint."""
    import warnings

    d = _files(tmp_path)
    with warnings.catch_warnings(record=True) as caught:  # the command line prints each as a line of stderr
        warnings.simplefilter("always")
        result = _run(tmp_path, capsys, {"dataset": {"name": "digits", "n": 2}, "attack": "square_linf",
                                         "model": {"name": "checkpoint", "path": str(d / "corrupt.pt")}})
    assert one_line(result, "model") is None and "is not a TorchScript file" in result[1], result
    assert not [str(w.message) for w in caught if "jit" in str(w.message)]


def test_compare_a_summary_without_its_dataset_is_one_line(tmp_path, capsys):
    """A hand-made or truncated summary.json lacking ``dataset`` was a KeyError traceback in compare."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"attack": "x", "family": "score", "asr": 0.5}')
    assert main(["compare", str(run), str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{run}: summary.json lacks the dataset" in err, err
