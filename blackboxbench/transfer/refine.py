"""Surrogate-refinement blocks of the transfer pipeline: ``fn(ctx, models, **params) -> models``, and the model
set that fuses several surrogates under a policy (spec sheet G4).

They run once per run, before any sample; ``ctx.rng`` is then a run-level stream (not a sample's), ``ctx.problem``
is None, and ``ctx.surrogates`` / ``ctx.assets`` / ``ctx.pool`` (the evaluation images) are the run's.

A fusion block ends the refine list with one :class:`ModelSet`:

* ``logit_ensemble``: the loss of the weighted logit average (Liu et al.; Dong et al. Eq. 7);
* ``loss_ensemble``: the weighted average of the members' losses (Dong et al.'s ensemble in loss);
* ``longitudinal``: member ``t mod K`` at iteration ``t`` (Li et al., GhostNet; RD, LGV and the Bayesian attack),
  or with groups of ``n`` members, the logit average of group ``t mod G`` (BlackboxBench's ``--n-ensemble``).

Its forward is always the weighted logit average (the clean check and the target labels of the surrogate);
:meth:`ModelSet.active` says which members, with which weights, the loss is taken over at iteration ``t``.
Gradient blocks that need each member (CWA, AdaEA) read :func:`members`.
"""
from torch import nn

from ..errors import BenchError
from ..registry import REFINE

# policy -> the [(weight, model)] whose weighted losses make the attack loss of a model set at iteration t
POLICIES = {
    "logit": lambda s, t: [(1.0, s)],  # the loss of the fused logits (its forward)
    "loss": lambda s, t: list(zip(s.weights, s.members)),
    "longitudinal": lambda s, t: [(1.0, s.groups[t % len(s.groups)])],
}


class ModelSet(nn.Module):
    """Surrogates attacked together under a fusion ``policy``; ``forward`` is the weighted logit sum (weights sum
    to 1)."""

    def __init__(self, models, weights, policy, group=1):
        super().__init__()
        if policy not in POLICIES:
            raise BenchError(f"model set: unknown policy {policy!r} (one of {', '.join(POLICIES)})")
        self.members = nn.ModuleList(models)
        self.weights = [float(w) for w in weights]
        self.policy = policy
        # the longitudinal policy's units: consecutive groups of `group` members (the last may be smaller), a
        # group of one is the member itself, a larger one its members' logit average (plain list: the members
        # are registered once, above)
        self.groups = [ms[0] if len(ms) == 1 else ModelSet(ms, [1.0 / len(ms)] * len(ms), "logit")
                       for ms in (models[i:i + group] for i in range(0, len(models), group))]

    def forward(self, x):
        return sum(w * m(x) for w, m in zip(self.weights, self.members))

    def active(self, t):
        """[(weight, model)] whose weighted losses make the attack loss at iteration ``t``."""
        return POLICIES[self.policy](self, t)


def active(model, t):
    """[(weight, model)] of the attack loss at iteration ``t``: a :class:`ModelSet`'s, else the model alone."""
    return model.active(t) if isinstance(model, ModelSet) else [(1.0, model)]


def members(model):
    """The surrogates inside ``model`` (a :class:`ModelSet`'s members, else the model alone) and their weights."""
    if isinstance(model, ModelSet):
        return list(model.members), list(model.weights)
    return [model], [1.0]


def _fuse(block, models, weights, policy, group=1):
    if not models:
        raise BenchError(f"refine '{block}': no surrogate models")
    weights = [1.0] * len(models) if weights is None else [float(w) for w in weights]
    if len(weights) != len(models) or min(weights) < 0 or sum(weights) <= 0:
        raise BenchError(f"refine '{block}': need {len(models)} non-negative weights with a positive sum, "
                         f"got {weights}")
    total = sum(weights)
    return [ModelSet(models, [w / total for w in weights], policy, group)]


@REFINE.register("logit_ensemble", paper="Liu et al., Delving into Transferable Adversarial Examples and "
                                         "Black-box Attacks, ICLR 2017; Dong et al., MI-FGSM, CVPR 2018 (ensemble "
                                         "in logits)", norms=("linf", "l2"), ranges={"weights": "list [0, inf)"},
                 fuses=True)
def logit_ensemble(ctx, models, *, weights=None):
    """Fuse the surrogates by averaging their logits, ``l(x) = sum_i w_i l_i(x)`` (Dong et al. Eq. 7).

    ``weights`` default to equal (as BlackboxBench); given weights must be >= 0 and are normalized to sum 1.
    Returns a one-element list.
    """
    return _fuse("logit_ensemble", models, weights, "logit")


@REFINE.register("loss_ensemble", paper="Dong et al., Boosting Adversarial Attacks with Momentum (MI-FGSM), CVPR "
                                        "2018 (ensemble in loss)", norms=("linf", "l2"),
                 ranges={"weights": "list [0, inf)"}, fuses=True)
def loss_ensemble(ctx, models, *, weights=None):
    """Fuse the surrogates by averaging their losses, ``L(x) = sum_i w_i L(l_i(x))`` (equal weights by default,
    as BlackboxBench's ``--emsemble-type loss``). Returns a one-element list."""
    return _fuse("loss_ensemble", models, weights, "loss")


@REFINE.register("longitudinal", paper="Li et al., Learning Transferable Adversarial Examples via Ghost Networks, "
                                       "AAAI 2020 (longitudinal ensemble)", norms=("linf", "l2"), fuses=True,
                 ranges={"shuffle": (False, True), "n_ensemble": "int [1, inf)"})
def longitudinal(ctx, models, *, shuffle=False, n_ensemble=1):
    """Fuse the surrogates longitudinally: iteration ``t`` attacks member ``t mod K`` alone, in the order of the
    list (as BlackboxBench's ``cycle`` over its source models). ``shuffle``: in one random order instead, drawn
    once from the run's refine stream (BlackboxBench's ``--shuffle``, one ``random.shuffle`` of the model list
    before the attack). ``n_ensemble``: iteration ``t`` attacks the logit average of group ``t mod G`` of the
    consecutive groups of ``n_ensemble`` members (the last group keeps what is left), as BlackboxBench's
    ``--n-ensemble`` (its ``build_model`` groups the, possibly shuffled, model list so and its losses ensemble
    on logits by default); 1, the default, is the plain longitudinal ensemble. The clean check uses every
    member's logit average. Returns a one-element list."""
    if n_ensemble > len(models) and models:
        raise BenchError(f"refine 'longitudinal': n_ensemble {n_ensemble} exceeds the {len(models)} surrogates")
    if shuffle and models:
        models = [models[i] for i in ctx.rng.permutations(len(models))[0].tolist()]
    return _fuse("longitudinal", models, None, "longitudinal", n_ensemble)
