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
  to ``H x W`` (the authors' ``resize_generator.py`` uses ``skimage.transform.resize``, order 1; this is
  ``F.interpolate(..., "bilinear", align_corners=False)``, the same pixel-centre mapping, edges clamped).
"""
import torch
import torch.nn.functional as F

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


@probe_generator("resize")
def resize(ctx, owner, shape, norm, factor):
    """QEBA-S: a low-resolution Gaussian image per channel, bilinearly upsampled."""
    c, h, w = shape
    small = ctx.rng.normal((c, reduced(h, factor), reduced(w, factor)), rows=owner)
    return F.interpolate(small, size=(h, w), mode="bilinear", align_corners=False)
