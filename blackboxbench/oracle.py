"""The only door from a query attack to its target model.

The oracle counts every image forwarded per sample, refuses any image past a sample's budget (so the count can
never exceed ``max_queries``), and answers with log-probabilities (``score``) or labels (``label``) only,
detached, computed under ``no_grad``: a block cannot obtain a gradient through it.

A ``defense`` (:class:`blackboxbench.defense.DefendedTarget`) sits inside the oracle: every forwarded query goes
through it, with the sample that asked it (its randomness is the defender's, per sample). ``eot`` k (the
attack-side EOT option) makes each logical query k forwards of the image, aggregated (the mean of the
probabilities for scores, the majority label for labels) and charged as k queries.
"""
import math

import torch

from .errors import BenchError, QueryError
from .rng import rank_within_group  # noqa: F401  (re-exported)

FEEDBACKS = ("score", "label")


def forward_chunk(device):
    """Images per model call: on CPU, activations of large batches fall out of cache (ResNet-20 HSJA on 10 images,
    two seeds, two repetitions: chunk 64 / 128 / 256 took 26.0-28.4 / 27.2-27.7 / 30.6-34.2 CPU s, and 1024 costs
    1.7x per image, see benchmarks/RESULTS.md); a GPU wants large ones."""
    return 4096 if device.type == "cuda" else 128


PIXEL_TOL = 1e-6  # float slack on [0, 1] for query images (a clamp's output is exact)

