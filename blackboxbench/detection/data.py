"""Detection datasets (registry ``DATASET``): every loader returns a :class:`DetectionDataset`.

* ``shapes`` (embedded, offline): squares, circles and triangles on textured backgrounds, generated
  deterministically from ``seed`` and the image index (image i is the same whatever ``n``), 64x64 or larger.
* ``voc2007``: Pascal VOC through ``torchvision.datasets.VOCDetection`` (never downloaded), difficult flags kept.
* ``coco_json``: a COCO-style annotation file and its image folder (``iscrowd`` boxes become difficult ones).

Images are resized to ``size`` x ``size`` (boxes scaled alike) so that a dataset stacks into one tensor; the
metrics are then computed at that resolution. ``y`` holds zeros (a detection sample has no single label); the
ground truth is ``targets[i] = {"boxes" (K, 4) xyxy pixels, "labels" (K,) class ids, "difficult" (K,) bool}``.
"""
import json
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch

from ..errors import BenchError
from ..prep.data import Dataset, _decode_image, _need, data_path, first_line
from ..registry import ASSET, DATASET, check_params

SHAPES = ("square", "circle", "triangle")
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")
SPLIT_SALT = {"test": 0, "train": 1 << 20}
CONTRAST = (0.15, 0.4)  # a shape's colour differs from the background under it by 0.15..0.4 in some channel  # the train split draws from other streams than the test split


@dataclass
class DetectionDataset(Dataset):
    """A :class:`~blackboxbench.prep.data.Dataset` with per-image ground-truth boxes (``targets``), class names,
    and whether boxes use VOC's integer "+1" convention (``legacy_coords``, for the metrics)."""

    targets: List[dict] = field(default_factory=list)
    classes: tuple = ()
    legacy_coords: bool = False
    source: Optional[str] = None
    boxes_only: bool = False  # x is a placeholder: the pixels were never read

    def subset(self, idx):
        idx = [int(i) for i in idx]
        t = torch.as_tensor(idx, dtype=torch.long)
        return DetectionDataset(self.name, self.x[t], self.y[t], self.num_classes, None, [self.targets[i] for i in idx],
                                self.classes, self.legacy_coords, self.source, self.boxes_only)


def _make(name, images, targets, classes, legacy=False, source=None, size=None):
    """The dataset of uint8 HxWx3 ``images``; None (boxes only): an all-zero ``size`` x ``size`` placeholder
    that takes no memory."""
    if images is None:
        x = torch.zeros(1, 3, size, size).expand(len(targets), -1, -1, -1)
    else:
        x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div(255.0).contiguous()
    return DetectionDataset(name, x, torch.zeros(len(targets), dtype=torch.long), len(classes), None, targets,
                            tuple(classes), legacy, source, images is None)


def _target(boxes, labels, difficult=None):
    boxes = torch.as_tensor(np.asarray(boxes, np.float32).reshape(-1, 4))
    labels = torch.as_tensor(np.asarray(labels, np.int64).reshape(-1))
    diff = torch.zeros(len(labels), dtype=torch.bool) if difficult is None else \
        torch.as_tensor(np.asarray(difficult, bool).reshape(-1))
    return {"boxes": boxes, "labels": labels, "difficult": diff}


# ---------------------------------------------------------------- synthetic shapes

def _background(rng, size):
    """A textured background: a smooth random colour field plus stripes and fine noise (uint8 RGB)."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    img = np.zeros((size, size, 3))
    for c in range(3):
        a, b, ph = rng.uniform(1, 4, 2).tolist() + [rng.uniform(0, 2 * np.pi)]
        img[..., c] = 0.45 + 0.15 * np.sin(2 * np.pi * (a * xx + b * yy) + ph)
    freq, angle = rng.uniform(4, 10), rng.uniform(0, np.pi)
    img += 0.06 * np.sin(2 * np.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy))[..., None]
    img += rng.normal(0, 0.03, img.shape)
    return img


def _draw(img, kind, x0, y0, s, color):
    size = img.shape[0]
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    if kind == "square":
        m = (xx >= x0) & (xx < x0 + s) & (yy >= y0) & (yy < y0 + s)
    elif kind == "circle":
        r = s / 2
        m = (xx - x0 - r) ** 2 + (yy - y0 - r) ** 2 <= r * r
    else:  # upward triangle inscribed in the box
        m = (yy >= y0) & (yy < y0 + s) & (np.abs(xx - x0 - s / 2) <= (yy - y0) / 2)
    img[m] = color


def shapes_image(seed, index, size=64, max_objects=3, split="test"):
    """Image ``index`` of the shapes set of ``seed``: (uint8 HxWx3, target). 1..``max_objects`` shapes of side
    size/6..size/2.3 whose boxes overlap at most slightly; a shape's box is its tight extent."""
    rng = np.random.default_rng([int(seed), SPLIT_SALT[split] + int(index)])
    img = _background(rng, size)
    boxes, labels = [], []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        for _attempt in range(20):
            s = float(rng.uniform(size / 6, size / 2.3))
            x0, y0 = rng.uniform(0, size - s, 2)
            box = [x0, y0, x0 + s, y0 + s]
            if all(_overlap(box, b) < 0.1 for b in boxes):
                break
        else:
            continue
        k = int(rng.integers(0, len(SHAPES)))
        delta = rng.uniform(-CONTRAST[1], CONTRAST[1], 3)
        while np.abs(delta).max() < CONTRAST[0]:  # a moderate contrast with the background
            delta = rng.uniform(-CONTRAST[1], CONTRAST[1], 3)
        _draw(img, SHAPES[k], x0, y0, s, np.clip(img[int(y0 + s / 2), int(x0 + s / 2)] + delta, 0, 1))
        boxes.append(box)
        labels.append(k)
    img = np.round(np.clip(img, 0, 1) * 255).astype(np.uint8)
    return img, _target(boxes, labels)


