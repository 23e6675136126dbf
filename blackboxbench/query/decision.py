"""Helpers shared by the decision-based attacks (label feedback only; Supp. F-A, Alg. 1 of the paper).

State convention of every decision attack (all tensors with the batch on dim 0):

* ``x_bd`` (n, C, H, W): the attack's current adversarial point, usually on the decision boundary;
* ``dist`` (n,): its distance to ``x`` in the threat norm (+inf while no adversarial point is known);
* ``claimed`` (n,): the distance at which success was last claimed (+inf before any claim);
* ``x_adv``, ``success``: what the pipeline reads, set by :func:`claim`.

Alg. 1 stops once the adversarial point lies inside the eps ball. A boundary point is useless as an output: the
pipeline returns ``quantize(project(x_adv))``, and rounding (towards the clean image under Linf, to the nearest
level inside the ball under L2) moves a boundary point back across the boundary about half the time. So a claim puts into ``x_adv`` the point pushed outward along the ray
from ``x`` through ``x_bd`` to the eps sphere. If the pipeline's confirming query disagrees, the sample comes
back unverified and is claimed again only once its distance has dropped below the failed claim.

Every query goes through :func:`query_adv`: a refused row (past the sample's budget) is never adversarial, and
the searches below freeze a sample at its first refused row instead of reading it as "not adversarial".
"""
import torch

from ..registry import ACCEPT
from ..threat import grid_levels, quantize_outward
from .common import per_sample

BLEND_TOL = 1e-3  # HSJA's initialization: blend factor tolerance of the binary search toward x (reference code)
# A claim needs the adversarial point 2 % inside the claim radius (and 2 % closer than an earlier failed claim):
# pushed out to the radius, the returned point then lies 2 % deeper along its ray than a point the oracle saw
# adversarial, a margin that survives logits moving with the batch they are computed in (TF32, per-shape GPU
# kernels: about 1e-3 relative; tests/test_numerics.py).
CLAIM_MARGIN = 0.02
def query_adv(ctx, images, idx=None):
    """Query ``images`` for local samples ``idx`` (default one each) -> ``(adv, ok)``, both (m,) bool.

    ``adv`` is False on refused rows (``ok`` False).
    """
    answer, ok = ctx.oracle(images, idx)
    sub = ctx.problem if idx is None else ctx.problem.sub(idx)
    return sub.is_adv(answer) & ok, ok


def known_dist(problem, x_bd, found):
    """The ``dist`` state entry: each sample's threat distance of ``x_bd``, +inf where no adversarial point is
    known (``found`` False)."""
    d = problem.dist(x_bd)
    return torch.where(found, d, torch.full_like(d, float("inf")))


def lopsided(f_sum, count, balance=1.0, z=3.0):
    """(n,) bool: samples whose answered +1/-1 probe decisions (their sum ``f_sum`` over ``count``, both (n,)) are
    lopsided: the mean ``m`` has ``|m| - balance >= z * sqrt((1 - m^2) / count)`` (``balance`` 1: all its answers
    agreed). Probes of a point at a smooth boundary split about evenly; lopsided answers mean the probes were
    smaller than the uncertainty of where the boundary lies (a bisection's threshold, logits that move with the
    batch they are computed in), and the estimate carries no information (HSJA's ``probe_balance``, Sign-OPT)."""
    mean = f_sum / count.clamp_min(1)
    spread = z * torch.sqrt((1 - mean * mean).clamp_min(0) / count.clamp_min(1))
    return (mean.abs() - balance >= spread) & (count > 0)


def grow(scale, mask, cap, growth=10.0):
    """(n,) probe-size ``scale`` grown ``growth``-fold, up to ``cap``, where ``mask``: GeoDA's alpha after a lopsided
    estimate, and :func:`grow_lopsided`."""
    return torch.where(mask, (scale * growth).clamp(max=cap), scale)


def grow_lopsided(scale, go, f_sum, count, cap, growth=10.0, balance=1.0):
    """:func:`grow` for the samples ``go`` whose probes' answers were lopsided (:func:`lopsided` of their sum
    ``f_sum`` over ``count`` at ``balance``; 1: all got one answer): OPT's and Sign-OPT's beta (a deviation, as
    HSJA's probe growth)."""
    return grow(scale, go & lopsided(f_sum, count, balance), cap, growth)


def has_budget(ctx):
    return ctx.oracle.remaining() > 0


