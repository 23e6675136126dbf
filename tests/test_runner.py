"""End-to-end runs on the embedded digits data: records, determinism, resume after a killed process."""
import json
import zlib
from pathlib import Path

import pytest

from blackboxbench.cli import main
from blackboxbench.config import load_config
from blackboxbench.errors import BenchError
from blackboxbench.runner import run_experiment

REPO = Path(__file__).resolve().parent.parent

QUERY = """
dataset: {name: digits, n: 24}
model: digits_mlp
attack: square_linf
threat: {norm: linf, eps: 0.2, max_queries: 300}
batch_size: 8
device: cpu
seed: 3
output_dir: OUT
"""

TRANSFER = """
dataset: {name: digits, n: 24}
attack: {recipe: mi_fgsm, name: mi_fgsm_ce, blocks: {loss: {name: ce}}}  # CE also targeted (white-box bar below)
surrogates: [digits_cnn]
targets: [digits_mlp, digits_cnn]
threat: {norm: linf, eps: 0.2, targeted: TARGETED}
batch_size: 8
device: cpu
output_dir: OUT
"""


def _write(tmp_path, text, out, name="cfg.yaml", **subs):
    text = text.replace("OUT", str(out))
    for k, v in subs.items():
        text = text.replace(k, v)
    path = tmp_path / name
    path.write_text(text)
    return path


