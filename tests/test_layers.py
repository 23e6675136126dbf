"""Layer maps (blackboxbench/prep/layers.py) and the CIFAR ResNet's named ReLU / shortcut / merge modules.

The refactored CIFAR ResNet is checked against an independent functional forward written here from the state
dict (F.relu, the option-A pad, the inline sum), bit for bit, and its state-dict keys against the akamaster
checkpoint's. The layer maps are checked per architecture family: names, roles, that a forward hook on a named
layer sees the tensor the architecture computes there, and the one-line error for an unknown name.
"""
import glob

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blackboxbench.errors import BenchError
from blackboxbench.prep.cifar_resnet import CifarResNet
from blackboxbench.prep.layers import FeatureTap, get_layer, layer_map
from blackboxbench.prep.models import build_model
from blackboxbench.prep.small_models import Block, SmallResNet


def _bn(sd, p, x):
    return F.batch_norm(x, sd[p + ".running_mean"], sd[p + ".running_var"], sd[p + ".weight"], sd[p + ".bias"],
                        False, 0.0, 1e-5)


def functional_resnet(sd, x, n, collect=None):
    """The CIFAR ResNet forward from its state dict alone (the pre-refactor functional form)."""
    out = F.relu(_bn(sd, "bn1", F.conv2d(x, sd["conv1.weight"], padding=1)))
    planes = 16
    for s, width in enumerate((16, 32, 64), 1):
        for j in range(n):
            p = f"layer{s}.{j}"
            stride = 2 if (s > 1 and j == 0) else 1
            h = F.relu(_bn(sd, p + ".bn1", F.conv2d(out, sd[p + ".conv1.weight"], stride=stride, padding=1)))
            h = _bn(sd, p + ".bn2", F.conv2d(h, sd[p + ".conv2.weight"], padding=1))
            pad = width // 4 if (stride != 1 or planes != width) else 0
            skip = F.pad(out[:, :, ::2, ::2], (0, 0, 0, 0, pad, pad)) if pad else out
            out = F.relu(h + skip)
            planes = width
        if collect is not None:
            collect[f"stage{s}"] = out
    return F.linear(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1), sd["linear.weight"], sd["linear.bias"])


