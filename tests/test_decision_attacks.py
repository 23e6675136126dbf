"""Decision-based attacks (label feedback): HopSkipJumpAttack Linf/L2 and RayS, built from their recipes.

A linear toy model (no data needed) checks convergence to a known boundary and the handling of refused queries;
the real pretrained CIFAR-10 ResNet-20 checks success at the paper's budget (Table V), targeted runs and tiny
budgets (skipped without the offline data).
"""
import math
from pathlib import Path

import pytest
import torch

from blackboxbench.errors import BenchError
from blackboxbench.query.decision import bisect, blend, find_start

from attack_utils import check_outputs, hyperplane_toy, make_ctx, resnet20_images, run_query

RECIPES = Path(__file__).resolve().parent.parent / "attacks" / "decision"
SETTINGS = [("hsja_linf", "linf"), ("hsja_l2", "l2"), ("rays", "linf")]
EPS = {"linf": 0.03, "l2": 1.0}  # Table V, CIFAR-10
N_REAL = 8


# ---------------------------------------------------------------- toy linear model (no data)


@pytest.fixture(scope="module")
def toy():
    model, x, y, gap = hyperplane_toy(torch.Generator().manual_seed(1))  # Linf distances 0.02-0.03
    w = model.w
    return model, x, y, {"linf": gap / w.abs().sum(), "l2": gap / w.norm()}


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_toy_linear_boundary_is_reached(toy, name, norm):
    model, x, y, dist = toy
    eps = 1.5 * dist[norm].max().item()  # reachable, and far below the random-noise start
    problem, res = run_query(name, model, x, y, eps, norm, budget=2000)
    assert res.success.all(), res.queries
    check_outputs(problem, res, model, 2000)


def test_bisect_keeps_hi_adversarial_when_refused(toy):
    model, x, y, dist = toy
    ctx = make_ctx(model, x, y, 0.03, "linf", 5, "label", num_classes=2)
    far = (model.w > 0).float().view(1, *x.shape[1:]).expand_as(x)  # the corner deepest in class 1
    with torch.no_grad():
        assert (model(far).argmax(1) == 1).all()
    ones = torch.ones(4)
    lo, hi = bisect(ctx, lambda t, i: blend(x[i], far[i], t), 0 * ones, ones, 1e-9, ones > 0)
    assert (ctx.oracle.counts == 5).all() and (hi - lo > 1e-3).all()  # stopped by the budget, not the tolerance
    with torch.no_grad():
        assert (model(blend(x, far, hi)).argmax(1) == 1).all()
        assert (model(blend(x, far, lo)).argmax(1) == 0).all()


def test_bisect_stops_once_within_reach(toy):
    model, x, y, dist = toy
    ctx = make_ctx(model, x, y, 0.03, "linf", 100, "label", num_classes=2)
    far = (model.w > 0).float().view(1, *x.shape[1:]).expand_as(x)
    ones = torch.ones(4)
    full = bisect(ctx, lambda t, i: blend(x[i], far[i], t), 0 * ones, ones, 1e-6, ones > 0)[1]
    used = ctx.oracle.counts.clone()
    enough = full.double() * 1.3  # the search may stop at any adversarial point below this
    _, hi = bisect(ctx, lambda t, i: blend(x[i], far[i], t), 0 * ones, ones, 1e-6, ones > 0, enough)
    assert (hi <= enough).all() and (hi >= full).all()
    assert ((ctx.oracle.counts - used) < used).all()  # fewer queries than the full search


