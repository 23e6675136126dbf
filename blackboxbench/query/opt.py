"""OPT attack (Cheng et al., ICLR 2019) and Sign-OPT (Cheng et al., ICLR 2020), batched over samples.

Both attacks search a direction ``theta`` that minimises ``g(theta)``, the distance from ``x`` to the decision
boundary along ``theta``: the smallest ``lam`` with ``clip(x + lam * theta)`` adversarial (``theta`` a unit vector,
so ``lam`` is a distance). The shared machinery here:

* :func:`g_search`: the authors' ``fine_grained_binary_search`` (start along a known adversarial ``lam``, or
  probe ``g`` at the best distance so far; bisect from 0) and ``fine_grained_binary_search_local`` (probe at the
  previous ``g``; grow ``lam`` by 1 % until adversarial or shrink it by 1 % until not; bisect), for any number of
  rows per sample, as one masked loop: every round asks one oracle call for all live rows, whatever phase each
  row is in, and a row stops at its sample's first refused query;
* :func:`initial_direction`: the best of ``num_directions`` random Gaussian directions (the authors' 100;
  targeted, the attacker's images of the target class as directions, as the authors' targeted code does), one
  round per candidate for all samples;
* :func:`line_search`: the authors' step-size search along an estimate (double the step while ``g`` keeps
  decreasing, else quarter it until ``g`` decreases, at most 15 steps each; momentum optional);
* :func:`offer`: every search result is a point the oracle saw adversarial; each sample keeps the closest one in
  the threat norm as its boundary point ``x_bd`` (what ``within_eps`` claims);
* the per-iteration bookkeeping (step size reset to 1 and ``beta`` divided by 10 once the step size falls below
  1e-4, with unit-Linf directions 1e-6 as the authors' ``Sign_OPT_lf.py``; the sample stops once ``beta`` <
  1e-8). Per-sample state: ``theta``, ``g``, ``alpha``, ``beta_scale``,
  ``stopped`` (Sign-OPT: ``velocity``), next to the decision-attack state of :mod:`.decision`.

OPT estimates the gradient of ``g`` by RGF over ``q`` = 10 Gaussian directions, each costing a local ``g``
search (all rows of all samples in one batched search); Sign-OPT estimates its sign with one query per direction
(``k`` = 200, one oracle call): is ``x + g(theta) (theta + beta u) / |theta + beta u|`` still adversarial?
SVM-OPT (``svm``) fits the signs by the authors' non-negative QP instead of averaging them.

Norms: OPT is L2-native: its direction is L2-normalised under either threat norm; under Linf it minimises the
L2 distance and success is judged in Linf (on the closest point in Linf among its search results). Sign-OPT does
the same by default (``directions`` "l2": the authors' ``Sign_OPT.py`` and BlackboxBench's ``sign_opt_attack.py``
under every norm); ``directions`` "threat" follows the authors' Linf variant (``Sign_OPT_lf.py``) under Linf:
directions and probes are normalised to unit Linf norm, so ``g`` is the Linf distance.

Deviations from the authors' code (none changes what a query asks for): points are clipped to [0, 1] before
they are queried (the authors' L2 code queries ``x0 + lam theta`` unclipped; ART clips); during a local search the
bracket keeps the last adversarial / non-adversarial ``lam`` seen (the authors keep the first probe as the far end
of the bisection, which only costs queries); RGF directions whose local search fails (no boundary within ``lam``
20) are left out of the estimate instead of making it infinite; there is no iteration cap besides the query
budget (the authors' 1,000-3,000 iterations are not reached within 10,000 queries); a sample stops searching as
soon as one of its points lies within the claim radius; where no initial candidate is adversarial, the other
kind is tried (untargeted: the pool's images of other classes; targeted: Gaussian directions).
"""
import torch

from ..errors import BenchError
from ..registry import INIT, PERTURB
from ..rng import rank_within_group
from ..threat import flat_norm
from . import common
from .common import per_sample, rows_where
from .decision import claim_limit, decision_state, grow_lopsided, known_dist, has_budget, query_adv, stop_radius

PAPER_OPT = ("Cheng, Le, Chen, Yi, Zhang, Hsieh, Query-Efficient Hard-label Black-box Attack: An "
             "Optimization-based Approach, ICLR 2019")
