"""The detection family's bookkeeping, pinned by hand: what a record counts (detections at the counting threshold,
boxes that are not difficult), what the summary derives from the records (detections per image and their ratio),
the threat keys' ranges, the class-range checks of the inputs, the post-processing every detector of a run gets,
the report's rows, and how an adversarial training set is assembled and cached."""
import dataclasses

import pytest
import torch

from blackboxbench.builder import build_attack, load_recipe
from blackboxbench.config import ConfigError, finish_threat
from blackboxbench.detection import training
from blackboxbench.detection.data import shapes
from blackboxbench.detection.family import match_record, summarize_detection
from blackboxbench.errors import BenchError
from blackboxbench.family import RunInputs
from blackboxbench.prep.models import build_model
from blackboxbench.registry import FAMILY
from blackboxbench.rng import Streams

FAM = FAMILY.get("detection")


def _det(scores, boxes=None):
    n = len(scores)
    boxes = boxes if boxes is not None else [[10.0 * k, 0.0, 10.0 * k + 8, 8.0] for k in range(n)]
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).view(-1, 4), "scores": torch.tensor(scores),
            "labels": torch.zeros(n, dtype=torch.long)}


GT = {"boxes": torch.tensor([[0.0, 0, 8, 8]]), "labels": torch.tensor([0]), "difficult": torch.tensor([False])}


def test_record_counts_the_detections_at_or_above_count_thr():
    d = _det([0.5, 0.3, 0.7, 0.49999])
    assert match_record(d, GT, 0.5, False)["n"] == 2  # a score equal to the threshold counts
    assert match_record(d, GT, None, False)["n"] == 4  # None: every detection returned
    assert match_record(_det([0.0]), GT, None, False)["n"] == 1


def test_record_holds_the_class_aware_and_the_fused_matching():
    """Boxes A (class 0) and B (class 1), both detected as class 1: class-aware, the detection on A is a false
    positive (mAP (0 + 0.5) / 2, CSR 1/2); fused (localisation only) both are true positives of 2 boxes (AP_loc 1)."""
    from blackboxbench.detection.family import metrics_of

    gt = {"boxes": torch.tensor([[0.0, 0, 8, 8], [20, 0, 28, 8]]), "labels": torch.tensor([0, 1]),
          "difficult": torch.tensor([False, False])}
    d = {"boxes": gt["boxes"].clone(), "scores": torch.tensor([0.9, 0.8]), "labels": torch.tensor([1, 1])}
    r = match_record(d, gt, None, False)
    assert r["c"] == [[0.9, 1, 0], [0.8, 1, 1]] and r["l"] == [[0.9, 1], [0.8, 1]]
    assert r["npos"] == {"0": 1, "1": 1}
    m = metrics_of([r, r])
    assert m["map"] == pytest.approx(0.25) and m["ap_loc"] == pytest.approx(1.0) and m["csr"] == pytest.approx(0.5)
    assert m["map_area"] == pytest.approx(0.25) and m["ap_loc_area"] == pytest.approx(1.0) and m["n_det"] == 2


def test_summary_detections_per_image_their_ratio_and_goal_rates():
    """clean: 3 and 1 detections on two images (2 per image); adversarial: 5 and 3 (4 per image): ratio 2. Goals
    met on target t: 1 of 2 images (clean: 0 of 2); on u: 2 of 2 (clean: 1 of 2): the run's goal rate 3/4."""
    def rec(c, a, goals):
        def side(t, k):
            return {"clean": match_record(_det([0.9] * c), GT, None, False),
                    "adv": match_record(_det([0.9] * a), GT, None, False), "score_thr": 0.3, "max_det": 100,
                    "goal": goals[k][0], "goal_clean": goals[k][1]}
        return {"attacked": True, "time": 0.1, "l2": 1.0, "linf": 0.03, "ssim": 0.9, "lpips": None,
                "targets": {t: side(t, k) for k, t in enumerate("tu")}}

    s = summarize_detection([rec(3, 5, [(True, False), (True, True)]), rec(1, 3, [(False, False), (True, False)])])
    p = s["per_target"]["t"]
    assert (p["clean_n_det"], p["adv_n_det"], p["det_ratio"]) == (2.0, 4.0, 2.0)
    assert (p["score_thr"], p["max_det"]) == (0.3, 100)
    assert (p["goal_rate"], p["goal_rate_clean"]) == (0.5, 0.0) and s["mean_goal_rate"] == 0.75
    assert s["per_target"]["u"]["goal_rate_clean"] == 0.5


