"""Inference copies of the models a run only forwards (prep/inference.py; the config's ``fuse``): same logits as
the model as built (the independent reference), BatchNorm folded, the model itself untouched, and the model kept
whenever the copy would change what the attack sees."""

import pytest
import torch
from torch import nn

from blackboxbench.config import load_config
from blackboxbench.prep.inference import inference_copy
from blackboxbench.prep.models import Normalized, build_model
from blackboxbench.registry import MODEL
from blackboxbench.runner import Session, run_experiment

DIGITS = [n for n in MODEL.names() if n.startswith("digits_")]


def batchnorms(model):
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def conv_bn_net(view=False):
    """Conv-BN-ReLU twice with non-trivial running statistics and affine terms, then a linear head; ``view``
    flattens with ``.view``, which a channels-last activation cannot do."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8),
                                      nn.ReLU())
            self.head = nn.Linear(8 * 4 * 4, 5)

        def forward(self, x):
            h = self.body(x)
            return self.head(h.view(len(h), -1) if view else h.flatten(1))

    net = Net()
    for bn in (net.body[1], net.body[4]):
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.2, 3)
        bn.weight.data.uniform_(0.5, 2), bn.bias.data.uniform_(-1, 1)
    return Normalized(net, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))


def test_copy_folds_batchnorm_and_keeps_logits():
    model = conv_bn_net()
    x = torch.rand(32, 3, 8, 8)
    with torch.no_grad():
        before = model(x)
        fast = inference_copy(model, x[:4])
        assert fast is not model and batchnorms(fast) == 0 and isinstance(fast, Normalized)
        torch.testing.assert_close(fast(x), before, rtol=1e-4, atol=1e-5)
        assert batchnorms(model) == 2 and torch.equal(model(x), before)  # the model itself is untouched
    assert not any(p.requires_grad for p in fast.parameters()) and not fast.training


@pytest.mark.parametrize("name", DIGITS)
def test_every_digits_model(name):
    model = build_model(name)
    x = torch.rand(64, 1, 8, 8)
    fast = inference_copy(model, x[:4], name)
    assert fast is not model and batchnorms(fast) == 0 and fast.arch_id == model.arch_id
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)


def residual_net():
    """Conv-BN, ReLU, a residual addition and the cases the in-place rewrite must leave alone: a ReLU of a view
    (``h[:, :4]``), a ReLU of a tensor read twice, and an addition to a graph input."""
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
            self.relu = nn.ReLU()
            self.head = nn.Linear(8 + 4 + 8, 5)

        def forward(self, x):
            h = self.relu(self.bn1(self.conv1(x)))         # fresh, read once: in place
            r = torch.relu(self.bn2(self.conv2(h)) + h)    # residual add and ReLU: both in place
            v = torch.relu(r[:, :4])                        # a view of r: not in place (r is read again below)
            twice = self.conv3(r)
            w = torch.relu(twice) + twice                   # read twice: neither in place
            e = x.mean(1, keepdim=True) + 1.0               # not a fresh module output: not in place
            feats = torch.cat([r.mean((2, 3)), v.mean((2, 3)), (w * e).mean((2, 3))], 1)
            return self.head(feats)

    net = Net()
    for bn in (net.bn1, net.bn2):
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.2, 3)
    return net.eval()


def test_in_place_rewrite_is_bit_identical_and_leaves_views_and_shared_tensors():
    model = residual_net()
    x = torch.rand(16, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)
    fast = inference_copy(model, x[:4])
    graph = fast.graph
    in_place = [n for n in graph.nodes if n.target in (torch.relu_, "add_")]
    assert len(in_place) == 3  # the block's ReLU, the residual add and the ReLU after it
    for n in in_place:  # each writes a tensor nobody else reads
        assert len(n.args[0].users) == 1
    # the view, the tensor read twice and the graph input's addition stay out of place
    assert sum(n.target is torch.relu for n in graph.nodes) == 2
    with torch.no_grad():
        plain = inference_copy(model, x[:4], in_place_ops=False)
        assert not any(n.target in (torch.relu_, "add_") for n in plain.graph.nodes)
        assert torch.equal(fast(x), plain(x))  # bit-identical to the folded copy without the rewrite
        torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-5)
        assert torch.equal(model(x), ref)  # the model as built is untouched


def test_in_place_leaves_hooked_modules():
    """A ReLU module with a forward hook keeps being called as a module in the copy, so its hook still runs."""
    model = residual_net()
    calls = []
    model.relu.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    x = torch.rand(8, 3, 8, 8)
    fast = inference_copy(model, x[:4])
    assert any(n.op == "call_module" and n.target == "relu" for n in fast.graph.nodes)
    calls.clear()
    with torch.no_grad():
        fast(x)
    assert calls == [torch.Size([8, 8, 8, 8])]


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small", "densenet121"])
def test_in_place_on_torchvision_architectures(arch):
    """Residual, inverted-residual (hardswish, squeeze-excitation) and dense-concatenation graphs: the rewrite
    finds in-place work in each and the copy stays bit-identical to the folded copy without it."""
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=10).eval()
    x = torch.rand(6, 3, 32, 32)
    fast = inference_copy(model, x[:4], arch)
    assert sum(n.target in (torch.relu_, "add_") for g in fast.modules() if isinstance(g, torch.fx.GraphModule)
               for n in g.graph.nodes) > 0
    with torch.no_grad():
        plain = inference_copy(model, x[:4], arch, in_place_ops=False)
        assert torch.equal(fast(x), plain(x))
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)


def test_in_place_rewrite_that_cannot_run_is_dropped():
    """An addition whose in-place form fails (the first operand would have to broadcast) keeps the folded copy."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
            self.pool = nn.Conv2d(4, 4, 8)  # (N, 4, 1, 1)
            self.head = nn.Linear(4 * 8 * 8, 3)

        def forward(self, x):
            h = self.bn(self.conv(x))
            return self.head((self.pool(h) + h).flatten(1))  # (N, 4, 1, 1) + (N, 4, 8, 8): add_ cannot run

    model = Net().eval()
    x = torch.rand(8, 3, 8, 8)
    fast = inference_copy(model, x[:4])
    assert fast is not model and not any(n.target == "add_" for n in fast.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)


