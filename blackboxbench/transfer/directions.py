"""Update-direction blocks of the transfer pipeline: ``fn(ctx, grad, state, **params) -> direction``."""
from ..registry import DIRECTION
from ..threat import per_sample


@DIRECTION.register("momentum", paper="Dong et al., Boosting Adversarial Attacks with Momentum (MI-FGSM), "
                                      "CVPR 2018", norms=("linf", "l2"), ranges={"decay": "[0, inf)"},
                    conflicts=("direction:momentum",),
                    conflict_reason="one momentum state per attack: list the momentum direction once")
def momentum(ctx, grad, state, *, decay=1.0, normalize=True):
    """MI-FGSM: ``g <- decay * g + grad / mean(|grad|)`` per sample, with ``g_0 = 0`` (Dong et al. Alg. 1).

    The paper divides by the L1 norm; the mean of |grad| (the reference implementation's choice) differs from it
    by the constant pixel count, which leaves the direction unchanged. ``decay`` 1.0: Table VII.
    ``normalize: false`` accumulates the raw gradient, as BlackboxBench's code does with its ``max_logit`` loss
    (spec sheet 10.14; the recipes keep Dong et al.'s normalization).
    """
    scale = per_sample(grad.abs().flatten(1).mean(1).clamp_min(1e-12), grad) if normalize else 1.0
    g = grad / scale
    if "momentum" in state:
        g = g + decay * state["momentum"]
    state["momentum"] = g
    return g
