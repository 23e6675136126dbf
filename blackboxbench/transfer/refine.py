"""Surrogate-refinement blocks of the transfer pipeline: ``fn(ctx, models, **params) -> models``.

They run once per run, before any sample; ``ctx.rng`` is then a run-level stream (not a sample's), ``ctx.problem``
is None, and ``ctx.surrogates`` / ``ctx.assets`` are the run's.
"""
from torch import nn

from ..errors import BenchError
from ..registry import REFINE


class LogitEnsemble(nn.Module):
    """One model whose logits are the weighted sum of its members' logits (weights sum to 1)."""

    def __init__(self, models, weights):
        super().__init__()
        self.members = nn.ModuleList(models)
        self.weights = [float(w) for w in weights]

    def forward(self, x):
        return sum(w * m(x) for w, m in zip(self.weights, self.members))


@REFINE.register("logit_ensemble", paper="Liu et al., Delving into Transferable Adversarial Examples and "
                                         "Black-box Attacks, ICLR 2017; Dong et al., MI-FGSM, CVPR 2018 (ensemble "
                                         "in logits)", norms=("linf", "l2"), ranges={"weights": "list [0, inf)"})
def logit_ensemble(ctx, models, *, weights=None):
    """Fuse the surrogates by averaging their logits, ``l(x) = sum_i w_i l_i(x)`` (Dong et al. Eq. 7).

    ``weights`` default to equal (as BlackboxBench); given weights must be >= 0 and are normalized to sum 1.
    Returns a one-element list.
    """
    if not models:
        raise BenchError("refine 'logit_ensemble': no surrogate models")
    weights = [1.0] * len(models) if weights is None else [float(w) for w in weights]
    if len(weights) != len(models) or min(weights) < 0 or sum(weights) <= 0:
        raise BenchError(f"refine 'logit_ensemble': need {len(models)} non-negative weights with a positive sum, "
                         f"got {weights}")
    total = sum(weights)
    return [LogitEnsemble(models, [w / total for w in weights])]
