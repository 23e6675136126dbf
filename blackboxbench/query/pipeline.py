"""The unified query-attack loop (Alg. 1 and Alg. 2 of the BlackboxBench paper, Supp. F-A/F-B), batched.

An attack is three blocks: ``init`` -> repeat (``perturb`` -> ``accept``) until each sample succeeds or exhausts
its budget. Block contracts (all tensors carry the batch on dim 0, blocks use local indices 0..n-1):

* ``init(problem, oracle, gen, **params) -> state``: a dict of tensors with leading dim n; it must hold
  ``x_adv`` (n, C, H, W) and ``success`` (n,) bool. It may query (e.g. to find a starting adversarial point).
* ``perturb(problem, state, oracle, gen, **params) -> proposal``: any object (typically candidate images);
  it may query (e.g. gradient estimation from label feedback).
* ``accept(problem, state, proposal, oracle, gen, **params) -> state``: queries the proposal if needed, keeps what
  improves, and sets ``success`` where the oracle has seen ``x_adv`` adversarial (score attacks) or where the
  adversarial ``x_adv`` lies inside the eps ball (decision attacks).

Only samples still being attacked are passed to ``perturb``/``accept``. A claimed success is confirmed with one
counted query of the exact uint8 image the attack will return (projected to the eps ball and [0, 1], quantized
towards the clean image); if the oracle does not confirm it, the sample keeps being attacked.
"""
from dataclasses import dataclass, field

import torch

from ..errors import BenchError


def _gather(state, idx):
    return {k: v[idx] for k, v in state.items()}


def _scatter(state, idx, sub, block):
    for k, v in sub.items():
        if k not in state:
            raise BenchError(f"block '{block}' added state key '{k}' that init did not create")
        state[k][idx] = v


@dataclass
class QueryResult:
    x_adv: torch.Tensor      # (n, C, H, W) quantized, inside the eps ball and [0, 1]
    success: torch.Tensor    # (n,) bool: the oracle saw x_adv adversarial
    queries: torch.Tensor    # (n,) long: images the oracle forwarded for each sample
    iterations: int = 0
    stalled: bool = False


@dataclass
class QueryAttack:
    """A built query attack: three bound blocks. Built by :func:`blackboxbench.builder.build_attack`."""

    name: str
    family: str
    init: object
    perturb: object
    accept: object
    max_iterations: int = 10**7
    meta: dict = field(default_factory=dict)

    def run(self, problem, oracle, gen):
        state = self.init(problem, oracle, gen)
        for key in ("x_adv", "success"):
            if key not in state:
                raise BenchError(f"init block of '{self.name}' must return state['{key}']")
        state["success"] = state["success"].clone()
        x_out = problem.quantize(problem.project(state["x_adv"]))
        verified = torch.zeros_like(state["success"])
        self._verify(problem, oracle, state, torch.arange(problem.n, device=problem.x.device), x_out, verified)
        it, stalled = 0, False
        while it < self.max_iterations:
            active = (~verified & (oracle.remaining() > 0)).nonzero().squeeze(1)
            if active.numel() == 0:
                break
            before = oracle.forwarded
            sub_p, sub_o, sub_s = problem.sub(active), oracle.view(active), _gather(state, active)
            proposal = self.perturb(sub_p, sub_s, sub_o, gen)
            sub_s = self.accept(sub_p, sub_s, proposal, sub_o, gen)
            _scatter(state, active, sub_s, self.name)
            self._verify(problem, oracle, state, active, x_out, verified)
            it += 1
            if oracle.forwarded == before:  # no block asked anything: nothing can change any more
                stalled = True
                break
        pending = ~verified
        x_out[pending] = problem.sub(pending.nonzero().squeeze(1)).quantize(
            problem.sub(pending.nonzero().squeeze(1)).project(state["x_adv"][pending]))
        return QueryResult(x_out, verified, oracle.counts.clone(), it, stalled)

    @staticmethod
    def _verify(problem, oracle, state, idx, x_out, verified):
        """Confirm new claims of success on the exact image to be returned (one counted query each)."""
        claim = idx[state["success"][idx] & ~verified[idx]]
        if claim.numel() == 0:
            return
        p = problem.sub(claim)
        candidate = p.quantize(p.project(state["x_adv"][claim]))
        answer, ok = oracle(candidate, claim)
        good = p.is_adv(answer) & ok
        verified[claim[good]] = True
        x_out[claim[good]] = candidate[good]
        state["success"][claim[~good]] = False
