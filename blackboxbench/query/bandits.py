"""Bandits-TD (Ilyas, Engstrom and Madry, "Prior Convictions: Black-Box Adversarial Attacks with Bandits and
Priors", ICLR 2019), Linf and L2, batched over samples.

Gradient estimation with a time prior (the latent vector ``v`` carries over between iterations) and a data prior
(``v`` lives on a ``prior_size`` x ``prior_size`` tile per channel, nearest-upsampled to the image; Bandits-TD).
One iteration per sample (BlackboxBench's ``BanditAttack._perturb``, from SignHunter's code):

1. draw ``u ~ N(0, I)`` in prior space;
2. probe the loss at ``x + fd_eta * q / ||q||_2`` for ``q = up(v +- exploration * u)`` (2 queries, one oracle call
   for every active sample, each probe projected onto the eps ball and [0, 1] as BlackboxBench's loss projects
   its queries);
3. ``Delta = (L(q+) - L(q-)) / (fd_eta * exploration) * u``, with ``L`` the attacker's loss (the negated CW
   margin, so ``Delta`` ascends the loss);
4. prior step: L2 ``v <- v + prior_lr * Delta`` (plain gradient step); Linf ``v <- EG(v, Delta, prior_lr)``, the
   exponentiated-gradient step on ``(v + 1) / 2`` in ``[-1, 1]`` (the paper's Linf prior update);
5. image step: Linf ``x <- P(x + lr * sign(up(v)))``, L2 ``x <- P(x + lr * up(v) / ||up(v)||_2)``; the step is always
   taken and queried once (``margin_step``, BlackboxBench's early-stop check): 3 queries per iteration.

Units (see :mod:`blackboxbench.query.nes`): BlackboxBench runs its score attacks on [0, 255] images, so its
``lr`` 2.55 and ``fd_eta`` 2.55 (Table VI) are 0.01 here. ``prior_lr`` multiplies a derivative per pixel unit
(``Delta`` carries ``1 / fd_eta``), so it converts the same way: Table VI's 0.1 is 0.1 / 255 here, and the prior
then evolves exactly as in BlackboxBench's runs (the EG step sees the same exponents, and in L2 the prior keeps
the same size relative to the exploration noise). ``exploration`` (Table VI ``prior_exploraton`` 0.1) lives in
prior space and needs no conversion.

Prior size: Table VI's 20 (BlackboxBench ``data_size`` 32 for CIFAR-10); it is clamped to the image side, so an
8x8 image gets a full-resolution prior. Deviations from BlackboxBench's code: the prior and the exploration noise
are per sample (their batch shares one generator, not one draw); a refused probe pair leaves the prior unchanged.
"""
import torch
import torch.nn.functional as F

from ..registry import INIT, PERTURB
from .common import l2_normalize, per_sample, query_margin, start_state

PAPER = "Ilyas, Engstrom and Madry, Prior Convictions: Black-Box Adversarial Attacks with Bandits and Priors, ICLR 2019"


def eg_step(v, g, lr):
    """Exponentiated-gradient ascent step on ``p = (v + 1) / 2`` in [0, 1], mapped back to [-1, 1] (Bandits Linf
    prior update, the authors' ``eg_step``): ``p' = p e^{lr g} / (p e^{lr g} + (1 - p) e^{-lr g})``, ``v' = 2 p' - 1``.

    Computed in the equivalent overflow-free form ``v' = tanh(artanh(v) + lr g)`` (``(1 + v) / (1 - v) =
    e^{2 artanh v}``), so large derivatives saturate the prior at +-1 instead of giving inf / inf.
    """
    return torch.tanh(torch.atanh(v) + lr * g)


def prior_shape(shape, prior_size):
    """(C, h, w) of the prior of images of ``shape`` (C, H, W): a ``prior_size`` tile, at most the image size."""
    c, h, w = shape
    return c, min(prior_size, h), min(prior_size, w)


def upsample(v, size_hw):
    """Nearest-neighbour upsampling of priors (n, C, h, w) to the image size (BlackboxBench's ``upsample_maker``)."""
    return v if tuple(v.shape[-2:]) == tuple(size_hw) else F.interpolate(v, size=tuple(size_hw), mode="nearest")


@INIT.register("bandits_init", paper=PAPER, norms=("linf", "l2"), ranges={"prior_size": "int [1, inf)"})
def bandits_init(ctx, *, prior_size=20):
    """Start at the clean image (one query) with a zero prior of ``prior_size`` x ``prior_size`` per channel
    (Table VI ``prior_size`` 20; clamped to the image side)."""
    x = ctx.problem.x
    prior = torch.zeros((x.shape[0], *prior_shape(x.shape[1:], prior_size)), dtype=x.dtype, device=x.device)
    return start_state(ctx, x.clone(), prior=prior)


def bandits_gradient(ctx, x_cur, prior, fd_eta, exploration):
    """Two-query bandit estimate of the loss gradient in prior space (step 1-3 of the module docstring): returns
    ``Delta`` (n, C, h, w); pairs with a refused probe give zero."""
    n = x_cur.shape[0]
    u = ctx.rng.normal(tuple(prior.shape[1:])).to(prior.dtype)
    q = torch.stack([prior + exploration * u, prior - exploration * u], 1).flatten(0, 1)
    q = upsample(q, x_cur.shape[-2:])
    idx = torch.arange(n, device=x_cur.device).repeat_interleave(2)
    probes = ctx.problem.sub(idx).project(x_cur.repeat_interleave(2, 0) + fd_eta * l2_normalize(q))
    margin, _, ok = query_margin(ctx, probes, idx)
    margin, ok = margin.view(n, 2), ok.view(n, 2).all(1)
    # the loss is the negated margin: L(q+) - L(q-) = margin(q-) - margin(q+)
    deriv = torch.where(ok, (margin[:, 1] - margin[:, 0]) / (fd_eta * exploration), torch.zeros_like(margin[:, 0]))
    return per_sample(deriv, u) * u


@PERTURB.register("bandits", paper=PAPER, norms=("linf", "l2"),
                  ranges={"lr": "(0, inf)", "fd_eta": "(0, inf)", "prior_lr": "(0, inf)", "exploration": "(0, inf)"})
def bandits(ctx, state, *, lr=0.01, fd_eta=0.01, prior_lr=0.1 / 255, exploration=0.1):
    """One Bandits-TD iteration from ``state['x_adv']``: update the prior with a two-query estimate, then take
    the image step along it (projected onto the eps ball and [0, 1]).

    Defaults: Table VI ``lr`` 2.55, ``fd_eta`` 2.55, ``prior_lr`` 0.1, ``prior_exploraton`` 0.1, converted to
    [0, 1] pixel units (the first three divided by 255; see the module docstring).
    """
    x_cur, problem = state["x_adv"], ctx.problem
    grad = bandits_gradient(ctx, x_cur, state["prior"], fd_eta, exploration)
    if problem.norm == "linf":
        prior = eg_step(state["prior"], grad, prior_lr)
        step = upsample(prior, x_cur.shape[-2:]).sign()
    else:
        prior = state["prior"] + prior_lr * grad
        step = l2_normalize(upsample(prior, x_cur.shape[-2:]))
    # the loss ascends along the prior, so the margin descends
    return {"x_adv": problem.project(x_cur + lr * step), "prior": prior}
