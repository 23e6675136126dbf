"""Score-based attacks (log-probability feedback): Square Linf/L2, NES, SimBA and SimBA-DCT, built from their recipes.

Helpers are checked against slicing references and their defining properties; a linear toy model (no data
needed) checks that every recipe reaches a known boundary on 8x8 images and never claims an unreachable one; the
real pretrained CIFAR-10 ResNet-20 checks success at the paper's budget (Table VI), a targeted run and tiny
budgets (skipped without the offline data).
"""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from blackboxbench.errors import BenchError
from blackboxbench.oracle import Oracle
from blackboxbench.query.common import greedy_update, random_corner, random_window, start_state, window_index, \
    window_mask
from blackboxbench.query.simba import basis_images, strided_band
from blackboxbench.query.square import grid_patterns, l2_window_step as square_l2_step, p_schedule, \
    pseudo_gaussian_windows, side_schedule, square_side
from blackboxbench.registry import ACCEPT, INIT, PERTURB
from blackboxbench.rng import Streams

from attack_utils import Linear, check_output, check_outputs, make_ctx, resnet20_images, run_query

RECIPES = Path(__file__).resolve().parent.parent / "attacks" / "score"
SETTINGS = [("square_linf", "linf"), ("square_l2", "l2"), ("nes", "linf"), ("nes", "l2"),
            ("simba_pixel", "linf"), ("simba_pixel", "l2"), ("simba_dct", "linf"), ("simba_dct", "l2")]
EPS = {"linf": 0.03, "l2": 1.0}  # Table VI, CIFAR-10


# ---------------------------------------------------------------- helpers

def streams(n, seed=0):
    return Streams(seed, n, "cpu").view(torch.arange(n))


def test_window_mask_matches_slicing():
    g = torch.Generator().manual_seed(0)
    size = torch.randint(1, 7, (20,), generator=g)
    mask, top, left = random_window(streams(20), size, (9, 7))
    ref = torch.zeros(20, 1, 9, 7, dtype=torch.bool)
    for i in range(20):
        ref[i, :, top[i]:top[i] + size[i], left[i]:left[i] + size[i]] = True
    assert torch.equal(mask, ref)
    assert (mask.flatten(1).sum(1) == size ** 2).all()  # always fully inside the image
    part = window_mask(torch.tensor([6]), torch.tensor([-1]), 5, 3, (8, 8))  # clipped at the borders
    assert part.sum() == 2 * 2


def test_window_index_matches_the_mask():
    g = torch.Generator().manual_seed(3)
    size = torch.randint(1, 6, (12,), generator=g)  # mixed sides in one call
    rng = streams(12, 3)
    mask, top, left = random_window(rng, size, (7, 9))
    idx = window_index(top, left, size, (2, 7, 9))
    assert idx.shape == (12, 2, int(size.max()), int(size.max()))
    hit = torch.zeros(12, 2 * 7 * 9, dtype=torch.bool).scatter_(1, idx.flatten(1), True).view(12, 2, 7, 9)
    assert torch.equal(hit, mask.expand(-1, 2, -1, -1))  # exactly the window's pixels, in every channel

    same = torch.full((12,), 4)  # one side for the whole batch: the fast path, same indices
    top, left = random_corner(rng, same, (7, 9))
    idx = window_index(top, left, same, (2, 7, 9))
    hit = torch.zeros(12, 2 * 7 * 9, dtype=torch.bool).scatter_(1, idx.flatten(1), True).view(12, 2, 7, 9)
    assert torch.equal(hit, window_mask(top, left, same, same, (7, 9)).expand(-1, 2, -1, -1))


def test_window_corners_reach_every_position():
    """A corner is uniform over the ``H - s + 1`` rows and ``W - s + 1`` columns where the window fits: the
    smallest uniform gives (0, 0), the largest the bottom-right placement."""
    from blackboxbench.query.common import corner_at

    u_max = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    u = torch.tensor([[0.0, 0.0], [u_max, u_max], [0.5, 0.5]], dtype=torch.float64)
    top, left = corner_at(u, torch.tensor([3, 3, 4]), (9, 7))
    assert top.tolist() == [0, 6, 3] and left.tolist() == [0, 4, 2]