def test_a_target_without_clean_detections_leaves_the_mean_drops_to_the_others():
    """Target t2 detects nothing on the clean images (clean mAP 0: its drops are undefined, in every resample too),
    and everything on the adversarial ones: the means over targets, and their intervals, are t1's alone."""
    from blackboxbench.detection.family import metrics_of

    gts = [{"boxes": torch.tensor([[0.0, 0, 8, 8], [20, 0, 28, 8]]), "labels": torch.tensor([0, 1]),
            "difficult": torch.tensor([False, False])} for _ in range(6)]
    none = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.long)}

    def found(g, keep):
        return {"boxes": g["boxes"][keep], "scores": torch.tensor([0.9, 0.8])[keep], "labels": g["labels"][keep]}

    records = [{"attacked": True, "time": 0.1, "l2": 1.0, "linf": 0.03, "ssim": 0.9, "lpips": None,
                "targets": {"t1": {"clean": match_record(found(g, [0, 1]), g, None, False),
                                   "adv": match_record(found(g, [0, 1][:1 + i % 2]), g, None, False),
                                   "score_thr": None, "max_det": None},
                            "t2": {"clean": match_record(none, g, None, False),
                                   "adv": match_record(found(g, [0, 1]), g, None, False),
                                   "score_thr": None, "max_det": None}}}
               for i, g in enumerate(gts)]
    s = summarize_detection(records)
    p1, p2 = s["per_target"]["t1"], s["per_target"]["t2"]
    assert p2["clean_map"] == 0 and p2["adv_map"] == 1
    for k in ("map", "ap_loc", "csr"):
        assert p2[f"drop_{k}"] is None and (p2[f"drop_{k}_low"], p2[f"drop_{k}_high"]) == (None, None)
        assert s[f"mean_drop_{k}"] == p1[f"drop_{k}"] > 0
        assert (s[f"mean_drop_{k}_low"], s[f"mean_drop_{k}_high"]) == (p1[f"drop_{k}_low"], p1[f"drop_{k}_high"])
    assert s["asr"] == p1["drop_map"] != p1["drop_ap_loc"]
    assert s["clean_acc"] == (p1["clean_map"] + p2["clean_map"]) / 2
    assert metrics_of([match_record(none, dict(gts[0], boxes=torch.zeros(0, 4), labels=torch.zeros(0, dtype=torch.long),
                                                difficult=torch.zeros(0, dtype=torch.bool)), None, False)])["csr"] is None


@pytest.mark.parametrize("key,value,ok", [("score_thr", 0.0, True), ("score_thr", 0.999, True),
                                          ("score_thr", 1.0, False), ("score_thr", -0.1, False),
                                          ("max_det", 1, True), ("max_det", 0, False),
                                          ("count_thr", 1.0, True), ("count_thr", 0.0, True),
                                          ("count_thr", 1.5, False), ("count_thr", -0.5, False)])
def test_threat_key_ranges(key, value, ok):
    recipe, _ = load_recipe("tog_vanishing", "test")
    if ok:
        assert finish_threat({key: value}, recipe, FAM, "test")[key] == value
    else:
        with pytest.raises(ConfigError, match=f"threat.{key}"):
            finish_threat({key: value}, recipe, FAM, "test")


def test_inputs_refuse_class_ids_past_the_datasets_classes():
    """A detector whose label map reaches class id K on a dataset of K classes, and a box labelled K, are refused
    (ids run 0..K-1); a label map ending at K-1 passes the class check."""
    det = build_model({"name": "shapes_fcos_b", "pretrained": False})  # label map [-1, 0, 1, 2]
    data = shapes(None, n=1)
    two = dataclasses.replace(data, num_classes=2)
    with pytest.raises(ConfigError, match="outputs class ids up to 2 but dataset shapes has 2 classes"):
        FAM.check_inputs({"targets": [det]}, two, "test", None, {})
    past = dataclasses.replace(data, targets=[dict(data.targets[0], labels=torch.full_like(data.targets[0]["labels"], 3))])
    with pytest.raises(ConfigError, match=r"box labels must be in \[0, 3\), got 3"):
        FAM.check_inputs({"targets": [det]}, past, "test", None, {})


