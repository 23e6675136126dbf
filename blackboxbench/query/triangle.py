"""Triangle Attack (Wang, Zhang, Tong, Gong, He, Li, Liu, "Triangle Attack: A Query-efficient Decision-based
Adversarial Attack", ECCV 2022): an L2 attack by geometry in a low-frequency plane, batched over samples.

Each iteration takes the plane through the clean image ``x`` and the current adversarial point ``x_adv`` spanned
by ``e1 = (x_adv - x) / d`` (``d = ||x_adv - x||_2``) and a random low-frequency direction ``e2`` orthogonal to it:
a Gaussian value on ``dim_num`` random 2-D DCT frequencies of every channel, drawn from the top-left
``int(ratio_mask * H)`` square of frequencies, orthogonalised against ``e1``. In that plane it builds the triangle
``x, x_adv, x_t`` with the learned angle ``alpha`` at the new vertex ``x_t`` and the searched angle ``beta`` at
``x``; by the law of sines the side opposite the angle ``pi - alpha - beta`` at ``x_adv`` is

    ||x_t - x|| = d * sin(alpha + beta) / sin(alpha),   x_t = x + ||x_t - x|| (cos(beta) e1 +/- sin(beta) e2),

shorter than ``d`` as soon as ``beta > pi - 2 alpha`` (:func:`vertex`). The attack queries ``x_t`` at the smallest
useful ``beta`` on one side of the plane, then the other; on a hit it searches ``beta`` upwards for at most
``max_iter_num_in_2d`` rounds (both sides each), moving to the first adversarial vertex. ``alpha`` grows by
``plus_learning_rate`` when the plane gave a closer point and shrinks by ``minus_learning_rate`` on every miss,
kept in ``pi/2 +/- half_range`` (the authors' ``get_x_hat_in_2d``). 1 to ``2 + 2 max_iter_num_in_2d`` queries
per iteration.

The authors rotate in the DCT domain; with the orthonormal DCT (an isometry: lengths, angles and inner products
are those of pixel space) the triangle can be built in pixel space with ``e2`` the inverse DCT of the frequency
direction, which is what this module does (the authors' ``torch_dct`` calls use ``norm=None``, a scaled
transform whose DC terms weigh sqrt(2) more; the paper's geometry is the isometric one).

Batched: one pipeline iteration is one plane for every sample with an adversarial point; every query of the
search is one masked oracle call for the samples still searching; ``alpha`` is per sample in the state. The DCT
helpers are shared: ``geoda.low_frequency_image`` (``simba.dct_matrix`` on the low frequencies, the same as
``ppba.idct2`` of the zero-padded block).

Norms: the triangle lives in L2. The blocks accept Linf too: the search is unchanged (it minimises the L2
distance) and success is judged in Linf; the shipped recipe offers L2 only (see its notes).

Defaults (Table V): ratio_mask 0.1, dim_num 1, max_iter_num_in_2d 2, plus_learning_rate 0.1,
minus_learning_rate 0.005, half_range 0.1, init_alpha pi/2 (see the recipe for the slip "2" and for
``init_theta``, which the authors' code never reads). Deviations: ``alpha`` is clamped to ``pi/2 +/- half_range``
after every update (the authors skip the clamp after a hit at the first search round, so it can drift above);
the square of frequencies has at least ``MIN_SIDE`` = 3 frequencies a side (CIFAR-10's own value; the authors'
``int(0.1 * side)`` is 0 below 10 pixels and their code fails) and ``dim_num`` at most its size; the start is
``decision.blended_start`` (uniform noise then a blend bisection; the authors: foolbox's linear blend search, 50
steps).
"""
import math

import torch

from ..registry import INIT, PERTURB
from .common import per_sample, rows_where
from .decision import blended_start, decision_state, known_dist, has_budget, query_adv
from .geoda import low_frequency_image

PAPER = ("Wang, Zhang, Tong, Gong, He, Li, Liu, Triangle Attack: A Query-efficient Decision-based Adversarial "
         "Attack, ECCV 2022")
