"""Feature-level (ILA, FIA, NAA), backprop-modification (SGM, LinBP) and surgery (IAA, GhostNet) transfer attacks:
blocks in blackboxbench/transfer/features.py and surgery.py, the ``auxiliary`` block kind of the pipeline, and
the recipes attacks/transfer/{ila,fia,naa,linbp,sgm,iaa,ghostnet}.yaml.

Each block is checked against an independent reference: per-sample loops over single-image forwards for the
auxiliary information, hand formulas (matrix products, separately differentiated branch and skip) for the
modified gradients, the closed form of each modified block's forward. The recipes are built from YAML through
the registries, run on small random networks (no data) and, with the offline data, on 16 CIFAR-10 images with
ResNet-20 as the surrogate and ResNet-56 as the target.
"""
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from blackboxbench.errors import BenchError
from blackboxbench.prep.cifar_resnet import CifarResNet
from blackboxbench.prep.layers import arch_id, get_layer, per_arch
from blackboxbench.prep.models import Normalized, arch_name, build_model, input_mean
from blackboxbench.registry import AUXILIARY, LOSS, REFINE, ParamError, check_params
from blackboxbench.rng import RowDraws, Streams, drawing_from
from blackboxbench.transfer.surgery import GhostAdd, GhostDropout, LinBPBlock, SkipGradientAdd, residual_blocks

from attack_utils import build as build_recipe
from attack_utils import check_output, correctly_classified, refine_ctx, transfer_ctx

