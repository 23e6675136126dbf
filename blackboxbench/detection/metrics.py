"""Detection metrics as pure functions: mAP@IoU (VOC2007 11-point or all-point "area"), AP_loc and CSR.

Definitions (od-robustness benchmark, Sec. 3.1.1; matching rules of spec sheet ``detection.md`` section 1, which
follow MMDetection's ``eval_map`` / ``tpfp_default``, i.e. the VOC devkit):

* **Matching**, per class and per image, detections in descending score order: each detection takes the
  ground-truth box of its class with the highest IoU (no fallback to the next one). At IoU >= ``iou_thr``: a
  *difficult* box makes the detection ignored (neither TP nor FP), an unused box makes it a TP (the box becomes
  used), a used box makes it a FP; below the threshold it is a FP. Matching within one image in score order gives
  the same flags as the devkit's global score order, so an image's flags are computed once and pooled.
* **AP** of a class from the pooled flags sorted by score: recall = cumTP / N_pos (non-difficult boxes),
  precision = cumTP / (cumTP + cumFP). ``"11points"`` (VOC2007, MMDetection's default for VOC2007): the mean over
  t in {0, 0.1, ..., 1} of the largest precision at recall >= t. ``"area"``: the area under the monotone
  precision envelope (VOC2010+, all-point). **mAP** is the mean over the classes that have a non-difficult box.
* **AP_loc**: every label fused into one class, then the same code (so two boxes of different classes on one
  object give one TP and one FP; no extra class-agnostic NMS).
* **CSR** = sum_c TP_c / N_GT with the same class-aware one-to-one matching and N_GT the non-difficult boxes
  (pooled recall at the detector's operating point; only detections with score >= ``score_thr`` count).
* ``legacy``: MMDetection's VOC "+1" pixel convention for areas and intersections (integer VOC coordinates).

Boxes are (K, 4) ``x1, y1, x2, y2``; detections ``{"boxes", "scores", "labels"}``; ground truth ``{"boxes",
"labels", "difficult"}`` (difficult optional). Arrays may be numpy arrays, tensors or lists.
"""
import numpy as np

MODES = ("11points", "area")
TP, FP, IGNORED = 1, 0, -1


def _np(v, shape_tail=(), dtype=np.float64):
    if hasattr(v, "detach"):
        v = v.detach().cpu().numpy()
    a = np.asarray(v, dtype=dtype)
    return a.reshape((-1, *shape_tail)) if a.size or shape_tail else a.reshape(0)


def box_iou(a, b, legacy=False):
    """IoU matrix (len(a), len(b)) of xyxy boxes; ``legacy`` adds 1 to widths and heights."""
    a, b = _np(a, (4,)), _np(b, (4,))
    e = 1.0 if legacy else 0.0
    area_a = (a[:, 2] - a[:, 0] + e) * (a[:, 3] - a[:, 1] + e)
    area_b = (b[:, 2] - b[:, 0] + e) * (b[:, 3] - b[:, 1] + e)
    w = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]) + e, 0, None)
    h = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]) + e, 0, None)
    inter = w * h
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def _det(d, score_thr):
    boxes, scores = _np(d["boxes"], (4,)), _np(d["scores"])
    labels = _np(d["labels"], dtype=np.int64)
    keep = scores >= score_thr
    return boxes[keep], scores[keep], labels[keep]


def _gt(g):
    boxes, labels = _np(g["boxes"], (4,)), _np(g["labels"], dtype=np.int64)
    diff = g.get("difficult")
    diff = np.zeros(len(labels), bool) if diff is None else _np(diff, dtype=bool)
    return boxes, labels, diff


