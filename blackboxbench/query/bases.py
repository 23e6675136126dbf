"""BASES (Cai, Song, Krishnamurthy, Roy-Chowdhury, Asif, "Blackbox Attacks via Surrogate Ensemble Search",
NeurIPS 2022), Linf and L2.

A perturbation machine ``PM(w)``, white-box PGD on the weighted surrogate ensemble loss ``sum_k w_k L_k`` (``L_k``
the CW margin of surrogate ``k``'s logits, lower is better), makes candidate images; the attack searches the weights
``w`` (one per surrogate, per sample) with the target's answers:

* ``bases_init``: ``w = 1/N`` for the N surrogates, ``x_adv = PM(w)`` from the clean image, one query.
* ``bases`` (perturb): for the current coordinate ``k`` (cycling 0, 1, ..., N-1), the two candidates
  ``PM(w + eta e_k)`` and ``PM(w - eta e_k)``, each warm-started from ``x_adv`` (as the authors' ``adv_init``).
  Surrogate work only; no query.
* ``bases_select`` (accept): both candidates in one oracle call (2 queries); an adversarial one is taken (``+``
  first), else the one with the lower target margin, unconditionally (the authors' update does not compare with
  the current point); ``w`` moves with it and the coordinate advances.

The search is the authors' ``while n_query < iterw`` loop: a sample's candidates are counted as the authors count
queries (the first image, then ``+``, then ``-`` unless ``+`` succeeded), and a sample whose count reached
``iterw`` (50, their default) makes no more candidates; it asks nothing and the pipeline ends it as stalled, at
most ``iterw + 1`` candidate queries in (their loop can overshoot by one as well); the pipeline's confirmation queries
of claims that rounding to the uint8 grid undoes come on top. The run's query budget caps it too.

PM: ``iters`` PGD steps of size ``step * eps / iters``: Linf sign steps, L2 steps along the L2-normalised
gradient, each projected onto the eps ball and [0, 1]. All samples' candidates run through the surrogates in one
batched forward/backward per PGD step.

**Answer memory.** The PM is deterministic and invariant to the scale of ``w`` (sign or normalised steps), so the
search often proposes an image it has already asked about: with one surrogate ``PM(w + eta e)`` and
``PM(w - eta e)`` are always the same image, and the warm-started PGD ends in fixed points or short cycles
(digits, targeted Linf 0.3, one surrogate: 5 of 11 samples). Each sample remembers its last ``MEMORY`` queried
images with their margins (state ``memo_x``, ``memo_margin``); a candidate equal to one of them, or to the other
candidate, is not asked again. A sample whose candidates are all known asks nothing and the pipeline ends it as
stalled (it can only revisit images whose answers it has), instead of spending the rest of the budget on repeats.

Defaults (not in BlackboxBench Table VI; the paper's Sec. 4 setup and the authors' ``query_w_bb.py``): PGD with
10 iterations, step 3 eps / 10 (``--x 3``), loss fusion of CW losses, ``w`` initialised uniform, ``eta`` 0.005
(``--lr``), at most ``iterw`` 50 candidates per sample (``--iterw``). Deviations: the authors query
``w - eta e_k`` only when ``w + eta e_k`` failed; here both are asked in one call, so a success costs at most one
query more (the search has no other per-iteration shape that keeps every sample's queries in one call). Their
code also takes sign steps under L2 (a step of 3 eps / 10 per pixel), and halves ``eta`` under a condition that
never holds with more than one surrogate: this PM uses normalised gradient steps under L2, and ``eta`` stays
constant. ``w`` is not renormalised (as in the authors' code).
"""
import torch

from ..registry import ACCEPT, INIT, PERTURB
from ..threat import rows_where
from .common import l2_normalize, query_margin, start_state
from .prgf import surrogate_gradient, surrogate_loss

PAPER = "Cai, Song, Krishnamurthy, Roy-Chowdhury, Asif, Blackbox Attacks via Surrogate Ensemble Search, NeurIPS 2022"
PM_RANGES = {"iters": "int [1, inf)", "step": "(0, inf)"}
MEMORY = 4  # queried images each sample remembers (catches fixed points and cycles up to this length)


def perturbation_machine(ctx, x_start, weights, rows, iters, step):
    """``iters`` PGD steps on ``sum_k weights[:, k] L_k`` from ``x_start`` (m, C, H, W) for local samples ``rows``
    (m,) (a sample may have several rows), projected onto each sample's eps ball and [0, 1]."""
    p = ctx.problem.sub(rows)
    y, target = p.y, p.target
    alpha = step * p.eps / iters

    def loss(k, logits, r):
        return surrogate_loss(logits, y[r], None if target is None else target[r], "margin")

    x = x_start
    for _ in range(iters):
        g = surrogate_gradient(ctx.surrogates, x, loss, weights=weights)
        x = p.project(x - alpha * (g.sign() if p.norm == "linf" else l2_normalize(g)))
    return x


@INIT.register("bases_init", paper=PAPER, norms=("linf", "l2"), needs=("surrogates",), ranges=PM_RANGES)
def bases_init(ctx, *, iters=10, step=3.0):
    """``x_adv = PM(w)`` with uniform weights ``w`` (n, N), from the clean image; one query. State adds ``w``, the
    next coordinate ``coord`` (n,), the candidates counted so far ``asked`` (n,) (the authors' ``n_query``: 1) and
    the answer memory (``memo_x`` (n, MEMORY, C, H, W), ``memo_margin``
    (n, MEMORY), +inf where empty, and the next slot ``memo_next`` (n,))."""
    p = ctx.problem
    n, k, dev = p.n, len(ctx.surrogates), p.x.device
    w = torch.full((n, k), 1.0 / k, dtype=torch.float64, device=dev)
    x0 = perturbation_machine(ctx, p.x.clone(), w, torch.arange(n, device=dev), iters, step)
    zero = torch.zeros(n, dtype=torch.long, device=dev)
    state = start_state(ctx, x0, w=w, coord=zero, asked=zero + 1)
    memo_x = x0[:, None].repeat(1, MEMORY, *([1] * (x0.dim() - 1)))
    memo_margin = torch.full((n, MEMORY), float("inf"), device=dev)
    memo_margin[:, 0] = state["margin"]
    state.update(memo_x=memo_x, memo_margin=memo_margin, memo_next=torch.ones(n, dtype=torch.long, device=dev))
    return state


