"""Square Attack (Andriushchenko et al., "Square Attack: a query-efficient black-box adversarial attack via
random search", ECCV 2020), Linf and L2, batched over samples.

Random search (paper Alg. 1): start from a vertex-like point of the eps ball, then every iteration change one
randomly placed square window of side ``s`` (Linf: set it to a random vertex per channel, Alg. 2; L2: move mass
into it with a pseudo-Gaussian "two bumps" pattern, Alg. 3), one query per iteration and sample, and keep the
candidate only if the margin loss drops (``margin_greedy``). ``s`` follows the paper's
piecewise-constant schedule of ``p`` (fraction of pixels changed), halved at iterations 10, 50, 200, 500, 1000,
2000, 4000, 6000, 8000 of a 10,000-query run and rescaled to other budgets as in the authors' code.
Default ``p_init`` 0.05: BlackboxBench Table VI.

Every window is drawn independently per sample (position, signs, orientation) and placed by broadcasting; the
iteration counter ``it`` is a per-sample tensor in the state, so any active subset can be attacked.

Deviations from the authors' code: L2 windows are placed per sample (theirs share one position per batch);
window corners are uniform over all positions that keep the window inside the image (theirs never touch the
last row/column); acceptance uses the margin loss also when targeted (theirs switch to cross-entropy), as
BlackboxBench's score attacks all use the CW margin.
"""
import functools

import torch

from ..errors import BenchError
from ..registry import INIT, PERTURB
from ..threat import quantize
from ..rng import bit_planes, unit_float64
from .common import corner_at, per_sample, side_range, start_state, window_index

PAPER = "Andriushchenko et al., Square Attack, ECCV 2020"
# Linf: vertices drawn per step (16 sign bits per channel of one draw). The authors redraw a vertex that leaves the
# window as it is until one changes it; the first of 16 that changes it has the same law, and all 16 leave it
# unchanged with probability 2^-16 when one channel of the window can change (8^-16 when all three can), in which
# case that step's query is spent on an unchanged image. One draw and no host sync per step instead of a loop.
VERTEX_TRIES = 16
# Iterations (of 10,000) after which p is halved (the authors' p_selection).
P_HALVINGS = (10, 50, 200, 500, 1000, 2000, 4000, 6000, 8000)


def _check_norm(problem, norm):
    if problem.norm != norm:
        raise BenchError(f"square_{norm} attacks the {norm} ball, got norm '{problem.norm}'")


def p_schedule(p_init, it, n_iters):
    """Fraction of pixels changed at per-sample iteration ``it`` (n,) of an ``n_iters`` run (authors' schedule,
    stated for 10,000 iterations and rescaled linearly; p returns to ``p_init`` past the end, as theirs does)."""
    scaled = torch.div(it * 10000, max(int(n_iters), 1), rounding_mode="floor")
    halvings = torch.bucketize(scaled, torch.tensor(P_HALVINGS, device=it.device))  # thresholds strictly below
    halvings = torch.where(scaled > 10000, torch.zeros_like(halvings), halvings)
    return p_init / 2.0 ** halvings.double()


def square_side(p, n_pixels, lo, hi):
    """Side of the square window covering a fraction ``p`` (n,) of the ``n_pixels`` pixels, rounded, clamped."""
    s = torch.round(torch.sqrt(p * n_pixels)).long()
    return s.clamp(min=lo, max=hi)


def side_schedule(p_init, it, n_iters, n_pixels, lo, hi):
    """``square_side(p_schedule(p_init, it, n_iters), n_pixels, lo, hi)`` by lookup: the side only changes where
    the schedule halves p, so it is one bucketize of ``it`` into those iterations (memoised per setting)."""
    starts, sides = _side_table(float(p_init), max(int(n_iters), 1), n_pixels, lo, hi, it.device)
    return sides[torch.bucketize(it, starts, right=True)]


