"""QEBA (HSJA with pluggable probe generators, gap G8) and CISA (transfer phase on white-box surrogates, then
customized-sampling noise compression).

Core math against independent references (the DCT probes through scipy's DCT, the bilinear resize by hand, the
``griddle`` mask against a per-sample transcription of the authors' loop, CISA's worthless-step test and one
compression step by hand); per-sample random streams; surrogate work never reaches the oracle count; batch-size
invariance of records (float64 digits models); the real pretrained CIFAR-10 ResNet-20 (QEBA) and ResNet-56 with
ResNet-20/32 surrogates (CISA) at L2 1.0 and Linf 0.03, targeted runs and tiny budgets (skipped without the offline
data).
"""
import math

import numpy as np
import pytest
import torch
from scipy.fft import dctn, idctn
from torch import nn

from blackboxbench.prep.models import _digits_model, build_model
from blackboxbench.query.cisa import griddle, worthless
from blackboxbench.query.hsja import estimate_direction, generator
from blackboxbench.query.probes import PROBES, draw_probes, orthonormal, reduced
from blackboxbench.registry import PERTURB
from blackboxbench.rng import Streams

from attack_utils import Linear2, check_outputs, correctly_classified, make_ctx, resnet20_images, run_query
from test_engine import records_by_batch_size
from test_score_surrogate import Counting, run_surrogate

SHAPE = (3, 32, 32)


def _ctx(n=3, shape=SHAPE):
    x = torch.full((n, *shape), 0.5)
    return make_ctx(nn.Identity(), x, torch.zeros(n, dtype=torch.long), 1.0, "l2", 10)


def _fresh(n=3, seed=0):
    return Streams(seed, n, "cpu").view(torch.arange(n))


# ---------------------------------------------------------------- probe generators (G8)

def test_gaussian_probes_are_hsjas_own_draws():
    """``gaussian`` draws exactly what HSJA drew before the generators existed (bit-identical HSJA runs)."""
    owner = torch.tensor([0, 0, 1, 2, 2])
    for norm in ("linf", "l2"):
        got = draw_probes("gaussian", _ctx(), owner, SHAPE, norm, 4.0)
        ref = _fresh().uniform(SHAPE, rows=owner) * 2 - 1 if norm == "linf" else _fresh().normal(SHAPE, rows=owner)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_shapes_and_per_sample_streams(name):
    """(m, C, H, W) finite non-zero directions; a sample's rows do not depend on the other samples drawn with it."""
    ctx = _ctx(4)
    owner = torch.tensor([0, 0, 1, 3, 3, 3])
    rows = draw_probes(name, ctx, owner, SHAPE, "l2", 4.0)
    assert rows.shape == (6, *SHAPE) and torch.isfinite(rows).all()
    assert (rows.flatten(1).norm(dim=1) > 0).all()
    alone = draw_probes(name, _ctx(4).sub(torch.tensor([3])), torch.tensor([0, 0, 0]), SHAPE, "l2", 4.0)
    assert torch.equal(alone, rows[3:])
    again = draw_probes(name, ctx, owner, SHAPE, "l2", 4.0)  # the streams advanced: new directions
    assert not torch.equal(again, rows)



@pytest.mark.parametrize("name", ["dct", "resize"])
def test_a_subspace_smaller_than_one_pixel_keeps_one(name):
    """The subspace side is ``int(side / factor)`` (32 / 3: 10) but at least 1: at factor 4 on 2 x 2 images the
    probes are one coarse value per channel (a constant channel), not empty (all-zero directions)."""
    assert reduced(32, 3.0) == 10 and reduced(2, 4.0) == 1
    shape = (3, 2, 2)
    rows = draw_probes(name, _ctx(1, shape=shape), torch.tensor([0, 0]), shape, "l2", 4.0)
    flat = rows.flatten(2)
    assert (flat.abs().amin(2) > 1e-3).all() and torch.allclose(flat, flat[..., :1].expand_as(flat), atol=1e-6)

