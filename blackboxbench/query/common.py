"""Helpers shared by the query-attack families: batched row selection, per-sample random draws and windows,
margin queries that never mistake a refused query for progress, and the greedy / step acceptance blocks.

Everything is batched over samples (dim 0) and works for any active subset the pipeline passes (local indices).
Score-attack state (see :func:`start_state`): ``x_adv`` (n, C, H, W), ``margin`` (n,) float (CW margin of the
log-probabilities, lower is better, +inf when unknown), ``success`` (n,) bool, plus any per-sample tensors an
attack adds (e.g. an iteration counter).
"""
import functools

import torch

from ..registry import ACCEPT, INIT
from ..threat import per_sample, rows_where  # noqa: F401  (re-exported for the query families)


# --------------------------------------------------------------------------- randomness
def uniform(shape, gen, device, dtype=torch.float32):
    """Uniform [0, 1) draws from ``gen`` (which may live on another device), returned on ``device``."""
    return torch.rand(shape, generator=gen, device=gen.device, dtype=dtype).to(device)


def gaussian(shape, gen, device):
    """Standard normal draws from ``gen``, returned on ``device``."""
    return torch.randn(shape, generator=gen, device=gen.device).to(device)


def random_signs(shape, gen, device):
    """Uniform {-1, +1} draws of ``shape``."""
    return torch.where(uniform(shape, gen, device) < 0.5, -1.0, 1.0)


def randint_below(high, gen):
    """One uniform integer in ``[0, high[i])`` per sample (``high`` (n,) long tensor, every entry in [1, 2^53)).

    ``u * high`` stays below ``high`` for every float64 ``u`` < 1 (the largest, 1 - 2^-53, times an integer
    rounds to at most ``high`` - ulp), so the floor never reaches ``high``.
    """
    return (uniform(high.shape, gen, high.device, torch.float64) * high).long()


def random_permutations(n, d, gen, device, key=None):
    """``n`` independent random permutations of ``range(d)`` as (n, d) long, vectorized (argsort of uniforms).

    With ``key`` (d,) (integer-valued), coordinates are sorted by ``key`` first and shuffled only among equal keys.
    """
    u = uniform((n, d), gen, device, torch.float64)
    if key is not None:
        u = u + key.to(u.dtype)[None]
    return u.argsort(dim=1)


def window_mask(top, left, height, width, size_hw):
    """Per-sample rectangular windows as a bool mask (n, 1, H, W).

    Window ``i`` covers rows ``top[i] .. top[i]+height[i]-1`` and columns ``left[i] .. left[i]+width[i]-1``
    (``top``/``left`` (n,) long tensors, ``height``/``width`` (n,) tensors or ints; ``size_hw`` = (H, W));
    parts outside the image are dropped. Built by broadcasting, no per-sample loop.
    """
    h, w = size_hw
    device = top.device
    as_t = lambda v: torch.as_tensor(v, device=device).reshape(-1, 1)  # noqa: E731
    top, left, height, width = as_t(top), as_t(left), as_t(height), as_t(width)
    rows = torch.arange(h, device=device)[None]
    cols = torch.arange(w, device=device)[None]
    in_r = (rows >= top) & (rows < top + height)
    in_c = (cols >= left) & (cols < left + width)
    return (in_r[:, :, None] & in_c[:, None, :])[:, None]


def random_corner(size, size_hw, gen):
    """Top-left corners (top, left) of per-sample square windows of side ``size`` (n,) placed uniformly inside
    the image."""
    h, w = size_hw
    span_h = (h + 1) - size
    return randint_below(span_h, gen), randint_below(span_h if w == h else (w + 1) - size, gen)


def random_window(size, size_hw, gen):
    """Per-sample square windows of side ``size`` (n,) placed uniformly inside the image -> (mask, top, left)."""
    top, left = random_corner(size, size_hw, gen)
    return window_mask(top, left, size, size, size_hw), top, left