def bisect(ctx, point, lo, hi, tol, live, enough=None, owner=None):
    """Batched binary search of a scalar parameter per search, in label space.

    One search per sample, or per row of ``owner`` (the sample each search queries for; several searches may share
    a sample). ``point(t, idx)`` builds the images of searches ``idx`` at parameters ``t`` (float64, (m,));
    ``point(hi)`` must be adversarial and ``point(lo)`` not. Each step queries the midpoints of all live searches
    in one call and moves ``hi`` (adversarial) or ``lo``; a search stops when ``hi - lo <= tol``, when
    ``hi <= enough`` (the parameter at which ``point`` is inside the eps ball: the attack needs no closer point),
    or at its first refused row, so ``hi`` always stays a point the oracle has seen adversarial. Returns
    ``(lo, hi)`` (float64).
    """
    lo, hi = lo.double().clone(), hi.double().clone()
    owner = torch.arange(lo.numel(), device=lo.device) if owner is None else owner
    tol = torch.as_tensor(tol, dtype=torch.float64, device=lo.device).expand_as(lo)
    enough = torch.as_tensor(-1.0 if enough is None else enough, dtype=torch.float64, device=lo.device)
    live = live & has_budget(ctx)[owner] & (hi - lo > tol) & (hi > enough)
    while live.any():
        idx = live.nonzero().squeeze(1)
        mid = (lo[idx] + hi[idx]) / 2
        stuck = (mid <= lo[idx]) | (mid >= hi[idx])  # float64 resolution reached
        adv, ok = query_adv(ctx, point(mid, idx), owner[idx])
        hi[idx[adv]] = mid[adv]
        lo[idx[ok & ~adv]] = mid[ok & ~adv]
        live[idx[~ok | stuck]] = False
        live &= (hi - lo > tol) & (hi > enough)
    return lo, hi


def blend(x, x_far, t):
    """``(1 - t) x + t x_far`` with one ``t`` per sample."""
    t = per_sample(t, x)
    return (1 - t) * x + t * x_far


def _search_images(ctx, x0, found):
    """Query, round by round, each unfound sample's next natural image of the attacker's pool (one call per
    round): untargeted, an image whose true label differs from the sample's; targeted, one of the target class.
    A sample tries the pool in dataset order starting after its own index, so its start does not depend on the
    other samples being attacked with it."""
    pool, problem = ctx.pool, ctx.problem
    if pool is None or pool.y.numel() < 2:
        return
    dev, m = problem.x.device, pool.y.numel()
    order = (ctx.index[:, None] + 1 + torch.arange(m - 1, device=dev)[None]) % m  # every pool image but itself
    labels = pool.y.to(dev)[order]
    cand = labels == problem.target[:, None] if problem.targeted else labels != problem.y[:, None]
    rank = cand.long().cumsum(1) - 1
    for r in range(m - 1):
        live = ~found & has_budget(ctx) & (rank[:, -1] >= r)
        if not live.any():  # later rounds need even more candidates
            break
        idx = live.nonzero().squeeze(1)
        pick = order[idx, (cand[idx] & (rank[idx] == r)).float().argmax(1)]
        images = pool.x[pick.cpu()].to(dev)
        adv, _ = query_adv(ctx, images, idx)
        x0[idx[adv]] = images[adv]
        found[idx[adv]] = True


def uniform_noise(ctx, k, idx):
    """Round ``k``'s candidates for samples ``idx``: uniform noise in [0, 1] (HSJA's BlendedUniformNoise)."""
    return ctx.rng.uniform(ctx.problem.x.shape[1:], rows=idx).to(ctx.problem.x.dtype)


def _search_noise(ctx, x0, found, tries, make):
    """Up to ``tries`` rounds of ``make(ctx, k, idx)`` (k = 1, 2, ...) for the unfound samples ``idx`` (one call
    per round)."""
    for k in range(1, tries + 1):
        live = ~found & has_budget(ctx)
        if not live.any():
            break
        idx = live.nonzero().squeeze(1)
        noise = make(ctx, k, idx)
        adv, _ = query_adv(ctx, noise, idx)
        x0[idx[adv]] = noise[adv]
        found[idx[adv]] = True


