"""Evolutionary attack (Dong et al., CVPR 2019), batched over samples: a (1+1)-CMA-ES with a diagonal covariance
in a reduced search space, moving an adversarial point towards the clean image.

Each trial of a sample draws ``z ~ N(0, C)`` in the reduced space of ``m = C (H / sub) (W / sub)`` coordinates
(``C`` the sample's diagonal covariance), keeps only ``k = m / 20`` coordinates sampled without replacement with
probabilities proportional to the diagonal of ``C`` (the others are set to 0) and upsamples ``z`` bilinearly to
the image. As in the authors' code (ARES ``evolutionary_worker.attack``, realsafe ``Evolutionary.batch_attack``)
the candidate is the biased point ``b = x_bd + mu (x - x_bd)`` plus ``up(z)`` scaled to the length
``sigma * ||x - x_bd||_2``, moved along its ray from ``x`` onto the sphere of radius ``||x - b|| = |1 - mu| d``
and clipped to [0, 1]: for 0 < mu < 2 every candidate is closer than ``x_bd`` (clipping only brings it closer), so
a trial succeeds when the candidate is adversarial. A success replaces ``x_bd`` and updates the
evolution path ``p_c = (1 - c_c) p_c + sqrt(c_c (2 - c_c)) z`` and ``C_ii = (1 - c_cov) C_ii + c_cov (p_c)_i^2``.
``mu`` follows the 1/5th success rule: every 5 trials after the first 15, ``mu *= exp(P - 1/5)`` with ``P`` the
success rate of the last 15 trials. Each sample keeps its own ``mu``, ``p_c``, ``C`` and success window.

BlackboxBench's port (``evo_attack.py``) adds ``up(z)``, ``z ~ N(0, (0.01 d)^2 C)``, without the sphere and
accepts an adversarial candidate only when it is closer: below a ``mu`` of about ``||up(z)||^2 / (2 d^2)`` hardly
any candidate is, the success rate drops to 0, the 1/5th rule shrinks ``mu`` further and the search stalls for
good (on CIFAR-10 ResNet-20 at L2 1.0, 12 of 20 samples ended with ``mu`` below 1e-16).

L2-native: the search minimises the L2 distance under every threat norm; under Linf success is judged by the
Linf distance (the ``within_eps`` acceptance). One pipeline iteration is one trial (one query) for every active
sample, in one oracle call.
"""
import math

import torch
import torch.nn.functional as F

from ..errors import BenchError
from ..registry import INIT, PERTURB
from .common import per_sample, rows_where
from .decision import blended_start, decision_state, known_dist, has_budget, query_adv

PAPER = ("Dong, Su, Wu, Li, Liu, Zhang, Zhu, Efficient Decision-based Black-box Adversarial Attacks on Face "
         "Recognition, CVPR 2019")
WINDOW = 15          # success rate of the last 15 trials (BlackboxBench code: MAX_PAST_TRIALS)
UPDATE_EVERY = 5     # mu is updated every 5 trials once more than WINDOW trials are done (BlackboxBench code)
TARGET_RATE = 0.2    # the 1/5th success rule
SELECT_FRACTION = 1 / 20  # k = m / 20 coordinates per trial (paper and code)


def _l2(a, b):
    return (a - b).flatten(1).norm(dim=1)


