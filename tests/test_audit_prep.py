"""Audit of blackboxbench/prep (trained.py, assets.py, small_models.py, tflite.py): what decides a cache key, the
in-process reuse of trained networks, the train/eval overlap check, the asset loaders, the small models' layout
and normalization against the data README, and the TFLite wrapper's input handling. Tiny hand-built inputs; the
data-root checks skip without it."""
import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blackboxbench.errors import BenchError
from blackboxbench.prep import trained
from blackboxbench.prep.assets import tensors_asset, train_images
from blackboxbench.prep.data import Dataset
from blackboxbench.prep.trained import augment, cache_key, digest, shared_images


def images(n, c=1, size=4, start=0.0):
    return torch.arange(n * c * size * size, dtype=torch.float32).view(n, c, size, size) / 100 + start


def labelled(x):
    return Dataset("d", x, torch.arange(len(x)) % 10, 10)


# ------------------------------------------------------------------------------------------- digest, keys ----

def test_digest_tells_apart_what_a_training_differs_by():
    assert len(digest()) == 24 and digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})
    pairs = [({"a": 1}, {"b": 1}),  # the key, not only the value
             ({"a": 1, "b": 2}, {"a": 1, "b": 3}),  # every entry
             ([[1], 2], [[1, 2]]), ([1, [2]], [[1], 2]),  # nesting
             (1, "1"), (torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)),
             (torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([1.0, 3.0], dtype=torch.bfloat16))]
    big = torch.zeros(5000)
    pairs.append(({"w": big}, {"w": big.index_fill(0, torch.tensor([2500]), 1.0)}))  # hidden in a repr's "..."
    for a, b in pairs:
        assert digest(a) != digest(b), (a, b)


def test_cache_key_follows_the_version_images_buffers_and_device_type(monkeypatch):
    net, data = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), labelled(images(3))
    key = cache_key("b", {"lr": 0.1}, net, data, 3, "cpu")
    assert key == cache_key("b", {"lr": 0.1}, (net,), data, np.int64(3), torch.device("cpu"))
    assert cache_key("b", {}, net, data, 0, "cuda:0") == cache_key("b", {}, net, data, 0, "cuda:1") \
        != cache_key("b", {}, net, data, 0, "cpu")
    other = labelled(images(3))
    other.x[2, 0, 1, 1] += 1e-3
    bn = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    bn.load_state_dict(net.state_dict())
    bn[1].running_mean += 1  # a buffer, not a parameter
    keys = {key, cache_key("b", {"lr": 0.1}, net, other, 3, "cpu"), cache_key("b", {"lr": 0.1}, bn, data, 3, "cpu"),
            cache_key("b", {"lr": 0.1}, [net, net], data, 3, "cpu")}
    monkeypatch.setattr(trained, "CACHE_VERSION", trained.CACHE_VERSION + 1)
    keys.add(cache_key("b", {"lr": 0.1}, net, data, 3, "cpu"))
    assert len(keys) == 5


def test_cache_key_tells_apart_the_same_bytes_in_another_shape_or_dtype():
    """``digest`` hashes a tensor's bytes; two trainings whose images (or weights) hold the same bytes in another
    layout or dtype are still two trainings, with two keys."""
    net = nn.Linear(2, 2)
    x = images(4, size=6)
    keys = {cache_key("b", {}, net, labelled(x), 0, "cpu"),
            cache_key("b", {}, net, labelled(x.reshape(4, 1, 4, 9)), 0, "cpu"),
            cache_key("b", {}, net, labelled(x.view(torch.int32)), 0, "cpu")}
    wide = nn.Linear(2, 2)  # the same weights' bytes as a 4 x 1 matrix
    wide.weight, wide.bias = nn.Parameter(net.weight.detach().reshape(4, 1).clone()), net.bias
    keys.add(cache_key("b", {}, wide, labelled(x), 0, "cpu"))
    assert len(keys) == 4


def test_cached_trains_once_and_then_reads_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path))
    first = trained.cached("k", "abc", lambda: {"w": torch.ones(2)})
    again = trained.cached("k", "abc", lambda: pytest.fail("trained again"))
    assert torch.equal(first["w"], again["w"]) and (tmp_path / "k" / "abc.pt").is_file()


# ----------------------------------------------------------------------------------------- once_per_run ----

class NoWeakref:
    __slots__ = ()
    gone = []

    def __del__(self):
        NoWeakref.gone.append(1)


def test_once_per_run_keeps_the_last_eight_keys_and_holds_an_owner_it_cannot_watch(monkeypatch):
    monkeypatch.setattr(trained, "_RUN", {})
    owners = [1000 + i for i in range(9)]  # ints: not weakly referenceable, held with the value
    built = []
    for i in range(9):
        trained.once_per_run(("k", i), owners[i], lambda i=i: built.append(i) or i)
    assert [trained.once_per_run(("k", i), owners[i], lambda: "rebuilt") for i in range(1, 9)] == list(range(1, 9))
    assert trained.once_per_run(("k", 0), owners[0], lambda: "rebuilt") == "rebuilt"  # the oldest went
    assert built == list(range(9))
    NoWeakref.gone.clear()
    trained.once_per_run("kept", NoWeakref(), lambda: 1)
    gc.collect()
    assert NoWeakref.gone == []  # its id stays its own while the key is remembered


