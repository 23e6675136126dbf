"""Detection attack blocks: TOG's four objectives and its sign-gradient loop (Chow et al. 2020), DAG (Xie et al.
2017). Settings from the authors' code as the spec sheet (detection.md section 2) records them; the recipes in
``attacks/detection/`` cite them.

Objectives (registry ``det_objective``) are ``fn(ctx, x_adv, *, params) -> (N,)`` per-image losses to maximize.
The torchvision training losses are batch means; an objective built on them returns the batch loss for every
image, which keeps each image's gradient direction (the steps are sign or per-image normalized), so a sample's
result does not depend on its neighbours' images up to that positive scale.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import BenchError, describe
from ..registry import DET_CRAFT, DET_OBJECTIVE, block_label
from ..threat import flat_norm, per_sample
from .context import U_STEP, ContextTables, sequential_plans
from .models import ONE_STAGE, TWO_STAGE

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
        loss = objective(ctx, x)
        if not isinstance(loss, torch.Tensor) or loss.shape != x.shape[:1]:
            raise BenchError(f"objective {block_label(objective)} returned {describe(loss)} for {x.shape[0]} "
                             f"images: an objective returns one value per image, shaped ({x.shape[0]},)")
        return torch.autograd.grad(loss.sum(), x)[0]


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


def detect_at(model, x, conf_thr):
    """``model``'s detections on ``x`` with its score threshold lowered to ``conf_thr`` for the call (its cap
    kept), as the family's clean detections (:func:`~blackboxbench.detection.family.forward_dets`)."""
    from .family import forward_dets

    old = model.score_thr, model.max_det
    model.harmonize(conf_thr, old[1])
    try:
        return forward_dets(model, x, "the surrogate")
    finally:
        model.harmonize(*old)


def _memo(problem, key, make):
    """``make()`` once per problem: targets read off the clean images, which every step of a batch reuses. Kept in
    the instance's ``__dict__``, not a dataclass field, so that ``sub`` and ``copy`` (built from the fields) never
    hand one batch's targets to another."""
    memo = problem.__dict__.setdefault("_memo", {})
    if key not in memo:
        memo[key] = make()
    return memo[key]


def pseudo_truth(ctx, conf_thr):
    """TOG's pseudo ground truth: the surrogate's clean detections at its own operating threshold (TOG's
    ``victim.detect(x, conf_threshold=victim.confidence_thresh_default)``: 0.20 for its YOLOv3, 0.70 for its Faster
    R-CNN; here the detector's own post-processing threshold, 0.3 on the tiny detectors), with score >=
    ``conf_thr`` too, whatever score threshold the run evaluates at. Where that is below the run's, the clean
    image is detected again at it (once per batch, :func:`_memo`); otherwise the family's clean detections are
    filtered."""
    model, p = ctx.model, ctx.problem
    thr = max(conf_thr, model.own[0])
    dets = _memo(p, ("detected_at", thr), lambda: detect_at(model, p.x, thr)) if thr < model.score_thr else p.clean
    out = []
    for d in dets:
        keep = d["scores"] >= thr
        out.append({"boxes": d["boxes"][keep], "labels": d["labels"][keep], "scores": d["scores"][keep]})
    return out


def _per_image(total, n):
    return total.expand(n)


def _training_loss_each(model, x, targets):
    """(N,) each image's summed training loss towards its own ``targets``, one image at a time (as TOG runs): a
    batch's loss is a batch mean whose normalizer (FCOS: the positives of the whole batch) and conv numerics move
    with the batch, which flipped gradient signs near 0 (untargeted, 4 shapes images, 2 steps: one pixel)."""
    return torch.stack([sum(model.losses(x[i:i + 1], [t]).values()) for i, t in enumerate(targets)])


def _vanish_loss(model, x):
    """log(1 - p) over every candidate and class (maximize: every score to 0). R-CNN as TOG's Faster R-CNN
    object_vanishing_loss (models/frcnn.py; descended there, ascended here with its sign flipped): minus the mean
    binary cross-entropy of every RPN anchor towards background and the mean cross-entropy of every proposal's RoI
    class distribution towards background, per image. TOG's RPN term covers every anchor (the training loss
    would sample 64 of them); its RoI term the RoIs its training-mode sampler draws, here the RPN's test-time
    proposals (as the fabrication loss)."""
    if model.kind in ONE_STAGE:
        p = model.candidates(x).clamp(1e-6, 1 - 1e-6)
        return torch.log1p(-p).flatten(1).mean(1)
    objectness, roi = model.two_stage_logits(x)
    bce = F.binary_cross_entropy_with_logits(objectness, torch.zeros_like(objectness), reduction="none").mean(1)
    cls = torch.stack([F.cross_entropy(r, r.new_zeros(len(r), dtype=torch.long)) if len(r) else r.sum()
                       for r in roi])
    return -(bce + cls)


@DET_OBJECTIVE.register("tog_vanishing", paper=TOG + " (object-vanishing: every objectness towards 0)")
def tog_vanishing(ctx, x):
    """Object vanishing: every candidate's class scores towards 0."""
    return _vanish_loss(ctx.model, x)


@DET_OBJECTIVE.register("tog_fabrication", paper=TOG + " (object-fabrication: every objectness towards 1; "
                        "R-CNN: models/frcnn.py object_fabrication_loss)", ranges={"rpn": "[0, inf)"})