def test_model_kept_when_the_copy_cannot_run(capsys):
    model = conv_bn_net(view=True)  # .view of a channels-last activation raises
    assert inference_copy(model, torch.rand(4, 3, 8, 8), "viewnet") is model
    assert "fuse: viewnet kept as built (RuntimeError" in capsys.readouterr().err


def test_model_that_cannot_be_copied_is_kept(capsys):
    class Handle:  # e.g. a plugin model holding a native runtime or an open file
        def __deepcopy__(self, memo):
            raise TypeError("cannot pickle 'Handle' object")

    model = conv_bn_net()
    model.handle = Handle()
    assert inference_copy(model, torch.rand(4, 3, 8, 8), "native") is model
    assert "fuse: native kept as built (TypeError: cannot pickle" in capsys.readouterr().err


def test_randomized_model_kept(capsys):
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = conv_bn_net()

        def forward(self, x):
            return self.net(x + 0.3 * torch.randn_like(x))

    model = Noisy()
    assert inference_copy(model, torch.rand(4, 3, 8, 8), "noisy") is model
    assert capsys.readouterr().err == ""  # the runner flags randomized models itself


def test_copy_that_changes_logits_is_refused(capsys, monkeypatch):
    """A fold that changed the model (simulated: the copy's BatchNorm statistics are lost) is caught by the probe
    check."""
    import blackboxbench.prep.inference as inf

    def broken(module):
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.reset_running_stats()
        return module

    monkeypatch.setattr(inf, "_fold", broken)
    model = conv_bn_net()
    assert inference_copy(model, torch.rand(4, 3, 8, 8), "broken") is model
    assert "fuse: broken kept as built (logits differ by" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["nan", "raises"])
def test_models_the_run_refuses_are_left_to_the_run(capsys, bad):
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = conv_bn_net()

        def forward(self, x):
            if bad == "raises":
                raise RuntimeError("wrong input shape")
            return self.net(x) * float("nan")

    model = Bad()
    assert inference_copy(model, torch.rand(4, 3, 8, 8), "bad") is model
    assert capsys.readouterr().err == ""


def test_cifar_models_fold(data_root):
    import numpy as np

    d = np.load(data_root / "cifar10" / "cifar10_test_first100.npz")
    x = torch.tensor(d["x"][:32]).permute(0, 3, 1, 2).float().div(255)
    for name, bns in (("cifar_resnet20", 19), ("cifar_resnet4b_adv", 0)):
        model = build_model(name, data_root=data_root)
        fast = inference_copy(model, x[:4], name)
        assert batchnorms(model) == bns and batchnorms(fast) == 0
        with torch.no_grad():
            ref, out = model(x), fast(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(out.argmax(1), ref.argmax(1))


CFG = """
dataset: {name: digits, n: 12}
MODELS
attack: ATTACK
threat: {norm: linf, eps: 0.2BUDGET}
batch_size: 6
device: cpu
output_dir: OUT
FUSE
"""


@pytest.mark.parametrize("fuse", ["", "fuse: false"])
def test_runner_fuses_only_forward_only_models(tmp_path, fuse):
    """A query run's target and a transfer run's targets are inference copies (unless ``fuse: false``); a transfer
    run's surrogates, which are differentiated and hooked, never are."""
    for attack, models in (("square_linf", "model: digits_resnet"),
                           ("i_fgsm", "surrogates: [digits_resnet]\ntargets: [digits_resnet]")):
        text = CFG.replace("MODELS", models).replace("ATTACK", attack).replace("FUSE", fuse)
        text = text.replace("BUDGET", ", max_queries: 100" if attack == "square_linf" else "")
        path = tmp_path / f"{attack}.yaml"
        path.write_text(text.replace("OUT", str(tmp_path / attack)))
        (exp,), _ = load_config(path)
        session = Session()
        run_experiment(exp, session=session, progress=False)
        folded = sorted(batchnorms(m) == 0 for m in session.models.values())
        if fuse:
            assert folded == [False]  # one model, as built, shared by every role
        elif attack == "square_linf":
            assert folded == [False, True]  # built once, then its copy for the oracle
        else:
            assert folded == [False, True]  # the surrogate as built; the target's copy
