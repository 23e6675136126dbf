"""Gradient blocks that weigh the members of a surrogate ensemble against each other (spec sheet T23-T24): CWA
and AdaEA. The surrogates come fused by a refine block (:class:`~blackboxbench.transfer.refine.ModelSet`); each
member's gradient comes from ``ctx.grad_of(x, member)`` (with the recipe's input transformations). They compute
their gradient themselves: a gradient block listed before them is not applied, one listed after wraps them.
"""
import torch
import torch.nn.functional as F

from ..registry import GRADIENT
from ..threat import flat_norm, per_sample
from .refine import members
from .updates import STEPS


def _l2_unit(g):
    return g / per_sample(flat_norm(g, "l2").clamp_min(1e-12), g)


@GRADIENT.register("cwa", paper="Chen et al., Rethinking Model Ensemble in Transfer-based Adversarial Attacks "
                                "(CWA), ICLR 2024", norms=("linf", "l2"),
                   ranges={"reverse": "[0, inf)", "inner_step": "(0, inf)", "inner_decay": "[0, inf)",
                           "reset_every": "int [0, inf)"},
                   conflicts=("gradient:cwa",), conflict_reason="one inner-momentum state per attack")
def cwa(ctx, grad_fn, x, state, *, reverse=1 / 3, inner_step=50.0, inner_decay=1.0, reset_every=0):
    """Common Weakness Attack (MI-CWA): the outer direction ``x~ - x`` of one sharpness-aware pass over the
    ensemble, to be followed by the recipe's momentum and step.

    1. Reverse step (SAM): ``x~ = Clip(x - reverse * alpha * step(grad L_ens(x)))``, the ensemble's gradient
       without the input transformations (``ctx.raw_grad``, as the authors' code).
    2. For each member k in turn (cosine-similarity encourager): ``m <- inner_decay * m + g_k / ||g_k||_2``,
       ``x~ <- Clip(x~ + inner_step * m)``, with ``g_k`` the member's gradient at ``x~``. The inner momentum ``m``
       lives on across iterations (the authors' ``inner_momentum``); ``reset_every`` k > 0 zeroes it every k
       iterations (the paper's Fig. 19b remedy for long runs).

    Defaults (CWA is not in Table VII): ``reverse`` 1/3 of the step alpha, the ratio of both the authors'
    ``reverse_step_size = 16/255/15`` to their step ``16/255/5`` and BlackboxBench's ``reverse_step_size = 0.001`` to
    Table VII's CIFAR step 0.003; ``inner_step`` 50 (BlackboxBench's CIFAR value; the authors' ImageNet 250);
    decays 1 (both).
    """
    problem, models = ctx.problem, members(ctx.model)[0]
    step = STEPS[problem.norm]
    if "cwa_inner" not in state or (reset_every and ctx.t % reset_every == 0):
        state["cwa_inner"] = torch.zeros_like(x)
    m = state["cwa_inner"]
    xt = problem.project(step(x, -ctx.raw_grad(x), reverse * ctx.alpha)) if reverse > 0 else x
    for model in models:
        m = inner_decay * m + _l2_unit(ctx.grad_of(xt, model))
        xt = problem.project(xt + inner_step * m)
    state["cwa_inner"] = m
    return xt - x


def _goal_ce(problem, logits, rows):
    """Per-row cross-entropy of the attack's label (the true label untargeted, the target targeted); ``rows``:
    the local sample of each row."""
    label = problem.target if problem.targeted else problem.y
    return F.cross_entropy(logits, label[rows], reduction="none")


@GRADIENT.register("adaea", paper="Chen et al., An Adaptive Model Ensemble Adversarial Attack for Boosting "
                                  "Adversarial Transferability (AdaEA), ICCV 2023", norms=("linf", "l2"),
                   ranges={"beta": "[0, inf)", "threshold": "[-1, 1]"})
def adaea(ctx, grad_fn, x, state, *, beta=10.0, threshold=-0.3):
    """AdaEA: the gradient of the loss on adaptively weighted logits ``sum_k w_k l_k``, masked where the members'
    gradients disagree.

    * AGM (adaptive gradient modulation): each member k takes a tentative step ``x_k = Clip(x + alpha *
      step(g_k))``; its weight is ``softmax_k(beta * sum_{i != k} r_i(x_k))`` over the members, with ``r_i(x_k) =
      CE_i(x_k) / CE_i(x_i)`` untargeted (how much x_k raises member i's loss against i's own step) and its
      inverse targeted (how much it lowers the loss of the target class), as the authors' ``agm``. The weights
      are per sample (the authors' losses are batch means, which would tie a sample to its batch).
    * DRF (disparity-reduced filter): the cosine similarity of the members' gradients over the channels at each
      pixel, averaged over the pairs; pixels below ``threshold`` get a zero gradient.

    Defaults (AdaEA is not in Table VII): ``beta`` 10 and ``threshold`` -0.3, the authors' run defaults (their
    ``utils/args.py``, which overrides the base class's keyword 0; TransferAttack's the same); the paper tunes both
    per ensemble. The ``adaea`` recipe follows with the authors' momentum decay 0.9.
    """
    problem, models = ctx.problem, members(ctx.model)[0]
    k, n = len(models), problem.n
    grads = [ctx.grad_of(x, m) for m in models]
    with torch.no_grad():
        tent = torch.cat([problem.project(STEPS[problem.norm](x, g, ctx.alpha)) for g in grads])
        rows = ctx.rows(k * n)
        ce = torch.stack([_goal_ce(problem, m(tent), rows).view(k, n) for m in models])  # [i, j]: CE_i(x_j)
        own = torch.diagonal(ce).T.unsqueeze(1)  # [i, 1, n]: CE_i(x_i)
        ratio = ce / own.clamp_min(1e-12) if not problem.targeted else own / ce.clamp_min(1e-12)
        off = ~torch.eye(k, dtype=torch.bool, device=x.device)
        w = torch.softmax(beta * (ratio * off.unsqueeze(2)).sum(0), dim=0)  # (k, n)
        if k > 1:
            sims = [F.cosine_similarity(grads[i], grads[j], dim=1, eps=1e-8) for i in range(k)
                    for j in range(i + 1, k)]
            keep = (torch.stack(sims).mean(0) >= threshold).unsqueeze(1).to(x.dtype)
        else:
            keep = torch.ones_like(x[:, :1])

    def fused(z):
        r = ctx.rows(z.shape[0])
        return sum(w[i, r].unsqueeze(1) * m(z) for i, m in enumerate(models))

    return ctx.grad_of(x, fused) * keep