def match_image(det, gt, *, iou_thr=0.5, fuse=False, legacy=False, score_thr=0.0):
    """The matching of one image: ``(scores, labels, flags, npos)`` with one flag per detection (1 TP, 0 FP,
    -1 ignored, in the detections' order) and ``npos`` {label: non-difficult boxes}. ``fuse``: one class."""
    boxes, scores, labels = _det(det, score_thr)
    g_boxes, g_labels, g_diff = _gt(gt)
    if fuse:
        labels, g_labels = np.zeros_like(labels), np.zeros_like(g_labels)
    flags = np.full(len(scores), FP, np.int64)
    iou = box_iou(boxes, g_boxes, legacy)
    for c in np.unique(labels):
        d_idx = np.flatnonzero(labels == c)
        g_idx = np.flatnonzero(g_labels == c)
        if not len(g_idx):
            continue
        d_idx = d_idx[np.argsort(-scores[d_idx], kind="stable")]
        sub = iou[np.ix_(d_idx, g_idx)]
        best, best_iou = sub.argmax(1), sub.max(1)
        used = np.zeros(len(g_idx), bool)
        for k, i in enumerate(d_idx):
            if best_iou[k] < iou_thr:
                continue
            j = best[k]
            if g_diff[g_idx[j]]:
                flags[i] = IGNORED
            elif not used[j]:
                flags[i], used[j] = TP, True
    npos = {int(c): int(n) for c, n in zip(*np.unique(g_labels[~g_diff], return_counts=True))}
    return scores, labels, flags, npos


