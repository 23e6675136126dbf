"""Transfer-attack blocks (transforms, losses, gradients, directions, updates, refine) and the recipes in
attacks/transfer/ (Alg. 3 of the BlackboxBench paper; Table VII CIFAR-10 defaults).

Unit tests check each block against an independent reference (hand-written formulas, scipy.ndimage, per-sample
loops). The recipe tests build each recipe's blocks from its YAML through the registries, run it on a tiny random
CNN (no data needed) and, with the offline data, on 16 CIFAR-10 test images that ResNet-20/32/56 all classify
correctly: ResNet-20 is the surrogate (ResNet-20 + ResNet-32 for the ensemble), ResNet-56 the black-box target.
Run with ``-s`` to see the measured success rates.
"""
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from scipy import ndimage
from torch import nn

from blackboxbench.context import Pool
from blackboxbench.errors import BenchError
from blackboxbench.registry import DIRECTION, GRADIENT, LOSS, REFINE, TRANSFORM, UPDATE
from blackboxbench.threat import Problem

from attack_utils import build as build_recipe
from attack_utils import check_output, correctly_classified, refine_ctx, transfer_ctx
from blackboxbench.transfer.gradients import gaussian_kernel
from blackboxbench.transfer.transforms import apply_di, apply_di_shrink, draw_di, draw_di_shrink

REPO = Path(__file__).resolve().parent.parent
RECIPE_DIR = REPO / "attacks" / "transfer"
# The recipes of this file (tests/test_transfer_opt.py covers those of the data / optimization perspective).
RECIPES = ["di2_fgsm", "ens_logit", "i_fgsm", "mi_di_ti_fgsm", "mi_fgsm", "pgd", "ti_fgsm"]
KINDS = {"refine": REFINE, "transform": TRANSFORM, "gradient": GRADIENT, "direction": DIRECTION, "loss": LOSS,
         "update": UPDATE}
EPS = {"linf": 0.03, "l2": 1.0}  # Table VII, CIFAR-10


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def build(name, norm="linf", targeted=False, iterations=None):
    return build_recipe(name, norm, targeted, EPS[norm], iterations)[0]


def step(x_adv, d, problem, alpha):
    return UPDATE.get("step")(transfer_ctx(problem.x, problem.y, problem.eps, problem.norm, alpha=alpha), x_adv, d)


def ti(g, **params):
    x = torch.zeros(len(g), 1, 1, 1)
    return GRADIENT.get("ti")(transfer_ctx(x, torch.zeros(len(g), dtype=torch.long)), lambda x: g, x, {}, **params)


# ---------------------------------------------------------------------------------------------- update ----

def test_step_linf_is_sign_step_then_clip():
    x = torch.rand(4, 3, 8, 8, generator=gen(1)) * 0.5 + 0.25
    d = torch.randn(4, 3, 8, 8, generator=gen(2))
    p = Problem(x=x, y=torch.zeros(4, dtype=torch.long), eps=1.0, norm="linf")
    out = step(x, d, p, alpha=0.01)
    assert torch.allclose(out, x + 0.01 * d.sign())
    p = Problem(x=x, y=p.y, eps=0.03, norm="linf")
    x_adv = x
    for _ in range(20):
        x_adv = step(x_adv, torch.randn(x.shape, generator=gen(3)), p, alpha=0.01)
        assert (x_adv - x).abs().max() <= 0.03 + 1e-6 and 0 <= x_adv.min() and x_adv.max() <= 1


