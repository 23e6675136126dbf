"""The threat model as pure tensor functions: projection, uint8 quantization, distances, success criteria.

Images are NCHW float in [0, 1]; epsilon is in the same [0, 1] pixel units (a config may write ``8/255``).
"""
import math
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from .errors import BenchError

NORMS = ("linf", "l2")


def flat_norm(v, norm):
    """Per-sample norm of a batch ``v`` (N, ...) -> (N,)."""
    v = v.flatten(1)
    return v.abs().amax(1) if norm == "linf" else torch.linalg.vector_norm(v, dim=1)


def dist(x_adv, x, norm):
    return flat_norm(x_adv - x, norm)


def per_sample(v, like):
    """Per-sample values ``v`` (n,) (or one scalar) shaped (n, 1, ..., 1) to broadcast against a batch ``like``."""
    v = torch.as_tensor(v, dtype=like.dtype, device=like.device)
    return v.view(-1, *([1] * (like.dim() - 1))) if v.dim() else v


def rows_where(mask, a, b):
    """Row ``i`` of ``a`` where ``mask[i]`` else row ``i`` of ``b`` (``mask`` (n,) bool, ``a``/``b`` (n, ...))."""
    return torch.where(mask.view(-1, *([1] * (a.dim() - 1))), a, b)


def project(x_adv, x, eps, norm):
    """Project onto the ``norm`` ball of radius ``eps`` around ``x``, then onto [0, 1].

    A point inside the ball (in float arithmetic) comes back bit for bit, only clipped to [0, 1]; a point on its
    surface may move by a float rounding error. For L2 the ball projection comes first; clipping to [0, 1]
    afterwards only moves a coordinate towards ``x`` (``x`` itself lies in [0, 1]), so the result stays inside.
    """
    if norm == "linf":
        e = per_sample(eps, x)
        inside = torch.minimum(torch.maximum(x_adv, x - e), x + e)
    else:
        delta = x_adv - x
        n = flat_norm(delta, "l2").clamp_min(1e-12)
        scale = torch.clamp(torch.as_tensor(eps, device=n.device, dtype=n.dtype) / n, max=1.0)
        inside = rows_where(scale < 1, x + delta * per_sample(scale, delta), x_adv)
    return inside.clamp(0.0, 1.0)


def quantize(x_adv, x):
    """Round ``x_adv`` to the uint8 grid *towards* the clean image ``x`` (itself on the grid).

    Every coordinate of the perturbation shrinks in magnitude, so any Lp norm never grows and the image stays in
    [0, 1]: an output inside the eps ball stays inside it after quantization.
    """
    q, _ = _grid_round(x_adv, x, outward=False)
    return (q.clamp(0, 255) / 255.0).to(x_adv.dtype)


def quantize_l2(x_adv, x, eps):
    """Round ``x_adv`` to the uint8 grid within the L2 ball of radius ``eps`` about the clean image ``x``: each
    coordinate to its nearest level, except that where the nearest level lies outward (away from the clean level)
    the outward roundings are kept cheapest first (the extra squared length ``2 m + 1`` levels^2 of a coordinate
    ``m`` levels out) while the ball has room, the rest rounded towards the clean image (:func:`quantize`'s rule).

    An L2 perturbation is spread thin: at a float success of NES at L2 1.0 on CIFAR-10, 81 % of the pixels move by
    less than one level, so rounding every coordinate towards the clean image zeroes them and keeps about 56 % of
    the L2 length, and none of 19 such images stayed adversarial (``benchmarks/RESULTS.md``, "Score attacks against
    BlackboxBench's port"). Rows are rounded independently; the output is in [0, 1] and inside the ball."""
    q_in, c = _grid_round(x_adv, x, outward=False)
    near = torch.round(x_adv * 255.0)
    m = (q_in - c).abs().flatten(1)
    extra = torch.where((near != q_in).flatten(1), 2 * m + 1, torch.full_like(m, float("inf")))
    room = (float(eps) * 255.0) ** 2 * (1 - 1e-6) - m.pow(2).sum(1, keepdim=True)
    cost, order = extra.sort(dim=1, stable=True)
    keep = torch.zeros_like(extra, dtype=torch.bool).scatter(1, order, cost.cumsum(1) <= room)
    q = torch.where(keep.view_as(q_in), near, q_in)
    return (q.clamp(0, 255) / 255.0).to(x_adv.dtype)


