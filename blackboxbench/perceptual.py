"""Perceptual cost of an adversarial image: SSIM and LPIPS per sample, on [0, 1] NCHW tensors.

* SSIM: Wang et al. 2004 (IEEE TIP), as the detection benchmark's spec fixes it (``shared/specs/detection.md``
  section 5): Gaussian window 11 x 11, sigma 1.5, K1 0.01, K2 0.03, data range 1, per channel over the valid
  region, averaged over channels. Computed by ``pytorch_msssim`` (maintained; valid-region convolution), not a
  hand copy. Images smaller than 11 px use the largest odd window that fits (the 8 x 8 digits: 7).
* LPIPS: Zhang et al. 2018, AlexNet trunk, linear heads v0.1 (the ``lpips`` package ships the heads). The trunk
  is torchvision's ImageNet AlexNet, which cannot be downloaded here: it is read from ``path`` or the torch hub
  cache (``alexnet-owt-7be5be79.pth``); when absent :func:`load_lpips` warns once and returns None, and the
  LPIPS column stays empty. ``random_trunk=True`` builds the metric with a random trunk (plumbing tests only:
  its values mean nothing).
"""
import warnings
from pathlib import Path

import torch

from .errors import BenchError

SSIM_WINDOW, SSIM_SIGMA, SSIM_K = 11, 1.5, (0.01, 0.03)
ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # torchvision AlexNet_Weights.IMAGENET1K_V1
# pixel values per SSIM or LPIPS call: SSIM's float64 maps hold about 15 times its images (at 299 x 299, 32 MB an
# image), so a batch is measured in pieces of about 2^22 values (15 images at 299 x 299; a CIFAR-10 batch of 1,365)
SSIM_VALUES = 1 << 22


def _pieces(x, ref):
    """``x`` and ``ref`` split alike into pieces of about ``SSIM_VALUES`` values (whole images, at least one)."""
    per = max(1, SSIM_VALUES // max(1, x[0].numel())) if len(x) else 1
    return zip(x.split(per), ref.split(per))


def ssim_window(h, w):
    """The SSIM window for an h x w image: 11, or the largest odd size that fits."""
    size = min(SSIM_WINDOW, h, w)
    return size if size % 2 else size - 1


def ssim(x, ref):
    """(N,) SSIM of each image of ``x`` against ``ref`` (same shape, values in [0, 1])."""
    from pytorch_msssim import ssim as _ssim

    if x.shape != ref.shape or x.dim() != 4:
        raise BenchError(f"ssim: need two (N, C, H, W) tensors of one shape, got {tuple(x.shape)} and "
                         f"{tuple(ref.shape)}")
    win = ssim_window(*x.shape[-2:])
    with torch.no_grad():
        parts = [_ssim(a.double(), b.double(), data_range=1.0, size_average=False, win_size=win,
                       win_sigma=SSIM_SIGMA, K=SSIM_K).float() for a, b in _pieces(x, ref)]
    return torch.cat(parts) if parts else x.new_zeros(0)


def alexnet_trunk_file(path=None):
    """The AlexNet trunk weights: ``path`` when given, else the torch hub cache's copy (may not exist)."""
    return Path(path).expanduser() if path else Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_FILE


def load_lpips(path=None, device="cpu", random_trunk=False):
    """The LPIPS (AlexNet, v0.1) metric module, or None (with one warning) when the trunk weights are absent."""
    import lpips

    file = alexnet_trunk_file(path)
    if not random_trunk and not file.is_file():
        if path:
            raise BenchError(f"lpips: trunk weights {file} not found")
        warnings.warn(f"LPIPS column left empty: the AlexNet trunk ({ALEXNET_FILE}) is not in {file.parent}; "
                      "put it there or set its path", stacklevel=1)  # one location: Python shows it once
        return None
    with warnings.catch_warnings():  # lpips calls torchvision's deprecated ``pretrained=`` argument
        warnings.simplefilter("ignore", UserWarning)
        net = lpips.LPIPS(net="alex", version="0.1", pnet_rand=True, verbose=False)
    if not random_trunk:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file raises anything
            raise BenchError(f"lpips: cannot read {file} ({type(e).__name__}): not torchvision's AlexNet state "
                             "dict") from None
        if not isinstance(state, dict):
            raise BenchError(f"lpips: {file} is not torchvision's AlexNet state dict")
        features = {k[len("features."):]: v for k, v in state.items() if isinstance(k, str) and
                    k.startswith("features.")}
        trunk = {f"slice{s}.{k}": v for k, v in features.items()
                 for s, (lo, hi) in enumerate(((0, 2), (2, 5), (5, 8), (8, 10), (10, 12)), 1)
                 if lo <= int(k.split(".")[0]) < hi}
        missing = net.net.load_state_dict(trunk, strict=False)
        if missing.missing_keys or missing.unexpected_keys or not trunk:
            raise BenchError(f"lpips: {file} is not torchvision's AlexNet state dict")
    return net.eval().requires_grad_(False).to(device)


def lpips_distance(net, x, ref):
    """(N,) LPIPS distance of each image of ``x`` to ``ref`` ([0, 1] inputs, mapped to [-1, 1] as LPIPS expects)."""
    with torch.no_grad():
        parts = [net(a.float() * 2 - 1, b.float() * 2 - 1).flatten().float() for a, b in _pieces(x, ref)]
    return torch.cat(parts) if parts else x.new_zeros(0)
