"""Detection attack blocks: TOG's four objectives and its sign-gradient loop (Chow et al. 2020), DAG (Xie et al.
2017). Settings from the authors' code as the spec sheet (detection.md section 2) records them; the recipes in
``attacks/detection/`` cite them.

Objectives (registry ``det_objective``) are ``fn(ctx, x_adv, *, params) -> (N,)`` per-image losses to maximize.
The torchvision training losses are batch means; an objective built on them returns the batch loss for every
image, which keeps each image's gradient direction (the steps are sign or per-image normalized), so a sample's
result does not depend on its neighbours' images up to that positive scale.
"""
import torch

from ..registry import DET_CRAFT, DET_OBJECTIVE
from ..threat import flat_norm, per_sample

TOG = "Chow et al., TPS-ISA 2020 (TOG); git-disl/TOG tog/attacks.py"


# ---------------------------------------------------------------- shared steps

def ascent_step(problem, x_adv, grad, alpha):
    """One ascent step of size ``alpha`` (Linf: sign; L2: per-image unit gradient), projected to the ball."""
    if problem.norm == "linf":
        step = grad.sign()
    else:
        step = grad / per_sample(flat_norm(grad, "l2") + 1e-12, grad)
    return problem.project(x_adv + alpha * step)


def objective_grad(ctx, objective, x):
    """Gradient of the summed objective at ``x``."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = objective(ctx, x).sum()
        return torch.autograd.grad(loss, x)[0]


def random_start(ctx, x):
    """A uniform start inside the Linf ball (L2: a uniform direction of radius eps * u), per sample's stream."""
    p = ctx.problem
    u = ctx.rng.uniform(x.shape[1:]).to(x) * 2 - 1
    if p.norm == "l2":
        u = u / per_sample(flat_norm(u, "l2") + 1e-12, u) * per_sample(ctx.rng.uniform(()).to(x).flatten(), u)
    return p.project(x + p.eps * u)


@DET_CRAFT.register("sign_pgd", paper=TOG + " (update: eps 8/255, step 2/255, 10 iterations, uniform start)",
                    ranges={"iterations": "int [1, inf)", "alpha": "(0, 1]"})
def sign_pgd(ctx, objective, *, iterations=10, alpha=2 / 255, random_init=True):
    """TOG's loop: optional uniform random start, then ``iterations`` sign-gradient ascent steps of the
    objective, each projected to the eps ball and [0, 1]."""
    x_adv = random_start(ctx, ctx.problem.x) if random_init else ctx.problem.x.clone()
    for t in range(iterations):
        c = ctx.at(t=t, iterations=iterations, alpha=alpha)
        x_adv = ascent_step(ctx.problem, x_adv, objective_grad(c, objective, x_adv), alpha)
    return x_adv


# ---------------------------------------------------------------- TOG objectives

@DET_OBJECTIVE.register("none", paper="no objective: for craft blocks that carry their own (DAG, EBAD, CAA, OSFD, "
                        "PhantomSponges)")
def no_objective(ctx, x):
    """A constant zero: the craft block optimizes its own loss."""
    return (x * 0).flatten(1).sum(1)


def pseudo_truth(ctx, conf_thr):
    """The surrogate's clean detections with score >= ``conf_thr`` as targets (TOG's pseudo ground truth)."""
    out = []
    for d in ctx.problem.clean:
        keep = d["scores"] >= conf_thr
        out.append({"boxes": d["boxes"][keep], "labels": d["labels"][keep]})
    return out


def _per_image(total, n):
    return total.expand(n)


def _vanish_loss(model, x):
    """log(1 - p) over every candidate and class (maximize: every score to 0); R-CNN: minus the classification
    losses with no object (CE of the RPN and the RoI head towards background)."""
    if model.kind in ("fcos", "retinanet", "ssd"):
        p = model.candidates(x).clamp(1e-6, 1 - 1e-6)
        return torch.log1p(-p).flatten(1).mean(1)
    empty = [{"boxes": x.new_zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long, device=x.device)}] * len(x)
    losses = model.losses(x, empty)
    return _per_image(-sum(v for k, v in losses.items() if "class" in k or "objectness" in k), len(x))


@DET_OBJECTIVE.register("tog_vanishing", paper=TOG + " (object-vanishing: every objectness towards 0)")
def tog_vanishing(ctx, x):
    """Object vanishing: every candidate's class scores towards 0."""
    return _vanish_loss(ctx.model, x)


@DET_OBJECTIVE.register("tog_fabrication", paper=TOG + " (object-fabrication: every objectness towards 1)")
def tog_fabrication(ctx, x):
    """Object fabrication: every candidate's best class score towards 1 (log p, one-stage heads)."""
    p = ctx.model.candidates(x).clamp(1e-6, 1 - 1e-6)
    return torch.log(p.amax(-1)).flatten(1).mean(1)


@DET_OBJECTIVE.register("tog_untargeted", paper=TOG + " (untargeted: ascend the training loss on the clean "
                        "detections, threshold 0.2)", ranges={"conf_thr": "[0, 1]"})
def tog_untargeted(ctx, x, *, conf_thr=0.2):
    """Untargeted: ascend the training loss with the clean detections (score >= conf_thr) as ground truth."""
    return _per_image(sum(ctx.model.losses(x, pseudo_truth(ctx, conf_thr)).values()), len(x))