def test_dct_probes_lie_in_the_low_frequency_band():
    """scipy's orthonormal 2-D DCT of each probe is ~0 outside the int(32/4) = 8 x 8 block of every channel, and
    inside it is an orthogonal matrix (the authors' QR-of-Gaussian coefficients): the probe has norm sqrt(8) per
    channel."""
    rows = draw_probes("dct", _ctx(2), torch.tensor([0, 1, 1]), SHAPE, "linf", 4.0).double().numpy()
    coeff = dctn(rows, axes=(2, 3), norm="ortho")
    f = reduced(32, 4.0)
    assert f == 8
    inside = np.zeros(SHAPE, dtype=bool)
    inside[:, :f, :f] = True
    assert np.abs(coeff[:, ~inside]).max() < 1e-5
    block = torch.from_numpy(coeff[:, :, :f, :f])
    eye = torch.eye(f, dtype=torch.float64)
    assert torch.allclose(block.transpose(-1, -2) @ block, eye.expand_as(block), atol=1e-5)
    assert np.allclose(np.linalg.norm(rows.reshape(3, 3, -1), axis=2), math.sqrt(f), atol=1e-5)
    # a 6 x 4 block (non-square image) is orthonormal along its short side
    q = orthonormal(torch.randn(5, 6, 4, dtype=torch.float64))
    assert torch.allclose(q.transpose(-1, -2) @ q, torch.eye(4, dtype=torch.float64).expand(5, 4, 4), atol=1e-12)
    q = orthonormal(torch.randn(5, 4, 6, dtype=torch.float64))
    assert torch.allclose(q @ q.transpose(-1, -2), torch.eye(4, dtype=torch.float64).expand(5, 4, 4), atol=1e-12)


def test_resize_probes_are_bilinear_upsampling_by_hand():
    """4 x 4 from 2 x 2 (factor 2), pixel-centre bilinear with the coarse image mirrored past its edge pixels (the
    authors' ``skimage.transform.resize``, order 1, mode ``reflect``): (1, 1) mixes with weights 3/4 and 1/4 per
    axis, and so do the corners (coarse index -1 reads 1), where clamped edges copied the coarse pixel."""
    shape = (1, 4, 4)
    got = draw_probes("resize", _ctx(1, shape=shape), torch.tensor([0]), shape, "l2", 2.0)[0, 0]
    a = _fresh(1).normal((1, 2, 2), rows=torch.tensor([0]))[0, 0]
    w = torch.tensor([0.75, 0.25])
    assert torch.allclose(got[1, 1], w @ a @ w, atol=1e-6)
    assert torch.allclose(got[1, 2], w @ a @ w.flip(0), atol=1e-6)
    assert torch.allclose(got[0, 0], w @ a @ w, atol=1e-6)
    assert torch.allclose(got[0, 3], w @ a @ w.flip(0), atol=1e-6)
    assert torch.allclose(got[3, 3], w.flip(0) @ a @ w.flip(0), atol=1e-6)
    assert not torch.allclose(got[0, 0], a[0, 0], atol=1e-3)


@pytest.mark.parametrize("side,factor", [(32, 2.0), (32, 4.0), (32, 3.0), (29, 2.5), (4, 4.0)])
def test_resize_probes_match_skimage_resize(side, factor):
    """QEBA-S probes equal the authors' ``transform.resize(p_small.transpose(1, 2, 0), (H, W, 3))`` of the same
    coarse Gaussian image (skimage's defaults: order 1, mode reflect), outer ring included."""
    transform = pytest.importorskip("skimage.transform")
    shape = (3, side, side)
    got = draw_probes("resize", _ctx(1, shape=shape), torch.tensor([0]), shape, "l2", factor)[0].double().numpy()
    small = _fresh(1).normal((3, reduced(side, factor), reduced(side, factor)), rows=torch.tensor([0]))[0]
    ref = transform.resize(small.double().numpy().transpose(1, 2, 0), (side, side, 3)).transpose(2, 0, 1)
    np.testing.assert_allclose(got, ref, atol=1e-5)



