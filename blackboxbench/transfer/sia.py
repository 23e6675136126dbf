"""SIA, the structure invariant transformation (Wang, Zhang & Zhang, ICCV 2023), as a transform block.

Each copy of an image is cut into an ``n_block`` x ``n_block`` grid at random cut points, and every block gets one
of ten operations drawn uniformly: vertical / horizontal shift (a roll inside the block), vertical / horizontal
flip, rotation by 180 degrees, scaling by U[0, 1], resizing to 0.8 and back (bilinear), uniform noise in
[-16/255, 16/255] (clipped to [0, 1]), a DCT low-pass (the top 40 % of the frequency indices of each axis zeroed)
and channel dropout (p 0.1, kept channels scaled by 1/0.9), as the authors' code.

Batched without a loop over blocks: the shifts, flips and rotation are one gather by a per-pixel source index, the
resize and the DCT low-pass are separable linear maps, block-diagonal over each row's bands, applied as
``A @ x @ B^T``; every pixel then takes the output of its block's operation. ``draw_sia`` draws every random
number of one call from the samples' streams, ``apply_sia`` is deterministic given them (kornia style).
"""
import functools
import math

import torch
import torch.nn.functional as F

from ..errors import BenchError
from ..registry import TRANSFORM

OPS = ("vshift", "hshift", "vflip", "hflip", "rot180", "scale", "resize", "noise", "dct", "dropout")
OP = {name: i for i, name in enumerate(OPS)}
NOISE = 16 / 255
DROP = 0.1
RESIZE = 0.8
LOW_PASS = 0.4


def resize_matrix(s):
    """(s, s) float64: bilinear resize (align_corners False) of a length-s signal to int(0.8 s) + 1 and back."""
    t = int(s * RESIZE) + 1
    eye = torch.eye(s, dtype=torch.float64)[:, None]
    down = F.interpolate(eye, size=t, mode="linear", align_corners=False)[:, 0].T      # (t, s)
    up = F.interpolate(torch.eye(t, dtype=torch.float64)[:, None], size=s, mode="linear",
                       align_corners=False)[:, 0].T                                   # (s, t)
    return up @ down


def dct_matrix(s):
    """(s, s) float64 orthonormal DCT-II."""
    k = torch.arange(s, dtype=torch.float64)[:, None]
    i = torch.arange(s, dtype=torch.float64)[None]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * s)) * math.sqrt(2 / s)
    d[0] /= math.sqrt(2)
    return d


def lowpass_matrix(s):
    """(s, s) float64: DCT, zero the last int(0.4 s) coefficients, inverse DCT (the authors' ``dct`` op per
    axis; their slice ``[-0:]`` would zero a whole block of side 1 or 2, here nothing is cut there)."""
    d = dct_matrix(s)
    keep = torch.ones(s, dtype=torch.float64)
    cut = int(s * LOW_PASS)
    if cut:
        keep[-cut:] = 0
    return d.T @ (keep[:, None] * d)


@functools.lru_cache(maxsize=8)
def band_table(n, kind):
    """(n + 1, n, n) float64: ``[s, :s, :s]`` is the per-axis matrix of ``kind`` for a band of length ``s``."""
    fn = {"resize": resize_matrix, "dct": lowpass_matrix}[kind]
    table = torch.zeros(n + 1, n, n, dtype=torch.float64)
    for s in range(1, n + 1):
        table[s, :s, :s] = fn(s)
    return table


@functools.lru_cache(maxsize=16)
def _band_table_on(n, kind, device):
    """:func:`band_table` on ``device`` (copied there once)."""
    return band_table(n, kind).to(device)


def _cuts(u, size, n_block):
    """(M, n_block + 1) cut points 0 < c_1 < ... < c_{n-1} < size, distinct, uniform (the first n_block - 1 of a
    random permutation of 1 .. size - 1, sorted), from (M, size - 1) uniforms."""
    inner = (u.argsort(dim=1, stable=True)[:, :n_block - 1] + 1).sort(dim=1).values
    m = u.shape[0]
    return torch.cat([torch.zeros(m, 1, dtype=torch.long, device=u.device), inner,
                      torch.full((m, 1), size, dtype=torch.long, device=u.device)], 1)


def draw_sia(ctx, shape, *, n_block=3, copies=10):
    """Random parameters of one SIA call on ``shape`` (m, C, H, W), m a multiple of the samples in ``ctx``: the
    output stacks ``copies`` copies (copy k in rows k*m ...), each row drawing from its sample's stream."""
    m, c, h, w = shape
    if not 2 <= n_block <= min(h, w):
        raise BenchError(f"transform 'sia': n_block must be in [2, {min(h, w)}] for {h}x{w} images, got {n_block}")
    big = m * copies
    nb2 = n_block * n_block
    parts = {"rcut": h - 1, "ccut": w - 1, "op": nb2, "vstep": nb2, "hstep": nb2, "scale": nb2, "drop": c * nb2,
             "noise": c * h * w}
    u = ctx.rng.uniform((sum(parts.values()),), rows=ctx.rows(big)).double()  # on the streams' device
    p, i = {}, 0
    for key, width in parts.items():
        p[key] = u[:, i:i + width]
        i += width
    rcut, ccut = _cuts(p["rcut"], h, n_block), _cuts(p["ccut"], w, n_block)
    bh = (rcut[:, 1:] - rcut[:, :-1])[:, :, None].expand(big, n_block, n_block).reshape(big, nb2)
    bw = (ccut[:, 1:] - ccut[:, :-1])[:, None, :].expand(big, n_block, n_block).reshape(big, nb2)
    return {"n_block": n_block, "copies": copies, "rcut": rcut, "ccut": ccut,
            "op": (p["op"] * len(OPS)).long().clamp(max=len(OPS) - 1),
            "vstep": (p["vstep"] * bh).long(), "hstep": (p["hstep"] * bw).long(),
            "scale": p["scale"].float(), "keep": (p["drop"] >= DROP).view(big, c, nb2),
            "noise": ((2 * p["noise"] - 1) * NOISE).float().view(big, c, h, w)}


