"""CISA, Customized Iteration and Sampling Attack (Shi, Han, Hu, Yang, Tian, "Query-Efficient Black-Box
Adversarial Attack With Customized Iteration and Sampling", IEEE TPAMI 2023), Linf and L2, batched over samples.

A transfer phase on white-box surrogates finds an intermediate adversarial example; a decision-based noise
compression then shrinks it with customized sampling. Everything below follows the authors' code
(github.com/shiyuchengTJU/CISA: ``cisa_main.py``, the transfer module ``init_attack_num`` 10 in
``my_attacks/gaussian_iterative_projected_gradient.py``, the compression ``rescale_or_not`` 39 in
``boundary/evolutionary_attack.py``); surrogate forwards and backwards never go through the oracle.

**Transfer phase** (``cisa_init``, every target query counted):

1. Step size from the boundary distance: query ``clip(x + N(0, s^2))`` with ``s`` = ``init_scale``, growing by
   ``scale_growth`` after each non-adversarial draw (at most ``scale_tries`` draws). The first adversarial draw
   at distance ``noise_g`` fixes the step ``noise_g / exp_step`` (the authors' ``exp_step`` 20; no bisection,
   ``Curls_binary`` 0). Targeted samples skip this search (random noise almost never lands in a given class) and,
   like samples whose search failed, start as HSJA does (``decision.find_start``: the attacker's pool images of
   the target class or of another class, and up to ``init_tries`` uniform-noise draws).
2. Dual-direction iterations ("Curls" trajectories, ``Curls_RC`` 1): an uphill and a downhill trajectory, both
   from ``x``, take turns. A step moves along the surrogates' input gradient of their loss (``ce``, the authors'
   cross-entropy; untargeted: up the true class's loss, targeted: down the target's), normalized in the dual of
   the threat norm (L2: unit L2 norm; Linf: its sign), by the step size, then clipped to [0, 1]; the downhill
   trajectory's first step goes against the gradient. Each step is one target query; the first adversarial point
   ends the phase (``return_early``). A trajectory is abandoned once its next step is predicted worthless:
   with ``a`` its distance after ``k`` steps and ``f = a (1 + 1/k)``, when ``f^2 + (1 - alpha) noise_g^2 -
   noise_g f >= 0`` (``worth_alpha`` 0.9985), i.e. once it is about to end no closer than the Gaussian start
   (and, here, once a step cannot move it: clipped in place at the [0, 1] box).
3. The intermediate example is the closer of the transfer point and the start (the authors keep the best
   adversarial point seen), without a binary search.

**Noise compression** (``cisa``, one query per iteration and sample), from the current adversarial ``x_adv`` with
perturbation ``d = x_adv - x``:

* customized sampling: ``p ~ N(m, |d|^2)`` per pixel (the noise sensitivity: a pixel's standard deviation is its
  current perturbation), where ``m`` is minus the mean of the probes that failed since the last success (zero
  after a success), times the mask of the ``rate`` (0.2) fraction of pixels with the largest ``|d|`` on the 8-bit
  grid (the authors' ``griddle``, ties at the threshold level kept at random);
* candidate, L2 (the authors' Boundary-attack geometry): ``l = x_adv - source_step d``, ``c = l + spherical_step
  ||d||_2 p / ||p||_2``, rescaled onto the sphere around ``x`` of radius ``||l - x||_2``; Linf (an adaptation, the
  authors' code is L2 only): ``c = x + clip(d + spherical_step ||d||_inf p / ||p||_inf, +-(1 - source_step)
  ||d||_inf)``, the probe in the box shrunk by ``source_step``. (Measured on a ResNet-56 image the transfer left
  at Linf 0.043: with the probe's L2 size, 0.1 ||d||_2, nearly every candidate fails and the attack stalls;
  shrinking ``d`` radially as in L2 before clipping reaches 0.036 after 1,800 queries, clipping only 0.032.) Both
  then clipped to [0, 1];
* keep the candidate if adversarial; every 20 queries ``source_step *= exp(p_success - 0.2)`` (the authors'
  evolutionary-attack step adaptation).

Deviations from the authors' code: the variance-reduced gradient (``Curls_vr_or_not`` 1, ``m`` 2) is the plain
gradient (their code evaluates both gradients at the same point); several surrogates give one gradient, that of
their summed losses; the Gaussian search is bounded (``scale_tries``; theirs runs until a hit); queries are not
rounded to integer pixels, so the relaxed state transition (accept an adversarial candidate farther than the
current point with probability t / T) never applies: candidates lie on the sphere (box) of radius
``(1 - source_step)`` times the current distance, and clipping to [0, 1] only brings them closer, so it is left
out; the paper's MSE-based stopping is replaced by the benchmark's: stop once inside the eps ball
(``within_eps``).
"""
import torch

