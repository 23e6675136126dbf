"""NES (Ilyas et al., "Black-box adversarial attacks with limited queries and information", ICML 2018).

Natural-evolution-strategies gradient estimate with antithetic Gaussian sampling (paper Alg. 1):
``g = 1 / (2 q sigma) * sum_i u_i [L(x + sigma u_i) - L(x - sigma u_i)]``, ``u_i ~ N(0, I)``, i = 1..q, then a
projected step that lowers the margin loss: Linf ``x - lr * sign(g)`` (the paper's PGD step), L2
``x - lr * g / ||g||_2``. All 2q probes of every active sample go to the oracle in one call (calls of whole
samples of bounded size at ImageNet size); the step is always taken (``margin_step`` queries it once to learn its
margin, BlackboxBench's early-stop check), so an iteration costs 2q + 1 queries.

Defaults (BlackboxBench Table VI): q 15, fd_eta 2.55, lr 2.55. Those two are in BlackboxBench's CIFAR-10 pixel
units [0, 255]: its score attacks run on uint8-range images (``Dataset.max_value`` 255 for CIFAR-10) and its
loss divides by 255 before the model (``attack_cifar10.py``: ``x_eval = xs / 255.``; epsilon 12.75 in
``config-jsons/cifar10_nes_linf_config.json`` is 0.05). In our [0, 1] units: fd_eta = lr = 2.55 / 255 = 0.01.
BlackboxBench's NES (from the SignHunter code) has no momentum or learning-rate decay; neither has this one.
"""
import torch

from ..registry import PERTURB
from .common import bounded_calls, per_sample, query_margin

PAPER = "Ilyas et al., Black-box Adversarial Attacks with Limited Queries and Information, ICML 2018"


def nes_gradient(ctx, x_cur, q, fd_eta):
    """Antithetic NES estimate of the margin-loss gradient at ``x_cur`` (n, C, H, W); 2q queries per sample, in
    calls of whole samples of about ``PROBE_VALUES`` values (one call on CIFAR-10; 100 samples' 30 probes at
    299 x 299 asked for tens of GB in one call before). Probes are projected onto the eps ball and [0, 1]; pairs
    with a refused probe contribute nothing."""
    n, shape = x_cur.shape[0], x_cur.shape[1:]
    g = torch.zeros_like(x_cur)
    for sel in bounded_calls(torch.ones(n, dtype=torch.long, device=x_cur.device), 2 * q * x_cur[0].numel()):
        m = sel.numel()
        u = ctx.rng.normal((q, *shape), rows=sel).to(x_cur.dtype)
        probes = torch.cat([x_cur[sel, None] + fd_eta * u, x_cur[sel, None] - fd_eta * u], 1).flatten(0, 1)
        idx = sel.repeat_interleave(2 * q)
        probes = ctx.problem.sub(idx).project(probes)  # valid images, as BlackboxBench's loss_fct projects its queries
        margin, _, ok = query_margin(ctx, probes, idx)
        margin, ok = margin.view(m, 2, q), ok.view(m, 2, q)
        diff = torch.where(ok.all(1), margin[:, 0] - margin[:, 1], torch.zeros_like(margin[:, 0]))
        g[sel] = (diff.view(m, q, *([1] * len(shape))) * u).sum(1) / (2 * q * fd_eta)
    return g


@PERTURB.register("nes", paper=PAPER, norms=("linf", "l2"),
                  ranges={"q": "int [1, inf)", "fd_eta": "(0, 1]", "lr": "(0, inf)"})
def nes(ctx, state, *, q=15, fd_eta=0.01, lr=0.01):
    """One NES step from ``state['x_adv']``, projected onto the eps ball and [0, 1].

    ``q`` 15 antithetic pairs, ``fd_eta`` (sigma) 0.01 and ``lr`` 0.01 in [0, 1] pixel units (Table VI's 2.55 on
    the [0, 255] scale, see the module docstring).
    """
    x_cur, problem = state["x_adv"], ctx.problem
    g = nes_gradient(ctx, x_cur, q, fd_eta)
    if problem.norm == "linf":
        step = g.sign()
    else:
        step = g / per_sample(g.flatten(1).norm(dim=1).clamp_min(1e-12), g)
    return problem.project(x_cur - lr * step)