def _run_inputs(data, threat=None, surrogate="shapes_fcos", target="shapes_fcos", iterations=1):
    recipe, src = load_recipe({"recipe": "tog_vanishing", "blocks": {"craft": {"iterations": iterations}}}, "test")
    t = finish_threat(threat or {}, recipe, FAM, "test")
    sur, tgt = build_model(surrogate), build_model(target)
    return RunInputs(attack=build_attack(recipe, t, src), threat=t, data=data,
                     models={"surrogates": [sur], "targets": [tgt]},
                     model_names={"surrogates": ["s"], "targets": ["t"]}, streams=Streams(0, len(data.y), "cpu"),
                     device=torch.device("cpu"), slots=len(data.y), assets={})


def test_worker_harmonizes_the_surrogates_too():
    """The run's score threshold and cap reach every detector, the surrogate whose clean detections are the
    attacks' pseudo truth included."""
    run = _run_inputs(shapes(None, n=1), {"score_thr": 0.55, "max_det": 7}, target="shapes_fcos_b")
    FAM.worker(run)
    for m in (run.models["surrogates"][0], run.models["targets"][0]):
        assert (m.score_thr, m.max_det) == (0.55, 7) and (m.net.score_thresh, m.net.detections_per_img) == (0.55, 7)


def test_record_n_gt_leaves_out_difficult_boxes():
    data = shapes(None, n=2)
    t0 = data.targets[0]
    assert len(t0["labels"]) >= 2
    difficult = torch.zeros(len(t0["labels"]), dtype=torch.bool)
    difficult[0] = True
    data = dataclasses.replace(data, targets=[dict(t0, difficult=difficult), data.targets[1]])
    from blackboxbench.runner import schedule

    records = []
    schedule(FAM.worker(_run_inputs(data)), range(2), records.extend, lambda _: None)
    records.sort(key=lambda r: r["index"])
    assert [r["n_gt"] for r in records] == [len(t0["labels"]) - 1, len(data.targets[1]["labels"])]
    assert sum(records[0]["targets"]["t"]["clean"]["npos"].values()) == len(t0["labels"]) - 1


def test_worker_projects_the_craft_into_the_ball():
    """A craft's images past the eps ball (and [0, 1]) are projected into it, then quantized: the records hold
    perturbations of Linf eps at most."""
    from blackboxbench.runner import schedule

    run = _run_inputs(shapes(None, n=2))
    run.attack = dataclasses.replace(run.attack, craft=lambda ctx, objective: ctx.problem.x + 0.5)
    records = []
    schedule(FAM.worker(run), range(2), records.extend, lambda _: None)
    eps = run.threat["eps"]
    assert all(eps - 1 / 255 < r["linf"] <= eps + 1e-6 for r in records)


def test_forward_dets_refuses_non_finite_scores_or_boxes():
    from blackboxbench.detection.family import forward_dets

    def model(scores, boxes):
        return lambda x: [{"boxes": torch.tensor([boxes]), "scores": torch.tensor([scores]),
                           "labels": torch.tensor([0])} for _ in x]

    x = torch.zeros(2, 3, 8, 8)
    assert len(forward_dets(model(0.5, [0.0, 0, 1, 1]), x, "m")) == 2
    for scores, boxes in [(float("nan"), [0.0, 0, 1, 1]), (0.5, [0.0, 0, float("inf"), 1])]:
        with pytest.raises(BenchError, match="m returned non-finite boxes or scores"):
            forward_dets(model(scores, boxes), x, "m")


