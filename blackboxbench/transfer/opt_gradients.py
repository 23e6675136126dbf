"""Gradient blocks of the optimization perspective (BlackboxBench Supp. A-3): NI, PI, VT, PGN and RAP.

Each is ``fn(ctx, grad_fn, x, state, **params) -> grad`` (see :mod:`blackboxbench.transfer.pipeline`). They read
the loop context (spec sheet gap G3): ``ctx.alpha`` (the step), ``ctx.t`` (the iteration), ``ctx.problem.eps`` /
``.norm``, and RAP ``ctx.raw_grad`` (the loss gradient without input transformations). Random neighbours come
from the samples' own streams ``ctx.rng``, one draw per call, so a sample's result does not depend on its batch.
Blocks that keep per-sample state under a fixed key declare a conflict with themselves (listed once only).
"""
import math

import torch

from ..registry import GRADIENT
from ..threat import flat_norm, per_sample, project
from .updates import STEPS


def unit(g, norm):
    """``g`` scaled per sample as the update uses it: Linf ``g / mean|g|`` (MI's normalization), L2
    ``g / ||g||_2``."""
    scale = g.abs().flatten(1).mean(1) if norm == "linf" else flat_norm(g, "l2")
    return g / per_sample(scale.clamp_min(1e-12), g)


def lookahead(v, norm):
    """The look-ahead displacement per unit step of a momentum-like ``v`` (accumulated ``g / mean|g|``).

    Linf: ``v`` itself, as Lin et al., the authors' code and torchattacks (``x + alpha * mu * g``). L2: ``v /
    sqrt(d)``, so that one normalized gradient moves about one step in L2 length, as it moves about one step per
    pixel under Linf (the raw Linf rule would move ``sqrt(d)`` steps, far outside an L2 ball)."""
    return v if norm == "linf" else v / math.sqrt(v[0].numel())


def neighbours(ctx, x, radius):
    """``x + r`` with ``r`` uniform in [-radius, radius] per pixel, from each sample's stream."""
    u = ctx.rng.uniform(tuple(x.shape[1:])).to(x)
    return x + (2 * u - 1) * radius


@GRADIENT.register("nesterov", paper="Lin et al., Nesterov Accelerated Gradient and Scale Invariance for "
                                     "Adversarial Attacks (NI-FGSM), ICLR 2020", norms=("linf", "l2"),
                   ranges={"decay": "[0, inf)", "step": "(0, inf)"}, requires=("direction:momentum",),
                   conflicts=("gradient:pregrad", "gradient:nesterov"),
                   conflict_reason="both move the point where the gradient is taken along the momentum")
def nesterov(ctx, grad_fn, x, state, *, decay=1.0, step=None):
    """NI: the gradient at the look-ahead point ``x + step * decay * g_t`` (``g_t``: the momentum state of the
    ``momentum`` direction, which this block requires; none at t = 0).

    ``step`` None is ``ctx.alpha``: Lin et al.'s rule, and what the authors' ``look_ahead_NI`` does (it ignores its
    step argument), so what the paper's runs used. Table VII's CIFAR look-ahead 1e-7 would make NI equal MI
    (spec sheet 10.3). ``decay`` 1: Table VII (keep it equal to the momentum's)."""
    g = state.get("momentum")
    if g is None:
        return grad_fn(x)
    s = ctx.alpha if step is None else step
    return grad_fn(x + s * decay * lookahead(g, ctx.problem.norm))


@GRADIENT.register("pregrad", paper="Wang et al., Boosting Adversarial Transferability through Enhanced Momentum, "
                                    "arXiv 2103.10609 / BMVC 2021 (BlackboxBench's PI-FGSM, pre-gradient guided "
                                    "momentum)", norms=("linf", "l2"),
                   ranges={"decay": "[0, inf)", "step": "(0, inf)"}, conflicts=("gradient:pregrad",),
                   conflict_reason="one pre-gradient state per attack")
def pregrad(ctx, grad_fn, x, state, *, decay=1.0, step=0.01):
    """PI: the gradient at ``x + step * decay * g_{t-1} / mean|g_{t-1}|``, ``g_{t-1}`` the gradient this block
    returned at the previous iteration (none at t = 0).

    ``step`` 0.01: the authors' CIFAR-10 ``PI.json`` (``look_ahead_PI(step_size=1e-2)``), what their runs used;
    Table VII prints 0.001 (spec sheet 10.3). ``decay`` 1: Table VII. The same displacement under both norms, as
    the authors' code and their L2 ``PI.json`` (same step): ``step`` is a fixed per-pixel size, so unlike NI's
    ``alpha`` times a growing sum it needs no L2 rescaling (``/ sqrt(d)`` would make it about 1 % of the CIFAR-10
    L2 ball, and PI plain MI)."""
    last = state.get("pregrad")
    g = grad_fn(x) if last is None else grad_fn(x + step * decay * unit(last, "linf"))
    state["pregrad"] = g
    return g