PAPER_SIGN = ("Cheng, Singh, Chen, Chen, Liu, Hsieh, Sign-OPT: A Query-Efficient Hard-label Adversarial Attack, "
              "ICLR 2020")

RATIO = 0.01          # fine-grained search: lam grows / shrinks by 1 % per query (authors' code)
MAX_LAMBDA = {False: 20.0, True: 100.0}  # a local search that must grow past this gives up (untargeted / targeted)
LS_STEPS = 15         # step-size doublings, then quarterings, per line search (authors' code)
# below it: step size back to 1, beta / 10; keyed by the norm the directions are unit in (authors' code:
# Sign_OPT.py and OPT_attack.py 1e-4, the Linf variant Sign_OPT_lf.py 1e-6 in its attack_untargeted)
ALPHA_FLOOR = {"l2": 1e-4, "linf": 1e-6}
BETA_FLOOR = 1e-8     # below it: the sample stops (authors' code)
LOCAL_TOL = 500       # local searches bisect to beta / 500 (authors' code)
TOL_FLOOR = 2e-9      # smallest bisection tolerance (Sign_OPT_lf.py)
# OPT's and Sign-OPT's beta grows tenfold after an iteration whose probes' signs were lopsided (a deviation, as HSJA's
# probe growth; decision.grow_lopsided; OPT: all agreed, Sign-OPT: its probe_balance), up to BETA_CAP: such signs
# carry no information (the probes were below the uncertainty of where the boundary lies: the local searches'
# tolerance, logits that move with the batch size). Logits that move by 1e-3 with the batch size shifted the
# boundary past beta 0.001: 57 % of Sign-OPT's sample-iterations on the digits MLP got signs 95 % or more on one side
# (4 % without the jitter), and it fooled 8 of 24 instead of 14, OPT 6 instead of 9 (tests/test_numerics.py). On a
# jittered CIFAR-10 ResNet-20 Sign-OPT's signs were 90-99 % on one side, which the unanimous rule missed: at
# probe_balance 0.7 Linf 0.05 fools 16 of 16 instead of 15 and L2 1.0 takes 1,485 mean queries instead of 1,733
# (1,193 on the model as it is; twenty-second session, benchmarks/RESULTS.md).
BETA_CAP = 0.1

PROBE, GROW, SHRINK, BISECT, DONE = range(5)


# ------------------------------------------------------------------------------------------------ g(theta)

def unit(v, norm):
    """Rows of ``v`` scaled to unit ``norm`` -> ``(unit rows, their norms)``."""
    size = flat_norm(v, norm)
    return v / per_sample(size.clamp_min(1e-30), v), size


def ray(x, theta, lam):
    """``clip(x + lam theta, 0, 1)`` per row (``lam`` (m,), any float dtype; the image is float32 arithmetic, so a
    point rebuilt from the same ``lam`` is bit for bit the one queried)."""
    return (x + per_sample(lam, x) * theta).clamp(0.0, 1.0)


def reach(ctx, radius, theta, owner):
    """(m,) float64: the ``lam`` along each row of ``theta`` below which its point lies within ``radius[owner]``
    in the threat norm (clipping only shortens a perturbation, so ``lam |theta|`` bounds the distance)."""
    size = flat_norm(theta, ctx.problem.norm).double().clamp_min(1e-30)
    return radius[owner].double() / size


def offer(ctx, best, theta, owner, lam):
    """Keep in ``best`` (a dict with ``x_bd`` (n, C, H, W) and ``dist`` (n,), updated in place) each sample's
    closest adversarial point in the threat norm among the search results ``lam`` (m,) along rows ``theta`` of
    samples ``owner`` (+inf rows: nothing found). Under L2 this is the point at the smallest ``g``; under Linf
    with an L2 search it can be another one, which is why the boundary point is tracked apart from ``theta``."""
    ok = torch.isfinite(lam)
    if not ok.any():
        return
    theta, owner, lam = theta[ok], owner[ok], lam[ok]
    pts = ray(ctx.problem.x[owner], theta, lam)
    d = flat_norm(pts - ctx.problem.x[owner], ctx.problem.norm)
    low = best["dist"].scatter_reduce(0, owner, d, "amin")
    win = (d == low[owner]) & (d < best["dist"][owner])
    win[win.nonzero().squeeze(1)[rank_within_group(owner[win]) > 0]] = False  # first of equals
    best["x_bd"][owner[win]] = pts[win]
    best["dist"][owner[win]] = d[win]