def _grid_round(x_adv, x, outward):
    """``x_adv`` in uint8 levels (255 x), each coordinate rounded towards (or away from) the clean image's level;
    returns (rounded levels, clean levels). Values within 1e-3 of a level belong to it (float noise of 255 k/255).
    """
    a, c = x_adv * 255.0, torch.round(x * 255.0)
    tol = 1e-3
    if outward:
        return torch.where(a >= c, torch.ceil(a - tol), torch.floor(a + tol)), c
    return torch.where(a >= c, torch.floor(a + tol), torch.ceil(a - tol)), c


def grid_levels(eps):
    """uint8 levels spanned by a Linf radius ``eps`` on the grid: floor(255 eps), tolerant of float noise (8/255
    gives 8). ``grid_levels(eps) / 255`` is the largest radius a uint8 image within ``eps`` can reach."""
    return math.floor(eps * 255 + 1e-6)


def quantize_outward(x_adv, x, eps):
    """Round ``x_adv`` to the uint8 grid *away from* the clean image ``x``, then clip to the largest Linf ball of
    radius <= ``eps`` on the grid (:func:`grid_levels`) and to [0, 1].

    Every perturbed coordinate keeps its sign and grows to the next grid level, so a point inside the Linf ball
    keeps its direction and leaves the rounding no room to pull it back across a decision boundary.
    """
    q, c = _grid_round(x_adv, x, outward=True)
    levels = grid_levels(eps)
    q = torch.minimum(torch.maximum(q, c - levels), c + levels)
    return (q.clamp(0, 255) / 255.0).to(x_adv.dtype)


def margin_loss(scores, y, target=None):
    """CW margin on logits or log-probabilities (identical up to a per-sample constant).

    Untargeted: s_y - max_{j != y} s_j. Targeted: max_{j != t} s_j - s_t. The sample is adversarial when < 0.
    """
    label = (y if target is None else target).unsqueeze(1)
    own = scores.gather(1, label).squeeze(1)
    other = scores.scatter(1, label, float("-inf")).amax(1)
    return own - other if target is None else other - own


@dataclass
class Problem:
    """One batch under attack: clean images, labels, the threat model. Blocks only read it."""

    x: torch.Tensor
    y: torch.Tensor
    eps: float
    norm: str
    target: Optional[torch.Tensor] = None
    num_classes: int = 10

    def __post_init__(self):
        if self.norm not in NORMS:  # flat_norm would read any other name as L2
            raise BenchError(f"unknown norm '{self.norm}': one of {', '.join(NORMS)}")

    @property
    def targeted(self):
        return self.target is not None

    @property
    def n(self):
        return self.x.shape[0]

    def copy(self):
        """The same problem with clean images, labels and targets of its own: what blocks get, so that one writing
        to them in place changes nothing the runner reads (verification, projection, output check, records)."""
        return replace(self, x=self.x.clone(), y=self.y.clone(),
                       target=None if self.target is None else self.target.clone())

    def sub(self, idx):
        """The same problem restricted to samples ``idx`` (a LongTensor)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(x=self.x[idx], y=self.y[idx], target=None if self.target is None else self.target[idx])
        return Problem(**kw)

    def project(self, x_adv):
        return project(x_adv, self.x, self.eps, self.norm)

    def dist(self, x_adv):
        return dist(x_adv, self.x, self.norm)

    def quantize(self, x_adv):
        """``x_adv`` on the uint8 grid, inside the ball: L2 by :func:`quantize_l2` (nearest levels while the ball
        has room), Linf by :func:`quantize` (towards the clean image)."""
        return quantize_l2(x_adv, self.x, self.eps) if self.norm == "l2" else quantize(x_adv, self.x)

    def margin(self, scores):
        """Margin loss from score feedback; < 0 means adversarial. NaN rows (refused queries) stay NaN."""
        return margin_loss(scores, self.y, self.target)

    def is_adv_label(self, labels):
        """Success from predicted labels (n,) or (n, k) (refused queries, label -1, never count as success)."""
        shape = (-1, *([1] * (labels.dim() - 1)))
        ok = labels >= 0
        hit = labels == self.target.view(shape) if self.targeted else labels != self.y.view(shape)
        return ok & hit

    def is_adv(self, answer):
        """Success from an oracle answer of either feedback kind."""
        if answer.dtype.is_floating_point:
            return self.is_adv_label(torch.where(torch.isnan(answer[:, 0]), -1, answer.argmax(1)))
        return self.is_adv_label(answer)
