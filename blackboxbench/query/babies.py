"""BABIES, "Black-box Attack Based on IntErpolation Scheme" (Tran, Lu and Zhang, "Exploiting the local parabolic
landscapes of adversarial losses to accelerate black-box adversarial attack", ECCV 2022; BlackboxBench's reference
[34]; official code: github.com/HoangATran/BABIES, ``BABIES/run_BABIES.py``), batched over samples.

An L2 attack in the frequency domain on a sphere, SimBA-DCT style: iteration k takes the next coordinate q of a
per-sample "strided" ordering of the orthonormal 2-D DCT basis and

1. tries the move ``-step * q`` from the current perturbation delta, kept on (or inside) the L2 sphere of radius
   ``rho`` by :func:`sphere_step` (inside: add the move; on the sphere: a geodesic step of arc length
   ``step`` towards the move's tangent direction, the authors' ``l2_projection``); keeps it if the loss drops;
2. otherwise tries ``+step * q`` the same way;
3. otherwise (``interp``), if the two answers differ, fits the parabola through the losses at -step, 0, +step and
   moves by its minimiser ``t* = step (L- - L+) / (2 (L- + L+ - 2 L0))`` *without querying*: the state's loss
   becomes the parabola's value there. Every ``interval`` iterations the current image is queried to refresh the
   loss (interpolated values drift).

One or two queries per iteration, plus the refresh. Table VI (all columns): order strided, ``interp``
"store_false" (an argparse flag whose default is True: interpolation on); CIFAR-10 ``rho`` 2.4 untargeted / 4
targeted, ``eps`` 2 (the authors' "querying step", ``step`` here); these are the authors' CIFAR-10 commands
(``--rho=2.4 --eps=2.0``, targeted ``--rho=4.0``). Not in Table VI, the authors' CIFAR-10 values: ``freq_dims`` 20,
``stride`` 4, ``interval`` 10 (``loader.py``; 38 / 9 / 50 on ImageNet).

Norms and radius. ``rho`` is the attack's own sphere (the authors report success inside it). Every query is the
image projected onto the threat model's ball (``problem.project``), as BlackboxBench's pipeline projects the
attack's points: for L2 with eps >= rho that is the authors' attack exactly; with eps < rho (CIFAR-10 eps 1 and
rho 2.4) the queried perturbation is the sphere point scaled by eps / rho (up to the [0, 1] clip). Linf is not
native: the sphere points are clipped to the Linf ball.

Deviations: the loss is the CW margin of the log-probabilities (the authors use the true-class probability, or
the target's for targeted runs; the margin is BlackboxBench's score loss, see ``simba.py``); a candidate the oracle
sees adversarial is always kept (the state's loss may be an interpolated value); success is only what the oracle
saw (the authors check success with an uncounted extra forward every iteration); with ``interp`` off the loss is
not refreshed (it is always an oracle answer; the authors' code then re-queries every iteration); the ordering is
drawn per sample and restarts after the whole basis; the authors' geodesic step uses ``tan(step / ||delta||)``,
kept as is, except that a step from delta = 0 is scaled into the sphere.
"""
import torch

from ..registry import ACCEPT, INIT, PERTURB
from .common import per_sample, query_margin, rows_where, start_state
from .ppba import strided_order
from .simba import basis_images

PAPER = ("Tran, Lu and Zhang, Exploiting the local parabolic landscapes of adversarial losses to accelerate "
         "black-box adversarial attack (BABIES), ECCV 2022")
TINY = 1e-10  # the authors' guard on every norm


def _norm(v):
    return v.flatten(1).norm(dim=1)


def sphere_step(delta, move, radius):
    """The change of perturbation ``delta`` (n, ...) for a move ``move`` (n, ...) on the L2 ball of ``radius``
    (the authors' ``l2_projection``): ``move`` itself where ``||delta|| + ||move|| <= radius``; otherwise a step of
    length ``||delta|| tan(||move|| / ||delta||)`` along the component of the move tangent to the sphere at delta,
    then back onto the sphere of ``radius``. From delta = 0 the move is only scaled into the ball."""
    nx, nd = _norm(delta) + TINY, _norm(move) + TINY
    inside = radius - nx >= nd
    x_dir, d_dir = delta / per_sample(nx, delta), move / per_sample(nd, move)
    tangent = d_dir - x_dir * per_sample((d_dir * x_dir).flatten(1).sum(1), delta)
    scale = nx * torch.tan(nd / nx) / (_norm(tangent) + TINY)
    ahead = delta + tangent * per_sample(scale, delta)
    on = ahead * per_sample(radius / (_norm(ahead) + TINY), delta)
    new = torch.where(per_sample(inside, delta).bool(), delta + move, on)
    origin = nx <= 2 * TINY  # delta = 0: the tangent construction is undefined
    new = rows_where(origin, move * per_sample((radius / nd).clamp(max=1.0), move), new)
    return new - delta


def parabola_min(m_left, m0, m_right, step):
    """Minimiser ``t*`` of the parabola through (-step, m_left), (0, m0), (step, m_right) and its value (the
    authors' formula, with their 1e-10 in the denominator)."""
    curv = m_left + m_right - 2 * m0
    t = (m_left - m_right) * step / (curv + TINY) / 2
    value = curv / 2 / step ** 2 * t ** 2 + (m_right - m_left) / 2 / step * t + m0
    return t, value