def test_step_l2_moves_alpha_per_sample_and_stays_in_ball():
    x = torch.full((3, 3, 8, 8), 0.5)
    d = torch.randn(3, 3, 8, 8, generator=gen(4)) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1, 1)
    p = Problem(x=x, y=torch.zeros(3, dtype=torch.long), eps=10.0, norm="l2")
    out = step(x, d, p, alpha=0.1)
    assert torch.allclose((out - x).flatten(1).norm(dim=1), torch.full((3,), 0.1), atol=1e-5)
    assert torch.allclose(out - x, 0.1 * d / d.flatten(1).norm(dim=1).view(3, 1, 1, 1), atol=1e-6)
    assert torch.equal(step(x, torch.zeros_like(x), p, alpha=0.1), x)  # zero direction
    p = Problem(x=x, y=p.y, eps=1.0, norm="l2")
    x_adv = x
    for i in range(30):
        x_adv = step(x_adv, torch.randn(x.shape, generator=gen(i)), p, alpha=0.3)
        assert ((x_adv - x).flatten(1).norm(dim=1) <= 1.0 + 1e-5).all()


def test_unknown_norm_is_a_bench_error():
    """A problem with a norm outside the threat model's is refused where it is made, before any block (whose
    distances would read it as L2) sees it."""
    x = torch.rand(1, 3, 4, 4)
    with pytest.raises(BenchError, match="unknown norm 'l1'"):
        Problem(x=x, y=torch.zeros(1, dtype=torch.long), eps=1, norm="l1")


# ----------------------------------------------------------------------------------------------- losses ----

class _Linear(torch.nn.Module):
    """A fixed linear surrogate on 3 x 4 x 4 images."""

    def __init__(self):
        super().__init__()
        self.w = torch.randn(48, 10, generator=torch.Generator().manual_seed(42))

    def forward(self, x):
        return x.flatten(1) @ self.w


def test_random_start_is_uniform_in_the_ball_around_x_from_each_samples_stream():
    """``random_start`` r: the loop starts at ``Clip(x + r * (2u - 1))``, ``u`` uniform per pixel from the sample's
    stream, so the start is centred on x (not pushed one way) and is projected to the eps ball before the first
    step (r > eps here, so a step from the unprojected start would end elsewhere)."""
    x = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(40)) * 0.5 + 0.25
    y = torch.tensor([1, 2])
    atk, _ = build_recipe("i_fgsm", eps=0.1, iterations=1, hyper={"random_start": 0.2})
    model, seen = _Linear(), []
    ctx = transfer_ctx(x, y, eps=0.1, model=model, alpha=0.03, seed=41, iterations=1)
    atk.run(ctx, lambda t, x_it: seen.append(x_it.clone()))
    u = transfer_ctx(x, y, seed=41).rng.uniform((3, 4, 4))
    x0 = (x + (0.2 * (2 * u - 1)).clamp(-0.1, 0.1)).requires_grad_(True)
    g, = torch.autograd.grad(F.cross_entropy(model(x0), y, reduction="sum"), x0)
    want = torch.minimum(torch.maximum(x0.detach() + 0.03 * g.sign(), x - 0.1), x + 0.1)
    assert torch.allclose(seen[0], want, atol=1e-6)


def test_losses_match_hand_formulas():
    z = torch.randn(6, 10, generator=gen(5))
    lab = torch.tensor([0, 3, 9, 2, 2, 7])
    logp = z - z.exp().sum(1, keepdim=True).log()
    own = z[torch.arange(6), lab]
    other = torch.stack([torch.cat([z[i, :lab[i]], z[i, lab[i] + 1:]]).max() for i in range(6)])
    x = torch.zeros(6, 1, 1, 1)
    untargeted, targeted_ctx = transfer_ctx(x, lab), transfer_ctx(x, lab, target=lab)
    ctxs = {False: untargeted, True: targeted_ctx}
    ce, cw, logit = (functools.partial(lambda f, z, lab, t: f(ctxs[t], z, lab), LOSS.get(n)) for n in
                     ("ce", "cw", "logit"))
    assert torch.allclose(ce(z, lab, False), -logp[torch.arange(6), lab], atol=1e-6)
    assert torch.allclose(ce(z, lab, True), logp[torch.arange(6), lab], atol=1e-6)
    assert torch.allclose(cw(z, lab, False), other - own)
    assert torch.allclose(cw(z, lab, True), own - other)
    assert torch.equal(logit(z, lab, True), own) and torch.equal(logit(z, lab, False), -own)
    for fn in (ce, cw, logit):  # ascending the loss lowers the true logit (untargeted), raises the target's
        for targeted, sign in ((False, -1), (True, 1)):
            zz = z.clone().requires_grad_(True)
            g, = torch.autograd.grad(fn(zz, lab, targeted).sum(), zz)
            assert (sign * g[torch.arange(6), lab] > 0).all(), (fn, targeted)


