"""Preparation module: datasets, model zoo, target labels."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blackboxbench.errors import BenchError
from blackboxbench.prep import data as D
from blackboxbench.prep import models as M
from blackboxbench.prep.cifar_resnet import CifarResNet
from blackboxbench.registry import DATASET, MODEL, TARGET_LABEL

CIFAR_ACC = {20: 93.0, 32: 91.7, 44: 93.3, 56: 95.0}  # measured on the 300 images (data README)


def assert_images(ds, shape, num_classes):
    assert tuple(ds.x.shape) == shape and ds.x.dtype == torch.float32
    assert ds.y.dtype == torch.long and ds.y.shape == (shape[0],)
    assert 0 <= ds.x.min() and ds.x.max() <= 1
    assert (ds.x * 255 - (ds.x * 255).round()).abs().max() < 1e-4, "not on the uint8 grid"
    assert ds.num_classes == num_classes and 0 <= ds.y.min() and ds.y.max() < num_classes


def one_line_error(fn, *words):
    with pytest.raises(BenchError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


# ---------------------------------------------------------------- datasets

def test_digits_offline(monkeypatch):
    monkeypatch.delenv("BLACKBOXBENCH_DATA", raising=False)
    test, train = DATASET.get("digits")(None), DATASET.get("digits")(None, split="train")
    assert_images(test, (500, 1, 8, 8), 10)
    assert_images(train, (1297, 1, 8, 8), 10)
    first = DATASET.get("digits")(None, n=7)
    assert torch.equal(first.x, test.x[:7]) and torch.equal(first.y, test.y[:7])
    from sklearn.datasets import load_digits
    v = load_digits().images[-1]
    assert torch.equal(test.x[-1, 0] * 255, torch.tensor(np.round(v * 255 / 16), dtype=torch.float32))


def test_missing_data_root_and_files(monkeypatch, tmp_path):
    monkeypatch.delenv("BLACKBOXBENCH_DATA", raising=False)
    one_line_error(lambda: D.resolve_data_root(None), "no data root", "BLACKBOXBENCH_DATA")
    one_line_error(lambda: D.resolve_data_root(tmp_path / "nope"), str(tmp_path / "nope"))
    monkeypatch.setenv("BLACKBOXBENCH_DATA", str(tmp_path))
    assert D.resolve_data_root(None) == tmp_path
    one_line_error(lambda: DATASET.get("cifar10")(None), str(tmp_path / "cifar10/cifar10_test_300.npz"))
    one_line_error(lambda: DATASET.get("mnist")(tmp_path), "mnist_test_first1000.npz")
    one_line_error(lambda: DATASET.get("nips17")(tmp_path), "imagenet_nips17_subset100")
    one_line_error(lambda: DATASET.get("cifar10")(tmp_path, torchvision_root=tmp_path), "torchvision")
    one_line_error(lambda: M.build_model("cifar_resnet20", tmp_path), "resnet20-*.th")


def test_cifar10_torchvision_fallback(tmp_path, monkeypatch):
    import torchvision

    class FakeCIFAR10:
        def __init__(self, root, train, download):
            assert root == str(tmp_path) and not train and not download
            self.data, self.targets = np.full((3, 32, 32, 3), 51, np.uint8), [4, 5, 6]

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    monkeypatch.delenv("BLACKBOXBENCH_DATA", raising=False)
    ds = DATASET.get("cifar10")(None, n=2, torchvision_root=tmp_path)
    assert_images(ds, (2, 3, 32, 32), 10)
    assert ds.y.tolist() == [4, 5] and torch.allclose(ds.x, torch.tensor(0.2))


def test_imagefolder(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    arrays = {}
    for cls in ("b_cat", "a_dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(2):
            arrays[cls, i] = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
            Image.fromarray(arrays[cls, i]).save(tmp_path / "imgs" / cls / f"{i}.png")
    ds = DATASET.get("imagefolder")(tmp_path, path="imgs", classes=["a_dog", "b_cat"], num_classes=2)
    assert_images(ds, (4, 3, 6, 5), 2)
    assert ds.y.tolist() == [0, 0, 1, 1]  # a_dog < b_cat
    assert torch.equal(ds.x[2] * 255, torch.from_numpy(arrays["b_cat", 0]).permute(2, 0, 1).float())
    assert_images(DATASET.get("imagefolder")(None, path=tmp_path / "imgs", size=4, n=3,
                                             classes={"a_dog": 0, "b_cat": 1}, num_classes=2), (3, 3, 4, 4), 2)


def test_real_datasets(data_root):
    assert_images(DATASET.get("cifar10")(data_root), (300, 3, 32, 32), 10)
    assert_images(DATASET.get("mnist")(data_root, n=50), (50, 1, 28, 28), 10)
    nips = DATASET.get("nips17")(data_root, n=3)
    assert_images(nips, (3, 3, 299, 299), 1000)
    assert nips.y.tolist() == [305, 883, 243] and nips.given_target.tolist()[:2] == [778, 377]
    assert_images(DATASET.get("nips17")(data_root, n=2, size=224), (2, 3, 224, 224), 1000)


# ---------------------------------------------------------------- models

@pytest.mark.parametrize("depth", sorted(CIFAR_ACC))
def test_cifar_resnets_accuracy(data_root, depth):
    ds = DATASET.get("cifar10")(data_root)
    model = M.build_model(f"cifar_resnet{depth}", data_root)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    with torch.no_grad():
        acc = 100 * (model(ds.x).argmax(1) == ds.y).float().mean().item()
    assert abs(acc - CIFAR_ACC[depth]) <= 0.7, acc


@pytest.fixture(scope="module")
def digits_models(tmp_path_factory):
    """The digits models trained once into a fresh cache (a few seconds each)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BLACKBOXBENCH_CACHE", str(cache))
        return cache, {name: M.build_model(name) for name in M.DIGITS_ARCHS}


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", sorted(M.DIGITS_ARCHS))
def test_digits_models_accuracy(digits_models, name):
    test = DATASET.get("digits")(None)
    with torch.no_grad():
        acc = (digits_models[1][name](test.x).argmax(1) == test.y).float().mean().item()
    assert acc >= 0.93, acc