def test_refused_start_is_not_found(toy):
    model, x, y, _ = toy
    ctx = make_ctx(model, x, y, 0.03, "linf", 0, "label", num_classes=2)
    x0, found = find_start(ctx, tries=10)
    assert not found.any() and torch.equal(x0, x)
    for name, norm in SETTINGS:
        _, res = run_query(name, model, x, y, 0.5, norm, budget=0)
        assert not res.success.any() and (res.queries == 0).all()


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_hsja_schedule_is_the_papers(toy, monkeypatch, norm):
    """HSJA's per-iteration constants (reference code): theta = gamma / d^2 (Linf) or gamma / d^1.5 (L2); at
    iteration t, min(init_num_evals * sqrt(t), max_num_evals) probes of size 0.1 at t = 1, else d theta dist_post
    (Linf) or sqrt(d) theta dist_post (L2); the geometric step search starts at dist / sqrt(t)."""
    from blackboxbench.query import hsja

    model, x, y, _ = toy
    n, d = len(x), x[0].numel()
    ctx = make_ctx(model, x, y, 0.03, norm, 10_000, "label", num_classes=2)
    state = hsja.hsja_init(ctx, gamma=2.0)
    theta = 2.0 / (d ** 2 if norm == "linf" else d ** 1.5)
    assert torch.allclose(state["theta"], torch.full((n,), theta, dtype=torch.float64))
    seen = {}

    def estimate(ctx, x_bd, num, delta, draw, balance=1.0):
        seen.update(num=num.clone(), delta=delta.clone())
        return torch.ones_like(x_bd) / math.sqrt(d), torch.zeros(n, dtype=torch.bool)

    def step(ctx, x_bd, update, size, live):
        seen["size"] = size.clone()
        return x_bd, torch.zeros(n, dtype=torch.bool)

    monkeypatch.setattr(hsja, "estimate_direction", estimate)
    monkeypatch.setattr(hsja, "geometric_step", step)
    monkeypatch.setattr(hsja, "to_boundary", lambda ctx, x_step, *a: (x_step, torch.zeros(n)))
    dist, dist_post = torch.full((n,), 0.2), torch.full((n,), 0.3)
    for it, num, delta in [(0, 100, 0.1), (3, 200, (d if norm == "linf" else math.sqrt(d)) * theta * 0.3),
                           (399, 2000, None)]:
        base = dict(state, x_bd=x.clone(), dist=dist, dist_post=dist_post, it=torch.full((n,), it),
                    probe_scale=torch.ones(n, dtype=torch.float64))
        hsja.hsja(ctx, base, init_num_evals=100, max_num_evals=2000)
        t = it + 1
        assert seen["num"].tolist() == [num] * n
        if delta is not None:
            assert torch.allclose(seen["delta"].double(), torch.full((n,), delta, dtype=torch.float64))
        assert torch.allclose(seen["size"], dist / math.sqrt(t))


def test_hsja_direction_subtracts_the_mean_decision(toy):
    """HSJA's estimate with mixed answers is sum_i (f_i - mean f) u_i, normalised (f = +-1, u_i the unit probe
    directions): checked by hand with fixed directions at a point a little inside class 0, where about a third of
    the probes are adversarial."""
    from blackboxbench.query.hsja import estimate_direction

    model, x, y, _ = toy
    n, d, k, delta = len(x), x[0].numel(), 64, 0.01
    w, t = model.w.detach(), model.t
    shift = t - 0.5 * delta * w.norm().item() / math.sqrt(d)  # score of x_bd: half a probe's spread below t
    x_bd = (0.5 + w * shift / w.norm() ** 2).view(1, *x.shape[1:]).expand_as(x).contiguous()
    dirs = torch.randn(n, k, *x.shape[1:], generator=torch.Generator().manual_seed(5))
    ctx = make_ctx(model, x, y, 0.03, "l2", 10_000, "label", num_classes=2)
    draw = lambda owner, shape: torch.cat([dirs[i] for i in owner.unique_consecutive()])  # noqa: E731
    grad, _ = estimate_direction(ctx, x_bd, torch.full((n,), k), torch.full((n,), delta), draw)
    for i in range(n):
        u = dirs[i] / dirs[i].flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        with torch.no_grad():
            f = 2.0 * (model(x_bd[i] + delta * u).argmax(1) == 1).float() - 1
        assert 0.1 < (f > 0).float().mean() < 0.6  # mixed, and not balanced
        ref = ((f - f.mean()).view(-1, 1, 1, 1) * u).sum(0)
        assert torch.allclose(grad[i], ref / ref.norm(), atol=1e-5)


def test_hsja_geometric_step_halves_until_adversarial(toy):
    """HSJA's geometric step search (reference code: ``epsilon /= 2`` until adversarial): along the unit direction
    towards the clean side of the hyperplane, from a point 0.01 / |w| (in L2) inside the adversarial side, the
    sizes 1, 1/2, 1/4, ... are tried and the first one below 0.01 / |w| is kept, one query per size."""
    from blackboxbench.query.hsja import geometric_step

    model, x, y, _ = toy
    w, n = model.w.detach(), len(x)
    unit = (w / w.norm()).view(1, *x.shape[1:])
    x_bd = (0.5 + (model.t + 0.01) * w / w.norm() ** 2).view(1, *x.shape[1:]).expand_as(x).contiguous()
    ctx = make_ctx(model, x, y, 0.03, "l2", 1000, "label", num_classes=2)
    out, found = geometric_step(ctx, x_bd, -unit.expand_as(x), torch.ones(n), torch.ones(n, dtype=torch.bool))
    k = math.ceil(math.log2(w.norm().item() / 0.01))  # 2^-k is the first size below 0.01 / |w|
    assert found.all() and ctx.oracle.counts.tolist() == [k + 1] * n
    assert torch.allclose(out, x_bd - 2.0 ** -k * unit, atol=1e-6)