RECIPE_DIR = Path(__file__).resolve().parent.parent / "attacks" / "transfer"
NEW = ["ila", "fia", "naa", "linbp", "sgm", "iaa", "ghostnet"]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def small_resnet(seed=0):
    """A random CIFAR-ResNet layout (one block per stage, 4/8/16 channels), random BN statistics, eval mode."""
    torch.manual_seed(seed)
    net = CifarResNet(blocks=1, widths=(4, 8, 16))
    g = gen(seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return net.eval().requires_grad_(False)


def images(n=4, seed=1, size=16):
    return torch.rand(n, 3, size, size, generator=gen(seed)), torch.arange(n) % 10


def ctx_for(model, x, y, seed=0, alpha=0.01, eps=0.05, iterations=3):
    return transfer_ctx(x, y, eps, "linf", None, model, alpha, seed, iterations)


def feats(model, layer, x):
    """Features of ``layer`` for each image forwarded alone (the per-sample reference)."""
    mod, out = get_layer(model, layer), []
    h = mod.register_forward_hook(lambda m, i, o: out.append(o))
    with torch.no_grad():
        for i in range(len(x)):
            model(x[i:i + 1])
    h.remove()
    return torch.cat(out)


def logit_grad_loop(model, layer, x, y):
    """d z_y / d f_layer per image, one image at a time."""
    mod, grads = get_layer(model, layer), []
    for i in range(len(x)):
        keep = []
        h = mod.register_forward_hook(lambda m, inp, o: keep.append(o))
        xi = x[i:i + 1].clone().requires_grad_(True)
        z = model(xi)[0, y[i]]
        h.remove()
        grads.append(torch.autograd.grad(z, keep[0])[0])
    return torch.cat(grads)


def unit(t):
    return t / t.flatten(1).norm(dim=1).view(-1, *([1] * (t.dim() - 1)))


# ------------------------------------------------------------------------------------------ ILA, FIA, NAA ----

def test_ila_baseline_and_projection_loss_match_a_hand_reference():
    net = small_resnet()
    x, y = images()
    ctx = ctx_for(net, x, y)
    aux = AUXILIARY.get("ila_baseline")(ctx, layer="stage2", iterations=3)
    try:
        xb = x.clone()  # the baseline: 3 I-FGSM steps (CE, sign, eps-ball and [0, 1] clip), not rounded to uint8
        for _ in range(3):  # (BlackboxBench's --as-baseline saves the float iterate as ILA's reference)
            xr = xb.clone().requires_grad_(True)
            g, = torch.autograd.grad(F.cross_entropy(net(xr), y, reduction="sum"), xr)
            xb = torch.min(torch.max(xb + 0.01 * g.sign(), x - 0.05), x + 0.05).clamp(0, 1)
        f0, fb = feats(net, "stage2", x), feats(net, "stage2", xb)
        d = unit(fb - f0)
        assert torch.allclose(aux["ila"].tensors["dir"], d, atol=1e-5)
        xa = (x + 0.03 * torch.randn(x.shape, generator=gen(5)).sign()).clamp(0, 1)
        with torch.no_grad():
            net(torch.cat([xa, xa]))  # two stacked copies: the per-sample tensors repeat
        loss = LOSS.get("ila")(ctx.at(aux=aux), None, None)
        fa = feats(net, "stage2", xa)
        ref = torch.stack([((fa[i] - f0[i]) * d[i]).sum() for i in range(len(x))])
        assert torch.allclose(loss, torch.cat([ref, ref]), atol=1e-5)
    finally:
        aux["ila"].close()
    assert not get_layer(net, "stage2")._forward_hooks


def test_fia_masks_the_normalized_input_by_default():
    """``fill: mean`` (the recipe's, as the FIA authors' code and BlackboxBench's fia_loss): the masks multiply the
    normalized input, so a dropped pixel is the model's normalization mean; ``fill: zero``: black, on the [0, 1]
    image. The reference feeds the inner network the masked normalized input directly."""
    inner = small_resnet(1)
    net = Normalized(inner, (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))
    assert input_mean(net) is net.mean and input_mean(inner) is None
    x, y = images(3, 2)
    weights = {}
    for fill in ("mean", "zero"):
        aux = AUXILIARY.get("fia_aggregate")(ctx_for(net, x, y, seed=4), layer="stage1", n_ens=4, drop=0.3,
                                             fill=fill)
        aux["fia"].close()
        replay = ctx_for(net, x, y, seed=4)
        masks = [(replay.rng.uniform(x.shape[1:]) >= 0.3).float() for _ in range(4)]
        z = (x - net.mean) / net.std
        total = sum(logit_grad_loop(inner, "stage1", z * m, y) if fill == "mean" else
                    logit_grad_loop(net, "stage1", x * m, y) for m in masks)
        weights[fill] = aux["fia"].tensors["weight"]
        assert torch.allclose(weights[fill], unit(total), atol=1e-5)
    assert not torch.allclose(weights["mean"], weights["zero"], atol=1e-3)


def test_fia_aggregate_gradient_matches_a_per_sample_loop():
    net = small_resnet(1)
    x, y = images(3, 2)
    ctx = ctx_for(net, x, y, seed=4)
    aux = AUXILIARY.get("fia_aggregate")(ctx, layer="stage1", n_ens=4, drop=0.3)
    aux["fia"].close()
    replay = ctx_for(net, x, y, seed=4)  # the same streams: the same masks
    masks = [(replay.rng.uniform(x.shape[1:]) >= 0.3).float() for _ in range(4)]
    kept = torch.stack(masks).mean().item()
    assert 0.65 < kept < 0.75
    total = sum(logit_grad_loop(net, "stage1", x * m, y) for m in masks)
    assert torch.allclose(aux["fia"].tensors["weight"], unit(total), atol=1e-5)
    f = aux["fia"]
    f.tap.out = torch.randn(6, *total.shape[1:], generator=gen(3))
    loss = LOSS.get("fia")(ctx.at(aux=aux), None, None)
    w = f.tensors["weight"]
    ref = torch.stack([-(f.tap.out[i] * w[i % 3]).sum() for i in range(6)])
    assert torch.allclose(loss, ref, atol=1e-5)


def test_naa_attention_and_loss_match_a_per_sample_loop():
    net = small_resnet(2)
    x, y = images(3, 3)
    ctx = ctx_for(net, x, y)
    aux = AUXILIARY.get("naa_attention")(ctx, layer="stage2", steps=5)
    aux["naa"].close()
    ia = sum(logit_grad_loop(net, "stage2", m / 5 * x, y) for m in range(1, 6)) / 5
    assert torch.allclose(aux["naa"].tensors["weight"], unit(ia), atol=1e-5)
    assert torch.allclose(aux["naa"].tensors["base"], feats(net, "stage2", torch.zeros_like(x)), atol=1e-6)
    f = aux["naa"]
    f.tap.out = torch.randn(3, *ia.shape[1:], generator=gen(4))
    for gamma in (1.0, 0.5):
        loss = LOSS.get("naa")(ctx.at(aux=aux), None, None, gamma=gamma)
        for i in range(3):
            wa = ((f.tap.out[i] - f.tensors["base"][i]) * f.tensors["weight"][i]).flatten()
            ref = -(wa[wa > 0].sum() - gamma * (-wa[wa < 0]).sum())
            assert torch.allclose(loss[i], ref, atol=1e-5)


def test_feature_blocks_fail_in_one_line():
    net = small_resnet()
    x, y = images(2)
    with pytest.raises(BenchError) as e:
        AUXILIARY.get("ila_baseline")(ctx_for(net, x, y), layer="stage4")
    assert "\n" not in str(e.value) and "valid names: mid, late" in str(e.value) and "ila_baseline" in str(e.value)
    with pytest.raises(BenchError, match="needs the auxiliary block 'naa_attention'"):
        LOSS.get("naa")(ctx_for(net, x, y), None, None)
    targeted = transfer_ctx(x, y, 0.05, "linf", (y + 1) % 10, net, 0.01)
    with pytest.raises(BenchError, match="untargeted only"):
        AUXILIARY.get("fia_aggregate")(targeted)


@pytest.mark.parametrize("block", ["ila_baseline", "fia_aggregate", "naa_attention"])
def test_unknown_layer_fails_before_the_run_folder_exists(tmp_path, capsys, block):
    """A layer the surrogate lacks is a one-line config error naming the file and the block, before anything is
    created (not an error in the first batch, with an empty run folder left behind)."""
    from blackboxbench.cli import main

    recipe = {"ila_baseline": "ila", "fia_aggregate": "fia", "naa_attention": "naa"}[block]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 4}}\nsurrogates: [digits_cnn]\ntargets: [digits_mlp]\n"
                   f"attack: {{recipe: {recipe}, blocks: {{auxiliary: [{{name: {block}, layer: stage9}}]}}}}\n"
                   f"threat: {{norm: linf, eps: 0.1}}\ndevice: cpu\noutput_dir: {tmp_path / 'out'}\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{cfg}:attack (block {block}, parameter layer): unknown layer 'stage9'" in err, err
    assert "did you mean: stage3" in err and not (tmp_path / "out").exists()