def test_digits_models_cached_and_deterministic(digits_models, monkeypatch):
    cache, models = digits_models
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"{n}-{M.DIGITS_VERSION}.pt" for n in models)
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(cache))
    monkeypatch.setattr(M, "train_digits", lambda *a, **k: pytest.fail("retrained instead of using the cache"))
    assert_same_weights(M.build_model("digits_mlp"), models["digits_mlp"])
    monkeypatch.undo()
    assert_same_weights(M.train_digits("digits_mlp"), models["digits_mlp"].net)
    assert_same_weights(M.train_digits("digits_cnn", epochs=1), M.train_digits("digits_cnn", epochs=1))
    assert not torch.equal(*(models[n](torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(0)))
                             for n in ("digits_mlp", "digits_cnn")))


def test_bad_cache_is_one_line_before_training(tmp_path, monkeypatch):
    """A BLACKBOXBENCH_CACHE that is a file, or lies under one, stops before any training with one line; a
    garbage cached file names itself and how to make it again."""
    monkeypatch.setattr(M, "train_digits", lambda *a, **k: pytest.fail("trained before the cache was checked"))
    (tmp_path / "f").write_text("x")
    for cache in (tmp_path / "f", tmp_path / "f" / "sub"):
        monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(cache))
        with pytest.raises(BenchError, match=f"cache folder {cache} cannot be used .*set BLACKBOXBENCH_CACHE to a "
                                             "writable folder"):
            M.build_model("digits_cnn")
    good = tmp_path / "cache"
    good.mkdir()
    (good / f"digits_cnn-{M.DIGITS_VERSION}.pt").write_bytes(b"not a tensor file")
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(good))
    with pytest.raises(BenchError, match=r"cached file .*digits_cnn-.*\.pt cannot be read .*delete it and it is "
                                         "made again"):
        M.build_model("digits_cnn")


class Spy(nn.Module):
    def forward(self, x):
        self.seen = x
        return x.flatten(1)[:, :10]


