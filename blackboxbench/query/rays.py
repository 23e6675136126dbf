"""RayS (Chen & Gu, KDD 2020): hard-label Linf attack by ray search over sign directions, batched over samples.

The attack looks for the sign vector ``s`` whose ray ``clip(x + r s)`` meets the decision boundary at the smallest
Linf radius ``r``. It keeps the best ``s`` and radius ``r_t`` and, one block at a time, flips the signs of a block
of coordinates (hierarchical: the whole image, then halves, quarters, ...). A flipped direction is first checked
at the current radius (one query: no hit, no search), and only on a hit binary-searched in ``[0, r_t]``.
One pipeline iteration is one block flip for every active sample (one call for the checks, one per bisection
step). The attack stops early once ``r_t`` reaches eps. Table V: no hyper-parameters beyond eps and budget.
"""
import math

import torch

from ..errors import BenchError
from ..registry import INIT, PERTURB
from .common import per_sample, rows_where
from .decision import bisect, decision_state, has_budget, query_adv, stop_radius

PAPER = "Chen & Gu, RayS: A Ray Searching Method for Hard-label Adversarial Attack, KDD 2020"
SEARCH_TOL = 1e-3  # reference code: bisection tolerance on the ray length along s / ||s||_2 (= r * sqrt(d))


@INIT.register("rays_init", paper=PAPER, norms=("linf",))
def rays_init(ctx):
    """All-ones sign vector, no boundary radius yet (+inf); no query."""
    problem = ctx.problem
    if problem.norm != "linf":
        raise BenchError(f"rays supports the linf norm only, got '{problem.norm}'")
    n, dev = problem.n, problem.x.device
    inf = torch.full((n,), float("inf"), device=dev)
    zero = torch.zeros(n, dtype=torch.long, device=dev)
    return decision_state(problem, problem.x.clone(), inf, sgn=torch.ones_like(problem.x),
                          radius=inf.double(), block_level=zero, block_ind=zero.clone())


def _block(level, ind, dim):
    """Coordinates ``[start, end)`` of block ``ind`` at ``level`` (blocks of ``ceil(dim / 2^level)``)."""
    blocks = 2 ** level.clamp(max=math.ceil(math.log2(dim)))  # past that level every block is one coordinate
    size = (dim + blocks - 1) // blocks
    start = ind * size
    return start, torch.clamp(start + size, max=dim), blocks


@PERTURB.register("rays", paper=PAPER, norms=("linf",))
def rays(ctx, state):
    """Flip the next block of each sample's sign vector and search its ray; keep it when the boundary is closer.

    Returns the updated search state (``sgn``, ``radius``, ``x_bd``, ``dist``, block schedule) for the
    ``within_eps`` acceptance.
    """
    problem = ctx.problem
    x, n = problem.x, problem.n
    dim = x[0].numel()
    level, ind = state["block_level"], state["block_ind"]
    start, end, blocks = _block(level, ind, dim)
    pos = torch.arange(dim, device=x.device)
    flip = (pos >= start[:, None]) & (pos < end[:, None])
    sgn = state["sgn"].flatten(1)
    attempt = torch.where(flip, -sgn, sgn).view_as(x)

    def ray(r, i):
        return (x[i] + per_sample(r, x[i]) * attempt[i]).clamp(0.0, 1.0)

    r_t = state["radius"]
    hi = r_t.clamp(max=1.0)  # beyond radius 1 every coordinate is clipped: the same corner of the box
    idx = has_budget(ctx).nonzero().squeeze(1)
    adv, _ = query_adv(ctx, ray(hi[idx], idx), idx)
    hit = torch.zeros(n, dtype=torch.bool, device=x.device)
    hit[idx[adv]] = True
    _, hi = bisect(ctx, ray, torch.zeros_like(hi), hi, SEARCH_TOL / math.sqrt(dim), hit,
                   enough=stop_radius(problem, state))  # the ray radius bounds the Linf distance
    better = hit & (hi < r_t)
    x_new = ray(hi, torch.arange(n, device=x.device))
    nxt = ind + 1
    wrap = (nxt == blocks) | (end == dim)
    return dict(sgn=rows_where(better, attempt, state["sgn"]), radius=torch.where(better, hi, r_t),
                x_bd=rows_where(better, x_new, state["x_bd"]),
                dist=torch.where(better, problem.dist(x_new), state["dist"]),
                block_level=level + wrap.long(), block_ind=torch.where(wrap, torch.zeros_like(nxt), nxt))