def test_pipeline_removes_feature_hooks_after_a_batch_even_on_error():
    net = small_resnet()
    x, y = images(2)
    atk = build_recipe("naa", "linf", False, 0.05, 2)[0]
    atk.run(ctx_for(net, x, y, iterations=2))
    assert all(not m._forward_hooks for m in net.modules())
    atk.update = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        atk.run(ctx_for(net, x, y, iterations=2))
    assert all(not m._forward_hooks for m in net.modules())


# --------------------------------------------------------------------------------------------- SGM, LinBP ----

def test_sgm_scales_the_residual_branch_gradient_only():
    net = small_resnet()
    x = torch.rand(3, 4, 8, 8, generator=gen(6))
    w = torch.randn(3, 4, 8, 8, generator=gen(7))
    block = net.layer1[0]
    (copy_,) = REFINE.get("sgm")(refine_ctx(), [net], gamma=0.3)
    new = copy_.layer1[0]
    xr = x.clone().requires_grad_(True)
    out = new(xr)
    assert torch.equal(out, block(x))  # forward unchanged
    g, = torch.autograd.grad((out * w).sum(), xr)
    xb = x.clone().requires_grad_(True)
    b, s = block.branch(xb), block.shortcut(xb)
    g_pre = w * ((b + s) > 0).float()
    ref = 0.3 * torch.autograd.grad(b, xb, g_pre, retain_graph=True)[0] + torch.autograd.grad(s, xb, g_pre)[0]
    assert torch.allclose(g, ref, atol=1e-6)