def test_greedy_keeps_a_sample_when_the_candidate_only_ties():
    """Square Attack's acceptance is strict: a candidate with the same margin (a flat model) never moves a
    sample, with or without local indices."""
    x = torch.full((3, 1, 2, 2), 0.5)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        flat[1].weight.zero_()
        flat[1].bias.copy_(torch.tensor([0.3, 0.3, -0.2]))
    ctx = make_ctx(flat, x, torch.tensor([0, 1, 2]), 1.0, "l2", 10, num_classes=3)
    state = start_state(ctx, x.clone())
    assert state["success"].tolist() == [False, False, True]  # a tie with another class (margin 0) is no success
    assert not greedy_update(ctx, state, torch.rand(3, 1, 2, 2)).any()
    assert not greedy_update(ctx, state, torch.rand(2, 1, 2, 2), torch.tensor([0, 2])).any()
    assert torch.equal(state["x_adv"], x)


def test_greedy_moves_only_the_improved_samples_and_keeps_earned_successes():
    """Logit of class 0 = sum of the pixels, class 1 = 0: with y = 1 a brighter image has a lower margin."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[1.0] * 4, [0.0] * 4]))
        model[1].bias.zero_()
    x = torch.tensor([0.5, 0.0, 0.0]).view(3, 1, 1, 1).expand(3, 1, 2, 2).clone()
    ctx = make_ctx(model, x, torch.ones(3, dtype=torch.long), 1.0, "l2", 10, num_classes=2)
    state = start_state(ctx, x.clone())
    assert state["success"].tolist() == [True, False, False]
    took = greedy_update(ctx, state, torch.zeros(3, 1, 2, 2))  # worse for sample 0 and not adversarial
    assert not took.any() and state["success"].tolist() == [True, False, False]
    took = greedy_update(ctx, state, torch.full((1, 1, 2, 2), 0.25), torch.tensor([2]))  # local sample 2 only
    assert took.tolist() == [True] and state["success"].tolist() == [True, False, True]
    assert torch.equal(state["x_adv"][:2], x[:2]) and (state["x_adv"][2] == 0.25).all()


def test_randint_below_stays_below_high():
    high = torch.tensor([1, 2, 3, 7, 31, 32, 1000, 2 ** 40 + 3])
    u_max = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    assert ((u_max * high).long() == high - 1).all()  # the largest float64 below 1 never rounds up to high
    draws = torch.stack([streams(len(high), k).randint_below(high) for k in range(200)])
    assert (draws >= 0).all() and (draws < high).all()
    assert (draws[:, 2].bincount(minlength=3) > 0).all()  # every value of [0, 3) is drawn

def test_pseudo_gaussian_window():
    n = 6
    top, left = torch.tensor([0, 1, 2, 3, 0, 5]), torch.tensor([0, 2, 1, 0, 3, 5])
    size = torch.tensor([1, 3, 5, 6, 7, 3])
    pat = pseudo_gaussian_windows(top, left, size, torch.zeros(n, dtype=torch.bool), (9, 10))
    flip = pseudo_gaussian_windows(top, left, size, torch.ones(n, dtype=torch.bool), (9, 10))
    inside = window_mask(top, left, size, size, (9, 10))
    assert torch.allclose(pat.flatten(1).norm(dim=1), torch.ones(n))
    assert (pat[~inside] == 0).all() and (pat[inside] != 0).all()
    for i in range(n):
        t, l, s = top[i], left[i], size[i]
        win = pat[i, 0, t:t + s, l:l + s]
        assert torch.allclose(flip[i, 0, t:t + s, l:l + s], win.T)
        assert (win[s // 2:] < 0).all() and (win[:s // 2] > 0).all()  # two opposite bumps
        if s % 2:
            assert torch.allclose(win, win.flip(1))  # odd windows: each bump symmetric about the middle column
        if s > 1:
            peak = win[s // 2:].abs().argmax()  # the lower bump peaks at its centre
            assert peak // s == (s - s // 2) // 2 and peak % s == s // 2


def _authors_bump(x, y):
    """The authors' rectangle bump (square_attack ``meta_pseudo_gaussian_pert``), written out pixel by pixel."""
    out = torch.zeros(x, y, dtype=torch.float64)
    for i in range(x):
        for j in range(y):
            d = max(abs(i - x // 2), abs(j - y // 2))
            out[i, j] = sum(1.0 / (k + 1) ** 2 for k in range(d, y // 2 + 1))
    return out


def test_pseudo_gaussian_window_against_the_authors_pattern():
    """Each window equals the authors' pattern built pixel by pixel (two rectangle bumps, each normalised, the
    lower negated, the whole normalised; transposed where drawn so), on square and non-square images."""
    gen = torch.Generator().manual_seed(3)
    for h, w in ((9, 10), (12, 7), (16, 16)):
        n = 8
        size = torch.randint(1, min(h, w) + 1, (n,), generator=gen)
        top = (torch.rand(n, generator=gen) * (h - size + 1)).long()
        left = (torch.rand(n, generator=gen) * (w - size + 1)).long()
        flip = torch.rand(n, generator=gen) > 0.5
        got = pseudo_gaussian_windows(top, left, size, flip, (h, w))
        for k in range(n):
            s, t, l = int(size[k]), int(top[k]), int(left[k])
            up, lo = _authors_bump(s // 2, s), _authors_bump(s - s // 2, s)
            up, lo = up / up.norm() if up.numel() else up, lo / lo.norm()
            win = torch.cat([up, -lo])
            win = win / win.norm()
            want = torch.zeros(h, w, dtype=torch.float64)
            want[t:t + s, l:l + s] = win.T if flip[k] else win
            assert torch.allclose(got[k, 0].double(), want, atol=1e-6), (h, w, k)


def _dense_l2_step(x, x_adv, eps, size, corner1, corner2, transpose, signs):
    """The authors' Square L2 update on whole images (masks, not windows), with their final renormalisation."""
    n, c, h, w = x.shape
    win1 = window_mask(*corner1, size, size, (h, w))
    win2 = window_mask(*corner2, size, size, (h, w))
    delta = x_adv - x
    sq = lambda v: v.square().sum((2, 3), keepdim=True)  # noqa: E731
    norm_image = delta.flatten(1).norm(dim=1).view(n, 1, 1, 1)
    bump = pseudo_gaussian_windows(*corner1, size, transpose, (h, w))
    new = bump * signs + delta * win1 / (1e-10 + sq(delta * win1).sqrt())
    budget = ((eps ** 2 - norm_image.square()).clamp_min(0) / c + sq(delta * (win1 | win2))).sqrt()
    new = new / sq(new).sqrt() * budget
    delta = torch.where(win1, new, torch.where(win2, torch.zeros_like(delta), delta))
    return (x + delta / delta.flatten(1).norm(dim=1).view(n, 1, 1, 1) * eps).clamp(0, 1)


@pytest.mark.parametrize("hw", [(16, 16), (12, 9)])
def test_square_l2_window_step_equals_the_dense_update(hw):
    """The window-local step equals the authors' whole-image update (within float rounding: theirs renormalises
    every pixel by a factor of 1), for mixed sides, overlapping windows, both orientations and clipped pixels."""
    gen = torch.Generator().manual_seed(5)
    h, w = hw
    n, c, eps = 24, 3, 1.0
    x = torch.rand(n, c, h, w, generator=gen)
    x_adv = x
    for _ in range(6):  # a chain of steps from the clean image, each on the last one's result
        size = torch.randint(1, 5, (n,), generator=gen) * 2 + 1
        corners = [tuple((torch.rand(n, generator=gen) * (m + 1 - size)).long() for m in (h, w)) for _ in range(2)]
        corners[1] = tuple(torch.where(torch.arange(n) % 4 == 0, a, b) for a, b in zip(corners[0], corners[1]))
        transpose = torch.rand(n, generator=gen) > 0.5
        signs = torch.where(torch.rand(n, c, 1, 1, generator=gen) < 0.5, -1.0, 1.0)
        got = square_l2_step(x, x_adv, eps, size, *corners, transpose, signs)
        want = _dense_l2_step(x, x_adv, eps, size, *corners, transpose, signs)
        assert torch.allclose(got, want, atol=1e-6)
        outside = ~(window_mask(*corners[0], size, size, (h, w)) | window_mask(*corners[1], size, size, (h, w)))
        assert torch.equal(got.masked_select(outside.expand_as(got)), x_adv.masked_select(outside.expand_as(got)))
        assert ((got - x).flatten(1).norm(dim=1) <= eps * (1 + 1e-5)).all()
        x_adv = got
    assert ((got == 0) | (got == 1)).any()  # some pixels were clipped on the way


def _full_image_grid(rng, n, c, size_hw):
    """The L2 initialisation's patterns built as the authors place them: each cell a whole-image window."""
    h, w = size_hw
    s = max(h // 5, 1)
    start = (h - 5 * s) // 2
    delta = torch.zeros(n, c, h, w)
    size = torch.full((n,), s)
    for top in range(start, start + (h // s) * s, s):
        for left in range(start, start + (w // s) * s, s):
            corner = torch.full((n,), top), torch.full((n,), left)
            bump = pseudo_gaussian_windows(*corner, size, rng.uniform(()) > 0.5, (h, w))
            delta = delta + bump * rng.signs((c, 1, 1))
    return delta


@pytest.mark.parametrize("hw", [(32, 32), (299, 299), (28, 28), (19, 19), (9, 9), (14, 20), (32, 10)])
def test_square_l2_init_grid_equals_whole_image_windows(hw):
    """The initialisation built cell by cell (one pattern per cell and orientation) equals the sum of whole-image
    windows with the same draws, also where a cell runs past the image's edge (19, 9, 14 x 20) or lies beyond
    it (9 x 9: cells of side 1 from row 2 to 10)."""
    n, c = 5, 3
    got = grid_patterns(streams(n, 4), n, c, hw, "cpu")
    want = _full_image_grid(streams(n, 4), n, c, hw)
    assert torch.allclose(got, want, atol=1e-6) and (got != 0).any()


def test_p_schedule_follows_the_paper():
    it = torch.tensor([0, 10, 11, 50, 51, 200, 201, 1001, 8000, 8001, 10000, 10001])
    halvings = torch.tensor([0, 0, 1, 1, 2, 2, 3, 5, 8, 9, 9, 0])
    assert torch.allclose(p_schedule(0.05, it, 10_000), 0.05 / 2.0 ** halvings.double())
    assert torch.allclose(p_schedule(0.05, it * 10, 100_000), 0.05 / 2.0 ** halvings.double())


@pytest.mark.parametrize("n_iters", [10_000, 1000, 37, 3])
def test_side_schedule_is_the_p_schedule(n_iters):
    it = torch.arange(0, 3 * n_iters + 20)
    for lo, hi, pixels in [(1, 31, 1024), (3, 27, 784)]:
        assert torch.equal(side_schedule(0.05, it, n_iters, pixels, lo, hi),
                           square_side(p_schedule(0.05, it, n_iters), pixels, lo, hi))


def test_square_side_rounds_to_the_nearest_integer():
    """The window side is round(sqrt(p * pixels)) as in the authors' code (not its floor), then clamped:
    sqrt(0.05 * 299^2) = 66.86 gives 67, sqrt(0.05 * 1024) = 7.16 gives 7, and the bounds apply."""
    p = torch.tensor([0.05, 0.05, 0.5, 1e-4], dtype=torch.float64)
    pixels = torch.tensor([299 * 299, 1024, 1024, 1024])
    want = [round(math.sqrt(a * b)) for a, b in zip(p.tolist(), pixels.tolist())]
    assert want == [67, 7, 23, 0]
    assert square_side(p[:1], 299 * 299, 1, 298).tolist() == [67]
    assert square_side(p[1:], 1024, 1, 20).tolist() == [7, 20, 1]


def test_square_l2_window_side_is_odd_and_at_least_three(monkeypatch):
    """Square L2 draws windows of odd side >= 3 (authors: s = max(round(sqrt(p * H * W)), 3), plus one if
    even): on 32 x 32 images p 0.0625 gives sqrt(64) = 8, hence 9; p 0.05 gives 7; p 0.001 gives 1, hence 3."""
    import blackboxbench.query.square as square

    seen = []
    step = square.l2_window_step
    monkeypatch.setattr(square, "l2_window_step", lambda *a: seen.append(a[3].clone()) or step(*a))
    x = 0.3 + 0.4 * torch.rand(2, 3, 32, 32)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    ctx = make_ctx(model, x, torch.zeros(2, dtype=torch.long), 1.0, "l2", 10_000)
    state = INIT.get("square_init_l2")(ctx)
    for p_init, side in [(0.0625, 9), (0.05, 7), (0.001, 3)]:
        square.square_l2(ctx, state, p_init=p_init)
        assert seen[-1].tolist() == [side, side], (p_init, seen[-1])


def test_square_linf_init_is_vertical_stripes_per_channel():
    """The Linf start is the paper's vertical stripes: every pixel at +-eps, one sign per (sample, channel,
    column) shared by all rows, drawn independently per channel (so the channels' stripes differ)."""
    n, c, h, w = 4, 3, 8, 8
    x = torch.round((0.3 + 0.4 * torch.rand(n, c, h, w)) * 255) / 255
    model = nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 10))
    ctx = make_ctx(model, x, torch.zeros(n, dtype=torch.long), 8 / 255, "linf", 100)
    sign = torch.sign(INIT.get("square_init_linf")(ctx)["x_adv"] - x)
    assert (sign != 0).all()
    assert torch.equal(sign, sign[:, :, :1].expand_as(sign))  # constant down each column
    assert (sign[:, 0] != sign[:, 1]).any() and (sign[:, 1] != sign[:, 2]).any()  # channels drawn apart
    assert (sign[:, :, 0] != sign[:, :, 0, :1]).any()  # columns drawn apart


def test_simba_bases():
    c, h, w = 2, 4, 4
    coords = torch.arange(c * h * w)
    dct = basis_images(coords, (c, h, w), True).flatten(1)
    assert torch.allclose(dct @ dct.T, torch.eye(c * h * w), atol=1e-5)  # orthonormal
    assert torch.allclose(dct[0], torch.full((c * h * w,), 0.25) * (torch.arange(c * h * w) < h * w))  # DC
    assert torch.equal(basis_images(coords, (c, h, w), False).flatten(1), torch.eye(c * h * w))
    band = strided_band(32, 32, 28, 7, "cpu").view(32, 32)
    assert (band[:28, :28] == 0).all() and (band[28:, :] == 1).all() and (band[:, 28:] == 1).all()
    assert (strided_band(8, 8, 28, 7, "cpu") == 0).all()  # freq_dims clamped to small images


def test_simba_dct_order_is_strided_and_per_sample():
    x = torch.rand(3, 3, 32, 32)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    ctx = make_ctx(model, x, torch.zeros(3, dtype=torch.long), 0.03, "linf", 10)
    state = INIT.get("simba_init_dct")(ctx, freq_dims=28, stride=7)
    perm = state["perm"]
    band = strided_band(32, 32, 28, 7, "cpu").repeat(3)[perm]
    assert (band[:, :3 * 28 * 28] == 0).all() and (band[:, 3 * 28 * 28:] == 1).all()
    assert torch.equal(perm.sort(1).values, torch.arange(3 * 32 * 32).expand(3, -1))
    assert not torch.equal(perm[0], perm[1])


def test_simba_asks_the_plus_candidate_only_where_minus_failed():
    """SimBA (paper Alg. 1) queries x + delta - step q, and x + delta + step q only where the first did not lower
    the margin: 1 or 2 queries per iteration and sample, and delta moves by the accepted one (or not at all)."""
    model, x, y, _ = make_toy()
    ctx = make_ctx(model, x, y, 0.5, "l2", 1000, num_classes=5)
    state = INIT.get("simba_init_pixel")(ctx)
    asked = []
    for _ in range(10):
        before, delta = ctx.oracle.counts.clone(), state["delta"].clone()
        proposal = PERTURB.get("simba_pixel")(ctx, state)
        state = ACCEPT.get("simba_greedy")(ctx, state, proposal)
        moved = (state["delta"] - delta).flatten(1)
        minus = (moved == -proposal["move"].flatten(1)).all(1) & (moved != 0).any(1)
        assert (moved == 0).all(1).logical_or(minus).logical_or((moved == proposal["move"].flatten(1)).all(1)).all()
        asked.append(ctx.oracle.counts - before)
        assert torch.equal(asked[-1], torch.where(minus, 1, 2))
    assert 1 in torch.stack(asked) and 2 in torch.stack(asked)


def test_greedy_update_never_accepts_a_refused_query():
    x = torch.full((4, 1, 2, 2), 0.5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        y = model(x).argmax(1)
    ctx = make_ctx(model, x, y, 1.0, "l2", 1, num_classes=3)
    state = start_state(ctx, x.clone())
    assert torch.isfinite(state["margin"]).all() and not state["success"].any()
    before = {k: v.clone() for k, v in state.items()}
    took = greedy_update(ctx, state, torch.rand(4, 1, 2, 2))  # every row past the budget
    assert not took.any() and not state["success"].any()
    assert all(torch.equal(before[k], state[k]) for k in state)
    from blackboxbench.query.common import query_margin
    margin, adv, ok = query_margin(ctx, x)
    assert not ok.any() and not adv.any() and (margin == math.inf).all()  # +inf, as documented (not NaN)


def test_square_rejects_the_other_norm():
    x = torch.rand(2, 3, 8, 8)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    with pytest.raises(BenchError):
        run_query("square_linf", model, x, torch.zeros(2, dtype=torch.long), 1.0, "l2", budget=10)
    with pytest.raises(BenchError):
        run_query("square_l2", model, x, torch.zeros(2, dtype=torch.long), 0.03, "linf", budget=10)


# ---------------------------------------------------------------- toy linear model (no data)

def make_toy():
    """4 grey 8x8 images (digits-sized), class 0 of 5 by a margin; returns per norm each image's smallest eps
    reaching another class."""
    g = torch.Generator().manual_seed(1)
    x = torch.round((0.3 + 0.4 * torch.rand(4, 1, 8, 8, generator=g)) * 255) / 255
    w = torch.randn(5, 8 * 8, generator=g)
    logits = x.flatten(1) @ w.T
    b = torch.zeros(5)
    b[0] = (logits[:, 1:].max() - logits[:, 0].min()).item() + 0.5
    margin = (logits + b)[:, :1] - (logits + b)[:, 1:]  # (4, 4) > 0
    need = {"linf": (margin / (w[:1] - w[1:]).abs().sum(1)).min(1).values,
            "l2": (margin / (w[:1] - w[1:]).norm(dim=1)).min(1).values}
    return Linear(w, b), x, torch.zeros(4, dtype=torch.long), need


@pytest.fixture(scope="module")
def toy():
    return make_toy()


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_toy_linear_boundary_is_crossed(toy, name, norm):
    model, x, y, need = toy
    eps = 2 * need[norm].max().item()  # NES L2 (0.01 steps, Table VI) needs ~3000 queries here, the rest < 500
    problem, res = run_query(name, model, x, y, eps, norm, budget=5000, num_classes=5)
    assert res.success.all(), res.queries
    check_outputs(problem, res, model, 5000)


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_toy_unreachable_is_never_claimed(toy, name, norm):
    model, x, y, need = toy
    problem, res = run_query(name, model, x, y, 0.9 * need[norm].min().item(), norm, budget=200, num_classes=5)
    assert not res.success.any() and (res.queries == 200).all() and not res.stalled.any()
    check_outputs(problem, res, model, 200)


def test_square_linf_confirms_success_without_an_extra_forward(toy, monkeypatch):
    """Square Linf queries images on the uint8 grid, so the image it returns is one the oracle has answered: the
    pipeline's confirmation reuses that answer, with no forward and no count."""
    model, x, y, need = toy
    eps = math.ceil(2 * need["linf"].max().item() * 255) / 255
    confirm, forwarded = Oracle.confirm, []

    def watched(self, *args, **kw):
        before = self.forwarded
        out = confirm(self, *args, **kw)
        forwarded.append(self.forwarded - before)
        return out

    monkeypatch.setattr(Oracle, "confirm", watched)
    problem, res = run_query("square_linf", model, x, y, eps, "linf", budget=2000, num_classes=5)
    assert res.success.all() and len(forwarded) >= 1 and sum(forwarded) == 0, forwarded
    check_outputs(problem, res, model, 2000)


def test_square_linf_step_changes_the_window_whenever_it_can(toy):
    """Every Square Linf step changes its window (one draw of 16 vertices, the first that changes it): from a
    state at the vertices, 50 steps of 4 images on the toy model each give a candidate other than the current
    image, inside the eps ball and on the uint8 grid; with eps 0 no vertex can change it and the step returns the
    image as it is."""
    from blackboxbench.query.square import square_init_linf, square_linf

    model, x, y, need = toy
    for eps in (8 / 255, 0.0):
        ctx = make_ctx(model, x, y, eps, "linf", budget=10_000, num_classes=5)
        state = square_init_linf(ctx)
        for _ in range(50):
            cand = square_linf(ctx, state)["x_adv"]
            changed = (cand != state["x_adv"]).flatten(1).any(1)
            assert bool(changed.all()) if eps else not bool(changed.any())
            check_output(cand, x, eps, "linf")
            assert torch.equal(cand, torch.round(cand * 255) / 255)
            state = dict(state, x_adv=cand, it=state["it"] + 1)


# ---------------------------------------------------------------- real CIFAR-10 ResNet-20

@pytest.fixture(scope="module")
def cifar(data_root):
    return resnet20_images(data_root, n=16, pool=24)


# (recipe, norm, images, budget, max median queries). Measured with seed 0 on these 8 images: every setting
# fools 8/8 at Table VI's 10,000 queries, median queries square_linf 39, square_l2 81, nes linf 157,
# simba_pixel linf 285, simba_pixel l2 101, simba_dct linf 74, simba_dct l2 77; the caps leave ~4-5x.
# NES L2 is left out: with Table VI's 0.01 step it needs 4,474 median queries (4/4 images, 35 s) and fools
# 10/16 images at 10,000; the toy model and the tiny-budget test cover it.
REAL = [("square_linf", "linf", 8, 10_000, 200), ("square_l2", "l2", 8, 10_000, 400),
        ("nes", "linf", 8, 10_000, 700), ("simba_pixel", "linf", 8, 10_000, 1200),
        ("simba_pixel", "l2", 8, 10_000, 500), ("simba_dct", "linf", 8, 10_000, 400),
        ("simba_dct", "l2", 8, 10_000, 400)]


@pytest.mark.parametrize("name,norm,n,budget,max_median", REAL)
def test_untargeted_on_resnet20(cifar, name, norm, n, budget, max_median):
    """Success rate >= 7/8 (one image of slack for platform numerics) and a median query count near the measured
    one, so a slowed-down attack fails too."""
    model, x, y = cifar
    problem, res = run_query(name, model, x[:n], y[:n], EPS[norm], norm, budget=budget)
    check_outputs(problem, res, model, budget)
    assert res.success.float().mean() >= 0.875, res.queries
    assert res.queries[res.success].float().median() <= max_median, res.queries


def test_targeted_square_on_resnet20(cifar):
    model, x, y = cifar
    x, y = x[:4], y[:4]
    target = (y + 1) % 10
    problem, res = run_query("square_linf", model, x, y, EPS["linf"], "linf", budget=10_000, target=target)
    check_outputs(problem, res, model, 10_000)
    assert res.success.float().mean() >= 0.75, res.queries  # measured 4/4, median 376 queries


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_tiny_budget_ends_without_false_success(cifar, name, norm):
    model, x, y = cifar
    problem, res = run_query(name, model, x[:4], y[:4], EPS[norm], norm, budget=5)
    check_outputs(problem, res, model, 5)
    assert (res.queries[~res.success] == 5).all() and not res.stalled.any()