class Oracle:
    """Query access to ``model`` for a batch of ``n`` samples, each with budget ``max_queries``.

    The oracle remembers its most recent call (a private copy of the images and the answers), so that
    :meth:`confirm` of one of those images again needs no forward (and, as no image is forwarded, costs no query).
    """

    def __init__(self, model, n, max_queries, num_classes, feedback="score", input_shape=None, chunk=None,
                 name="model", defense=None, eot=1, device=None, randomized=False):
        if feedback not in FEEDBACKS:
            raise BenchError(f"feedback must be one of {FEEDBACKS}, got '{feedback}'")
        if int(eot) < 1:
            raise BenchError(f"eot must be >= 1, got {eot}")
        self._forward, self.name, self.defense, self.eot = model, name, defense, int(eot)
        # a randomized target (the model itself, or a defense): confirm() never reuses the draw the attack selected on
        self.randomized = bool(randomized) or (defense is not None and defense.randomized)
        self.n, self.max_queries, self.feedback = n, int(max_queries), feedback
        self.num_classes = num_classes
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        if device is not None:  # the run's device: a model without parameters (TFLite) says nothing about it
            self.device = torch.device(device)
        else:
            self.device = next(iter(model.parameters()), torch.zeros(())).device if hasattr(model, "parameters") \
                else torch.device("cpu")
        self.chunk = chunk or forward_chunk(self.device)
        self.counts = torch.zeros(n, dtype=torch.long, device=self.device)
        self.forwarded = 0  # images actually forwarded, all samples together
        self._last = None  # (images, sample indices, answers) of the most recent call, for confirm()
        self._one = torch.ones((), dtype=torch.long, device=self.device)

    def remaining(self):
        return self.max_queries - self.counts

    def view(self, idx):
        """The oracle seen by samples ``idx`` (distinct indices), with local indices 0..len(idx)-1."""
        idx = idx.to(self.device)
        if torch.unique(idx).numel() != idx.numel():
            raise BenchError("oracle.view: sample indices must be distinct")
        return OracleView(self, idx)

    def __call__(self, x, idx=None):
        """Answer queries ``x`` (m, C, H, W) made for samples ``idx`` (m,), default one image per sample.

        Returns ``(answer, ok)``. Rows past their sample's budget are refused: not forwarded, not counted,
        ``ok`` False, and their answer is NaN (score) or -1 (label).
        """
        if idx is None:
            return self._ask(x, torch.arange(self.n, device=self.device), distinct=True)
        return self._ask(x, idx.to(self.device), distinct=False)

    def confirm(self, x, idx=None, draws=1):
        """As ``__call__``, but a row equal (bit for bit) to the image its sample had in the oracle's most recent
        call gets that answer again, without a forward or a count. Rows are one image per sample (``idx``
        distinct, else a :class:`QueryError`). Behind a randomized target (a randomized defense, or a model the runner
        found randomized: ``randomized``) nothing is reused: that answer is the draw the attack selected the
        image on, so the confirmation is a fresh draw, one counted query (as BlackboxBench's early-stop check and
        AutoAttack's final forward, both new draws).

        ``draws`` > 1 (the ``majority`` success rule, for randomized targets) asks every image ``draws`` times,
        each a counted query, and returns ``(adv_votes, answered)``: how many answers were adversarial is for the
        caller to judge, so this form returns the raw answers ``(m, draws, ...)`` and ``ok`` ``(m, draws)``.
        """
        idx = torch.arange(self.n, device=self.device) if idx is None else idx.to(self.device)
        x = x.to(self.device)
        if draws == 1 and idx.numel() and torch.unique(idx).numel() != idx.numel():  # one budget check per row
            raise QueryError("oracle.confirm: one image per sample (distinct indices); ask several images of a "
                             "sample with the oracle's call")
        if draws > 1:
            m = x.shape[0]
            answer, ok = self._ask(x.repeat(draws, 1, 1, 1), idx.repeat(draws), distinct=False)
            return answer.view(draws, m, *answer.shape[1:]).transpose(0, 1), ok.view(draws, m).T
        new = torch.ones(x.shape[0], dtype=torch.bool, device=self.device)  # rows the model must answer
        if self._last is not None and not self.randomized:
            last_x, last_idx, last_answer = self._last
            row = torch.full((self.n,), -1, dtype=torch.long, device=self.device)
            row[last_idx] = torch.arange(last_idx.numel(), device=self.device)
            row = row[idx]  # each sample's row in the last call, -1 if it had none
            had = (row >= 0).nonzero().squeeze(1)
            new[had[(x[had] == last_x[row[had]]).flatten(1).all(1)]] = False
        if bool(new.all()):
            return self._ask(x, idx, distinct=True)
        answer, ok = self._empty(x.shape[0]), torch.ones_like(new)
        answer[~new] = last_answer[row[~new]]
        if bool(new.any()):
            answer[new], ok[new] = self._ask(x[new], idx[new], distinct=True)
        return answer, ok

    @torch.no_grad()
    def _ask(self, x, idx, distinct):
        if x.dim() != 4 or x.shape[0] != idx.shape[0]:
            raise QueryError(f"oracle: expected queries (m, C, H, W) with m = len(idx) = {idx.shape[0]}, "
                             f"got shape {tuple(x.shape)}")
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            raise QueryError(f"oracle: query images must have shape {self.input_shape}, got {tuple(x.shape[1:])}")
        k = self.eot  # queries charged per image
        used = self.counts[idx] if distinct else self.counts[idx] + k * rank_within_group(idx)
        ok = used + k <= self.max_queries
        # one device sync for both checks: the images' value range (NaN fails both comparisons) and the budgets
        span = torch.stack(torch.aminmax(x.detach())).float().to(ok.device) if x.numel() else \
            torch.zeros(2, device=ok.device)
        lo, hi, all_ok = torch.cat([span, ok.all().float()[None]]).tolist()
        if not (lo >= -PIXEL_TOL and hi <= 1 + PIXEL_TOL):  # refused before anything is counted
            raise QueryError(f"oracle: query images must be finite and in [0, 1], got values in [{lo:.4g}, "
                             f"{hi:.4g}]")
        if all_ok:  # the common case: nothing refused
            xs, who = x.to(self.device, copy=True), idx  # under no_grad: a copy with no history
        else:
            rows = ok.nonzero().squeeze(1)
            xs, who = x[rows].to(self.device), idx[rows]
        self.counts.index_put_((who,), self._one * k, accumulate=True)
        self.forwarded += who.numel() * k
        version = xs._version  # torch's in-place write counter: a model or defense that writes to its input bumps it
        out = self._empty(0) if who.numel() == 0 else self._answer(xs, who)
        # Remember a call of one image per sample for confirm(), as copies no caller can modify (not when the model
        # wrote to the images it was given: the copy would no longer be the image forwarded).
        self._last = (xs, who, out.clone()) if distinct and xs._version == version else None
        if who.numel() == x.shape[0]:
            return out, ok
        answer = self._empty(x.shape[0])
        answer[ok] = out
        return answer, ok

    def _empty(self, m):
        if self.feedback == "score":
            return torch.full((m, self.num_classes), float("nan"), device=self.device)
        return torch.full((m,), -1, dtype=torch.long, device=self.device)

    def _logits(self, x, who):
        if self.defense is not None:
            return self.defense(x, who).float()
        if x.shape[0] <= self.chunk:
            return self._forward(x).float()
        return torch.cat([self._forward(x[i:i + self.chunk]).float() for i in range(0, x.shape[0], self.chunk)])

    def _answer(self, x, who):
        k, m = self.eot, x.shape[0]
        if k > 1:  # EOT: k copies of every image (copy j in rows j*m .. (j+1)*m - 1), aggregated below
            x, who = x.repeat(k, 1, 1, 1), who.repeat(k)
        logits = self._logits(x, who)
        bad = ~torch.isfinite(logits).all(1)
        if bool(bad.any()):
            raise BenchError(f"{self.name} returned non-finite logits (NaN or inf) for {int(bad.sum())} of "
                             f"{len(bad)} images; a NaN is never read as a class")
        if self.feedback == "score":
            logp = torch.log_softmax(logits, 1)
            return logp if k == 1 else torch.logsumexp(logp.view(k, m, -1), 0) - math.log(k)  # log mean prob
        labels = logits.argmax(1)
        return labels if k == 1 else torch.mode(labels.view(k, m), 0).values  # majority (ties: smallest label)


class OracleView:
    """The oracle seen by distinct samples ``idx`` of the batch; blocks use local indices 0..len(idx)-1.
    Made by :meth:`Oracle.view`."""

    def __init__(self, oracle, idx):
        self._oracle, self.idx = oracle, idx
        self.feedback, self.max_queries = oracle.feedback, oracle.max_queries

    @property
    def n(self):
        return self.idx.numel()

    @property
    def counts(self):
        return self._oracle.counts[self.idx]

    def remaining(self):
        return self._oracle.max_queries - self.counts

    def spent(self):
        """(n,) bool: the samples whose budget is used up."""
        return self.counts >= self._oracle.max_queries

    def view(self, idx):
        return self._oracle.view(self.idx[idx.to(self.idx.device)])

    def __call__(self, x, idx=None):
        if idx is None:  # one image per sample of the view: the indices are distinct
            return self._oracle._ask(x, self.idx, distinct=True)
        return self._oracle._ask(x, self.idx[idx.to(self.idx.device)], distinct=False)

    def confirm(self, x, idx=None, draws=1):
        return self._oracle.confirm(x, self.idx if idx is None else self.idx[idx.to(self.idx.device)], draws)