def g_search(ctx, theta, owner, start, tol, enough, *, local, known=None, max_lambda=20.0):
    """``g`` along rows ``theta`` (m, C, H, W) of samples ``owner`` (m,) -> (m,) float64, +inf where no
    adversarial point was found.

    ``local`` True is the authors' local search: probe ``start``; if adversarial shrink ``lam`` by 1 % until it is
    not, else grow it by 1 % until it is (giving up past ``max_lambda``); then bisect to ``tol``. ``local`` False is
    their initial search: rows with ``known`` (their point at ``start`` was just seen adversarial) bisect in
    ``[0, start]`` at once, the others probe ``start`` first and give up if it is not adversarial. A row stops early
    once its adversarial end is within ``enough`` (m,) (see :func:`reach`), and at its sample's first refused
    query. The result is always a ``lam`` whose point :func:`ray` the oracle answered adversarial (or ``start`` of a
    ``known`` row).
    """
    x, dev, m = ctx.problem.x, theta.device, owner.numel()
    start = start.double()
    tol = torch.as_tensor(tol, dtype=torch.float64, device=dev).expand(m).clamp_min(TOL_FLOOR)
    lo = torch.zeros(m, dtype=torch.float64, device=dev)
    hi = torch.full((m,), float("inf"), dtype=torch.float64, device=dev)
    known = torch.zeros(m, dtype=torch.bool, device=dev) if known is None else known
    hi[known] = start[known]
    phase = torch.where(known, BISECT, PROBE)
    phase[~(has_budget(ctx)[owner] & torch.isfinite(start))] = DONE
    while True:
        # rows whose bracket is fine enough, or whose adversarial end is close enough, are done
        narrow = (phase == BISECT) & (hi - lo <= tol)
        phase[narrow | ((phase == BISECT) | (phase == SHRINK)) & (hi <= enough)] = DONE
        idx = (phase != DONE).nonzero().squeeze(1)
        if idx.numel() == 0:
            return hi
        ph = phase[idx]
        t = torch.where(ph == PROBE, start[idx], (lo[idx] + hi[idx]) / 2)
        t = torch.where(ph == GROW, lo[idx] * (1 + RATIO), t)
        t = torch.where(ph == SHRINK, hi[idx] * (1 - RATIO), t)
        stuck = (ph == BISECT) & ((t <= lo[idx]) | (t >= hi[idx]))  # float64 resolution reached
        adv, ok = query_adv(ctx, ray(x[owner[idx]], theta[idx], t), owner[idx])
        hi[idx[adv]] = t[adv]
        lo[idx[ok & ~adv]] = t[ok & ~adv]
        nxt = ph.clone()
        if local:
            nxt[(ph == PROBE) & adv] = SHRINK
            nxt[(ph == PROBE) & ~adv] = GROW
            nxt[((ph == GROW) & adv) | ((ph == SHRINK) & ~adv)] = BISECT
            gave_up = (nxt == GROW) & (t * (1 + RATIO) > max_lambda)
            hi[idx[gave_up]] = float("inf")
            nxt[gave_up] = DONE
            nxt[(nxt == SHRINK) & (t * (1 - RATIO) < tol[idx])] = BISECT  # lo stays 0: bisect the rest
        else:
            nxt[(ph == PROBE) & adv] = BISECT
            nxt[(ph == PROBE) & ~adv] = DONE
        nxt[~ok | stuck] = DONE
        phase[idx] = nxt


def _pool_candidates(ctx, targeted):
    """Each sample's pool images to try as directions, in dataset order after its own index (so a sample's start
    does not depend on who is attacked with it): targeted, the images of the target class; untargeted, those of
    another class. Returns ``(order (n, N-1) pool indices, usable (n, N-1) bool, rank (n, N-1))`` or None."""
    pool, problem = ctx.pool, ctx.problem
    if pool is None or pool.y.numel() < 2:
        return None
    dev, m = problem.x.device, pool.y.numel()
    order = (ctx.index[:, None] + 1 + torch.arange(m - 1, device=dev)[None]) % m
    labels = pool.y.to(dev)[order]
    usable = labels == problem.target[:, None] if targeted else labels != problem.y[:, None]
    return order, usable, usable.long().cumsum(1) - 1