def test_subspace_probes_of_a_non_square_image():
    """On 8 x 12 images (factor 2) the subspace is 4 x 6 per channel: QEBA-S probes equal skimage's resize of the
    4 x 6 coarse draw, and QEBA-F's DCT coefficients fill the 4 x 6 low-frequency block with orthonormal rows."""
    transform = pytest.importorskip("skimage.transform")
    shape, one = (3, 8, 12), torch.tensor([0])
    got = draw_probes("resize", _ctx(1, shape=shape), one, shape, "l2", 2.0)[0].double().numpy()
    small = _fresh(1).normal((3, 4, 6), rows=one)[0].double().numpy()
    np.testing.assert_allclose(got, transform.resize(small.transpose(1, 2, 0), (8, 12, 3)).transpose(2, 0, 1),
                               atol=1e-5)
    coeff = dctn(draw_probes("dct", _ctx(1, shape=shape), one, shape, "l2", 2.0)[0].double().numpy(), axes=(1, 2),
                 norm="ortho")
    inside = np.zeros(shape, dtype=bool)
    inside[:, :4, :6] = True
    assert np.abs(coeff[~inside]).max() < 1e-5
    block = torch.from_numpy(coeff[:, :4, :6])
    assert torch.allclose(block @ block.transpose(-1, -2), torch.eye(4, dtype=torch.float64).expand(3, 4, 4),
                          atol=1e-5)
    assert block.abs().sum(1).min() > 1e-3  # every one of the 6 columns used

def test_dct_gradient_estimate_is_the_normal_projected_on_the_subspace():
    """At a boundary point of a linear model, with probes too small to be clipped, the DCT estimate is a unit vector
    in the 2 x 2 band of each channel (factor 4 on 8 x 8) and close to the normal projected there (independent
    reference: scipy's DCT of w, band kept, back to pixels)."""
    shape = (3, 8, 8)
    w = torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    x = torch.full((2, *shape), 0.5)
    ctx = make_ctx(Linear2(w), x, torch.zeros(2, dtype=torch.long), 1.0, "l2", 10_000, "label", num_classes=2)
    grad, agreed = estimate_direction(ctx, x, torch.tensor([400, 400]), torch.full((2,), 0.01),
                                       generator(ctx, "dct", 4.0))
    assert torch.allclose(grad.flatten(1).norm(dim=1), torch.ones(2)) and not agreed.any()
    coeff = dctn(w.view(shape).double().numpy(), axes=(1, 2), norm="ortho")
    band = np.zeros_like(coeff)
    band[:, :2, :2] = coeff[:, :2, :2]
    assert np.abs(dctn(grad.double().numpy(), axes=(2, 3), norm="ortho")[:, :, 2:]).max() < 1e-5
    ref = torch.from_numpy(idctn(band, axes=(1, 2), norm="ortho")).flatten()
    cos = grad.double().flatten(1) @ ref / ref.norm()
    assert (cos > 0.9).all(), cos
    assert ctx.oracle.counts.tolist() == [400, 400]


def test_probe_pieces_bound_each_call_and_keep_the_estimate(monkeypatch):
    """With room for 5 probe images per call, three samples asking 12, 7 and 0 probes: no oracle call holds more
    than two pieces' worth (10 images), a sample's probes come in pieces of 5, and the estimate equals the one-call
    estimate on the same directions (a draw stub handing each sample its next rows of a fixed table), to float
    precision: the pieces change the memory, not the arithmetic."""
    from blackboxbench.query import common

    shape = (3, 4, 4)
    w = torch.randn(48, generator=torch.Generator().manual_seed(5))
    x = 0.5 + 0.002 * torch.randn(3, *shape, generator=torch.Generator().manual_seed(7))  # near the hyperplane
    table = torch.randn(3, 12, *shape, generator=torch.Generator().manual_seed(6))
    num, delta = torch.tensor([12, 7, 0]), torch.full((3,), 0.05)

    def estimate(values):
        monkeypatch.setattr(common, "PROBE_VALUES", values)
        ctx = make_ctx(Linear2(w), x, torch.zeros(3, dtype=torch.long), 1.0, "l2", 10_000, "label",
                       num_classes=2)
        used, sizes = [0, 0, 0], []

        def draw(owner, _shape):
            sizes.append(owner.tolist())
            rows = []
            for o in owner.tolist():
                rows.append(table[o, used[o]])
                used[o] += 1
            return torch.stack(rows)

        grad, agreed = estimate_direction(ctx, x, num, delta, draw)
        return grad, agreed, sizes, ctx.oracle.counts.tolist()

    one, agreed_one, calls_one, counts = estimate(1 << 20)
    cut, agreed_cut, calls_cut, counts_cut = estimate(5 * 48)
    assert len(calls_one) == 1 and counts == counts_cut == [12, 7, 0]
    assert max(len(c) for c in calls_cut) <= 10 and all(c.count(i) <= 5 for c in calls_cut for i in range(3))
    assert torch.allclose(one, cut, atol=1e-6) and torch.equal(agreed_one, agreed_cut)
    assert not agreed_one[:2].any() and torch.allclose(one[:2].flatten(1).norm(dim=1), torch.ones(2))


