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

Only samples still being attacked are passed to ``perturb``/``accept``: the pipeline keeps them as a compact
working set (their problem, oracle view and a private copy of their state), rebuilt only when a sample leaves it,
so blocks may update the state dict they receive in place. A claimed success is confirmed by the oracle on the
exact uint8 image the attack will return (projected to the eps ball and [0, 1], quantized towards the clean
image): one counted query, or none when that image is the last one the oracle answered for the sample (see
:meth:`blackboxbench.oracle.Oracle.confirm`). If the oracle does not confirm it, the sample keeps being attacked.
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
        state = {k: v.clone() for k, v in state.items()}  # the pipeline's own copy: scattered into below
        x_out = problem.quantize(problem.project(state["x_adv"]))
        verified = torch.zeros_like(state["success"])
        everyone = torch.arange(problem.n, device=problem.x.device)
        self._verify(problem, oracle.view(everyone), state, everyone, x_out, verified)
        it, stalled, active = 0, False, None
        while it < self.max_iterations:
            if active is None:  # (re)build the working set: only samples still being attacked
                active = (~verified & (oracle.remaining() > 0)).nonzero().squeeze(1)
                if active.numel() == 0:
                    break
                sub_p, sub_o, sub_s = problem.sub(active), oracle.view(active), _gather(state, active)
            before = oracle.forwarded
            proposal = self.perturb(sub_p, sub_s, sub_o, gen)
            sub_s = self.accept(sub_p, sub_s, proposal, sub_o, gen)
            # One check (one sync) per iteration: did a sample claim success or use up its budget?
            if bool((sub_s["success"] | sub_o.spent()).any()):
                now = self._verify(sub_p, sub_o, sub_s, active, x_out, verified)
                spent = sub_o.spent()  # after the confirmations, which may query
                leaving = bool((spent if now is None else spent | now).any())
            else:
                leaving = False
            it += 1
            stalled = oracle.forwarded == before and not leaving  # nothing asked, nothing decided
            if stalled or leaving or it == self.max_iterations:
                _scatter(state, active, sub_s, self.name)
                if stalled:
                    break
                active = None  # shrink the working set only when a sample leaves it
        pending = (~verified).nonzero().squeeze(1)
        p = problem.sub(pending)
        x_out[pending] = p.quantize(p.project(state["x_adv"][pending]))
        return QueryResult(x_out, verified, oracle.counts.clone(), it, stalled)

    @staticmethod
    def _verify(problem, oracle, state, active, x_out, verified):
        """Confirm the claims of success in ``state`` (local to ``problem``/``oracle``, global indices ``active``)
        on the exact image to be returned; returns the (len(active),) mask of samples verified now, or None when
        nothing was claimed.

        The oracle answers each claim with one counted query, or without a forward when it answered that very
        image in its most recent call (a score attack whose accepted candidate is already on the uint8 grid).
        """
        claim = state["success"].nonzero().squeeze(1)
        if claim.numel() == 0:
            return None
        now = torch.zeros_like(state["success"])
        p = problem.sub(claim)
        candidate = p.quantize(p.project(state["x_adv"][claim]))
        answer, ok = oracle.confirm(candidate, claim)
        good = p.is_adv(answer) & ok
        now[claim[good]] = True
        verified[active[claim[good]]] = True
        x_out[active[claim[good]]] = candidate[good]
        state["success"] = state["success"].index_put((claim[~good],), torch.tensor(False, device=claim.device))
        return now