@pytest.mark.parametrize("spec", [{"name": "cifar_resnet20", "pretrained": False},
                                  {"name": "digits_cnn", "pretrained": False},
                                  {"name": "torchvision", "arch": "resnet18", "num_classes": 10}])
def test_random_weights_are_the_same_every_run(spec):
    """A model with random weights is drawn from a fixed seed: the same weights whatever the global random
    state, and building it leaves the caller's stream where it was."""
    torch.manual_seed(1)
    a = M.build_model(spec).state_dict()
    after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(3), after)
    torch.manual_seed(2)
    b = M.build_model(spec).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_random_weights_are_those_of_seed_0():
    """build_model's documented seed: a random-weight zoo model is the architecture initialised under seed 0."""
    torch.manual_seed(0)
    ref = CifarResNet(20)
    torch.manual_seed(5)
    assert_same_weights(M.build_model({"name": "cifar_resnet20", "pretrained": False}).net, ref.eval())


def test_normalized_resize_and_gradients():
    spy = Spy()
    model = M.Normalized(spy, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.1), resize=16)
    x = torch.rand(2, 3, 8, 8, requires_grad=True)
    model(x).sum().backward()
    up = F.interpolate(x.detach(), size=(16, 16), mode="bilinear", align_corners=False, antialias=False)
    mean, std = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.tensor([0.2, 0.2, 0.1]).view(1, 3, 1, 1)
    assert torch.allclose(spy.seen, (up - mean) / std)
    assert x.grad is not None and x.grad.abs().sum() > 0  # input gradients flow (transfer surrogates)
    x16 = torch.rand(1, 3, 16, 16)
    model(x16)
    assert torch.allclose(spy.seen, (x16 - mean) / std)
    assert not model.training
    # a grey image is not broadcast into three made-up channels
    one_line_error(lambda: model(torch.rand(1, 1, 16, 16)), "expects 3-channel images", "(1, 16, 16)")


def test_build_model_specs_and_errors():
    small = M.build_model({"name": "cifar_resnet20", "pretrained": False}, device="cpu")
    assert isinstance(small.net, CifarResNet) and not any(p.requires_grad for p in small.parameters())
    one_line_error(lambda: M.build_model("cifar_resnet21"), "unknown model", "did you mean")
    one_line_error(lambda: M.build_model({"name": "digits_mlp", "pretrainde": False}), "pretrainde", "pretrained")
    one_line_error(lambda: M.build_model({"name": "timm:resnet18", "arch": "resnet50"}), "arch given twice")
    one_line_error(lambda: M.build_model("timm:resnet181"), "unknown timm arch", "resnet18")
    one_line_error(lambda: M.build_model("torchvision:resnet181"), "unknown torchvision arch")
    assert {"cifar_resnet20", "cifar_resnet56", "digits_mlp", "digits_cnn", "timm", "torchvision",
            "checkpoint"} <= set(MODEL.names())


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    """torch.hub and Hugging Face caches pointed at an empty folder: nothing is available offline."""
    import huggingface_hub.constants
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub" / "checkpoints"


@pytest.mark.parametrize("lib", ["timm", "torchvision"])
def test_imagenet_archs_offline(empty_caches, lib):
    model = M.build_model({"name": f"{lib}:resnet18", "num_classes": 10, "resize": 64})
    x = torch.rand(2, 3, 32, 32, requires_grad=True)
    seen = []
    model.net.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    out = model(x)
    assert out.shape == (2, 10) and seen == [(2, 3, 64, 64)]  # resized for the network
    out.sum().backward()
    assert x.grad is not None
    one_line_error(lambda: M.build_model({"name": f"{lib}:resnet18", "pretrained": True}),
                   "not available offline", str(empty_caches))
    # weights already in the torch.hub cache are used, never downloaded
    url = (__import__("timm").models.get_pretrained_cfg("resnet18").url if lib == "timm" else
           __import__("torchvision").models.get_model_weights("resnet18").DEFAULT.url)
    ref = M.build_model(f"{lib}:resnet18")
    empty_caches.mkdir(parents=True)
    torch.save(ref.net.state_dict(), empty_caches / url.rsplit("/", 1)[-1])
    assert_same_weights(M.build_model({"name": f"{lib}:resnet18", "pretrained": True}).net, ref.net)
    # a corrupt file, or another architecture's weights, under that name: one line naming the file
    for bad in (b"junk", None):
        path = empty_caches / url.rsplit("/", 1)[-1]
        path.unlink()
        if bad is None:
            torch.save(M.build_model(f"{lib}:resnet34").net.state_dict(), path)
        else:
            path.write_bytes(bad)
        one_line_error(lambda: M.build_model({"name": f"{lib}:resnet18", "pretrained": True}),
                       f"{lib}:resnet18: the cached pretrained weights", "cannot be loaded")