# ---------------------------------------------------------------- CISA math

def _griddle_reference(delta, rate, u):
    """The authors' griddle loop for one sample (on 0-255 pixel units), with given uniform draws ``u``."""
    noise = np.abs(np.round(delta * 255))
    drop_rate = 1 - rate
    total = np.sum(noise != 0)
    deleted = 0
    for i in range(1, 256):
        if np.sum(noise == i) != 0:
            now = deleted + np.sum(noise == i)
            if now / (total * 1.0) >= drop_rate:
                lottery = (drop_rate * total - deleted) / np.sum(noise == i)
                level = noise == i
                noise[level & (u < lottery)] = 0
                break
            noise[noise == i] = 0
            deleted = now
    return (noise != 0).astype(np.float64)


def test_griddle_matches_the_authors_loop():
    g = torch.Generator().manual_seed(0)
    delta = (torch.randint(-6, 7, (4, 3, 5, 5), generator=g) / 255.0).double()  # many ties on the 8-bit levels
    delta[3] = 0  # nothing perturbed: empty mask
    u = torch.rand(delta.shape, generator=g, dtype=torch.float64)
    for rate in (0.2, 0.5, 1.0):
        got = griddle(delta, rate, u)
        for i in range(4):
            ref = _griddle_reference(delta[i].numpy(), rate, u[i].numpy())
            assert np.array_equal(got[i].numpy(), ref), (rate, i)
    kept = griddle(delta, 0.2, u)[:3].flatten(1).sum(1)
    assert ((kept - 0.2 * (delta[:3].flatten(1) != 0).sum(1)).abs() < 8).all()  # about 20 % (ties drawn)


def test_worthless_step_is_the_authors_value_estimate():
    """A trajectory is dropped once its next step is predicted to end at least alpha = 0.9985 of the way to the
    Gaussian start (f^2 - g f + 0.0015 g^2 >= 0 with f = a (1 + 1/k))."""
    g = torch.tensor([1.0, 1.0, 1.0, 1.0])
    a = torch.tensor([0.50, 0.94, 0.95, 0.0005])
    k = torch.tensor([10, 19, 19, 1])
    assert worthless(g, a, k, 0.9985).tolist() == [False, False, True, True]  # f 0.55, 0.9895, 1.0, 0.001