PI = math.pi
MIN_SIDE = 3  # the low-frequency square has at least 3 frequencies a side (CIFAR-10's int(0.1 * 32))


def vertex(x, e1, e2, d, alpha, beta, side):
    """The third vertex of the triangle ``x``, ``x + d e1``, ``x_t`` with angle ``alpha`` at ``x_t`` and ``beta``
    at ``x``, on ``side`` (+1 / -1) of ``e1`` in the plane (e1, e2) (unit, orthogonal): by the law of sines
    ``||x_t - x|| = d sin(alpha + beta) / sin(alpha)``. Per-sample (n,) ``d``, ``alpha``, ``beta``, ``side``;
    not clipped."""
    length = d * torch.sin(alpha + beta) / torch.sin(alpha)
    a, b = length * torch.cos(beta), length * torch.sin(beta) * side
    return x + per_sample(a, x) * e1 + per_sample(b, x) * e2


def first_beta(alpha):
    """The authors' first ``beta``: just past ``pi - 2 alpha`` (where the vertex stops being closer)."""
    return torch.clamp(PI - 2 * alpha, min=0) + torch.clamp(alpha / 2, max=PI / 16)


def plane_direction(ctx, e1, ratio_mask, dim_num):
    """A unit direction orthogonal to ``e1`` (n, C, H, W) in the plane of ``e1`` and a random low-frequency
    image: ``dim_num`` distinct frequencies of every channel in the top-left ``int(ratio_mask * H)`` square of the
    orthonormal 2-D DCT (at least ``MIN_SIDE``), each with a N(0, 1) coefficient (the authors'
    ``get_orthogonal_1d_in_subspace``)."""
    n, c, h, w = e1.shape
    side = min(max(MIN_SIDE, int(min(h, w) * ratio_mask)), h, w)
    k = min(dim_num, side * side)
    pick = ctx.rng.uniform((c, side * side), dtype=torch.float64).argsort(-1)[..., :k]  # (n, c, k) distinct
    value = ctx.rng.normal((c, k)).to(e1.dtype)
    coeff = torch.zeros((n, c, side * side), dtype=e1.dtype, device=e1.device).scatter(2, pick, value)
    v = low_frequency_image(coeff.view(n, c, side, side), (c, h, w))
    v = v - per_sample((v * e1).flatten(1).sum(1), v) * e1
    return v / per_sample(v.flatten(1).norm(dim=1).clamp_min(1e-20), v)


