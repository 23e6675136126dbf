"""Update step of the transfer pipeline (Alg. 3 line 13 of the BlackboxBench paper, Supp. F-C).

L_inf: ``x + alpha * sign(g)``; L_2: ``x + alpha * g / ||g||_2`` per sample; then projection onto the eps ball and
[0, 1] (``Clip_x^eps``). The step size ``ctx.alpha`` is the pipeline's (Table VII: eps/10). An update block is
``fn(ctx, x_adv, direction, **params) -> x_adv``.
"""
from ..errors import BenchError
from ..registry import UPDATE
from ..threat import flat_norm, per_sample


def _linf_step(x_adv, direction, alpha):
    return x_adv + alpha * direction.sign()


def _l2_step(x_adv, direction, alpha):
    # 1e-12 keeps a zero direction a zero step (as the reference implementation does).
    return x_adv + alpha * direction / per_sample(flat_norm(direction, "l2") + 1e-12, direction)


STEPS = {"linf": _linf_step, "l2": _l2_step}


@UPDATE.register("step", paper="BlackboxBench Alg. 3 line 13 (I-FGSM step, Kurakin et al. 2017)",
                 norms=tuple(STEPS))
def step(ctx, x_adv, direction):
    """One normalized ascent step of size ``ctx.alpha`` along ``direction``, projected to the threat model."""
    problem = ctx.problem
    if problem.norm not in STEPS:
        raise BenchError(f"update 'step': unsupported norm '{problem.norm}' (supported: {', '.join(STEPS)})")
    return problem.project(STEPS[problem.norm](x_adv, direction, ctx.alpha))