def test_cisa_step_by_hand():
    """One compression step on a linear model, two samples far inside the adversarial side and two just across the
    boundary: each sample asks once; an adversarial candidate (L2) lies on the sphere of radius
    (1 - source_step) * dist; a failed one adds its probe to the failure memory (which the next probes' mean
    negates); the masked probe only touches the largest 20 % of |x_adv - x|."""
    shape = (1, 6, 6)
    w = torch.randn(36, generator=torch.Generator().manual_seed(1))
    x = torch.full((4, *shape), 0.5)
    d = 0.15 * w.sign().view(1, *shape) * torch.linspace(0.5, 1.0, 36).view(1, *shape)
    t = (d.flatten() @ w).item()
    scale = torch.tensor([1.5, 1.5, 1.0005, 1.0005]).view(4, 1, 1, 1)  # w . d = t * scale
    far = x + d * scale
    ctx = make_ctx(Linear2(w, t), x, torch.zeros(4, dtype=torch.long), 0.01, "l2", 100, "label", num_classes=2)
    state = dict(x_bd=far, dist=ctx.problem.dist(far), claimed=torch.full((4,), float("inf")), x_adv=far,
                 success=torch.zeros(4, dtype=torch.bool), step_scale=torch.ones(4, dtype=torch.float64),
                 window=torch.zeros((4, 2), dtype=torch.long), failed=torch.zeros_like(x),
                 failures=torch.zeros(4, dtype=torch.long))
    out = PERTURB.get("cisa")(ctx, state, source_step=0.01, spherical_step=0.1, rate=0.2)
    assert ctx.oracle.counts.tolist() == [1, 1, 1, 1] and out["window"][:, 0].tolist() == [1, 1, 1, 1]
    moved = (out["x_bd"] != far).flatten(1).any(1)
    assert moved[:2].all() and not moved[2:].all(), moved
    assert torch.allclose(out["dist"][moved], 0.99 * state["dist"][moved], rtol=1e-5)
    assert torch.equal(out["x_bd"][~moved], far[~moved]) and torch.equal(out["dist"][~moved], state["dist"][~moved])
    assert out["failures"].tolist() == (~moved).long().tolist() and out["window"][:, 1].tolist() == moved.tolist()
    mag = (far - x).abs().flatten(1)
    top = mag >= mag.quantile(0.75, dim=1, keepdim=True)
    assert (out["failed"].flatten(1)[~top] == 0).all() and (out["failed"][~moved] != 0).any()
    assert (out["failed"][moved] == 0).all()
    # Linf: the candidate lies in the box shrunk by source_step
    ctx = make_ctx(Linear2(w, t), x, torch.zeros(4, dtype=torch.long), 0.01, "linf", 100, "label", num_classes=2)
    state.update(dist=ctx.problem.dist(far))
    out = PERTURB.get("cisa")(ctx, state, source_step=0.01, spherical_step=0.1, rate=0.2)
    moved = (out["x_bd"] != far).flatten(1).any(1)
    assert ctx.oracle.counts.tolist() == [1, 1, 1, 1] and moved[:2].all()
    assert (out["dist"][moved] <= 0.99 * state["dist"][moved] + 1e-7).all()


# ---------------------------------------------------------------- engine contracts (digits, no data)

def test_cisa_surrogate_work_never_reaches_the_oracle_count():
    from blackboxbench.prep.data import digits

    target, surrogate = Counting(_digits_model("digits_mlp", True)), Counting(_digits_model("digits_cnn", True))
    ds = digits(n=12)
    problem, res = run_surrogate("cisa", target, [surrogate], ds.x, ds.y, 0.3, "linf", budget=60)
    attacked = int(res.attacked.sum())
    # + the clean check and the audit (one image a sample each) and the randomized-model check (8 images, twice)
    assert target.images == int(res.queries.sum()) + len(ds.y) + attacked + 16, (target.images, res.queries)
    assert surrogate.images > 0
    check_outputs(problem, res, target, 60)


BATCH_CASES = [("qeba", "linf", 0.2, False, None, 1000), ("qeba", "l2", 1.5, True, None, 1000),
               ("cisa", "l2", 1.5, False, ["test_digits_cnn_f64"], 300),
               ("cisa", "linf", 0.3, True, ["test_digits_cnn_f64"], 300)]


@pytest.mark.parametrize("attack,norm,eps,targeted,surrogates,budget", BATCH_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'t' if c[3] else 'u'}" for c in BATCH_CASES])
def test_records_do_not_depend_on_the_batch_size(tmp_path, attack, norm, eps, targeted, surrogates, budget):
    """batch_size 1, 7 and 100 give identical records (float64 digits MLP target and CNN surrogate)."""
    extra = {"surrogates": surrogates} if surrogates else {}
    runs = records_by_batch_size(tmp_path, attack, norm, eps, targeted, budget, dataset={"name": "digits", "n": 10},
                                 **extra)
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 4


# ---------------------------------------------------------------- real CIFAR-10 models

EPS = {"linf": 0.03, "l2": 1.0}  # Table V, CIFAR-10


@pytest.fixture(scope="module")
def resnet20(data_root):
    return resnet20_images(data_root, n=4, pool=12)


