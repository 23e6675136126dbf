"""NonLinear-BA and PSBA: HSJA with probes decoded by an auto-encoder trained on the surrogates' input gradients
(``query/priors.py``).

The auto-encoder against the authors' CIFAR-10 layer shapes; a prior trained on the gradients of a linear model
steers the probes (the estimate finds the model's normal with a few probes, where HSJA's Gaussian probes do not);
PSBA's progressive scale rule on hand-made generators; the cache and the one-training-per-run memo; the
evaluation-image check (also for AdvFlow and NP-attack, which train the same way); batch-size invariance of records (float64 digits target); the real pretrained CIFAR-10
ResNet-56 with ResNet-20/32 surrogates, NonLinear-BA at L2 1.0 and PSBA at Linf 0.05 (skipped without the offline
data). The digits
contract (tests/test_contract.py) runs both recipes at every norm, targeted and not.
"""
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from blackboxbench.context import BlockContext
from blackboxbench.config import ConfigError
from blackboxbench.errors import BenchError
from blackboxbench.prep import trained
from blackboxbench.query import priors
from blackboxbench.query.hsja import estimate_direction, generator
from blackboxbench.query.priors import GradientAE, decode, pick_scale, reference_gradients, train_ae
from blackboxbench.runner import prepare, run_experiment

from attack_utils import count_calls, Linear2, make_ctx
from test_engine import _exp, _records

DATA = os.environ.get("BLACKBOXBENCH_DATA")
needs_data = pytest.mark.skipif(not DATA or not Path(DATA, "cifar10").is_dir(),
                                reason="needs the offline data root (BLACKBOXBENCH_DATA) with cifar10/")


def test_auto_encoder_is_the_authors_cifar10_ae192_at_side_32():
    """Side 32: convolutions 3 -> 12 -> 24 -> 48 (16, 8, 4 pixels), a 12 x 4 x 4 code, the mirror back; unit-norm
    output. Sides 16 and 8 keep the code and drop the first layers; any other side is a one-line error."""
    net = GradientAE(3, 32)
    convs = [m for m in net.encoder if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.stride, c.padding) for c in convs] == [
        (3, 12, (2, 2), (1, 1)), (12, 24, (2, 2), (1, 1)), (24, 48, (2, 2), (1, 1)), (48, 12, (2, 2), (3, 3))]
    x = torch.randn(5, 3, 32, 32)
    assert net.encoder(x).shape == (5, 12, 4, 4)
    out = net(x)
    assert out.shape == x.shape and torch.allclose(out.flatten(1).norm(dim=1), torch.ones(5), atol=1e-5)
    for side in (8, 16):
        assert GradientAE(1, side).encoder(torch.randn(2, 1, side, side)).shape == (2, 12, 4, 4)
    for side in (4, 12, 64):
        with pytest.raises(BenchError, match="side must be 8, 16 or 32"):
            GradientAE(3, side)



def test_codes_reach_the_decoder_at_unit_norm():
    """The auto-encoder decodes its encoder's output scaled to unit norm (the authors' code normalisation), and the
    attack's probes decode each sample's standard normal draws of a 12 x 4 x 4 code scaled to unit norm (their
    ``generate_ps``), resized to the image."""
    torch.manual_seed(0)
    net = GradientAE(3, 16)
    seen = []
    real = net.decode
    net.decode = lambda code: seen.append(code) or real(code)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        net(x)
        code, = seen
        enc = net.encoder(x).flatten(1)
        assert torch.allclose(code.flatten(1).norm(dim=1), torch.ones(4), atol=1e-6)
        assert torch.allclose((code.flatten(1) * enc).sum(1), enc.norm(dim=1), rtol=1e-5)  # the encoder's direction
        seen.clear()
        owner = torch.tensor([0, 0, 1])
        ctx = make_ctx(nn.Identity(), torch.full((2, 3, 8, 8), 0.5), torch.zeros(2, dtype=torch.long), 1.0, "l2", 10)
        probes = decode(net, ctx, owner, (3, 8, 8))
    draws = make_ctx(nn.Identity(), torch.full((2, 3, 8, 8), 0.5), torch.zeros(2, dtype=torch.long), 1.0, "l2",
                     10).rng.normal((12, 4, 4), rows=owner)
    code, = seen
    assert torch.allclose(code, draws / draws.flatten(1).norm(dim=1).view(-1, 1, 1, 1), atol=1e-6)
    assert probes.shape == (3, 3, 8, 8)