def test_linbp_plain_network_backward_is_the_linear_chain():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 5)).eval().requires_grad_(False)
    (lin,) = REFINE.get("linbp")(refine_ctx(), [mlp], position="stage1")
    x = torch.randn(4, 12, generator=gen(8)).requires_grad_(True)
    w = torch.randn(4, 5, generator=gen(9))
    out = lin(x)
    assert torch.equal(out, mlp(x))
    g, = torch.autograd.grad((out * w).sum(), x)
    assert torch.allclose(g, w @ mlp[3].weight @ mlp[1].weight, atol=1e-6)  # W1^T W2^T w: ReLU as identity
    assert type(mlp[2]) is nn.ReLU  # the original is untouched
    deep = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 5)) \
        .eval().requires_grad_(False)
    (lin,) = REFINE.get("linbp")(refine_ctx(), [deep], position="late")  # the second half: the first ReLU stays
    g, = torch.autograd.grad((lin(x) * w).sum(), x)
    gate = (deep[1](x) > 0).float()
    assert torch.allclose(g, ((w @ deep[5].weight @ deep[3].weight) * gate) @ deep[1].weight, atol=1e-6)


def test_linbp_residual_branch_gradient_renormalized_to_the_exact_norm():
    net = small_resnet(3)
    (lin,) = REFINE.get("linbp")(refine_ctx(), [net], position="late")  # block3_0 and after
    assert isinstance(lin.layer3[0], LinBPBlock) and not isinstance(lin.layer2[0], LinBPBlock)
    block = net.layer3[0]
    x = torch.rand(2, 8, 8, 8, generator=gen(10))
    w = torch.randn(2, 16, 4, 4, generator=gen(11))
    xr = x.clone().requires_grad_(True)
    out = lin.layer3[0](xr)
    assert torch.equal(out, block(x))
    g, = torch.autograd.grad((out * w).sum(), xr)
    xb = x.clone().requires_grad_(True)
    g_sum = w * ((block.branch(x) + block.shortcut(x)) > 0).float()  # relu2 after the sum keeps its exact mask
    linear_branch = block.bn2(block.conv2(block.bn1(block.conv1(xb))))  # relu1 as identity (affine in eval)
    g_lin = torch.autograd.grad(linear_branch, xb, g_sum, retain_graph=True)[0]
    g_exact = torch.autograd.grad(block.branch(xb), xb, g_sum, retain_graph=True)[0]
    alpha = g_exact.flatten(1).norm(dim=1) / g_lin.flatten(1).norm(dim=1)
    g_skip = torch.autograd.grad(block.shortcut(xb), xb, g_sum)[0]
    assert (g_sum == 0).any() and (g_sum != 0).any()  # the mask matters here
    assert torch.allclose(g, alpha.view(-1, 1, 1, 1) * g_lin + g_skip, atol=1e-5)
    for m in lin.layer3[0].linear.modules():
        assert type(m) is not nn.ReLU


def test_backprop_surgery_errors_are_one_line():
    cnn = build_model({"name": "digits_cnn", "pretrained": False})
    with pytest.raises(BenchError, match="no skip connections") as e:
        REFINE.get("sgm")(refine_ctx(), [cnn])
    assert "\n" not in str(e.value) and "cifar_resnet20" in str(e.value)
    sigmoid = build_model({"name": "cifar_conv_small_sigmoid", "pretrained": False})
    with pytest.raises(BenchError, match="no ReLU at or after position 'late'"):
        REFINE.get("linbp")(refine_ctx(), [sigmoid])
    with pytest.raises(BenchError, match="valid names: mid, late, stem, stage1"):
        REFINE.get("linbp")(refine_ctx(), [small_resnet()], position="block9_0")
    with pytest.raises(BenchError, match="one surrogate"):
        REFINE.get("linbp")(refine_ctx(), [small_resnet(), small_resnet(1)])
    with pytest.raises(BenchError, match="3 stages"):
        REFINE.get("iaa")(refine_ctx(), [small_resnet()], decay=[1.0, 0.5])


# ----------------------------------------------------------------------------------------- IAA, GhostNet ----

