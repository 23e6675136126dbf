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