def _randomized(net, seed=0):
    """Random BN statistics too, so that the check covers them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
    return net.eval()


@pytest.mark.parametrize("depth", [20, 32])
def test_cifar_resnet_equals_functional_reference_bit_for_bit(depth):
    torch.manual_seed(depth)
    net = _randomized(CifarResNet(depth))
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    sd = net.state_dict()
    stages = {}
    with torch.no_grad():
        ref = functional_resnet(sd, x, (depth - 2) // 6, stages)
        taps = {s: FeatureTap(get_layer(net, s)) for s in stages}
        out = net(x)
    assert torch.equal(out, ref)
    for s, tap in taps.items():
        assert torch.equal(tap.out, stages[s]), s
        tap.close()
    assert not any(isinstance(v, torch.Tensor) and v.dim() == 0 and k.endswith(("pad",)) for k, v in sd.items())
    named = {type(m) for m in net.modules()}
    assert nn.ReLU in named and len([m for m in net.modules() if isinstance(m, nn.ReLU)]) == 1 + 2 * 3 * (depth - 2) // 6


def test_cifar_resnet_state_dict_keys_are_the_checkpoints(data_root):
    path = sorted(glob.glob(str(data_root / "models/akamaster_resnet_cifar10/resnet20-*.th")))[0]
    from blackboxbench.prep.models import load_state

    sd = load_state(path)
    keys = [k for k in CifarResNet(20).state_dict() if not k.endswith("num_batches_tracked")]
    assert keys == list(sd)  # same keys, same order (no new parameter or buffer)
    model = build_model("cifar_resnet20", data_root)
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        z = (x - model.mean) / model.std
        assert torch.equal(model(x), functional_resnet(model.net.state_dict(), z, 3))


def test_small_resnet_block_with_merge_module_is_unchanged():
    torch.manual_seed(0)
    for cin, cout, stride in ((8, 16, 2), (16, 16, 1)):
        b = Block(cin, cout, stride).eval()
        x = torch.randn(2, cin, 8, 8)
        with torch.no_grad():
            ref = F.relu(b.conv2(F.relu(b.conv1(x))) + b.shortcut(x))
            assert torch.equal(b(x), ref)
    assert list(SmallResNet(8, 1).state_dict()) == [k for k in SmallResNet(8, 1).state_dict()]
    assert not any("merge" in k for k in SmallResNet(16, 2).state_dict())


# ------------------------------------------------------------------------------------------ layer maps ----

def test_resnet_layer_map_names_roles_and_hooks():
    net = CifarResNet(20).eval()
    lm = layer_map(net)
    assert lm.roles == {"mid": "stage2", "late": "block3_0"}
    assert [n for n in lm.layers if n.startswith("stage")] == ["stage1", "stage2", "stage3"]
    assert {f"block{s}_{j}" for s in (1, 2, 3) for j in range(3)} <= set(lm.layers)
    assert lm.get("mid") is net.layer2 and lm.get("block3_0") is net.layer3[0] and lm.get("stem") is net.relu
    assert lm.get("layer2.1.relu1") is net.layer2[1].relu1  # any module path
    wrapped = build_model({"name": "cifar_resnet20", "pretrained": False})
    assert get_layer(wrapped, "block2_1") is wrapped.net.layer2[1]  # the zoo wrapper is looked through


@pytest.mark.parametrize("spec,stages,mid,late", [
    ("digits_cnn", 3, "stage2", "stage2"), ("digits_mlp", 1, "stage1", "stage1"),
    ("digits_lenet", 3, "stage2", "stage2"),
    ({"name": "oval_cifar_wide", "pretrained": False}, 3, "stage2", "stage2"),
    ({"name": "cifar_cnn_a_mix", "pretrained": False}, 3, "stage2", "stage2"),
    ({"name": "mnist_lenet5_clntrained", "pretrained": False}, 3, "stage2", "stage2"),
    ({"name": "marabou_cifar_small", "pretrained": False}, 4, "stage2", "stage3"),  # late: the second half
])
def test_plain_network_stages_are_its_activations(spec, stages, mid, late):
    model = build_model({"name": spec, "pretrained": False} if isinstance(spec, str) else spec)
    lm = layer_map(model)
    acts = [m for m in model.net.modules() if isinstance(m, (nn.ReLU, nn.Sigmoid))]
    assert [lm.layers[f"stage{k}"] for k in range(1, stages + 1)] == acts
    assert lm.roles["mid"] == mid and lm.roles["late"] == late
    shape = (2, 1, 8, 8) if "digits" in str(spec) else (2, 1, 28, 28) if "mnist" in str(spec) else (2, 3, 32, 32)
    x = torch.rand(shape)
    with FeatureTap(lm.get("mid")) as tap, torch.no_grad():
        model(x)
    assert tap.out is not None and (tap.out >= 0).all()  # a ReLU output


def test_small_resnets_and_torchvision_resnet_maps():
    two = layer_map(build_model({"name": "cifar_resnet2b_adv", "pretrained": False}))
    four = layer_map(build_model({"name": "cifar_resnet4b_adv", "pretrained": False}))
    assert two.roles == {"mid": "stage1", "late": "block1_0"} and four.roles == {"mid": "stage1", "late": "block2_0"}
    from torchvision.models.resnet import BasicBlock, ResNet

    tv = ResNet(BasicBlock, [1, 2, 2, 1])  # the torchvision ResNet layout (resnet18 is [2, 2, 2, 2])
    lm = layer_map(tv)
    assert lm.roles == {"mid": "stage2", "late": "block4_0"} and lm.get("block3_1") is tv.layer3[1]
    assert lm.get("stem") is tv.relu and "block4_1" not in lm.layers


def test_container_stages_are_its_activations_when_it_has_some():
    """A ``features`` container (VGG style): its activations are the stages; a ``blocks`` container without
    activations: its children; a one-child container is no layout (the activations anywhere are)."""
    class Net(nn.Module):
        def __init__(self, box, name="features"):
            super().__init__()
            setattr(self, name, box)
            self.head = nn.Sequential(nn.Flatten(), nn.ReLU())

    vgg = Net(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.MaxPool2d(2)))
    lm = layer_map(vgg)
    assert lm.layers == {"stage1": vgg.features[1], "stage2": vgg.features[3]}
    assert lm.roles == {"mid": "stage1", "late": "stage2"}
    plain = Net(nn.ModuleList([nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)]), "blocks")
    assert list(layer_map(plain).layers.values()) == list(plain.blocks)
    one = Net(nn.Sequential(nn.Conv2d(3, 3, 1)), "stages")
    assert layer_map(one).layers == {"stage1": one.head[1]}


def test_unknown_layer_is_one_line_listing_valid_names():
    with pytest.raises(BenchError) as e:
        get_layer(CifarResNet(20), "stag2")
    msg = str(e.value)
    assert "\n" not in msg and "did you mean: stage2" in msg and "valid names: mid, late, stem, stage1" in msg
    assert "block3_2" in msg
    with pytest.raises(BenchError, match="valid names: mid, late, layer0"):
        get_layer(build_model({"name": "digits_cnn", "pretrained": False}), "conv9")