def average_precision(scores, flags, npos, mode="11points"):
    """AP of one class from pooled detections (``scores``, ``flags`` as :func:`match_image` gives) and ``npos``
    non-difficult boxes; None when ``npos`` is 0."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if npos == 0:
        return None
    scores, flags = np.asarray(scores, np.float64), np.asarray(flags, np.int64)
    keep = flags != IGNORED
    order = np.argsort(-scores[keep], kind="stable")
    f = flags[keep][order]
    tp, fp = np.cumsum(f == TP), np.cumsum(f == FP)
    rec = tp / npos
    prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
    if mode == "11points":
        return float(np.mean([prec[rec >= t].max() if (rec >= t).any() else 0.0 for t in np.linspace(0, 1, 11)]))
    mrec = np.concatenate([[0.0], rec, [1.0]])
    mpre = np.concatenate([[0.0], prec, [0.0]])
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    i = np.flatnonzero(mrec[1:] != mrec[:-1])
    return float(np.sum((mrec[i + 1] - mrec[i]) * mpre[i + 1]))


def pool_matches(matches, mode="11points"):
    """mAP and per-class AP from per-image matches ``[(scores, labels, flags, npos), ...]``:
    ``{"map": float or None, "ap": {label: AP}, "tp": total TP, "npos": total boxes, "n_det": detections}``."""
    npos, per = {}, {}
    n_det = 0
    for scores, labels, flags, n in matches:
        for c, k in n.items():
            npos[int(c)] = npos.get(int(c), 0) + int(k)
        labels = np.asarray(labels, np.int64)
        n_det += len(labels)
        for c in np.unique(labels):
            m = labels == c
            s, f = per.setdefault(int(c), ([], []))
            s.append(np.asarray(scores, np.float64)[m])
            f.append(np.asarray(flags, np.int64)[m])
    ap = {}
    for c, n in npos.items():
        s, f = per.get(c, ([], []))
        ap[c] = average_precision(np.concatenate(s) if s else [], np.concatenate(f) if f else [], n, mode)
    ap = {c: v for c, v in ap.items() if v is not None}
    tp = int(sum(int((np.asarray(fl) == TP).sum()) for _, _, fl, _ in matches))
    total = sum(npos.values())
    return {"map": float(np.mean(list(ap.values()))) if ap else None, "ap": ap, "tp": tp, "npos": total,
            "n_det": n_det}


WEIGHTED_VALUES = 1 << 22  # (resamples x detections of a class) values held at once by weighted_pool


def weighted_pool(matches, weights, mode="11points"):
    """:func:`pool_matches` of many weighted copies of the same images at once (the bootstrap's resamples):
    ``weights`` (B, n) counts image i ``weights[b, i]`` times in set b. Returns ``(map, tp, npos)``, each (B,):
    mAP over the classes with a box in the set (NaN where none has), and the pooled TP and box counts (CSR =
    tp / npos). A set equals its images listed that many times in :func:`pool_matches` (a detection counted w
    times adds its w TPs or FPs in one step; the intermediate points a listing adds are dominated, so neither AP
    changes)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    weights = np.asarray(weights, np.float64)
    b = weights.shape[0]
    img = np.concatenate([np.full(len(m[0]), i) for i, m in enumerate(matches)] + [np.zeros(0, int)])
    scores = np.concatenate([np.asarray(m[0], np.float64) for m in matches] + [np.zeros(0)])
    labels = np.concatenate([np.asarray(m[1], np.int64) for m in matches] + [np.zeros(0, np.int64)])
    flags = np.concatenate([np.asarray(m[2], np.int64) for m in matches] + [np.zeros(0, np.int64)])
    classes = sorted({int(c) for m in matches for c in m[3]})
    npos = np.array([[m[3].get(c, 0) for c in classes] for m in matches], np.float64).reshape(len(matches), -1)
    npos_b = weights @ npos  # (B, classes)
    ap = np.full((b, len(classes)), np.nan)
    for j, c in enumerate(classes):
        keep = np.flatnonzero((labels == c) & (flags != IGNORED))
        keep = keep[np.argsort(-scores[keep], kind="stable")]
        tp_row, fp_row = (flags[keep] == TP).astype(np.float64), (flags[keep] == FP).astype(np.float64)
        per = max(1, WEIGHTED_VALUES // max(1, len(keep)))
        for lo in range(0, b, per):
            w = weights[lo:lo + per][:, img[keep]]
            ap[lo:lo + per, j] = _weighted_ap(np.cumsum(w * tp_row, 1), np.cumsum(w * fp_row, 1),
                                              npos_b[lo:lo + per, j], mode)
    with np.errstate(invalid="ignore"):
        defined = npos_b > 0
        mean = np.where(defined, ap, 0.0).sum(1) / defined.sum(1)
    tp = weights @ np.array([int((np.asarray(m[2]) == TP).sum()) for m in matches], np.float64).reshape(-1)
    return mean, tp, npos_b.sum(1)


def _weighted_ap(tp, fp, npos, mode):
    """AP of (B, D) cumulative weighted TP / FP counts in score order and (B,) boxes (NaN where npos is 0); a
    position whose detection is not in the set repeats the previous point and changes nothing."""
    with np.errstate(invalid="ignore", divide="ignore"):
        rec = tp / npos[:, None]
        prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        if mode == "11points":
            best = [np.where(rec >= t, prec, -np.inf).max(1, initial=-np.inf) for t in np.linspace(0, 1, 11)]
            ap = np.mean([np.where(np.isfinite(v), v, 0.0) for v in best], 0)
        else:
            envelope = np.maximum.accumulate(prec[:, ::-1], 1)[:, ::-1]
            ap = (np.diff(rec, axis=1, prepend=0.0) * envelope).sum(1)
    return np.where(npos > 0, ap, np.nan)


def eval_map(dets, gts, *, iou_thr=0.5, mode="11points", fuse=False, legacy=False, score_thr=0.0):
    """mAP@``iou_thr`` of detections ``dets`` against ground truth ``gts`` (lists, one entry per image)."""
    return pool_matches([match_image(d, g, iou_thr=iou_thr, fuse=fuse, legacy=legacy, score_thr=score_thr)
                         for d, g in zip(dets, gts)], mode)


def ap_loc(dets, gts, **kw):
    """AP_loc: :func:`eval_map` with every label fused into one class."""
    return eval_map(dets, gts, fuse=True, **kw)["map"]


def csr(dets, gts, *, iou_thr=0.5, legacy=False, score_thr=0.0):
    """CSR = sum_c TP_c / N_GT (class-aware one-to-one matching; N_GT the non-difficult boxes); None without
    ground truth."""
    r = eval_map(dets, gts, iou_thr=iou_thr, legacy=legacy, score_thr=score_thr)
    return r["tp"] / r["npos"] if r["npos"] else None


def detection_metrics(dets, gts, *, iou_thr=0.5, mode="11points", legacy=False, score_thr=0.0):
    """{"map", "ap_loc", "csr", "n_det"} of one set of detections."""
    kw = dict(iou_thr=iou_thr, legacy=legacy, score_thr=score_thr)
    cls = eval_map(dets, gts, mode=mode, **kw)
    loc = eval_map(dets, gts, mode=mode, fuse=True, **kw)
    return {"map": cls["map"], "ap_loc": loc["map"], "csr": cls["tp"] / cls["npos"] if cls["npos"] else None,
            "n_det": cls["n_det"]}
