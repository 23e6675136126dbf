"""Detection data and models: the synthetic shapes (deterministic from a seed), the VOC and COCO-json loaders on
tiny generated fixtures, the torchvision detector zoo offline, and the tiny detector trained on first use, whose
all-point mAP agrees with torchmetrics (pycocotools) within 0.01."""
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from PIL import Image

from blackboxbench.config import ConfigError, validate_experiment
from blackboxbench.detection.data import VOC_CLASSES, coco_json, detection_images, shapes, voc2007
from blackboxbench.detection.metrics import eval_map
from blackboxbench.errors import BenchError
from blackboxbench.prep.models import build_model
from blackboxbench.runner import run_experiment


def test_shapes_are_deterministic_and_prefix_stable():
    a, b = shapes(None, n=6, seed=3), shapes(None, n=3, seed=3)
    assert torch.equal(a.x[:3], b.x) and all(torch.equal(s["boxes"], t["boxes"]) for s, t in zip(a.targets, b.targets))
    c = shapes(None, n=3, seed=4)
    assert not torch.equal(c.x, b.x)
    train = shapes(None, n=3, seed=3, split="train")
    assert not torch.equal(train.x, b.x)
    assert a.x.shape == (6, 3, 64, 64) and a.classes == ("square", "circle", "triangle")
    assert torch.equal(torch.round(a.x * 255), a.x * 255)  # on the uint8 grid
    for t in a.targets:
        assert 1 <= len(t["labels"]) <= 3 and t["labels"].max() <= 2 and not t["difficult"].any()
        assert (t["boxes"] >= 0).all() and (t["boxes"] <= 64).all() and (t["boxes"][:, 2:] > t["boxes"][:, :2]).all()


def test_shapes_square_box_is_its_drawn_extent():
    """Inside a square's box the image is one flat colour (up to the background's noise) that differs from the
    ring of pixels just outside it; every class occurs; larger sizes work."""
    from blackboxbench.detection.data import shapes_image

    found = 0
    for i in range(30):
        img, t = shapes_image(0, i, 96)
        for b, lab in zip(t["boxes"].tolist(), t["labels"].tolist()):
            if lab != 0:
                continue
            x1, y1, x2, y2 = [int(round(v)) for v in b]
            inside = img[y1 + 1:y2 - 1, x1 + 1:x2 - 1].reshape(-1, 3)
            colours, counts = np.unique(inside, axis=0, return_counts=True)
            assert counts.max() >= 0.85 * len(inside)  # flat (another shape may overlap it a little)
            ring = np.concatenate([img[max(y1 - 2, 0), x1:x2], img[min(y2 + 1, 95), x1:x2]])
            assert (np.abs(ring.astype(int) - colours[counts.argmax()]).max(1) > 10).mean() > 0.5
            found += 1
    assert found >= 5
    labels = torch.cat([t["labels"] for t in shapes(None, n=20, seed=0, size=96).targets])
    assert set(labels.tolist()) == {0, 1, 2}


def _voc_fixture(root):
    base = root / "VOCdevkit" / "VOC2007"
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (base / sub).mkdir(parents=True)
    objects = {"000001": [("dog", (11, 21, 50, 60), 0), ("person", (1, 1, 10, 30), 1)],
               "000002": [("car", (5, 5, 80, 40), 0)]}
    for name, objs in objects.items():
        Image.fromarray(np.full((60, 100, 3), 128, np.uint8)).save(base / "JPEGImages" / f"{name}.jpg")
        ann = ET.Element("annotation")
        ET.SubElement(ann, "filename").text = f"{name}.jpg"
        for cls, (x1, y1, x2, y2), diff in objs:
            o = ET.SubElement(ann, "object")
            ET.SubElement(o, "name").text = cls
            ET.SubElement(o, "difficult").text = str(diff)
            bb = ET.SubElement(o, "bndbox")
            for k, v in zip(("xmin", "ymin", "xmax", "ymax"), (x1, y1, x2, y2)):
                ET.SubElement(bb, k).text = str(v)
        ET.ElementTree(ann).write(base / "Annotations" / f"{name}.xml")
    (base / "ImageSets" / "Main" / "test.txt").write_text("000001\n000002\n")