@pytest.mark.filterwarnings("ignore:`torch.jit")  # TorchScript is deprecated in recent torch, still supported
def test_checkpoint_loader(tmp_path):
    net = CifarResNet(20)
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, tmp_path / "r20.th")
    model = M.build_model({"name": "checkpoint", "path": str(tmp_path / "r20.th"), "arch": "cifar_resnet20",
                           "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]})
    assert_same_weights(model.net, net.eval())
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x), net((x - 0.5) / 0.25), atol=1e-5)
    small = M.build_model({"name": "checkpoint", "path": str(tmp_path / "r20.th"), "arch": "cifar_resnet20",
                           "resize": 32})
    x16 = torch.rand(2, 3, 16, 16)
    with torch.no_grad():  # resize: the model takes smaller images, upsampled bilinearly before the normalization
        up = F.interpolate(x16, size=(32, 32), mode="bilinear", align_corners=False)
        assert torch.allclose(small(x16), net((up - torch.tensor(M.IMAGENET_MEAN).view(1, 3, 1, 1))
                                              / torch.tensor(M.IMAGENET_STD).view(1, 3, 1, 1)), atol=1e-5)
    one_line_error(lambda: M.build_model({"name": "checkpoint", "path": str(tmp_path / "r20.th"),
                                          "arch": "digits_mlp"}), "does not fit")
    one_line_error(lambda: M.build_model({"name": "checkpoint", "path": "r20.th"}, data_root=tmp_path / "x"),
                   str(tmp_path / "x"))
    scripted = torch.jit.script(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)))
    scripted.save(str(tmp_path / "tiny.pt"))
    tiny = M.build_model({"name": "checkpoint", "path": "tiny.pt"}, data_root=tmp_path)
    x = torch.rand(2, 3, 2, 2)
    with torch.no_grad():
        assert torch.allclose(tiny(x), scripted(x))
    one_line_error(lambda: M.build_model({"name": "checkpoint", "path": "r20.th"}, data_root=tmp_path),
                   "not a TorchScript file")


def test_checkpoint_of_a_zoo_model_and_its_errors(tmp_path):
    """The state dict of a built zoo model (``net.*`` plus its normalization) loads as it was saved; a misfit names
    missing and unexpected keys; an arch no state dict loads into, and a pickled whole model, are one line."""
    src = M.build_model({"name": "cifar_resnet20", "pretrained": False})
    torch.nn.init.normal_(src.net.conv1.weight)
    src.mean.fill_(0.3)
    torch.save(src.state_dict(), tmp_path / "zoo.pt")
    got = M.build_model({"name": "checkpoint", "path": str(tmp_path / "zoo.pt"), "arch": "cifar_resnet20"})
    assert_same_weights(got, src)
    msg = one_line_error(lambda: M.build_model({"name": "checkpoint", "path": str(tmp_path / "zoo.pt"),
                                                "arch": "cifar_resnet32"}), "does not fit the architecture")
    assert "keys missing (net.layer1.3." in msg or "keys missing" in msg, msg
    torch.save({"state_dict": src.net.state_dict()}, tmp_path / "bare.pt")
    msg = one_line_error(lambda: M.build_model({"name": "checkpoint", "path": str(tmp_path / "bare.pt"),
                                                "arch": "digits_mlp"}), "does not fit the architecture")
    assert "keys missing (" in msg and "unexpected keys (conv1.weight" in msg, msg
    torch.save(src, tmp_path / "whole.pt")  # a pickled module, refused by weights_only loading
    msg = one_line_error(lambda: M.build_model({"name": "checkpoint", "path": str(tmp_path / "whole.pt"),
                                                "arch": "cifar_resnet20"}), "cannot read checkpoint")
    assert "\x1b" not in msg, msg


