"""Feature-level transfer attacks (spec sheet T9-T11): ILA, FIA and NAA as ``auxiliary`` + ``loss`` blocks.

Each attack is a pair. Its auxiliary block (Alg. 3 line 2, once per batch before the loop) resolves the feature
layer on the refined surrogate (:func:`blackboxbench.prep.layers.get_layer`: a role such as ``mid``, a map name
such as ``stage2`` or a module path), computes its auxiliary information on the clean images, and leaves a
:class:`Features` entry in ``ctx.aux``: a forward hook on that layer for the loop, and the per-sample tensors
the loss needs. Its loss block reads the hooked features of the current forward (``ctx.aux[key].features``):
the logits are not used. The hook is removed when the batch ends (the pipeline closes it).

Rows: when a transform stacks K copies, the hooked features have K * n rows; the per-sample tensors are repeated
to match (copy k in rows k*n .. (k+1)*n - 1).
"""
from dataclasses import dataclass, field
from typing import Dict

import torch

from ..errors import BenchError
from ..prep.layers import FeatureTap, get_layer
from ..prep.models import input_mean
from ..registry import AUXILIARY, LOSS, UPDATE


@dataclass
class Features:
    """A feature hook on one layer of the surrogate and per-sample tensors computed before the loop."""

    tap: FeatureTap
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def features(self):
        return self.tap.out

    def rows(self, name, m):
        """Tensor ``name`` repeated to ``m`` rows (K stacked copies of the n samples)."""
        t = self.tensors[name]
        return t.repeat(m // t.shape[0], *([1] * (t.dim() - 1)))

    def close(self):
        self.tap.close()


def _layer(ctx, layer, block):
    return get_layer(ctx.model, layer, what=f"layer (auxiliary '{block}', parameter layer)")


def _need(ctx, key, loss, aux):
    if not isinstance(ctx.aux.get(key), Features):
        raise BenchError(f"loss '{loss}' needs the auxiliary block '{aux}' (add it under blocks.auxiliary)")
    return ctx.aux[key]


def _untargeted_only(ctx, block):
    if ctx.problem.targeted:
        raise BenchError(f"auxiliary '{block}': untargeted only (Table VII: no targeted setting); set "
                         "threat.targeted: false")


def features_of(model, module, x, grad=False):
    """The output of ``module`` when ``model`` sees ``x`` (and the logits); ``grad``: keep the graph to ``x``."""
    with FeatureTap(module) as tap, torch.set_grad_enabled(grad):
        logits = model(x)
    return tap.out, logits


def _flat_unit(t):
    """Each row scaled to unit L2 norm (a zero row stays zero)."""
    return t / t.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (t.dim() - 1)))


def _true_logit_grad(model, module, x, y):
    """d z_y(x) / d f_l(x) at the layer ``module``, one row per image."""
    x = x.detach().requires_grad_(True)
    feats, logits = features_of(model, module, x, grad=True)
    z = logits.gather(1, y[:, None]).sum()
    return torch.autograd.grad(z, feats)[0]


# ---------------------------------------------------------------------------------------------------- ILA ----

@AUXILIARY.register("ila_baseline", paper="Huang et al., Enhancing Adversarial Example Transferability with an "
                                          "Intermediate Level Attack (ILA), ICCV 2019",
                    norms=("linf", "l2"), ranges={"iterations": "int [1, inf)"}, layer_param="layer")
def ila_baseline(ctx, *, layer="mid", iterations=10):
    """ILA stage 1: a baseline I-FGSM of ``iterations`` steps (CE loss, the pipeline's step ``ctx.alpha`` and
    update) gives x'; keeps F_l(x) and the unit direction (F_l(x') - F_l(x)) / ||.|| per sample for the loss.
    ``iterations`` 10 (U) / 30 (T): Table VII CIFAR-10. The baseline starts at the clean image, as stage 2. x' is
    the baseline's last iterate as it is, not rounded to uint8 (BlackboxBench saves the float iterate as ILA's
    reference, ``--as-baseline``; so does the ILA authors' code, which hands its I-FGSM output on in memory)."""
    from .pipeline import TransferAttack  # the baseline is the pipeline's own I-FGSM

    module = _layer(ctx, layer, "ila_baseline")
    baseline = TransferAttack("ila_baseline", iterations, ctx.alpha, LOSS.get("ce"), UPDATE.get("step"))
    last = {}
    baseline.run(ctx.at(iterations=iterations, aux={}), lambda t, x_t: last.update(x=x_t))
    x_base = last["x"]
    f_clean, _ = features_of(ctx.model, module, ctx.problem.x)
    f_base, _ = features_of(ctx.model, module, x_base)
    return {"ila": Features(FeatureTap(module), {"clean": f_clean, "dir": _flat_unit(f_base - f_clean)})}


