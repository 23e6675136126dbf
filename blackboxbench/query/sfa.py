"""Sign Flip Attack (Chen, Zhang, Hu, Wu, "Boosting Decision-based Black-box Adversarial Attacks with Random Sign
Flip", ECCV 2020): a hard-label Linf attack, batched over samples.

From an adversarial perturbation ``delta`` (a random or target-class start pulled towards ``x`` by a Linf binary
search), every iteration makes two queries per sample:

* **projection step**: add random signs of size ``alpha`` and project onto the Linf ball of radius
  ``||delta||_inf - alpha``; keep it if still adversarial;
* **random sign flip**: flip the sign of each coordinate of ``delta`` with probability ``1 - p_j`` (``p`` starts
  at 0.999, per coordinate); keep it if still adversarial. A kept flip moves ``p`` by ``-1e-4 s`` (``s`` = +1
  kept, -1 flipped) on every coordinate.

Every 10 iterations (per sample) the success rates of the two steps adapt the sample's ``alpha`` (x1.5 above
0.7, /1.5 below 0.3) and its whole ``p`` (-0.001 above 0.7, +0.001 below 0.3); ``p`` stays in [0.99, 0.9999].
Constants (start ``alpha`` 0.004, ``p`` 0.999, 10 binary-search steps, the adaptation rule) are the authors'
(wubaoyuan/Sign-Flip-Attack, as ported to BlackboxBench's ``sign_flip_attack.py``). Table V: ``resize_factor``
1.0 (the random signs and flip masks are drawn at ``H / resize_factor`` and resized bilinearly; 1.0: none).

Batched: one pipeline iteration is one SFA iteration for every sample (two oracle calls); the step size, the flip
probabilities, the success counters and the adaptation clock are per sample in the state (the authors share one
clock over the batch). As in the authors' code, ``delta`` is kept unclipped and every query is
``clip(x + delta, 0, 1)``; ``x_bd`` is that image, so ``dist`` is its true Linf distance (the authors test
``||delta||_inf`` <= eps, which can only be larger). The start is ``decision.find_start`` (uniform noise, then the
pool: untargeted other classes, targeted the target class first, as the authors' targeted start).
"""
import torch
import torch.nn.functional as F

from ..errors import BenchError
from ..registry import INIT, PERTURB
from .common import per_sample, rows_where
from .decision import bisect, claim_limit, decision_state, known_dist, find_start, has_budget, query_adv

PAPER = ("Chen, Zhang, Hu, Wu, Boosting Decision-based Black-box Adversarial Attacks with Random Sign Flip, "
         "ECCV 2020")
ALPHA0 = 0.004            # initial projection step (authors' code)
PROB0 = 0.999             # initial probability of keeping a sign (authors' code)
PROB_RANGE = (0.99, 0.9999)
PROB_STEP = 1e-4          # move of p after a kept flip
ADAPT_EVERY = 10          # iterations between adaptations
ADAPT = (0.3, 0.7, 1.5, 1e-3)  # low / high success rate, alpha factor, p step


def box(x_far, x, radius):
    """``x_far`` clipped to the Linf box of ``radius`` (n,) around ``x`` (the authors' ``project_infinity``)."""
    r = per_sample(radius, x)
    return torch.maximum(x - r, torch.minimum(x_far, x + r))


