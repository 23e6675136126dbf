"""Detection metrics: hand-built fixtures with values worked out by hand (VOC devkit rules of spec sheet
detection.md section 1), and all-point AP cross-checked against torchmetrics (pycocotools backend)."""
import numpy as np
import pytest
import torch

from blackboxbench.detection.metrics import (ap_loc, average_precision, box_iou, csr, detection_metrics,
                                             eval_map, match_image)

A, B, C = [0, 0, 10, 10], [20, 20, 30, 30], [40, 0, 50, 10]
NEAR_A = [0, 0, 10, 9]  # IoU 0.9 with A


def det(boxes, scores, labels):
    return {"boxes": boxes, "scores": scores, "labels": labels}


def gt(boxes, labels, difficult=None):
    return {"boxes": boxes, "labels": labels, "difficult": difficult}


def test_box_iou_and_legacy_plus_one():
    assert box_iou([A], [NEAR_A])[0, 0] == pytest.approx(0.9)
    assert box_iou([[0, 0, 9, 9]], [[0, 0, 9, 9]], legacy=True)[0, 0] == 1.0
    assert box_iou([[0, 0, 1, 1]], [[1, 1, 2, 2]], legacy=True)[0, 0] == pytest.approx(1 / 7)  # 1 shared pixel
    assert box_iou([[0, 0, 1, 1]], [[1, 1, 2, 2]])[0, 0] == 0.0


def test_one_class_ap_by_hand():
    # 2 boxes; detections TP (.9), FP (.8), TP (.7): recall .5 .5 1, precision 1 .5 2/3
    d = [det([A, C, B], [0.9, 0.8, 0.7], [0, 0, 0])]
    g = [gt([A, B], [0, 0])]
    assert eval_map(d, g)["map"] == pytest.approx((6 * 1 + 5 * 2 / 3) / 11)
    assert eval_map(d, g, mode="area")["map"] == pytest.approx(0.5 + 0.5 * 2 / 3)


def test_difficult_boxes_are_ignored_not_counted():
    # A is difficult: the detection on it is neither TP nor FP, and N_pos = 1
    d = [det([A, B], [0.9, 0.8], [0, 0])]
    g = [gt([A, B], [0, 0], [True, False])]
    _, _, flags, npos = match_image(d[0], g[0])
    assert flags.tolist() == [-1, 1] and npos == {0: 1}
    assert eval_map(d, g)["map"] == 1.0 and csr(d, g) == 1.0
    # an image whose only box is difficult adds no positive; a class with only difficult boxes is not averaged
    g2 = [gt([A, B], [0, 1], [True, False])]
    assert eval_map([det([B], [0.5], [1])], g2)["ap"] == {1: 1.0}


def test_duplicates_are_false_positives():
    d = [det([A, NEAR_A], [0.9, 0.95], [0, 0])]  # the higher-scored one takes A, the other is a duplicate
    _, _, flags, _ = match_image(d[0], gt([A], [0]))
    assert flags.tolist() == [0, 1]
    # precision: 1 then 1/2 at recall 1 -> AP 1 either way (the TP comes first)
    assert eval_map(d, [gt([A], [0])])["map"] == 1.0
    d2 = [det([A, NEAR_A], [0.95, 0.9], [0, 0]), det([B], [0.99], [0])]  # FP first in image 2: AP < 1
    g2 = [gt([A], [0]), gt([], [])]
    assert eval_map(d2, g2, mode="area")["map"] == pytest.approx(0.5)


def test_max_iou_box_without_fallback():
    # the second detection's best box (A, IoU .9) is already used: FP, although it overlaps D (IoU 0.6) too
    D = [0, 0, 10, 16]
    d = det([A, [0, 0, 10, 11]], [0.9, 0.8], [0, 0])
    _, _, flags, _ = match_image(d, gt([A, D], [0, 0]))
    assert box_iou([[0, 0, 10, 11]], [A, D]).round(3).tolist() == [[0.909, 0.688]]
    assert flags.tolist() == [1, 0]


