"""The only door from a query attack to its target model.

The oracle counts every image forwarded per sample, refuses any image past a sample's budget (so the count can
never exceed ``max_queries``), and answers with log-probabilities (``score``) or labels (``label``) only,
detached, computed under ``no_grad``: a block cannot obtain a gradient through it.
"""
import torch

from .errors import BenchError

FEEDBACKS = ("score", "label")


def rank_within_group(idx):
    """For each position i, how many earlier positions share ``idx[i]`` (vectorized, stable)."""
    order = torch.sort(idx, stable=True).indices
    sorted_idx = idx[order]
    first = torch.searchsorted(sorted_idx, sorted_idx, right=False)
    rank = torch.empty_like(idx)
    rank[order] = torch.arange(idx.numel(), device=idx.device) - first
    return rank


class Oracle:
    """Query access to ``model`` for a batch of ``n`` samples, each with budget ``max_queries``."""

    def __init__(self, model, n, max_queries, num_classes, feedback="score", input_shape=None, chunk=None):
        if feedback not in FEEDBACKS:
            raise BenchError(f"feedback must be one of {FEEDBACKS}, got '{feedback}'")
        self._forward = model
        self.n, self.max_queries, self.feedback = n, int(max_queries), feedback
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.device = next(iter(model.parameters()), torch.zeros(())).device if hasattr(model, "parameters") \
            else torch.device("cpu")
        # Forward in chunks: ~256 images is the CPU sweet spot (1024-image batches cost 1.7x per image on
        # ResNet-20, see benchmarks/RESULTS.md); a GPU wants larger ones.
        self.chunk = chunk or (4096 if self.device.type == "cuda" else 256)
        self.counts = torch.zeros(n, dtype=torch.long, device=self.device)
        self.forwarded = 0  # images actually forwarded, all samples together

    def remaining(self):
        return self.max_queries - self.counts

    def view(self, idx):
        return OracleView(self, idx)

    @torch.no_grad()
    def __call__(self, x, idx=None):
        """Answer queries ``x`` (m, C, H, W) made for samples ``idx`` (m,), default one image per sample.

        Returns ``(answer, ok)``. Rows past their sample's budget are refused: not forwarded, not counted,
        ``ok`` False, and their answer is NaN (score) or -1 (label).
        """
        if idx is None:
            idx = torch.arange(self.n, device=self.device)
        idx = idx.to(self.device)
        if x.dim() != 4 or x.shape[0] != idx.shape[0]:
            raise BenchError(f"oracle: expected queries (m, C, H, W) with m = len(idx) = {idx.shape[0]}, "
                             f"got shape {tuple(x.shape)}")
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            raise BenchError(f"oracle: query images must have shape {self.input_shape}, got {tuple(x.shape[1:])}")
        ok = self.counts[idx] + rank_within_group(idx) < self.max_queries
        rows = ok.nonzero().squeeze(1)
        self.counts.index_add_(0, idx[rows], torch.ones_like(rows))
        self.forwarded += rows.numel()
        xs = x.detach()[rows].to(self.device)
        outs = [self._answer(xs[i:i + self.chunk]) for i in range(0, xs.shape[0], self.chunk)]
        if self.feedback == "score":
            answer = torch.full((x.shape[0], self.num_classes), float("nan"), device=self.device)
        else:
            answer = torch.full((x.shape[0],), -1, dtype=torch.long, device=self.device)
        if outs:
            answer[rows] = torch.cat(outs)
        return answer, ok

    def _answer(self, x):
        logits = self._forward(x).float()
        return torch.log_softmax(logits, 1) if self.feedback == "score" else logits.argmax(1)


class OracleView:
    """The oracle seen by a subset ``idx`` of the batch; blocks use local indices 0..len(idx)-1."""

    def __init__(self, oracle, idx):
        self.oracle, self.idx = oracle, idx.to(oracle.device)
        self.feedback, self.max_queries = oracle.feedback, oracle.max_queries

    @property
    def n(self):
        return self.idx.numel()

    @property
    def counts(self):
        return self.oracle.counts[self.idx]

    def remaining(self):
        return self.oracle.max_queries - self.counts

    def view(self, idx):
        return OracleView(self.oracle, self.idx[idx.to(self.idx.device)])

    def __call__(self, x, idx=None):
        local = torch.arange(self.n, device=self.idx.device) if idx is None else idx.to(self.idx.device)
        return self.oracle(x, self.idx[local])
