"""HopSkipJumpAttack (Chen, Jordan, Wainwright, IEEE S&P 2020), Linf and L2, batched over samples.

One pipeline iteration is one HSJA iteration for every active sample: the gradient-direction estimate at the
boundary point (one oracle call for all samples' probes), the geometric step-size search (one call per halving;
``grid_search``: one call for 20 sizes), and the binary search back to the boundary (one call per bisection
step). Defaults: Table V of the BlackboxBench paper (gamma 1, stepsize_search geometric_progression,
max_num_evals 10000, init_num_evals 100); the remaining constants (probe size, step size, binary-search
thresholds) follow the authors' reference code. The probes of the gradient estimate come from a pluggable
generator (``probes``, see ``probes.py``): QEBA (Li et al., CVPR 2020) is these blocks with low-frequency DCT
probes (recipe ``qeba``).
"""
import math

import torch

from ..registry import INIT, PERTURB
from . import common
from .common import per_sample, rows_where
from .decision import (bisect, blend, blended_start, claim_limit, decision_state, has_budget, known_dist, lopsided,
                       query_adv, stop_radius)
from .probes import PROBES, draw_probes

PAPER = "Chen et al., HopSkipJumpAttack, IEEE S&P 2020"
FIRST_DELTA = 0.1  # probe size of the first iteration: 0.1 * (clip_max - clip_min), reference code
# When every probe of a sample gets the same answer, its probes were smaller than the uncertainty of where the
# boundary point lies (the binary-search threshold, and logits that move with the batch they are computed in):
# the estimate carries no information, so that sample's probe size grows tenfold, up to FIRST_DELTA (a deviation
# from the reference code, which keeps the size; on exact arithmetic it almost never triggers).
PROBE_GROWTH = 10.0
# The same growth when the answers are lopsided (``probe_balance``): the fraction of adversarial probes lies
# outside 1/2 +- balance/2 by more than BALANCE_Z binomial standard errors. On a smooth boundary the probes of
# a point at the boundary split about evenly (0.43 to 0.61 on CIFAR-10 ResNet-20, 100 to 300 probes); at probes
# below the scale at which a rough target's decision is a function of its input (TF32 / low-precision
# arithmetic) they do not (0.11 to 0.92), and the estimate is noise (cosine 0.01 with the full-precision gradient
# instead of 0.2).
BALANCE_Z = 3.0
MAX_HALVINGS = 50  # step-size halvings after which the step is below float32 resolution of the image
GRID = 20  # grid_search: step sizes logspace(-4, 0, 20) * dist, reference code


def _dim(problem):
    return problem.x[0].numel()


def to_boundary(ctx, x_far, theta, live, radius, owner=None):
    """HSJA's binary search from ``x_far`` (adversarial) toward ``x`` -> ``(x_bd, dist_far)``; ``theta`` (n,).

    Linf: the parameter is the radius of the Linf box around ``x`` that ``x_far`` is clipped to, searched down
    from ``dist(x_far)`` until the bracket is below ``min(dist * theta, theta)``. L2: the blend factor between
    ``x`` and ``x_far``, searched down from 1 to a bracket of ``theta``. Either search stops early once its
    adversarial end lies within ``radius`` (a float or (n,), see :func:`~.decision.stop_radius`): the attack can
    then claim success and needs no closer point. ``dist_far`` is the distance of ``x_far`` itself, which the
    reference code uses to size the next probes. With ``owner`` (m,), row j of ``x_far`` (m, ...) is a point of
    sample ``owner[j]``, and ``live`` and the results are per row.
    """
    problem = ctx.problem if owner is None else ctx.problem.sub(owner)
    x = problem.x
    if owner is not None:
        theta = theta[owner]
        radius = radius[owner] if torch.is_tensor(radius) and radius.dim() else radius
    d_far = problem.dist(x_far)
    zeros = torch.zeros_like(d_far)
    if problem.norm == "linf":
        def point(t, i):
            t = per_sample(t, x[i])
            return torch.minimum(torch.maximum(x_far[i], x[i] - t), x[i] + t)

        hi, tol = d_far, torch.minimum(d_far.double() * theta, theta)
        enough = radius  # the box radius bounds the distance
    else:
        def point(t, i):
            return blend(x[i], x_far[i], t)

        hi, tol = torch.ones_like(d_far), theta
        enough = radius / d_far.double().clamp_min(1e-12)
    _, hi = bisect(ctx, point, zeros, hi, tol, live, enough, owner)
    return point(hi, torch.arange(problem.n, device=x.device)), d_far