def test_iaa_softplus_and_residual_decay_in_closed_form():
    net = small_resnet(4)
    (iaa,) = REFINE.get("iaa")(refine_ctx(), [net], beta=10.0, decay=[1.0, 0.5, 0.25])
    assert not any(type(m) is nn.ReLU for m in iaa.modules())
    sp = functools.partial(F.softplus, beta=10.0)
    x = torch.rand(2, 3, 16, 16, generator=gen(12))
    with torch.no_grad():
        h = sp(net.bn1(net.conv1(x)))
        for stage, lam in ((net.layer1, 1.0), (net.layer2, 0.5), (net.layer3, 0.25)):
            b = stage[0]
            h = sp(lam * b.bn2(b.conv2(sp(b.bn1(b.conv1(h))))) + b.shortcut(h))
        ref = net.linear(F.adaptive_avg_pool2d(h, 1).flatten(1))
        assert torch.allclose(iaa(x), ref, atol=1e-5)


def test_ghost_skip_erosion_draws_lambda_per_forward_row_and_channel():
    add = GhostAdd(0.4, RowDraws(refine_ctx(3).rng))
    lam = torch.cat([add(torch.zeros(3, 2, 4, 4), torch.ones(3, 2, 4, 4)) for _ in range(100)])  # the run's stream
    # one lambda per channel (the GhostNet authors' code: tf.random_uniform((depth,)) on the shortcut; not one
    # scalar per block), broadcast over the channel's pixels
    assert torch.equal(lam, lam[:, :, :1, :1].expand_as(lam)) and not torch.equal(lam[:, 0], lam[:, 1])
    lam = lam[:, :, 0, 0]
    assert lam.min() >= 0.6 and lam.max() <= 1.4 and lam.max() - lam.min() > 0.7 and abs(lam.mean() - 1) < 0.05
    assert len(lam[:3, 0].unique()) == 3  # the rows of one forward meet different ghosts
    again = GhostAdd(0.4, RowDraws(refine_ctx(3).rng))
    assert torch.equal(lam[:12], torch.cat([again(torch.zeros(3, 2), torch.ones(3, 2)) for _ in range(4)]))
    net = small_resnet()
    x = torch.rand(2, 3, 16, 16, generator=gen(13))
    (g0,) = REFINE.get("ghost")(refine_ctx(), [net], r=0.0)
    with torch.no_grad():
        assert torch.equal(g0(x), net(x))  # r = 0: the original network
        (g1,) = REFINE.get("ghost")(refine_ctx(), [net], r=1.0)
        assert not torch.equal(g1(x), g1(x))  # a fresh ghost at every forward
    assert all(isinstance(b.merge, GhostAdd) for _, b in residual_blocks(g1))


def test_ghost_draws_per_sample_while_bound():
    """Bound to the samples' streams, a sample meets the same ghosts in any batch, beside a padding copy of
    itself, and in a forward of K stacked copies each copy is one draw; a forward of a partial copy is refused."""
    net = small_resnet()
    (g,) = REFINE.get("ghost")(refine_ctx(), [net], r=1.0)
    x = torch.rand(4, 3, 16, 16, generator=gen(17))

    def forwards(idx, rows, copies=1):
        with drawing_from(g, Streams(5, 4, "cpu").view(idx)), torch.no_grad():
            return [g(x[rows].repeat(copies, 1, 1, 1)) for _ in range(3)]

    whole = forwards([0, 1, 2, 3], [0, 1, 2, 3])
    part = forwards([2, 3, 3], [2, 3, 3])  # a part of a fixed batch: sample 3 padded with a copy of itself
    for a, b in zip(whole, part):
        assert torch.allclose(a[2:], b[:2], atol=1e-5) and torch.allclose(b[1], b[2])
    stacked = forwards([1, 2], [1, 2], copies=2)
    assert not torch.allclose(stacked[0][:2], stacked[0][2:])  # the second copy meets other ghosts
    with drawing_from(g, Streams(5, 4, "cpu").view([0, 1])), pytest.raises(BenchError, match="whole copies"):
        g(x[:3])
    with drawing_from(g, Streams(5, 4, "cpu").view([0, 1])):
        pass
    assert all(b.merge.draws.rng is b.merge.draws.default for _, b in residual_blocks(g))  # unbound again