# ---------------------------------------------------------------- target labels

def target_call(mode, logits, y, seed, given=None):
    from blackboxbench.rng import Streams

    return TARGET_LABEL.get(mode)(logits, y, Streams(seed, len(y), "cpu").view(torch.arange(len(y))), given)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 10, generator=g)
    y = torch.randint(0, 10, (256,), generator=g)
    y[:64] = logits[:64].argmax(1)   # correctly classified
    y[64:96] = logits[64:96].argmin(1)  # y is the least likely
    return logits, y


@pytest.mark.parametrize("mode", TARGET_LABEL.names())
def test_target_modes_invariants(batch, mode):
    logits, y = batch
    given = (y + 1) % 10
    t = target_call(mode, logits, y, 1, given)
    assert t.dtype == torch.long and t.shape == y.shape and 0 <= t.min() and t.max() < 10
    if mode == "specified":
        assert torch.equal(t, given)
    else:
        assert not (t == y).any(), f"{mode} returned the true label"
    again = target_call(mode, logits, y, 1, given)
    assert torch.equal(t, again)


def test_target_modes_definitions(batch):
    logits, y = batch
    assert set(TARGET_LABEL.names()) >= {"random", "least_likely", "most_likely", "median", "specified"}
    ll, ml, med = (target_call(m, logits, y, 0) for m in ("least_likely", "most_likely", "median"))
    keep = logits.argmin(1) != y
    assert torch.equal(ll[keep], logits.argmin(1)[keep])
    assert torch.equal(ll[~keep], logits.argsort(dim=1)[~keep, 1])  # the next lowest when argmin is y
    assert torch.equal(ml[:64], logits[:64].argsort(dim=1, descending=True)[:, 1])
    others_above = (logits > logits.gather(1, med[:, None])).sum(1) - (logits.gather(1, y[:, None])[:, 0]
                                                                         > logits.gather(1, med[:, None])[:, 0]).long()
    assert (others_above == 4).all()  # the median of the 9 classes other than y
    r = torch.cat([target_call("random", logits, y, s) for s in range(8)])
    counts = torch.bincount(r - (r > y.repeat(8)).long(), minlength=9)  # rank among the other classes
    assert counts.min() > 0.7 * len(r) / 9  # roughly uniform over the 9 others


def test_target_specified():
    logits, y = torch.randn(4, 10), torch.tensor([0, 3, 5, 3])
    spec = TARGET_LABEL.get("specified")
    gen = torch.Generator()
    assert spec(logits, y, gen, None, label=3).tolist() == [3, 3, 3, 3]  # y == 3 rows: the runner skips them
    assert spec(logits, y, gen, torch.tensor([1, 2, 3, 4])).tolist() == [1, 2, 3, 4]
    one_line_error(lambda: spec(logits, y, gen, None), "set label")
    one_line_error(lambda: spec(logits, y, gen, None, label=10), "[0, 10)")
    one_line_error(lambda: spec(logits, y, gen, None, label=-1), "[0, 10)")
    one_line_error(lambda: spec(logits, y, gen, torch.tensor([1, 2, 3])), "4 class ids")