def initial_direction(ctx, *, num_directions, tol, dir_norm):
    """The authors' initialisation: for each of ``num_directions`` candidate directions (one round per direction,
    all samples together), one query at the candidate point, and where it is adversarial the initial ``g`` search
    (bisect from 0, after a probe at the best ``g`` so far when the candidate lies farther). Candidates:
    untargeted, Gaussian directions (the authors'), then for samples none of them fooled, up to
    ``num_directions`` of the pool's images of other classes; targeted, the pool's images of the target class (the
    authors' targeted code), then for samples none of them fooled, Gaussian directions. A sample stops once its
    ``g`` is within the claim radius.

    Returns ``(theta (n, C, H, W) unit in dir_norm, g (n,) float64, +inf where nothing was found)``.
    """
    problem = ctx.problem
    x, n, dev = problem.x, problem.n, problem.x.device
    theta, g = torch.zeros_like(x), torch.full((n,), float("inf"), dtype=torch.float64, device=dev)
    radius = torch.full((n,), claim_limit(problem), dtype=torch.float64, device=dev)
    pool = _pool_candidates(ctx, problem.targeted)
    stages = ["gauss", "pool"] if not problem.targeted else ["pool", "gauss"]
    for stage in stages:
        if stage == "pool" and pool is None:
            continue
        for r in range(num_directions):
            live = has_budget(ctx) & ~(g <= reach(ctx, radius, theta, torch.arange(n, device=dev)))
            if stage != stages[0]:  # the fallback: only samples without a direction yet
                live &= torch.isinf(g)
            if stage == "pool":  # samples with a candidate of this rank
                order, usable, rank = pool
                live &= rank[:, -1] >= r
            if not live.any():  # the live set only shrinks from round to round
                break
            idx = live.nonzero().squeeze(1)
            if stage == "gauss":
                raw = ctx.rng.normal(x.shape[1:], rows=idx).to(x.dtype)
            else:
                pick = order[idx, (usable[idx] & (rank[idx] == r)).float().argmax(1)]
                raw = ctx.pool.x[pick.cpu()].to(dev) - x[idx]
            _try_direction(ctx, raw, idx, theta, g, radius, tol, dir_norm)
    return theta, g


def _try_direction(ctx, raw, idx, theta, g, radius, tol, dir_norm):
    """One candidate direction ``raw`` per sample ``idx``: the query at ``x + raw``, then where adversarial the
    initial search; ``theta`` and ``g`` are updated in place where it beats the sample's best ``g``."""
    x = ctx.problem.x
    cand, lam0 = unit(raw, dir_norm)
    lam0 = lam0.double()
    adv, _ = query_adv(ctx, ray(x[idx], cand, lam0), idx)
    if not adv.any():
        return
    sel, cand, lam0 = idx[adv], cand[adv], lam0[adv]
    best = g[sel]
    lam = g_search(ctx, cand, sel, torch.minimum(lam0, best), tol, reach(ctx, radius, cand, sel), local=False,
                   known=lam0 <= best)
    better = lam < best
    theta[sel[better]] = cand[better]
    g[sel[better]] = lam[better]


def _start_state(ctx, theta, g, **extra):
    problem = ctx.problem
    found = torch.isfinite(g)
    x_bd = rows_where(found, ray(problem.x, theta, torch.where(found, g, 0.0)), problem.x)
    dist = known_dist(problem, x_bd, found)
    n, dev = problem.n, problem.x.device
    nan = torch.full((n,), float("nan"), dtype=torch.float64, device=dev)
    return decision_state(problem, x_bd, dist, theta=theta, g=g, alpha=nan, beta_scale=torch.ones_like(nan),
                          stopped=torch.zeros(n, dtype=torch.bool, device=dev), **extra)


# ------------------------------------------------------------------------------------------------ line search