def fake_ctx(asset, x_eval, pool=None):
    return SimpleNamespace(assets={"train": asset}, device=torch.device("cpu"), pool=pool,
                           problem=SimpleNamespace(x=x_eval))


def test_trained_model_per_block_and_params_frozen_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(trained, "_RUN", {})
    asset = labelled(images(4))
    ctx, calls = fake_ctx(asset, images(2, start=5.0)), []

    def train(x):
        calls.append(x)
        return {"state": {"1.weight": torch.full((1, 16), float(len(calls))), "1.bias": torch.zeros(1)}}

    def make(shape):
        return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(shape)), 1))

    a = trained.trained_model(ctx, "a", "kind", "train", {"seed": 0}, make, train)
    assert torch.equal(calls[0], asset.x) and not a.training and not any(p.requires_grad for p in a.parameters())
    assert trained.trained_model(ctx, "a", "kind", "train", {"seed": 0}, make, train) is a
    b = trained.trained_model(ctx, "b", "kind", "train", {"seed": 0}, make, train)
    c = trained.trained_model(ctx, "a", "kind", "train", {"seed": 1}, make, train)
    assert len(calls) == 3 and len({float(m[1].weight[0, 0]) for m in (a, b, c)}) == 3
    assert len(list((tmp_path / "kind").glob("*.pt"))) == 3
    monkeypatch.setattr(trained, "_RUN", {})  # a later run: read from the disk cache, not trained
    again = trained.trained_model(ctx, "a", "kind", "train", {"seed": 1}, make, lambda x: pytest.fail("retrained"))
    assert torch.equal(again[1].weight, c[1].weight)
    with pytest.raises(BenchError, match="holds 1 x 4 x 4 images, the run's are 1 x 8 x 8"):
        trained.trained_model(fake_ctx(asset, images(2, size=8)), "d", "kind", "train", {"seed": 0}, make, train)


# ------------------------------------------------------------------------------------------ overlap check ----

def test_shared_images_counts_exact_copies_only():
    x = images(3, start=0.3)
    assert shared_images(x, torch.stack([x[2], x[0] + 1e-6, x[0]])) == 2
    assert shared_images(x, x[1:2]) == 1 and shared_images(x[:1], x[1:]) == 0


def test_train_data_rejects_a_single_evaluation_image(monkeypatch):
    x = images(5, start=0.3)
    asset = labelled(x)
    assert trained.train_data(fake_ctx(asset, x, SimpleNamespace(x=x[5:] + 1)), "blk", "train") is asset
    assert trained.train_data(fake_ctx(asset, images(2, size=8)), "blk", "train") is asset  # any size by default
    with pytest.raises(BenchError, match="'blk': 1 of the 5 images of asset 'train' are evaluation images"):
        trained.train_data(fake_ctx(asset, x, SimpleNamespace(x=torch.cat([x[3:4], x[:1] + 1]))), "blk", "train")


# ------------------------------------------------------------------------------------------------ augment ----

def crop_offsets(out, x, pad):
    """(row offset, column offset, flipped) of each output image among the crops of the zero-padded input."""
    padded, h, w = F.pad(x, (pad,) * 4), x.shape[2], x.shape[3]
    found = []
    for i in range(len(x)):
        hits = [(r, c, f) for r in range(2 * pad + 1) for c in range(2 * pad + 1) for f in (False, True)
                if torch.equal(out[i], (lambda k: k.flip(2) if f else k)(padded[i, :, r:r + h, c:c + w]))]
        assert hits, i
        found.append(hits[0])
    return found


def test_augment_default_pad_is_an_eighth_and_covers_every_offset_and_both_flips():
    x = images(200, c=1, size=16) + 1  # no zero pixel: padding shows
    found = crop_offsets(augment(x, torch.Generator().manual_seed(0)), x, pad=2)
    assert {r for r, _, _ in found} == {c for _, c, _ in found} == set(range(5))
    assert 60 < sum(f for _, _, f in found) < 140


# ------------------------------------------------------------------------------------------------- assets ----

def test_tensors_asset_loads_a_tensor_or_a_dict_onto_the_device(tmp_path):
    torch.save(torch.ones(2), tmp_path / "one.pt")
    torch.save({"a": torch.zeros(1), "b": 3}, tmp_path / "mixed.pt")
    np.savez(tmp_path / "arr.npz", m=np.arange(3))
    one = tensors_asset(None, "meta", path=str(tmp_path / "one.pt"))
    assert list(one) == ["tensor"] and one["tensor"].device.type == "meta"
    assert torch.equal(tensors_asset(None, "cpu", path=str(tmp_path / "arr.npz"))["m"], torch.arange(3))
    with pytest.raises(BenchError, match="must hold tensors only"):
        tensors_asset(None, "cpu", path=str(tmp_path / "mixed.pt"))
    with pytest.raises(BenchError, match="is a directory, not a file"):
        tensors_asset(None, "cpu", path=str(tmp_path))