def test_target_ranks_break_ties_by_class_id():
    """Quantized scores (a TFLite model's clamped probabilities) tie: the ranked modes then order tied classes by
    class id, lower first, whatever the sort does internally; odd K: median is rank (K - 2) // 2 of the others."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (16, 51), generator=g).float()
    y = torch.randint(0, 51, (16,), generator=g)
    ranked = [sorted((c for c in range(51) if c != int(y[i])), key=lambda c: (-float(logits[i, c]), c))
              for i in range(16)]
    ll, ml, med = (target_call(m, logits, y, 0).tolist() for m in ("least_likely", "most_likely", "median"))
    assert ll == [r[-1] for r in ranked] and ml == [r[0] for r in ranked] and med == [r[24] for r in ranked]


def test_random_target_of_a_sample_does_not_depend_on_its_batch():
    """Each sample draws from its own stream: its random target is the same alone, in a batch, or in another
    order of the batch."""
    from blackboxbench.rng import Streams

    logits, y = torch.zeros(8, 10), torch.arange(8) % 10
    fn = TARGET_LABEL.get("random")

    def targets(idx):
        idx = torch.tensor(idx)
        return fn(logits[idx], y[idx], Streams(5, 8, "cpu").view(idx), None).tolist()

    whole = targets(range(8))
    assert [targets([i])[0] for i in range(8)] == whole
    assert targets([7, 2, 5]) == [whole[7], whole[2], whole[5]]
    assert len(set(whole)) > 1


def test_first_use_training_is_noted_on_a_terminal_only(tmp_path, monkeypatch):
    """Training on first use (a flow, a c-Glow, a tiny detector: minutes on a CPU) says so on a terminal's stderr,
    before and after, even under --quiet; never where stderr is not a terminal (logs, tests: one-line errors stay
    one line); a cache hit says nothing."""
    import io
    import sys

    from blackboxbench.prep.trained import cached

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path))
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cached("kind", "k1", lambda: {"a": torch.ones(2)})["a"].sum() == 2
    lines = term.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("training k1.pt on first use (cached in ") and \
        lines[1].startswith("trained k1.pt in "), lines
    cached("kind", "k1", lambda: 1 / 0)  # a hit: no training, no line
    assert len(term.getvalue().splitlines()) == 2
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    cached("kind", "k2", lambda: {"a": torch.ones(1)})
    assert plain.getvalue() == ""


def test_a_training_that_diverged_is_an_error_and_is_not_cached(tmp_path, monkeypatch):
    from blackboxbench.prep.trained import cached
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path))
    diverged = {"state": {"w": torch.tensor([1.0, float("nan")]), "steps": torch.tensor([3])}, "cos": torch.ones(1)}
    with pytest.raises(BenchError, match=r"training k\.pt ended with non-finite values in state\.w; nothing was "
                                         r"cached"):
        cached("kind", "k", lambda: diverged)
    assert not (tmp_path / "kind" / "k.pt").exists()
    with pytest.raises(BenchError, match=r"non-finite values in 1; nothing"):  # an infinity diverged as well
        cached("kind", "k", lambda: [torch.ones(1), torch.tensor([float("-inf")]), torch.tensor([5])])
    assert not (tmp_path / "kind" / "k.pt").exists()
    assert cached("kind", "k", lambda: {"w": torch.tensor([1.0, 2.0])})["w"].sum() == 3


LOCK_SCRIPT = """
import sys, time
from pathlib import Path
import torch
from blackboxbench.prep.trained import cached
log, role = Path(sys.argv[1]), sys.argv[2]
started = log.with_name("started")
if role == "second":  # ask once the first process is training (and holds the file's lock)
    while not started.exists():
        time.sleep(0.05)

def train():
    started.touch()
    with log.open("a") as f:
        f.write(role + "\\n")
    time.sleep(2)
    return {"w": torch.full((2,), 7.0)}

print(cached("locktest", "k", train)["w"].tolist())
"""


def test_two_processes_train_a_cache_file_once(tmp_path, monkeypatch):
    """Two processes (a sweep's workers, xdist's) ask for one uncached artifact: the second asks while the first
    trains it, waits for the first's lock (``models.training_lock``), then loads the file instead of training it
    again (without the lock it trained a second time)."""
    import subprocess
    import sys

    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "trained.log"
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_SCRIPT, str(log), role], cwd=Path(M.__file__).parents[2],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for role in ("first", "second")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1000:] for _, err in outs]
    assert log.read_text().split() == ["first"]
    assert [out.strip() for out, _ in outs] == ["[7.0, 7.0]"] * 2
    assert sorted(p.name for p in (tmp_path / "cache" / "locktest").iterdir()) == ["k.pt"]
