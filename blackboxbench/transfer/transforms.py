"""Input-transformation blocks of the transfer pipeline: ``fn(x, gen, **params) -> x'``.

Each transform is split kornia-style into ``draw_*`` (all random parameters of one call, from ``gen``) and
``apply_*`` (deterministic given those parameters), so a call can be replayed exactly.
"""
import torch
import torch.nn.functional as F

from ..errors import BenchError
from ..registry import TRANSFORM


def _place(img, top, left, out_hw):
    """Put each image of ``img`` (n, C, h, w) on a zero canvas ``out_hw`` at its own offset (top[i], left[i])."""
    n, c, h, w = img.shape
    oh, ow = out_hw
    rows = torch.arange(oh, device=img.device) - top.to(img.device)[:, None]     # (n, oh): source row or outside
    cols = torch.arange(ow, device=img.device) - left.to(img.device)[:, None]    # (n, ow)
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    idx = rows.clamp(0, h - 1)[:, :, None] * w + cols.clamp(0, w - 1)[:, None, :]
    out = img.flatten(2).gather(2, idx.flatten(1)[:, None].expand(n, c, oh * ow)).view(n, c, oh, ow)
    return out * inside[:, None].to(img.dtype)


def draw_di(shape, gen, *, resize_rate=1.25, prob=0.5):
    """Random parameters of one DI call for a batch of ``shape`` (n, C, H, W).

    One resized size per call, uniform in [H, round(H * resize_rate)) (as the authors' code; the width scales
    with it), per-sample padding offsets, and a per-sample coin: the sample is transformed with probability
    ``prob``.
    """
    n, _, h, w = shape
    out_h, out_w = round(h * resize_rate), round(w * resize_rate)
    if out_h <= h or not 0.0 <= prob <= 1.0:
        raise BenchError(f"transform 'di': need resize_rate > 1 (got {resize_rate}, image height {h}) and "
                         f"prob in [0, 1] (got {prob})")
    size_h = int(torch.randint(h, out_h, (1,), generator=gen, device=gen.device))
    size_w = min(round(size_h * w / h), out_w)
    top = torch.randint(0, out_h - size_h + 1, (n,), generator=gen, device=gen.device)
    left = torch.randint(0, out_w - size_w + 1, (n,), generator=gen, device=gen.device)
    apply = torch.rand(n, generator=gen, device=gen.device) < prob
    return {"size": (size_h, size_w), "out": (out_h, out_w), "top": top, "left": left, "apply": apply}


def apply_di(x, params):
    """Nearest-resize to ``size``, zero-pad to ``out`` at the drawn offsets, nearest-resize back to the input size
    (as BlackboxBench's DI, so any model input size works); samples whose coin is off pass unchanged."""
    small = F.interpolate(x, size=params["size"], mode="nearest")
    padded = _place(small, params["top"], params["left"], params["out"])
    back = F.interpolate(padded, size=x.shape[-2:], mode="nearest")
    return torch.where(params["apply"].to(x.device).view(-1, 1, 1, 1), back, x)


@TRANSFORM.register("di", paper="Xie et al., Improving Transferability of Adversarial Examples with Input "
                                "Diversity (DI2-FGSM), CVPR 2019", norms=("linf", "l2"))
def di(x, gen, *, resize_rate=1.25, prob=0.5):
    """DI2-FGSM random resize-and-pad. Defaults: Table VII, CIFAR-10 (32 -> 40, i.e. resize_rate 1.25; p 0.5)."""
    return apply_di(x, draw_di(x.shape, gen, resize_rate=resize_rate, prob=prob))
