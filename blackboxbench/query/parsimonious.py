"""Parsimonious attack / ECO (Moon, An and Song, "Parsimonious Black-Box Adversarial Attacks via Efficient
Combinatorial Optimization", ICML 2019), batched over samples with per-sample lazy-greedy schedules.

The perturbation lives on the vertices of the Linf ball: every pixel of every channel is at ``x + eps`` ("in the
working set") or ``x - eps``; it starts at ``x - eps`` everywhere. The image is cut into ``block_size`` x
``block_size`` blocks per channel, visited in a random order in mini-batches of ``block_batch_size`` blocks. On
each mini-batch the attack runs one accelerated lazy-greedy insertion pass (flip blocks from -eps to +eps) and
then one deletion pass (flip blocks back), as the authors' ``local_search_helper`` does (``max_iters`` 1):

1. *scan*: query the flip of every eligible block of the mini-batch (insertion: blocks at -eps, deletion: at
   +eps) and keep their marginal gains (new margin - current margin) in a priority queue;
2. flip the best block unconditionally (the authors' code inserts it even when its gain is positive);
3. *lazy loop*: pop the block with the best stale gain and query its flip again at the current point; if its
   fresh gain is still no worse than the next stale one it is flipped when the gain is <= 0, and the pass ends
   when it is > 0; otherwise it goes back into the queue with its fresh gain. The pass also ends when the queue
   is empty.

When every block has been visited, the block size is halved (down to 1 pixel) and a new random order is drawn
(the hierarchical refinement); at size 1 only the order is redrawn. Defaults (BlackboxBench Table VI, all eight
columns): ``block_size`` 4, ``block_batch_size`` 64, ``EOT`` 1 (``sigma`` 0 is the RND defense's noise, not a
parameter of the attack).

**Continuous batching.** A sample's position in its schedule is a handful of per-sample tensors: the block side
``bsize``, the visit ``order`` (a permutation of the blocks of the current level, padded to the number of blocks
of the finest level, so shapes never change), the mini-batch start ``pos``, the ``phase`` (insertion scan,
insertion lazy loop, deletion scan, deletion lazy loop), the stale ``gain`` of every mini-batch position and the
``queued`` mask (the priority queue: ties go to the lower position, as ``heapq`` orders ``(gain, index)``), the
scan's progress (``scan_at``, and the ``best`` margin met so far at position ``best_at``), and ``up``, the sign of
every pixel's vertex. Every pipeline iteration advances every sample by one step of its own schedule (a scan
step: its next ``scan_chunk`` candidates; a lazy step: one), all samples' candidates in one oracle call (rows =
local sample of each candidate). A scan with nothing eligible is skipped without a query. ``scan_chunk`` 1
(default) counts a scan as the authors do (they evaluate a scan in one forward but count only up to
its first adversarial candidate); a larger one trades up to ``scan_chunk`` - 1 extra queries on the succeeding
step for fewer iterations.

**Norms.** Linf is the method's own (the authors: "can be applied only in L-inf setting"). L2 is *not native*: it
runs the same search on the vertices of the largest cube inside the L2 ball, ``x +- eps / sqrt(d)`` per
coordinate (every vertex has L2 norm ``eps``: the L2 projection of the Linf vertices of radius ``eps``), which is
how BlackboxBench's L2 configuration (Table VI lists L2 columns; its code projects the result onto the L2 ball)
is given a meaning that never queries outside the ball. The vertices are rounded to the uint8 grid towards the
clean image (as Square's Linf vertices), so every candidate is an image the attack can return as is; for eps
off the grid the search radius is ``floor(255 r) / 255``.

Deviations from the authors' code: the current image is not re-queried at the start of every mini-batch (the
state already holds its margin: one query per mini-batch saved); an adversarial candidate met in a lazy step is
always taken (the authors take it only when the lazy rule accepts it); the flipped block's loss is the oracle's
answer for it (the authors add the gain to the old loss: the same number up to rounding); the blocks of a
mini-batch are indexed by their position in the visit order; every sample has its own random orders; a success
costs one more query, the pipeline's confirmation of the returned image.
"""
import math