def _records(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("time"), r.pop("check")  # the checksum covers the time too
    return sorted(rows, key=lambda r: r["index"])


def _run(path, **kw):
    (exp,), _ = load_config(path)
    return run_experiment(exp, progress=False, **kw)


def test_query_run_records_and_determinism(tmp_path):
    cfg_a = _write(tmp_path, QUERY, tmp_path / "a", "a.yaml")
    cfg_b = _write(tmp_path, QUERY, tmp_path / "b", "b.yaml")
    run_a, summary = _run(cfg_a)
    run_b, _ = _run(cfg_b)
    rec = _records(run_a)
    assert [r["index"] for r in rec] == list(range(24))
    assert rec == _records(run_b)  # same seed -> identical per-sample records on CPU
    attacked = [r for r in rec if r["attacked"]]
    assert attacked and all(r["queries"] <= 300 and r["linf"] <= 0.2 + 1e-6 for r in attacked)
    assert all(r["queries"] == 0 for r in rec if not r["clean_correct"])
    assert summary["asr"] == sum(r["success"] for r in attacked) / len(attacked)
    assert summary["asr"] >= 0.5 and summary["budget"] == 300
    assert (Path(run_a) / "config.yaml").exists() and json.loads((Path(run_a) / "summary.json").read_text())


def test_different_seed_differs(tmp_path):
    run_a, _ = _run(_write(tmp_path, QUERY, tmp_path / "a", "a.yaml"))
    run_b, _ = _run(_write(tmp_path, QUERY.replace("seed: 3", "seed: 4"), tmp_path / "b", "b.yaml"))
    assert _records(run_a) != _records(run_b)


@pytest.mark.parametrize("targeted", ["false", "true"])
def test_transfer_run_per_target(tmp_path, targeted):
    text = TRANSFER if targeted == "false" else TRANSFER.replace("eps: 0.2", "eps: 0.3")  # targeted needs more
    run_dir, summary = _run(_write(tmp_path, text, tmp_path / "o", TARGETED=targeted))
    rec = _records(run_dir)
    assert set(rec[0]["targets"]) == {"digits_mlp", "digits_cnn"}
    per = summary["per_target"]
    assert per["digits_cnn"]["asr"] >= 0.9  # white-box on the surrogate itself
    assert summary["asr"] == pytest.approx((per["digits_mlp"]["asr"] + per["digits_cnn"]["asr"]) / 2)
    if targeted == "true":
        assert all(r["target"] is not None and r["target"] != r["label"] for r in rec)


def kill_and_resume(tmp_path, text, n, at=8):
    """Run the CLI on config ``text``, SIGKILL it once ``at`` records exist, append a torn line, re-run: no
    sample lost or duplicated, and the records equal those of an uninterrupted run. The killed process holds after
    the write that reaches ``at`` records (:class:`held_run.HeldRun`), so the kill lands mid-run on any machine: it
    used to poll a free-running process, which a fast machine could finish (or a loaded one see finish) first."""
    from held_run import HeldRun

    killed = _write(tmp_path, text, tmp_path / "k", "k.yaml")
    with HeldRun(killed, tmp_path / "k", at) as run:
        rec_file = run.wait_held()
        run.kill()
    partial = len(rec_file.read_text().splitlines())
    assert at <= partial < n
    with open(rec_file, "a") as f:
        f.write(f'{{"index": {n - 1}, "label"')  # a torn line as a crash mid-write would leave
    assert main(["run", str(killed), "--quiet"]) == 0
    resumed = _records(rec_file.parent)
    assert [r["index"] for r in resumed] == list(range(n))
    fresh_dir, _ = _run(_write(tmp_path, text, tmp_path / "f", "f.yaml"))
    assert resumed == _records(fresh_dir)


def test_resume_after_kill_equals_uninterrupted(tmp_path):
    """Kill the CLI mid-run with SIGKILL, re-run: no sample lost or duplicated, same records. 48 samples: the kill
    lands mid-run at any size now (the killed run holds, see :func:`kill_and_resume`); 200 made a free-running run
    likely, not certain, to outlast the poll."""
    kill_and_resume(tmp_path, QUERY.replace("n: 24", "n: 48").replace("max_queries: 300", "max_queries: 600"), 48)


def test_leaderboard_csv(tmp_path):
    import csv
    _run(_write(tmp_path, QUERY, tmp_path / "res", "a.yaml"))
    _run(_write(tmp_path, TRANSFER, tmp_path / "res", "b.yaml", TARGETED="false"))
    out = tmp_path / "lb.csv"
    assert main(["leaderboard", str(tmp_path / "res"), "-o", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 and {r["family"] for r in rows} == {"score", "transfer"}
    asr = [float(r["asr"]) for r in rows]
    assert asr == sorted(asr, reverse=True)
    assert all(r["config_hash"] and r["version"] for r in rows)
    assert rows[0]["targeted"] in ("False", "True") and float(rows[0]["eps"]) == 0.2


def test_plugin_block_from_config(tmp_path):
    """A config can import a file whose decorator registers a new block, and name that block."""
    (exp,), _ = load_config(REPO / "configs" / "plugin_example.yaml",
                            [f"output_dir={tmp_path}", "dataset.n=8", "targets=[digits_mlp]"])
    run_dir, summary = run_experiment(exp, progress=False)
    resolved = (Path(run_dir) / "config.yaml").read_text()
    assert "gaussian_noise" in resolved and summary["attack"] == "i_fgsm_noise"
    assert summary["per_target"]["digits_mlp"]["n"] > 0


def plugin_run_error(tmp_path, capsys, plugin, attack, threat="{norm: linf, eps: 0.2}"):
    """Run a digits config that imports ``plugin`` with ``attack`` (the YAML after ``attack:``, then more keys);
    it must stop with exit code 2: returns the last line it printed to stderr."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plugins: [{plugin}]\ndataset: {{name: digits, n: 8}}\nthreat: {threat}\n"
                   f"output_dir: {tmp_path / 'res'}\nattack: {attack}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("name,body,returned", [
    ("no_tensor", "return None", "NoneType"),
    ("half_height", "return x[:, :, ::2]", "a tensor of shape (8, 1, 4, 8)"),
    ("three_rows", "return x[:3]", "a tensor of shape (3, 1, 8, 8)")])
def test_plugin_transform_breaking_its_contract_is_one_line(tmp_path, capsys, name, body, returned):
    """A plugin transform that returns no tensor, another image shape or a row count that is no multiple of its
    input's stops the run with one line naming the block and its file, not a traceback from deep in the loss."""
    (tmp_path / "plug.py").write_text(
        "from blackboxbench.registry import TRANSFORM\n\n\n"
        f"@TRANSFORM.register('{name}', paper='test')\ndef {name}(ctx, x):\n    {body}\n")
    err = plugin_run_error(tmp_path, capsys, tmp_path / "plug.py", f"{{recipe: i_fgsm, blocks: {{transform: "
                           f"[{{name: {name}}}]}}}}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]")
    assert err == (f"error: transform '{name}' ({tmp_path / 'plug.py'}:4) returned {returned} for an input of "
                   "shape (8, 1, 8, 8): a transform returns K stacked copies of its input's rows, shaped "
                   "(K x 8, 1, 8, 8)"), err


QUERY_PLUGIN = '''import torch
from blackboxbench.registry import ACCEPT, INIT, PERTURB


@INIT.register("no_success", paper="test")
def no_success(ctx):
    return {"x_adv": ctx.problem.x.clone()}


@INIT.register("float_success", paper="test")
def float_success(ctx):
    return {"x_adv": ctx.problem.x.clone(), "success": torch.zeros(ctx.problem.n)}


@INIT.register("one_row", paper="test")
def one_row(ctx):
    return {"x_adv": ctx.problem.x.clone(), "success": torch.zeros(ctx.problem.n, dtype=torch.bool),
            "m": torch.zeros(1)}


@INIT.register("growing", paper="test")
def growing(ctx):  # a per-sample tensor whose shape follows the batch that enters: it cannot live in a slot
    return {**INIT.get("square_init_linf")(ctx), "m": torch.zeros(ctx.problem.n, ctx.problem.n)}


@ACCEPT.register("no_state", paper="test")
def no_state(ctx, state, proposal):
    return None


@ACCEPT.register("cropped_adv", paper="test")
def cropped_adv(ctx, state, proposal):  # the state's images lose half their rows: they no longer fit the slots
    return {**state, "x_adv": state["x_adv"][:, :, :4]}


@ACCEPT.register("half_margin", paper="test")
def half_margin(ctx, state, proposal):  # a per-sample tensor changes dtype between the step and the slots
    return {**state, "margin": state["margin"].half()}


@PERTURB.register("cropped_query", paper="test")
def cropped_query(ctx, state):  # asks the oracle about images that lost half their rows
    return ctx.oracle(state["x_adv"][:, :, :4])
'''


def test_plugin_loss_not_per_row_is_one_line(tmp_path, capsys):
    """A plugin loss that returns a batch mean (or anything but one value per row) stops the run in one line;
    summed as it is, a mean would silently scale every sample's gradient by 1/n."""
    (tmp_path / "lplug.py").write_text("from blackboxbench.registry import LOSS\n\n\n@LOSS.register('mean_ce', "
                                       "paper='test')\ndef mean_ce(ctx, logits, label):\n"
                                       "    return logits.log_softmax(1).gather(1, label[:, None]).mean().neg()\n")
    err = plugin_run_error(tmp_path, capsys, tmp_path / "lplug.py", "{recipe: i_fgsm, blocks: {loss: {name: "
                           "mean_ce}}}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]")
    assert err == (f"error: loss 'mean_ce' ({tmp_path / 'lplug.py'}:4) returned a tensor of shape () for 8 rows: a "
                   "loss returns one value per row, shaped (8,)"), err


@pytest.mark.parametrize("kind,body,returned", [
    ("gradient", "return grad_fn(x)[:1]", "a tensor of shape (1, 1, 8, 8)"),
    ("direction", "return grad.sum()", "a tensor of shape ()"),
    ("update", "return None", "NoneType"),
    ("direction", "return grad.sign().double()", "a tensor of torch.float64")])  # it failed deep in a convolution
def test_plugin_step_block_returning_another_shape_is_one_line(tmp_path, capsys, fresh_registries, kind, body,
                                                               returned):
    """Gradient, direction and update blocks return a tensor shaped like the images; anything else stops the run
    in one line naming the block (a wrong shape could otherwise broadcast silently into the iterate)."""
    args = {"gradient": "ctx, grad_fn, x, state", "direction": "ctx, grad, state", "update": "ctx, x_adv, direction"}
    (tmp_path / "splug.py").write_text(f"from blackboxbench.registry import {kind.upper()}\n\n\n"
                                       f"@{kind.upper()}.register('bad_{kind}', paper='test')\n"
                                       f"def bad_{kind}({args[kind]}):\n    {body}\n")
    listed = f"[{{name: bad_{kind}}}]" if kind != "update" else f"{{name: bad_{kind}}}"
    err = plugin_run_error(tmp_path, capsys, tmp_path / "splug.py", f"{{recipe: i_fgsm, blocks: {{{kind}: {listed}}}}}"
                           "\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]")
    assert err == (f"error: {kind} 'bad_{kind}' ({tmp_path / 'splug.py'}:4) returned {returned}: it returns a tensor "
                   "shaped like the images, (8, 1, 8, 8), of their dtype torch.float32"), err


@pytest.mark.parametrize("kind,body,returned,rule", [
    ("refine", "return models[0]", "Normalized", "a refine block returns a non-empty list of models (callables from "
                                               "images to logits)"),
    ("refine", "return []", "list", "a refine block returns a non-empty list of models (callables from images to "
                                    "logits)"),
    ("auxiliary", "return [1]", "list", "an auxiliary block returns a dict of named values for the loop's blocks "
                                        "(ctx.aux)")])
def test_plugin_refine_or_auxiliary_breaking_its_contract_is_one_line(tmp_path, capsys, kind, body, returned, rule):
    """A refine block returns the list of surrogates it made, an auxiliary block a dict of named values; anything
    else stops the run with one line naming the block (not a traceback where the loop first uses it)."""
    args = {"refine": "ctx, models", "auxiliary": "ctx"}[kind]
    name = f"bad_{kind}_{zlib.crc32(body.encode())}"  # one name per case: a plugin registers its blocks for good
    (tmp_path / "rplug.py").write_text(f"from blackboxbench.registry import {kind.upper()}\n\n\n"
                                       f"@{kind.upper()}.register('{name}', paper='test')\n"
                                       f"def {name}({args}):\n    {body}\n")
    err = plugin_run_error(tmp_path, capsys, tmp_path / "rplug.py", f"{{recipe: i_fgsm, blocks: {{{kind}: "
                           f"[{{name: {name}}}]}}}}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]")
    assert err == f"error: {kind} '{name}' ({tmp_path / 'rplug.py'}:4) returned {returned}: {rule}", err


@pytest.mark.parametrize("body,returned", [
    ("return None", "NoneType"),
    ("return ctx.problem.x[:, :1]", "a tensor of shape (2, 1, 64, 64)"),
    ("return (ctx.problem.x * 255).byte()", "a tensor of dtype torch.uint8"),
    ("return Crafted([], ctx.problem.x[:1], torch.zeros(2), 0.5)", "a Crafted holding list"),
    ("return Crafted(ctx.problem.x, torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), 0.5)",
     "a Crafted with 1 goal boxes and 1 labels"),
    ("return Crafted(ctx.problem.x, torch.zeros(2, 4), torch.zeros(1, dtype=torch.long), 0.5)",
     "a Crafted with 2 goal boxes and 1 labels")])
def test_plugin_detection_craft_breaking_its_contract_is_one_line(tmp_path, capsys, body, returned):
    """A detection craft block returns the batch's images (float, the batch's shape) or a Crafted holding them with
    one goal per image; anything else stops the run with one line naming the block."""
    name = f"bad_craft_{zlib.crc32(body.encode())}"
    (tmp_path / "dplug.py").write_text("import torch\nfrom blackboxbench.detection.attacks import Crafted\n"
                                       "from blackboxbench.registry import DET_CRAFT\n\n\n"
                                       f"@DET_CRAFT.register('{name}', paper='test')\n"
                                       f"def {name}(ctx, objective):\n    {body}\n")
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"plugins: [{tmp_path / 'dplug.py'}]\ndataset: {{name: shapes, n: 2}}\nsurrogates: [shapes_fcos]"
                   f"\ntargets: [shapes_fcos]\ndevice: cpu\noutput_dir: {tmp_path / 'res'}\n"
                   f"attack: {{recipe: tog_vanishing, blocks: {{craft: {{name: {name}}}}}}}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: craft '{name}' ({tmp_path / 'dplug.py'}:6) returned {returned} for 2 images: a craft "
                   "block returns the adversarial images, a float tensor shaped (2, 3, 64, 64), or a Crafted "
                   "holding them with one goal per image"), err


@pytest.fixture(scope="session")
def query_plugin(tmp_path_factory):
    """One plugin file for the cases (a plugin imported again from the same path registers nothing twice). Per
    session, not per module: pytest-xdist may run this module's cases apart, and a module fixture made again would
    register the same block names from a second path."""
    path = tmp_path_factory.mktemp("qplug") / "qplug.py"
    path.write_text(QUERY_PLUGIN)
    return path


@pytest.mark.parametrize("block,line,message", [
    ("init: {name: no_success}", 5, "must return state['success']"),
    ("init: {name: float_success}", 10, "returned state['success'] of dtype torch.float32 and shape (4,): it is an "
                                        "(n,) bool tensor"),
    ("init: {name: one_row}", 15, "returned state['m'] that is not a tensor with one row per sample (4)"),
    ("init: {name: growing}", 21, "returned state['m'] of torch.float32 and per-sample shape (1,), earlier "
                                  "torch.float32 and (4,)"),
    ("accept: {name: no_state}", 26, "returned NoneType: it returns the state dict, with the keys init gave it (it, "
                                     "margin, success, x_adv)"),
    ("accept: {name: cropped_adv}", 31, "returned state['x_adv'] of shape (4, 1, 4, 8), the images' is (4, 1, 8, 8)"),
    ("accept: {name: half_margin}", 36, "returned state['margin'] of torch.float16 and per-sample shape (), earlier "
                                        "torch.float32 and ()"),
    ("perturb: {name: cropped_query}", 41, ": oracle: query images must have shape (1, 8, 8), got (1, 4, 8)")])
def test_plugin_query_block_breaking_its_contract_is_one_line(tmp_path, capsys, query_plugin, block, line,
                                                              message):
    """Query blocks: an init without the state the loop needs or whose per-sample shapes change between the
    batches that enter the slots, or an accept that does not return the state or changes a shape or dtype of
    it, stops the run with one line naming the block and its file (4 slots: the first init gets 4 samples, a
    later one the 1 that takes a freed slot)."""
    err = plugin_run_error(tmp_path, capsys, query_plugin, f"{{recipe: square_linf, blocks: {{{block}}}}}\n"
                           "model: digits_mlp\nbatch_size: 4\nruns: [{threat: {max_queries: 50}}]")
    kind, name = block.split(":")[0], block.split("name: ")[1].rstrip("}")
    assert err == f"error: {kind} block '{name}' ({query_plugin}:{line}){'' if message[0] == ':' else ' '}{message}", err


def test_run_threads_option(tmp_path, capsys, monkeypatch):
    """``--threads N`` runs the config on N CPU threads, and each worker of a processes backend too; below 1 it is
    a one-line error before anything runs."""
    import torch

    import blackboxbench.sweep

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 4}}\nmodel: digits_mlp\nattack: square_linf\n"
                   f"threat: {{norm: linf, eps: 0.2, max_queries: 20}}\noutput_dir: {tmp_path / 'res'}\n")
    before = torch.get_num_threads()
    try:
        assert main(["run", str(cfg), "--quiet", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    seen = []
    monkeypatch.setattr(blackboxbench.sweep, "run_sweep", lambda exps, backend, *a: seen.append(backend) or [])
    try:
        assert main(["run", str(cfg), "--quiet", "--threads", "2", "--backend", "processes"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen[0]["name"] == "processes" and seen[0]["threads"] == 2
    capsys.readouterr()
    assert main(["run", str(cfg), "--quiet", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --threads must be >= 1 (CPU threads of this process), got 0"
    assert torch.get_num_threads() == before


def test_a_failed_run_lets_the_others_of_the_config_run(tmp_path, capsys, query_plugin):
    """Serial backend: the first run breaks its contract, the two after it still run to their summaries; the error is
    the last line, exit code 2 (as the processes backend does). run_sweep's serial loop does the same."""
    from blackboxbench.sweep import run_sweep

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plugins: [{query_plugin}]\ndataset: {{name: digits, n: 4}}\nmodel: digits_mlp\n"
                   f"threat: {{norm: linf, eps: 0.2, max_queries: 30}}\noutput_dir: {tmp_path / 'res'}\nruns:\n"
                   "  - {attack: {recipe: square_linf, name: boom, blocks: {perturb: {name: cropped_query}}}}\n"
                   "  - {attack: square_linf}\n  - {attack: simba_pixel}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: perturb block 'cropped_query'"), err
    done = sorted(p.parent.name.split("_digits")[0] for p in (tmp_path / "res").glob("*/summary.json"))
    assert done == ["simba_pixel", "square_linf"]
    exps, opts = load_config(cfg, [f"output_dir={tmp_path / 'sweep'}"])
    seen = []
    with pytest.raises(BenchError, match="cropped_query"):
        run_sweep(exps, opts["backend"], done=seen.append)
    assert len(seen) == 2


def test_an_edited_plugin_gets_a_new_run_folder(tmp_path):
    """The run hash covers a plugin's source, not only its name: after an edit the run cannot resume (and silently
    reuse) the records of the old code. A config without plugins keeps its hash."""
    from blackboxbench.runner import Runner

    plug = tmp_path / "edit_plug.py"
    plug.write_text("from blackboxbench.registry import PERTURB\n")
    cfg = tmp_path / "c.yaml"
    base = (f"dataset: {{name: digits, n: 4}}\nmodel: digits_mlp\nattack: square_linf\n"
            f"threat: {{norm: linf, eps: 0.2, max_queries: 30}}\noutput_dir: {tmp_path / 'res'}\n")
    cfg.write_text(f"plugins: [{plug.name}]\n" + base)

    def folder():
        (exp,), _ = load_config(cfg)
        return Runner(exp, progress=False).run_dir

    first = folder()
    assert folder() == first
    plug.write_text("from blackboxbench.registry import PERTURB  # edited\n")
    assert folder() != first
    cfg.write_text(base)
    plain = folder()
    cfg.write_text("plugins: []\n" + base)
    assert folder() == plain


@pytest.mark.parametrize("mode,body,message", [
    ("out_of_range", "return torch.full_like(y, logits.shape[1])", "returned class ids 10..10: they must be in [0, 10)"),
    ("one_row", "return y[:1]", "returned torch.int64 of shape (1,): it returns one integer class id per sample, "
                                "shape (4,)"),
    ("floats", "return (y + 1).float() % 10", "returned torch.float32 of shape (4,)")])
def test_a_plugin_target_label_mode_is_checked_before_the_run(tmp_path, capsys, mode, body, message):
    """A target-label mode that returns targets outside the classes, of another shape or not integers is a one-line
    config error before the run folder exists (not an index error deep in a loss, mid-run)."""
    plug = tmp_path / "tl.py"
    plug.write_text("import torch\nfrom blackboxbench.registry import TARGET_LABEL\n\n\n"
                    f"@TARGET_LABEL.register('{mode}', paper='test')\ndef {mode}(logits, y, rng, given):\n"
                    f"    {body}\n")
    err = plugin_run_error(tmp_path, capsys, plug, "square_linf\nmodel: digits_mlp",
                           f"{{norm: linf, eps: 0.2, max_queries: 20, targeted: true, target_label: {mode}}}")
    assert err.startswith(f"error: {tmp_path / 'c.yaml'}:threat.target_label: target_label '{mode}' ({plug}:"), err
    assert message.replace("(4,)", "(8,)") in err, err
    assert not (tmp_path / "res").exists()


def test_a_plugin_dataset_that_returns_no_dataset_is_one_line(tmp_path, capsys):
    (tmp_path / "ds.py").write_text("from blackboxbench.registry import DATASET\n\n\n@DATASET.register('bad_ds', "
                                    "paper='test')\ndef bad_ds(data_root=None, *, n=None):\n    return {'x': 1}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plugins: [ds.py]\ndataset: {{name: bad_ds, n: 4}}\nmodel: digits_mlp\nattack: square_linf\n"
                   f"threat: {{norm: linf, eps: 0.2, max_queries: 20}}\noutput_dir: {tmp_path / 'res'}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{cfg}:dataset: dataset block 'bad_ds'" in err and "returned dict: it returns a Dataset" in err, err
    assert not (tmp_path / "res").exists()


def test_several_surrogates_without_a_fusing_block_fail_before_the_run(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dataset: {name: digits, n: 4}\nattack: {recipe: i_fgsm, hyper: {iterations: 2}}\n"
                   "surrogates: [digits_cnn, digits_lenet]\ntargets: [digits_mlp]\nthreat: {norm: linf, eps: 0.2}\n"
                   f"output_dir: {tmp_path / 'res'}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {cfg}:surrogates: 2 surrogates, but attack 'i_fgsm' has no refine block to fuse them: "
                   "add one, e.g. attack: {recipe: ..., blocks: {refine: [logit_ensemble]}}"), err
    assert not (tmp_path / "res").exists()


def _metric_plugin(tmp_path, name, body="return (x_adv - x).flatten(1).abs().sum(1)", better="'lower'"):
    path = tmp_path / f"{name}.py"
    path.write_text("from blackboxbench.registry import METRIC\n\n\n"
                    f"@METRIC.register('{name}', better={better})\ndef {name}(x_adv, x):\n    {body}\n")
    return path


def test_plugin_metric_reaches_summary_and_leaderboard(tmp_path, fresh_registries):
    """A plugin's metric is recorded per sample, summarized (mean and median over the attacked samples, as L2) and
    exported as leaderboard columns, also by an export that has not imported the plugin (not ranked there)."""
    import csv
    import statistics
    from blackboxbench.leaderboard import columns
    from blackboxbench.registry import METRIC, restore, snapshot
    before = snapshot()
    plugin = _metric_plugin(tmp_path, "l1dist")
    cfg = _write(tmp_path, f"plugins: [{plugin}]\n" + TRANSFER, tmp_path / "res", TARGETED="false")
    run_dir, summary = _run(cfg)
    rec = [r for r in _records(run_dir) if r["attacked"]]
    assert all(r["l1dist"] >= r["l2"] > 0 for r in rec)  # L1 >= L2 for every perturbation
    assert summary["mean_l1dist"] == pytest.approx(statistics.mean(r["l1dist"] for r in rec))
    assert summary["median_l1dist"] == pytest.approx(statistics.median(r["l1dist"] for r in rec))
    assert dict(columns())["mean_l1dist"] == "lower"
    restore(before)  # as in a new process: the plugin's metric is no longer registered
    assert "l1dist" not in METRIC and "mean_l1dist" not in dict(columns())
    out = tmp_path / "lb.csv"
    assert main(["leaderboard", str(tmp_path / "res"), "-o", str(out)]) == 0
    (row,) = list(csv.DictReader(out.open()))
    assert float(row["mean_l1dist"]) == pytest.approx(summary["mean_l1dist"])
    assert float(row["median_l2"]) == pytest.approx(summary["median_l2"])


def test_plugin_metric_reaches_the_robustness_csv(tmp_path, fresh_registries):
    """The robustness CSV keeps the mean of every metric a query run summarized: a plugin's (here exported by a
    process that has not imported it), L2 and Linf, before the columns that name the run."""
    import csv
    from blackboxbench.registry import restore, snapshot
    before = snapshot()
    plugin = _metric_plugin(tmp_path, "l1dist")
    _, summary = _run(_write(tmp_path, f"plugins: [{plugin}]\n" + QUERY, tmp_path / "res"))
    restore(before)
    out = tmp_path / "rob.csv"
    assert main(["robustness", str(tmp_path / "res"), "-o", str(out)]) == 0
    reader = csv.DictReader(out.open())
    (row,) = list(reader)
    assert reader.fieldnames[-3:] == ["wall_time", "config_hash", "run"]
    assert set(reader.fieldnames[-6:-3]) == {"mean_l1dist", "mean_l2", "mean_linf"}
    assert float(row["mean_l1dist"]) == pytest.approx(summary["mean_l1dist"]) and summary["mean_l1dist"] > 0


@pytest.mark.parametrize("name,body,better,error", [
    ("rowsum", "return (x_adv - x).flatten(1).sum(1, keepdim=True)", "'lower'",
     # the pre-run probe: 2 images
     " must return a tensor of shape (2,), one value per image; got a tensor of shape (2, 1)"),
    ("queries", "return (x_adv - x).flatten(1).abs().sum(1)", "'lower'",
     ": 'queries' is a field of the score family's records; register the metric under another name"),
    ("_image", "return (x_adv - x).flatten(1).abs().sum(1)", "None",
     ": '_image' is not a plain name; register the metric under another name")])
def test_plugin_metric_breaking_its_contract_is_one_line(tmp_path, capsys, fresh_registries, name, body, better,
                                                         error):
    """A plugin metric that answers other than one value per image, or whose name is a record field it would
    overwrite, stops the run before its folder exists with one line naming the metric and its file."""
    plugin = _metric_plugin(tmp_path, name, body, better)
    err = plugin_run_error(tmp_path, capsys, plugin, "square_linf\nmodel: digits_mlp",
                           "{norm: linf, eps: 0.2, max_queries: 50}")
    assert err == f"error: metric '{name}' ({plugin}:4){error}", err
    assert not (tmp_path / "res").exists()


def test_plugin_metric_direction_checked_at_registration(tmp_path, capsys, fresh_registries):
    plugin = _metric_plugin(tmp_path, "l1dist", better="'smaller'")
    err = plugin_run_error(tmp_path, capsys, plugin, "square_linf\nmodel: digits_mlp")
    assert err.endswith(f"metric 'l1dist' ({plugin}:4): better must be one of lower, higher, None, "
                        "got 'smaller'"), err


def test_metric_whose_summary_column_a_family_writes_is_refused(fresh_registries):
    """``drop_map`` would write ``mean_drop_map``, the detection family's own mAP drop column."""
    from blackboxbench.evaluation import check_metric_names
    from blackboxbench.registry import FAMILY, METRIC
    METRIC.register("drop_map")(lambda x_adv, x: (x_adv - x).flatten(1).abs().sum(1))
    fam = FAMILY.get("detection")
    with pytest.raises(BenchError, match="metric 'drop_map' .*: its summary column 'mean_drop_map' is one of the "
                                         "detection family's; register the metric under another name"):
        check_metric_names(fam.schema(), [c for c, _ in fam.columns], fam.name)
    check_metric_names(FAMILY.get("transfer").schema(), [c for c, _ in FAMILY.get("transfer").columns], "transfer")


def test_a_label_tells_apart_two_targets_of_one_model(tmp_path):
    """Targets with one label would merge into one column of results (refused, see test_config); ``label`` names
    a target's results, and its model is the same as without it."""
    text = TRANSFER.replace("targets: [digits_mlp, digits_cnn]",
                            "targets: [digits_mlp, {name: digits_mlp, label: mlp_again}]")
    _, summary = _run(_write(tmp_path, text, tmp_path / "o", TARGETED="false"))
    per = summary["per_target"]
    assert set(per) == {"digits_mlp", "mlp_again"} and per["digits_mlp"]["asr"] == per["mlp_again"]["asr"]
    assert summary["target_model"] == "digits_mlp, mlp_again"


def test_plugin_metric_nan_is_no_value(tmp_path, fresh_registries):
    """A metric undefined for some images (NaN) records None there; the summary's mean and median cover the others,
    and records and summary stay strict JSON (no NaN literal)."""
    import statistics
    body = "d = (x_adv - x).flatten(1).abs().sum(1)\n    d[::2] = float('nan')\n    return d"
    plugin = _metric_plugin(tmp_path, "halfdist", body)
    run_dir, summary = _run(_write(tmp_path, f"plugins: [{plugin}]\n" + TRANSFER, tmp_path / "res", TARGETED="false"))

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    rec = [strict(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]
    vals = [r["halfdist"] for r in rec if r["attacked"]]
    assert None in vals and any(v is not None for v in vals)
    assert strict((Path(run_dir) / "summary.json").read_text())["mean_halfdist"] == \
        pytest.approx(statistics.mean(v for v in vals if v is not None))


def test_one_target_average_interval_is_its_wilson_interval(tmp_path):
    """With one target the averaged ASR is that target's ASR: one interval (Wilson), not a second (bootstrap)."""
    _, summary = _run(_write(tmp_path, TRANSFER.replace("targets: [digits_mlp, digits_cnn]", "targets: [digits_mlp]"),
                             tmp_path / "o", TARGETED="false"))
    per = summary["per_target"]["digits_mlp"]
    assert (summary["asr"], summary["asr_low"], summary["asr_high"]) == (per["asr"], per["asr_low"], per["asr_high"])


def test_zoo_model_on_images_of_another_size_warns(tmp_path):
    """A CIFAR zoo model runs on 16 x 16 images (global pooling) but not as trained: one warning says so."""
    from PIL import Image
    import numpy as np
    for k in range(2):
        (tmp_path / "imf" / "a").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((16, 16, 3), 50 * k + 30, dtype=np.uint8)).save(tmp_path / "imf" / "a" / f"{k}.png")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: imagefolder, path: {tmp_path / 'imf'}, classes: {{a: 1}}}}\n"
                   "model: {name: cifar_resnet20, pretrained: false}\nattack: square_linf\n"
                   f"threat: {{norm: linf, eps: 0.03, max_queries: 5}}\noutput_dir: {tmp_path / 'o'}\n")
    with pytest.warns(UserWarning, match="model: cifar_resnet20 was trained on 32x32 images; dataset imagefolder "
                                         "gives 16x16"):
        _run(cfg)


WRITING_BLOCKS = {  # kind: (a block writing to its input x, an equivalent one that does not)
    "transform": ("from blackboxbench.registry import TRANSFORM as R\n\n\n"
                  "@R.register('writes', paper='test')\ndef writes(ctx, x):\n    x.data.zero_()\n    return x\n\n\n"
                  "@R.register('copies', paper='test')\ndef copies(ctx, x):\n    return x - x.detach()\n"),
    "gradient": ("import torch\nfrom blackboxbench.registry import GRADIENT as R\n\n\n"
                 "@R.register('writes', paper='test')\ndef writes(ctx, grad_fn, x, state):\n    x.zero_()\n"
                 "    return grad_fn(x)\n\n\n"
                 "@R.register('copies', paper='test')\ndef copies(ctx, grad_fn, x, state):\n"
                 "    return grad_fn(torch.zeros_like(x))\n")}


@pytest.mark.parametrize("kind", sorted(WRITING_BLOCKS))
def test_a_block_writing_to_its_input_leaves_the_iterate_alone(tmp_path, fresh_registries, kind):
    """A transform (gradient block) that zeroes its input ``x`` in place and one that computes the same from a
    zero copy give equal records: the attack's iterate was not touched."""
    (tmp_path / "wplug.py").write_text(WRITING_BLOCKS[kind])
    runs = []
    for name in ("writes", "copies"):
        text = f"plugins: [{tmp_path / 'wplug.py'}]\n" + TRANSFER.replace(
            "attack: {recipe: mi_fgsm, name: mi_fgsm_ce, blocks: {loss: {name: ce}}}",
            f"attack: {{recipe: i_fgsm, name: w, blocks: {{{kind}: [{{name: {name}}}]}}}}")
        run_dir, _ = _run(_write(tmp_path, text, tmp_path / name, f"{name}.yaml", TARGETED="false"))
        runs.append(_records(run_dir))
    assert runs[0] == runs[1]