def _rays_authors_blocks(dim, steps):
    """The RayS reference code's block loop, transcribed: (level, index, start, end) of the block flipped at each
    step: blocks of ceil(dim / 2^level) coordinates; the level grows after block 2^level - 1 or the block that
    reaches coordinate dim."""
    level = ind = 0
    out = []
    while len(out) < steps:
        size = math.ceil(dim / 2 ** level)
        start, end = ind * size, min(dim, (ind + 1) * size)
        out.append((level, ind, start, end))
        ind += 1
        if ind == 2 ** level or end == dim:
            level, ind = level + 1, 0
    return out


def test_rays_block_schedule_is_the_authors():
    """RayS flips the blocks of the reference code in its order (d = 75, not a power of two: levels whose last
    block reaches d early, and single coordinates past level 7), read from the state of ``rays`` steps against a
    model that never answers adversarial (so the sign vector never changes)."""
    from blackboxbench.query.rays import _block, rays, rays_init

    class Never(torch.nn.Module):
        def forward(self, x):
            return torch.tensor([1.0, 0.0]).expand(len(x), 2)

    x = torch.full((2, 3, 5, 5), 0.5)
    ctx = make_ctx(Never(), x, torch.zeros(2, dtype=torch.long), 0.03, "linf", 1000, "label", num_classes=2)
    state = rays_init(ctx)
    for level, ind, start, end in _rays_authors_blocks(75, 260):
        assert state["block_level"].tolist() == [level] * 2 and state["block_ind"].tolist() == [ind] * 2
        lo, hi, _ = _block(state["block_level"], state["block_ind"], 75)
        assert lo.tolist() == [start] * 2 and hi.tolist() == [end] * 2, (level, ind)
        state = {**state, **rays(ctx, state)}


def test_rays_rejects_l2(toy):
    model, x, y, _ = toy
    with pytest.raises(BenchError):
        run_query("rays", model, x, y, 1.0, "l2", budget=10)


# ---------------------------------------------------------------- real CIFAR-10 ResNet-20

@pytest.fixture(scope="module")
def cifar(data_root):
    return resnet20_images(data_root, n=N_REAL, pool=2 * N_REAL)


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_untargeted_table_v_budget(cifar, name, norm):
    """Measured on these 8 images (seed 0, one thread): ASR 8/8 for all three; mean / median queries hsja_linf
    1248 / 750, hsja_l2 780 / 720, rays 532 / 252. The bounds leave a margin of two samples for platform
    numerics; a broken attack lands far below them."""
    model, x, y = cifar
    problem, res = run_query(name, model, x, y, EPS[norm], norm, budget=10_000)
    check_outputs(problem, res, model, 10_000)
    assert res.success.float().mean() >= 0.75, res.queries
    assert res.queries[res.success].float().median() <= 2500


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_targeted_smoke(cifar, name, norm):
    """Three images of different classes, each targeted at another's class, 2,000 queries, three times the
    Table V eps: measured successes (seeds 0 / 1) hsja_linf 3/3, 3/3; hsja_l2 1/3, 3/3; rays 2/3, 2/3 (at 1,000
    queries hsja_l2 fooled 0-2 of 3 over seeds 0-3)."""
    model, x, y = cifar
    first = torch.tensor([int((y == c).nonzero()[0]) for c in y.unique()])[:3]  # three different classes
    x, y = x[first], y[first]
    target = y.roll(1)  # each target class has an image in the batch: a natural targeted start
    problem, res = run_query(name, model, x, y, 3 * EPS[norm], norm, budget=2000, target=target)
    check_outputs(problem, res, model, 2000)
    assert res.success.any(), res.queries


