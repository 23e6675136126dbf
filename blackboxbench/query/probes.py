"""Probe generators of HSJA-style boundary-gradient estimation (gap G8): where the random directions ``u_b`` of
the Monte-Carlo estimate ``sum_b phi(x + delta u_b) u_b`` come from.

A generator is a pure function ``fn(ctx, owner, shape, norm, factor) -> (m, *shape)`` registered with
:func:`probe_generator`: one raw (unnormalized) direction per row, row ``r`` belonging to local sample
``owner[r]`` and drawn from that sample's own stream (``ctx.rng``), so a sample's probes do not depend on the
batch it is attacked in. ``factor`` is the side reduction of a subspace generator (ignored by ``gaussian``; the
``qeba`` recipe uses 2: 16 x 16 per channel on CIFAR-10, see its ``defaults``).
:func:`~blackboxbench.query.hsja.estimate_direction` normalizes the directions, scales them by the probe size and
clips the probes to [0, 1]; the ``hsja`` perturb block picks a generator with its ``probes`` parameter.

* ``gaussian``: HopSkipJumpAttack's own probes (Chen et al. 2020): uniform in [-1, 1]^d for Linf, standard
  Gaussian for L2, over the full image space.
* ``dct``: QEBA-F (Li et al., CVPR 2020): the low-frequency ``int(H / factor) x int(W / factor)`` block of 2-D DCT
  coefficients of every channel, mapped to pixels by the inverse orthonormal DCT. As in the authors'
  ``dct_generator.py`` each channel's coefficient block is a random orthogonal matrix (the Q factor of a Gaussian
  matrix: its columns orthonormalized by Gram-Schmidt here, the rows when the block is wider than tall).
* ``resize``: QEBA-S: a Gaussian image of ``int(H / factor) x int(W / factor)`` per channel, bilinearly upsampled
  to ``H x W`` as the authors' ``resize_generator.py`` (``skimage.transform.resize``, order 1, its default mode
  ``reflect``): pixel-centre mapping (output pixel ``i`` reads coarse coordinate ``(i + 1/2) h / H - 1/2``) and,
  past the outer coarse pixel centres, the coarse image mirrored about its edge pixels (index -1 reads 1, h reads
  h - 2), so the outer ring of the probe mixes in its neighbour: ``(1, 0)`` of a 2 x 2 image of which only
  ``(0, 0)`` is 1 gives 0.5625 in every corner of the 4 x 4 probe. (Up to 2026-12-04 this clamped the edges,
  ``F.interpolate(..., align_corners=False)``, which copies the corner pixel: 1.0 there.)
"""
import torch

from ..errors import BenchError
from .ppba import idct2

PROBES = {}


def probe_generator(name):
    """Register a probe generator under ``name`` (a small decorator registry)."""

    def deco(fn):
        if name in PROBES:
            raise BenchError(f"duplicate probe generator '{name}'")
        PROBES[name] = fn
        return fn

    return deco


def draw_probes(name, ctx, owner, shape, norm, factor):
    """(m, *shape) raw directions of generator ``name`` for rows of local samples ``owner`` (m,)."""
    if name not in PROBES:
        raise BenchError(f"unknown probe generator '{name}' (known: {', '.join(sorted(PROBES))})")
    return PROBES[name](ctx, owner, tuple(shape), norm, factor)


def reduced(side, factor):
    """Side of the subspace of an image side ``side``: ``int(side / factor)`` (the authors' rule), at least 1."""
    return max(1, int(side / factor))


def orthonormal(a):
    """Orthonormalize the columns of the last two dims of ``a`` (..., r, k) (Gram-Schmidt, r >= k; the rows when
    r < k): the Q factor of a QR decomposition with a positive diagonal of R."""
    if a.shape[-2] < a.shape[-1]:
        return orthonormal(a.transpose(-1, -2)).transpose(-1, -2)
    cols = []
    for j in range(a.shape[-1]):
        v = a[..., j]
        for q in cols:
            v = v - (q * v).sum(-1, keepdim=True) * q
        cols.append(v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return torch.stack(cols, -1)


@probe_generator("gaussian")
def gaussian(ctx, owner, shape, norm, factor):
    """HSJA's probes: uniform in [-1, 1]^d (Linf) or standard Gaussian (L2)."""
    if norm == "linf":
        return ctx.rng.uniform(shape, rows=owner) * 2 - 1
    return ctx.rng.normal(shape, rows=owner)


@probe_generator("dct")
def dct(ctx, owner, shape, norm, factor):
    """QEBA-F: a random orthogonal low-frequency DCT block per channel, in pixel space."""
    c, h, w = shape
    fh, fw = reduced(h, factor), reduced(w, factor)
    block = orthonormal(ctx.rng.normal((c, fh, fw), rows=owner))
    coeff = block.new_zeros((owner.numel(), c, h, w))
    coeff[:, :, :fh, :fw] = block
    return idct2(coeff)


def upsample_weights(size, n, dtype=torch.float32, device=None):
    """(size, n) matrix of linear interpolation from ``n`` coarse pixels to ``size`` fine ones: pixel-centre
    mapping, coarse indices outside ``[0, n)`` mirrored about the edge pixels (skimage's ``reflect`` mode)."""
    src = (torch.arange(size, dtype=torch.float64) + 0.5) * (n / size) - 0.5
    lo = torch.floor(src)
    frac = src - lo
    lo = lo.long()

    def mirror(i):
        if n == 1:
            return torch.zeros_like(i)
        period = 2 * (n - 1)
        i = torch.remainder(i, period)
        return torch.where(i > n - 1, period - i, i)

    rows = torch.arange(size)
    mat = torch.zeros((size, n), dtype=torch.float64)
    mat.index_put_((rows, mirror(lo)), 1 - frac, accumulate=True)
    mat.index_put_((rows, mirror(lo + 1)), frac, accumulate=True)
    return mat.to(dtype=dtype, device=device)


def upsample(small, hw):
    """(..., h, w) -> (..., H, W): the authors' ``skimage.transform.resize(..., order=1)`` upsampling (see
    :func:`upsample_weights`)."""
    h, w = small.shape[-2:]
    wh = upsample_weights(hw[0], h, small.dtype, small.device)
    ww = upsample_weights(hw[1], w, small.dtype, small.device)
    return wh @ small @ ww.T


@probe_generator("resize")
def resize(ctx, owner, shape, norm, factor):
    """QEBA-S: a low-resolution Gaussian image per channel, bilinearly upsampled (edges mirrored, as skimage)."""
    c, h, w = shape
    small = ctx.rng.normal((c, reduced(h, factor), reduced(w, factor)), rows=owner)
    return upsample(small, (h, w))
