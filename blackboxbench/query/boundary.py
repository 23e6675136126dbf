"""Boundary attack (Brendel, Rauber, Bethge, ICLR 2018), batched over samples: rejection sampling along the
decision boundary with per-sample step sizes adapted from success statistics.

Each step of a sample draws one Gaussian direction, makes it orthogonal to the source direction ``x - x_bd``
and scales it to ``spherical_step * d``, ``d = ||x - x_bd||_2``; the spherical candidate is that step projected
back onto the sphere of radius ``d`` around ``x`` (Pythagoras), clipped to [0, 1]; the candidate then moves
towards ``x`` by ``source_step * d`` (corrected for the clipping) and is clipped again. The candidate is queried
at every step and replaces ``x_bd`` when it is adversarial and closer. Every ``update_stats_every_k``-th step the
spherical candidate is queried as well (a second query) and both answers enter per-sample success windows:
the spherical window (last 100 checks) multiplies both step sizes by ``step_adaptation`` above a success rate
of 0.5 and divides them below 0.2; the candidate window (last 30 checks) multiplies the source step above 0.25
and divides it below 0.1; a window that triggered is emptied. A sample stops (stalls) when its source step falls
below ``source_step_convergance`` or after ``steps`` steps. These are the semantics of foolbox 3's
``BoundaryAttack`` (window lengths 100 / 30 and the four thresholds are its constants), which BlackboxBench's
code adopts with one candidate per step; unlike foolbox, every sample draws its own direction from its own
stream (foolbox shares one Gaussian vector across the batch).

L2-native: the search measures and shrinks the L2 distance under every threat norm; under Linf success is judged
by the Linf distance (the ``within_eps`` acceptance). One pipeline iteration is one step for every active sample:
one oracle call for the candidates and, of the samples at a statistics step, the spherical candidates.
"""
import torch

from ..registry import INIT, PERTURB
from ..threat import dist
from .decision import blended_start, decision_state, known_dist, has_budget, query_adv

PAPER = ("Brendel, Rauber, Bethge, Decision-Based Adversarial Attacks: Reliable Attacks Against Black-Box "
         "Machine Learning Models, ICLR 2018")
SPHERICAL_WINDOW = 100  # foolbox 3: success window of the spherical candidates (in statistics steps)
STEP_WINDOW = 30        # foolbox 3: success window of the full candidates (in statistics steps)
SPHERICAL_HIGH, SPHERICAL_LOW = 0.5, 0.2  # foolbox 3: grow / shrink both steps outside this success range
STEP_HIGH, STEP_LOW = 0.25, 0.1           # foolbox 3: grow / shrink the source step outside this range


def _l2(a, b):
    return torch.linalg.vector_norm((a - b).flatten(1), dim=1)


def proposals(x, x_bd, eta, spherical_step, source_step):
    """Boundary-attack candidates of every row -> ``(candidate, spherical)``, both like ``x``.

    ``eta`` (n, C, H, W) is the Gaussian draw of each row; ``spherical_step`` and ``source_step`` are (n,)
    relative step sizes. See the module docstring for the construction (foolbox 3's ``draw_proposals``).
    """
    shape, dt = x.shape, x.dtype
    xf, bf, e = x.flatten(1), x_bd.flatten(1), eta.flatten(1).to(dt)
    sph_step, src_step = spherical_step.to(dt)[:, None], source_step.to(dt)[:, None]
    source = xf - bf
    d = torch.linalg.vector_norm(source, dim=1, keepdim=True)
    unit = source / d
    e = e - (e * unit).sum(1, keepdim=True) * unit  # orthogonal to the source direction
    e = e * (sph_step * d / torch.linalg.vector_norm(e, dim=1, keepdim=True))
    spherical = (xf + (e - source) / torch.sqrt(sph_step ** 2 + 1)).clamp(0.0, 1.0)
    back = xf - spherical
    d_sph = torch.linalg.vector_norm(back, dim=1, keepdim=True)
    length = (src_step * d + d_sph - d).clamp_min(0.0) / d_sph  # source step, corrected for the clipping
    candidate = (spherical + length * back).clamp(0.0, 1.0)
    return candidate.view(shape), spherical.view(shape)


def window_push(hist, count, rows, values):
    """Append ``values`` (m,) bool to the circular success windows ``hist`` (n, W) of local ``rows`` (m,);
    ``count`` (n,) is the number of entries since the window was last emptied. Returns new (hist, count)."""
    hist, count = hist.clone(), count.clone()
    w = hist.shape[1]
    hist[rows, count[rows] % w] = values
    count[rows] += 1
    return hist, count


def window_rate(hist, count):
    """(n,) success rate over each full window (NaN where the window is not full yet)."""
    full = count >= hist.shape[1]
    return torch.where(full, hist.double().mean(1), torch.full_like(count, float("nan"), dtype=torch.float64))


def _scale(up, down, factor, like):
    """``factor`` where ``up``, ``1 / factor`` where ``down``, else 1 (in the dtype of ``like``)."""
    one = torch.ones_like(like)
    return torch.where(up, one * factor, torch.where(down, one / factor, one))