def tog_fabrication(ctx, x, *, rpn=1.0):
    """Object fabrication: one-stage heads, every candidate's best class score towards 1 (log p); two-stage
    heads as TOG's Faster R-CNN loss (descended there, ascended here with its sign flipped): every RPN anchor
    towards object (minus ``rpn`` times the mean binary cross-entropy to 1; TOG: weight 1) and every proposal's
    RoI class distribution away from its own top class (plus the mean cross-entropy to its argmax, background
    included), per image. TOG scores the RoIs its training-mode sampler draws; here the RPN's test-time
    proposals. On the tiny Faster R-CNN the RPN term saturates the proposals and cancels the fabrication (8
    shapes images: 2.88 -> 2.75 detections per image at weight 1, 2.88 -> 9.0 at weight 0)."""
    if ctx.model.kind in TWO_STAGE:
        objectness, roi = ctx.model.two_stage_logits(x)
        bce = F.binary_cross_entropy_with_logits(objectness, torch.ones_like(objectness), reduction="none").mean(1)
        cls = torch.stack([F.cross_entropy(r, r.argmax(1)) if len(r) else r.sum() for r in roi])
        return cls - rpn * bce
    p = ctx.model.candidates(x).clamp(1e-6, 1 - 1e-6)
    return torch.log(p.amax(-1)).flatten(1).mean(1)


@DET_OBJECTIVE.register("tog_untargeted", paper=TOG + " (untargeted: ascend the training loss on the clean "
                        "detections, threshold 0.2; R-CNN: the fabrication loss on an image without detection, "
                        "models/frcnn.py compute_object_untargeted_gradient)", ranges={"conf_thr": "[0, 1]"})
def tog_untargeted(ctx, x, *, conf_thr=0.2):
    """Untargeted: ascend the training loss with the clean detections (score >= conf_thr) as ground truth. On a
    two-stage head, an image without such a detection takes :func:`tog_fabrication` (RPN weight 1) instead, as
    TOG's Faster R-CNN (one image per call there, so the switch is per image here). One-stage heads keep the
    training loss, whose empty ground truth still has a target (every candidate background), as TOG's YOLOv3 and
    SSD, which have no switch."""
    model, truth = ctx.model, pseudo_truth(ctx, conf_thr)
    if model.kind not in TWO_STAGE:
        return _training_loss_each(model, x, truth)
    empty = torch.tensor([not len(t["labels"]) for t in truth], device=x.device)
    out = x.new_zeros(len(x))
    if not bool(empty.all()):
        keep = (~empty).nonzero()[:, 0]
        out = out.index_put((keep,), _training_loss_each(model, x[keep], [truth[i] for i in keep.tolist()]))
    if bool(empty.any()):
        out = out.index_put((empty.nonzero()[:, 0],), tog_fabrication(ctx, x[empty]))
    return out


def mislabel_targets(ctx, conf_thr, mode):
    """TOG's relabelled pseudo ground truth (attack_utils/target_utils.py): each clean detection (score >=
    ``conf_thr``, :func:`pseudo_truth`) keeps its box and takes its ``ml`` or ``ll`` class (:func:`relabel`) from
    its own class scores (:func:`detection_class_scores`: TOG reads each detection's class logits); computed
    once per batch (:func:`_memo`), not at every step."""
    def make():
        truth = pseudo_truth(ctx, conf_thr)
        scores = detection_class_scores(ctx.model, ctx.problem.x, truth)
        return [{"boxes": t["boxes"], "labels": relabel(t["labels"], v, mode)} for t, v in zip(truth, scores)]
    return _memo(ctx.problem, ("mislabel", conf_thr, mode), make)


def relabel(labels, scores, mode):
    """The target class of each detection, (k,), from its own label ``labels`` (k,) and class scores ``scores``
    (k, C), background excluded: ``ml`` the most likely other class, ``ll`` the least likely one (ties: the
    lowest class id). TOG's ML takes the highest logit among the classes whose softmax is at or below the
    confidence threshold: on 20 or 80 classes the next class after the detected one; on the 3 shapes classes
    softmax puts at least one third on the top class, so the rule could leave no class or return the detection's
    own, and the next most likely other class is taken. TOG's LL is the lowest logit, as here."""
    if not len(labels):
        return labels.clone()
    other = torch.arange(scores.shape[1], device=labels.device)[None] != labels[:, None]
    if mode == "ml":
        return torch.where(other, scores, -math.inf).argmax(1)
    return torch.where(other, scores, math.inf).argmin(1)


def detection_class_scores(model, x, truth):
    """Per image, the class scores (k, C) of each detection of ``truth`` on the clean images ``x`` (TOG keeps
    each detection's class logits): a one-stage head's candidate that produced it (among the candidates whose
    decoded box overlaps the detection's at IoU >= 0.5, the one whose score of the detected class is the
    detection's score; the best-overlapping one where none overlaps so); a two-stage head's RoI class
    distribution of the detection's box as a proposal (:meth:`~blackboxbench.detection.models.Detector.
    box_class_scores`). Ranking by these scores is ranking by the class logits (FCOS: sqrt(cls * ctr), the
    centerness shared by the classes)."""
    from torchvision.ops import box_iou

    h, w = x.shape[-2:]
    out = []
    with torch.no_grad():
        for i, t in enumerate(truth):
            if not len(t["labels"]):
                out.append(x.new_zeros(0, model_classes(model)))
                continue
            if model.kind not in ONE_STAGE:
                out.append(model.box_class_scores(x[i:i + 1], [t["boxes"]])[0])
                continue
            probs, boxes = model.candidates(x[i:i + 1], boxes=True)
            boxes = torch.minimum((boxes[0] * boxes.new_tensor([w, h, w, h])).clamp_min(0),
                                  boxes.new_tensor([w, h, w, h]))  # in x's pixels, clipped as the detections
            iou = box_iou(t["boxes"].to(boxes), boxes)  # (k, A)
            gap = (probs[0][:, t["labels"]].T - t["scores"][:, None].to(probs)).abs()  # (k, A)
            near = iou >= 0.5
            pick = torch.where(near.any(1), torch.where(near, gap, math.inf).argmin(1), iou.argmax(1))
            out.append(probs[0][pick])
    return out


def model_classes(model):
    return int((model.label_map >= 0).sum())