def test_label_fusion_for_ap_loc():
    # a class-1 box on a class-0 object: mAP ignores it (class 1 has no box), AP_loc sees one TP and one FP
    g = [gt([A], [0])]
    fp_first = [det([A, NEAR_A], [0.9, 0.8], [1, 0])]
    assert eval_map(fp_first, g)["map"] == 1.0
    assert ap_loc(fp_first, g) == 1.0  # the fused TP comes first (the class-1 box at .9)
    fused_fp_first = [det([B, A], [0.9, 0.8], [1, 0])]  # a fused FP (elsewhere) before the TP
    assert ap_loc(fused_fp_first, g) == pytest.approx(0.5)
    assert ap_loc(fused_fp_first, g, mode="area") == pytest.approx(0.5)
    # mislabelling every object keeps AP_loc at 1 and drops mAP and CSR to 0
    g3 = [gt([A, B], [0, 1])]
    mis = [det([A, B], [0.9, 0.9], [1, 0])]
    m = detection_metrics(mis, g3)
    assert m["ap_loc"] == 1.0 and m["map"] == 0.0 and m["csr"] == 0.0


def test_csr_cases():
    g = [gt([A, B, C], [0, 1, 1], [False, False, True]), gt([A], [2])]
    # image 1: A right class, B wrong class, C (difficult) found; image 2: A found twice (one TP) -> 2 TP of 3
    d = [det([A, B, C], [0.9, 0.9, 0.9], [0, 0, 1]), det([A, NEAR_A], [0.5, 0.4], [2, 2])]
    assert csr(d, g) == pytest.approx(2 / 3)
    assert csr([det([], [], []), det([], [], [])], g) == 0.0
    assert csr(d, g, score_thr=0.6) == pytest.approx(1 / 3)  # the operating point is configurable
    assert csr([det([], [], [])], [gt([], [])]) is None


def test_empty_and_no_detections():
    g = [gt([A], [0])]
    assert eval_map([det([], [], [])], g)["map"] == 0.0
    assert eval_map([det([A], [1.0], [0])], [gt([], [])])["map"] is None
    assert average_precision([], [], 0) is None


