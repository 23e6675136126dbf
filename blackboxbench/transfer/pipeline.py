"""The unified transfer-attack loop (Alg. 3 of the BlackboxBench paper, Supp. F-C), batched.

Block contracts (``state`` is one dict per batch that blocks may use to keep e.g. momentum):

* ``refine(models, gen, **params) -> models``: surrogate refinement on the list of surrogates, once before the
  loop; it must end with one model (e.g. ``logit_ensemble`` fuses several).
* ``transform(x, gen, **params) -> x'``: input transformation. It may return K stacked copies (K*n, C, H, W);
  the loss then sees the label repeated K times. Listed transforms compose in order.
* ``loss(logits, label, targeted, **params) -> (N,)``: per-sample loss that the attack *maximizes*.
* ``gradient(grad_fn, x, state, gen, **params) -> grad``: gradient calculation; ``grad_fn(x)`` is the gradient
  of the summed loss of the transformed input, and a listed gradient block wraps the one before it.
* ``direction(grad, state, **params) -> direction``: update direction (e.g. momentum). Listed ones chain.
* ``update(x_adv, direction, problem, alpha, **params) -> x_adv``: one step, then projection to the eps ball.

The output is projected to the eps ball and [0, 1] and quantized to uint8 towards the clean image.
"""
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, List

import torch

from ..errors import BenchError


def _chain_transforms(transforms, x, gen):
    for t in transforms:
        x = t(x, gen=gen)
    return x


@dataclass
class TransferAttack:
    """A built transfer attack. Built by :func:`blackboxbench.builder.build_attack`."""

    name: str
    iterations: int
    alpha: float
    loss: Callable
    update: Callable
    transforms: List[Callable] = field(default_factory=list)
    gradients: List[Callable] = field(default_factory=list)
    directions: List[Callable] = field(default_factory=list)
    refiners: List[Callable] = field(default_factory=list)
    random_start: float = 0.0
    meta: dict = field(default_factory=dict)

    def refine(self, models, gen):
        """Apply the refiners to the list of surrogates; returns the single model to attack."""
        for r in self.refiners:
            models = r(models, gen=gen)
        if len(models) != 1:
            raise BenchError(f"attack '{self.name}': {len(models)} surrogates but no refine block fuses them "
                             "(add e.g. logit_ensemble)")
        return models[0]

    def grad_fn(self, model, problem, state, gen):
        """The raw gradient function: d/dx of the summed loss on the transformed input."""
        label = problem.target if problem.targeted else problem.y

        def fn(x):
            x = x.detach().requires_grad_(True)
            xt = _chain_transforms(self.transforms, x, gen)
            k = xt.shape[0] // x.shape[0]
            logits = model(xt)
            loss = self.loss(logits, label.repeat(k), problem.targeted).sum()
            return torch.autograd.grad(loss, x)[0]

        for g in self.gradients:
            fn = partial(g, fn, state=state, gen=gen)
        return fn

    def run(self, model, problem, gen):
        """Craft adversarial images for ``problem`` on the refined surrogate ``model``."""
        state = {}
        x_adv = problem.x.clone()
        if self.random_start > 0:
            noise = torch.rand(problem.x.shape, generator=gen, device=gen.device) * 2 - 1
            x_adv = problem.project(x_adv + self.random_start * noise.to(x_adv.device))
        grad = self.grad_fn(model, problem, state, gen)
        for _ in range(self.iterations):
            d = grad(x_adv)
            for direction in self.directions:
                d = direction(d, state=state)
            x_adv = problem.project(self.update(x_adv, d, problem=problem, alpha=self.alpha))
        return problem.quantize(x_adv)
