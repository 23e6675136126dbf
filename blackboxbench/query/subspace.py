"""Subspace attack (Guo, Yan, Zhang, "Subspace Attack: Exploiting Promising Subspaces for Query-Efficient
Black-box Attacks", NeurIPS 2019), Linf and L2.

Bandits-style gradient estimation whose search directions are the input gradients of white-box reference models
(the surrogates) instead of random noise, so the attack explores the subspace those gradients span. One iteration
from ``x = x_adv`` with the per-sample prior ``v`` (zero at the start):

1. Every sample draws one reference model (uniformly, its own stream) and, with dropout probability ``p_t``
   (:func:`drop_schedule`: ``init_drop`` for the first ``drop_grow_iter`` iterations, then growing towards
   ``max_drop`` as ``max_drop - (max_drop - init_drop) exp(-gamma (t - drop_grow_iter))``), takes its input
   gradient ``u`` of ``z_y - z_o`` (untargeted) or ``z_o - z_t`` (targeted) on the reference model's logits ``z``,
   where ``o`` is the target model's runner-up class at ``x``: the authors back-propagate the target's CW-loss
   gradient with respect to its logits through the reference model. ``u`` is scaled to unit L2 norm.
2. Two queries: ``l+- = L(x + fd_eta q+- / ||q+-||)`` with ``q+- = v +- exploration u``, where ``L`` is the
   attacker's loss, the negated CW margin (higher is better), so the prior ``v`` points the way the image moves.
3. ``Delta = (l+ - l-) / (fd_eta exploration) u``; the prior takes a momentum step ``v <- v + prior_lr Delta /
   ||Delta||_1`` (the authors' default ``--prior-update momentum``).
4. The image steps along the prior: Linf ``x + lr sign(v)``, L2 ``x + l2_lr v / ||v||_2``, projected onto the eps
   ball and [0, 1]. ``subspace_step`` queries it: BlackboxBench's per-iteration early-stop check (not counted by the
   authors), which also gives the runner-up class for the next iteration. So 3 queries per iteration.

The probes of step 2 therefore lie on the side the image steps to, as in the authors' ``attack.py`` and in
Bandits (:mod:`blackboxbench.query.bandits`): their finite difference looks ahead along the prior. (Until
2026-12-05 the prior here estimated the margin's ascent and the image stepped against it, so the probes looked
behind: the same estimate to first order, the opposite curvature term.)

**Reference models.** The paper's references are trained with ordinary training and attacked with dropout
(``DropoutConv2d``: dropout on every convolution's output, and before the classifier) to diversify the gradients;
for ResNet references the authors drop whole residual blocks instead. Surrogates here are frozen pretrained models
(CIFAR-10 ResNets have no dropout layers): :class:`~blackboxbench.query.prgf.conv_dropout` adds the
``DropoutConv2d`` behaviour to any surrogate by forward hooks, on every ``nn.Conv2d`` output and on the input of
the last ``nn.Linear``, with per-sample masks from the context's streams (so a sample's gradient does not depend
on its neighbours); block dropping is not used (it needs the architecture's residual structure).

Defaults (not in BlackboxBench Table VI; the paper's Sec. 4 and the authors' ``attack.py`` for CIFAR-10 Linf):
``fd_eta`` 0.1, ``exploration`` 0.1, ``prior_lr`` 1.0 (momentum update), image ``lr`` 1/255, dropout 0 for the
first 10 iterations then growing to 0.5 with gamma 0.01. The paper gives no L2 image step; ``l2_lr`` 0.1 is
Bandits-TD's L2 ratio image-lr / eps (0.5 / 5, Ilyas et al. 2019) at CIFAR-10's radius 1. Deviations: the
reference model and the dropout masks are drawn per sample (the authors draw one reference per batch); probes
are clamped to [0, 1] (the oracle takes images) but not projected onto the eps ball (the authors do neither). The
targeted pair is the target and its best other class, as the authors' targeted CW loss.
"""
import torch

from ..registry import ACCEPT, INIT, PERTURB
from .common import l2_normalize, merge_proposal, per_sample
from .prgf import conv_dropout, surrogate_gradient, surrogate_loss

PAPER = "Guo, Yan, Zhang, Subspace Attack: Exploiting Promising Subspaces for Query-Efficient Black-box Attacks, " \
        "NeurIPS 2019"


def drop_schedule(it, init_drop, max_drop, grow_iter, gamma):
    """Dropout probability at per-sample iteration ``it`` (n,) (the authors' schedule), float64."""
    t = it.to(torch.float64)
    grown = max_drop - (max_drop - init_drop) * torch.exp(-(t - grow_iter) * gamma)
    return torch.where(it < grow_iter, torch.full_like(t, init_drop), grown)


