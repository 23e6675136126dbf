"""Datasets (registry ``DATASET``): every loader returns a :class:`Dataset` of images on the uint8 grid.

A dataset is ``fn(data_root, *, n=None, ...)``: ``data_root`` is a Path or None (then env BLACKBOXBENCH_DATA is
used, see :func:`resolve_data_root`); ``n`` keeps the first ``n`` samples (an error when the dataset has fewer).
The embedded ``digits`` set needs no data root. File layouts follow the data README (``cifar10/``, ``mnist/``,
``imagenet_nips17_subset100/``). Unreadable input (missing key, corrupt image, bad labels) is a one-line
:class:`BenchError` naming the file.
"""
import csv
import os
import re
import struct
import zipfile
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
    dataset's own target labels (e.g. the NIPS-2017 competition targets) or None. ``num_classes`` None means
    "take it from the model" (an imagefolder without ``num_classes``): the runner fills it in."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: Optional[int]  # None: take it from the model (the runner fills it in)
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


def _need(path, what="file", directory=False):
    """``path``, which must exist and be a directory (``directory``) or a file: a one-line error naming ``what``
    otherwise (a folder where a file is expected, or the reverse, fails here, not deep in a reader)."""
    if not path.exists():
        raise BenchError(f"missing {what} {path}")
    if directory and not path.is_dir():
        raise BenchError(f"{what} {path} is not a directory")
    if not directory and path.is_dir():
        raise BenchError(f"{what} {path} is a directory, not a file")
    return path


def first_line(err, limit=None):
    """An exception's first line (its type when it has no text), terminal colour codes removed, at most ``limit``
    characters: for one-line errors that quote a library's."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return (text.splitlines() or [type(err).__name__])[0][:limit]


def _count(n, total, name):
    """How many samples to keep: ``total`` when ``n`` is None; a one-line error unless 1 <= n <= total."""
    if n is None:
        return total
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise BenchError(f"dataset {name}: n must be a positive integer, got {n!r}")
    if n > total:
        raise BenchError(f"dataset {name}: n = {n} but it has {total} images")
    return int(n)


def _labels(values, name, source, what, num_classes, count):
    """``values`` as a long tensor of ``count`` class ids in [0, num_classes) (upper bound unchecked when None)."""
    v = np.asarray(values)
    if v.shape != (count,) or v.dtype.kind not in "iu":
        raise BenchError(f"dataset {name}: {source}: {what} must be {count} integers (one per image), "
                         f"got {v.dtype} of shape {v.shape}")
    hi = np.inf if num_classes is None else num_classes
    bad = (v < 0) | (v >= hi)
    if bad.any():
        raise BenchError(f"dataset {name}: {source}: {what} has class id {v[bad][0]}, outside [0, {hi})")
    return torch.as_tensor(v.astype(np.int64))


def _from_uint8(x, y, name, num_classes, n, given=None, source=None):
    """uint8 NHWC (or NHW) array -> Dataset with float NCHW in [0, 1]; keeps the first ``n`` samples.
    ``source`` names the file or folder the arrays came from in error messages."""
    source = source or name
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise BenchError(f"dataset {name}: {source}: images must be uint8, got {x.dtype}")
    if x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[-1] not in (1, 3)) or len(x) == 0:
        raise BenchError(f"dataset {name}: {source}: images must be a non-empty (N, H, W) or (N, H, W, C) array "
                         f"with C = 1 or 3, got shape {x.shape}")
    y = _labels(y, name, source, "labels", num_classes, len(x))
    given = None if given is None else _labels(given, name, source, "given targets", num_classes, len(x))
    k = _count(n, len(x), name)
    x = torch.from_numpy(x[:k].copy())
    x = x[:, None] if x.dim() == 3 else x.permute(0, 3, 1, 2)
    return Dataset(name, x.float().div(255.0).contiguous(), y[:k], num_classes, None if given is None else given[:k])


def _load_npz(path, name, num_classes, n):
    """An npz with ``x`` (uint8 images) and ``y`` (labels); any unreadable file is a one-line error naming it."""
    _need(path)
    try:
        d = np.load(path)
        if not isinstance(d, np.lib.npyio.NpzFile):
            raise BenchError(f"dataset {name}: {path} is not an npz archive")
        with d:
            missing = [k for k in ("x", "y") if k not in d.files]
            if missing:
                raise BenchError(f"dataset {name}: {path} has no key {', '.join(map(repr, missing))} "
                                 f"(keys: {', '.join(d.files) or 'none'})")
            x, y = d["x"], d["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise BenchError(f"dataset {name}: cannot read {path}: {first_line(err)}") from None
    return _from_uint8(x, y, name, num_classes, n, source=path)


def _decode_image(path, size, mode="RGB"):
    """One image file -> uint8 (H, W, 3) RGB array (``mode`` "L": (H, W) grayscale), resized (bilinear) to
    ``size`` x ``size`` when ``size``. A file PIL cannot decode (corrupt, truncated, not an image) is a one-line
    error naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            if im.mode.startswith("I;16"):  # 16-bit grayscale: PIL's convert would clip it to 255, not scale it
                im = Image.fromarray((np.asarray(im, dtype=np.float64) / 257).round().astype(np.uint8))
            im = im.convert(mode)  # decodes the whole file: a truncated one raises here
            if size:
                im = im.resize((size, size), Image.BILINEAR)
            return np.asarray(im, dtype=np.uint8)
    except UnidentifiedImageError:
        raise BenchError(f"cannot decode image {path}: not an image file PIL can read") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError) as err:
        raise BenchError(f"cannot decode image {path}: {first_line(err)}") from None


