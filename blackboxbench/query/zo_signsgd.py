"""ZO-signSGD (Liu, Chen, Chen and Hong, "signSGD via Zeroth-Order Oracle", ICLR 2019), Linf and L2, batched over
samples.

Zeroth-order gradient estimate with ``q`` forward differences from the current point (the paper's estimator, as in
BlackboxBench's ``ZOSignSGDAttack._perturb``): ``g = 1 / (q fd_eta) * sum_i [L(x + fd_eta u_i) - L(x)] u_i``,
``u_i ~ N(0, I)``, then a sign step ``x <- P(x - lr * sign(g))`` on the CW margin ``L`` (lower is better),
projected onto the eps ball and [0, 1]. The step is the sign step in both norms: the method is signSGD, and
BlackboxBench's code takes ``lp_step(..., 'inf')`` "regardless of the lp-ball constraint" (then projects onto the
L2 ball); only the projection differs between Linf and L2.

Queries: the ``q`` probes of every active sample go to the oracle in one call (calls of whole samples of
bounded size at ImageNet size; each probe projected onto the eps ball and [0, 1], as BlackboxBench's loss
projects its queries). ``L(x)`` is not asked again: it is the margin
of the current point, which the previous step's query (``margin_step``, BlackboxBench's early-stop check) or the
start already returned. So an iteration costs q + 1 queries (BlackboxBench counts q + 1 plus its early-stop
query, and re-evaluates ``L(x)`` for every direction).

Defaults (Table VI): ``q`` 30, ``fd_eta`` 2.55 and ``lr`` 2.55 on BlackboxBench's [0, 255] scale, 0.01 here
(see :mod:`blackboxbench.query.nes`). The directions are unnormalised Gaussians as in BlackboxBench's code (its
unit-sphere normalisation, the paper's estimator, is commented out); with a sign step only the probe size
``fd_eta * u`` matters, and Table VI's ``fd_eta`` was set for Gaussian directions.
"""
import torch

from ..registry import PERTURB
from .common import bounded_calls, query_margin

PAPER = "Liu, Chen, Chen and Hong, signSGD via Zeroth-Order Oracle, ICLR 2019"


def zo_gradient(ctx, x_cur, base, q, fd_eta):
    """Forward-difference estimate ``1 / (q fd_eta) sum_i [L(x + fd_eta u_i) - L(x)] u_i`` of the margin gradient
    at ``x_cur`` (n, C, H, W), with ``base`` (n,) the known margins ``L(x_cur)``; q queries per sample, in calls of
    whole samples of about ``PROBE_VALUES`` values (one call on CIFAR-10). Probes are projected onto the eps ball
    and [0, 1]; a refused probe contributes nothing."""
    n, shape = x_cur.shape[0], x_cur.shape[1:]
    g = torch.zeros_like(x_cur)
    for sel in bounded_calls(torch.ones(n, dtype=torch.long, device=x_cur.device), q * x_cur[0].numel()):
        m = sel.numel()
        u = ctx.rng.normal((q, *shape), rows=sel).to(x_cur.dtype)
        idx = sel.repeat_interleave(q)
        probes = ctx.problem.sub(idx).project((x_cur[sel, None] + fd_eta * u).flatten(0, 1))
        margin, _, ok = query_margin(ctx, probes, idx)
        diff = margin.view(m, q) - base[sel, None]
        diff = torch.where(ok.view(m, q) & torch.isfinite(diff), diff, torch.zeros_like(diff))
        g[sel] = (diff.view(m, q, *([1] * len(shape))) * u).sum(1) / (q * fd_eta)
    return g


@PERTURB.register("zo_signsgd", paper=PAPER, norms=("linf", "l2"),
                  ranges={"q": "int [1, inf)", "fd_eta": "(0, inf)", "lr": "(0, inf)"})
def zo_signsgd(ctx, state, *, q=30, fd_eta=0.01, lr=0.01):
    """One ZO-signSGD step from ``state['x_adv']`` (whose margin is ``state['margin']``), projected onto the eps
    ball and [0, 1].

    ``q`` 30 directions, ``fd_eta`` 0.01 and ``lr`` 0.01 in [0, 1] pixel units (Table VI's q 30, fd_eta 2.55 and
    lr 2.55 on the [0, 255] scale).
    """
    x_cur = state["x_adv"]
    g = zo_gradient(ctx, x_cur, state["margin"], q, fd_eta)
    return ctx.problem.project(x_cur - lr * g.sign())