def window_index(top, left, size, shape):
    """Flat indices into a (C*H*W) image of each sample's ``size`` x ``size`` window, in every channel:
    (n, C, S, S) long, S the largest side. A sample with a smaller side repeats its window's top-left pixel in the
    extra positions, so gathering or scattering through them only duplicates that pixel (same value, no race)."""
    c, h, w = shape
    smallest, side = torch.stack(torch.aminmax(size)).tolist()
    offsets, reach, corner = _window_offsets(side, c, h, w, top.device)
    if smallest < side:  # mixed sides: positions past a sample's side repeat its top-left pixel
        offsets = torch.where(reach < size.view(-1, 1, 1, 1), offsets, corner)
    return torch.add(left, top, alpha=w).view(-1, 1, 1, 1) + offsets


@functools.lru_cache(maxsize=256)
def _window_offsets(side, c, h, w, device):
    """(1, C, S, S) flat offsets of a window's pixels from its top-left pixel, (1, 1, S, S) the Chebyshev
    distance of each position from the top-left (a position belongs to a window of side s when it is < s), and
    (1, C, 1, 1) the offsets of the top-left pixel in each channel; memoised per shape (constants)."""
    ar = torch.arange(side, device=device)
    rows, cols = ar.view(1, 1, side, 1), ar.view(1, 1, 1, side)
    offsets = (torch.arange(c, device=device) * (h * w)).view(1, c, 1, 1) + rows * w + cols
    return offsets, torch.maximum(rows, cols), offsets[:, :, :1, :1]


# --------------------------------------------------------------------------- margin queries
def query_margin(problem, oracle, images, idx=None):
    """Query ``images`` for local samples ``idx`` (default one image per sample) -> ``(margin, adv, ok)``.

    ``margin`` is the CW margin of the log-probabilities (``problem.margin``); ``adv`` is ``margin < 0`` (the
    true class, or the target, strictly beaten). A refused query (past the sample's budget) gets margin +inf and
    ``adv`` False, so it can never be accepted as an improvement nor counted as a success.
    """
    answer, ok = oracle(images, idx)
    margin = (problem if idx is None else problem.sub(idx)).margin(answer)
    margin = torch.where(ok, margin, float("inf"))
    return margin, margin < 0, ok


def start_state(problem, oracle, x0, **extra):
    """Query the starting points ``x0`` once and build the shared score state. ``x0`` must lie in the eps ball
    and [0, 1] (an init projects its own points; they are kept bit for bit, so points on the uint8 grid stay on it).

    ``extra`` adds per-sample tensors (each with the batch on dim 0), e.g. ``it=torch.zeros(n, dtype=long)``.
    """
    margin, adv, _ = query_margin(problem, oracle, x0)
    return dict(x_adv=x0, margin=margin, success=adv, **extra)


def greedy_update(problem, state, candidates, oracle, idx=None):
    """Query ``candidates`` for the local samples ``idx`` (default all) and keep each one that lowers the margin.

    Replaces the ``x_adv``/``margin``/``success`` entries of ``state`` (never writes into the tensors it was
    given) and returns the bool mask (len(idx),) of accepted candidates. Refused queries are never accepted.
    """
    margin, adv, _ = query_margin(problem, oracle, candidates, idx)
    if idx is None:  # one candidate per sample
        better = margin < state["margin"]
        state["x_adv"] = rows_where(better, candidates, state["x_adv"])
        state["margin"] = torch.where(better, margin, state["margin"])
        state["success"] = torch.where(better, adv, state["success"])
        return better
    better = margin < state["margin"][idx]
    keep = idx[better]
    for key, new in (("x_adv", candidates), ("margin", margin), ("success", adv)):
        state[key] = state[key].index_put((keep,), new[better])
    return better


def merge_proposal(state, proposal, image_key="x_adv"):
    """Split a proposal into (candidate images, new state).

    A proposal is either candidate images (n, C, H, W), or a dict holding them under ``image_key`` plus updated
    per-sample state entries (e.g. an advanced iteration counter) that replace those of ``state``. The returned
    state is a shallow copy: replace its entries, do not write into them.
    """
    state = dict(state)
    if isinstance(proposal, dict):
        state.update({k: v for k, v in proposal.items() if k in state and k != "x_adv"})
        proposal = proposal[image_key]
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
    margin, adv, _ = query_margin(problem, oracle, candidates)
    state["x_adv"], state["margin"], state["success"] = candidates, margin, adv
    return state