def test_voc_loader_keeps_difficult_and_scales_boxes(tmp_path):
    _voc_fixture(tmp_path)
    d = voc2007(None, root=str(tmp_path), size=50)
    assert d.x.shape == (2, 3, 50, 50) and d.legacy_coords and len(d.classes) == 20
    t = d.targets[0]
    assert t["labels"].tolist() == [d.classes.index("dog"), d.classes.index("person")]
    assert t["difficult"].tolist() == [False, True]
    assert torch.allclose(t["boxes"][0], torch.tensor([10 * 0.5, 20 * 50 / 60, 49 * 0.5, 59 * 50 / 60]))
    assert len(voc2007(None, root=str(tmp_path), size=50, keep_difficult=False).targets[0]["labels"]) == 1
    with pytest.raises(BenchError, match="no VOC2007 test"):
        voc2007(None, root=str(tmp_path / "nowhere"))
    with pytest.raises(BenchError, match="n = 3 but it has 2 images"):
        voc2007(None, root=str(tmp_path), size=50, n=3)


def test_boxes_only_reads_no_pixels(tmp_path):
    """``boxes_only``: the same boxes (scaled by each image's header size), an all-zero placeholder for the
    pixels that takes no memory, and a file whose pixels are corrupt still gives its boxes; the context asset
    reads VOC so, and the detection family refuses such a dataset as the one to attack."""
    from blackboxbench.detection.context import detection_context

    _voc_fixture(tmp_path)
    full, light = voc2007(None, root=str(tmp_path), size=50), voc2007(None, root=str(tmp_path), size=50,
                                                                       boxes_only=True)
    assert all(torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["labels"], b["labels"])
               for a, b in zip(full.targets, light.targets))
    assert light.boxes_only and not full.boxes_only and light.x.shape == full.x.shape
    assert light.x.stride(0) == 0 and not light.x.any()
    jpg = tmp_path / "VOCdevkit" / "VOC2007" / "JPEGImages" / "000002.jpg"
    raw = jpg.read_bytes()
    sos = raw.index(b"\xff\xda")
    jpg.write_bytes(raw[:sos + 2 + int.from_bytes(raw[sos + 2:sos + 4], "big") + 8])  # header kept, pixels cut
    with pytest.raises(BenchError, match="cannot decode image"):
        voc2007(None, root=str(tmp_path), size=50)
    assert voc2007(None, root=str(tmp_path), size=50, boxes_only=True).targets[1]["labels"].tolist() == [6]
    spec = {"name": "voc2007", "root": str(tmp_path), "size": 50}
    t = detection_context(None, "cpu", spec=spec)  # boxes only: the corrupt file does not matter
    dog, person = VOC_CLASSES.index("dog"), VOC_CLASSES.index("person")
    assert t.count.sum() == 2 and t.count[dog, person] == t.count[person, dog] == 1  # one pair, both orders
    exp = validate_experiment({"dataset": {**spec, "boxes_only": True}, "attack": "tog_vanishing",
                               "surrogates": ["shapes_fcos"], "targets": ["shapes_fcos"], "device": "cpu",
                               "output_dir": str(tmp_path / "out")}, "test.yaml")
    exp.update(_source="test.yaml", _base_dir=".")
    with pytest.raises(ConfigError, match="dataset.boxes_only"):
        run_experiment(exp, progress=False)


def test_coco_json_loader(tmp_path):
    (tmp_path / "img").mkdir()
    for k in (1, 2):
        Image.fromarray(np.zeros((40, 80, 3), np.uint8)).save(tmp_path / "img" / f"{k}.png")
    doc = {"images": [{"id": 7, "file_name": "1.png"}, {"id": 9, "file_name": "2.png"}],
           "categories": [{"id": 3, "name": "car"}, {"id": 1, "name": "person"}],
           "annotations": [{"image_id": 7, "category_id": 1, "bbox": [8, 4, 16, 8]},
                           {"image_id": 7, "category_id": 3, "bbox": [0, 0, 40, 20], "iscrowd": 1}]}
    (tmp_path / "ann.json").write_text(json.dumps(doc))
    d = coco_json(None, annotations=str(tmp_path / "ann.json"), images=str(tmp_path / "img"), size=40)
    assert d.classes == ("car", "person") and d.x.shape == (2, 3, 40, 40)
    light = coco_json(None, annotations=str(tmp_path / "ann.json"), images=str(tmp_path / "img"), size=40,
                      boxes_only=True)
    assert light.boxes_only and all(torch.equal(a["boxes"], b["boxes"]) for a, b in zip(d.targets, light.targets))
    t = d.targets[0]
    assert t["labels"].tolist() == [1, 0] and t["difficult"].tolist() == [False, True]
    assert torch.allclose(t["boxes"][0], torch.tensor([4.0, 4.0, 12.0, 12.0]))
    assert len(d.targets[1]["labels"]) == 0
    only = coco_json(None, annotations=str(tmp_path / "ann.json"), images=str(tmp_path / "img"), size=40,
                     classes=["person"])
    assert only.targets[0]["labels"].tolist() == [0]
    with pytest.raises(BenchError, match="no category named 'cat'"):
        coco_json(None, annotations=str(tmp_path / "ann.json"), images=str(tmp_path / "img"), classes=["cat"])