def reduced_shape(shape, resize_factor):
    c, h, w = shape
    return c, max(1, int(h // resize_factor)), max(1, int(w // resize_factor))


def upsample(v, size):
    """Bilinear resize of (n, C, h, w) to ``size`` (H, W) (the authors' ``resize``); identity at the same size."""
    return v if tuple(v.shape[-2:]) == tuple(size) else F.interpolate(v, size=list(size), mode="bilinear",
                                                                      align_corners=False)


@INIT.register("sfa_init", paper=PAPER, norms=("linf",),
               ranges={"resize_factor": "[1, inf)", "init_tries": "int [0, inf)",
                       "search_steps": "int [0, inf)"})
def sfa_init(ctx, *, resize_factor=1.0, init_tries=100, search_steps=10):
    """An adversarial start (``decision.find_start``, up to ``init_tries`` noise draws), then ``search_steps``
    (authors: 10) steps of Linf binary search of the box radius around ``x``."""
    problem = ctx.problem
    if problem.norm != "linf":
        raise BenchError(f"sfa supports the linf norm only, got '{problem.norm}'")
    x, n, dev = problem.x, problem.n, problem.x.device
    x0, found = find_start(ctx, tries=init_tries)
    d0 = problem.dist(x0).double()
    _, hi = bisect(ctx, lambda t, i: box(x0[i], x[i], t), torch.zeros_like(d0), d0, d0 / 2 ** search_steps, found,
                   claim_limit(problem))
    x_bd = box(x0, x, hi)
    dist = known_dist(problem, x_bd, found)
    shape = reduced_shape(x.shape[1:], resize_factor)
    return decision_state(problem, x_bd, dist, delta=x_bd - x,
                          alpha=torch.full((n,), ALPHA0, dtype=torch.float64, device=dev),
                          prob=torch.full((n, *shape), PROB0, dtype=x.dtype, device=dev),
                          it=torch.zeros(n, dtype=torch.long, device=dev),
                          proj_hits=torch.zeros(n, dtype=torch.long, device=dev),
                          flip_hits=torch.zeros(n, dtype=torch.long, device=dev))


@PERTURB.register("sfa", paper=PAPER, norms=("linf",))
def sfa(ctx, state):
    """One SFA iteration (projection step, random sign flip, every 10th iteration the adaptation) for every
    sample with an adversarial point; returns the updated search state for the ``within_eps`` acceptance."""
    problem = ctx.problem
    x = problem.x
    delta, alpha, prob = state["delta"], state["alpha"], state["prob"].clone()
    go = torch.isfinite(state["dist"]) & has_budget(ctx)
    proj_hit = torch.zeros_like(go)
    flip_hit = torch.zeros_like(go)

    # projection step: random signs of size alpha, then the Linf ball of radius ||delta||_inf - alpha
    idx = go.nonzero().squeeze(1)
    if idx.numel():
        a = alpha[idx].to(x.dtype)
        eta = upsample(ctx.rng.signs(prob.shape[1:], rows=idx).to(x.dtype) * per_sample(a, x), x.shape[-2:])
        radius = (delta[idx].flatten(1).abs().amax(1) - a).clamp_min(0)
        delta_p = box(delta[idx] + eta, torch.zeros_like(eta), radius)
        adv, _ = query_adv(ctx, (x[idx] + delta_p).clamp(0.0, 1.0), idx)
        delta = delta.index_put((idx[adv],), delta_p[adv])
        proj_hit[idx[adv]] = True

    # random sign flip: each coordinate keeps its sign with probability p
    idx = (go & has_budget(ctx)).nonzero().squeeze(1)
    if idx.numel():
        s = torch.where(ctx.rng.uniform(prob.shape[1:], rows=idx).to(prob.dtype) < prob[idx], 1.0, -1.0)
        s = s.to(prob.dtype)
        delta_s = delta[idx] * upsample(s, x.shape[-2:]).sign()
        adv, _ = query_adv(ctx, (x[idx] + delta_s).clamp(0.0, 1.0), idx)
        delta = delta.index_put((idx[adv],), delta_s[adv])
        prob[idx[adv]] = (prob[idx[adv]] - s[adv] * PROB_STEP).clamp(*PROB_RANGE)
        flip_hit[idx[adv]] = True

    # adaptation every ADAPT_EVERY iterations of the sample
    it = state["it"] + go.long()
    proj_hits, flip_hits = state["proj_hits"] + proj_hit.long(), state["flip_hits"] + flip_hit.long()
    due = go & (it % ADAPT_EVERY == 0)
    low, high, factor, p_step = ADAPT
    p_rate, f_rate = proj_hits.double() / ADAPT_EVERY, flip_hits.double() / ADAPT_EVERY
    alpha = torch.where(due & (p_rate > high), alpha * factor, alpha)
    alpha = torch.where(due & (p_rate < low), alpha / factor, alpha)
    move = torch.where(due & (f_rate > high), -p_step, 0.0) + torch.where(due & (f_rate < low), p_step, 0.0)
    prob = (prob + per_sample(move.to(prob.dtype), prob)).clamp(*PROB_RANGE)
    zero = torch.zeros_like(proj_hits)
    moved = proj_hit | flip_hit
    x_new = (x + delta).clamp(0.0, 1.0)
    return dict(delta=delta, alpha=alpha, prob=prob, it=it, proj_hits=torch.where(due, zero, proj_hits),
                flip_hits=torch.where(due, zero, flip_hits), x_bd=rows_where(moved, x_new, state["x_bd"]),
                dist=torch.where(moved, problem.dist(x_new), state["dist"]))