@pytest.fixture(scope="module")
def resnet56(data_root):
    target = build_model("cifar_resnet56", data_root)
    surrogates = [build_model(f"cifar_resnet{d}", data_root) for d in (20, 32)]
    return (target, surrogates, *correctly_classified([target], data_root, n=4, pool=12))


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_qeba_untargeted_resnet20(resnet20, norm):
    """Measured on these 4 images (seed 0, 10,000 queries): 4/4 fooled at L2 1.0 (queries 946, 2104, 946, 134) and
    at Linf 0.03 (1246, 1248, 977, 141); a 1,500 budget keeps the test short (3/4 and 4/4 expected)."""
    model, x, y = resnet20
    problem, res = run_query("qeba", model, x, y, EPS[norm], norm, budget=1500)
    check_outputs(problem, res, model, 1500)
    assert res.success.sum() >= 2, res.queries


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_cisa_untargeted_resnet56_with_resnet_surrogates(resnet56, norm):
    """Measured on these 4 images (seed 0, 10,000 queries): L2 1.0 4/4 (queries 27, 16, 13, 11); Linf 0.03 3/4
    (12, 9, 9), the fourth not within 10,000. The transfer phase does nearly all the work: 100 queries suffice."""
    target, surrogates, x, y = resnet56
    problem, res = run_surrogate("cisa", target, surrogates, x, y, EPS[norm], norm, budget=100)
    check_outputs(problem, res, target, 100)
    assert res.success.sum() >= 3, res.queries
    assert res.queries[res.success].float().median() <= 60, res.queries


def test_targeted_resnets(resnet20, resnet56):
    """Three images of different classes, each targeted at another's class (its image is in the batch: a natural
    start), 3x the Table V eps as HSJA's targeted smoke test. QEBA: Linf, 2,000 queries; CISA: L2, 100 queries
    (measured: 3/3 fooled with 3, 46 and 13 queries; at L2 1.0, 2/3 within 500)."""
    for model, x, y, run, norm, eps, budget in (
            (resnet20[0], *resnet20[1:], run_query, "linf", 3 * EPS["linf"], 2000),
            (resnet56[0], *resnet56[2:], lambda *a, **k: run_surrogate(a[0], a[1], resnet56[1], *a[2:], **k), "l2",
             3 * EPS["l2"], 100)):
        first = torch.tensor([int((y == c).nonzero()[0]) for c in y.unique()])[:3]
        xs, ys = x[first], y[first]
        name = "qeba" if run is run_query else "cisa"
        problem, res = run(name, model, xs, ys, eps, norm, budget=budget, target=ys.roll(1))
        check_outputs(problem, res, model, budget)
        assert res.success.any(), (name, res.queries)


def test_tiny_budget_ends_without_false_success(resnet20, resnet56):
    model, x, y = resnet20
    for norm in ("linf", "l2"):
        problem, res = run_query("qeba", model, x, y, EPS[norm], norm, budget=20)
        check_outputs(problem, res, model, 20)
        assert (res.queries[~res.success] == 20).all() and (~res.success).sum() >= 3
    target, surrogates, x, y = resnet56
    for norm, eps in (("linf", 1 / 255), ("l2", 0.05)):
        problem, res = run_surrogate("cisa", target, surrogates, x, y, eps, norm, budget=5)
        check_outputs(problem, res, target, 5)
        assert (res.queries <= 5).all()


class _Always(torch.nn.Module):
    """Always class 1 of two: every query of a label-0 sample is adversarial."""

    def forward(self, x):
        return torch.stack([torch.zeros(x.shape[0], dtype=x.dtype), torch.ones(x.shape[0], dtype=x.dtype)], 1)


def test_cisa_success_window_failure_memory_and_mean():
    """Every query adversarial, from pre-set per-sample state: the source step adapts once a sample's window holds
    20 queries (``exp(p - 0.2)``, p its success rate; the window then empties), not at 19; a success clears the
    failure memory; the probe's mean is minus the mean failed probe, so a large memory of failed probes all
    negative on the mask pushes the candidate towards more positive values on it (L2)."""
    shape = (1, 6, 6)
    n = 3
    x = torch.full((n, *shape), 0.5)
    d = (torch.arange(36).float().view(1, *shape) + 10) / 255  # positive, distinct 8-bit levels
    far = x + d
    ctx = make_ctx(_Always(), x, torch.zeros(n, dtype=torch.long), 0.01, "l2", 100, "label", num_classes=2)
    failed = torch.zeros_like(x)
    failed[0] = -1000.0  # the memory of sample 0: 10 failures of -100 each
    state = dict(x_bd=far, dist=ctx.problem.dist(far), claimed=torch.full((n,), float("inf")), x_adv=far,
                 success=torch.zeros(n, dtype=torch.bool), step_scale=torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64),
                 window=torch.tensor([[0, 0], [19, 3], [18, 3]]), failed=failed,
                 failures=torch.tensor([10, 0, 0]))
    out = PERTURB.get("cisa")(ctx, state, source_step=0.01, spherical_step=0.1, rate=0.2)
    assert out["window"].tolist() == [[1, 1], [0, 0], [19, 4]]
    assert torch.allclose(out["step_scale"], torch.tensor([1.0, math.exp(4 / 20 - 0.2), 2.0], dtype=torch.float64))
    assert (out["failed"] == 0).all() and out["failures"].tolist() == [0, 0, 0]
    mask = griddle(d.expand(n, *shape), 0.2, torch.zeros(n, *shape))[0] > 0
    move = (out["x_bd"][0] - far[0])
    assert float(move[mask].mean()) > 0.25 * 0.1 * float(d.norm()) / math.sqrt(float(mask.sum()))  # about 0.5 x