def line_search(ctx, theta, g, grad, alpha, tol, live, stop, best_point, *, dir_norm, max_lambda, velocity=None,
                momentum=0.0):
    """The authors' step-size search along ``-grad`` from ``theta`` (``g`` its distance), for samples ``live``.

    Double ``alpha`` after every try while the local ``g`` search keeps finding a smaller ``g`` (at most 15
    tries, each starting from the best ``g`` so far); if the first try failed, quarter ``alpha`` until a try beats
    ``g`` (at most 15). With ``velocity``, a try is ``theta + momentum * velocity - alpha * grad`` and the accepted
    step becomes the new velocity. Every try is one batched :func:`g_search` for the samples still trying, whose
    results are offered to ``best_point`` (see :func:`offer`); a sample stops trying once that point is within
    ``stop``. Returns ``(theta, g, alpha, velocity)``; a sample keeps its ``theta`` and ``g`` where nothing beat
    ``g``.
    """
    theta, alpha, best = theta.clone(), alpha.clone(), g.clone()
    vel = None if velocity is None else velocity.clone()

    def attempt(idx):
        step = -per_sample(alpha[idx], grad) * grad[idx]
        if velocity is not None:
            step = momentum * velocity[idx] + step
        cand, _ = unit(theta_0[idx] + step, dir_norm)
        enough = reach(ctx, stop, cand, idx)
        lam = g_search(ctx, cand, idx, best[idx], tol[idx], enough, local=True, max_lambda=max_lambda)
        offer(ctx, best_point, cand, idx, lam)
        return cand, step, lam

    def take(idx, ok, cand, step, lam):
        theta[idx[ok]], best[idx[ok]] = cand[ok], lam[ok]
        if vel is not None:
            vel[idx[ok]] = step[ok]

    theta_0 = theta.clone()
    active = live.clone()
    for _ in range(LS_STEPS):
        active &= has_budget(ctx) & (best_point["dist"].double() > stop)
        if not active.any():
            break
        idx = active.nonzero().squeeze(1)
        cand, step, lam = attempt(idx)
        alpha[idx] *= 2
        ok = lam < best[idx]
        take(idx, ok, cand, step, lam)
        active[idx[~ok]] = False
    active = live & (best >= g)
    for _ in range(LS_STEPS):
        active &= has_budget(ctx) & (best_point["dist"].double() > stop)
        if not active.any():
            break
        idx = active.nonzero().squeeze(1)
        alpha[idx] *= 0.25
        cand, step, lam = attempt(idx)
        ok = lam < g[idx]
        take(idx, ok, cand, step, lam)
        active[idx[ok]] = False
    return theta, best, alpha, vel


def _iteration_start(ctx, state, alpha):
    """``(go, alpha)``: the samples to iterate (a direction, budget, not stopped, not already within reach) and
    their step sizes (the recipe's ``alpha`` until a sample has its own: the init leaves it NaN)."""
    problem = ctx.problem
    reached = state["dist"].double() <= stop_radius(problem, state)
    go = torch.isfinite(state["g"]) & has_budget(ctx) & ~state["stopped"] & ~reached
    a = torch.where(torch.isnan(state["alpha"]), torch.full_like(state["alpha"], alpha), state["alpha"])
    return go, a


def _best_point(state):
    return {"x_bd": state["x_bd"].clone(), "dist": state["dist"].clone()}


def count_signs(tally, owner, sgn, answered):
    """Add the signs ``sgn`` (m,) of rows ``answered`` (m,) bool of samples ``owner`` to ``tally`` (each sample's
    sum of signs and count of answered rows, (n,) each; see :func:`~.decision.grow_lopsided`)."""
    tally[0].index_add_(0, owner, torch.where(answered, sgn, 0).to(tally[0].dtype))
    tally[1].index_add_(0, owner, answered.to(tally[1].dtype))


def _finish(state, go, theta, g, alpha, beta, best_point, dir_norm, **extra):
    """The authors' end of an iteration: alpha below ``ALPHA_FLOOR[dir_norm]`` (1e-4; 1e-6 for unit-Linf
    directions) -> alpha 1 and beta / 10 (stop below 1e-8). Returns the search state for ``within_eps``: the new
    direction where ``g`` decreased and the closest adversarial point seen (``best_point``)."""
    low = go & (alpha < ALPHA_FLOOR[dir_norm])
    alpha = torch.where(low, torch.ones_like(alpha), alpha)
    beta_scale = torch.where(low, state["beta_scale"] * 0.1, state["beta_scale"])
    moved = go & (g < state["g"])
    return dict(theta=rows_where(moved, theta, state["theta"]), g=torch.where(moved, g, state["g"]),
                alpha=torch.where(go, alpha, state["alpha"]), beta_scale=beta_scale,
                stopped=state["stopped"] | (low & (beta_scale * beta < BETA_FLOOR)), **best_point, **extra)


# ------------------------------------------------------------------------------------------------ OPT

@INIT.register("opt_init", paper=PAPER_OPT, norms=("linf", "l2"),
               ranges={"num_directions": "int [1, inf)", "init_tol": "(0, inf)"})
