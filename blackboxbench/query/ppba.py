"""PPBA (Li, Ji, Liu, Liu, Zhong, Deng and Tian, "Projection & Probability-Driven Black-Box Attack", CVPR 2020),
batched over samples, plus the DCT helpers shared with BABIES.

Projection: the perturbation is ``A^T z`` with ``z`` in R^m (m = ``low_dim``) and the rows of the sensing matrix
``A`` the orthonormal 2-D DCT basis images of m low frequencies: the first m coordinates of a "strided" ordering
whose first band is the ``r`` = C f^2 lowest frequencies (the f x f top-left block of every channel, shuffled),
then bands of ``stride`` more (as SimBA-DCT's ordering). With Table VI's r = 2352 = 3 * 28^2 and low_dim 1500 the
subspace is a random 1500 of the 2352 lowest frequencies, exactly as the authors' code builds it (``order``
strided: the first ``LOW_DIM`` of ``block_order(.., 28, 7)``; ``order`` random: ``random.sample(range(R),
LOW_DIM)`` of the 3 x 28 x 28 block). As the rows are orthonormal, ``||A^T z||_2 = ||z||_2``.

Probability-driven random walk: every iteration draws ``n_samples`` moves ``u`` in {-1, 0, +1}^m, coordinate j
taking value v with probability proportional to ``eff[v, j] / (eff[v, j] + ineff[v, j])`` (counts of moves that
lowered / did not lower the loss, starting at 1), tries ``z + rho u`` (L2: rescaled into the ball ||z|| <= eps),
and moves to the best candidate if it lowers the margin. After an improvement the counts decay by ``mom`` and
add the improving (``eff``) and the other (``ineff``) moves; after a failure ``ineff`` adds the moves. Defaults
(BlackboxBench Table VI, all columns): low-dim 1500, mom 1, order strided, r 2352, n_samples 1, rho 0.01 (the
authors' argparse defaults; [0, 1] pixel units as in the authors' code, whose images are ``ToTensor`` outputs).

Norms. L2 is the method's own: the authors bound ``||z||_2`` (to 5 on ImageNet); here the bound is the threat
model's eps. Linf follows the port in Ma et al.'s MetaSimulator code (the code BlackboxBench's score attacks
derive from): the pixel perturbation is clipped to [-eps, eps] (``problem.project``) and z is not bounded.

Deviations: the loss is the CW margin of the log-probabilities (the authors use the logit margin clamped at 0:
the same ordering, and the same success test); the released code (and the MetaSimulator port) add the improving
moves to a temporary list (``effective_probability``) instead of the ``effective_number`` counts, so their success
counts never grow; this module updates the counts as the paper describes (raise after a success). The subspace
is drawn per sample (the authors draw one for the whole run).
"""
import math

import torch

from ..registry import ACCEPT, INIT, PERTURB
from .common import query_margin, rows_where, start_state
from .simba import dct_matrix, strided_band

PAPER = ("Li, Ji, Liu, Liu, Zhong, Deng and Tian, Projection & Probability-Driven Black-Box Attack, CVPR 2020")


# --------------------------------------------------------------------------- DCT helpers (shared with BABIES)
def strided_order(ctx, freq_dims, stride):
    """Per-sample "strided" orderings of the C*H*W DCT coordinates (coordinate = channel * H * W + u * W + v):
    the ``freq_dims`` x ``freq_dims`` low-frequency block of every channel first (shuffled), then each band of
    ``stride`` more frequencies (shuffled), as the authors' ``block_order``. (n, C*H*W) long."""
    n, c, h, w = ctx.problem.x.shape
    key = strided_band(h, w, freq_dims, stride, ctx.problem.x.device).repeat(c)
    return ctx.rng.permutations(c * h * w, key)


def idct2(coeff):
    """Inverse orthonormal 2-D DCT of coefficient images (..., H, W): ``D_H^T coeff D_W``, the sum of the DCT
    basis images (``simba.basis_images``) weighted by the coefficients."""
    h, w = coeff.shape[-2:]
    return dct_matrix(h, coeff.device).T.to(coeff.dtype) @ coeff @ dct_matrix(w, coeff.device).to(coeff.dtype)


def subspace_image(z, coords, shape):
    """``A^T z``: coefficients ``z`` (k, m) at DCT coordinates ``coords`` (k, m) -> pixel images (k, C, H, W)."""
    c, h, w = shape
    coeff = torch.zeros((z.shape[0], c * h * w), dtype=z.dtype, device=z.device).scatter(1, coords, z)
    return idct2(coeff.view(-1, c, h, w))


