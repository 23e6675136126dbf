"""Input-transformation blocks of the transfer pipeline: ``fn(ctx, x, **params) -> x'``.

``x`` has ``K * n`` rows for the ``n`` samples of ``ctx`` (copy k in rows k*n .. (k+1)*n - 1) when an
earlier transform stacked copies. Each transform is split kornia-style into ``draw_*`` (all random parameters of
one call, from the samples' streams ``ctx.rng``) and ``apply_*`` (deterministic given those parameters), so a
call can be replayed exactly.
"""
import torch

from ..errors import BenchError
from ..registry import TRANSFORM


def nearest_index(dst, in_size, out_size):
    """Source index of each destination index of a nearest-neighbour resize from ``in_size`` to ``out_size``
    (per-row tensors), as ``F.interpolate(mode="nearest")`` computes it: ``floor(dst * (in / out))`` in float32,
    clamped to ``in - 1``."""
    scale = in_size.to(torch.float32) / out_size.to(torch.float32)
    src = torch.floor(dst.to(torch.float32) * scale).long()
    return torch.minimum(src, in_size - 1)


def draw_di(ctx, shape, *, resize_rate=1.25, prob=0.5):
    """Random parameters of one DI call for ``shape`` (m, C, H, W), m a multiple of the samples in ``ctx``.

    Per row, from its sample's stream: a resized height uniform in [H, round(H * resize_rate)], both ends included
    as the authors' DI (``randint(in_size, out_size + 1)``; Xie et al.'s code leaves the canvas size out), the width
    scaling with it, padding offsets uniform over the positions inside the canvas, and a coin: the row is
    transformed with probability ``prob``.
    """
    m, _, h, w = shape
    out_h, out_w = round(h * resize_rate), round(w * resize_rate)
    if out_h <= h or not 0.0 <= prob <= 1.0:
        raise BenchError(f"transform 'di': need resize_rate > 1 (got {resize_rate}, image height {h}) and "
                         f"prob in [0, 1] (got {prob})")
    u = ctx.rng.uniform((4,), rows=ctx.rows(m), dtype=torch.float64)
    size_h = h + (u[:, 0] * (out_h - h + 1)).long()
    size_w = torch.clamp(torch.round(size_h * (w / h)).long(), max=out_w)
    top = (u[:, 1] * (out_h - size_h + 1)).long()
    left = (u[:, 2] * (out_w - size_w + 1)).long()
    return {"size": (size_h, size_w), "out": (out_h, out_w), "top": top, "left": left, "apply": u[:, 3] < prob}


def _di_axis(n_out, size, top, out):
    """Per row: source index along one axis of the DI composite (resize to ``size``, pad to ``out`` at ``top``,
    resize back to ``n_out``) and whether it falls on the image (not the padding)."""
    dst = torch.arange(n_out, device=size.device)[None]
    canvas = nearest_index(dst, torch.full_like(size, out)[:, None], torch.full_like(size, n_out)[:, None])
    small = canvas - top[:, None]
    inside = (small >= 0) & (small < size[:, None])
    src = nearest_index(small.clamp(min=0), torch.full_like(size, n_out)[:, None], size[:, None])
    return src, inside


def apply_di(x, params):
    """Nearest-resize to each row's size, zero-pad to ``out`` at its offsets, nearest-resize back to the input size
    (as BlackboxBench's DI, so any model input size works), all rows at once by index maps; rows whose coin is off
    pass unchanged."""
    m, c, h, w = x.shape
    (size_h, size_w), (out_h, out_w) = params["size"], params["out"]
    dev = x.device
    r, r_in = _di_axis(h, size_h.to(dev), params["top"].to(dev), out_h)
    q, q_in = _di_axis(w, size_w.to(dev), params["left"].to(dev), out_w)
    idx = (r[:, :, None] * w + q[:, None, :]).flatten(1)
    out = x.flatten(2).gather(2, idx[:, None].expand(m, c, h * w)).view(m, c, h, w)
    out = out * (r_in[:, :, None] & q_in[:, None, :])[:, None].to(x.dtype)
    return torch.where(params["apply"].to(dev).view(-1, 1, 1, 1), out, x)


@TRANSFORM.register("di", paper="Xie et al., Improving Transferability of Adversarial Examples with Input "
                                "Diversity (DI2-FGSM), CVPR 2019", norms=("linf", "l2"),
                    ranges={"resize_rate": "(1, inf)", "prob": "[0, 1]"})