def test_attacks_pseudo_truth_is_each_images_own_detections():
    """The surrogate's clean detections a craft reads come from one image at a time, on a surrogate whose scores
    move with the batch's size."""
    from blackboxbench.detection.family import forward_dets
    from blackboxbench.runner import schedule
    from test_detection_attacks import BatchShifted

    data, seen = shapes(None, n=3), []
    run = _run_inputs(data)
    run.models["surrogates"] = [BatchShifted(build_model("shapes_fcos"))]

    def craft(ctx, objective):
        seen.extend(ctx.problem.clean)
        return ctx.problem.x

    run.attack = dataclasses.replace(run.attack, craft=craft)
    schedule(FAM.worker(run), range(3), lambda _: None, lambda _: None)
    alone = forward_dets(run.models["surrogates"][0], data.x, "s")
    assert len(seen) == 3 and all(torch.equal(a["scores"], b["scores"]) for a, b in zip(seen, alone))


def test_report_rows_scale_distances_and_keep_every_target_figure():
    from blackboxbench.detection.report import rows_of, transfer_matrix

    per = {"a": {"drop_map": 0.0, "adv_map": 0.5, "goal_rate": 0.25, "goal_rate_clean": 0.0},
           "b": {"drop_map": 0.4, "adv_map": 0.3, "goal_rate": None, "goal_rate_clean": None}}
    s = {"run": "r", "attack": "tog", "name": None, "family": "detection", "surrogates": "a", "eps": 0.03,
         "mean_l2": 0.1, "mean_linf": 0.02, "per_target": per}
    rows = rows_of([s, {"run": "q", "family": "transfer", "per_target": per}])  # another family: no rows
    assert [r["target"] for r in rows] == ["a", "b"]
    assert rows[0]["mean_l2_255"] == pytest.approx(25.5) and rows[0]["mean_linf_255"] == pytest.approx(5.1)
    assert (rows[0]["goal_rate"], rows[0]["goal_rate_clean"]) == (0.25, 0.0)
    _, cols, m = transfer_matrix(rows)
    assert cols == ["a", "b"] and m == [[0.0, 0.4]]  # a zero drop is a cell, not a gap


# ---------------------------------------------------------------- adversarial training sets

def test_split_plan_attacks_round_fraction_times_n():
    assert training.split_plan(10, {"a": 1.0}, 0.29) == [("a", [0, 1, 2]), (None, list(range(3, 10)))]
    assert training.split_plan(10, {"a": 1.0, "b": 1.0}, 0.5) == [("a", [0, 1]), ("b", [2, 3, 4]),
                                                                  (None, [5, 6, 7, 8, 9])]  # round(2.5) = 2


def test_finetune_leaves_the_base_alone_and_returns_a_frozen_copy():
    base = build_model("shapes_fcos")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    data = shapes(None, n=8, split="train")
    tuned = training.finetune(base, data.x, data.targets, steps=1, lr=1e-3, seed=0)
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())
    assert any(not torch.equal(v, before[k]) for k, v in tuned.state_dict().items())
    assert not any(p.requires_grad for p in tuned.parameters()) and not tuned.net.training


def test_adv_finetuned_refuses_a_zero_share():
    with pytest.raises(BenchError, match="shares must be positive"):
        training.adv_finetuned(attacks={"tog_vanishing": 0.0})


@pytest.fixture
def training_calls(monkeypatch):
    """adv_finetuned with the crafting, the fine-tuning and the cache replaced by recorders: the cache file's
    name, the images each attack crafts, and the training set the fine-tuning gets."""
    calls = {"files": [], "crafted": [], "x": None}

    def cached(net, file, train):
        calls["files"].append(file)
        return train()

    def craft(base, data, name, index, seed=0, data_root=None):
        calls["crafted"].append((name, list(index)))
        return torch.full((len(index), *data.x.shape[1:]), {"p": 0.25, "q": 0.75}[name])

    def tune(base, x, targets, *, steps, lr, seed):
        calls["x"] = x.clone()
        return base

    monkeypatch.setattr(training, "cached_or_trained", cached)
    monkeypatch.setattr(training, "adversarial_images", craft)
    monkeypatch.setattr(training, "finetune", tune)
    return calls


def test_training_set_holds_one_version_of_each_image(training_calls):
    """Shares 1:3 on the first half of 8 images: images 0 from p, 1-3 from q, 4-7 benign (the shapes pixels)."""
    training.adv_finetuned(attacks={"p": 1.0, "q": 3.0}, fraction=0.5, n_train=8, steps=1)
    assert training_calls["crafted"] == [("p", [0]), ("q", [1, 2, 3])]
    x, clean = training_calls["x"], shapes(None, n=8, split="train").x
    assert (x[0] == 0.25).all() and (x[1:4] == 0.75).all() and torch.equal(x[4:], clean[4:])