import torch

from ..registry import ACCEPT, INIT, PERTURB
from ..threat import quantize
from .common import query_margin, start_state

PAPER = ("Moon, An and Song, Parsimonious Black-Box Adversarial Attacks via Efficient Combinatorial Optimization, "
         "ICML 2019")
INSERT_SCAN, INSERT_LAZY, DELETE_SCAN, DELETE_LAZY = 0, 1, 2, 3
ROUNDS = 4  # skipped empty scans in a row, at most: insert -> delete -> next insert -> its delete (never empty)


# --------------------------------------------------------------------------- geometry
def vertex_radius(problem, dims):
    """Per-coordinate radius of the vertices searched: eps (Linf), eps / sqrt(d) (L2, see the module docstring)."""
    return problem.eps if problem.norm == "linf" else problem.eps / math.sqrt(dims)


def vertices(problem):
    """The two vertices of every coordinate, ``x + r`` and ``x - r`` clipped to [0, 1] and rounded to the uint8 grid
    towards ``x``, flat (n, C*H*W) each."""
    x = problem.x
    r = vertex_radius(problem, x[0].numel())
    hi, lo = (quantize((x + sign * r).clamp(0, 1), x) for sign in (1, -1))
    return hi.flatten(1), lo.flatten(1)


def num_blocks(bsize, shape):
    """Number of blocks of side ``bsize`` (tensor) of a (C, H, W) image (partial blocks at the borders count)."""
    c, h, w = shape
    return c * torch.div(h + bsize - 1, bsize, rounding_mode="floor") * torch.div(w + bsize - 1, bsize,
                                                                                  rounding_mode="floor")


def block_map(bsize, shape):
    """(n, C*H*W) block id of every pixel for per-sample block sides ``bsize`` (n,): block
    ``(row * blocks_per_row + col) * C + channel``."""
    c, h, w = shape
    dev = bsize.device
    b = bsize.view(-1, 1, 1, 1)
    per_row = torch.div(w + b - 1, b, rounding_mode="floor")
    rows = torch.div(torch.arange(h, device=dev).view(1, 1, h, 1), b, rounding_mode="floor")
    cols = torch.div(torch.arange(w, device=dev).view(1, 1, 1, w), b, rounding_mode="floor")
    chan = torch.arange(c, device=dev).view(1, c, 1, 1)
    return ((rows * per_row + cols) * c + chan).flatten(1)


def block_corner(block, bsize, shape):
    """Flat pixel index of the top-left pixel of block ``block`` (n, k) of side ``bsize`` (n,) in its channel."""
    c, h, w = shape
    b = bsize.view(-1, 1)
    per_row = torch.div(w + b - 1, b, rounding_mode="floor")
    chan, cell = block % c, torch.div(block, c, rounding_mode="floor")
    row, col = torch.div(cell, per_row, rounding_mode="floor"), cell % per_row
    return chan * (h * w) + row * b * w + col * b


def draw_orders(ctx, bsize, rows, shape):
    """A random visit order of the blocks of side ``bsize[rows]`` for samples ``rows``: (len(rows), NB) long, the
    first ``num_blocks`` entries a permutation of them, the rest padding (NB = C*H*W, the finest level). Every sample
    draws NB uniforms from its own stream, whatever its level."""
    nb_max = math.prod(shape)
    u = ctx.rng.uniform((nb_max,), rows=rows, dtype=torch.float64)
    pad = torch.arange(nb_max, device=u.device)[None] >= num_blocks(bsize[rows], shape)[:, None]
    return (u + 2.0 * pad).argsort(dim=1)


# --------------------------------------------------------------------------- schedule
SCHEDULE = ("up", "bsize", "order", "pos", "phase", "scan_at", "best", "best_at", "gain", "queued")


