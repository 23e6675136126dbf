"""Engine v2: continuous batching, per-sample randomness, verified success as the record, the block context
(surrogates, assets), randomized targets and their success rule, adversarial images on disk.

Runs on the embedded digits data; the numerics test (logits that move with the batch size, a CPU proxy of TF32
and per-shape GPU kernels) runs on the pretrained CIFAR-10 ResNet-20 when the data root is there.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from blackboxbench.cli import main
from blackboxbench.config import validate_experiment
from blackboxbench.errors import BenchError
from blackboxbench.prep.models import _digits_model, build_model
from blackboxbench.query.common import start_state
from blackboxbench.registry import INIT, MODEL
from blackboxbench.runner import run_experiment

from attack_utils import Jitter, check_outputs, correctly_classified, run_query


@MODEL.register("test_digits_mlp_f64", dataset="digits")
def digits_mlp_f64(data_root=None):
    """The digits MLP in float64: its forward is batch-invariant on CPU (each row's logits do not depend on the
    rows computed with it)."""
    return _digits_model("digits_mlp", True).double()


class NoisyInput(nn.Module):
    """A randomized defense: Gaussian noise (std 0.05) on every input before the model (its own generator)."""

    def __init__(self, model, std):
        super().__init__()
        self.model, self.std, self.gen = model, std, torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.model(x + self.std * torch.randn(x.shape, generator=self.gen).to(x))


@MODEL.register("test_noisy_digits_mlp", dataset="digits")
def noisy_digits_mlp(data_root=None, *, std=0.05):
    return NoisyInput(_digits_model("digits_mlp", True), std)


@INIT.register("test_surrogate_fgsm_start", paper="test: a query init that uses the white-box surrogates",
               needs=("surrogates",))
def surrogate_fgsm_start(ctx):
    """Start from an FGSM step on the first surrogate (white-box), then query it once."""
    p, model = ctx.problem, ctx.surrogates[0]
    x = p.x.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(model(x), p.y)
    g, = torch.autograd.grad(loss, x)
    return start_state(ctx, p.project(x.detach() + p.eps * g.sign()), it=torch.zeros(p.n, dtype=torch.long,
                                                                                   device=p.x.device))


@INIT.register("test_asset_start", paper="test: a query init that reads a named asset")
def asset_start(ctx):
    """Start from ``clean + eps * sign(asset 'direction')`` (a tensor asset of the image's shape)."""
    p = ctx.problem
    d = ctx.assets["prior"]["direction"].to(p.x)
    return start_state(ctx, p.project(p.x + p.eps * d.sign()), it=torch.zeros(p.n, dtype=torch.long,
                                                                              device=p.x.device))


def _exp(tmp_path, **kw):
    exp = {"dataset": {"name": "digits", "n": 30}, "device": "cpu", "output_dir": str(tmp_path / "out"), "seed": 2}
    exp.update(kw)
    exp = validate_experiment(exp, "test")
    exp.update(_source="test", _base_dir=".")
    return exp


def _records(run_dir, drop=("time", "check")):
    rows = [json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]
    for r in rows:
        for k in drop:
            r.pop(k, None)
    return sorted(rows, key=lambda r: r["index"])


def records_by_batch_size(tmp_path, attack, norm, eps, targeted, budget=1000, model="test_digits_mlp_f64", **kw):
    """The records of one query run at batch sizes 1, 7 and 100 (more slots than samples) on a batch-invariant
    model (random target labels when targeted), on 16 digits unless ``kw`` names a dataset; ``kw`` adds
    experiment keys (e.g. ``surrogates``)."""
    runs = []
    kw.setdefault("dataset", {"name": "digits", "n": 16})
    for bs in (1, 7, 100):
        threat = {"norm": norm, "eps": eps, "max_queries": budget, "targeted": targeted}
        if targeted:
            threat["target_label"] = "random"
        run_dir, _ = run_experiment(_exp(tmp_path / str(bs), attack=attack, model=model, threat=threat,
                                         batch_size=bs, **kw), progress=False)
        runs.append(_records(run_dir))
    return runs



def records_by_probe_values(tmp_path, monkeypatch, attack, module, values, norm, eps, budget=1000, **kw):
    """The records of one query run on 16 digits (float64 MLP target, batch 16) for each ``PROBE_VALUES`` of
    ``values``, with the largest number of images ``module.query_margin`` was asked for in one call of each run:
    ``[(records, largest call), ...]``. ``kw`` adds experiment keys (e.g. ``surrogates``)."""
    from blackboxbench.query import common

    real, out = module.query_margin, []
    for v in values:
        monkeypatch.setattr(common, "PROBE_VALUES", v)
        calls = []
        monkeypatch.setattr(module, "query_margin", lambda c, images, idx=None: calls.append(len(images))
                            or real(c, images, idx))
        threat = {"norm": norm, "eps": eps, "max_queries": budget}
        run_dir, _ = run_experiment(_exp(tmp_path / str(v), attack=attack, model="test_digits_mlp_f64", threat=threat,
                                         batch_size=16, dataset={"name": "digits", "n": 16}, **kw), progress=False)
        out.append((_records(run_dir), max(calls)))
    return out

QUERY_CASES = [("square_linf", "linf", 0.2, False), ("square_l2", "l2", 1.5, False), ("nes", "linf", 0.2, False), ("simba_dct", "linf", 0.2, True),
               ("hsja_linf", "linf", 0.2, False), ("hsja_l2", "l2", 1.5, True), ("rays", "linf", 0.2, False)]


@pytest.mark.parametrize("attack,norm,eps,targeted", QUERY_CASES, ids=[c[0] for c in QUERY_CASES])
def test_query_records_do_not_depend_on_the_batch_size(tmp_path, attack, norm, eps, targeted):
    """batch_size 1, 7 and 100 (more slots than samples) give identical records on a batch-invariant model,
    targeted runs with random target labels included."""
    runs = records_by_batch_size(tmp_path, attack, norm, eps, targeted)
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 6  # the attack did something worth comparing


@pytest.mark.parametrize("attack", [
    {"recipe": "mi_di_ti_fgsm", "hyper": {"iterations": 10}},
    {"recipe": "mi_di_ti_si", "hyper": {"iterations": 3}},  # 5 copies per step, each DI-transformed per row
    {"recipe": "sia", "hyper": {"iterations": 2}},
    {"recipe": "ghostnet", "hyper": {"iterations": 6}},  # a fresh ghost per forward, drawn per sample
    {"recipe": "ghostnet", "hyper": {"iterations": 4, "copies_per_forward": 0},  # 5 scaled copies in one forward
     "blocks": {"transform": [{"name": "si", "copies": 5}]}}],
    ids=["mi_di_ti_fgsm", "mi_di_ti_si", "sia", "ghostnet", "ghostnet_si"])
def test_transfer_records_do_not_depend_on_the_batch_size(tmp_path, attack):
    runs = []
    for bs in (1, 7, 100):
        run_dir, _ = run_experiment(_exp(tmp_path / str(bs), attack=attack,
                                         surrogates=["test_digits_mlp_f64"], targets=["digits_cnn"], batch_size=bs,
                                         threat={"norm": "linf", "eps": 0.2, "targeted": True,
                                                 "target_label": "random"}), progress=False)
        runs.append(_records(run_dir))
    assert runs[0] == runs[1] == runs[2]


class Sizes(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.sizes = model, []

    def forward(self, x):
        self.sizes.append(x.shape[0])
        return self.model(x)


def test_continuous_batching_keeps_the_slots_full():
    """60 samples through 10 slots: every iteration forwards 10 images until the dataset drains (a fixed batch
    would shrink as its samples succeed)."""
    model = Sizes(_digits_model("digits_mlp", True))
    from blackboxbench.prep.data import digits

    ds = digits(n=60)
    _, res = run_query("square_linf", model, ds.x, ds.y, 0.2, "linf", budget=300, slots=10)
    assert res.attacked.sum() >= 50 and res.success[res.attacked].float().mean() > 0.9
    sizes = model.sizes
    last_full = max(i for i, s in enumerate(sizes) if s == 10)
    drained = sizes[last_full + 1:]  # after the last full forward: the tail, once no sample is left to start
    full_share = sum(s == 10 for s in sizes[:last_full + 1]) / (last_full + 1)
    assert full_share > 0.5, sizes[:50]  # the rest are clean checks, starts and audits of a few samples
    assert len(drained) < len(sizes) / 2


def test_images_in_any_memory_layout():
    """Images handed over in another memory layout (a strided view, as ``permute`` of HWC arrays gives) run as
    their contiguous copy does (square's state keeps flat views of the images)."""
    from blackboxbench.prep.data import digits

    ds = digits(n=12)
    model = _digits_model("digits_cnn", True)
    nhwc = ds.x.transpose(2, 3).contiguous().transpose(2, 3)
    assert not nhwc.is_contiguous() and torch.equal(nhwc, ds.x)
    _, a = run_query("square_linf", model, ds.x, ds.y, 0.2, "linf", budget=100)
    _, b = run_query("square_linf", model, nhwc, ds.y, 0.2, "linf", budget=100)
    assert torch.equal(a.x_adv, b.x_adv) and torch.equal(a.queries, b.queries)


def test_kill_9_transfer_run_resumes_identically(tmp_path):
    """36 samples: the kill lands mid-run at any size (the killed run holds, see test_runner's kill_and_resume); 120
    made a free-running run likely, not certain, to outlast the poll."""
    from test_runner import kill_and_resume

    text = """
dataset: {name: digits, n: 36}
attack: {recipe: mi_di_ti_fgsm, hyper: {iterations: 60}}
surrogates: [digits_cnn]
targets: [digits_mlp]
threat: {norm: linf, eps: 0.2}
batch_size: 6
device: cpu
output_dir: OUT
"""
    kill_and_resume(tmp_path, text, 36)


def test_save_adv_writes_the_returned_images(tmp_path):
    from PIL import Image

    run_dir, summary = run_experiment(_exp(tmp_path, attack="square_linf", model="digits_mlp", save_adv=True,
                                           batch_size=8, threat={"norm": "linf", "eps": 0.2, "max_queries": 200}),
                                      progress=False)
    records = _records(run_dir)
    files = sorted((Path(run_dir) / "adv").glob("*.png"))
    assert [int(f.stem) for f in files] == [r["index"] for r in records if r["attacked"]]
    from blackboxbench.prep.data import digits

    x = digits(n=30).x
    model = _digits_model("digits_mlp", True)
    for f in files:
        r = records[int(f.stem)]
        img = torch.from_numpy(np.array(Image.open(f))).float().div(255)[None, None]
        d = (img - x[r["index"]]).flatten()
        assert d.abs().max().item() == pytest.approx(r["linf"], abs=1e-6) and d.abs().max() <= 0.2 + 1e-6
        with torch.no_grad():
            assert (model(img).argmax(1).item() != r["label"]) == r["success"]  # the image the record describes


def test_surrogates_reach_query_blocks_and_never_equal_the_target(tmp_path, capsys):
    recipe = {"name": "surrogate_start_square", "family": "score", "norms": ["l2"], "targeted": False,
              "blocks": {"init": "test_surrogate_fgsm_start", "perturb": "square_l2", "accept": "margin_greedy"}}
    threat = {"norm": "l2", "eps": 1.5, "max_queries": 200}
    run_dir, summary = run_experiment(_exp(tmp_path, attack=recipe, model="digits_mlp", surrogates=["digits_cnn"],
                                           threat=threat), progress=False)
    assert summary["asr"] > 0.8 and summary["surrogates"] == "digits_cnn"
    cfg = tmp_path / "same.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 4}}\nmodel: digits_mlp\nsurrogates: [digits_mlp]\n"
                   f"attack: square_linf\noutput_dir: {tmp_path / 'never'}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "surrogates[0]" in err and "is the target model" in err and "\n" not in err.strip()
    assert not (tmp_path / "never").exists()
    cfg.write_text(cfg.read_text().replace("surrogates: [digits_mlp]", "surrogates: [{name: digits_mlp, label: s}]"))
    assert main(["run", str(cfg), "--quiet"]) == 2  # a label does not make it another model
    assert "surrogates[0]: the surrogate s is the target model" in capsys.readouterr().err
    with pytest.raises(BenchError, match="needs 'surrogates'"):  # a block that declares it needs them
        run_experiment(_exp(tmp_path / "none", attack=recipe, model="digits_mlp", threat=threat), progress=False)


def test_assets_reach_blocks(tmp_path):
    direction = torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(0))
    np.savez(tmp_path / "prior.npz", direction=direction.numpy())
    recipe = {"name": "asset_start_square", "family": "score", "norms": ["l2"], "targeted": False,
              "blocks": {"init": "test_asset_start", "perturb": "square_l2", "accept": "margin_greedy"}}
    run_dir, summary = run_experiment(_exp(tmp_path, attack=recipe, model="digits_mlp", data_root=str(tmp_path),
                                           assets={"prior": {"name": "tensors", "path": "prior.npz"}},
                                           threat={"norm": "l2", "eps": 1.5, "max_queries": 100}),
                                      progress=False)
    assert summary["n_attacked"] > 0
    with pytest.raises(BenchError, match="missing asset file"):
        run_experiment(_exp(tmp_path / "b", attack=recipe, model="digits_mlp", data_root=str(tmp_path),
                            assets={"prior": {"name": "tensors", "path": "nope.npz"}},
                            threat={"norm": "l2", "eps": 1.5}), progress=False)


def test_randomized_target_success_policy(tmp_path):
    """A noisy-input defense as a model plugin. The runner flags it as randomized. With the default rule a
    success is the one draw that confirmed it: the audit's own forward may disagree, which is flagged and counted,
    never turned into a failure. The majority rule asks k more draws, each counted as a query."""
    threat = {"norm": "linf", "eps": 0.2, "max_queries": 300}
    run_dir, single = run_experiment(_exp(tmp_path / "s", attack="square_linf", model="test_noisy_digits_mlp",
                                          threat=threat), progress=False)
    rec = [r for r in _records(run_dir) if r["attacked"]]
    assert single["randomized_models"] == "test_noisy_digits_mlp" and single["success_rule"] == "single"
    assert single["n_audit_disagree"] == sum(r["audit_adv"] != r["success"] for r in rec)
    assert single["asr"] == sum(r["success"] for r in rec) / len(rec) and single["asr"] > 0.5
    run_dir, major = run_experiment(_exp(tmp_path / "m", attack="square_linf", model="test_noisy_digits_mlp",
                                         threat={**threat, "success_rule": {"name": "majority", "draws": 5}}),
                                    progress=False)
    rec = [r for r in _records(run_dir) if r["attacked"]]
    assert major["success_rule"] == "majority of 5" and all(r["success_rule"] == "majority of 5" for r in rec)
    assert all(r["queries"] >= 6 for r in rec if r["success"])  # the start, then five confirming draws
    assert all(r["queries"] <= 300 for r in rec)


@pytest.mark.parametrize("name,norm,eps", [("hsja_linf", "linf", 8 / 255), ("hsja_l2", "l2", 1.0),
                                           ("rays", "linf", 8 / 255)])
def test_decision_attacks_survive_batch_dependent_logits(data_root, name, norm, eps):
    """4 CIFAR-10 images, ResNet-20, 10,000 queries, logits that move by 1e-3 with the batch size: every image is
    fooled, as on the clean model (measured on the first 10: 10/10 with and without the jitter for all three; the
    engine before the fix fooled 2/8 and 5/8 with HSJA), and every recorded success is adversarial again when each
    returned image is forwarded alone (batch size 1). The clean model's success is tests/test_decision_attacks.py's."""
    model = Jitter(build_model("cifar_resnet20", data_root))
    x, y = correctly_classified([model.model], data_root, n=4, pool=30)
    problem, res = run_query(name, model, x, y, eps, norm, budget=10_000)
    check_outputs(problem, res, model, 10_000)  # every success again at batch size 1, on the same model
    assert res.success.all(), res.queries


class TF32Round(nn.Module):
    """Every convolution of ``model`` computed on its input and weights rounded to TF32 (10 mantissa bits): a CPU
    proxy of TF32 convolutions and of low-precision targets (fp16, int8), whose decision is a rough function of
    the input at scales below about 1e-4 per pixel (the logits move by up to 0.017 on CIFAR-10 ResNet-20)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        for m in list(model.modules()):
            for child, conv in list(m.named_children()):
                if isinstance(conv, nn.Conv2d):
                    setattr(m, child, _TF32Conv(conv))

    def forward(self, x):
        return self.model(x)


class _TF32Conv(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    @staticmethod
    def round(t):
        i = t.contiguous().view(torch.int32)
        return ((i + 0x1000) & ~0x1FFF).view(torch.float32)  # round to nearest, 10 mantissa bits

    def forward(self, x):
        c = self.conv
        return nn.functional.conv2d(self.round(x), self.round(c.weight), c.bias, c.stride, c.padding, c.dilation,
                                    c.groups)


@pytest.mark.parametrize("name,norm,eps", [("hsja_linf", "linf", 8 / 255), ("hsja_l2", "l2", 1.0),
                                           ("rays", "linf", 8 / 255)])
def test_decision_attacks_survive_rough_targets(data_root, name, norm, eps):
    """4 CIFAR-10 images, ResNet-20 with TF32-rounded convolutions (:class:`TF32Round`), 10,000 queries: every
    image is fooled, as on the full-precision model. Before ``probe_balance`` HSJA's probes shrank below the
    rounding scale, where half its answers were lopsided (adversarial fraction 0.11 to 0.92) and its estimates
    noise: hsja_linf and hsja_l2 fooled 3/4 of these (3/8 and 6/8 of the first 8). RayS never needed it (8/8)."""
    base = build_model("cifar_resnet20", data_root)
    x, y = correctly_classified([base], data_root, n=4, pool=30)
    model = TF32Round(build_model("cifar_resnet20", data_root))
    problem, res = run_query(name, model, x, y, eps, norm, budget=10_000)
    check_outputs(problem, res, model, 10_000)
    assert res.success.all(), res.queries


def test_cuda_runs_turn_tf32_off(monkeypatch):
    """A CUDA run forwards in full float32: with cuDNN's default TF32 convolutions hsja_linf fooled 53-56 % of 32
    CIFAR-10 images on an H200 and 100 % without (benchmarks/RESULTS.md, "GPU run of 2026-12-04"). A CPU run
    leaves the flags as they are."""
    from blackboxbench.runner import resolve_device

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert resolve_device("cpu").type == "cpu" and torch.backends.cudnn.allow_tf32
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert resolve_device("auto").type == "cuda"
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _paths(run_dir):
    out = {}
    for f in sorted((Path(run_dir) / "path").glob("*.npz")):
        with np.load(f) as z:
            out[int(f.stem)] = (z["steps"].tolist(), z["images"].copy())
    return out


@pytest.mark.parametrize("attack,every", [("square_linf", 15), ("hsja_linf", 100)])
def test_save_path_every_writes_each_samples_path(tmp_path, attack, every):
    """Each attacked sample's path: its clean image at step 0, an iterate each time its queries pass a multiple
    of k, its returned image last (the adv PNG); every image inside the eps ball on the uint8 grid; the paths do
    not depend on the batch size (a batch-invariant model)."""
    from PIL import Image

    from blackboxbench.prep.data import digits

    x = digits(n=16).x
    runs = []
    for bs in (1, 7):
        run_dir, _ = run_experiment(_exp(tmp_path / str(bs), dataset={"name": "digits", "n": 16}, attack=attack,
                                         model="test_digits_mlp_f64", batch_size=bs, save_adv=True,
                                         save_path_every=every,
                                         threat={"norm": "linf", "eps": 0.2, "max_queries": 600}), progress=False)
        runs.append((_records(run_dir), _paths(run_dir), run_dir))
    (records, paths, run_dir), (records7, paths7, _) = runs
    assert records == records7 and paths.keys() == paths7.keys()
    assert all(paths[i][0] == paths7[i][0] and np.array_equal(paths[i][1], paths7[i][1]) for i in paths)
    assert sorted(paths) == [r["index"] for r in records if r["attacked"]]
    long_paths = 0
    for r in (r for r in records if r["attacked"]):
        steps, images = paths[r["index"]]
        assert steps[0] == 0 and steps[-1] == r["queries"] and steps == sorted(steps)
        levels = [s // every for s in steps[1:-1]]
        assert levels == sorted(set(levels)) and all(lv >= 1 for lv in levels)  # one snapshot per multiple passed
        clean = torch.from_numpy(images[0]).float().div(255)
        assert torch.equal(clean, x[r["index"]])
        adv = np.array(Image.open(Path(run_dir) / "adv" / f"{r['index']:06d}.png"))
        assert np.array_equal(images[-1][0], adv)
        d = torch.from_numpy(images.astype(np.float32) / 255) - x[r["index"]]
        assert d.abs().amax() <= 0.2 + 1e-6
        long_paths += len(steps) > 2
    assert long_paths >= 3  # some samples took several snapshots


def test_save_path_every_in_transfer_runs(tmp_path):
    run_dir, _ = run_experiment(_exp(tmp_path, dataset={"name": "digits", "n": 6}, attack={
        "recipe": "mi_fgsm", "hyper": {"iterations": 10}}, surrogates=["digits_cnn"], targets=["digits_mlp"],
        save_adv=True, save_path_every=4, threat={"norm": "linf", "eps": 0.2}), progress=False)
    paths = _paths(run_dir)
    assert sorted(paths) == list(range(6))
    for i, (steps, images) in paths.items():
        assert steps == [0, 4, 8, 10] and images.shape == (4, 1, 8, 8)
        from PIL import Image
        assert np.array_equal(images[-1][0], np.array(Image.open(Path(run_dir) / "adv" / f"{i:06d}.png")))


@pytest.mark.parametrize("extra,message", [
    ({"save_path_every": -1, "model": "digits_mlp", "attack": "square_linf"}, "save_path_every: must be >= 0"),
    ({"save_path_every": 2.5, "model": "digits_mlp", "attack": "square_linf"}, "save_path_every"),
])
def test_save_path_every_is_checked(tmp_path, extra, message):
    from blackboxbench.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _exp(tmp_path, threat={"norm": "linf", "eps": 0.2}, **extra)


def test_save_path_every_is_not_for_detection(capsys):
    from blackboxbench.cli import main

    config = Path(__file__).resolve().parent.parent / "configs" / "detection_quickstart.yaml"
    assert main(["run", str(config), "--set", "save_path_every=5"]) == 2
    assert "save_path_every: not used by detection attacks (only by decision, score, transfer)" in \
        capsys.readouterr().err


@pytest.fixture
def vandal_init(fresh_registries):
    """An init block that writes to everything the context lends it: the clean images and labels of its problem
    and the attacker's pool; it claims success on its (moved) clean images."""
    @INIT.register("vandal_init_t", paper="test")
    def vandal_init_t(ctx):
        ctx.problem.x.add_(0.3).clamp_(0, 1)
        ctx.problem.y.add_(1).remainder_(10)
        ctx.pool.x.zero_()
        ctx.pool.y.zero_()
        return {"x_adv": ctx.problem.x.clone(), "success": torch.ones(ctx.problem.n, dtype=torch.bool,
                                                                    device=ctx.device)}


def test_a_block_writing_to_its_context_changes_no_record(tmp_path, vandal_init):
    """The blocks' problem and pool are copies: records keep the true labels and clean checks, distances are to the
    true clean images (inside the ball), and success is confirmed against the true labels (the audit agrees)."""
    from blackboxbench.registry import DATASET
    recipe = {"name": "vandal", "family": "score", "norms": ["linf"], "targeted": False,
              "blocks": {"init": "vandal_init_t", "perturb": "square_linf", "accept": "margin_greedy"}}
    threat = {"norm": "linf", "eps": 0.1, "max_queries": 1}
    run_dir, summary = run_experiment(_exp(tmp_path, attack=recipe, model="digits_mlp", threat=threat,
                                           batch_size=4, save_adv=True), progress=False)
    data = DATASET.get("digits")(None, n=30)
    rec = _records(run_dir)
    assert [r["label"] for r in rec] == data.y.tolist()
    clean = build_model("digits_mlp")(data.x).argmax(1) == data.y
    assert [r["clean_correct"] for r in rec] == clean.tolist()  # a later sample's clean check: the true images
    for r in (r for r in rec if r["attacked"]):
        assert r["linf"] <= 0.1 + 1e-6 and r["audit_adv"] == r["success"]
    assert summary["n_audit_disagree"] == 0
    # the returned images against the true clean images: inside the ball, and the records' distances are theirs
    # (the vandal moved its copy of the clean images by 0.3: a worker reading that copy would return it, linf 0)
    from PIL import Image
    model = build_model("digits_mlp")
    for r in (r for r in rec if r["attacked"]):
        img = torch.from_numpy(np.array(Image.open(Path(run_dir) / "adv" / f"{r['index']:06d}.png"))).float()
        d = (img.div(255)[None, None] - data.x[r["index"]]).abs().max().item()
        assert d == pytest.approx(r["linf"], abs=1e-6) and 0 < d <= 0.1 + 1e-6, r["index"]
        with torch.no_grad():
            assert (model(img.div(255)[None, None]).argmax(1).item() != r["label"]) == r["success"]


@pytest.mark.parametrize("body,error", [
    ("ctx.oracle(torch.full_like(ctx.problem.x, 7.0))", "oracle: query images must be finite and in [0, 1], got "
                                                         "values in [7, 7]"),
    ("ctx.oracle(ctx.problem.x * float('nan'))", "oracle: query images must be finite and in [0, 1], got values in "
                                                 "[nan, nan]"),
    ("None", "returned state['x_adv'] of torch.float64, the images' is torch.float32")])
def test_queries_outside_the_image_domain_and_wrong_dtypes_are_one_line(tmp_path, fresh_registries, body, error):
    """The oracle refuses (and does not count) images that are not images; an init's x_adv of another dtype than
    the images is refused at once, naming the block (it used to fail later, blamed on another block)."""
    @INIT.register("odd_init_t", paper="test")
    def odd_init_t(ctx):
        eval(body)
        return {"x_adv": ctx.problem.x.double() if body == "None" else ctx.problem.x.clone(),
                "success": torch.zeros(ctx.problem.n, dtype=torch.bool, device=ctx.device)}

    recipe = {"name": "odd", "family": "score", "norms": ["linf"], "targeted": False,
              "blocks": {"init": "odd_init_t", "perturb": "square_linf", "accept": "margin_greedy"}}
    with pytest.raises(BenchError, match="odd_init_t") as e:
        run_experiment(_exp(tmp_path, attack=recipe, model="digits_mlp",
                            threat={"norm": "linf", "eps": 0.1, "max_queries": 5}), progress=False)
    assert error in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_surrogate_written_with_its_defaults_is_still_the_target(tmp_path, capsys):
    cfg = tmp_path / "same.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 4}}\nmodel: digits_mlp\nsurrogates: [{{name: digits_mlp, "
                   f"pretrained: true, label: s}}]\nattack: square_linf\noutput_dir: {tmp_path / 'never'}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    assert "surrogates[0]: the surrogate s is the target model" in capsys.readouterr().err


def test_the_oracle_view_lends_no_oracle():
    """A block's oracle view exposes asking, confirming and counts, not the oracle behind it (its forward, its
    counters, its budget)."""
    from blackboxbench.oracle import Oracle
    view = Oracle(build_model("digits_mlp"), 4, 10, 10, "score", (1, 8, 8)).view(torch.arange(2))
    assert not any(isinstance(v, Oracle) for k, v in vars(view).items() if not k.startswith("_"))


class _Scheduled(nn.Module):
    """A target whose answer for row r of a call is class ``plan[r]`` (plan: one row per forwarded image)."""

    def __init__(self, plan):
        super().__init__()
        self.plan, self.calls = plan, []

    def forward(self, x):
        self.calls.append(x.shape[0])
        out = torch.zeros(x.shape[0], 3)
        out[torch.arange(x.shape[0]), torch.tensor(self.plan[:x.shape[0]])] = 1.0
        return out


def _verify_ctx(model, n, randomized=False):
    from types import SimpleNamespace

    from blackboxbench.oracle import Oracle
    from blackboxbench.threat import Problem
    problem = Problem(torch.zeros(n, 1, 2, 2), torch.zeros(n, dtype=torch.long), 1.0, "linf", num_classes=3)
    oracle = Oracle(model, n, 20, 3, "label", input_shape=(1, 2, 2), randomized=randomized)
    return SimpleNamespace(problem=problem, oracle=oracle.view(torch.arange(n))), oracle


def test_verify_withdraws_claims_the_oracle_does_not_confirm():
    """A claim of success is confirmed by one counted query of the returned image; a claim the oracle answers
    non-adversarial is withdrawn from ``state['success']`` (the sample keeps being attacked), a confirmed one stays
    and is returned with its image; a sample that claims nothing costs nothing."""
    from blackboxbench.query.pipeline import verify

    model = _Scheduled([0, 2])  # claims of samples 0 and 2 forwarded in that order: 0 says "clean", 2 "fooled"
    ctx, oracle = _verify_ctx(model, 3)
    x_adv = torch.rand(3, 1, 2, 2)
    state = {"x_adv": x_adv, "success": torch.tensor([True, False, True])}
    now, rows, images = verify(ctx, state, draws=1)
    assert now.tolist() == [False, False, True] and rows.tolist() == [2]
    assert state["success"].tolist() == [False, False, True]
    assert oracle.counts.tolist() == [1, 0, 1] and model.calls == [2]
    two = ctx.problem.sub(torch.tensor([2]))
    assert torch.equal(images, two.quantize(two.project(x_adv[2:])))


def test_verify_majority_needs_a_strict_majority_of_the_draws():
    """The ``majority`` rule asks the image ``draws`` times (each counted) and confirms on a strict majority of
    adversarial answers: 3 of 5 confirms, 2 of 5 does not (rows of the call are draw-major: draw d of sample i is
    row 2 d + i)."""
    from blackboxbench.query.pipeline import verify

    adv = [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]  # sample 0 fooled on 2 of 5 draws, sample 1 on 3 of 5
    model = _Scheduled([adv[i][d] for d in range(5) for i in range(2)])
    ctx, oracle = _verify_ctx(model, 2, randomized=True)
    state = {"x_adv": torch.rand(2, 1, 2, 2), "success": torch.tensor([True, True])}
    now, rows, _ = verify(ctx, state, draws=5)
    assert now.tolist() == [False, True] and rows.tolist() == [1]
    assert state["success"].tolist() == [False, True] and oracle.counts.tolist() == [5, 5]


@pytest.mark.parametrize("claiming", [False, True], ids=["no-claim", "odd-labels-claim"])
def test_a_sample_whose_iteration_asks_nothing_leaves_stalled(tmp_path, fresh_registries, claiming):
    """A sample leaves its slot at the first iteration that asks the oracle nothing for it (it cannot progress),
    whether or not a sample of the batch claims success in that iteration: its record says ``stalled``, a failure,
    with the queries it used until then, not the budget; a claim confirmed in that iteration is a success, not
    stalled. Every sample asks once per iteration (its clean image) and nothing at its third; there (``claiming``)
    the samples of odd label claim success on the white image (one counted confirmation each), which fools the
    model or not."""
    from blackboxbench.registry import ACCEPT, PERTURB

    @INIT.register("stall_init_t", paper="test")
    def stall_init_t(ctx):
        return {"x_adv": ctx.problem.x.clone(), "success": torch.zeros(ctx.problem.n, dtype=torch.bool),
                "t": torch.zeros(ctx.problem.n, dtype=torch.long)}

    @PERTURB.register("stall_perturb_t", paper="test")
    def stall_perturb_t(ctx, state):
        state["t"] += 1
        ask = (state["t"] != 3).nonzero().squeeze(1)
        if ask.numel():
            ctx.oracle(ctx.problem.x[ask], ask)
        return None

    @ACCEPT.register("stall_accept_t", paper="test")
    def stall_accept_t(ctx, state, proposal):
        claim = (state["t"] == 3) & (ctx.problem.y % 2 == 1) & claiming
        state["x_adv"][claim] = 1.0
        state["success"] = claim
        return state

    recipe = {"name": "stall", "family": "score", "norms": ["linf"], "targeted": False,
              "blocks": {"init": "stall_init_t", "perturb": "stall_perturb_t", "accept": "stall_accept_t"}}
    run_dir, summary = run_experiment(_exp(tmp_path, attack=recipe, model="digits_mlp", batch_size=4,
                                           dataset={"name": "digits", "n": 12},
                                           threat={"norm": "linf", "eps": 1.0, "max_queries": 10}), progress=False)
    with torch.no_grad():
        white = build_model("digits_mlp")(torch.ones(1, 1, 8, 8)).argmax(1).item()
    attacked = [r for r in _records(run_dir) if r["attacked"]]
    for r in attacked:
        claims = claiming and r["label"] % 2 == 1
        fooled = claims and r["label"] != white
        assert (r["success"], r["stalled"], r["queries"]) == (fooled, not fooled, 3 if claims else 2), r
    assert {(r["label"] % 2, r["success"]) for r in attacked} == \
        ({(0, False), (1, False), (1, True)} if claiming else {(0, False), (1, False)})
    assert summary["n_stalled"] == sum(r["stalled"] for r in attacked)