@DET_OBJECTIVE.register("tog_mislabel", paper=TOG + " (mislabel: descend the training loss towards the clean "
                        "detections relabelled ML or LL)",
                        ranges={"conf_thr": "[0, 1]", "mode": ("ml", "ll")})
def tog_mislabel(ctx, x, *, conf_thr=0.2, mode="ml"):
    """Mislabel as TOG (models/yolov3.py, frcnn.py build_object_mislabeling_loss): descend the detector's
    training loss with the clean detections (score >= conf_thr) relabelled to their ``ml`` (most likely other)
    or ``ll`` (least likely) class as the ground truth (:func:`mislabel_targets`), on every head."""
    return -_training_loss_each(ctx.model, x, mislabel_targets(ctx, conf_thr, mode))


# ---------------------------------------------------------------- DAG

DAG = ("Xie et al., ICCV 2017 (DAG); the authors' cihangxie/DAG code/{fooling_det_net,assign_target_det,"
       "generate_mapping,forward_propogation_det,back_propogation_det}.m")


def dag_targets(boxes, scores, gt_boxes, gt_labels, iou_thr=0.1, score_thr=0.1):
    """DAG's targets on one image (assign_target_det.m): the candidates whose box ``boxes`` (A, 4) has IoU >
    ``iou_thr`` with a ground-truth box whose class scores > ``score_thr`` on the candidate (``scores`` (A, C) on the
    clean image); each takes the class of the qualifying ground truth of highest IoU. (A,) labels, -1 elsewhere."""
    from torchvision.ops import box_iou

    if not len(gt_labels):
        return torch.full(boxes.shape[:1], -1, dtype=torch.long, device=boxes.device)
    iou = box_iou(gt_boxes.to(boxes), boxes)  # (G, A)
    ok = (iou > iou_thr) & (scores[:, gt_labels].T > score_thr)
    best = torch.where(ok, iou, -1.0).argmax(0)
    return torch.where(ok.any(0), gt_labels.to(boxes.device)[best], -1)


def dag_mapping(gt_labels, c, u):
    """DAG's adversarial label of each class (generate_mapping.m), (c,): every class of the image's ground truth
    ``gt_labels`` (in increasing order) to a distinct class absent from the image, taken in the random order of the
    uniforms ``u`` (c,); where the image leaves too few classes absent (3 shapes classes), the rest to the first
    other class in that order. Classes not in the image map to themselves (never used)."""
    order = u.argsort().tolist()
    present = sorted(set(gt_labels.tolist()))
    absent = [k for k in order if k not in present]
    m = list(range(c))
    for j, k in enumerate(present):
        m[k] = absent[j] if j < len(absent) else next(o for o in order if o != k)
    return torch.tensor(m, device=gt_labels.device)


def dag_strong(pred, score, true, adv, boxes, thr=0.8, nms_iou=0.35):
    """DAG's check of a strong adversarial result (forward_propogation_det.m), on a batch: among the targets
    predicted as their adversarial label (``pred`` == ``adv``; ``true`` -1: no target), those that class-agnostic
    NMS at IoU ``nms_iou`` on the predicted ``score`` keeps with a score below ``thr`` count as still predicted as
    their true label. (N, A) each, ``boxes`` (N, A, 4); NMS within each image. The predictions so corrected."""
    from torchvision.ops import batched_nms

    img, cand = ((true >= 0) & (pred == adv)).nonzero(as_tuple=True)
    keep = batched_nms(boxes[img, cand].float(), score[img, cand].float(), img, nms_iou)
    weak = keep[score[img[keep], cand[keep]] < thr]
    pred = pred.clone()
    pred[img[weak], cand[weak]] = true[img[weak], cand[weak]]
    return pred


@DET_CRAFT.register("dag", paper=DAG + " (step 0.5 / ||r||_inf, 150 iterations, targets at IoU > 0.1 and score > "
                    "0.1, RPN NMS 0.9, strong result: score 0.8 after NMS 0.35)",
                    ranges={"iterations": "int [1, inf)", "gamma": "(0, 1]", "score_thr": "[0, 1)",
                            "iou_thr": "[0, 1)", "strong": "[0, 1]", "strong_iou": "(0, 1]", "rpn_nms": "(0, 1]"})
