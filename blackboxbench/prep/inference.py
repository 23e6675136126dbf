"""Inference copies of frozen models, for the models a run only forwards (a query run's target behind the oracle, a
transfer run's targets): no gradient, no hook and no surgery ever reaches them.

:func:`inference_copy` folds every BatchNorm into the convolution before it (``torch.fx``'s ``fuse``, in each
submodule that traces; a wrapper such as :class:`~blackboxbench.prep.models.Normalized`, whose shape checks do not
trace, keeps its own forward around a folded ``net``) and stores the weights channels-last. On 2 CPU cores a
ResNet-20 forward at batch 100 then takes 0.6-0.7x the time (``benchmarks/RESULTS.md``). The copy is checked
against the model on a probe batch and the model is kept as built when they disagree (a warning names why), so a
model that folding or the memory format would change is never attacked in a changed form.
"""
import copy
import sys

import torch
from torch import nn

# Tolerance of the probe check, relative to the largest logit: folding changes the last bits (measured 4e-7 on
# ResNet-20 on CPU); TF32 convolutions on a GPU move logits by about 1e-3 between any two forwards. A model that
# the transformation breaks differs by O(1).
RTOL = 1e-2


def _fold(module):
    """``module`` with BatchNorm folded into the preceding convolutions wherever ``torch.fx`` traces it."""
    from torch.fx.experimental.optimization import fuse

    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return module
    try:  # a failure while tracing changes nothing; one while folding is caught by the probe check
        return fuse(module, inplace=True)
    except Exception:  # noqa: BLE001  (torch.fx raises several types for code it cannot trace): go one level down
        for name, child in module.named_children():
            setattr(module, name, _fold(child))
        return module


def _gap(out, ref):
    """Largest difference of two logit tensors, relative to the largest reference logit (at least 1)."""
    return float((out.float() - ref.float()).abs().max()) / max(1.0, float(ref.float().abs().max()))


def is_randomized(model, x, first=None):
    """Whether two forwards of the same batch differ (a randomized model or defense; AutoAttack's check): its
    success rule then matters (``threat.success_rule``), and the summary says so. ``first``: the model's logits on
    ``x`` when the caller already has them."""
    with torch.no_grad():
        return not torch.equal(model(x) if first is None else first, model(x))


def inference_copy(model, probe, name="model"):
    """A copy of the frozen ``model`` for forwards only (see the module docstring), or ``model`` itself when the
    copy cannot be made or run, when its logits on ``probe`` (a few inputs of the run) differ from the model's by
    more than ``RTOL`` of the largest, or when the model's own logits cannot be compared: it fails on the probe,
    returns non-finite logits, or is randomized (:func:`is_randomized`; such a model is never copied)."""
    try:
        with torch.no_grad():
            ref = model(probe)
        comparable = torch.is_tensor(ref) and bool(torch.isfinite(ref).all()) and not is_randomized(model, probe, ref)
    except Exception:  # noqa: BLE001
        comparable = False
    if not comparable:  # the run's own checks report the first two in one line and flag the third
        return model
    try:
        fast = _fold(copy.deepcopy(model)).to(memory_format=torch.channels_last)
        fast.requires_grad_(False).eval()
        with torch.no_grad():
            gap = _gap(fast(probe), ref)
    except Exception as e:  # noqa: BLE001  (a model that cannot be copied, or a copy that cannot run, stays as built)
        gap, why = float("inf"), f"{type(e).__name__}: {e}"
    else:
        why = f"logits differ by {gap:.2g} of the largest"
    if not gap <= RTOL:
        print(f"fuse: {name} kept as built ({why})", file=sys.stderr)
        return model
    if hasattr(model, "arch_id"):
        fast.arch_id = model.arch_id
    return fast
