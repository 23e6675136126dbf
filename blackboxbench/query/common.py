"""Helpers shared by the query-attack families: per-sample windows, margin queries that never mistake a refused
query for progress, and the greedy / step acceptance blocks.

Everything is batched over samples (dim 0) and works for any working set the pipeline passes (local indices);
random numbers come from the context's per-sample streams (``ctx.rng``).
Score-attack state (see :func:`start_state`): ``x_adv`` (n, C, H, W), ``margin`` (n,) float (CW margin of the
log-probabilities, lower is better, +inf when unknown), ``success`` (n,) bool, plus any per-sample tensors an
attack adds (e.g. an iteration counter).
"""
import functools

import torch

from ..registry import ACCEPT, INIT
from ..threat import per_sample, rows_where  # noqa: F401  (re-exported for the query families)


# --------------------------------------------------------------------------- bounded calls
# values per call of the batched estimates (HSJA's, GeoDA's, NES's, ZO-signSGD's and PRGF's probes, OPT's searches,
# Sign-OPT's signs, AdvFlow's and CG-Attack's populations, PSBA's scale search): 256 MiB of float32 images; a few
# calls at most on CIFAR-10, pieces at ImageNet size
PROBE_VALUES = 1 << 26


def bounded_calls(rows, values):
    """Group the samples with ``rows[i] > 0`` rows of ``values`` values each, in order and whole, into calls of
    about ``PROBE_VALUES`` values: a call holds the samples whose rows start within one window of that size, so
    at most that plus one sample's rows. Samples of equal size pass ``rows`` of ones and ``values`` a sample's
    values: every call then holds at most ``PROBE_VALUES`` values (or one sample). Yields each call's sample
    indices (long tensors)."""
    piece = max(1, PROBE_VALUES // max(1, values))
    call = (torch.cumsum(rows, 0) - rows) // piece  # a sample's call: where its rows start
    for k in torch.unique(call[rows > 0]).tolist():
        yield torch.nonzero((call == k) & (rows > 0)).flatten()


def add_rows_(out, owner, values):
    """``out[owner[j]] += values[j]`` for every row j, a sample's rows added in their order, in place; returns
    ``out``. The estimates' per-sample sums (HSJA's, GeoDA's, the priors' scale check) go through it so that they
    are the same float sums on every run: on CPU ``index_add_`` adds row by row; on CUDA it adds with atomics, in
    whatever order the threads run, so the last bits of a sum (and, near a tie, a sign step or an accepted point)
    changed from run to run. There ``index_put_`` with ``accumulate`` sorts the rows by index (a stable sort) and
    adds each index's rows in order."""
    if out.device.type == "cpu":
        return out.index_add_(0, owner, values)
    return out.index_put_((owner,), values, accumulate=True)


# --------------------------------------------------------------------------- windows
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


def random_corner(rng, size, size_hw):
    """Top-left corners (top, left) of per-sample square windows of side ``size`` (n,) placed uniformly inside
    the image (one draw of two integers per sample)."""
    return corner_at(rng.uniform((2,), dtype=torch.float64), size, size_hw)


def corner_at(u, size, size_hw):
    """:func:`random_corner` from given uniforms ``u`` (n, 2) float64 in [0, 1)."""
    h, w = size_hw
    span = torch.stack([(h + 1) - size, (w + 1) - size], 1)
    corner = (u * span.to(torch.float64)).long()  # see rng.randint_below
    return corner[:, 0], corner[:, 1]


def random_window(rng, size, size_hw):
    """Per-sample square windows of side ``size`` (n,) placed uniformly inside the image -> (mask, top, left)."""
    top, left = random_corner(rng, size, size_hw)
    return window_mask(top, left, size, size, size_hw), top, left


def side_range(size):
    """``(smallest, largest)`` of the window sides ``size`` (n,), as Python ints: one host sync, which a step that
    places several windows of these sides makes once (:func:`window_index`'s ``sides``)."""
    return tuple(torch.stack(torch.aminmax(size)).tolist())


def window_index(top, left, size, shape, sides=None):
    """Flat indices into a (C*H*W) image of each sample's ``size`` x ``size`` window, in every channel:
    (n, C, S, S) long, S the largest side. A sample with a smaller side repeats its window's top-left pixel in the
    extra positions, so gathering or scattering through them only duplicates that pixel (same value, no race).
    ``sides``: :func:`side_range` of ``size`` when the caller has it (else it is read here)."""
    c, h, w = shape
    smallest, side = sides or side_range(size)
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
def l2_normalize(v):
    """``v / ||v||_2`` per sample (a zero row stays zero)."""
    return v / per_sample(v.flatten(1).norm(dim=1).clamp_min(1e-12), v)


def query_margin(ctx, images, idx=None):
    """Query ``images`` for local samples ``idx`` (default one image per sample) -> ``(margin, adv, ok)``.

    ``margin`` is the CW margin of the log-probabilities (``problem.margin``); ``adv`` is ``margin < 0`` (the
    true class, or the target, strictly beaten). A refused query (past the sample's budget) gets margin +inf and
    ``adv`` False, so it can never be accepted as an improvement nor counted as a success.
    """
    answer, ok = ctx.oracle(images, idx)
    margin = (ctx.problem if idx is None else ctx.problem.sub(idx)).margin(answer)
    margin = torch.where(ok, margin, float("inf"))
    return margin, margin < 0, ok


def start_state(ctx, x0, **extra):
    """Query the starting points ``x0`` once and build the shared score state. ``x0`` must lie in the eps ball
    and [0, 1] (an init projects its own points; they are kept bit for bit, so points on the uint8 grid stay on it).

    ``extra`` adds per-sample tensors (each with the batch on dim 0), e.g. ``it=torch.zeros(n, dtype=long)``.
    """
    margin, adv, _ = query_margin(ctx, x0)
    return dict(x_adv=x0, margin=margin, success=adv, **extra)


def greedy_update(ctx, state, candidates, idx=None):
    """Query ``candidates`` for the local samples ``idx`` (default all) and keep each one that lowers the margin.

    Replaces the ``x_adv``/``margin``/``success`` entries of ``state`` (never writes into the tensors it was
    given) and returns the bool mask (len(idx),) of accepted candidates. Refused queries are never accepted.
    """
    margin, adv, _ = query_margin(ctx, candidates, idx)
    if idx is None:  # one candidate per sample
        return keep_better(state, candidates, margin, adv)
    better = margin < state["margin"][idx]
    keep = idx[better]
    for key, new in (("x_adv", candidates), ("margin", margin), ("success", adv)):
        state[key] = state[key].index_put((keep,), new[better])
    return better


def keep_better(state, candidates, margin, adv):
    """Move each sample to its candidate (one per sample) where the oracle's ``margin`` on it beats the sample's;
    ``adv`` is the oracle's verdict on the candidates. Replaces the ``x_adv``/``margin``/``success`` entries of
    ``state`` and returns the bool mask (n,) of moves. A refused query (margin +inf) never moves a sample."""
    better = margin < state["margin"]
    state["x_adv"] = rows_where(better, candidates, state["x_adv"])
    state["margin"] = torch.where(better, margin, state["margin"])
    state["success"] = torch.where(better, adv, state["success"])
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
def clean_start(ctx):
    """``x_adv = x`` with its margin (one query per sample)."""
    return start_state(ctx, ctx.problem.x.clone())


@ACCEPT.register("margin_greedy", paper="greedy acceptance on the margin loss (Supp. F-B, Alg. 2)",
                 norms=("linf", "l2"))
def margin_greedy(ctx, state, proposal):
    """Accept the proposal (one candidate image per sample) where it lowers the margin loss; one query each.

    Random-search acceptance of Square Attack (Andriushchenko et al. 2020, Alg. 1: keep the candidate only if
    the loss decreases).
    """
    candidates, state = merge_proposal(state, proposal)
    greedy_update(ctx, state, candidates)
    return state


@ACCEPT.register("margin_step", paper="gradient-estimation attacks always take their step (Supp. F-B, Alg. 2)",
                 norms=("linf", "l2"))
def margin_step(ctx, state, proposal):
    """Move to the proposal unconditionally and query it once for its margin and success (NES and other
    gradient-estimation attacks; the query is BlackboxBench's per-iteration early-stop check)."""
    candidates, state = merge_proposal(state, proposal)
    margin, adv, _ = query_margin(ctx, candidates)
    state["x_adv"], state["margin"], state["success"] = candidates, margin, adv
    return state