def di(ctx, x, *, resize_rate=1.25, prob=0.5):
    """DI2-FGSM random resize-and-pad. Defaults: Table VII, CIFAR-10 (32 -> 40, i.e. resize_rate 1.25; p 0.5).
    Each sample draws its own size (the authors draw one per batch), so a sample's result does not depend on
    its batch."""
    return apply_di(x, draw_di(ctx, x.shape, resize_rate=resize_rate, prob=prob))


@TRANSFORM.register("si", paper="Lin et al., Nesterov Accelerated Gradient and Scale Invariance for Adversarial "
                                "Attacks (SI-FGSM), ICLR 2020", norms=("linf", "l2"),
                    ranges={"copies": "int [1, inf)", "scale": "[1, inf)"})
def si(ctx, x, *, copies=3, scale=1.5):
    """Scale invariance: ``copies`` stacked copies ``x / scale**i``, i = 0 .. copies - 1 (copy i in rows
    i*m .. (i+1)*m - 1); the loss is summed over them (the authors average: the same direction). Defaults 3 copies,
    scale 1.5: Table VII, CIFAR-10 (ImageNet: 5 copies, scale 2). No randomness."""
    factors = scale ** -torch.arange(copies, dtype=torch.float64)
    return (x[None] * factors.to(x).view(-1, *([1] * x.dim()))).flatten(0, 1)


def draw_admix(ctx, m, *, n_samples=3):
    """Pool indices of the images mixed into ``m`` rows (m a multiple of the samples in ``ctx``): for each row,
    ``n_samples`` images drawn uniformly, from its sample's stream, among the pool images whose label differs from
    the sample's true label (Wang et al.: "images from other categories"); from the whole pool when there is none.
    Returns a (n_samples * m,) long tensor, mix j of row r at position j*m + r."""
    pool = ctx.pool
    if pool is None or len(pool.y) == 0:
        raise BenchError("transform 'admix': needs the attacker's image pool (ctx.pool), which is empty here")
    rows = ctx.rows(m)
    y = ctx.problem.y[rows].cpu()
    labels = pool.y.cpu().long()
    order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels, minlength=int(max(labels.max(), y.max())) + 1)
    start = torch.cumsum(counts, 0) - counts
    own, first = counts[y], start[y]
    others = len(labels) - own
    span = torch.where(others > 0, others, torch.full_like(others, len(labels)))
    u = ctx.rng.uniform((n_samples,), rows=rows, dtype=torch.float64).cpu()
    k = (u * span[:, None].double()).long()
    skip = (others > 0)[:, None] & (k >= first[:, None])  # jump over the block of the sample's own class
    pos = torch.where(skip, k + own[:, None], k)
    return order[pos].T.reshape(-1)


def apply_admix(x, pool_x, index, strength):
    """``x + strength * pool_x[index]``, x repeated once per mix (copy j in rows j*m ...)."""
    k = len(index) // x.shape[0]
    return x.repeat(k, 1, 1, 1) + strength * pool_x[index].to(x)


@TRANSFORM.register("admix", paper="Wang et al., Admix: Enhancing the Transferability of Adversarial Attacks, "
                                   "ICCV 2021", norms=("linf", "l2"),
                    ranges={"strength": "[0, inf)", "n_samples": "int [1, inf)"})
def admix(ctx, x, *, strength=0.2, n_samples=3):
    """Admix: ``n_samples`` stacked copies ``x + strength * x'``, each ``x'`` a clean pool image of another class
    (:func:`draw_admix`), drawn afresh at every call. List ``si`` after it for Wang et al.'s m1 x m2 copies.
    Defaults strength 0.2, 3 images: Table VII (both datasets). The authors' code mixes in other images of the
    current adversarial batch; drawing from the attacker's pool per sample keeps a sample's result independent
    of its batch (and works for a batch of one)."""
    index = draw_admix(ctx, x.shape[0], n_samples=n_samples)
    return apply_admix(x, ctx.pool.x, index, strength)