def _end_pass(ctx, state, done):
    """Samples ``done`` (n,) bool finished a pass: insertion -> deletion scan; deletion -> the next mini-batch
    (the next level, or a new order, after the last one) -> insertion scan. Replaces entries of ``state``."""
    if not bool(done.any()):
        return
    shape = ctx.problem.x.shape[1:]
    phase, pos, bsize = state["phase"], state["pos"], state["bsize"]
    batch = state["gain"].shape[1]
    inserting = phase <= INSERT_LAZY
    to_delete = done & inserting
    to_next = done & ~inserting
    pos = torch.where(to_next, pos + batch, pos)
    wrap = to_next & (pos >= num_blocks(bsize, shape))
    if bool(wrap.any()):
        bsize = torch.where(wrap & (bsize >= 2), torch.div(bsize, 2, rounding_mode="floor"), bsize)
        rows = wrap.nonzero().squeeze(1)
        order = state["order"].clone()
        order[rows] = draw_orders(ctx, bsize, rows, shape)
        state["order"], pos = order, torch.where(wrap, torch.zeros_like(pos), pos)
    state["phase"] = torch.where(to_delete, DELETE_SCAN, torch.where(to_next, INSERT_SCAN, phase))
    state["pos"], state["bsize"] = pos, bsize
    state["queued"] = state["queued"] & ~done[:, None]
    state["scan_at"] = torch.where(done, 0, state["scan_at"])
    state["best"] = torch.where(done, float("inf"), state["best"])
    state["best_at"] = torch.where(done, 0, state["best_at"])


def _batch_blocks(state, shape):
    """(n, B) block ids of each sample's current mini-batch, and (n, B) bool: the positions that hold a block."""
    order, pos, batch = state["order"], state["pos"], state["gain"].shape[1]
    k = torch.arange(batch, device=order.device)[None]
    at = (pos[:, None] + k).clamp(max=order.shape[1] - 1)
    valid = pos[:, None] + k < num_blocks(state["bsize"], shape)[:, None]
    return torch.where(valid, order.gather(1, at), 0), valid


def _pending(state, shape):
    """(n, B) bool: the mini-batch positions the scan of the sample's current pass has still to try: blocks at
    -r (insertion) or at +r (deletion), read at the block's top-left pixel as the authors do, from ``scan_at``."""
    blocks, valid = _batch_blocks(state, shape)
    up = state["up"].gather(1, block_corner(blocks, state["bsize"], shape))
    inserting = (state["phase"] <= INSERT_LAZY)[:, None]
    k = torch.arange(blocks.shape[1], device=blocks.device)[None]
    return valid & torch.where(inserting, ~up, up) & (k >= state["scan_at"][:, None])


def _scanning(state):
    return (state["phase"] == INSERT_SCAN) | (state["phase"] == DELETE_SCAN)


def _members(state, at, shape):
    """(n, C*H*W) bool: the pixels of the block at mini-batch position ``at`` (n,) of every sample."""
    blocks, _ = _batch_blocks(state, shape)
    return block_map(state["bsize"], shape) == blocks.gather(1, at[:, None])