@functools.lru_cache(maxsize=256)
def _side_table(p_init, n_iters, n_pixels, lo, hi, device):
    """The first iteration of each piece of the p schedule (where ``it * 10000 // n_iters`` first exceeds each
    halving point, then 10,000), and the window side of every piece."""
    marks = (*P_HALVINGS, 10000)
    starts = torch.tensor([-(-(t + 1) * n_iters // 10000) for t in marks], device=device)
    p = p_init / 2.0 ** torch.tensor([*range(len(P_HALVINGS) + 1), 0], dtype=torch.float64, device=device)
    return starts, square_side(p, n_pixels, lo, hi)


def _budget(ctx, n_iters):
    return ctx.oracle.max_queries if n_iters is None else n_iters


# --------------------------------------------------------------------------- Linf
@INIT.register("square_init_linf", paper=PAPER, norms=("linf",))
def square_init_linf(ctx):
    """Vertical stripes: every column of every channel gets +eps or -eps (the paper's Linf initialisation);
    one query.

    The two vertices of every pixel, ``x +- eps`` clipped to [0, 1], are on the uint8 grid (rounded towards
    ``x``, as the returned image will be), so every candidate is an image the attack can return as is and the
    pipeline's confirmation of a success needs no extra query. For eps on the grid (e.g. 8/255) this is the
    paper's attack exactly; otherwise it searches the radius floor(255 eps)/255 the output reaches.
    """
    problem = ctx.problem
    _check_norm(problem, "linf")
    _, c, _, w = problem.x.shape
    x_hi, x_lo = linf_vertices(problem.x, problem.eps)
    stripes = torch.where(ctx.rng.uniform((c, 1, w)) < 0.5, x_hi, x_lo)
    return linf_state(ctx, stripes, 0)


def linf_vertices(x, eps):
    """The two vertices ``x +- eps`` of the pixels ``x`` (any shape), clipped to [0, 1] and on the uint8 grid
    (rounded towards x): computed where they are needed (the whole image at the start, a window per step), so a
    slot holds no copy of them."""
    return tuple(quantize((x + sign * eps).clamp(0, 1), x) for sign in (1, -1))


def linf_state(ctx, x0, it):
    """The Linf Square state at ``x0`` (one query) and the p schedule's iteration ``it`` (every sample's first)."""
    return start_state(ctx, x0, it=torch.full((len(x0),), int(it), dtype=torch.long, device=x0.device))


@PERTURB.register("square_linf", paper=PAPER, norms=("linf",), ranges={"p_init": "(0, 1]", "n_iters": "int [1, inf)"})
def square_linf(ctx, state, *, p_init=0.05, n_iters=None):
    """Set one random s x s window per sample to a random vertex (+-eps per channel) of the Linf ball.

    ``p_init`` 0.05 (Table VI); ``n_iters`` is the length the p schedule is stretched to (None: the query budget,
    as the authors pass ``n_iters`` = budget). As in the authors' code a window that would not change the current
    image is redrawn: each step draws ``VERTEX_TRIES`` vertices at once and takes the first that changes the
    window. Candidates are on the uint8 grid (see :func:`square_init_linf`).
    """
    x, x_adv, it = ctx.problem.x, state["x_adv"], state["it"]
    n, c, h, w = x.shape
    s = side_schedule(p_init, it, _budget(ctx, n_iters), h * w, 1, min(h, w) - 1)
    b = ctx.rng.bits(2 + -(-VERTEX_TRIES * c // 64))  # one draw per step: the corner, then the vertices' signs
    idx = window_index(*corner_at(unit_float64(b[:, :2]), s, (h, w)), s, (c, h, w)).view(n, -1)  # channel-major
    flat = x_adv.reshape(n, -1)
    cur, clean = (v.reshape(n, -1).gather(1, idx).view(n, c, -1) for v in (flat, x))
    hi, lo = linf_vertices(clean, ctx.problem.eps)
    up = bit_planes(b[:, 2:], VERTEX_TRIES * c).view(n, VERTEX_TRIES, c)  # x + eps where up, else x - eps
    kept_hi, kept_lo = ((v == cur).all(2)[:, None] for v in (hi, lo))  # (n, 1, C): a channel's vertex as it is
    first = torch.where(up, kept_hi, kept_lo).all(2).logical_not_().byte().argmax(1)  # first that changes it
    up = up[torch.arange(n, device=up.device), first]
    cand = flat.scatter(1, idx, torch.where(up[..., None], hi, lo).view(n, -1)).view_as(x_adv)
    return {"x_adv": cand, "it": it + 1}


# --------------------------------------------------------------------------- L2
_TAIL = {}


def _inv_square_cumsum(k, device):
    """``T[m] = sum_{j<m} 1 / (j+1)^2`` for m = 0..k, cached per (k, device)."""
    key = (k, str(device))
    if key not in _TAIL:
        terms = 1.0 / torch.arange(1, k + 1, dtype=torch.float64, device=device) ** 2
        _TAIL[key] = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), terms.cumsum(0)]).float()
    return _TAIL[key]


def pseudo_gaussian_windows(top, left, size, transpose, size_hw, largest=None):
    """The paper's L2 window pattern (Alg. 3: two opposite-signed pseudo-Gaussian bumps), one per sample,
    placed at (``top``, ``left``) with side ``size`` (n,) and transposed where ``transpose`` (n,): (n, 1, H, W),
    unit L2 norm, zero outside the window. ``largest``: ``size.max()`` when the caller has it (else it is read).

    Each half (rows ``< s//2`` and the rest) is the authors' rectangle bump: pixel (i, j) of an x-by-y rectangle
    holds ``sum_{k >= d} 1/(k+1)^2`` over ``k < y//2 + 1``, ``d`` the Chebyshev distance to (x//2, y//2);
    each half is normalised, the lower one negated, and the whole normalised again.
    """
    h, w = size_hw
    dev = top.device
    # Every term is a function of one axis, so each is built on (n, H, 1) or (n, 1, W) and broadcast once: the
    # pattern's row coordinate a is the H axis (the W axis where transposed), its column coordinate b the other.
    r = torch.arange(h, device=dev)[None, :, None] - top[:, None, None]  # (n, H, 1)
    q = torch.arange(w, device=dev)[None, None, :] - left[:, None, None]  # (n, 1, W)
    flip = transpose[:, None, None]
    s = size[:, None, None]
    half = s // 2

    def row_term(a):  # distance term of the row coordinate: to the middle row of its half
        up = a < half
        return (torch.where(up, a, a - half) - torch.where(up, half, s - half) // 2).abs(), up

    def col_term(b):  # distance term of the column coordinate: to the middle column
        return (b - s // 2).abs()

    (row_r, up_r), (row_q, up_q) = row_term(r), row_term(q)
    d = torch.maximum(torch.where(flip, col_term(r), row_r), torch.where(flip, row_q, col_term(q)))
    upper = torch.where(flip, up_q, up_r)  # (n, H, W)
    inside = ((r >= 0) & (r < s)) & ((q >= 0) & (q < s))
    tail = _inv_square_cumsum((int(size.max()) if largest is None else largest) + 1, dev)
    k_max = s // 2 + 1
    val = (tail[k_max] - tail[d.clamp(max=tail.numel() - 1)]) * inside  # d is arbitrary outside the window
    norm_up = (val.square() * upper).flatten(1).sum(1).sqrt().clamp_min(1e-12)[:, None, None]
    norm_lo = (val.square() * ~upper).flatten(1).sum(1).sqrt().clamp_min(1e-12)[:, None, None]
    val = torch.where(upper, val / norm_up, -val / norm_lo)
    val = val / val.flatten(1).norm(dim=1).clamp_min(1e-12)[:, None, None]
    return val[:, None]


def _random_transpose(rng):
    return rng.uniform(()) > 0.5


@INIT.register("square_init_l2", paper=PAPER, norms=("l2",))
def square_init_l2(ctx):
    """A grid of (H//5)-sided windows, each holding the pseudo-Gaussian pattern with a random sign per channel
    (and random orientation), rescaled to L2 norm eps (authors' L2 initialisation; one query)."""
    problem = ctx.problem
    _check_norm(problem, "l2")
    x = problem.x
    n, c, h, w = x.shape
    delta = grid_patterns(ctx.rng, n, c, (h, w), x.device)
    delta = delta / per_sample(delta.flatten(1).norm(dim=1).clamp_min(1e-12), delta) * problem.eps
    return start_state(ctx, problem.project(x + delta),
                       it=torch.zeros(n, dtype=torch.long, device=x.device))


def grid_patterns(rng, n, c, size_hw, device):
    """The L2 initialisation's sum of patterns (n, C, H, W): cells of side s = H//5 from (H - 5 s)//2 on both axes
    (a cell past the image's edge keeps its visible part, normalised over it, as a window clipped by the image).
    The cells are the same for every sample, so each cell's pattern is built once in both orientations and only
    the orientation and the channel signs are drawn per sample (in the order of the loops below)."""
    h, w = size_hw
    s = max(h // 5, 1)
    start = (h - 5 * s) // 2
    delta = torch.zeros(n, c, h, w, device=device)
    zero = torch.zeros(2, dtype=torch.long, device=device)
    size = torch.full((2,), s, dtype=torch.long, device=device)
    orient = torch.tensor([False, True], device=device)
    for top in range(start, start + (h // s) * s, s):  # loop over grid cells, not samples
        for left in range(start, start + (w // s) * s, s):
            hh, ww = min(s, h - top), min(s, w - left)  # the visible part of the cell
            flip = _random_transpose(rng)
            signs = rng.signs((c, 1, 1))
            if hh <= 0 or ww <= 0:
                continue  # wholly outside: nothing to add (its draws are still made)
            both = pseudo_gaussian_windows(zero, zero, size, orient, (hh, ww))  # (2, 1, hh, ww)
            delta[:, :, top:top + hh, left:left + ww] += both[flip.long()] * signs
    return delta


@PERTURB.register("square_l2", paper=PAPER, norms=("l2",), ranges={"p_init": "(0, 1]", "n_iters": "int [1, inf)"})
def square_l2(ctx, state, *, p_init=0.05, n_iters=None):
    """Authors' L2 update: zero a second random window, refill the first with old perturbation plus a fresh
    pseudo-Gaussian pattern (random sign per channel) so that the total stays on the L2 sphere of radius eps.

    ``p_init`` 0.05 (Table VI); the side is at least 3 and odd; ``n_iters`` as in :func:`square_linf`. The draws
    (two corners, an orientation, a sign per channel: one draw of the sample's stream) are made here and applied
    by :func:`l2_window_step`.
    """
    x, x_adv, it = ctx.problem.x, state["x_adv"], state["it"]
    n, c, h, w = x.shape
    p = p_schedule(p_init, it, _budget(ctx, n_iters))
    s = square_side(p, h * w, 3, h * w)
    s = (s + (s % 2 == 0).long()).clamp(min=1, max=min(h, w) - 1)
    b = ctx.rng.bits(4 + -(-(1 + c) // 64))  # one draw per step: two corners, then the orientation and signs
    corner1, corner2 = (corner_at(unit_float64(b[:, k:k + 2]), s, (h, w)) for k in (0, 2))
    flags = bit_planes(b[:, 4:], 1 + c)
    transpose, signs = flags[:, 0], torch.where(flags[:, 1:], 1.0, -1.0).view(n, c, 1, 1)
    return {"x_adv": l2_window_step(x, x_adv, ctx.problem.eps, s, corner1, corner2, transpose, signs),
            "it": it + 1}


def l2_window_step(x, x_adv, eps, size, corner1, corner2, transpose, signs):
    """One Square L2 candidate per sample, computed on its two windows only (gathered, (n, C, S, S), S the largest
    side): the pixels outside both windows are ``x_adv``'s, bit for bit.

    ``size`` (n,) the windows' side, ``corner1``/``corner2`` their (top, left), ``transpose`` (n,) the pattern's
    orientation, ``signs`` (n, C, 1, 1). Window 2 (less window 1) returns to ``x``; window 1 gets its old
    perturbation, normalised, plus the signed pattern, scaled so that the image's squared L2 perturbation is
    ``eps^2`` (the mass both windows held plus what the image lacked, shared equally by the channels); then
    [0, 1]. The authors' code renormalises the whole perturbation to ``eps`` after this; that factor is 1 (up to
    rounding) because the new window's mass already makes the total ``eps`` (the start lies in the ball), so it is
    left out here: that is what keeps the step local.
    """
    n, c, h, w = x.shape
    sides = side_range(size)  # the step's one host sync for its windows' shapes
    side = sides[1]
    flat_x, flat_adv = x.reshape(n, -1), x_adv.reshape(n, -1)
    idx1 = window_index(*corner1, size, (c, h, w), sides).view(n, -1)
    idx2 = window_index(*corner2, size, (c, h, w), sides).view(n, -1)
    ar = torch.arange(side, device=x.device)
    rows, cols = ar.view(1, 1, side, 1), ar.view(1, 1, 1, side)
    s = size.view(n, 1, 1, 1)
    real = (rows < s) & (cols < s)  # (n, 1, S, S): positions inside a sample's own side
    (t1, l1), (t2, l2) = ((t.view(n, 1, 1, 1), l.view(n, 1, 1, 1)) for t, l in (corner1, corner2))
    in1 = (t2 + rows >= t1) & (t2 + rows < t1 + s) & (l2 + cols >= l1) & (l2 + cols < l1 + s)
    x1, x2 = (flat_x.gather(1, i) for i in (idx1, idx2))
    d1 = (flat_adv.gather(1, idx1) - x1).view(n, c, side, side) * real
    d2 = (flat_adv.gather(1, idx2) - x2).view(n, c, side, side) * (real & ~in1)
    sq = lambda v: v.square().sum((2, 3), keepdim=True)  # noqa: E731  per sample and channel
    norm_win1 = sq(d1).sqrt()
    norm_both2 = sq(d1) + sq(d2)  # squared perturbation of both windows (their overlap counted once)
    norm_image = per_sample((flat_adv - flat_x).norm(dim=1), x)
    zero = torch.zeros_like(size)
    bump = pseudo_gaussian_windows(zero, zero, size, transpose, (side, side), side)
    new = bump * signs + d1 / (1e-10 + norm_win1)
    budget = ((eps ** 2 - norm_image.square()).clamp_min(0) / c + norm_both2).sqrt()
    new = new / sq(new).sqrt().clamp_min(1e-12) * budget
    vals = (x1.view_as(new) + new).clamp(0, 1)
    vals = torch.where(real, vals, vals[:, :, :1, :1])  # repeated positions carry the top-left pixel's value
    cand = flat_adv.scatter(1, idx2, x2).scatter_(1, idx1, vals.view(n, -1))
    return cand.view_as(x_adv)