def test_train_images_names_its_spec_leaves_it_alone_and_moves_to_the_device():
    spec = {"name": "digits", "split": "train", "n": 5}
    data = train_images(None, "meta", spec=spec)
    assert spec == {"name": "digits", "split": "train", "n": 5}
    assert data.name == "digits n=5 split=train" and data.x.device.type == data.y.device.type == "meta"


def test_default_train_images_are_not_the_evaluation_images(data_root):
    from blackboxbench.registry import DATASET

    data = train_images(data_root, "cpu")
    assert "cifar10_test_sdp200.npz" in data.name and len(data.y) == 200
    evaluated = DATASET.get("cifar10")(data_root, file="cifar10/cifar10_test_first100.npz")
    assert len(evaluated.y) == 100 and shared_images(data.x, evaluated.x) == 0


# ------------------------------------------------------------------------------------------- small models ----

README = {  # data README, models/abcrown_small_cifar_mnist and advertorch_mnist_lenet5: (mean, std, PGD-trained)
    "cifar_resnet2b_adv": ((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616), True),
    "cifar_resnet4b_adv": ((0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616), True),
    **{f"cifar_cnn_a_{v}": ((125.3 / 255, 123.0 / 255, 113.9 / 255), (63.0 / 255, 62.1 / 255, 66.7 / 255), True)
       for v in ("adv", "adv4", "adv_alt", "mix", "mix4")},
    **{f"oval_cifar_{v}": ((0.485, 0.456, 0.406), (0.225,) * 3, False) for v in ("base", "wide", "deep")},
    "eran_cifar_conv_small_pgd": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010), True),
    "cifar_conv_small_sigmoid": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010), False),
    **{f"marabou_cifar_{v}": (None, None, False) for v in ("small", "medium", "large")},
    "mnist_cnn_a_adv": (None, None, True),
    "eran_mnist_conv_small_nat": ((0.1307,), (0.3081,), False),
    "mnist_madrycnn_no_maxpool_tiny": (None, None, False),
    "mnist_lenet5_clntrained": (None, None, False),
    "mnist_lenet5_advtrained": (None, None, True),
}


@pytest.mark.parametrize("name", sorted(README))
def test_small_model_normalization_and_tag_are_the_data_readmes(name):
    from blackboxbench.prep.models import build_model
    from blackboxbench.registry import MODEL

    mean, std, adv = README[name]
    model = build_model({"name": name, "pretrained": False})
    assert not model.training  # a fixed target
    for got, want in ((model.mean, mean), (model.std, std)):
        assert (got is None) if want is None else torch.allclose(got.flatten(), torch.tensor(want))
    assert MODEL.get(name).registry_meta["defense"] == ("at" if adv else None)


def test_a_directory_where_the_checkpoint_should_be_is_a_missing_checkpoint(tmp_path):
    from blackboxbench.prep.models import build_model

    (tmp_path / "models/abcrown_small_cifar_mnist/cifar_resnet2b_adv.pth").mkdir(parents=True)
    with pytest.raises(BenchError, match=r"^missing checkpoint .*cifar_resnet2b_adv\.pth$"):
        build_model("cifar_resnet2b_adv", tmp_path)


def test_conv_stack_ends_with_the_logits_layer():
    """No activation after the last Linear: the logits take any sign (a ReLU there flattens the margins)."""
    from blackboxbench.prep.small_models import CIFAR, CNN_A, conv_stack

    net = conv_stack(CIFAR, *CNN_A)
    assert isinstance(net[-1], nn.Linear) and [type(m).__name__ for m in net][:5] == \
        ["Conv2d", "ReLU", "Conv2d", "ReLU", "Flatten"] and net[5].in_features == 32 * 8 * 8


# ------------------------------------------------------------------------------------------------- tflite ----

def test_tflite_clamps_to_the_unit_range_and_keeps_the_background_column(data_root):
    pytest.importorskip("ai_edge_litert.interpreter", reason="ai-edge-litert is not installed")
    from blackboxbench.prep.models import build_model

    model = build_model("tflite:mobilenet_v1_0.25_128_quant", data_root)
    x = torch.rand(2, 3, 128, 128, generator=torch.Generator().manual_seed(0)) * 1.6 - 0.3
    with torch.no_grad():
        assert torch.equal(model(x), model(x.clamp(0, 1)))
        whole = build_model({"name": "tflite", "arch": "mobilenet_v1_0.25_128_quant", "background": False},
                            data_root)(x)
    assert whole.shape == (2, 1001) and torch.equal(whole[:, 1:], model(x))