def dag(ctx, objective, *, iterations=150, gamma=0.5 / 255, score_thr=0.1, iou_thr=0.1, strong=0.8, strong_iou=0.35,
        rpn_nms=0.9):
    """Dense Adversary Generation as the authors' code. Targets (:func:`dag_targets`): on a two-stage head the
    RPN's proposals on the clean image (NMS threshold raised to ``rpn_nms``), kept fixed and classified by its RoI
    head on every iterate (DAG's own setting); on a one-stage head its candidates with their boxes on the clean
    image; those at IoU > ``iou_thr`` with a ground-truth box whose class scores > ``score_thr`` there, labelled
    with that class, each class mapped to a random class absent from the image (:func:`dag_mapping`, the sample's
    stream). While some target of an image is still predicted as its true label (after :func:`dag_strong`),
    x += gamma * r / ||r||_inf, r = grad of the sum over the targets predicted neither as their adversarial label
    nor as background of (log p_adv - log p_true): the logit difference on a softmax head. Each iterate is clipped
    to [0, 1] (the authors never clip). ``objective`` is unused (DAG has its own)."""
    model, p = ctx.model, ctx.problem
    x, (h, w) = p.x, p.x.shape[-2:]
    if model.kind in ONE_STAGE:
        logp_of = lambda xi: torch.log(model.candidates(xi).clamp_min(1e-30))  # noqa: E731
        with torch.no_grad():
            p0, boxes = model.candidates(x, boxes=True)
        boxes = boxes * boxes.new_tensor([w, h, w, h])
    else:
        proposals, sizes = model.proposals(x, rpn_nms)
        logp_of = lambda xi: model.proposal_scores(xi, proposals, log=True)  # noqa: E731  (padding rows: 0)
        boxes = torch.nn.utils.rnn.pad_sequence([b * b.new_tensor([w / s[1], h / s[0]] * 2)  # to x's pixels
                                                 for b, s in zip(proposals, sizes)], batch_first=True)
        with torch.no_grad():
            p0 = model.proposal_scores(x, proposals)
    c = p0.shape[-1]
    u = ctx.rng.uniform((c,)).to(x.device)
    true = torch.stack([dag_targets(b, s, g["boxes"], g["labels"], iou_thr, score_thr)
                        for b, s, g in zip(boxes, p0, p.gt)])
    adv = torch.stack([dag_mapping(g["labels"], c, ui)[t.clamp_min(0)] for g, ui, t in zip(p.gt, u, true)])
    target = true >= 0
    x_adv = x.clone()
    for _ in range(iterations):
        xg = x_adv.detach().requires_grad_(True)
        with torch.enable_grad():
            logp = logp_of(xg)
            with torch.no_grad():
                prob = logp.exp()
                score, pred = prob.max(-1)
                if model.kind not in ONE_STAGE:  # the background: what the foreground classes leave
                    bg = 1 - prob.sum(-1)
                    pred, score = torch.where(bg > score, -1, pred), torch.maximum(bg, score)
                pred = dag_strong(pred, score, true, adv, boxes, strong, strong_iou)
            live = (target & (pred == true)).any(1)
            if not bool(live.any()):
                break
            active = target & (pred != adv) & (pred >= 0) & live[:, None]
            gain = logp.gather(-1, adv[..., None])[..., 0] - logp.gather(-1, true.clamp_min(0)[..., None])[..., 0]
            r = torch.autograd.grad(torch.where(active, gain, 0).sum(), xg)[0]
        r = r / per_sample(flat_norm(r, "linf") + 1e-12, r)
        x_adv = p.project(x_adv + per_sample(live.to(x.dtype), x) * gamma * r)
    return x_adv


# ---------------------------------------------------------------- OSFD

OSFD = "Ding et al., AAAI 2024 (OSFD); wakuwu/OSFD attack/ours/OSFD.py, attack/base/{MI,RRB}.py"