@INIT.register("triangle_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"init_alpha": "(0, 3.14159)", "init_tries": "int [0, inf)"})
def triangle_init(ctx, *, init_alpha=PI / 2, init_tries=100):
    """``decision.blended_start`` (uniform noise up to ``init_tries`` draws, then the pool; a blend bisection
    towards ``x``); every sample's ``alpha`` starts at ``init_alpha`` (pi/2, the authors' value)."""
    problem = ctx.problem
    n, dev = problem.n, problem.x.device
    x_bd, found = blended_start(ctx, tries=init_tries)
    dist = known_dist(problem, x_bd, found)
    return decision_state(problem, x_bd, dist, alpha=torch.full((n,), init_alpha, dtype=torch.float64, device=dev))


@PERTURB.register("triangle", paper=PAPER, norms=("linf", "l2"), native_norms=("l2",),
                  ranges={"ratio_mask": "(0, 1]", "dim_num": "int [1, inf)", "max_iter_num_in_2d": "int [0, inf)",
                          "plus_learning_rate": "[0, inf)", "minus_learning_rate": "[0, inf)",
                          "half_range": "[0, 1.5]"})
def triangle(ctx, state, *, ratio_mask=0.1, dim_num=1, max_iter_num_in_2d=2, plus_learning_rate=0.1,
             minus_learning_rate=0.005, half_range=0.1):
    """One plane of the triangle search for every sample with an adversarial point (the authors'
    ``get_x_hat_in_2d``); returns the updated search state (``x_bd``, ``dist``, ``alpha``) for ``within_eps``.
    The triangle lives in L2; under Linf the search is the same and only success is judged in Linf."""
    problem = ctx.problem
    x, x_bd = problem.x, state["x_bd"]
    n, dev = problem.n, x.device
    lower, upper = PI / 2 - half_range, PI / 2 + half_range
    alpha = state["alpha"].clone()
    go = torch.isfinite(state["dist"]) & has_budget(ctx)
    diff = (x_bd - x).to(torch.float64)
    d = diff.flatten(1).norm(dim=1)
    go &= d > 0
    e1 = (diff / per_sample(d.clamp_min(1e-30), diff)).to(x.dtype)
    if bool(go.all()):
        e2 = plane_direction(ctx, e1, ratio_mask, dim_num)
    else:
        rows = go.nonzero().squeeze(1)
        e2 = torch.zeros_like(e1).index_put((rows,), plane_direction(ctx.sub(rows), e1[rows], ratio_mask, dim_num))

    x_hat = x_bd.clone()
    found = torch.zeros(n, dtype=torch.bool, device=dev)   # a closer adversarial vertex was seen this plane
    done = torch.zeros_like(found)                           # the search of the plane is over
    side = torch.ones(n, dtype=torch.float64, device=dev)
    d32 = d.to(x.dtype)

    def ask(live, beta):
        """Query the vertices at ``beta`` on ``side`` for the ``live`` samples -> (idx, adv, ok); hits go to
        ``x_hat``."""
        idx = live.nonzero().squeeze(1)
        cand = vertex(x[idx], e1[idx], e2[idx], d32[idx], alpha[idx].to(x.dtype), beta[idx].to(x.dtype),
                      side[idx].to(x.dtype)).clamp(0.0, 1.0)
        adv, ok = query_adv(ctx, cand, idx)
        x_hat[idx[adv]] = cand[adv]
        return idx, adv, ok

    def miss(mask):
        alpha[mask] = torch.clamp(alpha[mask] - minus_learning_rate, min=lower)

    def hit(mask):
        alpha[mask] = torch.clamp(alpha[mask] + plus_learning_rate, max=upper)

    def flag(idx, values):
        m = torch.zeros(n, dtype=torch.bool, device=dev)
        m[idx[values]] = True
        return m

    # the first vertex on each side of the plane
    beta = first_beta(alpha)
    right = PI - alpha
    live = go.clone()
    for s in (1.0, -1.0):
        if not bool(live.any()):
            break
        side[live] = s
        idx, adv, ok = ask(live, beta)
        found |= flag(idx, adv)
        failed = flag(idx, ok & ~adv)
        miss(failed)
        done |= flag(idx, ~ok)
        if s > 0:
            beta = torch.where(failed, torch.maximum(beta, PI - 2 * alpha + PI / 64), beta)
        else:
            done |= failed  # neither side: the plane is given up
        live = failed & ~done
    left = beta.clone()

    # search beta upwards between the hit (left) and pi - alpha (right), both sides each round
    beta = (left + right) / 2
    live = found & ~done
    for _ in range(max_iter_num_in_2d):
        if not bool((live & has_budget(ctx)).any()):
            break
        idx, adv, ok = ask(live, beta)
        hit(flag(idx, adv))
        done |= flag(idx, adv | ~ok)
        failed = flag(idx, ok & ~adv)
        miss(failed)
        beta = torch.where(failed, torch.maximum(beta, PI - 2 * alpha + PI / 64), beta)
        side = torch.where(failed, -side, side)
        if bool(failed.any()):
            idx, adv, ok = ask(failed, beta)
            hit(flag(idx, adv))
            done |= flag(idx, adv | ~ok)
            again = flag(idx, ok & ~adv)
            miss(again)
            left = torch.where(again, first_beta(alpha), left)
            right = torch.where(again, beta, right)
        live = found & ~done
        beta = torch.where(live, (left + right) / 2, beta)
    hit(found & ~done)  # the search rounds ran out: the plane's first hit stands
    return dict(x_bd=rows_where(found, x_hat, x_bd), dist=torch.where(found, problem.dist(x_hat), state["dist"]),
                alpha=alpha)