@INIT.register("babies_init", paper=PAPER, norms=("linf", "l2"),
               ranges={"freq_dims": "int [1, inf)", "stride": "int [1, inf)"})
def babies_init(ctx, *, freq_dims=20, stride=4):
    """Start at the clean image (one query, delta 0) with a per-sample strided ordering of the DCT basis
    (``freq_dims`` 20, ``stride`` 4: the authors' CIFAR-10 values; Table VI: order strided)."""
    problem = ctx.problem
    n = problem.n
    return start_state(ctx, problem.x.clone(), perm=strided_order(ctx, freq_dims, stride),
                       delta=torch.zeros_like(problem.x), it=torch.zeros(n, dtype=torch.long, device=problem.x.device))


@PERTURB.register("babies", paper=PAPER, norms=("linf", "l2"), ranges={"rho": "(0, inf)", "step": "(0, inf)"})
def babies(ctx, state, *, rho=2.4, step=2.0):
    """The two probes ``delta -+ step q`` (each kept on the sphere of radius ``rho`` by :func:`sphere_step`, clipped
    to [0, 1]) for the next DCT coordinate q of every sample, and their projections onto the threat ball (the
    queries). ``rho`` 2.4 (4 targeted) and ``step`` 2 (Table VI's CIFAR-10 "rho" and "eps")."""
    problem = ctx.problem
    x, delta, it, perm = problem.x, state["delta"], state["it"], state["perm"]
    coords = perm.gather(1, (it % perm.shape[1])[:, None]).squeeze(1)
    q = basis_images(coords, x.shape[1:], True).to(x.dtype)
    inner = {}
    for side, sign in (("left", -1.0), ("right", 1.0)):
        inner[side] = (x + delta + sphere_step(delta, sign * step * q, rho)).clamp(0, 1)
    return {"left": problem.project(inner["left"]), "right": problem.project(inner["right"]),
            "inner_left": inner["left"], "inner_right": inner["right"], "q": q, "rho": rho, "step": step,
            "it": it + 1}


def _ask(ctx, images, rows):
    """Margins of ``images`` for local samples ``rows``, always asked as rows (see ``parsimonious.eot_margin``: the
    cost of a confirmation must not depend on which other samples needed a second probe)."""
    return query_margin(ctx, images, rows)


@ACCEPT.register("babies_accept", paper=PAPER, norms=("linf", "l2"),
                 ranges={"interp": (True, False), "interval": "int [1, inf)"})
def babies_accept(ctx, state, proposal, *, interp=True, interval=10):
    """Query the left probe; the right one where the left did not lower the margin; interpolate where neither did
    (``interp`` on: Table VI's "store_false"); refresh the margin by a query every ``interval`` iterations (10: the
    authors' CIFAR-10 value)."""
    problem, state = ctx.problem, dict(state)
    x, delta, m0 = problem.x, state["delta"], state["margin"]
    n = problem.n
    everyone = torch.arange(n, device=x.device)
    state["it"] = proposal["it"]

    m_left, adv_left, ok_left = _ask(ctx, proposal["left"], everyone)
    took_left = ok_left & ((m_left < m0) | adv_left)
    rest = (~took_left).nonzero().squeeze(1)
    m_right = torch.full_like(m0, float("inf"))
    adv_right, ok_right = torch.zeros_like(took_left), torch.zeros_like(took_left)
    if rest.numel():
        m, a, o = _ask(ctx, proposal["right"][rest], rest)
        m_right, adv_right, ok_right = m_right.index_put((rest,), m), adv_right.index_put((rest,), a), \
            ok_right.index_put((rest,), o)
    took_right = ~took_left & ok_right & ((m_right < m0) | adv_right)

    inner = rows_where(took_left, proposal["inner_left"], proposal["inner_right"])
    new_margin = torch.where(took_left, m_left, m_right)
    new_adv = torch.where(took_left, adv_left, adv_right)
    moved = took_left | took_right
    if interp:
        fit = ~moved & ok_left & ok_right & (m_left != m_right)
        if bool(fit.any()):
            t, value = parabola_min(m_left, m0, m_right, proposal["step"])
            t = torch.where(fit, t, torch.zeros_like(t))
            inner_fit = (x + delta + sphere_step(delta, per_sample(t, delta) * proposal["q"], proposal["rho"])).clamp(
                0, 1)
            inner = rows_where(fit, inner_fit, inner)
            new_margin = torch.where(fit, value, new_margin)
            new_adv = new_adv & ~fit  # an interpolated loss is no oracle answer
            moved = moved | fit
    state["delta"] = rows_where(moved, inner - x, delta)
    state["x_adv"] = rows_where(moved, problem.project(inner), state["x_adv"])
    state["margin"] = torch.where(moved, new_margin, m0)
    state["success"] = torch.where(moved, new_adv, state["success"])

    if interp:
        due = ((state["it"] % interval == 0) & ~state["success"]).nonzero().squeeze(1)
        if due.numel():
            m, a, o = _ask(ctx, state["x_adv"][due], due)
            state["margin"] = state["margin"].index_put((due[o],), m[o])
            state["success"] = state["success"].index_put((due[o],), a[o])
    return state
