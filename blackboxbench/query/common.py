"""Helpers shared by the query-attack families: batched row selection, per-sample random draws and windows,
score losses that never mistake a refused query for progress, and the greedy / step acceptance blocks.

Everything is batched over samples (dim 0) and works for any active subset the pipeline passes (local indices).
Score-attack state (see :func:`start_state`): ``x_adv`` (n, C, H, W), ``loss`` (n,) float (lower is better, +inf
when unknown), ``success`` (n,) bool, plus any per-sample tensors an attack adds (e.g. an iteration counter).
"""
import torch

from ..errors import BenchError
from ..registry import ACCEPT, INIT


# --------------------------------------------------------------------------- batched indexing / randomness
def per_sample(v, like):
    """Per-sample values ``v`` (n,) shaped (n, 1, ..., 1) to broadcast against a batch ``like`` (n, ...)."""
    return v.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def rows_where(mask, a, b):
    """Row ``i`` of ``a`` where ``mask[i]`` else row ``i`` of ``b`` (``mask`` (n,) bool, ``a``/``b`` (n, ...))."""
    return torch.where(mask.view(-1, *([1] * (a.dim() - 1))), a, b)


def rand_like_gen(shape, gen, device):
    """Uniform [0, 1) draws from ``gen`` (which may live on another device), returned on ``device``."""
    return torch.rand(shape, generator=gen, device=gen.device).to(device)


def randn_like_gen(shape, gen, device):
    """Standard normal draws from ``gen``, returned on ``device``."""
    return torch.randn(shape, generator=gen, device=gen.device).to(device)


def random_signs(shape, gen, device):
    """Uniform {-1, +1} draws of ``shape``."""
    return torch.where(rand_like_gen(shape, gen, device) < 0.5, -1.0, 1.0)


def randint_below(high, gen):
    """One uniform integer in ``[0, high[i])`` per sample (``high`` (n,) long tensor, every entry >= 1)."""
    u = rand_like_gen(high.shape, gen, high.device)
    return torch.minimum((u * high).long(), high - 1)


def random_permutations(n, d, gen, device, key=None):
    """``n`` independent random permutations of ``range(d)`` as (n, d) long, vectorized (argsort of uniforms).

    With ``key`` (d,) (integer-valued), coordinates are sorted by ``key`` first and shuffled only among equal keys.
    """
    u = rand_like_gen((n, d), gen, device)
    if key is not None:
        u = u + key.to(u.dtype)[None]
    return u.argsort(dim=1)


def window_mask(top, left, height, width, size_hw):
    """Per-sample rectangular windows as a bool mask (n, 1, H, W).

    Window ``i`` covers rows ``top[i] .. top[i]+height[i]-1`` and columns ``left[i] .. left[i]+width[i]-1``
    (each an (n,) long tensor or an int; ``size_hw`` = (H, W)); parts outside the image are dropped.
    Built by broadcasting, no per-sample loop.
    """
    h, w = size_hw
    device = top.device if torch.is_tensor(top) else left.device
    as_t = lambda v: torch.as_tensor(v, device=device).reshape(-1, 1)  # noqa: E731
    top, left, height, width = as_t(top), as_t(left), as_t(height), as_t(width)
    rows = torch.arange(h, device=device)[None]
    cols = torch.arange(w, device=device)[None]
    in_r = (rows >= top) & (rows < top + height)
    in_c = (cols >= left) & (cols < left + width)
    return (in_r[:, :, None] & in_c[:, None, :])[:, None]


def random_window(size, size_hw, gen):
    """Per-sample square windows of side ``size`` (n,) placed uniformly inside the image -> (mask, top, left)."""
    h, w = size_hw
    top = randint_below(h - size + 1, gen)
    left = randint_below(w - size + 1, gen)
    return window_mask(top, left, size, size, size_hw), top, left


# --------------------------------------------------------------------------- score losses and queries
def own_logprob_loss(problem, scores):
    """Loss of SimBA (Guo et al. 2019): log-prob of the true class (untargeted) or minus that of the target."""
    label = problem.y if problem.target is None else problem.target
    own = scores.gather(1, label[:, None]).squeeze(1)
    return own if problem.target is None else -own


LOSSES = {"margin": lambda problem, scores: problem.margin(scores), "prob": own_logprob_loss}