def query_with_runner_up(ctx, images):
    """Query one image per sample -> ``(margin, adv, ok, other)``: the CW margin (+inf where refused), success,
    and the best class other than the true label (untargeted) or the target (targeted)."""
    p = ctx.problem
    answer, ok = ctx.oracle(images)
    margin = torch.where(ok, p.margin(answer), float("inf"))
    label = (p.y if p.target is None else p.target)[:, None]
    other = answer.scatter(1, label, float("-inf")).nan_to_num(nan=float("-inf")).argmax(1)
    return margin, margin < 0, ok, other


@INIT.register("subspace_init", paper=PAPER, norms=("linf", "l2"))
def subspace_init(ctx):
    """``x_adv = x`` (one query) with a zero prior, the iteration counter ``it`` and the target's runner-up class
    ``other``."""
    p = ctx.problem
    x0 = p.x.clone()
    margin, adv, _, other = query_with_runner_up(ctx, x0)
    return dict(x_adv=x0, margin=margin, success=adv, prior=torch.zeros_like(x0),
                it=torch.zeros(p.n, dtype=torch.long, device=x0.device), other=other)


@PERTURB.register("subspace", paper=PAPER, norms=("linf", "l2"), needs=("surrogates",),
                  ranges={"fd_eta": "(0, inf)", "exploration": "(0, inf)", "prior_lr": "(0, inf)",
                          "lr": "(0, inf)", "l2_lr": "(0, inf)", "init_drop": "[0, 1)", "max_drop": "[0, 1)",
                          "drop_grow_iter": "int [0, inf)", "drop_gamma": "[0, inf)"})
def subspace(ctx, state, *, fd_eta=0.1, exploration=0.1, prior_lr=1.0, lr=1 / 255, l2_lr=0.1, init_drop=0.0,
             max_drop=0.5, drop_grow_iter=10, drop_gamma=0.01):
    """One Subspace-attack step (see the module docstring): a reference model's gradient as the search direction,
    2 queries for the finite difference along it, a momentum step of the prior, an image step against the prior."""
    p, x, v = ctx.problem, state["x_adv"], state["prior"]
    n, dev, models = p.n, x.device, ctx.surrogates
    drop = drop_schedule(state["it"], init_drop, max_drop, drop_grow_iter, drop_gamma)
    choice = ctx.rng.randint_below(torch.full((n,), len(models), dtype=torch.long, device=dev))
    y, target, other = p.y, p.target, state["other"]

    def loss(k, logits, rows):
        return surrogate_loss(logits, y[rows], None if target is None else target[rows], "pair", other[rows])

    def wrap(k, rows):
        return conv_dropout(models[k], ctx.rng, rows, drop[rows])

    u = l2_normalize(surrogate_gradient(models, x, loss, choice=choice, wrap=wrap))
    q_plus, q_minus = v + exploration * u, v - exploration * u
    probes = torch.stack([x + fd_eta * l2_normalize(q_plus), x + fd_eta * l2_normalize(q_minus)], 1).flatten(0, 1)
    probes = probes.clamp(0, 1)  # a query is an image: the oracle refuses values outside [0, 1]
    idx = torch.arange(n, device=dev).repeat_interleave(2)
    answer, ok = ctx.oracle(probes, idx)
    margin = p.sub(idx).margin(answer).view(n, 2)
    ok = ok.view(n, 2).all(1)
    # the attacker's loss is the negated margin: l+ - l- = margin(q-) - margin(q+)
    slope = torch.where(ok, (margin[:, 1] - margin[:, 0]) / (fd_eta * exploration), torch.zeros_like(margin[:, 0]))
    delta = per_sample(slope, u) * u
    l1 = delta.flatten(1).abs().sum(1)
    v = v + prior_lr * delta / per_sample(torch.where(l1 == 0, 1e-8, l1), delta)
    step = lr * v.sign() if p.norm == "linf" else l2_lr * l2_normalize(v)
    return dict(x_adv=p.project(x + step), prior=v, it=state["it"] + 1)


@ACCEPT.register("subspace_step", paper=PAPER, norms=("linf", "l2"))
def subspace_step(ctx, state, proposal):
    """``margin_step`` that also keeps the target's runner-up class at the new point (one query per sample)."""
    candidates, state = merge_proposal(state, proposal)
    margin, adv, ok, other = query_with_runner_up(ctx, candidates)
    state.update(x_adv=candidates, margin=margin, success=adv, other=torch.where(ok, other, state["other"]))
    return state