def _overlap(a, b):
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    return w * h / min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))


@DATASET.register("shapes", source="embedded: synthetic squares, circles, triangles (deterministic from seed)",
                  ranges={"n": "int [1, inf)", "size": "int [64, 1024]", "max_objects": "int [1, 8]",
                          "seed": "int [0, inf)"})
def shapes(data_root=None, *, n=64, seed=0, size=64, max_objects=3, split="test"):
    """``n`` synthetic images (``split`` test or train: disjoint streams), classes square, circle, triangle."""
    if split not in SPLIT_SALT:
        raise BenchError(f"shapes: split must be 'train' or 'test', got '{split}'")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise BenchError(f"shapes: seed must be an integer in [0, 2^63), got {seed!r}")
    pairs = [shapes_image(seed, i, size, max_objects, split) for i in range(n)]
    return _make("shapes", [p[0] for p in pairs], [p[1] for p in pairs], SHAPES, source=f"shapes seed {seed}")


# ---------------------------------------------------------------- VOC2007 and COCO json

def _resize(img, target, size):
    """Resize uint8 HxWx3 ``img`` to size x size (bilinear), scaling the boxes."""
    from PIL import Image

    h, w = img.shape[:2]
    if size and (h, w) != (size, size):
        img = np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR))
    return img, _scale(target, h, w, size)


def _scale(target, h, w, size):
    if not size or (h, w) == (size, size):
        return target
    return dict(target, boxes=target["boxes"] * torch.tensor([size / w, size / h, size / w, size / h]))


def _image_or_size(path, target, size, boxes_only):
    """(uint8 image resized to size x size, target scaled alike); ``boxes_only``: (None, the target scaled by the
    image's size read from its header, the pixels never decoded)."""
    if not boxes_only:
        return _resize(_decode_image(path, None), target, size)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise BenchError(f"cannot read the size of image {path}: {first_line(err)}") from None
    return None, _scale(target, h, w, size)


@DATASET.register("voc2007", source="torchvision.datasets.VOCDetection (local copy, never downloaded)",
                  ranges={"n": "int [1, inf)", "size": "int [32, 2048]"})
def voc2007(data_root, *, root="VOC", image_set="test", year="2007", n=None, size=512, keep_difficult=True,
            boxes_only=False):
    """VOC ``year`` ``image_set`` from ``root`` (relative to the data root, or absolute; the folder holding
    ``VOCdevkit``), in file order; ``difficult`` flags kept (ignored by the metrics). Boxes keep VOC's 1-based
    integer pixels (``legacy_coords``), minus 1 to put them at 0-based positions. ``boxes_only``: the boxes
    without the pixels (``x`` an all-zero placeholder), for assets that read boxes alone (CAA's context tables:
    VOC trainval's 5,011 images at 512 px would take 16 GB)."""
    import torchvision

    path = data_path(data_root, root)
    try:
        ds = torchvision.datasets.VOCDetection(str(path), year=year, image_set=image_set, download=False)
    except (RuntimeError, FileNotFoundError, ValueError) as err:
        raise BenchError(f"voc2007: no VOC{year} {image_set} under {path} ({first_line(err)})") from None
    count = len(ds) if n is None else n
    if count > len(ds):
        raise BenchError(f"dataset voc2007: n = {n} but it has {len(ds)} images")
    images, targets = [], []
    for i in range(count):
        img_path = ds.images[i]
        ann = ds.parse_voc_xml(__import__("xml.etree.ElementTree", fromlist=["parse"]).parse(ds.annotations[i])
                               .getroot())["annotation"]
        objs = ann.get("object", [])
        objs = objs if isinstance(objs, list) else [objs]
        boxes, labels, diff = [], [], []
        for o in objs:
            if o["name"] not in VOC_CLASSES:
                raise BenchError(f"voc2007: {ds.annotations[i]}: unknown class '{o['name']}'")
            d = bool(int(o.get("difficult", "0")))
            if d and not keep_difficult:
                continue
            b = o["bndbox"]
            boxes.append([float(b["xmin"]) - 1, float(b["ymin"]) - 1, float(b["xmax"]) - 1, float(b["ymax"]) - 1])
            labels.append(VOC_CLASSES.index(o["name"]))
            diff.append(d)
        img, t = _image_or_size(img_path, _target(boxes, labels, diff), size, boxes_only)
        images.append(img)
        targets.append(t)
    return _make("voc2007", None if boxes_only else images, targets, VOC_CLASSES, legacy=True, source=str(path),
                 size=size)