def opt_init(ctx, *, num_directions=100, init_tol=1e-5):
    """Best of ``num_directions`` random directions (authors' code: 100 Gaussian directions; targeted: the
    attacker's images of the target class), each searched to ``init_tol`` (authors' OPT code: 1e-5). The direction
    is L2-normalised under either threat norm (OPT is L2-native)."""
    theta, g = initial_direction(ctx, num_directions=num_directions, tol=init_tol, dir_norm="l2")
    return _start_state(ctx, theta, g)


@PERTURB.register("opt", paper=PAPER_OPT, norms=("linf", "l2"),
                  ranges={"alpha": "(0, inf)", "beta": "(0, inf)", "q": "int [1, inf)"})
def opt(ctx, state, *, alpha=0.2, beta=0.001, q=10):
    """One OPT iteration for every sample with a direction: the RGF estimate of the gradient of ``g`` from ``q``
    directions ``u`` (unit Gaussian; ``(g(theta + beta u) - g(theta)) / beta * u`` averaged, each ``g`` a local
    search to ``beta / 500``, the ``q`` rows of whole samples in batched searches of about ``PROBE_VALUES`` values:
    one on CIFAR-10, pieces at ImageNet size), the line search with initial step ``alpha`` (Table V: alpha 0.2, beta
    0.001), then the best of the line search and the best probe direction.
    """
    problem = ctx.problem
    go, a = _iteration_start(ctx, state, alpha)
    theta, g = state["theta"], state["g"]
    b = beta * state["beta_scale"]
    stop = stop_radius(problem, state)
    max_lambda = MAX_LAMBDA[problem.targeted]
    idx = go.nonzero().squeeze(1)
    best_point = _best_point(state)
    grad = torch.zeros_like(theta)
    tally = (torch.zeros_like(g), torch.zeros_like(g))  # the signs of g1 - g (see BETA_CAP)
    min_g1 = torch.full_like(g, float("inf"))
    min_probe = theta.clone()
    for group in common.bounded_calls(torch.ones_like(idx), q * theta[0].numel()):  # whole samples per search
        sel = idx[group]
        owner = sel.repeat_interleave(q)
        u, _ = unit(ctx.rng.normal(theta.shape[1:], rows=owner).to(theta.dtype), "l2")
        probe, _ = unit(theta[owner] + per_sample(b[owner], u) * u, "l2")
        enough = reach(ctx, stop, probe, owner)
        g1 = g_search(ctx, probe, owner, g[owner], b[owner] / LOCAL_TOL, enough, local=True, max_lambda=max_lambda)
        offer(ctx, best_point, probe, owner, g1)
        fin = torch.isfinite(g1)
        coef = torch.where(fin, (g1 - g[owner]) / b[owner], torch.zeros_like(g1))
        count_signs(tally, owner, coef.sign(), fin)
        grad[sel] = (per_sample(coef, u) * u).view(sel.numel(), q, *u.shape[1:]).sum(1) / q
        # the best probe of each sample (first of equals), and whether it already lies within reach
        rows = torch.arange(sel.numel(), device=g.device) * q + g1.view(-1, q).argmin(1)
        min_g1[sel] = g1[rows]
        min_probe[sel] = probe[rows]
    near = best_point["dist"].double() <= stop  # a probe landed within reach: no line search
    new_theta, new_g, a, _ = line_search(ctx, theta, g, grad, a, b / LOCAL_TOL, go & ~near, stop, best_point,
                                         dir_norm="l2", max_lambda=max_lambda)
    use_probe = go & (min_g1 < new_g)
    new_theta = rows_where(use_probe, min_probe, new_theta)
    new_g = torch.where(use_probe, min_g1, new_g)
    return _finish({**state, "beta_scale": grow_lopsided(state["beta_scale"], go, *tally, BETA_CAP / beta)},
                   go, new_theta, new_g, a, beta, best_point, "l2")


# ------------------------------------------------------------------------------------------------ Sign-OPT

def sign_directions(ctx, theta, g, u, owner, beta, dir_norm):
    """Sign-OPT's single-query sign of the directional derivative of ``g`` along each row ``u`` (m, C, H, W) of
    samples ``owner``: -1 where ``x + g (theta + beta u) / |theta + beta u|`` is adversarial (``g`` would
    decrease), +1 where not, 0 where the query was refused. Returns (m,) float."""
    probe, _ = unit(theta[owner] + per_sample(beta[owner], u) * u, dir_norm)
    adv, ok = query_adv(ctx, ray(ctx.problem.x[owner], probe, g[owner]), owner)
    return torch.where(adv, -1.0, 1.0) * ok.float()