def score_loss(problem, scores, loss="margin"):
    """Per-sample loss to minimise from log-probabilities: ``margin`` (CW margin, < 0 is adversarial) or
    ``prob`` (see :func:`own_logprob_loss`)."""
    if loss not in LOSSES:
        raise BenchError(f"unknown score loss '{loss}'; choose one of {', '.join(LOSSES)}")
    return LOSSES[loss](problem, scores)


def query_loss(problem, oracle, images, idx=None, loss="margin"):
    """Query ``images`` for local samples ``idx`` (default one image per sample) -> ``(loss, adv, ok)``.

    A refused query (past the sample's budget) gets loss +inf and ``adv`` False, so it can never be accepted as
    an improvement nor counted as a success.
    """
    answer, ok = oracle(images, idx)
    sub = problem if idx is None else problem.sub(idx)
    value = score_loss(sub, answer, loss)
    value = torch.where(ok, value, torch.full_like(value, float("inf")))
    return value, sub.is_adv(answer) & ok, ok


def start_state(problem, oracle, x0, loss="margin", **extra):
    """Query the starting points ``x0`` (projected into the ball) once and build the shared score state.

    ``extra`` adds per-sample tensors (each with the batch on dim 0), e.g. ``it=torch.zeros(n, dtype=long)``.
    """
    x0 = problem.project(x0)
    value, adv, _ = query_loss(problem, oracle, x0, loss=loss)
    return dict(x_adv=x0, loss=value, success=adv, **extra)


def greedy_update(problem, state, candidates, oracle, idx=None, loss="margin"):
    """Query ``candidates`` for the local samples ``idx`` (default all) and keep each one that lowers the loss.

    Updates ``state`` in place (``x_adv``, ``loss``, ``success``) and returns the bool mask (len(idx),) of
    accepted candidates. Refused queries are never accepted.
    """
    if idx is None:
        idx = torch.arange(candidates.shape[0], device=candidates.device)
    value, adv, _ = query_loss(problem, oracle, candidates, idx, loss)
    better = value < state["loss"][idx]
    keep = idx[better]
    state["x_adv"][keep] = candidates[better]
    state["loss"][keep] = value[better]
    state["success"][keep] = adv[better]
    return better


def merge_proposal(state, proposal, image_key="x_adv"):
    """Split a proposal into (candidate images, new state).

    A proposal is either candidate images (n, C, H, W), or a dict holding them under ``image_key`` plus updated
    per-sample state entries (e.g. an advanced iteration counter) that replace those of ``state``. The returned
    state is a shallow copy whose ``x_adv``/``loss``/``success`` are cloned, so updating it in place is safe.
    """
    state = dict(state)
    if isinstance(proposal, dict):
        state.update({k: v for k, v in proposal.items() if k in state and k != "x_adv"})
        proposal = proposal[image_key]
    for k in ("x_adv", "loss", "success"):
        state[k] = state[k].clone()
    return proposal, state


# --------------------------------------------------------------------------- blocks
@INIT.register("clean_start", paper="score-based attacks start from the clean image (Supp. F-B, Alg. 2)",
               norms=("linf", "l2"))
def clean_start(problem, oracle, gen):
    """``x_adv = x`` with its margin (one query per sample)."""
    return start_state(problem, oracle, problem.x.clone())


@ACCEPT.register("margin_greedy", paper="greedy acceptance on the margin loss (Supp. F-B, Alg. 2)",
                 norms=("linf", "l2"))
def margin_greedy(problem, state, proposal, oracle, gen):
    """Accept the proposal (one candidate image per sample) where it lowers the margin loss; one query each.

    Random-search acceptance of Square Attack (Andriushchenko et al. 2020, Alg. 1: keep the candidate only if
    the loss decreases).
    """
    candidates, state = merge_proposal(state, proposal)
    greedy_update(problem, state, candidates, oracle)
    return state


@ACCEPT.register("margin_step", paper="gradient-estimation attacks always take their step (Supp. F-B, Alg. 2)",
                 norms=("linf", "l2"))
def margin_step(problem, state, proposal, oracle, gen):
    """Move to the proposal unconditionally and query it once for its margin and success (NES and other
    gradient-estimation attacks; the query is BlackboxBench's per-iteration early-stop check)."""
    candidates, state = merge_proposal(state, proposal)
    value, adv, _ = query_loss(problem, oracle, candidates)
    state["x_adv"], state["loss"], state["success"] = candidates, value, adv
    return state