@DATASET.register("coco_json", source="a COCO-style annotation file and its images",
                  ranges={"n": "int [1, inf)", "size": "int [32, 2048]"})
def coco_json(data_root, *, annotations, images, n=None, size=512, classes=None, boxes_only=False):
    """Images listed in ``annotations`` (COCO json: images, annotations with ``bbox`` [x, y, w, h],
    categories) under folder ``images``, in the file's image order. Class ids are the categories in the file's
    order (or ``classes``: the category names to keep, in class-id order; other categories are dropped).
    ``iscrowd`` boxes are kept as difficult (ignored by the metrics). ``boxes_only``: as :func:`voc2007`'s."""
    ann_path = _need(data_path(data_root, annotations), "annotation file")
    folder = _need(data_path(data_root, images), "image folder", directory=True)
    try:
        doc = json.loads(ann_path.read_text(encoding="utf-8"))
        cats = [(int(c["id"]), str(c["name"])) for c in doc["categories"]]
        imgs = [(int(im["id"]), str(im["file_name"])) for im in doc["images"]]
        anns = [(int(a["image_id"]), int(a["category_id"]), [float(v) for v in a["bbox"]], bool(a.get("iscrowd", 0)))
                for a in doc["annotations"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise BenchError(f"coco_json: cannot read {ann_path}: {type(err).__name__} {first_line(err)}") from None
    names = list(classes) if classes is not None else [name for _, name in cats]
    unknown = [c for c in names if c not in {name for _, name in cats}]
    if unknown:
        raise BenchError(f"coco_json: {ann_path}: no category named {', '.join(map(repr, unknown))}")
    cat_to_label = {cid: names.index(name) for cid, name in cats if name in names}
    count = len(imgs) if n is None else n
    if count > len(imgs) or not imgs:
        raise BenchError(f"dataset coco_json: n = {n} but {ann_path} lists {len(imgs)} images")
    by_image = {}
    for image_id, cid, (x, y, w, h), crowd in anns:
        if cid in cat_to_label:
            by_image.setdefault(image_id, []).append(([x, y, x + w, y + h], cat_to_label[cid], crowd))
    images_out, targets = [], []
    for image_id, fname in imgs[:count]:
        objs = by_image.get(image_id, [])
        t = _target([o[0] for o in objs], [o[1] for o in objs], [o[2] for o in objs])
        img, t = _image_or_size(_need(folder / fname, "image"), t, size, boxes_only)
        images_out.append(img)
        targets.append(t)
    return _make("coco_json", None if boxes_only else images_out, targets, names, source=str(ann_path), size=size)


# ---------------------------------------------------------------- the attacker's own training images

@dataclass
class TrainImages:
    """Detection images an attack may learn from (a universal perturbation's training set), never the test
    images; ``cache`` keeps what a craft block learnt once per run (e.g. the perturbation), keyed by the block."""

    data: DetectionDataset
    cache: dict = field(default_factory=dict)


def detection_dataset(data_root, spec, who):
    """The detection dataset of ``spec`` ({name: ..., params}) for asset ``who``; a wrong name, parameter or a
    dataset without boxes is a one-line error naming ``spec.<param>``."""
    spec = dict(spec)
    name = spec.pop("name", None)
    fn = DATASET.get(name)
    check_params(fn, spec, f"{who}: spec.")
    data = fn(data_root, **spec)
    if not isinstance(data, DetectionDataset):
        raise BenchError(f"{who}: dataset {name} has no boxes")
    return data


def with_default(spec, default):
    """An asset's dataset spec: a partial one (no name, or the default's) completes ``default`` (``{n: 32}`` keeps
    the shapes train split); a spec naming another dataset stands alone."""
    spec = dict(spec or {})
    return {**default, **spec} if spec.get("name", default["name"]) == default["name"] else spec


@ASSET.register("detection_images", source="a detection dataset spec (default: the shapes train split)")
def detection_images(data_root, device, *, spec=None):
    """The images of detection dataset ``spec`` ({name: ..., params}; default ``{name: shapes, split: train,
    n: 320}``, which a partial spec completes) for attacks that train on images of their own (PhantomSponges'
    universal perturbation: it validates on 10 % of them, and with 64 its early stop reads 7 images' noise)."""
    spec = with_default(spec, {"name": "shapes", "split": "train", "n": 320})
    return TrainImages(detection_dataset(data_root, spec, "detection_images"))