def test_cisa_transfer_phase_alternates_dual_trajectories_by_hand(monkeypatch):
    """The transfer phase on a linear target with a linear surrogate of the same normal ``w`` (the surrogate's CE
    gradient is then +-w): after the Gaussian search (first adversarial draw at ``noise_g``), the step is
    ``noise_g / 20`` and the trajectories take turns, uphill first: uphill k steps along +w (unit L2, per sample),
    downhill one step along -w, then one back along +w to x, where its next step is predicted worthless and it is
    dropped (uphill goes on alone); the first adversarial point ends the phase. Each sample (two boundaries at
    different distances) gets exactly these queries and ends at ``k* step`` along w. (A small image: the Gaussian
    start, grown slowly, is then only a few times the boundary distance, so the step is a fraction of it.)"""
    import dataclasses

    import blackboxbench.query.cisa as cisa_mod

    shape = (1, 2, 2)
    w = torch.randn(4, generator=torch.Generator().manual_seed(4))
    wu = (w / w.norm()).view(1, *shape)
    x = torch.full((2, *shape), 0.5)
    target = Linear2(w, 0.0)
    # per-sample boundaries: sample i is adversarial beyond distance D_i along w (shift x so the scores differ)
    dists = torch.tensor([0.05, 0.12])
    x = x - dists.view(2, 1, 1, 1) * wu
    ctx = make_ctx(target, x, torch.zeros(2, dtype=torch.long), 1e-3, "l2", 1000, "label", num_classes=2)
    ctx = dataclasses.replace(ctx, surrogates=(Linear2(w, 0.0),))
    asked = []
    real = cisa_mod.query_adv

    def spy(ctx_, images, idx):
        adv, ok = real(ctx_, images, idx)
        asked.append((idx.clone(), images.clone(), adv.clone()))
        return adv, ok

    monkeypatch.setattr(cisa_mod, "query_adv", spy)
    state = cisa_mod.cisa_init(ctx, surrogate_loss="ce", scale_growth=1.1, scale_tries=200)
    for i in range(2):
        mine = [(img[list(idx).index(i)], bool(a[list(idx).index(i)])) for idx, img, a in asked if i in idx.tolist()]
        first = next(k for k, (_, a) in enumerate(mine) if a)  # the Gaussian search's hit
        noise_g = float((mine[first][0] - x[i]).norm())
        step = noise_g / 20
        transfer = mine[first + 1:]
        k_star = math.ceil(float(dists[i]) / step - 1e-6)
        assert k_star >= 3, k_star
        want, up_k, downs = [], 0, [-1, 0]
        while True:  # uphill 1, downhill -1, uphill 2, downhill 0 (then dropped), uphill 3, 4, ...
            up_k += 1
            want.append(up_k)
            if up_k >= k_star:
                break
            if downs:
                want.append(downs.pop(0))
        assert len(transfer) == len(want), (i, len(transfer), want)
        for (img, a), k in zip(transfer, want):
            torch.testing.assert_close(img, (x[i] + k * step * wu[0]).clamp(0, 1), atol=2e-6, rtol=0)
        assert transfer[-1][1] and not any(a for _, a in transfer[:-1])
        assert float(state["dist"][i]) == pytest.approx(k_star * step, rel=1e-4)
