"""An example plugin: a new transfer input-transformation block, registered by a decorator and named in YAML
(see configs/plugin_example.yaml)."""
from blackboxbench.registry import TRANSFORM


@TRANSFORM.register("gaussian_noise", paper="example plugin", ranges={"std": "[0, inf)"})
def gaussian_noise(ctx, x, *, std=0.05):
    """Add Gaussian noise before the surrogate sees the image; each sample draws from its own stream
    (``ctx.rng``), one row per stacked copy."""
    noise = ctx.rng.normal(x.shape[1:], rows=ctx.rows(x.shape[0])).to(x)
    return (x + std * noise).clamp(0, 1)
