"""Inference copies of frozen models, for the models a run only forwards (a query run's target behind the oracle, a
transfer run's targets): no gradient, no hook and no surgery ever reaches them.

:func:`inference_copy` folds every BatchNorm into the convolution before it (``torch.fx``'s ``fuse``, in each
submodule that traces; a wrapper such as :class:`~blackboxbench.prep.models.Normalized`, whose shape checks do not
trace, keeps its own forward around a folded ``net``) and stores the weights channels-last. On 2 CPU cores a
ResNet-20 forward at batch 100 then takes 0.6-0.7x the time (``benchmarks/RESULTS.md``). The copy is checked
against the model on a probe batch and the model is kept as built when they disagree (a warning names why), so a
model that folding or the memory format would change is never attacked in a changed form.

In the traced parts, :func:`in_place` then runs each ReLU and each residual addition in the memory of its input
when nothing else reads that input (a fresh convolution, linear or addition output): the forward allocates and
touches about half as many activation tensors (ResNet-20 on 2 CPU cores: up to 1.5x the images per second with
glibc's default allocator, 0-10 % more with the one ``blackboxbench run`` sets; ``benchmarks/RESULTS.md``, "In-place
activations"). Its output must be bit-identical to the folded copy's on the probe, otherwise the folded copy is
used without it.
"""
import copy
import linecache
import operator
import sys
import weakref

import torch
import torch.nn.functional as F
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


_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)  # outputs a new tensor, never a view
_RELU_FUNCTIONS = (torch.relu, F.relu)
_ADD_FUNCTIONS = (operator.add, torch.add)


def in_place(gm):
    """Rewrite the ``torch.fx.GraphModule`` ``gm``: a ReLU (module, function or method) or an out-of-place
    addition whose first input is a fresh tensor (a convolution's, a linear layer's, an addition's or a rewritten
    node's output) read by no other node becomes ``torch.relu_`` / ``Tensor.add_`` on that input. Views (slicing,
    ``view``, ``flatten``), graph inputs, parameters, tensors read twice and modules with forward hooks are left
    as they are. Returns ``gm``."""
    mods = dict(gm.named_modules())
    fresh = set()

    def module(n, kind):  # the plain module a call_module node calls (none with hooks: they may see or keep it)
        m = mods.get(n.target) if n.op == "call_module" else None
        hooked = m is not None and (m._forward_hooks or m._forward_pre_hooks)
        return isinstance(m, kind) and not hooked

    def writable(a):
        if not isinstance(a, torch.fx.Node) or len(a.users) != 1:
            return False
        return a in fresh or module(a, _FRESH_MODULES) or (
            a.op == "call_function" and a.target in _ADD_FUNCTIONS and not a.kwargs)

    for node in list(gm.graph.nodes):
        relu = module(node, nn.ReLU) or (
            node.op == "call_function" and node.target in _RELU_FUNCTIONS and not node.kwargs.get("inplace")) or (
            node.op == "call_method" and node.target == "relu")
        add = node.op == "call_function" and node.target in _ADD_FUNCTIONS and len(node.args) == 2 and not node.kwargs
        if not (relu or add) or not node.args or not writable(node.args[0]):
            continue
        with gm.graph.inserting_after(node):
            new = (gm.graph.call_function(torch.relu_, (node.args[0],)) if relu
                   else gm.graph.call_method("add_", (node.args[0], node.args[1])))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        fresh.add(new)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def _slim(fast, probe, ref):
    """``fast`` with :func:`in_place` applied to every traced submodule of a copy, when that copy's logits on
    ``probe`` are bit-identical to ``ref`` (``fast``'s own); else ``fast``."""
    if not any(isinstance(m, torch.fx.GraphModule) for m in fast.modules()):
        return fast
    try:
        slim = copy.deepcopy(fast)
        for m in slim.modules():
            if isinstance(m, torch.fx.GraphModule):
                in_place(m)
        with torch.no_grad():
            out = slim(probe)
        same = torch.is_tensor(out) and out.dtype == ref.dtype and torch.equal(out, ref)
    except Exception:  # noqa: BLE001  (a rewrite the graph does not allow, e.g. a broadcasting add): not used
        same = False
    return slim if same else fast


def _gap(out, ref):
    """Largest difference of two logit tensors, relative to the largest reference logit (at least 1)."""
    return float((out.float() - ref.float()).abs().max()) / max(1.0, float(ref.float().abs().max()))