def _bands(cut, size):
    """Per row and position along an axis: its band, the band's start and length, (M, size) each."""
    pos = torch.arange(size, device=cut.device)
    band = (cut[:, None, 1:-1] <= pos[None, :, None]).sum(-1)
    start = cut.gather(1, band)
    return band, start, cut.gather(1, band + 1) - start


def _block_diag(table, band, start, length):
    """(M, n, n): per row, the block-diagonal matrix with ``table[len]`` on each band."""
    n = band.shape[1]
    pos = torch.arange(n, device=band.device)
    li = (pos[None] - start)[:, :, None].expand(-1, n, n)
    lj = pos[None, None, :] - start[:, :, None]
    same = band[:, :, None] == band[:, None, :]
    s = length[:, :, None].expand(-1, n, n)
    zero = torch.zeros((), dtype=table.dtype, device=table.device)
    return torch.where(same, table[s, li, lj.clamp(0, n - 1)], zero)


def apply_sia(x, params):
    """The SIA copies of ``x`` (m rows) for ``params`` from :func:`draw_sia`: (copies * m, C, H, W)."""
    xs = x.repeat(params["copies"], 1, 1, 1)
    big, c, h, w = xs.shape
    nb, dev = params["n_block"], x.device
    params = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    rband, r0, rlen = _bands(params["rcut"], h)
    cband, c0, clen = _bands(params["ccut"], w)
    block = rband[:, :, None] * nb + cband[:, None, :]                            # (M, H, W)
    flat = block.flatten(1)
    op = params["op"].gather(1, flat).view(big, h, w)
    is_op = {name: op == OP[name] for name in OPS}
    rr = torch.arange(h, device=dev)[None, :, None].expand(big, h, w)
    cc = torch.arange(w, device=dev)[None, None, :].expand(big, h, w)
    r0p, rlp = r0[:, :, None].expand(big, h, w), rlen[:, :, None].expand(big, h, w)
    c0p, clp = c0[:, None, :].expand(big, h, w), clen[:, None, :].expand(big, h, w)
    vstep = params["vstep"].gather(1, flat).view(big, h, w)
    hstep = params["hstep"].gather(1, flat).view(big, h, w)
    src_r = torch.where(is_op["vshift"], r0p + (rr - r0p - vstep) % rlp, rr)
    src_r = torch.where(is_op["vflip"] | is_op["rot180"], 2 * r0p + rlp - 1 - rr, src_r)
    src_c = torch.where(is_op["hshift"], c0p + (cc - c0p - hstep) % clp, cc)
    src_c = torch.where(is_op["hflip"] | is_op["rot180"], 2 * c0p + clp - 1 - cc, src_c)
    idx = (src_r * w + src_c).flatten(1)
    out = xs.flatten(2).gather(2, idx[:, None].expand(big, c, h * w)).view(big, c, h, w)

    def per_pixel(v):  # per-block values (M, nb2) or (M, C, nb2) -> per pixel
        if v.dim() == 2:
            return v.gather(1, flat).view(big, 1, h, w)
        return v.gather(2, flat[:, None].expand(big, v.shape[1], h * w)).view(big, v.shape[1], h, w)

    def where(name, value, other):
        return torch.where(is_op[name][:, None], value, other)

    out = where("scale", out * per_pixel(params["scale"]).to(xs), out)
    out = where("noise", (xs + params["noise"].to(xs)).clamp(0, 1), out)
    out = where("dropout", xs * per_pixel(params["keep"]).to(xs) / (1 - DROP), out)
    for name, clamp in (("resize", True), ("dct", False)):
        a = _block_diag(_band_table_on(h, name, dev), rband, r0, rlen).to(xs)
        b = _block_diag(_band_table_on(w, name, dev), cband, c0, clen).to(xs)
        y = a[:, None] @ xs @ b[:, None].transpose(-1, -2)
        out = where(name, y.clamp(0, 1) if clamp else y, out)
    return out


@TRANSFORM.register("sia", paper="Wang, Zhang & Zhang, Structure Invariant Transformation for Better Adversarial "
                                 "Transferability (SIA), ICCV 2023", norms=("linf", "l2"),
                    ranges={"n_block": "int [2, inf)", "copies": "int [1, inf)"})
def sia(ctx, x, *, n_block=3, copies=10):
    """SIA: ``copies`` stacked structure-invariant copies of ``x`` (see the module). Defaults 3 x 3 blocks and 10
    copies: BlackboxBench's code (SIA is not in Table VII; Wang et al.: 3 and 20)."""
    return apply_sia(x, draw_sia(ctx, x.shape, n_block=n_block, copies=copies))
