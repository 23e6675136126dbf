"""The data root's small CIFAR-10/MNIST classifiers as zoo entries (blackboxbench/prep/small_models.py): each
loads its checkpoint and reproduces the clean accuracy the data README measured (within 1 pp); the adversarially
trained ones carry ``defense="at"``; a missing file is a one-line error."""
import pytest
import torch

from blackboxbench.errors import BenchError
from blackboxbench.prep.data import cifar10, mnist
from blackboxbench.prep.models import build_model
from blackboxbench.prep.small_models import ADVERSARIALLY_TRAINED, ENTRIES, MEASURED
from blackboxbench.registry import MODEL

SHAPES = {"cifar10": (3, 32, 32), "mnist": (1, 28, 28)}


@pytest.fixture(scope="module")
def datasets(data_root):
    return {"cifar10": cifar10(data_root), "mnist": mnist(data_root)}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_clean_accuracy_matches_the_data_readme(name, data_root, datasets):
    data = datasets[MODEL.get(name).registry_meta["dataset"]]
    model = build_model(name, data_root)
    with torch.no_grad():
        acc = (model(data.x).argmax(1) == data.y).double().mean().item() * 100
    assert abs(acc - MEASURED[name]) <= 1.0, (name, acc, MEASURED[name])


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_builds_without_weights_and_tags_adversarial_training(name, tmp_path):
    meta = MODEL.get(name).registry_meta
    model = build_model({"name": name, "pretrained": False}, tmp_path)
    assert model(torch.rand(2, *SHAPES[meta["dataset"]])).shape == (2, 10)
    assert meta["defense"] == ("at" if name in ADVERSARIALLY_TRAINED else None)


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(BenchError, match=r"missing checkpoint .*cifar_resnet4b_adv\.pth"):
        build_model("cifar_resnet4b_adv", tmp_path)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", b"PK\x03\x04" + bytes(range(200))])
def test_unreadable_checkpoint_is_one_line(tmp_path, content):
    """A truncated or foreign file where a checkpoint should be: one line naming it, whatever torch.load raises."""
    from blackboxbench.prep.models import load_state
    path = tmp_path / "model.pth"
    path.write_bytes(content)
    with pytest.raises(BenchError, match=rf"cannot read checkpoint {path}: not a PyTorch / safetensors state dict"):
        load_state(path)


def test_state_dict_keys_are_the_checkpoints(data_root):
    from blackboxbench.prep.models import load_state
    from blackboxbench.prep.data import data_path

    for name, (folder, file, *_rest) in ENTRIES.items():
        sd = load_state(data_path(data_root, f"{folder}/{file}"))
        assert set(build_model(name, data_root).net.state_dict()) == set(sd), name