def _load_images(paths, size, name, mode="RGB"):
    """Decode ``paths`` and stack them (N, H, W, 3), or (N, H, W) for ``mode`` "L"; without ``size`` they must
    share one size."""
    images = [_decode_image(p, size, mode) for p in paths]
    shapes = [im.shape for im in images]
    if len(set(shapes)) > 1:
        i = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise BenchError(f"dataset {name}: images differ in size ({paths[0]} is {shapes[0][1]}x{shapes[0][0]}, "
                         f"{paths[i]} is {shapes[i][1]}x{shapes[i][0]}); set size")
    return np.stack(images)


@DATASET.register("digits", source="sklearn.datasets.load_digits (bundled, offline)", ranges={"n": "int [1, inf)"})
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


@DATASET.register("cifar10", source="data README: cifar10/cifar10_test_300.npz (lossless test images)",
                  ranges={"n": "int [1, inf)"})
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


@DATASET.register("mnist", source="data README: mnist/mnist_test_first1000.npz", ranges={"n": "int [1, inf)"})
def mnist(data_root, *, n=None, file="mnist/mnist_test_first1000.npz"):
    """MNIST test images (``x`` (N, 28, 28) uint8) -> (N, 1, 28, 28)."""
    return _load_npz(data_path(data_root, file), "mnist", 10, n)


def _class_mapping(data_root, classes, labels_file, num_classes):
    """For :func:`imagefolder`: ({folder name: class id}, names given more than once, where the mapping is)."""
    if (classes is None) == (labels_file is None):
        problem = "classes and labels_file both given" if classes is not None else "no class mapping"
        raise BenchError(f"imagefolder: {problem}; set one of classes: [folder names in class-id order], "
                         "classes: {folder: class id}, or labels_file: <text file, one class name per line, "
                         "line k = class id k>")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or num_classes < 1):
        raise BenchError(f"imagefolder: num_classes must be a positive integer, got {num_classes!r}")
    if labels_file is not None:
        path = _need(data_path(data_root, labels_file), "labels file")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise BenchError(f"imagefolder: cannot read labels file {path}: {first_line(err)}") from None
        pairs, where = [(name.strip(), k) for k, name in enumerate(lines) if name.strip()], f"labels file {path}"
    elif isinstance(classes, (list, tuple)):
        pairs, where = [(name, k) for k, name in enumerate(classes)], "classes"
    elif isinstance(classes, dict):
        pairs, where = list(classes.items()), "classes"
    else:
        raise BenchError("imagefolder: classes must be a list of folder names or a mapping {folder: class id}, "
                         f"got {type(classes).__name__}")
    mapping, repeated = {}, set()
    for name, k in pairs:
        if not isinstance(name, str):
            raise BenchError(f"imagefolder: {where}: folder names must be strings, got {name!r} "
                             f"({type(name).__name__}; quote it in YAML)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise BenchError(f"imagefolder: {where}: class id of '{name}' must be a non-negative integer, "
                             f"got {k!r}")
        if num_classes is not None and k >= num_classes:
            raise BenchError(f"imagefolder: {where}: '{name}' has class id {k}, not below "
                             f"num_classes = {num_classes}")
        if name in mapping:
            repeated.add(name)
        mapping.setdefault(name, k)
    return mapping, repeated, where


@DATASET.register("imagefolder", source="one sub-folder per class, class ids from classes or labels_file",
                  ranges={"n": "int [1, inf)", "size": "int [1, inf)", "num_classes": "int [1, inf)"})