def test_torchvision_detectors_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(BenchError, match=r"not available offline: put ssdlite320.*\.pth in "):
        build_model({"name": "torchvision_det", "arch": "ssdlite320_mobilenet_v3_large", "pretrained": True})
    with pytest.raises(BenchError, match="unknown torchvision detection arch 'fcos_resnet5'"):
        build_model("torchvision_det:fcos_resnet5")
    det = build_model({"name": "torchvision_det", "arch": "ssdlite320_mobilenet_v3_large", "num_classes": 91})
    assert det.kind == "ssd" and det.label_map[1] == 14 and int((det.label_map >= 0).sum()) == 20  # person
    assert det.harmonize(0.3, 50) == (0.3, 50) and det.net.score_thresh == 0.3 and det.net.detections_per_img == 50
    assert det.harmonize() == det.own  # None restores the architecture's own post-processing
    out = det(torch.rand(1, 3, 64, 64))
    assert set(out[0]) == {"boxes", "scores", "labels"}
    assert det.candidates(torch.rand(1, 3, 64, 64)).shape[-1] == 20


def test_random_weight_detectors_are_the_same_every_run():
    """A detector with random weights (``pretrained: false``, a torchvision architecture without weights) is
    drawn from a fixed seed, so a config that names one gives the same records in every run and process, and
    building it leaves the caller's random stream alone."""
    specs = [{"name": "shapes_fcos_b", "pretrained": False}, {"name": "shapes_fcos_c", "pretrained": False},
             {"name": "torchvision_det", "arch": "ssdlite320_mobilenet_v3_large", "num_classes": 4,
              "label_map": "identity"}]
    torch.manual_seed(123)
    a = [build_model(s).state_dict() for s in specs]
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)
    torch.manual_seed(7)  # another global state: the same weights
    b = [build_model(s).state_dict() for s in specs]
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert not torch.equal(a[0]["net.head.classification_head.cls_logits.weight"],
                           a[1]["net.head.classification_head.cls_logits.weight"])  # each tiny its own seed


@pytest.fixture(scope="session")
def tiny():
    return build_model("shapes_fcos")


def test_tiny_detector_map_and_cross_check(tiny):
    pytest.importorskip("pycocotools")
    from torchmetrics.detection import MeanAveragePrecision

    d = shapes(None, n=48)
    with torch.no_grad():
        dets = tiny(d.x)
    ours = eval_map(dets, d.targets, mode="area")["map"]
    assert ours > 0.6
    m = MeanAveragePrecision(iou_thresholds=[0.5], backend="pycocotools")
    m.update(dets, [{"boxes": t["boxes"], "labels": t["labels"]} for t in d.targets])
    assert abs(ours - float(m.compute()["map_50"])) <= 0.01


def test_detection_images_asset():
    a = detection_images(None, "cpu", spec={"name": "shapes", "split": "train", "n": 4})
    assert len(a.data.targets) == 4 and a.cache == {}
    with pytest.raises(BenchError, match="has no boxes"):
        detection_images(None, "cpu", spec={"name": "digits", "n": 4})


@pytest.mark.parametrize("spec", ["shapes_fcos"] + [{"name": "torchvision_det", "arch": a, "num_classes": 21,
                                                     "label_map": "identity"}
                                                    for a in ("ssdlite320_mobilenet_v3_large", "retinanet_resnet50_fpn")])
