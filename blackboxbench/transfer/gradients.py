"""Gradient-calculation blocks of the transfer pipeline: ``fn(ctx, grad_fn, x, state, **params) -> grad``.

``grad_fn(x)`` is the gradient of the summed loss on the transformed input (or of the gradient block listed
before this one).
"""
import torch
import torch.nn.functional as F

from ..errors import BenchError
from ..registry import GRADIENT


def gaussian_kernel(kernel_size, nsig=3.0):
    """The TI Gaussian kernel (kernel_size, kernel_size), summing to 1.

    As the authors' code (dongyp13/Translation-Invariant-Attacks ``gkern``) and BlackboxBench: samples of the
    standard normal density on ``linspace(-nsig, nsig, kernel_size)``, so the kernel radius ``(kernel_size-1)/2``
    spans ``nsig`` standard deviations: sigma = radius / nsig pixels.
    """
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise BenchError(f"gradient 'ti': kernel_size must be a positive odd integer, got {kernel_size}")
    if nsig <= 0:
        raise BenchError(f"gradient 'ti': nsig must be > 0, got {nsig}")
    t = torch.linspace(-nsig, nsig, kernel_size, dtype=torch.float64)
    k1 = torch.exp(-t ** 2 / 2)
    k2 = torch.outer(k1, k1)
    return k2 / k2.sum()


@GRADIENT.register("ti", paper="Dong et al., Evading Defenses to Transferable Adversarial Examples by "
                               "Translation-Invariant Attacks (TI-FGSM), CVPR 2019", norms=("linf", "l2"),
                   ranges={"kernel_size": "odd [1, inf)", "nsig": "(0, inf)"})
def ti(ctx, grad_fn, x, state, *, kernel_size=3, nsig=3.0):
    """TI: convolve the gradient, channel by channel, with a Gaussian kernel (zero 'same' padding).

    ``kernel_size`` 3: Table VII, CIFAR-10 (ImageNet: 5). ``nsig`` 3: the kernel of the authors' code and of
    BlackboxBench (see :func:`gaussian_kernel`); at kernel_size 3 it is nearly a delta (centre weight 0.957).
    ``nsig = 3 ** 0.5`` gives sigma = radius / sqrt(3).
    """
    grad = grad_fn(x)
    c = grad.shape[1]
    w = gaussian_kernel(kernel_size, nsig).to(grad).expand(c, 1, kernel_size, kernel_size)
    return F.conv2d(grad, w, padding=kernel_size // 2, groups=c)