def test_resize_averages_areas_when_shrinking_and_is_bilinear_when_growing():
    """Shrinking by 2 or 4 averages each 2 x 2 or 4 x 4 block (the PSBA decodes of sides 16 and 32 onto 8 x 8
    digits, and the gradients onto the coarse sides; bilinear sampling would read 2 of every 4 pixels); growing
    2 x 2 to 4 x 4 is pixel-centre bilinear with clamped edges (weights 3/4, 1/4; the corners copy the coarse
    pixel)."""
    v = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    for k in (2, 4):
        blocks = v.view(2, 3, 8 // k, k, 8 // k, k).mean((3, 5))
        assert torch.allclose(priors.resize(v, (8 // k, 8 // k)), blocks, atol=1e-6)
    a = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    up = priors.resize(a.view(1, 1, 2, 2), (4, 4))[0, 0]
    w = torch.tensor([0.75, 0.25])
    assert torch.allclose(up[1, 1], w @ a @ w) and torch.allclose(up[2, 1], w.flip(0) @ a @ w)
    assert up[0, 0] == a[0, 0] and up[3, 3] == a[1, 1]
    assert priors.resize(v, (8, 8)) is v

def _ctx_with(model, x, surrogates=(), assets=None, pool=None):
    ctx = make_ctx(model, x, torch.zeros(len(x), dtype=torch.long), 1.0, "l2", 10_000, "label", num_classes=2)
    return BlockContext(problem=ctx.problem, rng=ctx.rng, oracle=ctx.oracle, surrogates=tuple(surrogates),
                        assets=assets or {}, pool=pool)


class LinearScores(nn.Module):
    """Two-class scores ``(0, w . (x - 0.5))`` of a fixed smooth direction ``w``: every input gradient is +-w."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        s = ((x - 0.5) * self.w).flatten(1).sum(1)
        return torch.stack([torch.zeros_like(s), s], 1)


def _linear_gradients():
    """A smooth direction ``w`` (1, 3, 16, 16) and the input gradients of :class:`LinearScores` at 256 points."""
    g = torch.Generator().manual_seed(0)
    w = nn.functional.interpolate(torch.randn(1, 3, 4, 4, generator=g), size=(16, 16), mode="bilinear")
    return w, reference_gradients([LinearScores(w)], torch.rand(256, 3, 16, 16, generator=g), 1, None)


def test_a_prior_trained_on_a_models_gradients_steers_the_probes():
    """Trained on the gradients of a linear model (all +-w), the decodes lie along w: 20 probes estimate the
    normal of that model's boundary to cosine > 0.6, where 20 Gaussian probes in 3 x 16 x 16 reach about
    sqrt(20 / 768) ~ 0.16."""
    w, grads = _linear_gradients()
    out = train_ae(grads, 16, epochs=30, lr=1e-3, batch=32, seed=0)
    assert out["cos"].item() > 0.95
    net = GradientAE(3, 16)
    net.load_state_dict(out["state"])
    with torch.no_grad():  # the reported figure: the mean over the training gradients of decode . target
        cos = (net(grads) * grads).flatten(1).sum(1)
    assert abs(out["cos"].item() - cos.mean().item()) < 1e-5 and cos.max() - cos.mean() > 1e-4
    flat = w.flatten()
    x0 = torch.full((2, 3, 16, 16), 0.5)
    ctx = make_ctx(Linear2(flat), x0, torch.zeros(2, dtype=torch.long), 1.0, "l2", 10_000, "label", num_classes=2)
    num, delta = torch.tensor([20, 20]), torch.full((2,), 0.01)
    learned, _ = estimate_direction(ctx, x0, num, delta, lambda owner, shape: decode(net, ctx, owner, shape))
    gauss, _ = estimate_direction(ctx, x0, num, delta, generator(ctx, "gaussian", 1.0))
    unit = flat / flat.norm()
    assert (learned.flatten(1) @ unit).min() > 0.6
    assert (gauss.flatten(1) @ unit).max() < 0.4


def _dead_first(monkeypatch, dead):
    """Auto-encoders whose first ``dead`` ones start with the code's last bias at -1000: their code stays zero."""
    made = []

    class DeadFirst(priors.GradientAE):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)
            if len(made) <= dead:
                nn.init.constant_(self.encoder[-2].bias, -1e3)

    monkeypatch.setattr(priors, "GradientAE", DeadFirst)
    return made


def test_a_training_that_ends_with_a_dead_code_starts_again(monkeypatch):
    """A dead code (every code unit zero on every training gradient) makes every decode one fixed direction: the
    training starts again from the next initialisation of the seeded stream and counts the restart."""
    made = _dead_first(monkeypatch, 1)
    out = train_ae(_linear_gradients()[1], 16, epochs=30, lr=1e-3, batch=32, seed=0)
    assert len(made) == 2 and int(out["restarts"]) == 1
    assert out["cos"].item() > 0.9
    assert not torch.equal(made[1].encoder[-2].bias, torch.full_like(made[1].encoder[-2].bias, -1e3))


def test_a_code_dead_after_every_training_is_a_one_line_error(monkeypatch):
    made = _dead_first(monkeypatch, priors.TRAININGS)
    with pytest.raises(BenchError, match=f"every code unit was zero on every training gradient after each of "
                                         f"{priors.TRAININGS} trainings"):
        train_ae(_linear_gradients()[1], 16, epochs=2, lr=1e-3, batch=32, seed=0)
    assert len(made) == priors.TRAININGS


class Fixed(nn.Module):
    """A stand-in generator whose decodes are ``mix * g + (1 - mix) * noise`` for a fixed direction ``g``."""

    def __init__(self, g, mix):
        super().__init__()
        self.g, self.mix, self.gen = g, mix, torch.Generator().manual_seed(int(mix * 100))

    def decode(self, code):
        noise = torch.randn((code.shape[0], *self.g.shape[1:]), generator=self.gen)
        noise = noise / noise.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        sign = torch.sign(code.flatten(1)[:, :1]).view(-1, 1, 1, 1)
        return sign * self.mix * self.g + (1 - self.mix) * noise


def _pick(mixes):
    """PSBA's scale for 3 samples under the linear surrogate of direction g, with generators of the given mixes."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1, 1, 8, 8, generator=g)
    w = w / w.norm()
    x = torch.full((3, 1, 8, 8), 0.5)
    ctx = _ctx_with(nn.Identity(), x, surrogates=[LinearScores(w)])
    return pick_scale(ctx, [Fixed(w, m) for m in mixes], x, 50)


def test_psba_picks_the_scale_of_the_best_simulated_estimate():
    """Each sample takes the scale whose simulated estimate best matches the surrogates' gradient, wherever it
    lies: [aligned 0.6, noise, aligned 0.9] takes the finest (the progressive rule, which stopped at the first
    scale whose estimate did not improve, kept the coarsest)."""
    assert _pick([0.0, 0.9, 0.0]).tolist() == [1, 1, 1]
    assert _pick([0.6, 0.0, 0.9]).tolist() == [2, 2, 2]
    assert _pick([0.9, 0.3, 0.0]).tolist() == [0, 0, 0]
    assert _pick([0.0, 0.3, 0.9]).tolist() == [2, 2, 2]
    assert _pick([0.5]).tolist() == [0, 0, 0]  # one scale: nothing to search



class Three(nn.Module):
    """Three-class scores ``(0, w1 . (x - 0.5), 1.5 w2 . (x - 0.5))``."""

    def __init__(self, w1, w2):
        super().__init__()
        self.w1, self.w2 = w1, w2

    def forward(self, x):
        return torch.stack([torch.zeros(len(x)), ((x - 0.5) * self.w1).flatten(1).sum(1),
                            1.5 * ((x - 0.5) * self.w2).flatten(1).sum(1)], 1)


def test_psba_scale_search_uses_the_attacks_loss():
    """The simulated estimate follows the surrogate's gradient of the attack's own loss: at x = 0.5 (uniform
    softmax) untargeted from class 0 it is w1 + 1.5 w2 (closer to w2, scale 1), targeted at class 1 it is
    2 w1 - 1.5 w2 (closer to w1, scale 0), for orthonormal w1, w2 and generators aligned with each."""
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(2, 1, 1, 8, 8, generator=g)
    w1 = w1 / w1.norm()
    w2 = w2 - (w2 * w1).sum() * w1
    w2 = w2 / w2.norm()
    x = torch.full((2, 1, 8, 8), 0.5)
    for target, want in ((None, 1), (torch.ones(2, dtype=torch.long), 0)):
        ctx = make_ctx(nn.Identity(), x, torch.zeros(2, dtype=torch.long), 1.0, "l2", 10, target=target,
                       num_classes=3)
        ctx = BlockContext(problem=ctx.problem, rng=ctx.rng, oracle=ctx.oracle, surrogates=(Three(w1, w2),))
        assert pick_scale(ctx, [Fixed(w1, 0.9), Fixed(w2, 0.9)], x, 50).tolist() == [want, want], target


def test_psba_picks_a_samples_scale_once_and_keeps_it(monkeypatch):
    """A sample's scale is searched at its first iteration from its boundary point and kept in the state: the next
    iteration neither searches again nor changes it (generators: noise at scale 0, aligned with the linear
    surrogate's normal at scale 1)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1, 1, 8, 8, generator=g)
    w = w / w.norm()
    x = torch.rand(3, 1, 8, 8, generator=g)
    model = Linear2(w)
    ctx = make_ctx(model, x, model(x).argmax(1), 1.0, "l2", 10_000, "label", num_classes=2)
    ctx = BlockContext(problem=ctx.problem, rng=ctx.rng, oracle=ctx.oracle, surrogates=(LinearScores(w),))
    nets, picks, real = [Fixed(w, 0.0), Fixed(w, 0.9)], [], priors.pick_scale
    monkeypatch.setattr(priors, "trained_decoders", lambda *args: nets)
    monkeypatch.setattr(priors, "pick_scale", lambda c, *args: picks.append(c.problem.n) or real(c, *args))
    state = priors.psba_init(ctx)
    assert state["scale"].tolist() == [-1, -1, -1] and torch.isfinite(state["dist"]).all()
    state = {**state, **priors.psba(ctx, state, init_num_evals=20)}
    assert state["scale"].tolist() == [1, 1, 1] and picks == [3]
    state = {**state, **priors.psba(ctx, state, init_num_evals=20)}
    assert state["scale"].tolist() == [1, 1, 1] and picks == [3]


def test_each_samples_probes_come_from_its_scale():
    """``decode_at``: the probes of a sample at scale k are decodes of the k-th generator (here +-a at scale 0,
    +-b at scale 1)."""
    a, b = torch.randn(2, 1, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    ctx = make_ctx(nn.Identity(), torch.full((3, 1, 8, 8), 0.5), torch.zeros(3, dtype=torch.long), 1.0, "l2", 10)
    out = priors.decode_at([Fixed(a, 1.0), Fixed(b, 1.0)], torch.tensor([1, 0, 1]), ctx, torch.tensor([0, 0, 1, 2]),
                           (1, 8, 8))
    for row, want in zip(out, (b, b, a, b)):
        assert torch.allclose(row.abs(), want[0].abs())

def _digits_assets(n=200):
    return {"train": {"name": "train_images", "spec": {"name": "digits", "split": "train", "n": n}}}


FAST = {"epochs": 3, "views": 1}  # a small prior: these tests check the plumbing, benchmarks/ the fidelity
# ResNet-56 test: a mid prior that still steers (cosine with ResNet-56's gradients 0.27 from ResNet-20/32, the
# recipe's 0.31 from ResNet-20/32/44) in a third of the training time
MID = {"epochs": 15, "views": 4, "lr": 0.003}


def test_one_training_per_run_and_a_cache_across_runs(tmp_path, monkeypatch):
    """PSBA's three auto-encoders are trained once in a run (later steps reuse them) from one computation of the
    surrogates' gradients, and loaded from the cache by the next run."""
    calls = {"train": 0, "grads": 0, "cache": 0}
    train, grads, cache = priors.train_ae, priors.reference_gradients, priors.cached

    monkeypatch.setattr(priors, "train_ae", count_calls(calls, "train", train))
    monkeypatch.setattr(priors, "reference_gradients", count_calls(calls, "grads", grads))
    monkeypatch.setattr(priors, "cached", count_calls(calls, "cache", cache))
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "cache"))
    attack = {"recipe": "psba", "blocks": {"perturb": {"name": "psba", **FAST}}}
    threat = {"norm": "l2", "eps": 1.5, "max_queries": 200}
    for i in range(2):
        exp = _exp(tmp_path / str(i), attack=attack, model="digits_mlp", surrogates=["digits_cnn"],
                   assets=_digits_assets(), threat=threat, batch_size=2, dataset={"name": "digits", "n": 2})
        trained._RUN.clear()
        run_experiment(exp, progress=False)
        assert calls == {"train": 3, "grads": 1, "cache": 3 * (i + 1)}  # one lookup per side and run
    assert len(list((tmp_path / "cache" / "priors").glob("*.pt"))) == 3


@pytest.mark.parametrize("attack,extra", [("nonlinear_ba", {"surrogates": ["digits_cnn"]}), ("advflow", {}),
                                         ("np_attack", {})])
def test_training_on_evaluation_images_is_refused(tmp_path, attack, extra):
    """The train_images asset of a query attack that trains (probe priors, AdvFlow's flow, NP-attack's ANP) must not
    hold the run's evaluation images (here: the same digits)."""
    exp = _exp(tmp_path, attack=attack, model="digits_mlp", **extra,
               assets={"train": {"name": "train_images", "spec": {"name": "digits", "n": 20}}},
               threat={"norm": "l2", "eps": 1.5, "max_queries": 100}, dataset={"name": "digits", "n": 2})
    trained._RUN.clear()
    with pytest.raises(BenchError, match="evaluation images of this run"):
        run_experiment(exp, progress=False)


def test_a_side_the_auto_encoder_cannot_take_is_a_config_error(tmp_path):
    """PSBA's sides are checked when the config is read, in one line naming the key; their order does not matter."""
    def exp(sides):
        return _exp(tmp_path, attack={"recipe": "psba", "blocks": {"perturb": {"name": "psba", "sides": sides}}},
                    model="digits_mlp", surrogates=["digits_cnn"], assets=_digits_assets(),
                    threat={"norm": "l2", "eps": 1.5})

    with pytest.raises(ConfigError, match=r"attack.blocks.perturb.sides: each item must be one of 8, 16, 32, got 12"):
        prepare(exp([8, 12]))
    prepare(exp([32, 8]))


@pytest.mark.parametrize("attack,norm,eps,targeted", [("psba", "linf", 0.2, False)])
def test_records_do_not_depend_on_the_batch_size(tmp_path, attack, norm, eps, targeted):
    """batch_size 1, 7 and 100 give identical records (float64 digits target; the prior, trained with the recipe's
    parameters as in the contract, and the scale search on the digits CNN). PSBA only: NonLinear-BA's probes are
    PSBA's decode at one fixed scale."""
    runs = []
    for bs in (1, 7, 100):
        threat = {"norm": norm, "eps": eps, "max_queries": 2000, "targeted": targeted}
        if targeted:
            threat["target_label"] = "random"
        exp = _exp(tmp_path / str(bs), attack=attack, model="test_digits_mlp_f64", surrogates=["digits_cnn"],
                   assets=_digits_assets(), threat=threat, batch_size=bs, dataset={"name": "digits", "n": 8})
        run_dir, _ = run_experiment(exp, progress=False)
        runs.append(_records(run_dir))
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 3


@needs_data
def test_resnet56_with_resnet_surrogates(tmp_path):
    """Untargeted on the first 4 CIFAR-10 test images, target ResNet-56, surrogates ResNet-20/32, the paper's budget
    10,000: PSBA at Linf 0.05 on sides 8 and 32, then NonLinear-BA at L2 1.0 (its side-32 prior is PSBA's, loaded
    from the cache), the priors trained on the 200 images of cifar10_test_sdp200.npz (``MID``). Every correctly
    classified image fooled inside eps (the runner also checks [0, 1] and the uint8 grid), within budget, and every
    success confirmed by the oracle and by the worker's own forward of the returned image. PSBA first: it trains
    both sides on one computation of the surrogates' reference gradients (NonLinear-BA first, PSBA computed them
    again for side 8: 7 s)."""
    for attack, norm, eps, extra in [("psba", "linf", 0.05, {"sides": [8, 32]}), ("nonlinear_ba", "l2", 1.0, {})]:
        exp = _exp(tmp_path / attack, attack={"recipe": attack, "blocks": {"perturb": {"name": attack, **MID, **extra}}},
                   model="cifar_resnet56", surrogates=["cifar_resnet20", "cifar_resnet32"],
                   assets={"train": {"name": "train_images"}}, data_root=DATA, batch_size=4,
                   dataset={"name": "cifar10", "file": "cifar10/cifar10_test_first100.npz", "n": 4},
                   threat={"norm": norm, "eps": eps, "max_queries": 10_000})
        run_dir, _ = run_experiment(exp, progress=False)
        recs = [r for r in _records(run_dir, drop=()) if r["attacked"]]
        assert len(recs) >= 3 and all(r["success"] and r["audit_adv"] for r in recs), attack
        assert all(r["queries"] <= 10_000 and r[norm] <= eps + 1e-5 for r in recs), attack


def test_psba_scale_search_holds_whole_samples_within_the_bound(tmp_path, monkeypatch):
    """With room for one sample's ``pick_probes`` decodes (100 digits of 64 values) a call, the scale search decodes
    one sample's probes at a time, where the unbounded run decodes every sample's at once; the records are the same
    (at 299 x 299 a sample's 100 decodes are 107 MB, and the search held every new sample's at once). The room is
    cut in the search's calls only: HSJA's estimate, in pieces, sums its probes in another order (float
    precision, tests/test_decision_qeba_cisa.py)."""
    from blackboxbench.query import common

    real_pick, real_decode = priors.pick_scale, priors.decode
    inside, out = [], []

    def pick(*args):
        inside.append(True)
        try:
            return real_pick(*args)
        finally:
            inside.pop()

    def counted(net, ctx, owner, shape):
        if inside:
            sizes.append(len(owner))
        return real_decode(net, ctx, owner, shape)

    monkeypatch.setattr(priors, "pick_scale", pick)
    monkeypatch.setattr(priors, "decode", counted)
    attack = {"recipe": "psba", "blocks": {"perturb": {"name": "psba", **FAST}}}
    real_calls = common.bounded_calls
    for values in (1 << 26, 100 * 64):
        monkeypatch.setattr(priors, "bounded_calls", lambda rows, v: real_calls(rows, v * (1 << 26) // values))
        sizes = []
        exp = _exp(tmp_path / str(values), attack=attack, model="test_digits_mlp_f64", surrogates=["digits_cnn"],
                   assets=_digits_assets(), threat={"norm": "linf", "eps": 0.2, "max_queries": 400},
                   batch_size=16, dataset={"name": "digits", "n": 16})
        run_dir, _ = run_experiment(exp, progress=False)
        out.append((_records(run_dir), max(sizes)))
    (whole, largest), (cut, largest_cut) = out
    assert largest >= 8 * 100 and largest_cut == 100
    assert whole == cut


@pytest.mark.parametrize("block", ["advflow", "np_attack", "cg_attack", "mcg_init"])
def test_a_generative_prior_of_another_image_size_is_one_line_error(block):
    """AdvFlow's flow, NP-attack's ANP and the c-Glows model images of one size: a train_images asset whose images
    differ from the run's stops with one line naming the asset's key before any training (the default asset,
    CIFAR-10 at 32 x 32, against ImageNet images gave a shape traceback)."""
    from blackboxbench.prep.data import Dataset
    from blackboxbench.query import advflow, cg_attack, np_attack

    x = torch.rand(2, 3, 16, 16)
    train = Dataset("small", torch.rand(4, 3, 8, 8), torch.zeros(4, dtype=torch.long), 2)
    ctx = _ctx_with(nn.Flatten(), x, surrogates=[nn.Flatten()], assets={"train": train})
    build = {"advflow": lambda: advflow.trained_flow(ctx, "train", {}, {"seed": 0}),
             "np_attack": lambda: np_attack.trained_anp(ctx, "train", {}, {"seed": 0}),
             "cg_attack": lambda: cg_attack.trained_cglow(ctx, "train", {"num_levels": 3}, {"seed": 0}),
             "mcg_init": lambda: cg_attack.trained_cglow(ctx, "train", {"num_levels": 3}, {"seed": 0}, "mcg_init")}
    trained._RUN.clear()
    with pytest.raises(BenchError, match=rf"^'{block}': the train_images asset 'train' holds 3 x 8 x 8 images, "
                                         r"the run's are 3 x 16 x 16; .*assets: \{train: "):
        build[block]()


def test_images_the_generative_priors_cannot_take_are_one_line_errors():
    """At 299 x 299 NP-attack's ANP would attend between all 268,203 points (1.15 TB) and the c-Glow needs sides
    that are multiples of 8: each stops with one line naming the block (MCG's c-Glow names mcg_init)."""
    from blackboxbench.prep.data import Dataset
    from blackboxbench.query import cg_attack
    from blackboxbench.query.np_attack import check_points

    with pytest.raises(BenchError, match=r"^np_attack: the ANP attends .* at 3 x 299 x 299 its attention is "
                                         r"4 x P\^2 = 1,151 GB .*config key data"):
        check_points((3, 299, 299))
    check_points((3, 32, 32))
    check_points((1, 128, 128))  # 16,384 points: 4 x P^2 = 2^30 values, the limit itself
    with pytest.raises(BenchError, match=r"at most 16,384 points"):
        check_points((1, 128, 129))
    x = torch.rand(2, 3, 12, 12)
    ctx = _ctx_with(nn.Flatten(), x, surrogates=[nn.Flatten()],
                    assets={"train": Dataset("small", torch.rand(4, 3, 12, 12), torch.zeros(4, dtype=torch.long), 2)})
    trained._RUN.clear()
    with pytest.raises(BenchError, match=r"^mcg_init: image sides 12 x 12 must be multiples of 8 \(num_levels 3"):
        cg_attack.trained_cglow(ctx, "train", {"num_levels": 3}, {"seed": 0}, "mcg_init")