def test_candidate_boxes_are_the_detectors_own(spec):
    """``candidates(x, boxes=True)`` decodes each candidate's box as the detector's post-processing does: every
    detection's box (clipped, in image pixels) is one of the candidates' boxes (in units of the image side)."""
    det = build_model(spec)
    det.harmonize(1e-6, 20)  # random weights: keep every candidate
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = det(x)
        probs, boxes = det.candidates(x, boxes=True)
    assert boxes.shape == (*probs.shape[:2], 4)
    for d, b in zip(out, boxes.clamp(0, 1) * 64):
        assert len(d["boxes"]) > 0
        gap = torch.cdist(d["boxes"].double(), b.double()).min(1).values
        assert float(gap.max()) < 1e-3, gap


def test_shapes_train_and_test_splits_share_no_image():
    test, train = shapes(None, n=12), shapes(None, n=12, split="train")
    assert not any(torch.equal(a, b) for a in train.x for b in test.x)


def test_shapes_object_count_and_overlap():
    """1..max_objects shapes per image, every count occurring; two boxes overlap by less than a tenth of the
    smaller one (a box inside another overlaps it entirely)."""
    from blackboxbench.detection.data import _overlap

    assert _overlap([0, 0, 10, 10], [0, 0, 20, 20]) == 1.0 and _overlap([0, 0, 10, 10], [5, 0, 25, 10]) == 0.5
    data = shapes(None, n=40)
    assert {len(t["labels"]) for t in data.targets} == {1, 2, 3}
    assert {len(t["labels"]) for t in shapes(None, n=10, max_objects=1).targets} == {1}
    for t in data.targets:
        b = t["boxes"].tolist()
        assert all(_overlap(b[i], b[j]) < 0.1 for i in range(len(b)) for j in range(i))


def test_subset_keeps_the_rows_and_every_property():
    import dataclasses

    full = dataclasses.replace(shapes(None, n=3), legacy_coords=True, source="src")
    sub = full.subset([2, 0])
    assert torch.equal(sub.x, full.x[[2, 0]])
    assert all(torch.equal(a["boxes"], full.targets[i]["boxes"]) for a, i in zip(sub.targets, (2, 0)))
    assert (sub.legacy_coords, sub.source, sub.classes, sub.num_classes, sub.boxes_only) == \
        (True, "src", full.classes, 3, False)


def test_shapes_contrast_with_the_background_under_them():
    """Every shape's colour differs from the background at its centre by at least 0.15 in some channel (up to the
    uint8 rounding), so no object is near-invisible."""
    from blackboxbench.detection.data import _background, shapes_image

    gaps = []
    for i in range(40):
        img, t = shapes_image(0, i)
        bg = _background(np.random.default_rng([0, i]), 64)  # the test split's stream: the background comes first
        for x0, y0, x1, y1 in t["boxes"].tolist():
            cy, cx = int((y0 + y1) / 2), int((x0 + x1) / 2)
            gaps.append(float(np.abs(img[cy, cx] / 255 - bg[cy, cx]).max()))
    assert len(gaps) > 50 and min(gaps) >= 0.15 - 1 / 255


@pytest.mark.parametrize("kind", ["square", "circle", "triangle"])
def test_a_drawn_shape_fills_its_box(kind):
    """Each shape's pixels span its box (x0, y0, x0 + s, y0 + s) to the pixel in both directions."""
    from blackboxbench.detection.data import _draw

    img = np.zeros((64, 64, 3))
    _draw(img, kind, 10.3, 12.7, 20.0, np.ones(3))
    ys, xs = np.nonzero(img[..., 0])
    assert abs(xs.min() - 10.3) <= 1 and abs(xs.max() + 1 - 30.3) <= 1
    assert abs(ys.min() - 12.7) <= 1 and abs(ys.max() + 1 - 32.7) <= 1


def test_coco_json_refuses_more_images_than_listed(tmp_path):
    (tmp_path / "img").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "img" / "1.png")
    doc = {"images": [{"id": 1, "file_name": "1.png"}], "categories": [{"id": 1, "name": "a"}], "annotations": []}
    (tmp_path / "ann.json").write_text(json.dumps(doc))
    with pytest.raises(BenchError, match="n = 2 but .* lists 1 images"):
        coco_json(None, annotations=str(tmp_path / "ann.json"), images=str(tmp_path / "img"), n=2, size=8)