def find_start(ctx, *, tries, noise=uniform_noise):
    """An adversarial starting point per sample -> ``(x0, found)``; every try is a counted query.

    Untargeted: random noise (``noise``, default uniform: HSJA's BlendedUniformNoise initialization), up to
    ``tries`` draws, then the pool's natural images with a different true label. Targeted: the pool's images
    whose true label is the target (queried to check), then random noise. ``x0`` is ``x`` where nothing was found.
    ``noise(ctx, k, idx)`` gives round ``k``'s (1-based) candidate images of samples ``idx``.
    """
    problem = ctx.problem
    x0, found = problem.x.clone(), torch.zeros(problem.n, dtype=torch.bool, device=problem.x.device)
    if problem.targeted:
        _search_images(ctx, x0, found)
        _search_noise(ctx, x0, found, tries, noise)
    else:
        _search_noise(ctx, x0, found, tries, noise)
        _search_images(ctx, x0, found)
    return x0, found


def blended_start(ctx, *, tries, tol=BLEND_TOL):
    """:func:`find_start`, then a binary search of the blend factor toward ``x`` -> ``(x_start, found)``."""
    x0, found = find_start(ctx, tries=tries)
    problem = ctx.problem
    x = problem.x
    zeros, ones = torch.zeros(problem.n, device=x.device), torch.ones(problem.n, device=x.device)
    enough = claim_limit(problem) / problem.dist(x0).double().clamp_min(1e-12)  # blend factor within reach
    _, t = bisect(ctx, lambda t, i: blend(x[i], x0[i], t), zeros, ones, tol, found, enough)
    return blend(x, x0, t), found


def decision_state(problem, x_bd, dist, **extra):
    """The state every decision attack shares (see the module docstring), claimed where already inside eps."""
    n, dev = problem.n, problem.x.device
    state = dict(x_bd=x_bd, dist=dist, claimed=torch.full((n,), float("inf"), device=dev),
                 x_adv=x_bd.clone(), success=torch.zeros(n, dtype=torch.bool, device=dev), **extra)
    return claim(problem, state)


def claim_radius(problem):
    """The distance within which a point can be claimed: eps, or for Linf the largest radius on the uint8 grid,
    floor(255 eps) / 255, which is as far as a returned image can reach."""
    return grid_levels(problem.eps) / 255 if problem.norm == "linf" else problem.eps


def claim_limit(problem, claimed=None):
    """(n,) distance at or below which an adversarial point is claimed: the claim radius, or an earlier failed
    claim if smaller, times (1 - CLAIM_MARGIN)."""
    radius = claim_radius(problem)
    if claimed is None:
        return radius * (1 - CLAIM_MARGIN)
    return torch.clamp(claimed.double(), max=radius) * (1 - CLAIM_MARGIN)


def stop_radius(problem, state):
    """(n,) distance below which a search may stop: the sample could then claim (:func:`claim_limit`)."""
    return claim_limit(problem, state["claimed"])


def push_to_eps(problem, x_bd, dist, radius=None):
    """``x + (x_bd - x) * radius / dist`` in [0, 1]: the ray from ``x`` through ``x_bd``, out to the sphere of
    ``radius`` (default eps)."""
    x = problem.x
    scale = (problem.eps if radius is None else radius) / dist.clamp_min(1e-12)
    return (x + (x_bd - x) * per_sample(scale, x)).clamp(0.0, 1.0)


def claim(problem, state):
    """The acceptance check of Alg. 1 (line 2): claim success where the adversarial point lies within
    :func:`claim_limit` (inside the claim radius, :func:`claim_radius`, and closer than any earlier failed claim,
    both with a margin); ``x_adv`` is then pushed out to the claim radius (Linf: and rounded to the uint8 grid
    away from ``x``, see :func:`~blackboxbench.threat.quantize_outward`), else ``x_bd``."""
    state = dict(state)
    dist, radius = state["dist"], claim_radius(problem)
    success = dist.double() <= claim_limit(problem, state["claimed"])
    x_adv = state["x_bd"].clone()
    idx = success.nonzero().squeeze(1)
    if idx.numel():  # only the claiming rows are pushed out and rounded (a step's few, not the whole batch)
        sub = problem.sub(idx)
        out = push_to_eps(sub, state["x_bd"][idx], dist[idx], radius)
        x_adv[idx] = quantize_outward(out, sub.x, radius) if problem.norm == "linf" else out
    state["x_adv"] = x_adv
    state["claimed"] = torch.where(success, dist, state["claimed"])
    state["success"] = success
    return state


@ACCEPT.register("within_eps", paper="Supp. F-A, Alg. 1: stop once the adversarial point is within eps",
                 norms=("linf", "l2"))
def within_eps(ctx, state, proposal):
    """Take the perturb block's updated search state (a dict of per-sample tensors), then :func:`claim`.

    Makes no query: decision attacks only ever move ``x_bd`` to points the oracle has seen adversarial.
    """
    return claim(ctx.problem, {**state, **proposal})
