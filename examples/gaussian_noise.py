"""Example plugin: a new input-transformation block, registered without editing the package.

Use it from a config with ``plugins: [../examples/gaussian_noise.py]`` (paths are relative to the config file)
and name it in a recipe's ``transform`` list (see configs/plugin_example.yaml).
"""
import torch

from blackboxbench.registry import TRANSFORM


@TRANSFORM.register("gaussian_noise", paper="example plugin")
def gaussian_noise(x, gen, *, std=0.05):
    """Add Gaussian noise (drawn from the run's generator) before the surrogate sees the image."""
    noise = torch.randn(x.shape, generator=gen, device=gen.device).to(x.device)
    return (x + std * noise).clamp(0, 1)