def is_randomized(model, x, first=None):
    """Whether two forwards of the same batch differ (a randomized model or defense; AutoAttack's check): its
    success rule then matters (``threat.success_rule``), and the summary says so. ``first``: the model's logits on
    ``x`` when the caller already has them."""
    with torch.no_grad():
        return not torch.equal(model(x) if first is None else first, model(x))


def _generated_sources():
    """torch.fx's store of the code it generates (one entry per traced module and per recompile, also in
    ``linecache``), or None in a torch without it."""
    from torch.fx import graph_module

    return getattr(getattr(graph_module, "_loader", None), "eval_cache", None)


def _forget_sources(keys):
    """Drop generated code ``keys`` from torch.fx's store and ``linecache`` (their modules are gone)."""
    store = _generated_sources()
    for key in keys:
        if store is not None:
            store.pop(key, None)
        linecache.cache.pop(key, None)


def inference_copy(model, probe, name="model", in_place_ops=True):
    """A copy of the frozen ``model`` for forwards only (see the module docstring), or ``model`` itself when the
    copy cannot be made or run, when its logits on ``probe`` (a few inputs of the run) differ from the model's by
    more than ``RTOL`` of the largest, or when the model's own logits cannot be compared: it fails on the probe,
    returns non-finite logits, or is randomized (:func:`is_randomized`; such a model is never copied).
    ``in_place_ops=False`` skips the :func:`in_place` rewrite (the folded, channels-last copy only).

    torch.fx keeps the source of every module it generates for the life of the process (its ``_loader`` and
    ``linecache``): the entries made here are dropped when the copy is (at once when the model itself is
    returned), so a process that builds copy after copy (a sweep's runs, each in its own Session) does not grow."""
    store = _generated_sources()
    before = set(store or ())
    fast = _copy(model, probe, name, in_place_ops)
    made = [k for k in (store or ()) if k not in before]
    if made:
        if fast is model:
            _forget_sources(made)
        else:
            weakref.finalize(fast, _forget_sources, made)
    return fast


def _copy(model, probe, name, in_place_ops):
    if getattr(model, "opaque", False):  # not a torch graph (a TFLite black box): nothing to fold
        return model
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
            out = fast(probe)
            gap = _gap(out, ref)
    except Exception as e:  # noqa: BLE001  (a model that cannot be copied, or a copy that cannot run, stays as built)
        gap, why = float("inf"), f"{type(e).__name__}: {e}"
    else:
        why = f"logits differ by {gap:.2g} of the largest"
    if not gap <= RTOL:
        print(f"fuse: {name} kept as built ({why})", file=sys.stderr)
        return model
    if in_place_ops:  # only a copy the probe check accepted is worth rewriting
        fast = _slim(fast, probe, out)
    if hasattr(model, "arch_id"):
        fast.arch_id = model.arch_id
    return fast


def fixed_rows(n, size, device=None):
    """The rows of ``n`` that calls of exactly ``size`` rows take, in order (a list of index tensors): consecutive
    runs of ``size``, the last padded with copies of its last row (their answers are dropped)."""
    rows = torch.arange(n, device=device)
    pad = -n % size
    if pad:
        rows = torch.cat([rows, rows[-1:].expand(pad)])
    return list(rows.split(size))


class FixedBatch(nn.Module):
    """``model`` forwarded in calls of exactly ``size`` images (a config's ``fixed_batch``), the last call padded
    with copies of its last image and the padding's answers dropped (:func:`fixed_rows`).

    On a GPU the logits of one image move slightly with the batch it is forwarded in (kernels are chosen per
    shape), so a sample's record could depend on ``batch_size`` and on its neighbours; the rows of calls of one
    shape are computed independently of each other, so behind this wrapper a row's answer depends only on the
    row. The runner wraps a query run's target and surrogates and a transfer run's targets (the transfer worker
    attacks its batches in parts of ``size`` samples itself, so that feature hooks and surgery see whole calls).
    Gradients flow through to the input."""

    def __init__(self, model, size):
        super().__init__()
        self.model, self.size = model, int(size)

    def forward(self, x):
        n, k = x.shape[0], self.size
        if n == k or n == 0:
            return self.model(x)
        pad = -n % k  # the calls of fixed_rows, without gathering the rows
        if pad:
            x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
        return torch.cat([self.model(part) for part in x.split(k)])[:n]


def bare_model(model):
    """The model inside a :class:`FixedBatch` wrapper, else ``model`` (for what hashes weights: a cache key)."""
    return model.model if isinstance(model, FixedBatch) else model