def test_ghost_dropout_erosion_on_a_plain_network():
    cnn = build_model({"name": "digits_cnn", "pretrained": False})
    (ghost,) = REFINE.get("ghost")(refine_ctx(), [cnn], p=0.5)
    drops = [m for m in ghost.modules() if isinstance(m, GhostDropout)]
    assert len(drops) == 3
    h = torch.ones(4, 16, 8, 8)
    out = drops[0](h)
    assert set(out.unique().tolist()) <= {0.0, 2.0} and 0.45 < (out == 0).float().mean() < 0.55
    assert not torch.equal(out[0], out[1])  # a mask per row


@pytest.mark.parametrize("block,params", [("sgm", {}), ("linbp", {}), ("iaa", {"decay": [1.0, 0.8, 0.5]}),
                                          ("ghost", {})])
def test_surgery_works_on_a_copy(block, params):
    net = small_resnet(5)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    types = [type(m) for m in net.modules()]
    x = torch.rand(2, 3, 16, 16, generator=gen(14))
    with torch.no_grad():
        ref = net(x)
        (out,) = REFINE.get(block)(refine_ctx(), [net], **params)
        out(x)
        assert torch.equal(net(x), ref)
    assert out is not net and [type(m) for m in net.modules()] == types
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


# ------------------------------------------------------------------------------------------------ recipes ----

def test_recipes_cite_table_vii_and_build():
    for name in NEW:
        r = yaml.safe_load((RECIPE_DIR / f"{name}.yaml").read_text())
        assert r["name"] == name and r["family"] == "transfer" and r["paper"] and "Table VII" in r["defaults"]
        assert r["targeted"] is (name not in ("fia", "naa"))  # Table VII: FIA, NAA untargeted only
        for norm, eps in (("linf", 0.03), ("l2", 1.0)):
            for targeted in (False, True) if r["targeted"] else (False,):
                atk = build_recipe(name, norm, targeted, eps)[0]
                assert atk.iterations == (300 if targeted else 100) and atk.alpha == pytest.approx(eps / 10)
    ila = build_recipe("ila", "linf", True, 0.03)[0]
    assert ila.auxiliaries[0].keywords == {"layer": "mid", "iterations": 30}  # Table VII: baseline 10 / 30
    # Table VII per architecture (CIFAR-10 column: ResNet-50 the default); the CIFAR ResNets' values are chosen on
    # held-out images (recipe notes)
    assert build_recipe("sgm", "linf", False, 0.03)[0].refiners[0].keywords == {
        "gamma": {"cifar_resnet[0-9][0-9]": 0.8, "default": 0.5}}
    assert build_recipe("ghostnet", "linf", False, 0.03)[0].refiners[0].keywords == {
        "r": {"cifar_resnet[0-9][0-9]": 0.22, "default": 1.0}, "p": {"inception*": 0.2, "default": 0.1}}


# ------------------------------------------------------------------------- per-architecture parameters ----

def test_per_arch_values_follow_the_zoo_name():
    zoo = build_model({"name": "cifar_resnet20", "pretrained": False})
    plain = small_resnet()  # no zoo name: its class name
    assert arch_id(zoo) == "cifar_resnet20" and arch_id(plain) == "cifarresnet"
    assert arch_name("timm:resnet18") == "resnet18" and arch_name({"name": "torchvision:resnet50"}) == "resnet50"
    assert arch_name({"name": "checkpoint", "path": "w.pt", "arch": "timm:resnet18"}) == "resnet18"
    assert arch_name({"name": "checkpoint", "path": "w.pt", "arch": "cifar_resnet20"}) == "cifar_resnet20"
    table = {"cifar_resnet*": 0.22, "cifar*": 0.5, "default": 1.0}
    assert per_arch(table, zoo) == 0.22  # the first matching pattern, in order
    assert per_arch(table, plain) == 0.5 and per_arch({"resnet50": 0.3, "default": 1.0}, plain) == 1.0
    assert per_arch(0.7, zoo) == 0.7
    adv = build_model({"name": "cifar_resnet4b_adv", "pretrained": False})  # the recipes' pattern leaves it out
    assert per_arch({"cifar_resnet[0-9][0-9]": 0.22, "default": 1.0}, adv) == 1.0
    gammas = {b.merge.gamma for _, b in residual_blocks(REFINE.get("sgm")(refine_ctx(), [zoo], gamma=table)[0])}
    rs = {b.merge.r for _, b in residual_blocks(REFINE.get("ghost")(refine_ctx(), [zoo, plain], r=table)[1])}
    assert gammas == {0.22} and rs == {0.5}
    assert all(isinstance(b.merge, SkipGradientAdd) for _, b in residual_blocks(
        REFINE.get("sgm")(refine_ctx(), [plain], gamma=0.3)[0]))