# --------------------------------------------------------------------------- blocks
@INIT.register("parsimonious_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"block_size": "int [1, inf)", "block_batch_size": "int [1, inf)"})
def parsimonious_init(ctx, *, block_size=4, block_batch_size=64):
    """Start at the vertex ``x - r`` everywhere (one query) with a random visit order of the ``block_size`` blocks.

    ``block_size`` 4 and ``block_batch_size`` 64: Table VI. The state holds the per-sample schedule (see the module
    docstring); its shapes depend only on the image shape and ``block_batch_size``.
    """
    problem = ctx.problem
    n, shape = problem.n, problem.x.shape[1:]
    dev = problem.x.device
    dims = math.prod(shape)
    bsize = torch.full((n,), min(block_size, max(shape[1:])), dtype=torch.long, device=dev)
    order = draw_orders(ctx, bsize, torch.arange(n, device=dev), shape)
    batch = min(block_batch_size, dims)
    _, lo = vertices(problem)
    zeros = torch.zeros(n, dtype=torch.long, device=dev)
    return start_state(ctx, lo.view_as(problem.x), up=torch.zeros((n, dims), dtype=torch.bool, device=dev),
                       bsize=bsize, order=order, pos=zeros, phase=zeros.clone(), scan_at=zeros.clone(),
                       best=torch.full((n,), float("inf"), device=dev), best_at=zeros.clone(),
                       gain=torch.zeros((n, batch), device=dev),
                       queued=torch.zeros((n, batch), dtype=torch.bool, device=dev))


@PERTURB.register("eco_lazy_greedy", paper=PAPER, norms=("linf", "l2"), ranges={"scan_chunk": "int [1, inf)"})
def eco_lazy_greedy(ctx, state, *, scan_chunk=1):
    """The next step of every sample's lazy-greedy schedule as candidate images (one or several per sample).

    A sample in a scan proposes the flips of its next ``scan_chunk`` eligible blocks (a scan with nothing eligible
    is skipped, no query); a sample in a lazy loop pops the best queued block (lowest stale gain, then lowest
    position) and proposes its flip. ``scan_chunk`` does not change the search, only how many of a scan's
    candidates share an oracle call: 1 (default) asks them one per iteration, so a success costs exactly the
    authors' count (they stop counting at the first adversarial candidate); ``block_batch_size`` asks a whole
    scan at once (fewer iterations, up to ``block_batch_size`` - 1 more queries on the step that succeeds).
    Returns a dict: ``images`` (m, C, H, W), ``idx`` (m,) the local sample of each row, ``slot`` (m,) its
    mini-batch position, and the advanced schedule entries.
    """
    problem = ctx.problem
    shape = problem.x.shape[1:]
    state = {k: state[k] for k in SCHEDULE}
    for _ in range(ROUNDS):
        empty = _scanning(state) & ~_pending(state, shape).any(1)
        if not bool(empty.any()):
            break
        _end_pass(ctx, state, empty)
    scanning = _scanning(state)
    pending = _pending(state, shape)
    chunk = pending & (pending.long().cumsum(1) <= scan_chunk)
    gain = state["gain"].masked_fill(~state["queued"], float("inf"))
    popped = torch.nn.functional.one_hot(gain.argmin(1), gain.shape[1]).bool() & state["queued"]
    rows_mask = torch.where(scanning[:, None], chunk, popped)
    state["queued"] = state["queued"] & ~(popped & ~scanning[:, None])
    idx, slot = rows_mask.nonzero(as_tuple=True)
    blocks, _ = _batch_blocks(state, shape)
    members = block_map(state["bsize"][idx], shape) == blocks[idx, slot][:, None]
    hi, lo = vertices(problem)
    images = torch.where(state["up"][idx] ^ members, hi[idx], lo[idx]).view(-1, *shape)
    return dict(state, images=images, idx=idx, slot=slot)


def eot_margin(ctx, images, idx, eot):
    """Margin of ``images`` for local samples ``idx`` averaged over ``eot`` answers each (EOT, every answer a
    counted query) -> (margin, adv, ok).

    Always asked as rows of samples (never as "one image per sample", even when it is), so that whether the oracle
    remembers a sample's image for the pipeline's confirmation never depends on the other samples in the batch
    (a confirmed success costs one query, whatever the batch)."""
    if eot > 1:
        images, idx = images.repeat_interleave(eot, 0), idx.repeat_interleave(eot)
    margin, _, ok = query_margin(ctx, images, idx)
    if eot > 1:
        margin, ok = margin.view(-1, eot).mean(1), ok.view(-1, eot).all(1)
        margin = torch.where(ok, margin, float("inf"))
    return margin, margin < 0, ok


@ACCEPT.register("eco_accept", paper=PAPER, norms=("linf", "l2"), ranges={"EOT": "int [1, inf)"})
def eco_accept(ctx, state, proposal, *, EOT=1):  # noqa: N803  (Table VI's name)
    """Query the candidates of :func:`eco_lazy_greedy` (one oracle call) and advance every sample's schedule.

    Scan: the gains go into the queue; once the scan is complete, its best block is flipped (the first adversarial
    candidate at once, if any). Lazy step: the popped block is flipped if its fresh gain is <= 0 and no worse than
    the best stale gain (or if it is adversarial); the pass ends when that gain is > 0 or the queue is empty;
    otherwise the block is queued again with its fresh gain. ``EOT`` 1 (Table VI): answers averaged per candidate,
    for randomized targets.
    """
    problem = ctx.problem
    shape = problem.x.shape[1:]
    state = dict(state)
    state.update({k: v for k, v in proposal.items() if k in state})
    idx, slot = proposal["idx"], proposal["slot"]
    n, batch = problem.n, state["gain"].shape[1]
    margin_r, adv_r, ok_r = eot_margin(ctx, proposal["images"], idx, EOT)

    def grid(fill, v):
        return torch.full((n, batch), fill, dtype=v.dtype, device=v.device).index_put((idx, slot), v)

    margin_g, adv_g, answered = grid(float("inf"), margin_r), grid(False, adv_r), grid(False, ok_r)
    asked = grid(False, torch.ones_like(ok_r))
    at = lambda t, k: t.gather(1, k[:, None]).squeeze(1)  # noqa: E731
    positions = torch.arange(batch, device=idx.device)[None]
    scanning, cur = _scanning(state), state["margin"]
    refused = (asked & ~answered).any(1)  # the budget ran out: the sample leaves (a scan is left incomplete)

    # scans: record the chunk (gains queued, best so far); complete when nothing is pending or a candidate is
    # adversarial, then flip the best (or the first adversarial) block; a chunk cut by the budget completes nothing
    scan_rows = scanning[:, None] & answered
    state["gain"] = torch.where(scan_rows, margin_g - cur[:, None], state["gain"])
    queued = state["queued"] | scan_rows
    chunk_at = margin_g.argmin(1)
    chunk_best = at(margin_g, chunk_at)
    improve = scanning & (chunk_best < state["best"])
    state["best"] = torch.where(improve, chunk_best, state["best"])
    state["best_at"] = torch.where(improve, chunk_at, state["best_at"])
    first_adv = torch.where(adv_g, positions, batch).amin(1)
    hit = scanning & (first_adv < batch)
    last = torch.where(asked, positions, -1).amax(1)
    state["scan_at"] = torch.where(scanning, last + 1, state["scan_at"])
    complete = scanning & (hit | ~refused & ~_pending(state, shape).any(1))
    scan_pick = torch.where(hit, first_adv, state["best_at"])
    scan_margin = torch.where(hit, at(margin_g, first_adv.clamp(max=batch - 1)), state["best"])

    # lazy steps: the popped block against the best stale gain still queued
    lazy = ~scanning & answered.any(1)
    lazy_pick = torch.where(asked, positions, batch).amin(1).clamp(max=batch - 1)
    fresh = at(margin_g, lazy_pick)
    gain_new = fresh - cur
    top = state["gain"].masked_fill(~queued, float("inf")).amin(1)
    lazy_adv = at(adv_g, lazy_pick)
    lazy_take = lazy & ((gain_new <= top) & (gain_new <= 0) | lazy_adv)
    lazy_stop = lazy & ~lazy_take & (gain_new <= top)
    requeue = (lazy & ~lazy_take & ~lazy_stop)[:, None] & (positions == lazy_pick[:, None])
    state["gain"] = torch.where(requeue, gain_new[:, None], state["gain"])
    queued = queued | requeue

    # the flip
    take = complete | lazy_take
    pick = torch.where(scanning, scan_pick, lazy_pick)
    state["queued"] = queued & ~(complete[:, None] & (positions == pick[:, None]))
    if bool(take.any()):
        up = state["up"] ^ (_members(state, pick, shape) & take[:, None])
        hi, lo = vertices(problem)
        state["up"] = up
        state["x_adv"] = torch.where(take[:, None], torch.where(up, hi, lo), state["x_adv"].flatten(1)).view_as(
            state["x_adv"])
        state["margin"] = torch.where(complete, scan_margin, torch.where(lazy_take, fresh, cur))
        state["success"] = torch.where(complete, hit, torch.where(lazy_take, lazy_adv, state["success"]))

    # phase: a complete scan -> its lazy loop; a pass ends when the lazy rule stops or the queue runs dry
    state["phase"] = torch.where(complete, state["phase"] + 1, state["phase"])
    done = (complete | lazy) & (lazy_stop | ~state["queued"].any(1))
    _end_pass(ctx, state, done)
    return state