def side_of(r, channels):
    """The side f of the low-frequency block of ``r`` = C f^2 coordinates (28 for Table VI's 2352 and 3 channels)."""
    return max(1, math.isqrt(int(r) // channels))


# --------------------------------------------------------------------------- blocks
@INIT.register("ppba_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"low_dim": "int [1, inf)", "r": "int [1, inf)", "stride": "int [1, inf)"})
def ppba_init(ctx, *, low_dim=1500, r=2352, stride=7):
    """Start at the clean image (one query, z = 0) with a per-sample subspace of ``low_dim`` low frequencies.

    ``low_dim`` 1500, ``r`` 2352 (the low-frequency block: 3 x 28 x 28), order strided: Table VI; ``stride`` 7 is
    the authors' (and SimBA's, Table VI) band width. ``low_dim`` and the block are clamped to the image.
    """
    problem = ctx.problem
    n, c, h, w = problem.x.shape
    m = min(low_dim, c * h * w)
    coords = strided_order(ctx, side_of(r, c), stride)[:, :m]
    kw = dict(dtype=problem.x.dtype, device=problem.x.device)
    ones = torch.ones((n, 3, m), **kw)
    return start_state(ctx, problem.x.clone(), coords=coords, z=torch.zeros((n, m), **kw), eff=ones,
                       ineff=ones.clone())


def move_probabilities(eff, ineff):
    """(..., 3, m) probabilities of the values -1, 0, +1 of every coordinate: ``eff / (eff + ineff)`` normalised
    over the three values (the authors' ``get_probability``)."""
    p = eff / (eff + ineff)
    return p / p.sum(-2, keepdim=True)


def draw_moves(p, uniform):
    """Moves in {-1, 0, +1} from probabilities ``p`` (n, 3, m) and uniforms ``uniform`` (n, S, m): -1 below
    p[-1], +1 at or above p[-1] + p[0], else 0 (the authors' thresholds)."""
    p_minus, p_zero = p[:, None, 0], p[:, None, 1]
    return (uniform >= p_minus + p_zero).to(uniform.dtype) - (uniform < p_minus).to(uniform.dtype)


@PERTURB.register("ppba", paper=PAPER, norms=("linf", "l2"),
                  ranges={"rho": "(0, inf)", "n_samples": "int [1, inf)"})
def ppba(ctx, state, *, rho=0.01, n_samples=1):
    """``n_samples`` candidates ``z + rho u`` per sample, u drawn from the move probabilities (L2: z rescaled into
    the eps ball), as images ``project(x + A^T z)``. ``rho`` 0.01, ``n_samples`` 1: Table VI."""
    problem = ctx.problem
    n, m = state["z"].shape
    shape = problem.x.shape[1:]
    uniform = ctx.rng.uniform((n_samples, m)).to(state["z"].dtype)
    u = draw_moves(move_probabilities(state["eff"], state["ineff"]), uniform)
    z = state["z"][:, None] + rho * u
    if problem.norm == "l2":
        z = z * (problem.eps / z.norm(dim=2, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
    z = z.flatten(0, 1)
    idx = torch.arange(n, device=z.device).repeat_interleave(n_samples)
    delta = subspace_image(z, state["coords"][idx], shape)
    images = problem.sub(idx).project(problem.x[idx] + delta)
    return {"images": images, "z": z.view(n, n_samples, m), "u": u}


@ACCEPT.register("ppba_accept", paper=PAPER, norms=("linf", "l2"), ranges={"mom": "[0, inf)"})
def ppba_accept(ctx, state, proposal, *, mom=1.0):
    """Query the candidates (one oracle call), move to the best one where it lowers the margin, and update the
    move counts (``mom`` 1: Table VI)."""
    state = dict(state)
    z, u, images = proposal["z"], proposal["u"], proposal["images"]
    n, s, m = z.shape
    if s == 1:
        margin, adv, _ = query_margin(ctx, images)
        margin, adv = margin[:, None], adv[:, None]
    else:
        margin, adv, _ = query_margin(ctx, images, torch.arange(n, device=z.device).repeat_interleave(s))
        margin, adv = margin.view(n, s), adv.view(n, s)
    best = margin.argmin(1)
    better = margin.gather(1, best[:, None]).squeeze(1) < state["margin"]
    worked = margin < state["margin"][:, None]  # (n, s); refused queries (+inf) never work
    values = torch.tensor([-1.0, 0.0, 1.0], device=u.device).view(1, 3, 1, 1)
    hits = u[:, None] == values  # (n, 3, s, m)
    good = (hits & worked[:, None, :, None]).sum(2).float()
    bad = (hits & ~worked[:, None, :, None]).sum(2).float()
    b = better[:, None, None]
    state["eff"] = torch.where(b, state["eff"] * mom + good, state["eff"])
    state["ineff"] = torch.where(b, state["ineff"] * mom + bad, state["ineff"] + bad)
    rows = torch.arange(n, device=z.device) * s + best
    state["z"] = rows_where(better, z.flatten(0, 1)[rows], state["z"])
    state["x_adv"] = rows_where(better, images[rows], state["x_adv"])
    state["margin"] = torch.where(better, margin.gather(1, best[:, None]).squeeze(1), state["margin"])
    state["success"] = torch.where(better, adv.gather(1, best[:, None]).squeeze(1), state["success"])
    return state
