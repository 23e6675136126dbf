"""PRGF (Cheng, Dong, Pang, Su, Zhu, "Improving Black-box Adversarial Attacks with a Transfer-based Prior",
NeurIPS 2019): prior-guided random gradient-free estimation, PRGF-BS (the optimal lambda*), Linf and L2.

Also the surrogate helpers the other surrogate-assisted query attacks share (``subspace.py``, ``bases.py``):
:func:`surrogate_gradient` (the per-sample input gradient of a loss summed over white-box surrogates, one batched
backward), :func:`surrogate_loss` and :class:`conv_dropout` (per-sample dropout masks drawn from the context's
streams). Surrogate forwards and backwards never go through the oracle: they cost no query.

One iteration from ``x = x_adv`` (loss ``L`` = the CW margin of the target's log-probabilities, lower is better):

1. ``v``: the surrogates' input gradient of their loss at ``x`` (the transfer-based prior), scaled to RMS 1.
2. Every ``norm_every`` iterations (and at iteration 3, "the gradient norm may change fast in the early iterations"),
   estimate ``||grad L||^2`` as the mean of ``((L(x + sigma u_j) - L(x)) / sigma)^2`` over ``norm_samples`` Gaussian
   directions ``u_j`` of RMS 1 (their norm is sqrt(D), so each term is an unbiased estimate of ``||grad L||^2``).
3. Query ``L(x + sigma v)``: ``alpha = (L(x + sigma v) - L(x)) / (sigma sqrt(D ||grad L||^2))`` estimates the cosine
   between the prior and the true gradient; a negative estimate flips ``v``.
4. ``lambda* (alpha, q, D)`` (:func:`lambda_star`, paper Sec. 3.2): 0 when ``alpha^2 <= 1/(D + 2q - 2)``, 1 when
   ``alpha^2 >= (2q - 1)/(D + 2q - 2)``, else ``(1 - a)(1 - a(D + 2q - 2)) / (a^2 D (D + 2q - 2) - 2 a D q + 1)``
   with ``a = alpha^2`` (it maximises ``E[grad^T g]^2 / E||g||^2`` for the estimator below; the tests check it
   against that objective maximised numerically).
5. ``lambda* = 1``: the step direction is the prior itself (no more queries). Otherwise draw ``q`` Gaussian
   ``xi_i``, remove their component along ``v``, scale them to RMS 1 and take ``u_i = sqrt(lambda) v +
   sqrt(1 - lambda) xi_i``; ``g = mean_i (L(x + sigma u_i) - L(x)) u_i`` (q queries in one oracle call).
6. Step against the estimate: Linf ``x - lr sign(g)``, L2 ``x - l2_lr g / ||g||_2``, projected onto the eps ball
   and [0, 1]; ``margin_step`` queries it (BlackboxBench's per-iteration early-stop check).

As in the authors' ``attack.py``: ``sigma`` doubles while the prior's finite difference is exactly 0 and grows 5x
while the estimate is exactly 0 (here at most ``MAX_RETRIES`` rounds per iteration), and every second iteration a
raised ``sigma`` is tested with two random probes at the initial value and set back when both differences are
non-zero. Probes are not projected (``sigma`` 1e-4 is 1/40 of a grey level; the authors do not project them
either), and refused probes (past the budget) contribute nothing.

Defaults (not in BlackboxBench Table VI; the paper's Sec. 4.1 and the authors' ``attack.py``): q 50
(``samples_per_draw``), sigma 1e-4 (undefended models), Linf lr 0.005, norm estimate with 10 samples every 10
iterations. The paper's L2 step has length 2 for an L2 radius of sqrt(1e-3 D) = 16.4 on 299 x 299 ImageNet images:
``l2_lr`` 0.12 keeps that ratio for CIFAR-10's radius 1.

Choices where the original does not fit the benchmark: the target loss is BlackboxBench's CW margin (the authors'
code uses cross-entropy for target and surrogate alike), so the prior is the gradient of the surrogates' CW margin
(``prior_loss`` ``margin``; ``ce``, the authors' surrogate loss, is the other choice: on ResNet-56 with
ResNet-20/32/44 surrogates, 8 images, Linf 0.03, median queries 16 with ``margin``, 31 with ``ce``), of the true
label (untargeted) or the target label (targeted; the authors' code is untargeted only); several surrogates give
one prior, the gradient of their summed losses (the paper uses one surrogate, ResNet-152); the data-dependent prior
(PRGF-D, a 50 x 50 ImageNet subspace) and the averaging variant (Appendix B) are not implemented.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..prep.inference import FixedBatch, fixed_rows
from ..registry import INIT, PERTURB
from ..threat import margin_loss
from .common import bounded_calls, l2_normalize, per_sample, query_margin, start_state

PAPER = "Cheng et al., Improving Black-box Adversarial Attacks with a Transfer-based Prior, NeurIPS 2019"
MAX_RETRIES = 10  # rounds of sigma growth within one iteration (the authors loop until the difference is non-zero)
SURROGATE_LOSSES = ("ce", "margin")


# --------------------------------------------------------------------------- surrogate helpers (shared)
def _param_dtype(model):
    p = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
    return None if p is None else p.dtype


def surrogate_loss(logits, y, target=None, kind="margin", other=None):
    """Per-sample attack loss on surrogate ``logits`` (m, K), lower is better for the attacker.

    ``margin``: the CW margin (as the oracle's loss); ``ce``: minus the cross-entropy of the true label
    (untargeted) or the cross-entropy of the target; ``pair``: ``z_y - z_other`` (untargeted) or
    ``z_other - z_target`` (targeted) for given classes ``other`` (m,) (the Subspace attack's victim-guided pair).
    """
    if kind == "margin":
        return margin_loss(logits, y, target)
    if kind == "ce":
        if target is None:
            return -F.cross_entropy(logits, y, reduction="none")
        return F.cross_entropy(logits, target, reduction="none")
    label = (y if target is None else target)[:, None]
    own, oth = logits.gather(1, label)[:, 0], logits.gather(1, other[:, None])[:, 0]
    return own - oth if target is None else oth - own


def surrogate_gradient(models, x, loss_fn, weights=None, choice=None, wrap=None):
    """Per-sample input gradient of ``sum_k w[i, k] loss_fn(k, logits_k, rows)`` at ``x`` (n, C, H, W), in one
    backward over every sample and surrogate.

    ``loss_fn(k, logits, rows)`` returns the (m,) losses of surrogate ``k`` on its rows (local sample indices
    ``rows``). ``weights`` (n, K) weighs the surrogates per sample (default 1); ``choice`` (n,) long gives every
    sample one surrogate instead of all; ``wrap(k, rows)`` may return a context manager active during surrogate
    ``k``'s forward (e.g. :class:`conv_dropout`; behind :class:`~blackboxbench.prep.inference.FixedBatch`, one per
    call of the wrapper, on the rows of that call). Surrogates get ``x`` in their parameters' dtype; BatchNorm in
    eval mode keeps the samples independent, so a sample's gradient does not depend on its neighbours.
    """
    n = x.shape[0]
    everyone = torch.arange(n, device=x.device)
    with torch.enable_grad():
        xg = x.detach().clone().requires_grad_(True)
        total = None
        for k, model in enumerate(models):
            rows = everyone if choice is None else (choice == k).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            xin = xg if choice is None else xg[rows]
            dtype = _param_dtype(model)
            if dtype is not None and dtype != xin.dtype:
                xin = xin.to(dtype)
            if wrap is None:
                logits = model(xin)
            elif isinstance(model, FixedBatch):  # the wrapper's calls, each inside its own rows' context
                parts = []
                for r in fixed_rows(len(rows), model.size, x.device):
                    with wrap(k, rows[r]):
                        parts.append(model.model(xin[r]))
                logits = torch.cat(parts)[:len(rows)]
            else:
                with wrap(k, rows):
                    logits = model(xin)
            loss = loss_fn(k, logits, rows)
            if weights is not None:
                loss = loss * weights[rows, k].to(loss.dtype)
            part = loss.sum().to(xg.dtype)
            total = part if total is None else total + part
        if total is None or not total.requires_grad:
            return torch.zeros_like(x)
        grad, = torch.autograd.grad(total, xg)
    return grad.detach()


class conv_dropout:  # noqa: N801 (a context manager used like a function)
    """Dropout on the output of every ``nn.Conv2d`` of ``model`` and on the input of its last ``nn.Linear`` (the
    classifier), active inside the ``with`` block: the Subspace attack's ``DropoutConv2d`` reference models
    (Guo et al. 2019), applied to any frozen surrogate by forward hooks.

    Row ``r`` of a forward belongs to local sample ``rows[r]`` and is dropped with probability ``p[r]``
    (masks from ``rng``, the sample's own stream, scaled by 1 / (1 - p)); rows with ``p`` 0 draw nothing.
    """

    def __init__(self, model, rng, rows, p):
        self.model, self.rng, self.rows, self.p = model, rng, rows, p
        self.handles = []

    def _mask(self, t):
        live = (self.p > 0).nonzero().squeeze(1)
        if live.numel() == 0:
            return None
        p = self.p[live].view(-1, *([1] * (t.dim() - 1)))
        u = self.rng.uniform(tuple(t.shape[1:]), rows=self.rows[live], dtype=torch.float64).to(t.device)
        mask = torch.ones_like(t)
        mask[live] = ((u >= p) / (1 - p)).to(t.dtype)
        return mask

    def _after_conv(self, module, inputs, out):
        mask = self._mask(out)
        return None if mask is None else out * mask

    def _before_linear(self, module, inputs):
        mask = self._mask(inputs[0])
        return None if mask is None else (inputs[0] * mask, *inputs[1:])

    def __enter__(self):
        linears = []
        for m in self.model.modules():
            if isinstance(m, nn.Conv2d):
                self.handles.append(m.register_forward_hook(self._after_conv))
            elif isinstance(m, nn.Linear):
                linears.append(m)
        if linears:
            self.handles.append(linears[-1].register_forward_pre_hook(self._before_linear))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False


def rms_normalize(v):
    """Each sample (dim 0) scaled to root-mean-square 1 (norm sqrt(D)), as the authors normalise directions."""
    rms = v.flatten(1).pow(2).mean(1).sqrt().clamp_min(1e-12)
    return v / per_sample(rms, v)


# --------------------------------------------------------------------------- PRGF math
def lambda_star(alpha2, d, q):
    """The optimal weight of the prior, lambda* (paper Sec. 3.2, authors' ``attack.py`` as fixed in 2023), for
    squared cosine estimates ``alpha2`` (n,), dimension ``d`` and ``q`` directions, in float64."""
    a = torch.as_tensor(alpha2, dtype=torch.float64)
    k = d + 2 * q - 2
    mid = (1 - a) * (1 - a * k) / (a * a * d * k - 2 * a * d * q + 1)
    lam = torch.where(a <= 1.0 / k, torch.zeros_like(a), torch.where(a >= (2 * q - 1) / k, torch.ones_like(a), mid))
    return lam.clamp(0.0, 1.0)


def prior_guided_directions(xi, v, lam):
    """``u_i = sqrt(lam) v + sqrt(1 - lam) xi_i'`` for Gaussian ``xi`` (n, q, C, H, W), priors ``v`` (n, C, H, W)
    of RMS 1 and weights ``lam`` (n,): ``xi_i'`` is ``xi_i`` without its component along ``v``, at RMS 1."""
    n, q = xi.shape[:2]
    vf = v.flatten(1)[:, None]  # (n, 1, D)
    xf = xi.flatten(2)
    xf = xf - (xf * vf).sum(2, keepdim=True) * vf / (vf * vf).sum(2, keepdim=True).clamp_min(1e-12)
    xf = xf / xf.pow(2).mean(2, keepdim=True).sqrt().clamp_min(1e-12)
    lam = lam.to(xf.dtype).view(n, 1, 1)
    return (lam.sqrt() * vf + (1 - lam).sqrt() * xf).view(xi.shape)


def _differences(ctx, images, idx, base):
    """``L(images) - base`` for rows of local samples ``idx`` (one oracle call) and the rows answered. The probes
    are clamped to [0, 1] first: a query is an image (the oracle refuses others), so a finite-difference step at a
    saturated pixel is the part of it that stays inside."""
    margin, _, ok = query_margin(ctx, images.clamp(0, 1), idx)
    diff = torch.where(ok, margin - base, torch.zeros_like(margin))
    return diff.double(), ok


def _guided_estimate(ctx, x, v, lam, sel, sigma, scale, base, q):
    """PRGF's estimate from ``q`` prior-guided directions for the samples ``sel`` (one draw each): the mean of
    ``(L(x + s u) - L(x)) u`` with ``s = sigma * scale``. A sample whose estimate is zero though its probes were
    answered asks again along the same directions with its ``scale`` (n,) times 5, updated in place ("estimated
    grad == 0" in the authors' code; at most ``MAX_RETRIES`` times). Returns (len(sel), C, H, W) float64."""
    m, shape = sel.numel(), tuple(x.shape[1:])
    rows = sel.repeat_interleave(q)
    xi = ctx.rng.normal(shape, rows=rows).to(x).view(m, q, *shape)
    u = prior_guided_directions(xi, v[sel], lam[sel])
    est = torch.zeros((m, *shape), dtype=torch.float64, device=x.device)
    pending = torch.arange(m, device=x.device)  # rows of sel still to estimate
    for _ in range(MAX_RETRIES):
        who = rows.view(m, q)[pending].flatten()
        ui = u[pending]
        probes = x[sel[pending]][:, None] + per_sample(sigma * scale[sel[pending]], ui) * ui
        dq, okq = _differences(ctx, probes.flatten(0, 1), who, base[who])
        est[pending] = (dq.view(-1, q, *([1] * len(shape))) * ui.double()).mean(1)
        zero = (est[pending].flatten(1).abs().amax(1) == 0) & okq.view(-1, q).any(1)
        if not bool(zero.any()):
            break
        pending = pending[zero]
        scale[sel[pending]] *= 5
    return est


# --------------------------------------------------------------------------- blocks
@INIT.register("prgf_init", paper=PAPER, norms=("linf", "l2"))
def prgf_init(ctx):
    """``x_adv = x`` with its margin (one query), plus the per-sample iteration counter ``it``, the multiplier
    ``sigma_scale`` of the finite-difference step and the estimate ``norm_sq`` of ``||grad L||^2``."""
    p = ctx.problem
    dev = p.x.device
    return start_state(ctx, p.x.clone(), it=torch.zeros(p.n, dtype=torch.long, device=dev),
                       sigma_scale=torch.ones(p.n, dtype=torch.float64, device=dev),
                       norm_sq=torch.zeros(p.n, dtype=torch.float64, device=dev))


@PERTURB.register("prgf", paper=PAPER, norms=("linf", "l2"), needs=("surrogates",),
                  ranges={"q": "int [1, inf)", "sigma": "(0, 1]", "lr": "(0, inf)", "l2_lr": "(0, inf)",
                          "norm_samples": "int [1, inf)", "norm_every": "int [1, inf)",
                          "prior_loss": SURROGATE_LOSSES})
def prgf(ctx, state, *, q=50, sigma=1e-4, lr=0.005, l2_lr=0.12, norm_samples=10, norm_every=10,
         prior_loss="margin"):
    """One PRGF-BS step from ``state['x_adv']`` (see the module docstring): the surrogates' gradient as the prior,
    ``lambda*`` from the estimated cosine, ``q`` prior-guided probes unless ``lambda*`` is 1, then a sign (Linf,
    ``lr``) or normalised (L2, ``l2_lr``) step. Queries: 1 for the prior, ``q`` when the prior is not trusted alone,
    ``norm_samples`` every ``norm_every`` iterations, 2 for a sigma check after sigma grew."""
    p, x = ctx.problem, state["x_adv"]
    n, shape, dev = p.n, tuple(x.shape[1:]), x.device
    d = math.prod(shape)
    base, it = state["margin"], state["it"]
    scale, norm_sq = state["sigma_scale"].clone(), state["norm_sq"].clone()

    # A raised sigma goes back to its initial value when two random probes there both see a change.
    check = ((it % 2 == 0) & (scale != 1)).nonzero().squeeze(1)
    if check.numel():
        rows = check.repeat_interleave(2)
        u = rms_normalize(ctx.rng.normal(shape, rows=rows).to(x))
        diff, ok = _differences(ctx, x[rows] + sigma * u, rows, base[rows])
        back = ((diff != 0) & ok).view(-1, 2).all(1)
        scale[check[back]] = 1.0

    # The transfer-based prior: the surrogates' gradient at x.
    y, target = p.y, p.target

    def loss(k, logits, rows):
        return surrogate_loss(logits, y[rows], None if target is None else target[rows], prior_loss)

    v = rms_normalize(surrogate_gradient(ctx.surrogates, x, loss))

    # One oracle call (calls of whole samples, bounded): the norm estimate of the samples due for one, and the
    # prior's finite difference.
    s = sigma * scale  # (n,) float64
    due_now = (it % norm_every == 0) | (it == 3)
    d_prior = torch.zeros(n, dtype=torch.float64, device=dev)
    ok_prior = torch.zeros(n, dtype=torch.bool, device=dev)
    for sel in bounded_calls(1 + norm_samples * due_now.long(), d):
        due = sel[due_now[sel]]
        rows = due.repeat_interleave(norm_samples)
        pert = rms_normalize(ctx.rng.normal(shape, rows=rows).to(x)) if rows.numel() else x.new_zeros((0, *shape))
        probes = torch.cat([x[rows] + per_sample(s[rows], pert) * pert, x[sel] + per_sample(s[sel], v[sel]) * v[sel]])
        diff, ok = _differences(ctx, probes, torch.cat([rows, sel]), torch.cat([base[rows], base[sel]]))
        if due.numel():
            dn, okn = diff[:rows.numel()].view(-1, norm_samples), ok[:rows.numel()].view(-1, norm_samples)
            sq = ((dn / s[due, None]) ** 2 * okn).sum(1) / okn.sum(1).clamp_min(1)
            norm_sq[due] = torch.where(okn.any(1), sq, norm_sq[due])
        d_prior[sel], ok_prior[sel] = diff[rows.numel():], ok[rows.numel():]
    has_prior = v.flatten(1).abs().amax(1) > 0  # a zero prior (flat surrogates) has nothing to scale up
    for _ in range(MAX_RETRIES):  # "avoid the numerical issue in finite difference": double sigma
        zero = (ok_prior & (d_prior == 0) & has_prior).nonzero().squeeze(1)
        if zero.numel() == 0:
            break
        scale[zero] *= 2
        s = sigma * scale
        dz, okz = _differences(ctx, x[zero] + per_sample(s[zero], v[zero]) * v[zero], zero, base[zero])
        d_prior[zero], ok_prior[zero] = dz, okz
    alpha = d_prior / s / (d * norm_sq).sqrt().clamp_min(1e-12)
    v = v * per_sample(torch.where(alpha < 0, -1.0, 1.0), v)
    alpha = alpha.abs()
    lam = lambda_star(alpha * alpha, d, q)

    # Prior-guided random directions for the samples whose prior is not trusted alone, whole samples per call.
    g = v.clone()
    rg = (lam < 1).nonzero().squeeze(1)
    for group in bounded_calls(torch.ones_like(rg), q * d):
        sel = rg[group]
        g[sel] = _guided_estimate(ctx, x, v, lam, sel, sigma, scale, base, q).to(x.dtype)

    if p.norm == "linf":
        step = lr * g.sign()
    else:
        step = l2_lr * l2_normalize(g)
    return dict(x_adv=p.project(x - step), it=it + 1, sigma_scale=scale, norm_sq=norm_sq)
