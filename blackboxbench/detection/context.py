"""CAA's context (Cai et al., AAAI 2022): the co-occurrence, distance and size tables of a detection dataset's
ground truth, and the sequential attack plans built from them. Definitions from the authors' code
(CSIPlab/context-aware-attacks: ``context/voc_cooccurrence_graph.ipynb`` for the tables,
``attacks/utils_attack.py`` ``get_sequential_attack_plan`` and ``generate_box`` for the plans); the tables are
computed here from a dataset the config names (the authors': VOC2007 trainval), never shipped.

Pure functions of their inputs: every random choice is read from the uniforms the caller passes, so a plan is
replayed from the sample's stream and does not depend on its batch.
"""
import math
from dataclasses import dataclass

import torch

from ..registry import ASSET, DATASET, block_params
from .data import detection_dataset, with_default

HELPER_P = 0.05   # a helper class needs co-occurrence probability above 5 % with the target (the authors')
U_LABEL = 1       # uniforms per plan step: the helper label,
U_BOX = 7         # and the helper box (4: direction order, 1: angle, 2: fallback position)
U_STEP = U_LABEL + U_BOX


@dataclass
class ContextTables:
    """Per ordered class pair (i, j): ``count`` the object pairs of classes i and j in one image (a same-class
    pair counted once, on the diagonal), ``dist`` their mean centre distance and ``size`` the mean (h, w) of the
    class-j object, both in units of the image diagonal (0 where never seen together); ``single`` the mean
    (h, w) of every class-j object (``single_n`` how many)."""

    count: torch.Tensor      # (K, K) float64
    dist: torch.Tensor       # (K, K)
    size: torch.Tensor       # (K, K, 2)
    single: torch.Tensor     # (K, 2)
    single_n: torch.Tensor   # (K,)

    @property
    def num_classes(self):
        return len(self.count)