def draw_di_shrink(ctx, shape, *, resize_rate=0.9, prob=0.5):
    """Random parameters of one ``di_shrink`` call for ``shape`` (m, C, H, W): per row, from its sample's stream, a
    height uniform in [int(H * resize_rate), H) (the width scales with it), offsets uniform in [0, H - size) as
    torchattacks draws them, and a coin (transformed with probability ``prob``)."""
    m, _, h, w = shape
    lo = int(h * resize_rate)
    if not 0.0 < resize_rate < 1.0 or lo < 1 or not 0.0 <= prob <= 1.0:
        raise BenchError(f"transform 'di_shrink': need resize_rate in (0, 1) with int(H * resize_rate) >= 1 (got "
                         f"{resize_rate}, image height {h}) and prob in [0, 1] (got {prob})")
    u = ctx.rng.uniform((4,), rows=ctx.rows(m), dtype=torch.float64)
    size_h = lo + (u[:, 0] * (h - lo)).long()
    size_w = torch.clamp(torch.round(size_h * (w / h)).long(), max=w - 1)
    top = (u[:, 1] * (h - size_h)).long()
    left = (u[:, 2] * (w - size_w)).long()
    return {"size": (size_h, size_w), "top": top, "left": left, "apply": u[:, 3] < prob}


def _bilinear_matrix(n, size, offset, dtype):
    """Per row, the (n, n) matrix of a bilinear resize of ``n`` pixels to ``size`` placed at ``offset`` along one
    axis (zero outside ``[offset, offset + size)``). Source coordinates follow ``F.interpolate(mode="bilinear",
    align_corners=False)``: ``max((k + 0.5) n / size - 0.5, 0)``, between pixels ``floor`` and ``min(floor + 1,
    n - 1)``."""
    k = torch.arange(n, device=size.device, dtype=torch.float64)[None] - offset[:, None]
    inside = ((k >= 0) & (k < size[:, None])).to(torch.float64)
    src = ((k + 0.5) * (n / size[:, None].double()) - 0.5).clamp(min=0)
    i0 = src.floor().long().clamp(max=n - 1)
    w1 = src - i0
    mat = torch.zeros((size.numel(), n, n), dtype=torch.float64, device=size.device)
    mat.scatter_add_(2, i0[..., None], ((1 - w1) * inside)[..., None])
    mat.scatter_add_(2, (i0 + 1).clamp(max=n - 1)[..., None], (w1 * inside)[..., None])
    return mat.to(dtype)


def apply_di_shrink(x, params):
    """Bilinear resize of each row to its size, zero-padded at its offsets into the input's own canvas (no resize
    back); rows whose coin is off pass unchanged. The resize is separable: ``R_h x R_w^T`` with per-row (H, H) and
    (W, W) interpolation matrices, two batched matrix products (forward and backward of 64 CIFAR-10 images on 2 CPU
    threads: 4.2-4.5 ms, against 5.8-6.6 ms for one ``grid_sample``)."""
    m, _, h, w = x.shape
    dev = x.device
    (size_h, size_w), top, left = params["size"], params["top"].to(dev), params["left"].to(dev)
    apply = params["apply"].to(dev)
    eye_h, eye_w = torch.eye(h, dtype=x.dtype, device=dev), torch.eye(w, dtype=x.dtype, device=dev)
    rh = torch.where(apply.view(-1, 1, 1), _bilinear_matrix(h, size_h.to(dev), top, x.dtype), eye_h)
    rw = torch.where(apply.view(-1, 1, 1), _bilinear_matrix(w, size_w.to(dev), left, x.dtype), eye_w)
    c = x.shape[1]
    t = torch.bmm(rh, x.transpose(1, 2).reshape(m, h, c * w)).view(m, h * c, w)  # rows: (m, H, C W)
    return torch.bmm(t, rw.transpose(1, 2)).view(m, h, c, w).transpose(1, 2).contiguous()  # columns: (m, H C, W)


@TRANSFORM.register("di_shrink", paper="Xie et al., DI2-FGSM, CVPR 2019, as torchattacks' DIFGSM implements it "
                                       "(resize_rate < 1)", norms=("linf", "l2"),
                    ranges={"resize_rate": "(0, 1)", "prob": "[0, 1]"})
def di_shrink(ctx, x, *, resize_rate=0.9, prob=0.5):
    """Input diversity inside the input's own canvas: a bilinear shrink to [int(H * resize_rate), H), zero-padded
    back to H x W at a random offset, never resized back (torchattacks' DIFGSM at its default resize_rate 0.9, for
    side-by-side checks; the paper's DI is ``di``: a larger canvas, nearest resizes, resized back). Each sample
    draws its own size, offset and coin (torchattacks draws one per batch)."""
    return apply_di_shrink(x, draw_di_shrink(ctx, x.shape, resize_rate=resize_rate, prob=prob))
