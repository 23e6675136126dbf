"""Losses of the transfer pipeline: ``fn(ctx, logits, label) -> (N,)``, a per-sample loss to *maximize*.

``label`` is the true class when untargeted and the target class when targeted (the pipeline passes the right
one); ``ctx.problem.targeted`` says which. BlackboxBench uses cross-entropy for CIFAR-10 in both settings (released CIFAR-10 configs) and the logit
loss of Zhao et al. for its ImageNet targeted runs (Supp. D).
"""
import torch.nn.functional as F

from ..registry import LOSS
from ..threat import margin_loss


@LOSS.register("ce", paper="cross-entropy (Kurakin et al. 2017; Alg. 3)", norms=("linf", "l2"))
def ce(ctx, logits, label):
    """Untargeted: CE(logits, y) (push away from y). Targeted: -CE(logits, t) (pull towards t)."""
    loss = F.cross_entropy(logits, label, reduction="none")
    return -loss if ctx.problem.targeted else loss


@LOSS.register("cw", paper="Carlini & Wagner, S&P 2017 (margin loss)", norms=("linf", "l2"))
def cw(ctx, logits, label):
    """Logit margin, unclamped (no confidence kappa) so the step keeps pushing past the boundary.

    Untargeted: max_{j != y} z_j - z_y. Targeted: z_t - max_{j != t} z_j. Positive means adversarial.
    """
    return -margin_loss(logits, label, label if ctx.problem.targeted else None)


@LOSS.register("logit", paper="Zhao et al., On Success and Simplicity: A Second Look at Transferable "
                              "Targeted Attacks, NeurIPS 2021", norms=("linf", "l2"))
def logit(ctx, logits, label):
    """Targeted: the target logit z_t. Untargeted: -z_y (the reference's ``max_logit`` loss)."""
    z = logits.gather(1, label[:, None]).squeeze(1)
    return z if ctx.problem.targeted else -z


@LOSS.register("by_goal", paper="BlackboxBench Supp. D-B and its released json_files sweeps: cross-entropy "
                                "untargeted, the logit loss (Zhao et al., NeurIPS 2021) targeted",
               norms=("linf", "l2"), block_params=("untargeted", "targeted"))
def by_goal(ctx, logits, label, *, untargeted="ce", targeted="logit"):
    """The loss ``untargeted`` or ``targeted`` (any registered loss, a plugin's too; checked when the attack is
    built) by the problem's goal.

    Defaults: what the paper's CIFAR-10 runs used (spec sheet sections 0 and 10.2): CE untargeted, ``logit``
    (``max_logit`` in the authors' code) targeted."""
    return LOSS.get(targeted if ctx.problem.targeted else untargeted)(ctx, logits, label)