@PERTURB.register("bases", paper=PAPER, norms=("linf", "l2"), needs=("surrogates",),
                  ranges={"eta": "(0, inf)", "iterw": "int [1, inf)", **PM_RANGES})
def bases(ctx, state, *, eta=0.005, iters=10, step=3.0, iterw=50):
    """The candidates ``PM(w +- eta e_coord)`` warm-started from ``x_adv`` (no query) of the samples that have
    counted fewer than ``iterw`` candidates (``live``): a dict with ``plus`` and ``minus`` images (n, C, H, W)
    (``x_adv`` where not live), their weights ``w_plus``, ``w_minus`` (n, N) and ``live`` (n,)."""
    x_adv = state["x_adv"]
    e = torch.nn.functional.one_hot(state["coord"], state["w"].shape[1]).to(state["w"]) * eta
    w_plus, w_minus = state["w"] + e, state["w"] - e
    live = state["asked"] < iterw
    idx = live.nonzero().squeeze(1)
    plus, minus = x_adv.clone(), x_adv.clone()
    if idx.numel():
        m = idx.numel()
        x = perturbation_machine(ctx, x_adv[idx].repeat(2, 1, 1, 1), torch.cat([w_plus[idx], w_minus[idx]]),
                                 idx.repeat(2), iters, step)
        plus[idx], minus[idx] = x[:m], x[m:]
    return dict(plus=plus, minus=minus, w_plus=w_plus, w_minus=w_minus, live=live)


def _recall(memo_x, memo_margin, images):
    """The remembered margin of each sample's ``images`` (n, C, H, W): +inf and False where not remembered."""
    hit = (memo_x == images[:, None]).flatten(2).all(2) & torch.isfinite(memo_margin)  # (n, MEMORY)
    margin = torch.where(hit, memo_margin, float("inf")).amin(1)
    return margin, hit.any(1)


@ACCEPT.register("bases_select", paper=PAPER, norms=("linf", "l2"))
def bases_select(ctx, state, proposal):
    """Ask about both candidates of the live samples (one call, up to 2 queries per sample; remembered images and
    a duplicate second candidate are not asked again) and move to the adversarial one (``+`` first) or else to the
    one with the lower margin; refused candidates are never taken. The coordinate advances, and ``asked`` counts
    the candidates as the authors do (``-`` only when ``+`` was not adversarial)."""
    n, dev = ctx.problem.n, state["x_adv"].device
    plus, minus = proposal["plus"], proposal["minus"]
    m_plus, known_plus = _recall(state["memo_x"], state["memo_margin"], plus)
    m_minus, known_minus = _recall(state["memo_x"], state["memo_margin"], minus)
    twin = (plus == minus).flatten(1).all(1)
    live = proposal["live"]
    ask_plus, ask_minus = live & ~known_plus, live & ~known_minus & ~(twin & ~known_plus)
    everyone = torch.arange(n, device=dev)
    rows = torch.cat([everyone[ask_plus], everyone[ask_minus]])
    margin, _, ok = query_margin(ctx, torch.cat([plus[ask_plus], minus[ask_minus]]), rows)
    k = int(ask_plus.sum())
    ok_plus, ok_minus = known_plus.clone(), known_minus.clone()
    m_plus[ask_plus], ok_plus[ask_plus] = margin[:k], ok[:k]
    m_minus[ask_minus], ok_minus[ask_minus] = margin[k:], ok[k:]
    copy = twin & ask_plus  # the second candidate is the first: its answer
    m_minus, ok_minus = torch.where(copy, m_plus, m_minus), torch.where(copy, ok_plus, ok_minus)
    adv_plus, adv_minus = ok_plus & (m_plus < 0), ok_minus & (m_minus < 0)
    take_plus = adv_plus | (~adv_minus & (m_plus < m_minus))
    moved = live & torch.where(take_plus, ok_plus, ok_minus)
    state = dict(state)
    state["x_adv"] = rows_where(moved, rows_where(take_plus, plus, minus), state["x_adv"])
    state["w"] = rows_where(moved, rows_where(take_plus, proposal["w_plus"], proposal["w_minus"]), state["w"])
    state["margin"] = torch.where(moved, torch.where(take_plus, m_plus, m_minus), state["margin"])
    state["success"] = moved & torch.where(take_plus, adv_plus, adv_minus)
    state["coord"] = torch.where(live, (state["coord"] + 1) % state["w"].shape[1], state["coord"])
    state["asked"] = state["asked"] + live.long() * (2 - adv_plus.long())
    # Remember what was asked and answered.
    memo_x, memo_margin, slot = state["memo_x"].clone(), state["memo_margin"].clone(), state["memo_next"].clone()
    for ask, images, answered, m in ((ask_plus, plus, ok_plus, m_plus), (ask_minus, minus, ok_minus, m_minus)):
        keep = (ask & answered).nonzero().squeeze(1)
        memo_x[keep, slot[keep]] = images[keep]
        memo_margin[keep, slot[keep]] = m[keep]
        slot[keep] = (slot[keep] + 1) % MEMORY
    state.update(memo_x=memo_x, memo_margin=memo_margin, memo_next=slot)
    return state