from ..registry import INIT, PERTURB
from ..threat import flat_norm
from .common import per_sample, rows_where
from .decision import decision_state, known_dist, find_start, has_budget, query_adv
from .prgf import SURROGATE_LOSSES, surrogate_gradient, surrogate_loss

PAPER = "Shi et al., Query-Efficient Black-Box Adversarial Attack With Customized Iteration and Sampling, TPAMI 2023"
WINDOW = 20         # evolutionary_attack.py: stats_step_adversarial = deque(maxlen=20)
TARGET_RATE = 0.2   # evolutionary_attack.py: source_step *= exp(p_step - 0.2)
LEVELS = 255        # griddle works on the perturbation rounded to 8-bit levels


def worthless(noise_g, noise_now, steps, alpha):
    """The authors' ``step_value_estimate``: is one more step of a trajectory at distance ``noise_now`` after
    ``steps`` steps (>= 1) predicted worthless against the Gaussian start at ``noise_g``? (all (n,) tensors)"""
    future = noise_now + noise_now / steps.clamp_min(1)
    return future * future + (1 - alpha) * noise_g * noise_g - noise_g * future >= 0


def griddle(delta, rate, u):
    """(n, C, H, W) float mask of the ``rate`` fraction of pixels with the largest ``|delta|`` on the 8-bit grid.

    The authors' ``griddle``: among the pixels with a non-zero rounded level ``q = round(255 |delta|)``, drop the
    ``(1 - rate)`` fraction with the smallest levels, level by level from 1 up; at the level where the count is
    reached, drop each pixel with the probability that completes it (``u`` (n, C, H, W) uniform [0, 1) draws:
    dropped when ``u < p``)."""
    n = delta.shape[0]
    q = torch.round(delta.abs().flatten(1).double() * LEVELS).clamp(max=LEVELS).long()
    u = u.flatten(1)
    hist = torch.zeros((n, LEVELS + 1), dtype=torch.float64, device=delta.device)
    hist.scatter_add_(1, q, torch.ones_like(q, dtype=torch.float64))
    hist[:, 0] = 0
    cum = hist.cumsum(1)
    drop = (1 - rate) * cum[:, -1:]  # (n, 1) pixels to drop
    reach = (hist > 0) & (cum >= drop)
    level = reach.double().argmax(1, keepdim=True)  # first level reaching the count (0 when nothing is perturbed)
    below = cum.gather(1, (level - 1).clamp_min(0)) * (level > 0)
    lottery = (drop - below) / hist.gather(1, level).clamp_min(1)
    keep = (q > level) | ((q == level) & (u.double() >= lottery))
    return (keep & (q > 0)).to(delta.dtype).view_as(delta)


def _direction(ctx, x, rows, first_down, loss_kind):
    """Ascent direction of the attack (minus the surrogates' loss gradient) at ``x`` for local samples ``rows``,
    in the dual of the threat norm; negated where ``first_down``."""
    p = ctx.problem
    y, target = p.y[rows], None if p.target is None else p.target[rows]

    def loss(k, logits, r):
        return surrogate_loss(logits, y[r], None if target is None else target[r], loss_kind)

    g = -surrogate_gradient(ctx.surrogates, x, loss)
    if p.norm == "linf":
        g = g.sign()
    else:
        g = g / per_sample(g.flatten(1).norm(dim=1).clamp_min(1e-12), g)
    return torch.where(first_down.view(-1, *([1] * (g.dim() - 1))), -g, g)