def estimate_direction(ctx, x_bd, num, delta, draw, balance=1.0):
    """HSJA's Monte-Carlo estimate of the boundary normal at ``x_bd``, with ``num[i]`` probes for sample i.

    Directions come from ``draw(owner, shape)`` -> (m, *shape), raw directions for rows of local samples ``owner``
    (m,) (see :func:`generator`: the registered generators of ``probes.py``; ``priors.py``: learned ones),
    normalized, clipped to [0, 1]; the +1/-1 decisions get the mean baseline subtracted unless they are all equal.
    Refused probes are left out of every sum. Returns unit-L2 directions (zero where none answered) and the (n,)
    mask of lopsided samples: the mean ``m`` of a sample's answered +1/-1 decisions has
    ``|m| - balance >= BALANCE_Z * sqrt((1 - m^2) / count)`` (``balance`` 1: all its answers agreed).

    Memory is bounded: a sample's probes come in pieces of at most ``PROBE_VALUES / d`` rows (``d`` values per
    image; one piece on CIFAR-10, where it is 21,845 rows, above ``max_num_evals``), piece ``p`` of every sample
    in the ``p``-th round of draws, each round's samples split into oracle calls of about ``PROBE_VALUES`` values
    (never a sample across two calls). A sample's draws thus depend only on its own ``num``, not on its batch
    (an ImageNet image at 100 slots asked for tens of GiB in one call before). The sums are accumulated over the
    calls: ``sum (f - mean) u = sum f u - mean * sum u`` over the answered probes.
    """
    problem = ctx.problem
    n, dev = problem.n, x_bd.device
    piece = max(1, common.PROBE_VALUES // max(1, x_bd[0].numel()))
    f_u, ok_u = torch.zeros_like(x_bd), torch.zeros_like(x_bd)
    count = torch.zeros(n, device=dev)
    f_sum = torch.zeros(n, device=dev)
    for start in range(0, int(num.max()) if n else 0, piece):
        rows = (num - start).clamp(0, piece)
        for members in common.bounded_calls(rows, x_bd[0].numel()):
            owner = torch.repeat_interleave(members, rows[members])
            rv = draw(owner, x_bd.shape[1:]).to(x_bd.dtype)
            rv = rv / per_sample(rv.flatten(1).norm(dim=1), rv)
            base, step = x_bd[owner], per_sample(delta[owner], rv)
            probes = (base + step * rv).clamp(0.0, 1.0)
            rv = (probes - base) / step
            adv, ok = query_adv(ctx, probes, owner)
            okf = ok.to(x_bd.dtype)
            fval = (2 * adv.to(x_bd.dtype) - 1) * okf
            count.index_add_(0, owner, okf)  # sums of 0 / +-1: exact in any order
            f_sum.index_add_(0, owner, fval)
            common.add_rows_(f_u, owner, per_sample(fval, rv) * rv)
            common.add_rows_(ok_u, owner, per_sample(okf, rv) * rv)
    mean = f_sum / count.clamp_min(1)
    mixed = mean.abs() < 1
    grad = torch.where(per_sample(mixed, x_bd) > 0, f_u - per_sample(mean, x_bd) * ok_u, f_u)
    return (grad / per_sample(grad.flatten(1).norm(dim=1).clamp_min(1e-20), grad),
            lopsided(f_sum, count, balance, BALANCE_Z))


def geometric_step(ctx, x_bd, update, size, live):
    """Halve each sample's step size until ``x_bd + size * update`` is adversarial (one call per halving).

    Returns ``(x_step, found)``; a sample whose query was refused is not ``found``.
    """
    size, found = size.clone(), torch.zeros_like(live)
    live = live & has_budget(ctx)
    for _ in range(MAX_HALVINGS):
        if not live.any():
            break
        idx = live.nonzero().squeeze(1)
        cand = (x_bd[idx] + per_sample(size[idx], x_bd) * update[idx]).clamp(0.0, 1.0)
        adv, ok = query_adv(ctx, cand, idx)
        found[idx[adv]] = True
        live[idx[adv | ~ok]] = False
        size[idx[ok & ~adv]] /= 2
    return (x_bd + per_sample(size, x_bd) * update).clamp(0.0, 1.0), found


def grid_step(ctx, x_bd, update, dist, theta, live, radius):
    """HSJA's ``grid_search`` step size: the ``GRID`` steps ``logspace(-4, 0) * dist`` along ``update`` from each
    live sample's ``x_bd``, queried in one call; every adversarial one is binary-searched back to the boundary
    (:func:`to_boundary`, all of them together) and the closest result is kept. Returns ``(x_new, dist_far,
    found)``: ``dist_far`` is the distance of the kept step before its search; a sample none of whose steps was
    adversarial is not ``found`` and keeps ``x_bd``."""
    problem = ctx.problem
    n = problem.n
    idx = (live & has_budget(ctx)).nonzero().squeeze(1)
    owner = idx.repeat_interleave(GRID)
    sizes = torch.logspace(-4, 0, GRID, dtype=torch.float64, device=x_bd.device).repeat(idx.numel())
    step = per_sample(sizes * dist[owner].double(), x_bd).to(x_bd.dtype)
    cand = (x_bd[owner] + step * update[owner]).clamp(0.0, 1.0)
    adv, _ = query_adv(ctx, cand, owner)
    owner, cand = owner[adv], cand[adv]
    x_new, d_far = to_boundary(ctx, cand, theta, torch.ones_like(owner, dtype=torch.bool), radius, owner)
    d_new = problem.sub(owner).dist(x_new)
    order = torch.argsort(d_new, stable=True)
    order = order[torch.argsort(owner[order], stable=True)]  # by sample, then by distance after the search
    first = torch.ones_like(order, dtype=torch.bool)
    first[1:] = owner[order[1:]] != owner[order[:-1]]
    best = order[first]
    x_out, d_out = x_bd.clone(), torch.zeros(n, dtype=d_far.dtype, device=x_bd.device)
    x_out[owner[best]], d_out[owner[best]] = x_new[best], d_far[best]
    found = torch.zeros(n, dtype=torch.bool, device=x_bd.device)
    found[owner[best]] = True
    return x_out, d_out, found


@INIT.register("hsja_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"gamma": "(0, inf)", "init_tries": "int [0, inf)"})
def hsja_init(ctx, *, gamma=1.0, init_tries=100):
    """Blended-uniform-noise start (targeted: the batch's images of the target class first), then the binary
    search to the boundary.

    ``gamma`` (Table V: 1) sets the binary-search threshold theta = gamma / d^{3/2} (L2) or gamma / d^2 (Linf),
    kept per sample in the state. ``init_tries`` bounds the random-noise draws per sample (the reference code
    allows up to 1e4; with a query budget a bound keeps a hopeless search from eating it all); untargeted
    samples with no hit fall back to the batch's images of other classes (see ``decision.find_start``).
    """
    problem = ctx.problem
    d, n, dev = _dim(problem), problem.n, problem.x.device
    theta = torch.full((n,), gamma / (d ** 2 if problem.norm == "linf" else d ** 1.5), dtype=torch.float64,
                       device=dev)
    x_start, found = blended_start(ctx, tries=init_tries)
    x_bd, d_far = to_boundary(ctx, x_start, theta, found, claim_limit(problem))
    dist = known_dist(problem, x_bd, found)
    return decision_state(problem, x_bd, dist, dist_post=d_far, it=torch.zeros(n, dtype=torch.long, device=dev),
                          theta=theta, probe_scale=torch.ones(n, dtype=torch.float64, device=dev))


@PERTURB.register("hsja", paper=PAPER, norms=("linf", "l2"),
                  ranges={"init_num_evals": "int [1, inf)", "max_num_evals": "int [1, inf)",
                          "stepsize_search": ("geometric_progression", "grid_search"), "probes": tuple(PROBES),
                          "probe_factor": "[1, inf)", "probe_balance": "[0, 1]"})
def hsja(ctx, state, *, init_num_evals=100, max_num_evals=10000, stepsize_search="geometric_progression",
         probes="gaussian", probe_factor=2.0, probe_balance=0.2):
    """One HopSkipJumpAttack iteration for every sample that has an adversarial point.

    Iteration t (1-based, per sample) uses ``min(init_num_evals * sqrt(t), max_num_evals)`` probes (Table V:
    100 and 10000) of size 0.1 at t = 1, then ``sqrt(d) theta dist_post`` (L2) or ``d theta dist_post`` (Linf);
    steps along the estimate (its sign for Linf) starting at ``dist / sqrt(t)`` and halving until adversarial
    (``stepsize_search`` geometric_progression, Table V; ``grid_search``, the reference code's other choice, tries
    20 sizes at once instead, see :func:`grid_step`); then binary-searches back to the boundary.
    ``probes`` picks the probe generator (``gaussian``: HSJA's; ``dct``: QEBA-F, ``resize``: QEBA-S, on a
    subspace of side ``int(side / probe_factor)``; see ``probes.py``). ``probe_balance`` (a deviation from the
    paper, which keeps the probe size): a sample's probe size grows tenfold (``PROBE_GROWTH``, up to the first
    iteration's 0.1) after an iteration whose adversarial fraction of probes lies significantly (``BALANCE_Z``
    standard errors) outside ``1/2 +- probe_balance / 2``: probes at a point of a smooth boundary split about
    evenly, and lopsided answers mean the probes are below the scale at which the target's decision is rough
    (TF32 or low-precision arithmetic); 1 grows only when all answers agree. Returns the updated search state
    for the ``within_eps`` acceptance.
    """
    return hsja_step(ctx, state, generator(ctx, probes, probe_factor), init_num_evals, max_num_evals,
                     stepsize_search, probe_balance)


def generator(ctx, name, factor):
    """``draw(owner, shape)`` of the registered probe generator ``name`` (``probes.py``) for the samples of ``ctx``."""
    return lambda owner, shape: draw_probes(name, ctx, owner, shape, ctx.problem.norm, factor)


def hsja_step(ctx, state, draw, init_num_evals, max_num_evals, stepsize_search, balance=1.0):
    """One HSJA iteration (see :func:`hsja`) with probe directions from ``draw`` (see :func:`estimate_direction`):
    the ``hsja`` block and the learned priors of NonLinear-BA and PSBA (``priors.py``). A sample's probe size
    grows after a lopsided estimate (``balance``, see :func:`estimate_direction`; 1: only when all its probes
    agreed)."""
    problem = ctx.problem
    go = torch.isfinite(state["dist"]) & has_budget(ctx)
    it = state["it"] + go.long()
    t = it.clamp_min(1).to(torch.float64)
    theta, x_bd, dist = state["theta"], state["x_bd"], state["dist"]
    scale = _dim(problem) if problem.norm == "linf" else math.sqrt(_dim(problem))
    grown = torch.clamp(scale * theta * state["dist_post"].double() * state["probe_scale"], max=FIRST_DELTA)
    delta = torch.where(it == 1, FIRST_DELTA, grown).to(x_bd.dtype)
    num = torch.clamp((init_num_evals * t.sqrt()).long(), max=max_num_evals)
    num = torch.where(go, torch.minimum(num, ctx.oracle.remaining()), torch.zeros_like(num))
    grad, lopsided = estimate_direction(ctx, x_bd, num, delta, draw, balance)
    probe_scale = torch.where(lopsided & (it > 1), state["probe_scale"] * PROBE_GROWTH, state["probe_scale"])
    update = grad.sign() if problem.norm == "linf" else grad
    size = torch.where(go, dist, torch.zeros_like(dist)) / t.sqrt().to(dist.dtype)
    if stepsize_search == "grid_search":
        x_new, d_post, stepped = grid_step(ctx, x_bd, update, dist, theta, go, stop_radius(problem, state))
    else:
        x_step, stepped = geometric_step(ctx, x_bd, update, size, go)
        x_new, d_post = to_boundary(ctx, x_step, theta, stepped, stop_radius(problem, state))
    return dict(x_bd=rows_where(stepped, x_new, x_bd),
                dist=torch.where(stepped, problem.dist(x_new), dist),
                dist_post=torch.where(stepped, d_post, state["dist_post"]), it=it, probe_scale=probe_scale)