# --------------------------------------------------------------------------------------------- momentum ----

def test_momentum_matches_hand_formula():
    grads = [torch.randn(2, 3, 4, 4, generator=gen(10 + t)) * (t + 1) for t in range(4)]
    state, acc = {}, np.zeros((2, 3, 4, 4))
    for g in grads:
        out = DIRECTION.get("momentum")(None, g, state, decay=0.7)
        gn = g.numpy().astype(np.float64)
        acc = 0.7 * acc + gn / np.abs(gn).reshape(2, -1).mean(1).reshape(2, 1, 1, 1)
        np.testing.assert_allclose(out.numpy(), acc, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(DIRECTION.get("momentum")(None, torch.zeros(1, 3, 4, 4), {})).all()



def test_momentum_default_decay_is_one():
    """MI-FGSM's default decay is 1.0 (Table VII): with no ``decay`` given, the momentum is the plain sum of the
    normalised gradients g_t / mean|g_t|."""
    grads = [torch.randn(2, 3, 4, 4, generator=gen(20 + t)) for t in range(3)]
    state, acc = {}, torch.zeros(2, 3, 4, 4, dtype=torch.float64)
    for g in grads:
        out = DIRECTION.get("momentum")(None, g, state)
        acc = acc + g.double() / g.double().abs().flatten(1).mean(1).view(2, 1, 1, 1)
        assert torch.allclose(out.double(), acc, rtol=1e-5, atol=1e-5)


def test_momentum_without_normalization_accumulates_the_raw_gradient():
    """``normalize: false`` (BlackboxBench's code with its max_logit loss): g_t = decay * g_{t-1} + grad_t, the
    gradients as they come, so a large gradient weighs more than a small one."""
    grads = [torch.randn(2, 3, 4, 4, generator=gen(30 + t)) * 10 ** t for t in range(3)]
    state, acc = {}, torch.zeros(2, 3, 4, 4)
    for g in grads:
        out = DIRECTION.get("momentum")(None, g, state, decay=0.5, normalize=False)
        acc = 0.5 * acc + g
        assert torch.allclose(out, acc, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------- TI ----

@pytest.mark.parametrize("kernel_size,nsig", [(3, 3.0), (5, 3.0), (5, 3 ** 0.5), (7, 2.0)])
def test_ti_equals_scipy_gaussian_filter(kernel_size, nsig):
    k = gaussian_kernel(kernel_size, nsig)
    assert k.shape == (kernel_size, kernel_size) and abs(float(k.sum()) - 1) < 1e-12
    assert torch.equal(k, k.flip(0)) and torch.equal(k, k.T)
    g = torch.randn(2, 3, 9, 11, generator=gen(6), dtype=torch.float64)
    out = ti(g, kernel_size=kernel_size, nsig=nsig)
    sigma = (kernel_size - 1) / (2 * nsig)  # radius = nsig standard deviations
    ref = np.stack([np.stack([ndimage.gaussian_filter(g[n, c].numpy(), sigma, mode="constant", truncate=nsig)
                              for c in range(3)]) for n in range(2)])
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-12)


def test_ti_kernel_size_one_is_identity_and_even_size_is_an_error():
    g = torch.randn(1, 3, 5, 5, generator=gen(7))
    assert torch.allclose(ti(g, kernel_size=1), g)
    with pytest.raises(BenchError, match="odd"):
        ti(g, kernel_size=4)
    for nsig in (0.0, -1.0):  # nsig 0 would flatten the Gaussian into a box filter
        with pytest.raises(BenchError, match="nsig"):
            ti(g, kernel_size=3, nsig=nsig)


# ------------------------------------------------------------------------------------------------- DI ----

def _di_loop(x, p):
    """Independent per-sample reference: resize, pad, resize back with F.interpolate / F.pad."""
    out = []
    oh, ow = p["out"]
    for i in range(len(x)):
        if not p["apply"][i]:
            out.append(x[i])
            continue
        sh, sw = int(p["size"][0][i]), int(p["size"][1][i])
        small = F.interpolate(x[i:i + 1], size=(sh, sw), mode="nearest")
        t, l_ = int(p["top"][i]), int(p["left"][i])
        padded = F.pad(small, (l_, ow - sw - l_, t, oh - sh - t))
        out.append(F.interpolate(padded, size=x.shape[-2:], mode="nearest")[0])
    return torch.stack(out)


def test_di_matches_per_sample_reference_and_replays():
    x = torch.rand(8, 3, 32, 32, generator=gen(8))
    y = torch.zeros(8, dtype=torch.long)
    sizes = set()
    for seed in range(20):
        p = draw_di(transfer_ctx(x, y, seed=seed), x.shape, resize_rate=1.25, prob=0.5)
        sizes.update(p["size"][0].tolist())
        assert p["out"] == (40, 40) and ((32 <= p["size"][0]) & (p["size"][0] <= 40)).all()
        assert torch.equal(p["size"][0], p["size"][1])
        assert ((p["top"] >= 0) & (p["top"] <= 40 - p["size"][0])).all()
        assert torch.equal(apply_di(x, p), _di_loop(x, p))
        assert torch.equal(apply_di(x, p), apply_di(x, p))                    # replay
        assert torch.equal(TRANSFORM.get("di")(transfer_ctx(x, y, seed=seed), x), apply_di(x, p))  # draw + apply
    assert len(sizes) == 9  # every size of [32, 40], 40 included as the authors' randint(in_size, out_size + 1)
    p = draw_di(transfer_ctx(x, y), x.shape, prob=1.0)
    assert p["apply"].all() and len(set(p["top"].tolist())) > 1 and len(set(p["size"][0].tolist())) > 1
    assert torch.equal(TRANSFORM.get("di")(transfer_ctx(x, y), x, prob=0.0), x)
    xx = x.clone().requires_grad_(True)
    g, = torch.autograd.grad(TRANSFORM.get("di")(transfer_ctx(x, y), xx, prob=1.0).sum(), xx)
    assert g.abs().sum() > 0
    with pytest.raises(BenchError):
        draw_di(transfer_ctx(x, y), x.shape, resize_rate=1.0)


def test_di_is_applied_with_probability_prob():
    """DI transforms a row with probability ``prob`` (Xie et al.'s p): at prob 0.2 about a fifth of 1000 rows are
    transformed (binomial sd 13 rows), and with the same draws every row transformed at 0.2 is also at 0.6."""
    x = torch.zeros(1000, 1, 8, 8)
    y = torch.zeros(1000, dtype=torch.long)
    low = draw_di(transfer_ctx(x, y, seed=3), x.shape, resize_rate=1.25, prob=0.2)["apply"]
    high = draw_di(transfer_ctx(x, y, seed=3), x.shape, resize_rate=1.25, prob=0.6)["apply"]
    assert 150 < int(low.sum()) < 250 and 540 < int(high.sum()) < 660
    assert not (low & ~high).any()


def test_di_draws_per_sample():
    """A sample's DI parameters depend on its own stream only: the same whatever batch it is in."""
    x = torch.rand(6, 3, 32, 32, generator=gen(9))
    y = torch.zeros(6, dtype=torch.long)
    whole = draw_di(transfer_ctx(x, y), x.shape, prob=0.5)
    part = draw_di(transfer_ctx(x, y).sub(torch.tensor([4, 1])), (2, 3, 32, 32), prob=0.5)
    for key in ("top", "left", "apply"):
        assert torch.equal(whole[key][[4, 1]], part[key])
    twice = draw_di(transfer_ctx(x, y), (12, 3, 32, 32), prob=0.5)  # two stacked copies: rows 0-5, 6-11
    assert not torch.equal(twice["top"][:6], twice["top"][6:]) or not torch.equal(twice["size"][0][:6],
                                                                                    twice["size"][0][6:])


def test_di_parameters_are_independent_draws_covering_their_ranges():
    """Per row, DI's size, top offset, left offset and coin are separate draws: each offset takes every position
    of [0, out - size] (both ends, for sizes that leave room), the two offsets differ, and the coin does not
    depend on the size (the rows transformed and the rows kept both show every size). Likewise ``di_shrink``,
    whose offsets take every position of [0, H - size)."""
    x = torch.zeros(1500, 1, 32, 32)
    y = torch.zeros(1500, dtype=torch.long)
    p = draw_di(transfer_ctx(x, y, seed=4), x.shape, resize_rate=1.25, prob=0.5)
    size, apply = p["size"][0], p["apply"]
    room = 40 - size
    for off in (p["top"], p["left"]):
        assert ((off == room) & (room > 0)).any() and ((off == 0) & (room > 0)).any()
    assert (p["top"] != p["left"]).float().mean() > 0.5
    assert set(size[apply].tolist()) == set(size[~apply].tolist()) == set(range(32, 41))
    p = draw_di_shrink(transfer_ctx(x, y, seed=4), x.shape, prob=0.5)
    size, apply = p["size"][0], p["apply"]
    for off in (p["top"], p["left"]):
        assert ((off == 32 - size - 1) & (size < 31)).any() and (off == 0).any()
    assert (p["top"] != p["left"]).float().mean() > 0.3  # about 0.48: few positions, often the same
    assert set(size[apply].tolist()) == set(size[~apply].tolist()) == {28, 29, 30, 31}


def test_di_shrink_matches_torchattacks_ops_per_sample():
    """``di_shrink``: each row equals torchattacks' DIFGSM ops (bilinear ``F.interpolate`` to its size, ``F.pad``
    at its offsets, no resize back), offsets in [0, 32 - size) as torchattacks draws them; parameters per sample."""
    x = torch.rand(8, 3, 32, 32, generator=gen(10))
    y = torch.zeros(8, dtype=torch.long)
    sizes = set()
    for seed in range(10):
        p = draw_di_shrink(transfer_ctx(x, y, seed=seed), x.shape, prob=1.0)
        size, top, left = p["size"][0], p["top"], p["left"]
        sizes.update(size.tolist())
        assert ((28 <= size) & (size < 32)).all() and (top < 32 - size).all() and (left < 32 - size).all()
        ref = torch.cat([F.pad(F.interpolate(x[i:i + 1], size=[int(s), int(s)], mode="bilinear",
                                             align_corners=False), [int(lf), 32 - int(s) - int(lf), int(t),
                                                                    32 - int(s) - int(t)])
                         for i, (s, t, lf) in enumerate(zip(size, top, left))])
        assert torch.allclose(apply_di_shrink(x, p), ref, atol=1e-5)
    assert sizes == {28, 29, 30, 31}
    assert torch.equal(TRANSFORM.get("di_shrink")(transfer_ctx(x, y), x, prob=0.0), x)
    whole = draw_di_shrink(transfer_ctx(x, y), x.shape)
    part = draw_di_shrink(transfer_ctx(x, y).sub(torch.tensor([5, 2])), (2, 3, 32, 32))
    for key in ("top", "left", "apply"):
        assert torch.equal(whole[key][[5, 2]], part[key])
    with pytest.raises(BenchError):
        draw_di_shrink(transfer_ctx(x, y), (1, 1, 1, 1))


# --------------------------------------------------------------------------------------------- ensemble ----

def test_logit_ensemble_averages_logits():
    torch.manual_seed(0)
    a, b = nn.Linear(12, 10), nn.Linear(12, 10)
    x = torch.randn(5, 12, generator=gen(9))
    out = REFINE.get("logit_ensemble")(refine_ctx(), [a, b])
    assert isinstance(out, list) and len(out) == 1
    assert torch.allclose(out[0](x), (a(x) + b(x)) / 2, atol=1e-6)
    w = REFINE.get("logit_ensemble")(refine_ctx(), [a, b], weights=[1, 3])[0]
    assert torch.allclose(w(x), 0.25 * a(x) + 0.75 * b(x), atol=1e-6)
    for bad in ([1], [-1, 2], [0, 0]):
        with pytest.raises(BenchError):
            REFINE.get("logit_ensemble")(refine_ctx(), [a, b], weights=bad)
    with pytest.raises(BenchError, match="fuses"):
        build("i_fgsm").refine(refine_ctx(), [a, b])
    assert build("ens_logit").refine(refine_ctx(), [a, b])(x).shape == (5, 10)


# -------------------------------------------------------------------------------- recipes (no data) ----

def test_recipes_follow_the_schema():
    assert set(RECIPES) == {"i_fgsm", "pgd", "mi_fgsm", "di2_fgsm", "ti_fgsm", "mi_di_ti_fgsm", "ens_logit"}
    for name in RECIPES:
        r = yaml.safe_load((RECIPE_DIR / f"{name}.yaml").read_text())
        assert r["name"] == name and r["family"] == "transfer" and r["targeted"] is True
        assert set(r["norms"]) == {"linf", "l2"} and r["paper"] and "Table VII" in r["defaults"]
        for norm in EPS:  # Table VII CIFAR-10: step eps/10, 100 / 300 iterations
            for targeted, iters in ((False, 100), (True, 300)):
                atk = build(name, norm, targeted)
                assert atk.iterations == iters and atk.alpha == pytest.approx(EPS[norm] / 10)
    assert build("pgd").random_start == pytest.approx(1e-7) and build("i_fgsm").random_start == 0
    mdt = build("mi_di_ti_fgsm")
    assert [len(mdt.transforms), len(mdt.gradients), len(mdt.directions)] == [1, 1, 1]


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("norm,targeted", [("linf", False), ("l2", True)])
def test_recipe_runs_deterministically_inside_the_ball(name, norm, targeted):
    net = TinyNet().eval()
    x = torch.rand(4, 3, 16, 16, generator=gen(11))
    y = torch.tensor([0, 1, 2, 3])
    atk = build(name, norm, targeted, iterations=3)
    model = atk.refine(refine_ctx(), [net, TinyNet().eval()] if atk.refiners else [net])

    def ctx(seed):
        return transfer_ctx(x, y, EPS[norm], norm, (y + 1) % 10 if targeted else None, model, atk.alpha, seed, 3)

    out = atk.run(ctx(1))
    check_output(out, x, EPS[norm], norm)
    assert not torch.equal(out, x)
    assert torch.equal(out, atk.run(ctx(1)))  # randomness only from the samples' streams
    assert torch.equal(out[2:], atk.run(ctx(1).sub(torch.tensor([2, 3]))))  # and per sample


class RowCounter(nn.Module):
    """TinyNet that records the batch size of every forward."""

    def __init__(self):
        super().__init__()
        self.net, self.sizes = TinyNet().eval(), []

    def forward(self, x):
        self.sizes.append(len(x))
        return self.net(x)


@pytest.mark.parametrize("recipe,per,forwards", [("si_fgsm", 1, [4, 4, 4]), ("si_fgsm", 2, [8, 4]),
                                                  ("si_fgsm", 0, [12]), ("admix", 4, [16, 16, 4])])
def test_copies_per_forward_splits_forwards_not_the_gradient(recipe, per, forwards):
    """``hyper.copies_per_forward``: the surrogate sees that many stacked copies per forward (0: all); the
    gradient equals the one-batch gradient (si_fgsm: 3 copies, admix: 3 samples x 3 SI copies)."""
    x = torch.rand(4, 3, 16, 16, generator=gen(3))
    y = torch.tensor([0, 1, 2, 3])
    grads = {}
    for p in (0, per):
        atk = build_recipe(recipe, "linf", False, 0.03, hyper={"iterations": 1, "copies_per_forward": p})[0]
        net = RowCounter()
        ctx = transfer_ctx(x, y, 0.03, "linf", None, net, atk.alpha, 5, 1).at(t=0, pool=Pool(x, y))
        grads[p] = atk.grad_fn(ctx, {})(x)
        if p == per:
            assert net.sizes == forwards
    torch.testing.assert_close(grads[per], grads[0], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- recipes on real models ----

@pytest.fixture(scope="module")
def zoo(data_root):
    from blackboxbench.prep.models import build_model

    return {d: build_model(f"cifar_resnet{d}", data_root) for d in (20, 32, 56)}


@pytest.fixture(scope="module")
def batch(data_root, zoo):
    """10 CIFAR-10 test images classified correctly by ResNet-20, -32 and -56 (clean error 0 on the batch)."""
    return correctly_classified(list(zoo.values()), data_root, n=10, pool=300)


@pytest.fixture(scope="module")
def attack_run(zoo, batch):
    """Memoized runs: (recipe, norm, targeted, iterations) -> (x_adv, surrogate model, problem)."""

    @functools.lru_cache(maxsize=None)
    def run(name, norm="linf", targeted=False, iterations=None):
        x, y = batch
        atk = build(name, norm, targeted, iterations)
        model = atk.refine(refine_ctx(), [zoo[20], zoo[32]] if atk.refiners else [zoo[20]])
        ctx = transfer_ctx(x, y, EPS[norm], norm, (y + 1) % 10 if targeted else None, model, atk.alpha, 0,
                           atk.iterations)
        return atk.run(ctx), model, ctx.problem

    return run


def success(model, x_adv, problem):
    with torch.no_grad():
        return problem.is_adv_label(model(x_adv).argmax(1)).float().mean().item()


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_untargeted_linf_transfers_to_resnet56(name, attack_run, zoo):
    """Recipe defaults (100 iterations, eps 0.03, step 0.003): white-box >= 0.95 on the surrogate; transfer to
    ResNet-56 far above its clean error (0 on this batch, 5 % on the 300 images)."""
    x_adv, model, problem = attack_run(name)
    check_output(x_adv, problem.x, 0.03, "linf")
    white, transfer = success(model, x_adv, problem), success(zoo[56], x_adv, problem)
    print(f"\n{name}: white-box {white:.3f}, transfer to ResNet-56 {transfer:.3f} ({len(problem.x)} images)")
    assert white >= 0.95
    assert transfer >= 0.5


@pytest.mark.parametrize("name", ["i_fgsm", "mi_di_ti_fgsm", "ens_logit"])
def test_recipe_targeted_on_surrogate(name, attack_run):
    """Target (y + 1) mod 10. 30 iterations instead of the recipe's 300 keep the file fast: 30 steps of eps/10
    already span the ball twice and white-box targeted success saturates (300 is checked in the schema test)."""
    x_adv, model, problem = attack_run(name, targeted=True, iterations=30)
    check_output(x_adv, problem.x, 0.03, "linf")
    white = success(model, x_adv, problem)
    print(f"\n{name} targeted: white-box {white:.3f}")
    assert white >= 0.95


def test_recipe_l2_on_surrogate(attack_run):
    """L2 eps 1, step 0.1 (Table VII); 30 iterations (3x the ball radius) keep the file fast."""
    x_adv, model, problem = attack_run("mi_fgsm", norm="l2", iterations=30)
    check_output(x_adv, problem.x, 1.0, "l2")
    assert success(model, x_adv, problem) >= 0.95


def test_logit_ensemble_of_real_models_averages_logits(attack_run, zoo, batch):
    _, model, _ = attack_run("ens_logit", targeted=True, iterations=30)
    with torch.no_grad():
        assert torch.allclose(model(batch[0]), (zoo[20](batch[0]) + zoo[32](batch[0])) / 2, atol=1e-5)