def signed_sum(ctx, theta, g, idx, k, beta, dir_norm, tally=None):
    """``sum_i sign_i u_i`` over ``k`` random directions of each sample of ``idx`` (see :func:`sign_directions`),
    (len(idx), C, H, W). Memory is bounded as in HSJA (``PROBE_VALUES``): a sample's directions come in pieces of at
    most ``PROBE_VALUES / d`` rows, piece ``p`` in its ``p``-th draw, and a call holds as many whole pieces as fit.
    On CIFAR-10 (one piece of 200 rows, 109 samples a call) that is one draw and one call, as before; a 299 x 299
    image at 100 slots asked for about 10 GB in one call. ``tally``: a pair of (n,) tensors that get each
    sample's sum of signs and count of answered directions (see :func:`~.decision.lopsided`)."""
    piece = max(1, common.PROBE_VALUES // max(1, theta[0].numel()))
    total = torch.zeros((idx.numel(), *theta.shape[1:]), dtype=theta.dtype, device=theta.device)
    for start in range(0, k, piece):
        rows = min(piece, k - start)
        for sel in common.bounded_calls(torch.ones_like(idx), rows * theta[0].numel()):  # whole pieces a call
            owner = idx[sel].repeat_interleave(rows)
            u, _ = unit(ctx.rng.normal(theta.shape[1:], rows=owner).to(theta.dtype), dir_norm)
            sgn = sign_directions(ctx, theta, g, u, owner, beta, dir_norm)
            total[sel] += (per_sample(sgn, u) * u).view(sel.numel(), rows, *theta.shape[1:]).sum(1)
            if tally is not None:
                count_signs(tally, owner, sgn, sgn != 0)
    return total


DIRECTIONS = ("l2", "threat")


def direction_norm(threat_norm, directions):
    """The norm Sign-OPT's directions are unit in: "l2" whatever the threat (``Sign_OPT.py``; BlackboxBench's port),
    or the threat norm itself ("threat": ``Sign_OPT_lf.py`` under Linf)."""
    return {"l2": "l2", "threat": threat_norm}[directions]


def check_directions(theta, g, norm):
    """The perturb block's ``directions`` must be the init's: every found direction is unit in ``norm``."""
    size = flat_norm(theta[torch.isfinite(g)], norm)
    if not torch.allclose(size, torch.ones_like(size), rtol=1e-3):
        raise BenchError(f"sign_opt: the init's directions are not unit in {norm} (give sign_opt_init and sign_opt "
                         "the same directions)")


def nonneg_qp(Q, b, iters=20000, tol=1e-7):
    """The authors' ``quad_solver``, batched: min_a 0.5 a^T Q a + b^T a s.t. a >= 0 for each (K, K) ``Q`` of a
    batch (n, K, K), by greedy coordinate descent (the largest projected coordinate step each time, until it is
    below ``tol``; a zero row of ``Q`` needs a zero entry of ``b``). Returns (n, K)."""
    n, k = b.shape
    a = torch.zeros_like(b)
    grad = b.clone()
    diag = torch.diagonal(Q, dim1=1, dim2=2).clamp_min(1e-30)
    live = torch.ones(n, dtype=torch.bool, device=b.device)
    rows = torch.arange(n, device=b.device)
    for _ in range(iters):
        delta = torch.clamp(a - grad / diag, min=0.0) - a
        j = delta.abs().argmax(1)
        val = delta[rows, j]
        live &= val.abs() >= tol
        if not live.any():
            break
        val = torch.where(live, val, torch.zeros_like(val))
        grad += val[:, None] * Q[rows, :, j]
        a[rows, j] += val
    return a


@INIT.register("sign_opt_init", paper=PAPER_SIGN, norms=("linf", "l2"),
               ranges={"num_directions": "int [1, inf)", "init_tol": "(0, inf)", "init_tol_linf": "(0, inf)",
                       "directions": DIRECTIONS})
def sign_opt_init(ctx, *, num_directions=100, init_tol=1e-3, init_tol_linf=1e-5, directions="l2"):
    """Best of ``num_directions`` random directions (authors' code: 100; targeted: the attacker's images of the
    target class), unit in :func:`direction_norm` (``directions``: "l2", or "threat" for ``Sign_OPT_lf.py``'s
    unit-Linf directions under Linf), each searched to ``init_tol`` (authors' ``Sign_OPT.py``: 1e-3) with unit-L2
    directions, ``init_tol_linf`` (``Sign_OPT_lf.py``: 1e-5) with unit-Linf ones. Adds the momentum velocity."""
    norm = direction_norm(ctx.problem.norm, directions)
    theta, g = initial_direction(ctx, num_directions=num_directions,
                                 tol=init_tol_linf if norm == "linf" else init_tol, dir_norm=norm)
    return _start_state(ctx, theta, g, velocity=torch.zeros_like(theta))


@PERTURB.register("sign_opt", paper=PAPER_SIGN, norms=("linf", "l2"), native_norms=("l2",),
                  ranges={"alpha": "(0, inf)", "beta": "(0, inf)", "k": "int [1, inf)", "momentum": "[0, 1)",
                          "svm": (True, False), "svm_k": "int [1, inf)", "directions": DIRECTIONS,
                          "probe_balance": "(0, 1]"})
def sign_opt(ctx, state, *, alpha=0.2, beta=0.001, k=200, momentum=0.0, svm=False, svm_k=100, directions="l2",
             probe_balance=0.7):
    """One Sign-OPT iteration for every sample with a direction: ``k`` single-query signs (Table V: k 200, one
    oracle call for all samples), ``grad = sum sign_i u_i / k`` (``svm``: SVM-OPT, ``svm_k`` signs fitted by the
    non-negative QP, authors' default 100), then the line search with initial step ``alpha`` and local searches
    to ``beta / 500`` (Table V: alpha 0.2, beta 0.001, momentum 0, svm False). ``directions`` must be the init's
    (see :func:`sign_opt_init`). A sample whose signs were lopsided (``probe_balance``, see
    :func:`~.decision.lopsided`; 1: only when all agreed) probes with a tenfold beta from then on (up to
    ``BETA_CAP``)."""
    problem = ctx.problem
    norm = direction_norm(problem.norm, directions)
    go, a = _iteration_start(ctx, state, alpha)
    theta, g = state["theta"], state["g"]
    check_directions(theta, g, norm)
    b = beta * state["beta_scale"]
    stop = stop_radius(problem, state)
    idx = go.nonzero().squeeze(1)
    grad = torch.zeros_like(theta)
    tally = (torch.zeros_like(g), torch.zeros_like(g))  # the signs (see BETA_CAP)
    if svm:  # whole samples per draw, about PROBE_VALUES directions' values (one draw on CIFAR-10)
        for group in common.bounded_calls(torch.ones_like(idx), svm_k * theta[0].numel()):
            sel = idx[group]
            owner = sel.repeat_interleave(svm_k)
            u, _ = unit(ctx.rng.normal(theta.shape[1:], rows=owner).to(theta.dtype), norm)
            sgn = sign_directions(ctx, theta, g, u, owner, b, norm)
            count_signs(tally, owner, sgn, sgn != 0)
            X = (per_sample(sgn, u) * u).view(sel.numel(), svm_k, theta[0].numel()).double()
            answered = (sgn != 0).view(sel.numel(), svm_k).double()  # a refused row (zero in X) gets no weight
            coef = nonneg_qp(X @ X.transpose(1, 2), -answered)
            grad[sel] = (coef[:, None, :] @ X).squeeze(1).view(-1, *theta.shape[1:]).to(theta.dtype)
    else:
        grad[idx] = signed_sum(ctx, theta, g, idx, k, b, norm, tally) / k
    best_point = _best_point(state)
    new_theta, new_g, a, vel = line_search(ctx, theta, g, grad, a, b / LOCAL_TOL, go, stop, best_point, dir_norm=norm,
                                           max_lambda=MAX_LAMBDA[problem.targeted], velocity=state["velocity"],
                                           momentum=momentum)
    moved = go & (new_g < g)
    grown = grow_lopsided(state["beta_scale"], go, *tally, BETA_CAP / beta, balance=probe_balance)
    return _finish({**state, "beta_scale": grown},
                   go, new_theta, new_g, a, beta, best_point, norm,
                   velocity=rows_where(moved, vel, state["velocity"]))