def adapt(state, factor):
    """foolbox 3's step-size adaptation from the success windows of ``state`` -> updated copies of
    ``spherical_step``, ``source_step``, ``sph_count``, ``cand_count`` (a window that triggered is emptied)."""
    sph, src = state["spherical_step"], state["source_step"]
    rate = window_rate(state["sph_hist"], state["sph_count"])
    up, down = rate > SPHERICAL_HIGH, rate < SPHERICAL_LOW  # NaN (not full) compares False
    scale = _scale(up, down, factor, sph)
    sph, src = sph * scale, src * scale
    sph_count = torch.where(up | down, torch.zeros_like(state["sph_count"]), state["sph_count"])
    rate = window_rate(state["cand_hist"], state["cand_count"])
    up, down = rate > STEP_HIGH, rate < STEP_LOW
    src = src * _scale(up, down, factor, src)
    cand_count = torch.where(up | down, torch.zeros_like(state["cand_count"]), state["cand_count"])
    return sph, src, sph_count, cand_count


@INIT.register("boundary_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"spherical_step": "(0, inf)", "source_step": "(0, 1)", "init_tries": "int [0, inf)"})
def boundary_init(ctx, *, spherical_step=0.01, source_step=0.01, init_tries=100):
    """Blended-uniform-noise start with a binary search of the blend factor (``decision.blended_start``;
    targeted: the pool's images of the target class first), and the initial step sizes (Table V: 0.01 and 0.01)
    and empty success windows of every sample."""
    problem = ctx.problem
    n, dev = problem.n, problem.x.device
    x_start, found = blended_start(ctx, tries=init_tries)
    dist = known_dist(problem, x_start, found)
    zero = torch.zeros(n, dtype=torch.long, device=dev)
    return decision_state(
        problem, x_start, dist,
        spherical_step=torch.full((n,), float(spherical_step), dtype=torch.float64, device=dev),
        source_step=torch.full((n,), float(source_step), dtype=torch.float64, device=dev),
        steps_done=zero, sph_hist=torch.zeros((n, SPHERICAL_WINDOW), dtype=torch.bool, device=dev),
        sph_count=zero.clone(), cand_hist=torch.zeros((n, STEP_WINDOW), dtype=torch.bool, device=dev),
        cand_count=zero.clone())


@PERTURB.register("boundary", paper=PAPER, norms=("linf", "l2"), native_norms=("l2",),
                  ranges={"steps": "int [1, inf)", "source_step_convergance": "[0, inf)",
                          "step_adaptation": "(1, inf)", "update_stats_every_k": "int [1, inf)"})
def boundary(ctx, state, *, steps=25000, source_step_convergance=1e-7, step_adaptation=1.5,
             update_stats_every_k=10):
    """One Boundary-attack step for every sample that has an adversarial point, has not converged (source step
    >= ``source_step_convergance``) and has steps left (``steps``); Table V: 25000, 1e-7, 1.5, 10.

    Returns the updated search state (``x_bd``, ``dist``, step sizes, windows) for the ``within_eps``
    acceptance.
    """
    problem = ctx.problem
    x, n = problem.x, problem.n
    go = (torch.isfinite(state["dist"]) & has_budget(ctx) & (state["steps_done"] < steps)
          & (state["source_step"] >= source_step_convergance))
    steps_done = state["steps_done"] + go.long()
    out = dict(state, steps_done=steps_done)
    idx = go.nonzero().squeeze(1)
    if idx.numel() == 0:
        return out
    x_bd = state["x_bd"]
    eta = ctx.rng.normal(x.shape[1:], rows=idx)
    cand, sph = proposals(x[idx], x_bd[idx], eta, state["spherical_step"][idx], state["source_step"][idx])
    check = steps_done[idx] % update_stats_every_k == 0
    c = check.nonzero().squeeze(1)
    m = idx.numel()
    adv, ok = query_adv(ctx, torch.cat([cand, sph[c]]), torch.cat([idx, idx[c]]))  # one call: a sample's candidate
    adv, ok, sph_adv, sph_ok = adv[:m], ok[:m], adv[m:], ok[m:]                  # is counted before its spherical
    check[c] = sph_ok
    if sph_ok.any():
        c, rows = c[sph_ok], idx[c[sph_ok]]
        out["sph_hist"], out["sph_count"] = window_push(state["sph_hist"], state["sph_count"], rows, sph_adv[sph_ok])
        out["cand_hist"], out["cand_count"] = window_push(state["cand_hist"], state["cand_count"], rows, adv[c])
    xi = x[idx]
    closer = adv & (_l2(cand, xi) < _l2(x_bd[idx], xi))  # closer in L2, the metric it searches
    if bool(closer.any()):
        rows, moved = idx[closer], cand[closer]
        out["x_bd"] = x_bd.index_put((rows,), moved)
        out["dist"] = state["dist"].index_put((rows,), dist(moved, xi[closer], problem.norm))
    if check.any():
        stats = torch.zeros(n, dtype=torch.bool, device=x.device)
        stats[idx[check]] = True  # adapt only at the samples' statistics steps (foolbox: every k-th step)
        sph_s, src_s, sph_c, cand_c = adapt(out, step_adaptation)
        out["spherical_step"] = torch.where(stats, sph_s, state["spherical_step"])
        out["source_step"] = torch.where(stats, src_s, state["source_step"])
        out["sph_count"] = torch.where(stats, sph_c, out["sph_count"])
        out["cand_count"] = torch.where(stats, cand_c, out["cand_count"])
    return out

