"""SimBA (Guo et al., "Simple Black-box Adversarial Attacks", ICML 2019): SimBA (pixel basis) and SimBA-DCT.

Each iteration takes the next direction ``q`` of a random ordering of an orthonormal basis and tries
``x - step * q`` then, only if that did not lower the loss, ``x + step * q`` (paper Alg. 1), keeping the first
that lowers it: 1 or 2 queries per iteration. Basis: SimBA, the pixel (standard) basis in a random order;
SimBA-DCT, the orthonormal 2-D DCT basis of the whole image (the authors' ``block_idct`` with block size = image
size), ordered "strided": the low-frequency ``freq_dims`` x ``freq_dims`` block first, then bands of ``stride``
more frequencies, each band shuffled over channels and positions (authors' ``block_order``). Table VI:
freq_dims 28, order strided, stride 7; ``step`` 0.2 is the authors' default ``--epsilon`` (step per iteration).

Deviations: the loss is the CW margin, as for every score attack of BlackboxBench (``attack_cifar10.py``:
``criterion = cw_loss``), not the paper's true-class probability, which saturates at 1.0 in float32 on confident
models so the attack never moves (SimBA-DCT Linf at 3,000 queries on 16 CIFAR-10 images: 11/16 fooled with the
probability, 15/16 with the margin); the ordering is drawn independently per sample (the authors share one per
batch); after the whole basis has been tried the ordering starts again (as BlackboxBench's SimBA does, so the
query budget can be used); ``freq_dims`` is clamped to the image size and the last band is cut at the border.

As in the authors' code the perturbation accumulates unclipped (state ``delta``, the pixel-space image of their
coefficient vector) and every query is its projection ``problem.project(x + delta)``, into the eps ball and
[0, 1] here (their ``linf_bound`` and [0, 1] clamp); accumulating the projected image instead gets stuck at the
Linf box (digits MLP, targeted, eps 0.2: 9/15 fooled instead of 12/15).
"""
import math

import torch

from ..registry import ACCEPT, INIT, PERTURB
from .common import greedy_update, merge_proposal, start_state

PAPER = "Guo et al., Simple Black-box Adversarial Attacks, ICML 2019"


def dct_matrix(n, device):
    """Orthonormal DCT-II matrix (n, n): row ``u`` is the ``u``-th cosine basis vector."""
    k = torch.arange(n, dtype=torch.float64, device=device)
    m = torch.cos(math.pi * (2 * k[None] + 1) * k[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m.float()


def strided_band(h, w, freq_dims, stride, device):
    """Band index of every frequency (u, v): 0 inside the top-left ``freq_dims`` block, then 1, 2, ... for each
    further ``stride`` rows/columns (authors' block_order), as an (h * w,) tensor."""
    f = min(freq_dims, h, w)
    u = torch.arange(h, device=device)[:, None]
    v = torch.arange(w, device=device)[None]
    level = torch.maximum(u, v)
    band = torch.where(level < f, torch.zeros_like(level), 1 + torch.div(level - f, stride, rounding_mode="floor"))
    return band.flatten()


def basis_images(coords, shape, dct):
    """Unit-norm basis images (n, C, H, W) for per-sample coordinate indices ``coords`` (n,) of a C*H*W basis:
    the pixel basis when ``dct`` is False, else the 2-D DCT basis (coordinate = channel, frequency u, v)."""
    c, h, w = shape
    n, dev = coords.shape[0], coords.device
    if not dct:
        return torch.nn.functional.one_hot(coords, c * h * w).float().view(n, c, h, w)
    ch, u, v = coords // (h * w), (coords // w) % h, coords % w
    img = dct_matrix(h, dev)[u][:, :, None] * dct_matrix(w, dev)[v][:, None, :]  # (n, H, W)
    return torch.nn.functional.one_hot(ch, c).float()[:, :, None, None] * img[:, None]


def _init(ctx, dct, freq_dims, stride):
    problem = ctx.problem
    n, c, h, w = problem.x.shape
    key = None
    if dct:
        key = strided_band(h, w, freq_dims, stride, problem.x.device).repeat(c)
    perm = ctx.rng.permutations(c * h * w, key)
    return start_state(ctx, problem.x.clone(), perm=perm, delta=torch.zeros_like(problem.x),
                       it=torch.zeros(n, dtype=torch.long, device=problem.x.device))


@INIT.register("simba_init_pixel", paper=PAPER, norms=("linf", "l2"))
def simba_init_pixel(ctx):
    """Start at the clean image (one query, ``delta`` 0) with a per-sample random ordering of the pixel basis."""
    return _init(ctx, False, 0, 1)


@INIT.register("simba_init_dct", paper=PAPER, norms=("linf", "l2"),
               ranges={"freq_dims": "int [1, inf)", "stride": "int [1, inf)"})
def simba_init_dct(ctx, *, freq_dims=28, stride=7):
    """Start at the clean image (one query, ``delta`` 0) with a per-sample strided ordering of the DCT basis.

    ``freq_dims`` 28 and ``stride`` 7: Table VI ("order strided"); freq_dims is clamped to the image size.
    """
    return _init(ctx, True, freq_dims, stride)


def _perturb(ctx, state, dct, step):
    delta, it, perm = state["delta"], state["it"], state["perm"]
    coords = perm.gather(1, (it % perm.shape[1])[:, None]).squeeze(1)
    move = step * basis_images(coords, delta.shape[1:], dct).to(delta.dtype)
    problem = ctx.problem
    return {"minus": problem.project(problem.x + delta - move), "plus": problem.project(problem.x + delta + move),
            "move": move, "it": it + 1}


@PERTURB.register("simba_pixel", paper=PAPER, norms=("linf", "l2"), ranges={"step": "(0, 1]"})
def simba_pixel(ctx, state, *, step=0.2):
    """Candidates ``x + delta -+ step * e_i`` (projected) for the next pixel ``e_i`` of each sample's ordering
    (``step`` 0.2: the authors' default)."""
    return _perturb(ctx, state, False, step)


@PERTURB.register("simba_dct", paper=PAPER, norms=("linf", "l2"), ranges={"step": "(0, inf)"})
def simba_dct(ctx, state, *, step=0.2):
    """Candidates ``x + delta -+ step * d_i`` (projected) for the next DCT basis image ``d_i`` of each sample's
    ordering (``step`` 0.2: the authors' default)."""
    return _perturb(ctx, state, True, step)


@ACCEPT.register("simba_greedy", paper=PAPER, norms=("linf", "l2"))
def simba_greedy(ctx, state, proposal):
    """Query the ``- step q`` candidate for every sample, then the ``+ step q`` one only where the first did not
    lower the margin (paper Alg. 1); keep whichever lowers it, and its move in ``delta``."""
    minus, state = merge_proposal(state, proposal, image_key="minus")
    move, delta = proposal["move"], state["delta"].clone()
    took = greedy_update(ctx, state, minus)
    delta[took] -= move[took]
    rest = (~took).nonzero().squeeze(1)
    if rest.numel():
        took = rest[greedy_update(ctx, state, proposal["plus"][rest], idx=rest)]
        delta[took] += move[took]
    state["delta"] = delta
    return state