@INIT.register("cisa_init", paper=PAPER, norms=("linf", "l2"), needs=("surrogates",),
               ranges={"init_scale": "(0, inf)", "scale_growth": "(1, inf)", "scale_tries": "int [0, inf)",
                       "exp_step": "(0, inf)", "worth_alpha": "(0, 1)", "surrogate_loss": SURROGATE_LOSSES,
                       "init_tries": "int [0, inf)"})
def cisa_init(ctx, *, init_scale=1 / 255, scale_growth=1.5, scale_tries=20, exp_step=20.0, worth_alpha=0.9985,
              surrogate_loss="ce", init_tries=100):
    """CISA's transfer phase (module docstring): the Gaussian step-size search, then the dual-direction surrogate
    iterations, each step checked by one target query. Returns the decision state at the intermediate adversarial
    example (``dist`` +inf where none was found) with the compression's per-sample state. ``init_tries`` bounds
    the random-noise draws of the fallback start (``decision.find_start``, as ``hsja_init``)."""
    problem = ctx.problem
    x, n, dev = problem.x, problem.n, problem.x.device
    shape = tuple(x.shape[1:])

    # 1. Gaussian noise of growing scale: the distance to a nearby boundary sets the step size.
    start, found = x.clone(), torch.zeros(n, dtype=torch.bool, device=dev)
    scale = torch.full((n,), float(init_scale), dtype=torch.float64, device=dev)
    for _ in range(scale_tries if not problem.targeted else 0):
        live = ~found & has_budget(ctx)
        if not live.any():
            break
        idx = live.nonzero().squeeze(1)
        noise = ctx.rng.normal(shape, rows=idx).to(x.dtype)
        cand = (x[idx] + per_sample(scale[idx], noise).to(x.dtype) * noise).clamp(0.0, 1.0)
        adv, ok = query_adv(ctx, cand, idx)
        start[idx[adv]] = cand[adv]
        found[idx[adv]] = True
        scale[idx[ok & ~adv]] *= scale_growth
    if not found.all():
        rest = (~found).nonzero().squeeze(1)
        x0, hit = find_start(ctx.sub(rest), tries=init_tries)
        start[rest[hit]] = x0[hit]
        found[rest[hit]] = True
    noise_g = torch.where(found, problem.dist(start), torch.full((n,), float("inf"), device=dev))
    step = noise_g / exp_step

    # 2. Dual-direction ("Curls") iterations on the surrogates, each step checked by a target query.
    traj = torch.stack([x, x])  # (2, n, C, H, W): uphill, downhill
    steps = torch.zeros((2, n), dtype=torch.long, device=dev)
    dropped = torch.zeros((2, n), dtype=torch.bool, device=dev)
    up = torch.ones(n, dtype=torch.bool, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    x_tr = x.clone()
    everyone = torch.arange(n, device=dev)
    while True:
        up = torch.where(dropped[0], False, torch.where(dropped[1], True, up))  # an abandoned side hands over
        live = found & ~done & ~dropped.all(0) & has_budget(ctx)
        if not live.any():
            break
        side = (~up).long()  # 0 uphill, 1 downhill
        here = traj[side, everyone]
        k = steps[side, everyone]
        stop = live & (k > 0) & worthless(noise_g, problem.dist(here), k, worth_alpha)
        dropped[side[stop], stop.nonzero().squeeze(1)] = True
        up = torch.where(stop, ~up, up)
        go = (live & ~stop).nonzero().squeeze(1)
        if go.numel() == 0:
            continue
        first_down = (side[go] == 1) & (k[go] == 0)
        move = _direction(ctx, here[go], go, first_down, surrogate_loss)
        cand = (here[go] + per_sample(step[go], move).to(x.dtype) * move).clamp(0.0, 1.0)
        adv, ok = query_adv(ctx, cand, go)
        x_tr[go[adv]] = cand[adv]
        done[go[adv]] = True
        miss = ok & ~adv
        g, s = go[miss], side[go[miss]]
        traj[s, g] = cand[miss]
        steps[s, g] += 1
        up[g] = ~up[g]
        stuck = miss & (cand == here[go]).flatten(1).all(1)  # clipped in place: the trajectory cannot go on
        dropped[side[go[stuck]], go[stuck]] = True

    # 3. The intermediate adversarial example: the closer of the transfer point and the start.
    better = done & (problem.dist(x_tr) < noise_g)
    x_bd = rows_where(better, x_tr, start)
    dist = known_dist(problem, x_bd, found)
    return decision_state(problem, x_bd, dist, step_scale=torch.ones(n, dtype=torch.float64, device=dev),
                          window=torch.zeros((n, 2), dtype=torch.long, device=dev),
                          failed=torch.zeros_like(x), failures=torch.zeros(n, dtype=torch.long, device=dev))


@PERTURB.register("cisa", paper=PAPER, norms=("linf", "l2"),
                  ranges={"source_step": "(0, 1)", "spherical_step": "(0, inf)", "rate": "(0, 1]"})
def cisa(ctx, state, *, source_step=3e-3, spherical_step=0.1, rate=0.2):
    """One CISA noise-compression step for every sample with an adversarial point (module docstring): a
    customized-sampling candidate, one query, keep it if adversarial, adapt the source step every 20 queries.

    ``source_step`` 3e-3, ``spherical_step`` 0.1 and ``rate`` 0.2 are the defaults of the authors'
    ``cisa_main.py``; ``source_step`` is each sample's initial value (the state holds its adaptation factor).
    Returns the updated search state for the ``within_eps`` acceptance."""
    problem = ctx.problem
    x, x_bd, dist = problem.x, state["x_bd"], state["dist"]
    go = (torch.isfinite(dist) & has_budget(ctx)).nonzero().squeeze(1)
    out = {k: state[k].clone() for k in ("x_bd", "dist", "step_scale", "window", "failed", "failures")}
    if go.numel() == 0:
        return out
    shape = tuple(x.shape[1:])
    xs, cur = x[go], x_bd[go]
    scale = state["step_scale"][go]
    s = (source_step * scale).clamp(max=1.0)  # the adapted step never passes x
    d = cur - xs
    count = state["failures"][go]
    mean = -state["failed"][go] / per_sample(count.clamp_min(1), d).to(d.dtype)
    z = ctx.rng.normal(shape, rows=go).to(d.dtype)
    mask = griddle(d, rate, ctx.rng.uniform(shape, rows=go))
    probe = (mean + d.abs() * z) * mask
    size = spherical_step * flat_norm(d, problem.norm) / flat_norm(probe, problem.norm).clamp_min(1e-12)
    step = per_sample(size, probe) * probe
    if problem.norm == "l2":  # the authors': toward x by source_step, then back onto the sphere of that radius
        line = cur - per_sample(s, d).to(d.dtype) * d
        radius = flat_norm(line - xs, "l2")
        cand = line + step - xs
        cand = xs + cand * per_sample(radius / flat_norm(cand, "l2").clamp_min(1e-12), d)
    else:  # Linf: into the box shrunk by source_step
        radius = per_sample((1 - s) * dist[go].double(), d).to(d.dtype)
        cand = xs + torch.maximum(torch.minimum(d + step, radius), -radius)
    cand = cand.clamp(0.0, 1.0)
    adv, ok = query_adv(ctx, cand, go)

    win = out["window"][go] + torch.stack([ok.long(), adv.long()], 1)
    full = win[:, 0] >= WINDOW
    scale = torch.where(full, scale * torch.exp(win[:, 1].double() / win[:, 0].clamp_min(1) - TARGET_RATE), scale)
    out["window"][go] = torch.where(full[:, None], torch.zeros_like(win), win)
    out["step_scale"][go] = scale
    keep, miss = go[adv], ok & ~adv
    out["x_bd"][keep] = cand[adv]
    out["dist"][keep] = problem.sub(keep).dist(cand[adv])
    out["failed"][keep] = 0
    out["failures"][keep] = 0
    out["failed"][go[miss]] += probe[miss]
    out["failures"][go[miss]] += 1
    return out