@LOSS.register("ila", paper="Huang et al., ILA, ICCV 2019 (projection loss)", norms=("linf", "l2"))
def ila(ctx, logits, label):
    """ILA stage 2: the projection <F_l(x_adv) - F_l(x), d> of the feature change on the baseline's unit
    direction d (the authors' ILAProjLoss), to maximize. Needs the auxiliary block ``ila_baseline``."""
    f = _need(ctx, "ila", "ila", "ila_baseline")
    feats = f.features
    m = feats.shape[0]
    return ((feats - f.rows("clean", m)) * f.rows("dir", m)).flatten(1).sum(1)


# ---------------------------------------------------------------------------------------------------- FIA ----

@AUXILIARY.register("fia_aggregate", paper="Wang et al., Feature Importance-aware Transferable Adversarial "
                                           "Attacks (FIA), ICCV 2021", norms=("linf", "l2"),
                    ranges={"n_ens": "int [1, inf)", "drop": "[0, 1)", "fill": ("mean", "zero")}, layer_param="layer")
def fia_aggregate(ctx, *, layer="mid", n_ens=30, drop=0.3, fill="mean"):
    """FIA's aggregate gradient: Delta = sum_n d z_y(x masked by M_n) / d f_l, M_n ~ Bernoulli(1 - ``drop``) pixel
    masks drawn per sample from its stream, then scaled to unit L2 norm per sample. Table VII: N = 30, drop 0.3.

    ``fill`` is what a dropped pixel becomes: ``mean`` (default), the model's input-normalization mean, i.e. the
    mask multiplies the normalized input, as the FIA authors' code and BlackboxBench's ``fia_loss`` do (the zoo's
    normalization is inside the model); ``zero``, black, as the FIA paper's text reads. z_y is the true-class
    logit. One forward per mask (a loop over the ensemble, not the samples)."""
    _untargeted_only(ctx, "fia_aggregate")
    module = _layer(ctx, layer, "fia_aggregate")
    x, y = ctx.problem.x, ctx.problem.y
    mean = input_mean(ctx.model) if fill == "mean" else None
    background = torch.zeros_like(x) if mean is None else mean.to(x).expand_as(x)
    total = 0
    for _ in range(n_ens):
        mask = (ctx.rng.uniform(x.shape[1:]).to(x) >= drop).to(x.dtype)
        total = total + _true_logit_grad(ctx.model, module, x * mask + background * (1 - mask), y)
    return {"fia": Features(FeatureTap(module), {"weight": _flat_unit(total)})}


@LOSS.register("fia", paper="Wang et al., FIA, ICCV 2021 (feature importance-aware loss)", norms=("linf", "l2"))
def fia(ctx, logits, label):
    """-sum(Delta * f_l(x_adv)) per sample, to maximize: suppress the features the aggregate gradient marks as
    important for the true class. Needs the auxiliary block ``fia_aggregate``."""
    f = _need(ctx, "fia", "fia", "fia_aggregate")
    feats = f.features
    return -(feats * f.rows("weight", feats.shape[0])).flatten(1).sum(1)


# ---------------------------------------------------------------------------------------------------- NAA ----

@AUXILIARY.register("naa_attention", paper="Zhang et al., Improving Adversarial Transferability via Neuron "
                                           "Attribution-Based Attacks (NAA), CVPR 2022", norms=("linf", "l2"),
                    ranges={"steps": "int [1, inf)"}, layer_param="layer")
def naa_attention(ctx, *, layer="mid", steps=30):
    """NAA's integrated attention IA = (1/n) sum_{m=1..n} d z_y(xb + m/n (x - xb)) / d y_l on the straight path
    from the black baseline xb = 0 to x (n = ``steps``: Table VII, 30), scaled to unit L2 norm per sample, and
    the baseline's features y_l(xb). The path points carry no noise (decision: deterministic; the NAA code adds
    Gaussian noise to them). One forward per path point."""
    _untargeted_only(ctx, "naa_attention")
    module = _layer(ctx, layer, "naa_attention")
    x, y = ctx.problem.x, ctx.problem.y
    base = torch.zeros_like(x)
    total = 0
    for m in range(1, steps + 1):
        total = total + _true_logit_grad(ctx.model, module, base + m / steps * (x - base), y)
    f_base, _ = features_of(ctx.model, module, base)
    return {"naa": Features(FeatureTap(module), {"weight": _flat_unit(total / steps), "base": f_base})}


@LOSS.register("naa", paper="Zhang et al., NAA, CVPR 2022 (weighted neuron attribution)", norms=("linf", "l2"),
               ranges={"gamma": "[0, inf)"})
def naa(ctx, logits, label, *, gamma=1.0):
    """Neuron attribution WA = (y_l(x_adv) - y_l(xb)) * IA; the loss to maximize is -(sum WA+ - gamma sum WA-)
    (linear transforms of both parts, the NAA paper's default), with WA- the magnitudes of the negative part.
    ``gamma`` 1.0: the NAA paper (not in Table VII). Needs the auxiliary block ``naa_attention``."""
    f = _need(ctx, "naa", "naa", "naa_attention")
    feats = f.features
    m = feats.shape[0]
    wa = ((feats - f.rows("base", m)) * f.rows("weight", m)).flatten(1)
    return -(wa.clamp_min(0).sum(1) - gamma * (-wa).clamp_min(0).sum(1))