@pytest.mark.parametrize("value,message", [({"cifar_resnet*": 0.8}, "needs a 'default' entry"),
                                           ({"cifar_resnet*": 1.5, "default": 0.5}, "patterns to numbers in"),
                                           ({"default": "x"}, "patterns to numbers in"), ("0.5", "a per-architecture")])
def test_per_arch_mapping_errors_are_one_line(value, message):
    with pytest.raises(ParamError, match=message) as e:
        check_params(REFINE.get("sgm"), {"gamma": value}, where="recipe sgm: ")
    assert "\n" not in str(e.value) and str(e.value).startswith("recipe sgm: gamma:")


@pytest.mark.parametrize("name", NEW)
def test_recipe_runs_inside_the_ball_per_sample(name):
    net = small_resnet(6)
    x, y = images(5, 15)
    atk = build_recipe(name, "linf", False, 0.05, 3)[0]

    def run(rows=None):
        model = atk.refine(refine_ctx(), [net])
        c = ctx_for(model, x, y, seed=1, alpha=atk.alpha)
        return atk.run(c if rows is None else c.sub(rows))

    out = run()
    check_output(out, x, 0.05, "linf")
    assert not torch.equal(out, x) and torch.equal(out, run())  # deterministic given the seed
    assert torch.equal(out[3:], run(torch.tensor([3, 4])))


# ------------------------------------------------------------------------------------- real CIFAR models ----

@pytest.fixture(scope="module")
def transfer_run(data_root):
    """Memoized runs on 16 CIFAR-10 test images that ResNet-20 and ResNet-56 classify correctly: recipe ->
    (white-box ASR on ResNet-20, transfer ASR on ResNet-56). 20 iterations (twice across the ball) instead of
    100 keep the file fast; untargeted Linf 0.03, step eps/10."""
    zoo = {d: build_model(f"cifar_resnet{d}", data_root) for d in (20, 56)}
    x, y = correctly_classified(list(zoo.values()), data_root, n=16, pool=300)

    @functools.lru_cache(maxsize=None)
    def run(name):
        atk = build_recipe(name, "linf", False, 0.03, 20)[0]
        model = atk.refine(refine_ctx(), [zoo[20]])
        out = atk.run(transfer_ctx(x, y, 0.03, "linf", None, model, atk.alpha, 0, atk.iterations))
        check_output(out, x, 0.03, "linf")
        with torch.no_grad():
            return tuple((zoo[d](out).argmax(1) != y).float().mean().item() for d in (20, 56))

    return run


@pytest.mark.parametrize("name", NEW)
def test_recipe_on_resnet20_transfers_to_resnet56(name, transfer_run):
    """White-box success on the (unmodified) surrogate and transfer far above ResNet-56's clean error (0 on these
    images). The ordering against I-FGSM is the benchmark's (100 images, 100 steps,
    benchmarks/fidelity_transfer_features.py); here only NAA's claim is checked: at least I-FGSM's transfer."""
    white, transfer = transfer_run(name)
    print(f"\n{name}: white-box {white:.3f}, ResNet-56 {transfer:.3f} (i_fgsm {transfer_run('i_fgsm')[1]:.3f})")
    assert white >= 0.95 and transfer >= 0.5
    if name == "naa":
        assert transfer >= transfer_run("i_fgsm")[1]