def context_tables(targets, image_sizes, num_classes):
    """:class:`ContextTables` of ``targets`` (per image {"boxes" (n, 4) xyxy pixels, "labels" (n,)}), with
    ``image_sizes`` per image (H, W); every box counts, difficult ones too (as the authors' notebook)."""
    k = num_classes
    count = torch.zeros(k, k, dtype=torch.float64)
    dist_sum, size_sum = torch.zeros(k, k, dtype=torch.float64), torch.zeros(k, k, 2, dtype=torch.float64)
    single, single_n = torch.zeros(k, 2, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    for t, (h, w) in zip(targets, image_sizes):
        boxes, labels = t["boxes"].to(torch.float64).cpu(), t["labels"].long().cpu()
        if not len(labels):
            continue
        diag = math.hypot(w, h)
        hw = torch.stack([boxes[:, 3] - boxes[:, 1], boxes[:, 2] - boxes[:, 0]], 1) / diag
        centre = (boxes[:, :2] + boxes[:, 2:]) / 2
        single.index_add_(0, labels, hw)
        single_n.index_add_(0, labels, torch.ones(len(labels), dtype=torch.float64))
        a, b = torch.triu_indices(len(labels), len(labels), 1)  # every unordered pair of objects once
        d = (centre[a] - centre[b]).norm(dim=1) / diag
        la, lb = labels[a], labels[b]
        # ordered (la, lb) always; (lb, la) too unless the pair is on the diagonal (the authors' counting)
        off = la != lb
        rows = torch.cat([la, lb[off]])
        cols = torch.cat([lb, la[off]])
        flat = rows * k + cols
        count.view(-1).index_add_(0, flat, torch.ones(len(flat), dtype=torch.float64))
        dist_sum.view(-1).index_add_(0, flat, torch.cat([d, d[off]]))
        size_sum.view(-1, 2).index_add_(0, flat, torch.cat([hw[b], hw[a][off]]))
    seen = count.clamp_min(1)
    return ContextTables(count, dist_sum / seen, size_sum / seen[..., None], single / single_n.clamp_min(1)[:, None],
                         single_n)


def helper_distribution(tables, target):
    """(K,) the probabilities of CAA's helper labels for ``target``: its co-occurrence row normalised, classes at
    or below 5 % dropped, renormalised. A class never seen with another (an empty row, where the authors' code
    divides by zero) gives every class alike."""
    row = tables.count[target]
    if float(row.sum()) == 0:
        return torch.full_like(row, 1.0 / len(row))
    p = row / row.sum()
    p = torch.where(p > HELPER_P, p, torch.zeros_like(p))
    return p / p.sum()


def pick(probs, u):
    """The class an inverse-CDF draw ``u`` in [0, 1) selects from ``probs`` (never a zero-probability one)."""
    nz = torch.nonzero(probs > 0).flatten()
    cdf = torch.cumsum(probs[nz], 0)
    j = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return int(nz[min(j, len(nz) - 1)])


def helper_box(victim, target, helper, tables, height, width, u):
    """A helper object's box (xyxy pixel list) as the authors' ``generate_box``: of the mean size of ``helper``
    objects seen with ``target`` (else of every ``helper`` object; else the victim's), centred at their mean
    distance from the victim's centre (halved, then quartered, when no direction fits in the image: the room in
    each direction truncated to whole pixels, as theirs) at a random angle between two adjacent free directions
    (right, up, left, down); where none fits, at a random position.
    ``u``: 7 uniforms (direction order 4, angle 1, position 2). Sides are at least 2 px (a degenerate box would
    have no area to match)."""
    diag = math.hypot(width, height)
    vx0, vy0, vx1, vy1 = [int(v) for v in victim]
    xc, yc = int((vx0 + vx1) / 2), int((vy0 + vy1) / 2)
    seen = float(tables.count[target, helper]) > 0
    if seen:
        size = tables.size[target, helper]
    elif float(tables.single_n[helper]) > 0:
        size = tables.single[helper]
    else:
        size = torch.tensor([(vy1 - vy0) / diag, (vx1 - vx0) / diag], dtype=torch.float64)
    h, w = max(int(size[0] * diag), 2), max(int(size[1] * diag), 2)
    if seen:
        order = torch.argsort(torch.as_tensor(u[:4])).tolist()
        # right, up, left, down: room from the victim's centre, truncated to whole pixels as theirs (int())
        free = [int(width - w / 2 - xc), int(yc - h / 2), int(xc - w / 2), int(height - h / 2 - yc)]
        base = int(float(tables.dist[target, helper]) * diag)
        for factor in (1, 1 / 2, 1 / 4):
            dist = factor * base
            for d1 in order:
                if not free[d1] > dist:
                    continue
                for step in (1, -1):
                    if free[(d1 + step) % 4] > dist:
                        angle = math.radians(90 * d1 + step * min(int(u[4] * 90), 89))
                        cx, cy = int(xc + dist * math.cos(angle)), int(yc - dist * math.sin(angle))
                        return _clip([cx - w // 2, cy - h // 2, cx + w // 2, cy + h // 2], height, width)
    x0 = min(int(u[5] * (max(0, width - w) + 1)), max(0, width - w))
    y0 = min(int(u[6] * (max(0, height - h) + 1)), max(0, height - h))
    return _clip([x0, y0, x0 + w, y0 + h], height, width)


def _clip(box, height, width):
    x0, y0, x1, y1 = box
    return [float(min(max(x0, 0), width)), float(min(max(y0, 0), height)), float(min(max(x1, 0), width)),
            float(min(max(y1, 0), height))]


def sequential_plans(boxes, labels, victim, target, tables, height, width, steps, u, random_helpers=False,
                     vanish=False):
    """CAA's plans ap0..ap``steps`` for one image, each a (boxes, labels) pair extending the one before: ap0 is
    the detections with object ``victim`` relabelled to ``target``; each later plan relabels the next other
    detection (in detection order) to a helper label drawn from :func:`helper_distribution`, and once every
    detection is relabelled, adds a helper object (:func:`helper_box`). ``u``: (steps, 8) uniforms, one row per
    step (label 1, box 7). ``boxes`` (n, 4), ``labels`` (n,) long, n >= 1. ``random_helpers``: every class alike
    as a helper label (the authors' ``-random`` control, which shows what the context adds). ``vanish``: plan
    ap``k`` keeps only its first k + 1 objects (the authors' ``-vanish``: the detections not yet relabelled leave
    the target annotation, so the attack hides them; from the plan that has relabelled every detection on, nothing
    changes)."""
    order = [victim] + [i for i in range(len(labels)) if i != victim]
    bx, lab = boxes[order].clone(), labels[order].clone()
    lab[0] = target
    plans = [(bx.clone(), lab.clone())]
    probs = None if not steps else (torch.full((tables.num_classes,), 1.0 / tables.num_classes, dtype=torch.float64)
                                     if random_helpers else helper_distribution(tables, target))
    for k in range(steps):
        row = u[k].tolist()
        helper = pick(probs, row[0])
        if k + 1 < len(lab):
            lab[k + 1] = helper
        else:
            box = helper_box(boxes[victim].tolist(), target, helper, tables, height, width, row[U_LABEL:])
            bx = torch.cat([bx, torch.tensor([box], dtype=bx.dtype, device=bx.device)])
            lab = torch.cat([lab, torch.tensor([helper], dtype=lab.dtype, device=lab.device)])
        plans.append((bx.clone(), lab.clone()))
    return [(b[:k + 1], lab[:k + 1]) for k, (b, lab) in enumerate(plans)] if vanish else plans


@ASSET.register("detection_context", source="CAA's context tables from a detection dataset's boxes (default: "
                "the shapes train split, 256 images)")
def detection_context(data_root, device, *, spec=None):
    """:class:`ContextTables` of detection dataset ``spec`` ({name: ..., params}; default ``{name: shapes, split:
    train, n: 256}``); for VOC as the authors, ``{name: voc2007, image_set: trainval}``. Never the test images.
    A dataset that can skip its pixels (``boxes_only``: VOC, COCO json) reads only its boxes and image sizes."""
    spec = with_default(spec, {"name": "shapes", "split": "train", "n": 256})  # {n: 64} keeps shapes' train split
    if "boxes_only" in block_params(DATASET.get(spec.get("name"))):
        spec.setdefault("boxes_only", True)
    data = detection_dataset(data_root, spec, "detection_context")
    h, w = data.x.shape[-2:]
    return context_tables(data.targets, [(h, w)] * len(data.targets), data.num_classes)
