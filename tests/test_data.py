"""Dataset loaders on bad input: explicit imagefolder class mapping, corrupt images, n too large, unreadable files.

Every failure must be a one-line BenchError that names the file (no traceback)."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from blackboxbench.errors import BenchError
from blackboxbench.registry import DATASET

CIFAR = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
imagefolder, nips17 = DATASET.get("imagefolder"), DATASET.get("nips17")


def one_line_error(fn, *words):
    with pytest.raises(BenchError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg and all(str(w) in msg for w in words), msg
    return msg


def png_bytes(seed=0, shape=(6, 5, 3), fmt="PNG"):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def make_folder(root, layout):
    """layout: {folder: number of 6x5 PNGs}; returns root."""
    for i, (folder, count) in enumerate(layout.items()):
        (root / folder).mkdir(parents=True)
        for j in range(count):
            (root / folder / f"{j}.png").write_bytes(png_bytes(10 * i + j))
    return root


def make_nips(root, rows=3, header="ImageId,label_1000,target_1000"):
    (root / "images").mkdir(parents=True)
    lines = [header]
    for i in range(rows):
        (root / "images" / f"im{i}.png").write_bytes(png_bytes(i))
        lines.append(f"im{i},{100 + i},{200 + i}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


# ---------------------------------------------------------------- imagefolder class mapping

def test_imagefolder_class_subset_keeps_true_ids(tmp_path):
    """Two CIFAR-10 classes: labels are their CIFAR ids (3, 8), not folder indices (0, 1)."""
    make_folder(tmp_path / "imgs", {"cat": 2, "ship": 1})
    for spec in ({"classes": CIFAR}, {"classes": {"cat": 3, "ship": 8}}):
        ds = imagefolder(tmp_path, path="imgs", **spec)
        assert ds.y.tolist() == [3, 3, 8] and ds.y.dtype == torch.long
        assert ds.num_classes is None  # taken from the model by the runner
        assert tuple(ds.x.shape) == (3, 3, 6, 5)
    assert imagefolder(tmp_path, path="imgs", classes=CIFAR, num_classes=10).num_classes == 10


def test_imagefolder_labels_file(tmp_path):
    make_folder(tmp_path / "imgs", {"cat": 1, "ship": 1})
    (tmp_path / "names.txt").write_text("\n".join(CIFAR) + "\n\n")  # trailing blank lines name no class
    rel = imagefolder(tmp_path, path="imgs", labels_file="names.txt", num_classes=10)
    absolute = imagefolder(None, path=tmp_path / "imgs", labels_file=tmp_path / "names.txt")
    assert rel.y.tolist() == absolute.y.tolist() == [3, 8] and rel.num_classes == 10
    (tmp_path / "gaps.txt").write_text("cat\n\nship\n")  # a blank line holds id 1: ship is line 2
    assert imagefolder(tmp_path, path="imgs", labels_file="gaps.txt").y.tolist() == [0, 2]
    # a 1001-line file (background first) against a 1000-class model: caught, not shifted silently
    (tmp_path / "bg.txt").write_text("\n".join(["background"] + CIFAR) + "\n")
    one_line_error(lambda: imagefolder(tmp_path, path="imgs", labels_file="bg.txt", num_classes=10),
                   "bg.txt", "'truck'", "class id 10", "num_classes = 10")
    # repeated names are an error only when a folder uses one
    (tmp_path / "dup.txt").write_text("crane\ncat\nship\ncrane\n")
    assert imagefolder(tmp_path, path="imgs", labels_file="dup.txt").y.tolist() == [1, 2]
    make_folder(tmp_path / "imgs2", {"crane": 1})
    one_line_error(lambda: imagefolder(tmp_path, path="imgs2", labels_file="dup.txt"), "dup.txt", "crane",
                   "more than once")
    one_line_error(lambda: imagefolder(tmp_path, path="imgs", labels_file="nope.txt"), str(tmp_path / "nope.txt"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00cat")
    one_line_error(lambda: imagefolder(tmp_path, path="imgs", labels_file="bin.txt"), "bin.txt")


def test_imagefolder_mapping_required_and_checked(tmp_path):
    make_folder(tmp_path / "imgs", {"cat": 1, "ship": 1, ".ipynb_checkpoints": 0})  # dot folders are ignored
    call = lambda **kw: imagefolder(tmp_path, path="imgs", **kw)  # noqa: E731
    one_line_error(call, "no class mapping", "classes", "labels_file")
    one_line_error(lambda: call(classes=CIFAR, labels_file="x.txt"), "both", "classes", "labels_file")
    one_line_error(lambda: call(classes=["cat"]), "not in classes", "ship", "ignore_unmapped")
    ds = call(classes=["cat"], ignore_unmapped=True)
    assert ds.y.tolist() == [0] and len(ds.x) == 1
    one_line_error(lambda: call(classes={"cat": -1, "ship": 2}), "'cat'", "non-negative integer", "-1")
    one_line_error(lambda: call(classes={"cat": True, "ship": 2}), "'cat'", "non-negative integer")
    one_line_error(lambda: call(classes={"cat": 1.0, "ship": 2}), "'cat'", "non-negative integer")
    one_line_error(lambda: call(classes={3: 3, "cat": 1, "ship": 2}), "must be strings", "3")
    one_line_error(lambda: call(classes="cat"), "list of folder names or a mapping")
    one_line_error(lambda: call(classes={"cat": 3, "ship": 8}, num_classes=5), "'ship'", "class id 8",
                   "num_classes = 5")
    one_line_error(lambda: call(classes=CIFAR, num_classes=0), "num_classes", "positive")
    one_line_error(lambda: call(classes=["cat", "ship", "cat"]), "cat", "more than once")


# ---------------------------------------------------------------- corrupt image files

def corruptions():
    png, jpg = png_bytes(shape=(32, 32, 3)), png_bytes(shape=(32, 32, 3), fmt="JPEG")
    return {"truncated.png": png[: len(png) // 2], "truncated.jpg": jpg[: len(jpg) // 2],
            "random.png": np.random.default_rng(1).bytes(500), "empty.png": b""}


@pytest.mark.parametrize("fname", sorted(corruptions()))
def test_corrupt_image_in_imagefolder(tmp_path, fname):
    make_folder(tmp_path / "imgs", {"cat": 2})
    bad = tmp_path / "imgs" / "cat" / fname
    bad.write_bytes(corruptions()[fname])
    one_line_error(lambda: imagefolder(tmp_path, path="imgs", classes=CIFAR, size=8), "cannot decode image",
                   str(bad))


@pytest.mark.parametrize("fname", ["truncated.png", "random.png"])
def test_corrupt_image_in_nips17(tmp_path, fname):
    root = make_nips(tmp_path / "nips")
    bad = root / "images" / "im1.png"
    bad.write_bytes(corruptions()[fname])
    one_line_error(lambda: nips17(tmp_path, path="nips"), "cannot decode image", str(bad))
    nips17(tmp_path, path="nips", n=1)  # only the kept rows are decoded


# ---------------------------------------------------------------- n

def npz(path, **arrays):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


@pytest.fixture
def small_sets(tmp_path):
    """Every loader with a small set: name -> (loader call taking n, size)."""
    npz(tmp_path / "cifar10" / "cifar10_test_300.npz", x=np.zeros((7, 4, 4, 3), np.uint8), y=np.arange(7) % 10)
    npz(tmp_path / "mnist" / "mnist_test_first1000.npz", x=np.zeros((6, 28, 28), np.uint8), y=np.arange(6))
    make_folder(tmp_path / "imgs", {"cat": 2, "ship": 3})
    make_nips(tmp_path / "imagenet_nips17_subset100", rows=4)
    return {"digits": (lambda n: DATASET.get("digits")(None, n=n), 500),
            "cifar10": (lambda n: DATASET.get("cifar10")(tmp_path, n=n), 7),
            "mnist": (lambda n: DATASET.get("mnist")(tmp_path, n=n), 6),
            "imagefolder": (lambda n: imagefolder(tmp_path, path="imgs", classes=CIFAR, n=n), 5),
            "nips17": (lambda n: nips17(tmp_path, n=n), 4)}


@pytest.mark.parametrize("name", ["digits", "cifar10", "mnist", "imagefolder", "nips17"])
def test_n_larger_than_dataset(small_sets, name):
    load, size = small_sets[name]
    assert len(load(size).y) == size and len(load(2).x) == 2
    assert len(load(None).y) == size
    one_line_error(lambda: load(size + 1), f"dataset {name}: n = {size + 1} but it has {size} images")
    for bad in (0, -3, 2.5, True, "4"):
        one_line_error(lambda: load(bad), f"dataset {name}: n must be a positive integer", repr(bad))


def test_n_larger_than_real_datasets(data_root):
    one_line_error(lambda: DATASET.get("cifar10")(data_root, n=1000), "dataset cifar10: n = 1000 but it has 300")
    one_line_error(lambda: DATASET.get("mnist")(data_root, n=1001), "dataset mnist: n = 1001 but it has 1000")
    one_line_error(lambda: nips17(data_root, n=101), "dataset nips17: n = 101 but it has 100 images")


# ---------------------------------------------------------------- other unreadable input

@pytest.mark.parametrize("arrays, words", [
    ({"y": np.arange(3)}, ["no key 'x'", "keys: y"]),
    ({"x": np.zeros((3, 4, 4, 3), np.uint8), "labels": np.arange(3)}, ["no key 'y'"]),
    ({"x": np.zeros((3, 4, 4, 3), np.float32), "y": np.arange(3)}, ["must be uint8", "float32"]),
    ({"x": np.zeros((3, 4, 4, 3), np.uint8), "y": np.arange(2)}, ["3 integers", "shape (2,)"]),
    ({"x": np.zeros((3, 4, 4, 3), np.uint8), "y": np.array([0.0, 1.0, 2.0])}, ["integers", "float64"]),
    ({"x": np.zeros((3, 4, 4, 3), np.uint8), "y": np.array([0, 10, 2])}, ["class id 10", "[0, 10)"]),
    ({"x": np.zeros((3, 4, 4, 3), np.uint8), "y": np.array([0, -1, 2])}, ["class id -1"]),
    ({"x": np.zeros((3, 3, 4, 4), np.uint8), "y": np.arange(3)}, ["(N, H, W, C)", "(3, 3, 4, 4)"]),
    ({"x": np.zeros((0, 4, 4, 3), np.uint8), "y": np.arange(0)}, ["non-empty"]),
    ({"x": np.array([None, 1], dtype=object), "y": np.arange(2)}, ["cannot read"]),
])
def test_bad_npz(tmp_path, arrays, words):
    path = npz(tmp_path / "c.npz", **arrays)
    one_line_error(lambda: DATASET.get("cifar10")(tmp_path, file="c.npz"), "dataset cifar10", str(path), *words)


def test_unreadable_npz_files(tmp_path):
    (tmp_path / "random.npz").write_bytes(np.random.default_rng(0).bytes(300))
    np.save(tmp_path / "array.npy", np.zeros((2, 28, 28), np.uint8))
    good = npz(tmp_path / "good.npz", x=np.zeros((2, 28, 28), np.uint8), y=np.arange(2)).read_bytes()
    (tmp_path / "cut.npz").write_bytes(good[: len(good) // 2])
    for f in ("random.npz", "array.npy", "cut.npz"):
        one_line_error(lambda: DATASET.get("mnist")(tmp_path, file=f), "dataset mnist", str(tmp_path / f))


def test_bad_nips17_labels(tmp_path):
    root = make_nips(tmp_path / "nips", header="ImageId,TrueLabel,target_1000")
    one_line_error(lambda: nips17(tmp_path, path="nips"), str(root / "labels.csv"), "no column label_1000",
                   "TrueLabel")
    (root / "labels.csv").write_text("ImageId,label_1000\nim0,5\nim1,cat\n")
    one_line_error(lambda: nips17(tmp_path, path="nips"), str(root / "labels.csv"), "line 3", "'cat'")
    (root / "labels.csv").write_text("ImageId,label_1000\nim0,5\nim1\n")
    one_line_error(lambda: nips17(tmp_path, path="nips"), "line 3", "None")
    (root / "labels.csv").write_text("ImageId,label_1000\nim0,1000\n")
    one_line_error(lambda: nips17(tmp_path, path="nips"), str(root / "labels.csv"), "class id 1000")
    (root / "labels.csv").write_text("ImageId,label_1000\n")
    one_line_error(lambda: nips17(tmp_path, path="nips"), "no rows")
    (root / "labels.csv").write_text("ImageId,label_1000\nim0,5\nim9,6\n")
    one_line_error(lambda: nips17(tmp_path, path="nips"), str(root / "images" / "im9.png"))
    (root / "labels.csv").write_text("ImageId,label_1000\nim0,5\nim1,6\n")  # no target column: no given targets
    ds = nips17(tmp_path, path="nips")
    assert ds.y.tolist() == [5, 6] and ds.given_target is None and ds.num_classes == 1000


def test_images_of_different_sizes(tmp_path):
    make_folder(tmp_path / "imgs", {"cat": 1, "ship": 1})
    big = tmp_path / "imgs" / "ship" / "0.png"
    big.write_bytes(png_bytes(shape=(9, 7, 3)))
    one_line_error(lambda: imagefolder(tmp_path, path="imgs", classes=CIFAR), "differ in size", str(big), "7x9",
                   "set size")
    assert tuple(imagefolder(tmp_path, path="imgs", classes=CIFAR, size=4).x.shape) == (2, 3, 4, 4)
    root = make_nips(tmp_path / "nips", rows=2)
    (root / "images" / "im1.png").write_bytes(png_bytes(shape=(9, 7, 3)))
    one_line_error(lambda: nips17(tmp_path, path="nips"), "differ in size", str(root / "images" / "im1.png"))


def test_16_bit_png_is_scaled_not_clipped(tmp_path):
    """A 16-bit grayscale PNG (PIL mode I;16) keeps its contrast: value v reads as round(v / 257), not min(v, 255)."""
    from blackboxbench.prep.data import _decode_image
    v = np.array([[0, 257, 30000], [40000, 65535, 128 * 257]], dtype=np.uint16)
    Image.fromarray(v).save(tmp_path / "g.png")
    assert Image.open(tmp_path / "g.png").mode.startswith("I;16")
    got = _decode_image(tmp_path / "g.png", None, "L")
    assert got.tolist() == np.round(v / 257).astype(int).tolist()
    assert _decode_image(tmp_path / "g.png", None, "RGB")[..., 0].tolist() == got.tolist()


# ---------------------------------------------------------------- what a loader returns

def test_npz_images_keep_their_pixels_and_order(tmp_path):
    """NHWC uint8 -> NCHW floats v / 255 in file order (C = 3 and C = 1), labels and ``n`` alike."""
    x3 = np.random.default_rng(1).integers(0, 256, (4, 3, 5, 3), dtype=np.uint8)
    npz(tmp_path / "c.npz", x=x3, y=np.array([3, 1, 4, 1]))
    ds = DATASET.get("cifar10")(tmp_path, file="c.npz", n=3)
    assert ds.y.tolist() == [3, 1, 4] and ds.x.dtype == torch.float32
    assert torch.equal(ds.x * 255, torch.from_numpy(x3[:3]).permute(0, 3, 1, 2).float())
    npz(tmp_path / "g.npz", x=x3[..., :1], y=np.arange(4))
    gray = DATASET.get("cifar10")(tmp_path, file="g.npz")
    assert torch.equal(gray.x * 255, torch.from_numpy(x3[..., 0]).float()[:, None])


def test_imagefolder_files_are_taken_in_name_order(tmp_path):
    names = ["b.png", "d.png", "a.png", "e.png", "c.png"]  # written out of order
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    for i, name in enumerate(names):
        (tmp_path / "imgs" / "cat" / name).write_bytes(png_bytes(i))
    ds = imagefolder(tmp_path, path="imgs", classes=CIFAR)
    for k, name in enumerate(sorted(names)):
        want = np.array(Image.open(tmp_path / "imgs" / "cat" / name))
        assert torch.equal(ds.x[k] * 255, torch.from_numpy(want).permute(2, 0, 1).float()), name
    assert torch.equal(imagefolder(tmp_path, path="imgs", classes=CIFAR, n=2).x, ds.x[:2])  # n keeps the first


def test_resize_is_bilinear(tmp_path):
    """``size`` resizes bilinearly: a black-and-white checkerboard enlarged gets grey levels between the two."""
    board = (np.indices((4, 4)).sum(0) % 2 * 255).astype(np.uint8)
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    Image.fromarray(np.stack([board] * 3, -1)).save(tmp_path / "imgs" / "cat" / "0.png")
    levels = (imagefolder(tmp_path, path="imgs", classes=CIFAR, size=10).x * 255).round().unique()
    assert ((levels > 0) & (levels < 255)).sum() >= 3, levels


def test_data_root_argument_wins_over_the_environment(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("BLACKBOXBENCH_DATA", str(tmp_path / "a"))
    from blackboxbench.prep.data import resolve_data_root
    assert resolve_data_root(tmp_path / "b") == tmp_path / "b"
    assert resolve_data_root(None) == tmp_path / "a"


def test_imagefolder_skips_files_that_are_not_images(tmp_path):
    make_folder(tmp_path / "imgs", {"cat": 2})
    (tmp_path / "imgs" / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / "imgs" / "cat" / "3.PNG").write_bytes(png_bytes(7))  # the extension in any case
    assert len(imagefolder(tmp_path, path="imgs", classes=CIFAR).y) == 3


def test_cifar10_file_wins_over_the_torchvision_fallback(tmp_path):
    x = np.full((2, 4, 4, 3), 102, np.uint8)
    npz(tmp_path / "cifar10" / "cifar10_test_300.npz", x=x, y=np.array([1, 2]))
    ds = DATASET.get("cifar10")(tmp_path, torchvision_root=tmp_path / "no_torchvision_here")
    assert ds.y.tolist() == [1, 2] and torch.allclose(ds.x, torch.tensor(0.4))