def imagefolder(data_root, *, path, classes=None, labels_file=None, num_classes=None, ignore_unmapped=False,
                n=None, size=None, grayscale=False):
    """Images in ``path/<folder>/``; the class id of each folder comes from exactly one of

    - ``classes``: a list of folder names in class-id order (folder ``classes[i]`` -> class id i), or a mapping
      {folder name: class id} (non-negative integers);
    - ``labels_file``: a text file (relative to the data root, or absolute), one class name per line, line k
      (from 0) = class id k; each folder's name is looked up in it (a name on several lines is an error when
      a folder uses it). Blank lines hold an id but name no class.

    A folder missing from the mapping is an error unless ``ignore_unmapped`` (then it is skipped); folders whose
    name starts with "." are ignored. ``num_classes``: the classifier's class count; every id in the mapping must
    be below it. None (default): the Dataset's ``num_classes`` is None and the runner takes it from the model.
    Samples: folders sorted by name, files sorted inside each; ``n`` keeps the first n. ``size`` resizes every
    image to ``size`` x ``size`` (bilinear) so that they stack; without it they must already share one size.
    ``grayscale``: decode to one channel (for grayscale models); otherwise RGB.
    """
    mapping, repeated, where = _class_mapping(data_root, classes, labels_file, num_classes)
    root = _need(data_path(data_root, path), "image folder", directory=True)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise BenchError(f"imagefolder: no class sub-folders in {root}")
    unmapped = [f.name for f in folders if f.name not in mapping]
    if unmapped and not ignore_unmapped:
        raise BenchError(f"imagefolder: folders of {root} not in {where}: {', '.join(unmapped)} "
                         f"(add them, or set ignore_unmapped: true to skip them)")
    used = [f for f in folders if f.name in mapping]
    ambiguous = sorted(repeated & {f.name for f in used})
    if ambiguous:
        raise BenchError(f"imagefolder: {where} gives {', '.join(ambiguous)} more than once: ambiguous class id")
    files = [(f, mapping[c.name]) for c in used for f in sorted(c.iterdir())
             if f.suffix.lower() in IMAGE_EXTS and f.is_file()]
    if not files:
        raise BenchError(f"imagefolder: no images in the class folders of {root}")
    files = files[:_count(n, len(files), "imagefolder")]
    return _from_uint8(_load_images([f for f, _ in files], size, "imagefolder", "L" if grayscale else "RGB"),
                       [k for _, k in files],
                       "imagefolder", num_classes, None, source=root)


@DATASET.register("nips17", source="data README: imagenet_nips17_subset100 (NIPS-2017 DEV set, 299x299 PNG)",
                  ranges={"n": "int [1, inf)", "size": "int [1, inf)"})
def nips17(data_root, *, n=None, path="imagenet_nips17_subset100", size=None):
    """ImageNet-compatible NIPS-2017 images: ``images/<ImageId>.png`` in the row order of ``labels.csv``;
    ``y`` = ``label_1000``, ``given_target`` = ``target_1000`` (the competition's targets; None when the column
    is absent); 1000 classes. ``size`` resizes (bilinear) to ``size`` x ``size``, e.g. 224."""
    root = _need(data_path(data_root, path), "directory", directory=True)
    csv_path = _need(root / "labels.csv")
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows, columns = list(reader), reader.fieldnames or []
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise BenchError(f"dataset nips17: cannot read {csv_path}: {first_line(err)}") from None
    missing = [c for c in ("ImageId", "label_1000") if c not in columns]
    if missing:
        raise BenchError(f"dataset nips17: {csv_path} has no column {', '.join(missing)} "
                         f"(columns: {', '.join(columns) or 'none'})")
    if not rows:
        raise BenchError(f"dataset nips17: {csv_path} has no rows")
    rows = rows[:_count(n, len(rows), "nips17")]
    cols = ["label_1000"] + (["target_1000"] if "target_1000" in columns else [])
    ids = {c: [] for c in cols}
    for i, r in enumerate(rows):
        for c in cols:
            try:
                ids[c].append(int(r[c]))
            except (TypeError, ValueError):
                raise BenchError(f"dataset nips17: {csv_path} line {i + 2}: {c} = {r[c]!r} is not an integer") \
                    from None
    images = _load_images([_need(root / "images" / f"{r['ImageId']}.png") for r in rows], size, "nips17")
    return _from_uint8(images, ids["label_1000"], "nips17", 1000, None, given=ids.get("target_1000"),
                       source=csv_path)