def test_benign_finetuning_cache_ignores_the_fraction(training_calls):
    """Without attacks every fraction is the same benign training set, hence one cache file; with attacks the
    fraction names another file."""
    for fraction in (1.0, 0.5):
        training.adv_finetuned(attacks=None, fraction=fraction, n_train=8, steps=1)
    for fraction in (1.0, 0.5):
        training.adv_finetuned(attacks={"p": 1.0}, fraction=fraction, n_train=8, steps=1)
    files = training_calls["files"]
    assert files[0] == files[1] and files[2] != files[3] and files[0] not in files[2:]


# ---------------------------------------------------------------- detector label maps

def test_label_map_drops_unmapped_labels_and_its_inverse_takes_the_first():
    """Model labels 0..3 -> classes [-1, 2, 0, 0]: label 0 is dropped, class 0 kept (it is a class like the
    others); the inverse (dataset class -> model label, for the attacks' training targets) takes the first model
    label of a class."""
    from blackboxbench.detection.models import Detector

    det = Detector(build_model({"name": "shapes_fcos_b", "pretrained": False}).net, [-1, 2, 0, 0], "fcos")
    assert det.inverse_map.tolist() == [2, 0, 1]
    out = det._map({"boxes": torch.arange(16.0).view(4, 4), "scores": torch.tensor([0.9, 0.8, 0.7, 0.6]),
                    "labels": torch.tensor([0, 1, 2, 3])})
    assert out["labels"].tolist() == [2, 0, 0] and out["scores"].tolist() == pytest.approx([0.8, 0.7, 0.6])
    assert torch.equal(out["boxes"], torch.arange(4.0, 16.0).view(3, 4))
    t = det.to_model_targets([{"boxes": torch.zeros(2, 4), "labels": torch.tensor([0, 2])}])
    assert t[0]["labels"].tolist() == [2, 1]


@pytest.mark.parametrize("num_classes,label_map,expect", [(73, "voc", {72: 19, 1: 14, 5: 0}), (4, "identity", None)])
def test_torchvision_label_maps(num_classes, label_map, expect):
    """``voc``: COCO category ids (spec sheet section 3) to VOC classes, tvmonitor (72) kept by a 73-class model;
    ``identity``: label k -> class k - 1, the background dropped."""
    det = build_model({"name": "torchvision_det", "arch": "ssdlite320_mobilenet_v3_large", "num_classes": num_classes,
                       "label_map": label_map})
    lm = det.label_map.tolist()
    if expect is None:
        assert lm == [-1, 0, 1, 2]
    else:
        assert {k: lm[k] for k in expect} == expect and sorted(c for c in lm if c >= 0) == list(range(20))


def test_fcos_candidate_scores_are_the_detection_scores():
    """FCOS scores a candidate sqrt(class probability x centerness) (torchvision's post-processing): every detection
    of the tiny FCOS is a candidate with its box and, in its class's column, its score."""
    det = build_model("shapes_fcos")
    x = shapes(None, n=2).x
    with torch.no_grad():
        out = det(x)
        probs, boxes = det.candidates(x, boxes=True)
    for d, p, b in zip(out, probs, boxes.clamp(0, 1) * 64):
        assert len(d["boxes"]) > 0
        for box, score, label in zip(d["boxes"], d["scores"], d["labels"]):
            at = (b - box).abs().amax(1) < 1e-3
            assert at.any() and ((p[at, label] - score).abs() < 1e-5).any()


def test_candidate_boxes_of_a_non_square_image_are_in_units_of_its_width_and_height():
    det = build_model({"name": "shapes_fcos_b", "pretrained": False})
    det.harmonize(1e-6, 20)  # random weights: keep every candidate
    x = torch.rand(1, 3, 48, 96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (d,), (_, boxes) = det(x), det.candidates(x, boxes=True)
    b = boxes[0].clamp(0, 1) * torch.tensor([96.0, 48, 96, 48])
    assert len(d["boxes"]) > 0
    assert float(torch.cdist(d["boxes"].double(), b.double()).min(1).values.max()) < 1e-3
