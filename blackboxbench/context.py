"""The block context: the one object every attack block receives, before its own parameters.

A block is ``fn(ctx, <pipeline arguments>, *, <its parameters>)``. The context carries everything a block may
use, and nothing else reaches it:

* ``problem``: the samples under attack (:class:`~blackboxbench.threat.Problem`: clean images, labels, targets,
  eps, norm). Blocks read it; they never modify it.
* ``rng``: the samples' random streams (:class:`~blackboxbench.rng.StreamView`). Every random number a block
  draws comes from here, so a sample's result depends only on the seed, its index and the config.
* ``oracle``: query attacks only, the samples' view of the counting oracle (scores or labels, no gradient).
* ``surrogates``: white-box models the attacker owns (transfer attacks; query attacks that declare
  ``surrogates:``). The config validation guarantees that none of them is the target.
* ``assets``: named trained artifacts declared under ``assets:`` (a model, a tensor file, ...).
* ``pool``: the attacker's own natural images with known labels (the dataset), e.g. to start a decision attack
  from an image of another (or the target) class.
* ``model``, ``t``, ``iterations``, ``alpha``: transfer attacks only, the refined surrogate being attacked and
  the position in the loop (iteration ``t`` of ``iterations``, step size ``alpha``).
* ``raw_grad``: transfer gradient blocks only, ``raw_grad(x)``: the gradient of the summed attack loss at ``x``
  *without* the input transformations (RAP's inner loop).
* ``grad_of``: transfer gradient blocks only, ``grad_of(x, model)``: the gradient of the summed attack loss at
  ``x``, with the input transformations, on ``model`` instead of ``ctx.model`` (one member of an ensemble, from
  :func:`~blackboxbench.transfer.refine.members`: CWA, AdaEA).
* ``aux``: transfer attacks only, what the ``auxiliary`` blocks computed once for the batch before the loop
  (Alg. 3 line 2: ILA's baseline features, FIA's aggregate gradient, NAA's integrated attention), by name.

``ctx.sub(rows)`` is the same context restricted to local samples ``rows`` (distinct), with the problem, the
oracle view and the random streams restricted alike.
"""
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from .rng import StreamView
from .threat import Problem


@dataclass(frozen=True)
class Pool:
    """Natural images ``x`` (N, C, H, W) with true labels ``y`` (N,) that the attacker owns (on CPU)."""

    x: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True)
class BlockContext:
    problem: Problem
    rng: StreamView
    oracle: Optional[Any] = None
    surrogates: Tuple[Any, ...] = ()
    assets: Mapping[str, Any] = field(default_factory=dict)
    pool: Optional[Pool] = None
    model: Optional[Any] = None
    t: int = 0
    iterations: int = 0
    alpha: float = 0.0
    raw_grad: Optional[Callable] = None
    grad_of: Optional[Callable] = None
    aux: Mapping[str, Any] = field(default_factory=dict)

    @property
    def device(self):
        return self.problem.x.device

    @property
    def index(self):
        """(n,) dataset indices of the samples (their stream ids)."""
        return self.rng.idx

    def rows(self, m):
        """The local sample of each of ``m`` rows that stack K = m / n copies of the n samples (copy k in rows
        k*n .. (k+1)*n - 1), for drawing random numbers per row: ``ctx.rng.uniform(shape, rows=ctx.rows(m))``."""
        n = self.problem.n
        if m % n:
            raise ValueError(f"{m} rows are not copies of {n} samples")
        return torch.arange(n, device=self.device).repeat(m // n)

    def sub(self, rows):
        """The context of local samples ``rows`` (a LongTensor of distinct local indices)."""
        return replace(self, problem=self.problem.sub(rows), rng=self.rng.sub(rows),
                       oracle=None if self.oracle is None else self.oracle.view(rows))

    def at(self, **loop):
        """The same context at another position of the transfer loop (``t``, ``model`` ...)."""
        return replace(self, **loop)

