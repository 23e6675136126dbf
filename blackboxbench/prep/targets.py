"""Target labels for targeted attacks (registry ``TARGET_LABEL``), after Supp. D-B of the paper.

Supp. D-B offers five target types, "random", "least likely", "most likely", "median" and "specified label",
and uses "median" for its evaluation. Each mode is ``fn(logits, y, rng, given, *, ...) -> LongTensor (N,)``:
``logits`` (N, K) from the target model (log-probabilities rank the same), ``y`` the true labels, ``rng`` the
samples' random streams (:class:`~blackboxbench.rng.StreamView`), ``given`` the dataset's own targets or None.
Every mode except ``specified`` excludes ``y``.
"""
import torch

from ..errors import BenchError
from ..registry import TARGET_LABEL, block_label


def _rank_without_y(logits, y):
    """Classes other than ``y`` sorted by decreasing logit: (N, K-1)."""
    order = logits.argsort(dim=1, descending=True, stable=True)
    return order[order != y[:, None]].view(len(y), -1)


def choose_targets(spec, logits, y, rng, given):
    """The targets of mode ``spec`` ({name: mode, **params}) for a batch: one class id per sample, checked (a
    plugin mode that returns anything else is one line naming it, not an index error deep in a loss)."""
    params = dict(spec)
    fn = TARGET_LABEL.get(params.pop("name"))
    out = fn(logits, y, rng, given, **params)
    k = logits.shape[1]
    if not isinstance(out, torch.Tensor) or out.shape != y.shape or out.dtype not in (torch.int64, torch.int32):
        got = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise BenchError(f"target_label {block_label(fn)} returned {got}: it returns one integer class id per "
                         f"sample, shape {tuple(y.shape)}")
    if out.numel() and bool(((out < 0) | (out >= k)).any()):
        raise BenchError(f"target_label {block_label(fn)} returned class ids {int(out.min())}..{int(out.max())}: "
                         f"they must be in [0, {k})")
    return out.long()


@TARGET_LABEL.register("random", paper="Supp. D-B")
def random(logits, y, rng, given):
    """Uniform over the K-1 classes other than ``y`` (from each sample's own stream)."""
    high = torch.full_like(y, logits.shape[1] - 1)
    r = rng.randint_below(high).to(y.device)
    return r + (r >= y).long()


@TARGET_LABEL.register("least_likely", paper="Supp. D-B")
def least_likely(logits, y, rng, given):
    """The class with the lowest logit (the next lowest when that is ``y``)."""
    return _rank_without_y(logits, y)[:, -1]


@TARGET_LABEL.register("most_likely", paper="Supp. D-B")
def most_likely(logits, y, rng, given):
    """The class with the highest logit among those other than ``y``."""
    return _rank_without_y(logits, y)[:, 0]


@TARGET_LABEL.register("median", paper="Supp. D-B (the paper's default)")
def median(logits, y, rng, given):
    """The class at the median rank of the K-1 classes other than ``y`` (rank (K-2)//2 from the top; for
    CIFAR-10 the 5th of 9). The reference code takes the 5th-ranked class of all K: for a correctly classified
    CIFAR-10 sample that is one rank above this median, and for K = 1000 far from any median."""
    return _rank_without_y(logits, y)[:, (logits.shape[1] - 2) // 2]


@TARGET_LABEL.register("specified", paper="Supp. D-B", ranges={"label": "int [0, inf)"})
def specified(logits, y, rng, given, *, label=None):
    """One fixed ``label`` for every sample, or with ``label=None`` the dataset's targets ``given`` (e.g. the
    NIPS-2017 targets). Samples whose ``y`` equals their target are returned as they are: the runner skips
    them (they are already "adversarial")."""
    k = logits.shape[1]
    if label is None:
        if given is None:
            raise BenchError("target label 'specified': set label, or use a dataset that provides targets")
        t = torch.as_tensor(given, dtype=torch.long, device=y.device)
    else:
        t = torch.full_like(y, int(label))
    if t.shape != y.shape or bool(((t < 0) | (t >= k)).any()):
        raise BenchError(f"target label 'specified': targets must be {len(y)} class ids in [0, {k})")
    return t