def reduced_shape(shape, sub):
    """(C, H // sub, W // sub) of an image of ``shape`` (C, H, W), each side at least 1."""
    c, h, w = shape
    return c, max(1, h // sub), max(1, w // sub)


def select(u, weight, k):
    """(m_rows, m) bool masks of ``k`` coordinates per row, sampled without replacement with probabilities
    proportional to ``weight`` (Efraimidis-Spirakis: the ``k`` largest ``u_i^(1/w_i)``), ``u`` uniform in [0, 1)."""
    keys = torch.log1p(-u.double()) / weight.double().clamp_min(1e-30)  # log of (1 - u)^(1/w), (1 - u) in (0, 1]
    top = keys.topk(k, dim=1).indices
    return torch.zeros_like(u, dtype=torch.bool).scatter_(1, top, True)


def upsample(z, shape):
    """Reduced perturbations ``z`` (n, C, h, w) bilinearly upsampled to ``shape`` (H, W), corners aligned (the
    grid of ``scipy.ndimage.zoom(order=1)`` the reference code uses)."""
    return F.interpolate(z, size=tuple(shape), mode="bilinear", align_corners=True)


def candidates(x, x_bd, z, mu, sigma):
    """The authors' candidates, one per row: ``b = x_bd + mu (x - x_bd)`` plus ``up(z)`` scaled to length ``sigma
    ||x - x_bd||_2``, moved along its ray from ``x`` onto the sphere of radius ``||x - b||_2``, clipped to [0, 1];
    ``z`` (n, C, h, w) reduced, ``mu`` (n,), ``sigma`` a float."""
    biased = x_bd + per_sample(mu, x) * (x - x_bd)
    pert = upsample(z.to(x.dtype), x.shape[2:])
    step = pert * per_sample(sigma * _l2(x_bd, x) / pert.flatten(1).norm(dim=1).clamp_min(1e-30), x)
    out = biased + step - x
    scale = _l2(biased, x) / out.flatten(1).norm(dim=1).clamp_min(1e-30)  # onto the biased point's sphere
    return (x + out * per_sample(scale, x)).clamp(0.0, 1.0)


def cma_update(pc, cdiag, z, c_c, c_cov):
    """Evolution path and diagonal covariance after a successful trial with reduced draw ``z`` (n, m) (``N(0, C)``
    on the selected coordinates, before it is scaled) -> ``(pc, cdiag)``."""
    pc = (1 - c_c) * pc + math.sqrt(c_c * (2 - c_c)) * z
    return pc, (1 - c_cov) * cdiag + c_cov * pc ** 2


def one_fifth(mu, hist):
    """``mu * exp(P - 1/5)`` with ``P`` the success rate of each row's window ``hist`` (n, WINDOW)."""
    return mu * torch.exp(hist.double().mean(1) - TARGET_RATE)


@INIT.register("evolutionary_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"sub": "int [1, inf)", "mu": "(0, 1)", "init_tries": "int [0, inf)"})
def evolutionary_init(ctx, *, sub=2, mu=0.01, init_tries=100):
    """Blended-uniform-noise start with a binary search of the blend factor (``decision.blended_start``;
    targeted: the pool's images of the target class first); per sample the initial ``mu`` (0.01, the original
    paper), an empty evolution path, an identity covariance over the reduced space of factor ``sub`` (Table V: 2)
    and an empty success window."""
    problem = ctx.problem
    n, dev = problem.n, problem.x.device
    m = math.prod(reduced_shape(problem.x.shape[1:], sub))
    x_start, found = blended_start(ctx, tries=init_tries)
    dist = known_dist(problem, x_start, found)
    return decision_state(
        problem, x_start, dist, mu=torch.full((n,), float(mu), dtype=torch.float64, device=dev),
        pc=torch.zeros((n, m), device=dev), cdiag=torch.ones((n, m), device=dev),
        hist=torch.zeros((n, WINDOW), dtype=torch.bool, device=dev),
        trials=torch.zeros(n, dtype=torch.long, device=dev))


@PERTURB.register("evolutionary", paper=PAPER, norms=("linf", "l2"), native_norms=("l2",),
                  ranges={"sub": "int [1, inf)", "c_c": "(0, 1]", "c_cov": "(0, 1]", "sigma": "(0, inf)"})
def evolutionary(ctx, state, *, sub=2, c_c=0.01, c_cov=0.001, sigma=0.03):
    """One trial for every sample that has an adversarial point (see the module docstring); ``sub`` must be the
    init's (Table V: 2); ``c_c`` 0.01 and ``c_cov`` 0.001 are the paper's and the code's constants, ``sigma`` 0.03
    (the length of the random step relative to the distance) the default of the authors' ARES ``Evolutionary``.

    Returns the updated search state for the ``within_eps`` acceptance.
    """
    problem = ctx.problem
    x, n = problem.x, problem.n
    red = reduced_shape(x.shape[1:], sub)
    m = math.prod(red)
    if state["cdiag"].shape[1] != m:
        raise BenchError(f"evolutionary: sub {sub} gives {m} coordinates, the init's state has "
                         f"{state['cdiag'].shape[1]} (give both blocks the same sub)")
    go = torch.isfinite(state["dist"]) & has_budget(ctx)
    idx = go.nonzero().squeeze(1)
    if idx.numel() == 0:
        return dict(state)
    trials = state["trials"]
    due = go & (trials > WINDOW) & (trials % UPDATE_EVERY == 0)
    mu = torch.where(due, one_fifth(state["mu"], state["hist"]), state["mu"])
    x_bd, cdiag = state["x_bd"][idx], state["cdiag"][idx]
    k = max(1, int(m * SELECT_FRACTION))
    keep = select(ctx.rng.uniform((m,), rows=idx), cdiag, k)
    z = ctx.rng.normal((m,), rows=idx) * cdiag.sqrt() * keep
    cand = candidates(x[idx], x_bd, z.view(-1, *red), mu[idx], sigma)
    adv, ok = query_adv(ctx, cand, idx)
    win = adv & (_l2(cand, x[idx]) < _l2(x_bd, x[idx]))  # always closer for 0 < mu < 2
    pc, cd = cma_update(state["pc"][idx], cdiag, z, c_c, c_cov)
    better = torch.zeros(n, dtype=torch.bool, device=x.device)
    better[idx] = win
    asked = torch.zeros_like(better)
    asked[idx] = ok
    new_pc, new_cd, new_bd = state["pc"].clone(), state["cdiag"].clone(), state["x_bd"].clone()
    new_pc[idx], new_cd[idx], new_bd[idx] = pc, cd, cand
    hist = state["hist"].clone()
    rows = idx[ok]
    hist[rows, trials[rows] % WINDOW] = win[ok]
    out_bd = rows_where(better, new_bd, state["x_bd"])
    return dict(state, x_bd=out_bd, dist=torch.where(better, problem.dist(out_bd), state["dist"]), mu=mu,
                pc=rows_where(better, new_pc, state["pc"]), cdiag=rows_where(better, new_cd, state["cdiag"]),
                hist=hist, trials=trials + asked.long())