@GRADIENT.register("vt", paper="Wang & He, Enhancing the Transferability of Adversarial Attacks through "
                               "Variance Tuning, CVPR 2021", norms=("linf", "l2"),
                   ranges={"n": "int [1, inf)", "bound": "(0, inf)"}, conflicts=("gradient:vt",),
                   conflict_reason="one variance state per attack")
def vt(ctx, grad_fn, x, state, *, n=5, bound=1.5):
    """Variance tuning: returns ``grad(x) + v_{t-1}`` and stores ``v_t = mean_i grad(x + r_i) - grad(x)``, ``r_i``
    uniform in ``[-bound * eps, bound * eps]`` per pixel (``v_0 = 0``).

    ``n`` 5: Table VII (Wang & He: 20). ``bound`` 1.5 (Linf; Wang & He's beta) and 0.015 (L2), per pixel in units
    of eps: the authors' code (recipes set it per norm)."""
    g = grad_fn(x)
    acc = torch.zeros_like(g)
    for _ in range(n):
        acc += grad_fn(neighbours(ctx, x, bound * ctx.problem.eps))
    v_prev = state.get("vt")
    state["vt"] = acc / n - g
    return g if v_prev is None else g + v_prev


@GRADIENT.register("pgn", paper="Ge et al., Boosting Adversarial Transferability by Achieving Flat Local Maxima "
                                "(PGN), NeurIPS 2023", norms=("linf", "l2"),
                   ranges={"n": "int [1, inf)", "zeta": "(0, inf)", "delta": "[0, 1]"})
def pgn(ctx, grad_fn, x, state, *, n=20, zeta=3.0, delta=0.5):
    """Penalizing the gradient norm: the mean over ``n`` neighbours ``x' = x + r`` of ``(1 - delta) g1 + delta
    g2``, ``g1 = grad(x')``, ``g2 = grad(x' - alpha * unit(g1))`` (a finite-difference step against the gradient).

    Linf: ``r`` uniform in ``[-zeta eps, zeta eps]`` per pixel; L2: ``r = zeta eps z / ||z||`` (z Gaussian), and
    g1, g2 normalized before mixing (the authors' L2 variant). Defaults zeta 3, delta 0.5, n 20: Ge et al. and
    BlackboxBench's code (not in Table VII)."""
    norm, eps = ctx.problem.norm, ctx.problem.eps
    acc = None
    for _ in range(n):
        if norm == "linf":
            xn = neighbours(ctx, x, zeta * eps)
        else:
            z = ctx.rng.normal(tuple(x.shape[1:])).to(x)
            xn = x + zeta * eps * z / per_sample(flat_norm(z, "l2").clamp_min(1e-12), z)
        g1 = grad_fn(xn)
        g2 = grad_fn(xn - ctx.alpha * unit(g1, norm))
        if norm != "linf":
            g1, g2 = unit(g1, norm), unit(g2, norm)
        mix = (1 - delta) * g1 + delta * g2
        acc = mix if acc is None else acc + mix
    return acc / n


@GRADIENT.register("rap", paper="Qin et al., Boosting the Transferability of Adversarial Attacks with Reverse "
                                "Adversarial Perturbation (RAP), NeurIPS 2022", norms=("linf", "l2"),
                   ranges={"late_start": "int [0, inf)", "inner_iterations": "int [1, inf)",
                           "inner_eps": "(0, inf)"}, conflicts=("gradient:rap",),
                   conflict_reason="one reverse perturbation per attack")
def rap(ctx, grad_fn, x, state, *, late_start=100, inner_iterations=5, inner_eps=None):
    """RAP: from iteration ``late_start`` on, the gradient at ``x + n_rap``, where ``n_rap`` approximately
    *minimizes* the attack loss within the ball of radius ``inner_eps`` (default eps) around ``x``:
    ``inner_iterations`` steps of size ``ctx.alpha`` against ``ctx.raw_grad`` (no input transformations, as the
    authors' code), from a uniform start in ``[-inner_eps, inner_eps]`` (L2: ``inner_eps / 100`` per pixel, the
    code's), each projected to the ball and [0, 1]. Before ``late_start``: the plain gradient.

    Defaults late start 100, inner iterations 5: Table VII CIFAR-10 (ImageNet: 10); 400 outer iterations are the
    recipe's. The inner loss is the attack's own loss, descended (the authors' code ascends ``max_logit`` of the
    true class untargeted and CE away from the target targeted: the same goal)."""
    if ctx.t < late_start:
        return grad_fn(x)
    norm = ctx.problem.norm
    e = ctx.problem.eps if inner_eps is None else inner_eps
    x = x.detach()
    start = e if norm == "linf" else e / 100
    xr = neighbours(ctx, x, start).clamp(0, 1)
    for _ in range(inner_iterations):
        xr = project(STEPS[norm](xr, -ctx.raw_grad(xr), ctx.alpha), x, e, norm)
    return grad_fn(xr)