@pytest.mark.parametrize("name,norm", [("hsja_l2", "l2"), ("hsja_linf", "linf")])
@pytest.mark.parametrize("budget", [10_000, 60, 150])
def test_hsja_grid_search(cifar, name, norm, budget):
    """``stepsize_search: grid_search``, the reference code's other step size (Table V keeps
    geometric_progression): 20 sizes per iteration in one call, each adversarial one binary-searched back, the
    closest kept. Measured on these 4 images at 10,000 queries (seed 0): 4/4 under both norms, L2 390-3,800
    queries and Linf 508-3,980 (the geometric search: 132-946 and 139-1,535). At 60 queries every sample's grid
    is refused whole, at 150 its binary searches are cut short: nothing is claimed falsely and no sample
    overspends."""
    model, x, y = cifar
    problem, res = run_query(name, model, x[:4], y[:4], EPS[norm], norm, budget=budget,
                             blocks={"perturb": {"stepsize_search": "grid_search"}})
    check_outputs(problem, res, model, budget)
    if budget == 10_000:
        assert res.success.float().mean() >= 0.75, res.queries
    else:
        assert (res.queries[~res.success] == budget).all()


@pytest.mark.parametrize("name,norm", SETTINGS)
def test_tiny_budget_ends_without_false_success(cifar, name, norm):
    model, x, y = cifar
    problem, res = run_query(name, model, x[:4], y[:4], EPS[norm], norm, budget=20)
    check_outputs(problem, res, model, 20)  # any success is real (checked by a fresh forward)
    assert (res.queries[~res.success] == 20).all() and not res.stalled.any()  # the others spend the budget
    assert (~res.success).sum() >= 3  # 20 queries are too few for most images (init + binary search)


# ---------------------------------------------------------------- per-sample sums of the estimates


def _rows_and_owner(device="cpu"):
    gen = torch.Generator().manual_seed(3)
    owner = torch.repeat_interleave(torch.tensor([0, 2, 3]), torch.tensor([700, 5, 300]))  # as the probes' calls
    values = torch.randn(len(owner), 3, 4, 4, generator=gen) * torch.logspace(-6, 2, len(owner))[:, None, None, None]
    return owner.to(device), values.to(device)


def test_add_rows_adds_each_samples_rows_in_order():
    """HSJA's, GeoDA's and the priors' per-sample sums: on CPU exactly the row-by-row sum in row order (so records
    are those of ``index_add_``); the other devices' branch (``index_put_`` with accumulate) adds the same rows."""
    from blackboxbench.query.common import add_rows_

    owner, values = _rows_and_owner()
    ref = torch.zeros(4, *values.shape[1:])
    for j in range(len(owner)):
        ref[owner[j]] += values[j]
    assert torch.equal(add_rows_(torch.zeros_like(ref), owner, values), ref)
    other = torch.zeros_like(ref).index_put_((owner,), values, accumulate=True)
    torch.testing.assert_close(other, ref, rtol=1e-6, atol=1e-5)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA's index_add_ is atomic)")
def test_add_rows_is_the_same_sum_on_every_cuda_run():
    from blackboxbench.query.common import add_rows_

    owner, values = _rows_and_owner("cuda")
    sums = [add_rows_(torch.zeros(4, *values.shape[1:], device="cuda"), owner, values) for _ in range(5)]
    assert all(torch.equal(s, sums[0]) for s in sums[1:])
    cpu = add_rows_(torch.zeros(4, *values.shape[1:]), owner.cpu(), values.cpu())
    torch.testing.assert_close(sums[0].cpu(), cpu, rtol=1e-5, atol=1e-4)


