"""Datasets (registry ``DATASET``): every loader returns a :class:`Dataset` of images on the uint8 grid.

A dataset is ``fn(data_root, *, n=None, ...)``: ``data_root`` is a Path or None (then env BLACKBOXBENCH_DATA is
used, see :func:`resolve_data_root`); ``n`` keeps the first ``n`` samples. The embedded ``digits`` set needs no
data root. File layouts follow the data README (``cifar10/``, ``mnist/``, ``imagenet_nips17_subset100/``).
"""
import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import BenchError
from ..registry import DATASET

DIGITS_TRAIN = 1297  # digits: train = first 1297 samples, test = the last 500 (1797 in all)
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp")


@dataclass
class Dataset:
    """Images ``x`` (N, C, H, W) float32 in [0, 1] on the uint8 grid, labels ``y``; ``given_target`` holds the
    dataset's own target labels (e.g. the NIPS-2017 competition targets) or None."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    given_target: Optional[torch.Tensor] = None


def resolve_data_root(value=None):
    """The data root: ``value`` if given, else env BLACKBOXBENCH_DATA; it must be an existing directory."""
    value = value or os.environ.get("BLACKBOXBENCH_DATA")
    if not value:
        raise BenchError("no data root: set data_root in the config or BLACKBOXBENCH_DATA")
    root = Path(value).expanduser()
    if not root.is_dir():
        raise BenchError(f"data root {root} is not a directory")
    return root


def data_path(data_root, rel):
    """``rel`` itself when absolute, else ``rel`` under the resolved data root."""
    rel = Path(rel).expanduser()
    return rel if rel.is_absolute() else resolve_data_root(data_root) / rel


def _need(path, what="file"):
    if not path.exists():
        raise BenchError(f"missing {what} {path}")
    return path


def _from_uint8(x, y, name, num_classes, n, given=None):
    """uint8 NHWC (or NHW) array -> Dataset with float NCHW in [0, 1]; keeps the first ``n`` samples."""
    x, y = np.asarray(x)[:n], np.asarray(y)[:n]
    if x.dtype != np.uint8:
        raise BenchError(f"dataset {name}: images must be uint8, got {x.dtype}")
    x = torch.from_numpy(x.copy())
    x = x[:, None] if x.dim() == 3 else x.permute(0, 3, 1, 2)
    given = None if given is None else torch.as_tensor(np.asarray(given)[:n], dtype=torch.long)
    return Dataset(name, x.float().div(255.0).contiguous(), torch.as_tensor(y, dtype=torch.long), num_classes,
                   given)


def _load_npz(path, name, num_classes, n):
    with np.load(_need(path)) as d:
        return _from_uint8(d["x"], d["y"], name, num_classes, n)


def _load_image(path, size):
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if size:
            im = im.resize((size, size), Image.BILINEAR)
        return np.asarray(im, dtype=np.uint8)


@DATASET.register("digits", source="sklearn.datasets.load_digits (bundled, offline)")
def digits(data_root=None, *, n=None, split="test"):
    """8x8 grayscale digits embedded in scikit-learn; values 0..16 are mapped to round(v * 255 / 16) / 255.

    ``split="train"`` is the first 1297 samples, ``"test"`` the last 500. ``data_root`` is ignored.
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "test"):
        raise BenchError(f"digits: split must be 'train' or 'test', got '{split}'")
    d = load_digits()
    x = np.round(d.images * 255.0 / 16.0).astype(np.uint8)
    sl = slice(0, DIGITS_TRAIN) if split == "train" else slice(DIGITS_TRAIN, None)
    return _from_uint8(x[sl], d.target[sl], "digits", 10, n)


@DATASET.register("cifar10", source="data README: cifar10/cifar10_test_300.npz (lossless test images)")
def cifar10(data_root, *, n=None, file="cifar10/cifar10_test_300.npz", torchvision_root=None):
    """CIFAR-10 test images from an npz (keys ``x`` uint8 NHWC, ``y``) under the data root.

    When that file is missing and ``torchvision_root`` is given, the torchvision test set there is used
    (never downloaded).
    """
    try:
        path = data_path(data_root, file)
    except BenchError:
        if torchvision_root is None:
            raise
        path = None
    if torchvision_root is None or (path is not None and path.exists()):
        return _load_npz(path, "cifar10", 10, n)
    import torchvision

    try:
        ds = torchvision.datasets.CIFAR10(str(torchvision_root), train=False, download=False)
    except RuntimeError as err:
        raise BenchError(f"cifar10: no {path or file} and no torchvision CIFAR-10 at {torchvision_root} "
                         f"({str(err).splitlines()[0]})") from None
    return _from_uint8(ds.data, ds.targets, "cifar10", 10, n)


@DATASET.register("mnist", source="data README: mnist/mnist_test_first1000.npz")
def mnist(data_root, *, n=None, file="mnist/mnist_test_first1000.npz"):
    """MNIST test images (``x`` (N, 28, 28) uint8) -> (N, 1, 28, 28)."""
    return _load_npz(data_path(data_root, file), "mnist", 10, n)


@DATASET.register("imagefolder", source="one sub-folder per class")
def imagefolder(data_root, *, path, n=None, size=None):
    """Images in ``path/<class>/``: class folders sorted by name give labels 0..K-1, files sorted inside each.

    ``size`` resizes every image to ``size`` x ``size`` (bilinear) so that they stack; without it they must
    already share one size.
    """
    root = _need(data_path(data_root, path), "image folder")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise BenchError(f"imagefolder: no class sub-folders in {root}")
    files = [(f, k) for k, c in enumerate(classes) for f in sorted(c.iterdir())
             if f.suffix.lower() in IMAGE_EXTS][:n]
    if not files:
        raise BenchError(f"imagefolder: no images in the class folders of {root}")
    images = [_load_image(f, size) for f, _ in files]
    if len({im.shape for im in images}) > 1:
        raise BenchError(f"imagefolder: images in {root} differ in size; set size")
    return _from_uint8(np.stack(images), [k for _, k in files], "imagefolder", len(classes), None)


@DATASET.register("nips17", source="data README: imagenet_nips17_subset100 (NIPS-2017 DEV set, 299x299 PNG)")
def nips17(data_root, *, n=None, path="imagenet_nips17_subset100", size=None):
    """ImageNet-compatible NIPS-2017 images: ``images/<ImageId>.png`` in the row order of ``labels.csv``;
    ``y`` = ``label_1000``, ``given_target`` = ``target_1000`` (the competition's targets); 1000 classes.
    ``size`` resizes (bilinear) to ``size`` x ``size``, e.g. 224."""
    root = _need(data_path(data_root, path), "directory")
    with open(_need(root / "labels.csv"), newline="") as f:
        rows = list(csv.DictReader(f))[:n]
    images = [_load_image(_need(root / "images" / f"{r['ImageId']}.png"), size) for r in rows]
    return _from_uint8(np.stack(images), [int(r["label_1000"]) for r in rows], "nips17", 1000, None,
                       given=[int(r["target_1000"]) for r in rows])