def _random_scene(rng, n_img=30, n_cls=3):
    dets, gts = [], []
    for _ in range(n_img):
        k = rng.integers(1, 4)
        xy = rng.permutation(4)[:k]  # non-overlapping 16 px cells of a 64x64 image
        boxes = np.stack([[16 * (c % 4) + 1, 16 * c // 4 + 1, 16 * (c % 4) + 13, 16 * c // 4 + 13] for c in xy])
        boxes = boxes.astype(float)
        labels = rng.integers(0, n_cls, k)
        m = rng.integers(0, 6)
        jitter = rng.normal(0, 2.5, (m, 4))
        src = rng.integers(0, k, m)
        d_boxes = np.clip(boxes[src] + jitter, 0, 64) if m else np.zeros((0, 4))
        d_boxes = np.concatenate([np.sort(d_boxes[:, [0, 2]], 1), np.sort(d_boxes[:, [1, 3]], 1)], 1)[:, [0, 2, 1, 3]]
        d_labels = np.where(rng.random(m) < 0.7, labels[src], rng.integers(0, n_cls, m)) if m else np.zeros(0, int)
        dets.append(det(d_boxes, rng.random(m), d_labels))
        gts.append(gt(boxes, labels))
    return dets, gts


def _torchmetrics_map50(dets, gts, rec_thresholds=None):
    pytest.importorskip("pycocotools")
    from torchmetrics.detection import MeanAveragePrecision

    m = MeanAveragePrecision(iou_thresholds=[0.5], rec_thresholds=rec_thresholds, max_detection_thresholds=[1, 10, 100],
                             backend="pycocotools")
    t = lambda a, dt=torch.float32: torch.as_tensor(np.asarray(a), dtype=dt)  # noqa: E731
    m.update([{"boxes": t(d["boxes"]).view(-1, 4), "scores": t(d["scores"]), "labels": t(d["labels"], torch.long)}
              for d in dets], [{"boxes": t(g["boxes"]).view(-1, 4), "labels": t(g["labels"], torch.long)} for g in gts])
    return float(m.compute()["map_50"])


@pytest.mark.parametrize("seed", [0, 1])
def test_all_point_ap_matches_torchmetrics(seed):
    """All-point AP against COCO-style AP50: pycocotools interpolates at 101 recall points, a difference of at
    most ~1/101 per class (stated tolerance 0.01); on a 1001-point grid the two agree within 0.002."""
    dets, gts = _random_scene(np.random.default_rng(seed))
    ours = eval_map(dets, gts, mode="area")["map"]
    assert abs(ours - _torchmetrics_map50(dets, gts)) <= 0.01
    assert abs(ours - _torchmetrics_map50(dets, gts, list(np.linspace(0, 1, 1001)))) <= 0.002
    assert eval_map(dets, gts)["map"] != ours  # 11-point differs from all-point on this scene


def test_robustness_table_keeps_a_transfer_run_in_one_column():
    """The adversarial-training table: a run crafted on the base detector and evaluated on the fine-tuned ones
    (the od benchmark's protocol) is one column, the base detector's own row included; a white-box run is
    labelled by its attack."""
    from blackboxbench.detection.report import robustness_table

    def row(run, attack, surrogate, target, clean, adv):
        return {"run": run, "label": attack, "surrogate": surrogate, "target": target, "clean_map": clean,
                "adv_map": adv}

    rows = [row("t", "tog", "base", "base", 0.9, 0.1), row("t", "tog", "base", "ft", 0.8, 0.7),
            row("w", "tog", "ft", "ft", 0.8, 0.2)]
    rl, cl, m = robustness_table(rows)
    assert rl == ["base", "ft"] and cl == ["clean", "tog (base)", "tog"]
    assert m[0][:2] == [0.9, 0.1] and np.isnan(m[0][2]) and m[1] == [0.8, 0.7, 0.2]


def test_run_labels_tell_every_run_apart():
    """A run's heatmap label: its config name, else its attack; two runs of one surrogate sharing a label get their
    eps, else their config hash; the same label on another surrogate is another heatmap row already."""
    from blackboxbench.detection.report import rows_of, transfer_matrix

    def s(run, attack, eps, name=None, surrogate="base", h="h"):
        return {"run": run, "attack": attack, "name": name, "eps": eps, "surrogates": surrogate, "config_hash": h,
                "family": "detection", "per_target": {"base": {"drop_map": eps}, "ft": {"drop_map": 2 * eps}}}

    runs = [s("a", "tog", 8 / 255), s("b", "tog", 4 / 255), s("c", "tog", 4 / 255, name="mine"),
            s("d", "dag", 2 / 255, h="h1"), s("e", "dag", 2 / 255, h="h2"), s("f", "tog", 8 / 255, surrogate="ft")]
    rows = rows_of(runs)
    assert {r["run"]: r["label"] for r in rows} == {"a": "tog eps 8/255", "b": "tog eps 4/255", "c": "mine",
                                                    "d": "dag h1", "e": "dag h2", "f": "tog"}
    rl, cl, m = transfer_matrix(rows)
    assert len(rl) == 6 and cl == ["base", "ft"] and not np.isnan(np.array(m)).any()  # no run hidden


@pytest.mark.parametrize("mode", ["11points", "area"])
def test_weighted_pool_equals_the_images_listed_that_many_times(mode):
    """The bootstrap's weighted pooling against pool_matches of the resampled images listed one by one (an
    independent path): mAP, TP and box counts of 40 random resamples of a random scene, including resamples
    without one class's boxes."""
    from blackboxbench.detection.metrics import pool_matches, weighted_pool

    rng = np.random.default_rng(4)
    dets, gts = _random_scene(rng, n_img=12)
    matches = [match_image(d, g) for d, g in zip(dets, gts)]
    weights = rng.multinomial(12, np.full(12, 1 / 12), size=40)
    weights[0] = 0
    weights[0, 0] = 12  # one image only: some classes have no box
    got_map, got_tp, got_npos = weighted_pool(matches, weights, mode)
    for b, w in enumerate(weights):
        ref = pool_matches([m for m, k in zip(matches, w) for _ in range(k)], mode)
        assert (got_tp[b], got_npos[b]) == (ref["tp"], ref["npos"])
        assert got_map[b] == pytest.approx(ref["map"], abs=1e-12)


def test_detection_summary_has_drop_intervals():
    """A run's summary (records as the detection family writes them): each target's drops and their mean over
    targets come with a bootstrap interval that holds the full-sample value, and the same records give the same
    intervals."""
    from blackboxbench.detection.family import match_record, summarize_detection

    rng = np.random.default_rng(5)
    dets, gts = _random_scene(rng, n_img=40)
    weak = [det(d["boxes"][::2], d["scores"][::2], d["labels"][::2]) for d in dets]  # the attack removes half
    records = [{"attacked": True, "time": 0.1, "l2": 1.0, "linf": 0.03, "ssim": 0.9, "lpips": None,
                "targets": {t: {"clean": match_record(d, g, None, False), "adv": match_record(a, g, None, False),
                                "score_thr": None, "max_det": None} for t in ("t1", "t2")}}
               for d, a, g in zip(dets, weak, gts)]
    s = summarize_detection(records)
    for k in ("map", "ap_loc", "csr"):
        p = s["per_target"]["t1"]
        assert p[f"drop_{k}_low"] < p[f"drop_{k}"] < p[f"drop_{k}_high"]
        assert s[f"mean_drop_{k}_low"] < s[f"mean_drop_{k}"] < s[f"mean_drop_{k}_high"]
    assert (s["asr_low"], s["asr_high"]) == (s["mean_drop_map_low"], s["mean_drop_map_high"])
    assert summarize_detection(records)["mean_drop_csr_low"] == s["mean_drop_csr_low"]
    # each target repeats its own mAP drop and clean mAP under the run-level names, so analysis rows per target
    # (aev_heatmap: target x run) read that target's values, not the run's mean
    from blackboxbench.analysis.aev import aev_heatmap, summary_rows
    s["per_target"]["t2"] = {**s["per_target"]["t2"], "drop_map": 0.5, "asr": 0.5}
    for t, p in s["per_target"].items():
        assert (p["asr"], p["asr_low"], p["asr_high"]) == (p["drop_map"], p["drop_map_low"], p["drop_map_high"])
        assert p["clean_acc"] == p["clean_map"]
    _, body, _ = aev_heatmap(summary_rows([{**s, "attack": "a"}]), x="target_model", y="asr", hue="attack",
                             average=False)
    assert body == [["a", s["per_target"]["t1"]["drop_map"], 0.5]]


# ---- independent references: a VOC-devkit-style evaluation (one global score order per class, as voc_eval.py /
# MMDetection's tpfp_default + average_precision) and pycocotools with difficult boxes as crowd regions

def _iou1(a, b):
    iw, ih = max(0.0, min(a[2], b[2]) - max(a[0], b[0])), max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - iw * ih
    return iw * ih / union if union > 0 else 0.0


def _devkit(dets, gts, mode, fuse=False, thr=0.5):
    """``(mAP, TP)``: per class, every detection of every image in one descending score order; each takes its
    image's max-IoU box of the class (>= thr: difficult -> skipped, unused -> TP, used -> FP); 11-point: the
    thresholds of ``np.arange(0, 1 + 1e-3, 0.1)`` (MMDetection; voc_eval.py's ``np.arange(0., 1.1, 0.1)`` is the same
    floats); all-point: sum over recall steps of the best precision at that recall or beyond."""
    cls = (lambda v: 0) if fuse else int
    aps, tp_all = [], 0
    for c in sorted({cls(v) for g in gts for v in g["labels"]}):
        boxes = [[list(b) for b, v in zip(g["boxes"], g["labels"]) if cls(v) == c] for g in gts]
        diff = [[bool(d) for d, v in zip(g["difficult"], g["labels"]) if cls(v) == c] for g in gts]
        used = [[False] * len(b) for b in boxes]
        order = sorted(((float(s), i, list(b)) for i, d in enumerate(dets)
                        for b, s, v in zip(d["boxes"], d["scores"], d["labels"]) if cls(v) == c), key=lambda t: -t[0])
        flags = []
        for _, i, b in order:
            ov = [_iou1(b, g) for g in boxes[i]]
            j = int(np.argmax(ov)) if ov else -1
            if j < 0 or ov[j] < thr:
                flags.append(0)
            elif not diff[i][j]:
                flags.append(0 if used[i][j] else 1)
                used[i][j] = True
        npos = sum(not d for ds in diff for d in ds)
        tp_all += sum(flags)
        if not npos:
            continue
        tp = np.cumsum(flags)
        rec, prec = tp / npos, tp / np.arange(1, len(flags) + 1)
        if mode == "11points":
            aps.append(sum(prec[rec >= t].max() if (rec >= t).any() else 0.0 for t in np.arange(0, 1 + 1e-3, 0.1)) / 11)
        else:
            steps = [k for k in range(len(rec)) if rec[k] > (rec[k - 1] if k else 0.0)]
            aps.append(sum((rec[k] - (rec[k - 1] if k else 0.0)) * prec[k:].max() for k in steps))
    return (float(np.mean(aps)) if aps else None), tp_all


def _fuzz_scene(rng, n_img, n_cls, overlap):
    """Images with 0-4 boxes (difficult ones among them; overlapping or on a grid), 0-7 detections each: jittered
    boxes of the image, duplicates, false alarms anywhere, wrong labels and a label with no box anywhere."""
    dets, gts = [], []
    for _ in range(n_img):
        k = int(rng.integers(0, 5))
        if overlap:
            xy = rng.uniform(0, 40, (k, 2))
            boxes = np.concatenate([xy, xy + rng.uniform(5, 25, (k, 2))], 1)
        else:
            boxes = np.array([[25 * (c % 4) + 2, 25 * (c // 4) + 2, 25 * (c % 4) + 18, 25 * (c // 4) + 18]
                              for c in rng.permutation(16)[:k]], float).reshape(-1, 4)
        labels, diff = rng.integers(0, n_cls, k), rng.random(k) < 0.25
        db, dl = [], []
        for _ in range(int(rng.integers(0, 8))):
            if k and rng.random() < 0.8:
                j = int(rng.integers(0, k))
                b = boxes[j] + rng.normal(0, 1.5, 4)
                v = labels[j] if rng.random() < 0.8 else int(rng.integers(0, n_cls + 1))
            else:
                b, v = rng.uniform(0, 90, 4), int(rng.integers(0, n_cls + 1))
            b = np.array([min(b[0], b[2]), min(b[1], b[3]), max(b[0], b[2]) + 0.5, max(b[1], b[3]) + 0.5])
            db.append(b)
            dl.append(v)
        dets.append(det(np.array(db).reshape(-1, 4), rng.random(len(db)), np.array(dl, int)))
        gts.append(gt(boxes, labels, diff))
    return dets, gts


def test_map_ap_loc_and_csr_match_a_devkit_reference_on_random_scenes():
    """300 random scenes (difficult boxes, duplicates, empty images, classes without boxes, overlapping boxes):
    11-point and all-point mAP, AP_loc and the TP count of CSR equal the devkit-style reference to 1e-12."""
    rng = np.random.default_rng(11)
    for s in range(300):
        dets, gts = _fuzz_scene(rng, int(rng.integers(1, 12)), int(rng.integers(1, 4)), overlap=s % 2 == 1)
        for mode in ("11points", "area"):
            for fuse in (False, True):
                want, tp = _devkit(dets, gts, mode, fuse)
                got = eval_map(dets, gts, mode=mode, fuse=fuse)
                assert (got["map"] is None) == (want is None)
                assert want is None or got["map"] == pytest.approx(want, abs=1e-12), (s, mode, fuse)
                assert got["tp"] == tp
        want_csr = _devkit(dets, gts, "area")[1] / max(1, sum(int((~np.asarray(g["difficult"])).sum()) for g in gts))
        assert csr(dets, gts) in (None, pytest.approx(want_csr))


def test_eleven_point_thresholds_are_the_devkit_floats():
    """A recall of exactly 3/10 is below the devkit's (and MMDetection's) third threshold, 0.30000000000000004:
    10 boxes, 3 TPs, 7 FPs, 1 TP; at t = 0.3 the best precision is 4/11, not 1."""
    flags, scores = [1, 1, 1] + [0] * 7 + [1], -np.arange(11.0)
    assert average_precision(scores, flags, 10) == pytest.approx((3 + 2 * 4 / 11) / 11)  # t = 0..0.2, then 0.3, 0.4
    boxes = [[20 * i, 0, 20 * i + 10, 10] for i in range(10)]
    dets = [det(boxes[:3] + [[0, 50, 10, 60]] * 7 + boxes[3:4], 1 - np.arange(11.0) / 20, [0] * 11)]
    gts = [gt(boxes, [0] * 10, [False] * 10)]
    assert eval_map(dets, gts)["map"] == pytest.approx((3 + 2 * 4 / 11) / 11)
    assert _devkit(dets, gts, "11points")[0] == pytest.approx((3 + 2 * 4 / 11) / 11)


def _coco_ap50(dets, gts, n_cls, grid):
    """pycocotools' AP50 on a recall grid of ``grid`` + 1 points, a difficult box as a crowd region."""
    import contextlib
    import io

    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    anns = [{"id": len(dets) * 100 + 10 * i + j, "image_id": i + 1, "category_id": int(v) + 1, "iscrowd": int(d),
             "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "area": float((b[2] - b[0]) * (b[3] - b[1]))}
            for i, g in enumerate(gts) for j, (b, v, d) in enumerate(zip(g["boxes"], g["labels"], g["difficult"]))]
    res = [{"image_id": i + 1, "category_id": int(v) + 1, "score": float(s),
            "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]}
           for i, d in enumerate(dets) for b, s, v in zip(d["boxes"], d["scores"], d["labels"])]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = {"images": [{"id": i + 1} for i in range(len(gts))], "annotations": anns,
                        "categories": [{"id": c + 1} for c in range(n_cls + 1)]}
        coco.createIndex()
        e = COCOeval(coco, coco.loadRes(res), "bbox")
        e.params.iouThrs, e.params.recThrs = np.array([0.5]), np.linspace(0, 1, grid + 1)
        e.params.maxDets, e.params.areaRng, e.params.areaRngLbl = [100], [[0, 1e10]], ["all"]
        e.evaluate()
        e.accumulate()
    p = e.eval["precision"][0, :, :, 0, 0]
    return float(np.mean([p[:, k].mean() for k in range(p.shape[1]) if (p[:, k] > -1).all()]))


def test_all_point_ap_matches_pycocotools_with_difficult_boxes_as_crowd():
    """All-point AP against pycocotools on a fine recall grid (M = 10,000): COCO averages the precision envelope at
    the M + 1 grid points, all-point integrates it, so they differ by at most (boxes of a class + 1) / (M + 1)
    (one grid point per recall step, and r = 0); with at most ~40 boxes a class the stated tolerance is 5e-3, the
    largest seen 7.5e-5. Boxes on a grid (COCO's fallback to the next box never applies) and no detection whose
    crowd IoA and IoU fall on different sides of 0.5 (COCO matches a crowd region by IoA)."""
    rng = np.random.default_rng(12)
    compared = 0
    for _ in range(60):
        n_cls = int(rng.integers(1, 4))
        dets, gts = _fuzz_scene(rng, int(rng.integers(2, 12)), n_cls, overlap=False)
        for d, g in zip(dets, gts):  # drop the detections COCO's crowd rule would judge otherwise
            keep = []
            for b in np.asarray(d["boxes"]).reshape(-1, 4):
                area = (b[2] - b[0]) * (b[3] - b[1])
                inter = [max(0, min(b[2], c[2]) - max(b[0], c[0])) * max(0, min(b[3], c[3]) - max(b[1], c[1]))
                         for c in g["boxes"]]
                keep.append(not any(dd and (_iou1(b, c) >= 0.5) != (i / area >= 0.5)
                                    for c, i, dd in zip(g["boxes"], inter, g["difficult"])))
            keep = np.array(keep, bool)
            d.update(boxes=np.asarray(d["boxes"]).reshape(-1, 4)[keep], scores=np.asarray(d["scores"])[keep],
                     labels=np.asarray(d["labels"])[keep])
        ours = eval_map(dets, gts, mode="area")["map"]
        if ours is None or not sum(len(d["scores"]) for d in dets):
            continue
        compared += 1
        assert abs(ours - _coco_ap50(dets, gts, n_cls, 10_000)) <= 5e-3
    assert compared > 40


def test_an_iou_of_exactly_the_threshold_matches():
    """MMDetection's rule (spec sheet: IoU >= 0.5; voc_eval.py's strict > differs only here): half of A is a TP."""
    half = [0, 0, 10, 5]
    assert box_iou([half], [A])[0, 0] == 0.5
    assert eval_map([det([half], [0.9], [0])], [gt([A], [0])])["tp"] == 1
    assert _devkit([det([half], [0.9], [0])], [gt([A], [0], [False])], "area") == (1.0, 1)


def test_a_score_of_exactly_the_threshold_counts():
    """``score_thr`` keeps detections with score >= the threshold (module docstring): a detection scored exactly
    0.5 is a TP at score_thr 0.5 and dropped just above it, in CSR, mAP and the detection count alike."""
    d, g = [det([A, B], [0.5, 0.25], [0, 1])], [gt([A, B], [0, 1])]
    assert csr(d, g, score_thr=0.5) == pytest.approx(0.5)
    assert csr(d, g, score_thr=0.5 + 1e-9) == 0.0
    m = detection_metrics(d, g, score_thr=0.5)
    assert m["n_det"] == 1 and m["map"] == pytest.approx(0.5) and m["ap_loc"] == pytest.approx(6 / 11)