def mislabel_targets(ctx, conf_thr, mode):
    """The clean detections relabelled: ``ml`` the best other class among detections on (nearly) the same box
    (the same candidate, IoU >= 0.9), ``ll`` a class absent there (else the lowest-scored other one); with no
    other class on the box, ``ml`` takes the next class id and ``ll`` the previous one."""
    from torchvision.ops import box_iou

    out, c = [], ctx.problem.num_classes
    for d, t in zip(ctx.problem.clean, pseudo_truth(ctx, conf_thr)):
        labels = t["labels"].clone()
        if len(labels):
            same = box_iou(t["boxes"], d["boxes"]) >= 0.9  # (kept, all)
            for k in range(len(labels)):
                cls = d["labels"][same[k]]
                sc = d["scores"][same[k]]
                score = torch.full((c,), -1.0, device=sc.device).scatter_reduce(0, cls, sc, "amax")
                score[labels[k]] = float("nan")
                others = [j for j in range(c) if j != int(labels[k])]
                if mode == "ml":
                    found = [j for j in others if score[j] >= 0]
                    labels[k] = max(found, key=lambda j: float(score[j])) if found else (int(labels[k]) + 1) % c
                else:
                    absent = [j for j in others if score[j] < 0]
                    labels[k] = absent[-1] if absent else min(others, key=lambda j: float(score[j]))
        out.append({"boxes": t["boxes"], "labels": labels})
    return out


def candidate_targets(model, x, conf_thr, mode):
    """For a one-stage head: the candidates whose best clean class score is >= ``conf_thr`` (N, A) bool, their
    class (N, A) and their mislabel class (``ml``: the candidate's second most likely class; ``ll``: its least
    likely), from the clean image ``x`` (TOG's ML / LL selection per detection)."""
    with torch.no_grad():
        p = model.candidates(x)
    top2 = p.topk(2, -1).indices
    return p.amax(-1) >= conf_thr, top2[..., 0], top2[..., 1] if mode == "ml" else p.argmin(-1)


@DET_OBJECTIVE.register("tog_mislabel", paper=TOG + " (mislabel: every detection towards its ML or LL class)",
                        ranges={"conf_thr": "[0, 1]", "mode": ("ml", "ll")})
def tog_mislabel(ctx, x, *, conf_thr=0.2, mode="ml"):
    """Mislabel: every detected candidate (clean best score >= conf_thr) towards its ``ml`` (second most likely)
    or ``ll`` (least likely) class and away from its own: log p_target + log(1 - p_own) (one-stage heads). R-CNN:
    descend the training loss towards the clean detections relabelled (:func:`mislabel_targets`)."""
    model = ctx.model
    if model.kind not in ("fcos", "retinanet", "ssd"):
        return _per_image(-sum(model.losses(x, mislabel_targets(ctx, conf_thr, mode)).values()), len(x))
    det, own, tgt = candidate_targets(model, ctx.problem.x, conf_thr, mode)
    p = model.candidates(x).clamp(1e-6, 1 - 1e-6)
    gain = torch.log(p.gather(-1, tgt[..., None]))[..., 0] + torch.log1p(-p.gather(-1, own[..., None]))[..., 0]
    return (gain * det).sum(1)


# ---------------------------------------------------------------- DAG

@DET_CRAFT.register("dag", paper="Xie et al., ICCV 2017 (DAG); reference port yizhe-ang/detectron2-1 adv.py",
                    ranges={"iterations": "int [1, inf)", "gamma": "(0, 1]", "score_thr": "[0, 1)"})
def dag(ctx, objective, *, iterations=150, gamma=0.5 / 255, score_thr=0.1):
    """Dense Adversary Generation on a one-stage head's candidates: the targets are the candidates whose best
    class score exceeds ``score_thr`` on the clean image, each with a random wrong label (the sample's stream);
    while some target of an image is not yet predicted as its label, x += gamma * r / ||r||_inf with
    r = grad sum over active targets (log p_adv - log p_true). ``objective`` is unused (DAG has its own)."""
    model, x = ctx.model, ctx.problem.x
    with torch.no_grad():
        p0 = model.candidates(x)
    n, a, c = p0.shape
    true = p0.argmax(-1)
    target = p0.amax(-1) > score_thr
    shift = 1 + (ctx.rng.uniform((a,)).to(x.device) * (c - 1)).long().clamp_max(c - 2)
    adv = (true + shift) % c
    x_adv = x.clone()
    for _ in range(iterations):
        xg = x_adv.detach().requires_grad_(True)
        with torch.enable_grad():
            logp = torch.log(model.candidates(xg).clamp_min(1e-8))
            active = target & (logp.argmax(-1) != adv)
            if not bool(active.any()):
                break
            gain = (logp.gather(-1, adv[..., None]) - logp.gather(-1, true[..., None]))[..., 0]
            r = torch.autograd.grad((gain * active).sum(), xg)[0]
        live = per_sample(active.any(1).to(x.dtype), x)
        r = r / per_sample(flat_norm(r, "linf") + 1e-12, r)
        x_adv = ctx.problem.project(x_adv + live * gamma * r)
    return x_adv