def _rotate(x, boxes, u, angle, jitter):
    """RRB's random axis rotation of one image ``x`` (1, C, H, W) (the authors' ``random_axis_rotation``): by an
    angle uniform in [-angle, angle] degrees about a centre drawn uniformly from the centres of ``boxes`` (g, 4)
    and the image's, each moved by an integer in [-jitter, jitter) pixels per axis; nearest-neighbour sampling,
    zero fill (torchvision's rotate, as theirs). ``u``: 4 uniforms."""
    from torchvision.transforms.functional import rotate

    h, w = x.shape[-2:]
    centres = torch.cat([(boxes[:, :2] + boxes[:, 2:]) / 2, boxes.new_tensor([[w // 2, h // 2]])])
    c = centres[min(int(u[0] * len(centres)), len(centres) - 1)]
    j = int(jitter)
    shift = [math.floor(float(v) * 2 * j) - j for v in u[1:3]] if j else [0, 0]
    return rotate(x, float(u[3]) * 2 * angle - angle, center=[int(c[0] + shift[0]), int(c[1] + shift[1])])


def _resize(x, boxes, u, rho, s_max):
    """RRB's box-adaptive random resizing of one image ``x`` (1, C, H, W) (the authors' ``adaptive_random_resizing``):
    a box of ``boxes`` drawn uniformly sets the scale s = min(1 + rho * box side / image side, s_max) per axis;
    the image is resized (bilinear, corners aligned) to a size drawn among the integers in [side, int(s * side)],
    zero-padded at a random offset to int(s * side) and resized back. No box: unchanged. ``u``: 5 uniforms."""
    if not len(boxes):
        return x
    h, w = x.shape[-2:]
    b = boxes[min(int(u[0] * len(boxes)), len(boxes) - 1)]
    full = [int(min(1 + rho * float(b[3] - b[1]) / h, s_max) * h), int(min(1 + rho * float(b[2] - b[0]) / w, s_max) * w)]
    new = [side + math.floor(float(v) * (f - side + 1)) for side, f, v in zip((h, w), full, u[1:3])]
    top, left = (math.floor(float(v) * (f - n + 1)) for f, n, v in zip(full, new, u[3:5]))
    out = F.interpolate(x, size=new, mode="bilinear", align_corners=True)
    out = F.pad(out, (left, full[1] - new[1] - left, top, full[0] - new[0] - top))
    return F.interpolate(out, size=(h, w), mode="bilinear", align_corners=True)


def rrb(ctx, x, copies, angle, jitter, rho, s_max, sigma):
    """OSFD's random robust transform (the authors' ``RRB.preprocess_data``), ``copies`` stacked copies (K*n, C,
    H, W): copy 1 the image rotated (:func:`_rotate`), copy 2 that rotated image resized (:func:`_resize`), each
    later copy the previous one transformed again by the next of the two in turn; then Gaussian noise of std
    ``sigma`` on every copy, clipped to [0, 1]. The rotation centres and the resizing boxes are each image's
    ground-truth boxes (theirs: the dataset's ``gt_bboxes``). Random numbers from the samples' streams;
    differentiable in ``x``."""
    gt = [g["boxes"].to(x) for g in ctx.problem.gt]
    out, cur = [], x
    for i in range(copies):
        u = ctx.rng.uniform((5,)).tolist()
        cur = torch.cat([_rotate(cur[r:r + 1], gt[r], u[r][:4], angle, jitter) if i % 2 == 0
                         else _resize(cur[r:r + 1], gt[r], u[r], rho, s_max) for r in range(len(x))])
        out.append(cur)
    out = torch.cat(out)
    return (out + sigma * ctx.rng.normal(x.shape[1:], rows=ctx.rows(len(out))).to(x)).clamp(0, 1)


@DET_CRAFT.register("osfd", paper=OSFD + " (k 3, eps 5/255, noise start randint[-2, 2], MI momentum 1, RRB: "
                    "2 copies, 10 deg about a box or the image centre, 10 px, box-adaptive resize rho 1 up to 1.1, "
                    "noise 6/255)",
                    ranges={"k": "(0, inf)", "iterations": "int [1, inf)", "alpha": "(0, 1]", "momentum": "[0, inf)",
                            "copies": "int [1, inf)", "angle": "[0, 180]", "jitter": "int [0, inf)",
                            "rho": "[0, inf)", "s_max": "[1, inf)", "sigma": "[0, 1]", "start": "[0, 1]"})
def osfd(ctx, objective, *, k=3.0, iterations=10, alpha=1 / 255, momentum=1.0, copies=2, angle=10.0, jitter=10,
         rho=1.0, s_max=1.1, sigma=6 / 255, start=2 / 255):
    """Object-aware significant feature distortion: maximize sum over the backbone body's stages of
    MSE(k * F_clean, F_adv), the clean features of the clean images, on the :func:`rrb` copies of the current
    image; momentum on the gradient normalized by its mean |g| per image, sign steps of ``alpha``. As the
    authors' pipeline the state is the noise, integer noise in [-start, start] to begin with, clipped to +-eps
    only: the image x + noise is clipped to [0, 1] where the detector reads it (RRB's clip) and in the output
    (theirs at evaluation), not between the steps. ``objective`` unused."""
    model, p = ctx.model, ctx.problem
    with torch.no_grad():
        target = [k * f for f in model.features(p.x)]
    levels = round(start * 255)
    noise = torch.floor(ctx.rng.uniform(p.x.shape[1:]).to(p.x) * (2 * levels + 1)) - levels
    noise = (noise / 255).clamp(-p.eps, p.eps)
    g_acc = torch.zeros_like(p.x)
    for _ in range(iterations):
        ng = noise.detach().requires_grad_(True)
        with torch.enable_grad():
            feats = model.features(rrb(ctx, p.x + ng, copies, angle, jitter, rho, s_max, sigma))
            loss = sum(((f - t.repeat(copies, 1, 1, 1)) ** 2).mean() for f, t in zip(feats, target))
            g = torch.autograd.grad(loss, ng)[0]
        g_acc = momentum * g_acc + g / per_sample(g.abs().flatten(1).mean(1) + 1e-12, g)
        noise = (noise + alpha * g_acc.sign()).clamp(-p.eps, p.eps)
    return p.project(p.x + noise)


# ---------------------------------------------------------------- EBAD and CAA: weighted training losses

EBAD = "Cai et al., CVPR 2023 (EBAD); CSIPlab/EBAD attack_bb_det.py, utils_mmdet.py"
CAA = "Cai et al., AAAI 2022 (context-aware attacks); CSIPlab/context-aware-attacks run_sequential_attack.py"


def pick_victims(ctx, conf_thr, u):
    """Per image: the surrogate's clean detections (score >= conf_thr), a random one of them as the victim (its
    index, None when there is no detection) and a random class absent from the image as its target (any other
    class when every class is present); ``u`` (n, 2) uniforms pick the victim and the class."""
    c, out = ctx.problem.num_classes, []
    for d, (u1, u2) in zip(pseudo_truth(ctx, conf_thr), u.tolist()):
        labels = d["labels"]
        if not len(labels):
            out.append((d, None, -1))
            continue
        v, present = min(int(u1 * len(labels)), len(labels) - 1), labels.tolist()
        absent = [j for j in range(c) if j not in present] or [j for j in range(c) if j != present[v]]
        out.append((d, v, absent[min(int(u2 * len(absent)), len(absent) - 1)]))
    return out


def relabel_one(ctx, conf_thr):
    """Targets per image: the surrogate's clean detections with the victim relabelled to its target class
    (:func:`pick_victims`, from the samples' streams). Returns (targets, victim boxes (n, 4), target labels (n,),
    the victims' own labels (n,)); images without a detection keep empty targets (labels -1)."""
    p = ctx.problem
    out, vboxes, vlabels, own = [], [], [], []
    for d, v, new in pick_victims(ctx, conf_thr, ctx.rng.uniform((2,))):
        if v is None:
            out.append(d)
            vboxes.append(p.x.new_zeros(4))
            own.append(-1)
        else:
            labels = d["labels"].clone()
            labels[v] = new
            out.append({"boxes": d["boxes"], "labels": labels})
            vboxes.append(d["boxes"][v])
            own.append(int(d["labels"][v]))
        vlabels.append(new)
    dev = p.x.device
    return out, torch.stack(vboxes), torch.tensor(vlabels, device=dev), torch.tensor(own, device=dev)


def _weighted_loss(models, weights, x, targets):
    return sum(w * sum(m.losses(x, targets).values()) for m, w in zip(models, weights))


def descend(ctx, models, weights, targets, x0, iterations, alpha):
    """Sign-gradient descent of the weighted training losses towards ``targets`` from ``x0`` in the Linf ball, as
    EBAD's and CAA's authors loop (``attack_bb_det.py`` PM_tensor_weight_balancing; ``run_sequential_attack.py``
    with ``utils_mmdet.get_train_data``): the perturbation is the state, clamped to the eps ball alone, and the
    loss reads the image clipped to [0, 1], so a pixel pushed past 0 or 1 gets no gradient (the clamp's) and stays
    there. Returns the image, clipped, and the loss at the last step's input (EBAD's ``LOSS['ens'][-1]``)."""
    p, x_adv = ctx.problem, x0
    e = per_sample(p.eps, p.x)
    for _ in range(iterations):
        xg = x_adv.clamp(0, 1).detach().requires_grad_(True)
        with torch.enable_grad():
            loss = _weighted_loss(models, weights, xg, targets)
            g = torch.autograd.grad(loss, xg)[0]
        g = g * ((x_adv > -1e-6) & (x_adv < 1 + 1e-6))  # the clamp's backward (beyond float noise: k / 255 is on it)
        x_adv = torch.minimum(torch.maximum(x_adv - alpha * g.sign(), p.x - e), p.x + e)
    return p.project(x_adv), float(loss.detach())


@dataclass
class Crafted:
    """A craft block's images with the goal its attack set each of them (EBAD, CAA: the victim relabelled): the
    attack succeeds on image i where a detector finds label ``labels[i]`` at IoU > ``iou`` with ``boxes[i]``
    (label -1: no goal, an image without a detection). The family scores the goal on every target detector."""

    x: torch.Tensor
    boxes: torch.Tensor
    labels: torch.Tensor
    iou: float

    @staticmethod
    def cat(parts):
        return Crafted(torch.cat([c.x for c in parts]), torch.cat([c.boxes for c in parts]),
                       torch.cat([c.labels for c in parts]), parts[0].iou)


def goal_met(dets, boxes, labels, iou_thr):
    """Per image: whether detections ``dets[i]`` hold label ``labels[i]`` at IoU > iou_thr with ``boxes[i]``
    (None where the label is -1: no goal)."""
    from torchvision.ops import box_iou

    out = []
    for d, b, lab in zip(dets, boxes, labels.tolist()):
        m = d["labels"] == lab
        out.append(None if lab < 0 else
                   bool(m.any()) and bool((box_iou(b[None].to(d["boxes"]), d["boxes"][m]) > iou_thr).any()))
    return out


def victim_loss(det, box, own, ens_loss):
    """EBAD's black-box loss of one image from the victim's detections ``det`` alone (``get_bb_loss`` of
    attack_bb_det.py): while the victim's own label ``own`` is still detected at IoU > 0.3 with its ``box``, 1e3
    plus the score of that detection (the one of highest IoU); once it is gone, the ensemble's white-box loss
    ``ens_loss``. As its docstring says ("the conf score of the victim object"); its code compares with the target
    label instead (its ``target_clean`` row is the relabelled one), which would rank a candidate showing the
    target label near the box below one showing nothing there."""
    from torchvision.ops import box_iou

    m = det["labels"] == own
    if own < 0 or not bool(m.any()):
        return ens_loss
    iou = box_iou(box[None].to(det["boxes"]), det["boxes"][m])[0]
    return 1e3 + float(det["scores"][m][iou.argmax()]) if bool((iou > 0.3).any()) else ens_loss


def hit(model, x, boxes, labels, iou_thr):
    """(n,) whether ``model`` detects label ``labels[i]`` at IoU > iou_thr with ``boxes[i]`` (label -1: no)."""
    with torch.no_grad():
        dets = model(x)
    return torch.tensor([bool(h) for h in goal_met(dets, boxes, labels, iou_thr)], device=x.device)


@DET_CRAFT.register("ebad", paper=EBAD + " (eps 10/255, 20 PGD steps of 3 eps / 20, 10 queries, lr_w 0.01, "
                    "success at IoU > 0.9)", per_image=True,
                    ranges={"iterations": "int [1, inf)", "queries": "int [0, inf)", "lr_w": "[0, inf)",
                            "conf_thr": "[0, 1]", "iou_thr": "[0, 1]"})
def ebad(ctx, objective, *, iterations=20, queries=10, lr_w=0.01, conf_thr=0.3, iou_thr=0.9):
    """Ensemble-based black-box attack (mislabel): one random detected object relabelled to a class absent from
    the image, the others kept; PGD descent (step 3 eps / 20) of the weighted training losses of the surrogates,
    weights initialised to w_i = (1 / L_i) / sum_j (1 / L_j). Then victim queries as the authors'
    ``attack_bb_det.py`` counts them: the first PGD's image is query 1, and while fewer than ``queries`` were
    made, a round: one surrogate in turn gets two candidates, w_i + lr_w / L_i then w_i - lr_w / L_i (the raw
    inverse loss, the others unchanged), each a PGD run started from the current image and one query (10 queries:
    5 rounds, at most 11 queries as theirs). Every PGD run's image is put on the uint8 grid before its query (as
    theirs), so a query sees the image that is returned. An image stops at its first candidate that succeeds (its target
    label at IoU > iou_thr on the victim, the first surrogate as in the benchmark); otherwise the candidate with
    the lower black-box loss (:func:`victim_loss`: from the victim's detections, never its training loss)
    becomes the current image and weights, the weights then clipped at 0, raised by 0.005 and normalised. Runs
    one image at a time (``per_image``): each image has its own weights."""
    p, models = ctx.problem, list(ctx.surrogates) or [ctx.model]
    victim = models[0]
    targets, vboxes, vlabels, own = relabel_one(ctx, conf_thr)
    alpha = 3 * p.eps / 20
    with torch.no_grad():
        inv = torch.tensor([1 / max(float(sum(m.losses(p.x, targets).values())), 1e-6) for m in models])
    w = inv / inv.sum()

    def pgd(weights, start):  # a PGD run's image on the uint8 grid, as queried and returned (theirs: astype(uint8));
        # within the run the image is clipped to [0, 1] inside the loss alone, as theirs (PM_tensor_weight_balancing)
        x, ens = descend(ctx, models, weights.tolist(), targets, start, iterations, alpha)
        return p.quantize(x), ens

    x_adv, _ = pgd(w, p.x)
    # an image without a detection has no goal (label -1): nothing to query for (the authors skip such images)
    done = bool((vlabels < 0).all()) or bool(hit(victim, x_adv, vboxes, vlabels, iou_thr).all())
    spent, turn = 1, 0
    while not done and spent < queries and len(models) > 1:
        i, cands = turn % len(models), []
        for sgn in (1, -1):
            wc = w.clone()
            wc[i] = wc[i] + sgn * lr_w * inv[i]
            xc, ens = pgd(wc, x_adv)
            spent += 1
            with torch.no_grad():
                det = victim(xc)[0]  # the query: detections only
            if bool(goal_met([det], vboxes, vlabels, iou_thr)[0]):
                w, x_adv, done = wc, xc, True
                break
            cands.append((victim_loss(det, vboxes[0], int(own[0]), ens), wc, xc))
        if not done:
            _, w, x_adv = min(cands, key=lambda c: c[0])
            w = torch.relu(w) + 0.005
            w = w / w.sum()
        turn += 1
    return Crafted(x_adv, vboxes, vlabels, iou_thr)


@DET_CRAFT.register("caa", paper=CAA + " (eps 30/255, step 2/255, 50 iterations per plan, plans ap0-ap5, loss 4 "
                    "L_FRCNN + L_YOLOv3, success at IoU > 0.3)", per_image=True,
                    asset_params={"context": "detection_context"},
                    ranges={"iterations": "int [1, inf)", "alpha": "(0, 1]", "weights": "list [0, inf)",
                            "conf_thr": "[0, 1]", "iou_thr": "[0, 1]", "steps": "int [0, inf)",
                            "select": ("last", "first_hit"), "helpers": ("context", "random"),
                            "vanish": (False, True)})
def caa(ctx, objective, *, iterations=50, alpha=2 / 255, weights=None, conf_thr=0.3, iou_thr=0.3, steps=5,
        context=None, select="last", helpers="context", vanish=False):
    """Context-aware attack, the authors' sequential plans ap0..ap``steps`` (:func:`~blackboxbench.detection.
    context.sequential_plans`): ap0 relabels a random victim to a class absent from the image; each later plan
    also relabels the next other object, then adds a helper object, with helper labels from the co-occurrence
    row of the target class and helper boxes placed by the distance and size tables of ``ctx.assets[context]``
    (a ``detection_context`` asset, named by the recipe; none is needed with ``steps: 0``). Each plan starts from
    the clean image and descends the weighted training losses of the surrogates (``weights``, default 4, 1, 1,
    ...: 4 L_FRCNN + L_YOLOv3) for ``iterations`` sign steps of ``alpha``, the perturbation clamped to the eps
    ball and the image clipped to [0, 1] inside the loss, as theirs (:func:`descend`). ``select``:
    ``last`` returns every image's last plan, and only that plan runs (the authors' script runs every plan to
    score each one; the earlier plans do not change the last one's image); ``first_hit`` the first plan after
    which the first surrogate (the authors' indicator model) detects the target label on the victim at IoU >
    iou_thr (else the last), stopping there. ``helpers: random`` draws helper labels uniformly (the authors'
    ``-random`` control). ``vanish: true``: plan ap``k`` keeps only its first k + 1 objects, so the attack also
    hides the detections it has not relabelled yet (the authors' ``-vanish``)."""
    tables = ctx.assets.get(context) if steps and context is not None else None
    if steps and not isinstance(tables, ContextTables):
        raise BenchError(f"caa: plans after ap0 need CAA's context tables, a detection_context asset named by "
                         f"blocks.craft.context (now {context!r}; assets: {{context: {{name: detection_context}}}}), "
                         "or blocks.craft.steps: 0 for plan ap0 alone")
    p, models = ctx.problem, list(ctx.surrogates) or [ctx.model]
    w = list(weights) if weights is not None else [4.0] + [1.0] * (len(models) - 1)
    u = ctx.rng.uniform((2 + U_STEP * steps,))  # victim, target class, then one row per plan step
    h, wd = p.x.shape[-2:]
    plans, vboxes, vlabels = [], [], []
    for (d, v, target), ui in zip(pick_victims(ctx, conf_thr, u[:, :2]), u[:, 2:]):
        if v is None:
            plans.append([d] * (steps + 1))
            vboxes.append(p.x.new_zeros(4))
        else:
            seq = sequential_plans(d["boxes"], d["labels"], v, target, tables, h, wd, steps, ui.view(steps, U_STEP),
                                   random_helpers=helpers == "random", vanish=vanish)
            plans.append([{"boxes": b, "labels": lab} for b, lab in seq])
            vboxes.append(d["boxes"][v])
        vlabels.append(target)
    vboxes, vlabels = torch.stack(vboxes), torch.tensor(vlabels, device=p.x.device)
    x_best, done = p.x.clone(), torch.zeros(p.n, dtype=torch.bool, device=p.x.device)
    # select last: only the last plan is kept, and each plan's descent starts from the clean image and draws no
    # random number of the sample's, so the earlier plans are not run (same images, 1 / (steps + 1) of the work)
    for k in range(steps + 1) if select == "first_hit" else [steps]:
        xc, _ = descend(ctx, models, w[:len(models)], [pl[k] for pl in plans], p.x, iterations, alpha)
        x_best = torch.where(per_sample(done, p.x).bool(), x_best, xc)
        if select == "first_hit" and k < steps:
            done = done | hit(models[0], x_best, vboxes, vlabels, iou_thr)
            if bool(done.all()):
                break
    return Crafted(x_best, vboxes, vlabels, iou_thr)


# ---------------------------------------------------------------- PhantomSponges (universal)

PS = "Shapira et al., WACV 2023 (PhantomSponges); AvishagS422/PhantomSponges attack/uap_phantom_sponge.py"


def sponge_loss(model, x, conf, area=0.0, target_class=None):
    """PhantomSponges' loss, to minimize: the max-objects term, relu(conf - s) summed over the candidates whose
    best class score is below ``conf`` and divided by the number of candidates of the batch (s: the score of
    ``target_class``, a dataset class index, or the best class score when None; more candidates pass to NMS),
    plus ``area`` times the bounding-box term, the mean area of the candidates at or above ``conf`` in units of the
    image's area, averaged over the images that have such candidates (smaller boxes overlap less, so NMS
    suppresses fewer of them). The IoU term (lambda1 < 1) is not built."""
    probs, boxes = model.candidates(x, boxes=True)
    p = probs.amax(-1)
    if target_class is not None and not 0 <= target_class < probs.shape[-1]:
        raise BenchError(f"phantom_sponges: target_class {target_class} is not a class of the detector's "
                         f"{probs.shape[-1]}")
    s = p if target_class is None else probs[..., target_class]
    below = p < conf
    loss = (torch.relu(conf - s) * below).sum() / p.numel()
    if area:
        wh = (boxes[..., 2:] - boxes[..., :2]).clamp_min(0)
        above = (~below).to(wh.dtype)
        count = above.sum(1)
        has = count > 0
        if bool(has.any()):
            loss = loss + area * ((wh[..., 0] * wh[..., 1] * above).sum(1)[has] / count[has]).mean()
    return loss


def sponge_val_loss(model, val, uap, batch, conf, area, target_class):
    """The authors' validation loss (``evaluate_loss``): the mean over the validation batches of ``batch`` images
    of :func:`sponge_loss` with ``uap`` added (each batch's loss counts once, whatever its size)."""
    with torch.no_grad():
        losses = [float(sponge_loss(model, (val[i:i + batch] + uap).clamp(0, 1), conf, area, target_class))
                  for i in range(0, len(val), batch)]
    return sum(losses) / len(losses)


@DET_CRAFT.register("phantom_sponges", paper=PS + " (universal; lambda1 1 (IoU term off), lambda2 10, step 0.0005, "
                    "batch 8, 70 epochs, patience 7 on a 10 % validation split, delta 1e-4, L2 70 at 640x640)",
                    asset_params={"asset": "detection_images"}, heads=ONE_STAGE,
                    ranges={"epochs": "int [1, inf)", "patience": "int [1, inf)", "lr": "(0, 1]",
                            "batch": "int [1, inf)", "conf": "(0, 1)", "area": "[0, inf)",
                            "target_class": "int [0, inf)", "val_split": "(0, 1)", "delta": "[0, inf)",
                            "seed": "int [0, inf)"})
def phantom_sponges(ctx, objective, *, epochs=70, patience=7, lr=0.0005, batch=8, conf=0.25, area=10.0,
                    target_class=None, val_split=0.1, delta=1e-4, seed=0, asset="train"):
    """A universal perturbation learnt once per run on the attacker's images (``ctx.assets[asset]``, a
    ``detection_images`` asset) with the surrogate, as the authors' ``pgd_L2``: the first 1 - ``val_split`` of the
    images train it, the rest validate it. Each epoch visits the training images in a new random order (``seed``)
    in batches of ``batch``: uap <- clamp(uap - lr * sign(grad of :func:`sponge_loss`), 0, 1) (non-negative), then
    projected to the threat's L2 ball. After each epoch the validation loss (:func:`sponge_val_loss`) of the
    current perturbation is compared with the best so far, the zero perturbation's to begin with: as the authors'
    early stopping, a loss below best + ``delta`` is the new best (the authors' sign: a loss up to ``delta`` worse
    counts too), otherwise a stale epoch; ``patience`` stale epochs in a row stop the training, and the best
    perturbation is the one returned, not the last. Every test image gets the same perturbation (x + uap, clipped
    to [0, 1]). ``area``: the weight lambda2 of the bounding-box term; ``target_class``: the class whose score
    the max-objects term raises (the authors': COCO's car; None: each candidate's best class)."""
    p, model = ctx.problem, ctx.model
    train = ctx.assets.get(asset)
    if train is None or not hasattr(train, "cache"):
        raise BenchError(f"phantom_sponges needs a detection_images asset named '{asset}' (assets: {{{asset}: "
                         "{name: detection_images}}})")
    key = ("phantom_sponges", id(model), p.eps, p.norm, epochs, patience, lr, batch, conf, area, target_class,
           val_split, delta, seed)
    if key not in train.cache:
        xs = train.data.x.to(p.x.device)
        cut = int(len(xs) * (1 - val_split))  # the authors': int(1500 * (1 - 0.1)) training images, 150 validation
        if not 0 < cut < len(xs):
            raise BenchError(f"phantom_sponges: val_split {val_split} of the asset's {len(xs)} images leaves "
                             f"{cut} to train on and {len(xs) - cut} to validate; both need one")
        xs, val = xs[:cut], xs[cut:]
        gen = torch.Generator().manual_seed(seed)
        uap = torch.zeros_like(xs[:1])
        best_uap, best, stale = uap, sponge_val_loss(model, val, uap, batch, conf, area, target_class), 0
        for _ in range(epochs):
            order = torch.randperm(len(xs), generator=gen).to(xs.device)
            for i in range(0, len(xs), batch):
                ug = uap.detach().requires_grad_(True)
                with torch.enable_grad():
                    loss = sponge_loss(model, (xs[order[i:i + batch]] + ug).clamp(0, 1), conf, area, target_class)
                    g = torch.autograd.grad(loss, ug)[0]
                uap = (uap - lr * g.sign()).clamp(0, 1)
                uap = uap * torch.clamp(p.eps / (flat_norm(uap, p.norm) + 1e-12), max=1.0).view(-1, 1, 1, 1)
            v = sponge_val_loss(model, val, uap, batch, conf, area, target_class)
            if v < best + delta:
                best_uap, best, stale = uap, v, 0
            else:
                stale += 1
                if stale >= patience:
                    break
        train.cache[key] = best_uap.detach()
    return p.project((p.x + train.cache[key]).clamp(0, 1))