def test_claim_pushes_a_close_point_out_to_the_grid_radius():
    """Alg. 1's acceptance: a point within (1 - CLAIM_MARGIN) of the claim radius (Linf: floor(255 eps) / 255) is
    claimed, pushed along its ray to that radius and rounded outward on the uint8 grid; a farther one is not; a
    later claim needs a point 2 % closer than the last claimed distance."""
    from blackboxbench.query.decision import claim, claim_limit, claim_radius
    from blackboxbench.threat import Problem

    x = torch.full((3, 1, 3, 3), 128 / 255)
    signs = torch.tensor([1.0, -1.0]).repeat(5)[:9].view(1, 1, 3, 3)
    ray = signs * torch.tensor([1.0, 0.5, 0.3]).repeat(3).view(1, 1, 3, 3)  # Linf length 1, off-grid parts
    p = Problem(x=x, y=torch.zeros(3, dtype=torch.long), eps=0.03, norm="linf")
    radius = 7 / 255  # floor(255 * 0.03) = 7 levels
    assert claim_radius(p) == pytest.approx(radius)
    assert claim_radius(Problem(x=x, y=p.y, eps=0.5, norm="l2")) == 0.5
    limit = radius * 0.98
    assert claim_limit(p) == pytest.approx(limit)
    assert torch.allclose(claim_limit(p, torch.tensor([math.inf, 0.01, 1.0])).float(),
                          torch.tensor([limit, 0.0098, limit]))
    d = torch.tensor([0.5 * limit, 1.5 * radius, limit], dtype=torch.float64)  # the last one exactly at the limit
    state = dict(x_bd=x + d.float().view(-1, 1, 1, 1) * ray, dist=d, claimed=torch.full((3,), math.inf,
                 dtype=torch.float64), x_adv=x.clone(), success=torch.zeros(3, dtype=torch.bool))
    out = claim(p, state)
    assert out["success"].tolist() == [True, False, True]
    assert out["claimed"][0] == d[0] and out["claimed"][1] == math.inf
    assert torch.equal(out["x_adv"][1], state["x_bd"][1])
    for i in (0, 2):
        delta = out["x_adv"][i] - x[i]
        levels = torch.ceil(7 * ray[0].abs() - 1e-4) * ray[0].sign()  # 7, 3.5 -> 4, 2.1 -> 3 levels, outward
        assert torch.allclose(delta * 255, levels, atol=1e-4)
    closer = torch.tensor([0.99 * d[0], 0.97 * d[0], 0.99 * limit], dtype=torch.float64)
    assert claim(p, dict(out, dist=closer))["success"].tolist() == [False, True, False]  # 1 % closer is not enough


def test_bounded_calls_group_samples_by_where_their_rows_start():
    """Windows of 4 rows: rows 3, 3, 3, 0, 2 start at 0, 3, 6, 9, 9 -> calls {0, 1}, {2}, {4} (no call for the
    sample without rows; a call may run past its window by the rest of its last sample)."""
    from blackboxbench.query.common import PROBE_VALUES, bounded_calls

    calls = bounded_calls(torch.tensor([3, 3, 3, 0, 2]), PROBE_VALUES // 4)
    assert [c.tolist() for c in calls] == [[0, 1], [2], [4]]
    assert [c.tolist() for c in bounded_calls(torch.ones(3, dtype=torch.long), 1)] == [[0, 1, 2]]


class _PoolLabels(torch.nn.Module):
    """Classifies an image as the label of the pool image v / 10 nearest to its mean value v."""

    def __init__(self, labels):
        super().__init__()
        self.labels = labels

    def forward(self, x):
        j = (x.flatten(1).mean(1) * 10).round().clamp(0, len(self.labels) - 1).long()
        return torch.nn.functional.one_hot(self.labels[j], 3).float()


def test_start_search_takes_the_pool_in_order_after_each_sample():
    """Each sample tries the pool from the image after its own index on (wrapping round): untargeted the first
    with another label, targeted the first of the target class, before any noise."""
    from blackboxbench.context import Pool

    y = torch.tensor([0, 1, 0, 1, 2, 0])
    x = (torch.arange(6) / 10).view(6, 1, 1, 1).expand(6, 1, 2, 2).clone()  # image j: constant j / 10
    model, pool = _PoolLabels(y), Pool(x, y)
    ctx = make_ctx(model, x, y, 1.0, "l2", 20, "label", num_classes=3, pool=pool)
    x0, found = find_start(ctx, tries=0)
    assert found.all() and torch.equal(x0, x[[1, 2, 3, 4, 5, 1]])
    target = torch.tensor([2, 2, 1, 0, 0, 1])
    ctx = make_ctx(model, x, y, 1.0, "l2", 20, "label", target=target, num_classes=3, pool=pool)
    x0, found = find_start(ctx, tries=2)  # uniform noise (mean near 0.5) would pass for class 0: never tried
    assert found.all() and torch.equal(x0, x[[4, 4, 3, 5, 5, 1]])
    assert (ctx.oracle.counts == 1).all()  # only target-class images are asked


def test_refused_rows_are_never_adversarial_and_unknown_points_are_infinitely_far(toy):
    from blackboxbench.query.decision import known_dist, query_adv

    model, x, y, _ = toy
    ctx = make_ctx(model, x, y, 0.03, "linf", 0, "label", num_classes=2)
    far = (model.w > 0).float().view(1, *x.shape[1:]).expand_as(x)  # adversarial for every sample
    adv, ok = query_adv(ctx, far)
    assert not ok.any() and not adv.any()
    d = known_dist(ctx.problem, far, torch.tensor([True, False, True, False]))
    assert torch.equal(d.isinf(), torch.tensor([False, True, False, True]))
    assert torch.allclose(d[0], (far[0] - x[0]).abs().max())
