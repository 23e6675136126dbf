"""Surrogate refinement in weight space (spec sheet T16-T20): RD, LGV, SWA, the Bayesian attack's SWAG samples
and DRA's score-matching fine-tuning, as ``refine`` blocks that turn each surrogate into one or more models (fuse
several with ``longitudinal``).

The training blocks fine-tune a copy of the surrogate on the attacker's own labelled images, a ``train_images``
asset the config declares (by default the 200 CIFAR-10 test images of ``cifar10_test_sdp200.npz``, disjoint from
the evaluation images: the spec sheet's split A; on the digits, their train split). The paper's schedules are
in epochs of the 50,000 CIFAR-10 training images; here an epoch is one pass over the declared images in batches
of ``min(batch, N)`` and at least ``min_steps`` steps (spec sheet section 3: keep the number of collected models
and the learning rates, re-express epochs in steps). Augmentation: random crop with zero padding of 1/8 of the
side (CIFAR's 4 pixels) and a horizontal flip, as the authors' CIFAR loaders.

Every random number comes from the run's refine stream ``ctx.rng`` (RD's directions, SWAG's samples) or from a
generator seeded by one draw of it (mini-batches, augmentation), so a run's seed fixes the refined models. A
trained result is cached in ``BLACKBOXBENCH_CACHE``/refine under a hash of the block, its parameters, the
surrogate's weights, the images, that seed and the device type (the spec sheet's G2 cache key); a second run
loads it.
"""
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..prep.layers import per_arch
from ..prep.models import input_std
from ..prep.trained import augment, cache_key, cached, train_data
from ..registry import REFINE


# ------------------------------------------------------------------------------------------------ helpers ----

def _params(model):
    return list(model.parameters())


def _trainable(model, bn_stats="train"):
    """A deep copy of ``model`` whose parameters take gradients (the shared surrogate stays frozen). ``bn_stats``
    "keep": its BatchNorm running statistics stay the checkpoint's while it trains (momentum 0; the batches are
    still normalized by their own statistics)."""
    net = copy.deepcopy(model)
    net.requires_grad_(True)
    if bn_stats == "keep":
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = 0.0
    return net


def _frozen(model):
    return model.eval().requires_grad_(False)


def schedule(n, batch, epochs, min_steps):
    """(batch size, steps per epoch, total steps) for ``epochs`` passes over ``n`` images."""
    batch = min(int(batch), n)
    per = max(math.ceil(n / batch), int(min_steps))
    return batch, per, per * int(epochs)


def bn_update(model, x, batch=256):
    """Re-estimate every BatchNorm's running statistics on the images ``x`` (one pass, each batch weighted by its
    size, as the authors' ``bn_update``); the model ends in eval mode. A model without BatchNorm is left as is.
    The callers pass the training images augmented (:func:`augment`), as the authors pass their training loader
    (Li et al.'s ``update_bn_imgnet``, Gubri et al.'s ``bn_update``, both on augmented batches); all of them, not
    the authors' 10 % (20 of the 200 offline images)."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model.eval()
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
    model.train()
    seen = 0
    with torch.no_grad():
        for part in x.split(batch):
            for m in bns:  # weighted by batch size: the mean over the images
                m.momentum = len(part) / (seen + len(part))
            model(part)
            seen += len(part)
    for m, mom in zip(bns, saved):
        m.momentum = mom
    return model.eval()


def _seed(ctx):
    """One draw of the run's refine stream, seeding a block's mini-batch and augmentation generator."""
    return int(ctx.rng.randint_below(torch.tensor([2 ** 31])).item())


def _cpu_state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _load(model, state):
    net = copy.deepcopy(model)
    net.load_state_dict({k: v.to(t.device) for (k, v), t in zip(state.items(), net.state_dict().values())})
    return _frozen(net)


def _noisy_copy(model, ctx, scales, dev=None, dev_scale=0.0):
    """A copy of ``model`` with ``scales[i] * z_i`` added to its parameter i (a number or a tensor of its shape),
    ``z`` standard normal from the run's refine stream (one draw for all the parameters). ``dev`` (per parameter,
    (K, *shape)): also ``dev_scale * sum_k u_k dev[i][k]``, ``u`` K more standard normals of the same draw (SWAG's
    low-rank part)."""
    net = copy.deepcopy(model)
    params = _params(net)
    sizes = [p.numel() for p in params]
    k = 0 if dev is None else dev[0].shape[0]
    z = ctx.rng.normal((sum(sizes) + k,))[0]
    u = z[sum(sizes):]
    with torch.no_grad():
        for i, (p, s, zi) in enumerate(zip(params, scales, z[:sum(sizes)].split(sizes))):
            p.add_(s * zi.view_as(p).to(p))
            if k:
                p.add_(torch.tensordot(u.to(p), dev[i].to(p), dims=1), alpha=float(dev_scale))
    return net


def _batches(data, gen, batch, steps):
    """``steps`` augmented mini-batches (x, y) of ``batch`` distinct images each."""
    n = len(data.y)
    for _ in range(steps):
        idx = torch.randperm(n, generator=gen)[:batch]
        yield augment(data.x[idx], gen), data.y[idx]


# --------------------------------------------------------------------------------------------------- RD ----

@REFINE.register("random_directions", paper="Gubri et al., LGV: Boosting Adversarial Example Transferability from "
                                            "Large Geometric Vicinity, ECCV 2022 (the RD baseline)",
                 norms=("linf", "l2"), ranges={"std": "arch [0, 1]", "n_models": "int [1, inf)"},
                 asset_params={"data": "train_images"})
def random_directions(ctx, models, *, std=0.005, n_models=10, data=None):
    """RD: ``n_models`` copies of each surrogate with i.i.d. Gaussian noise of standard deviation ``std`` on every
    parameter (BlackboxBench's ``sample_from_isotropic``), then, when ``data`` names a ``train_images`` asset,
    the BatchNorm statistics re-estimated on those images (the authors' ``update_bn``; the ``rd`` recipe names
    ``train``; None, the default, keeps the surrogate's statistics), each copy on its own augmentation of them
    (random crop and flip, as the authors' training loader; a generator seeded by one draw of the run's stream).
    Returns the copies, surrogate by surrogate (fuse them with ``longitudinal``). Table VII, CIFAR-10: std 0.005
    (ResNet-50, IncV3), 0.01 (VGG-19, DenseNet-BC); n_models 10."""
    if not models:
        raise BenchError("refine 'random_directions': no surrogate models")
    images = None if data is None else train_data(ctx, "random_directions", data)
    gen = None if images is None else torch.Generator().manual_seed(_seed(ctx))
    out = []
    for model in models:
        scales = [per_arch(std, model)] * len(_params(model))
        for _ in range(int(n_models)):
            net = _noisy_copy(model, ctx, scales)
            out.append(_frozen(bn_update(net, augment(images.x, gen)) if images is not None else net))
    return out


# -------------------------------------------------------------------------------------------------- LGV ----

@REFINE.register("lgv", paper="Gubri et al., LGV: Boosting Adversarial Example Transferability from Large "
                              "Geometric Vicinity, ECCV 2022", norms=("linf", "l2"),
                 ranges={"lr": "arch [0, 10]", "wd": "arch [0, 1]", "momentum": "[0, 1)", "epochs": "int [1, inf)",
                         "collects_per_epoch": "int [1, inf)", "batch": "int [1, inf)",
                         "bn_stats": ("train", "keep")},
                 asset_params={"data": "train_images"})
def lgv(ctx, models, *, lr=0.05, wd=5e-4, momentum=0.9, epochs=10, collects_per_epoch=4, batch=256, data="train",
        bn_stats="train"):
    """LGV: from each pretrained surrogate, SGD at a constant high learning rate for ``epochs`` epochs, collecting
    the weights ``collects_per_epoch`` times per epoch (40 models by default); returns the collected models
    (fuse them with ``longitudinal``: iteration t attacks model t mod 40). BatchNorm statistics are the training
    run's (the collected models are used as saved, as the authors'). Table VII, CIFAR-10: batch 256, 10 epochs,
    constant lr; lr / wd 0.05 / 5e-4 (ResNet-50, VGG-19), 0.1 / 5e-4 (IncV3), 0.5 / 1e-4 (DenseNet-BC); momentum
    0.9; the code's ``swa_freq`` 4 collects per epoch. ``bn_stats: keep`` freezes the BatchNorm running statistics
    at the checkpoint's while it trains (not the authors'; measured in benchmarks/RESULTS.md)."""
    if not models:
        raise BenchError("refine 'lgv': no surrogate models")
    train = train_data(ctx, "lgv", data)
    out = []
    for model in models:
        hp = {"lr": per_arch(lr, model), "wd": per_arch(wd, model), "momentum": momentum, "epochs": epochs,
              "collects_per_epoch": collects_per_epoch, "batch": batch, "bn_stats": bn_stats}
        seed = _seed(ctx)
        key = cache_key("lgv", hp, model, train, seed, ctx.rng.device)
        states = cached("refine", key, lambda: _lgv_collect(model, train, seed, **hp))
        out += [_load(model, s) for s in states]
    return out


def _lgv_collect(model, data, seed, *, lr, wd, momentum, epochs, collects_per_epoch, batch, bn_stats):
    net = _trainable(model, bn_stats).train()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    batch, per, total = schedule(len(data.y), batch, epochs, collects_per_epoch)
    every = per // collects_per_epoch  # the collects of an epoch, evenly spaced
    gen, states = torch.Generator().manual_seed(seed), []
    for step, (xb, yb) in enumerate(_batches(data, gen, batch, total), start=1):
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
        within = (step - 1) % per + 1  # the step's position in its epoch, 1-based
        if within % every == 0 and within // every <= collects_per_epoch:
            states.append(_cpu_state(net))
    return states


# ---------------------------------------------------------------------------------------- SWA and SWAG ----

SWA_RANGES = {"lr": "arch [0, 10]", "wd": "arch [0, 1]", "lam": "arch [0, inf)", "gamma": "arch [0, inf)",
              "sigma": "[0, 1]", "momentum": "[0, 1)", "epochs": "int [1, inf)", "batch": "int [1, inf)",
              "snapshots": "int [1, inf)", "min_steps": "int [1, inf)", "bn_stats": ("train", "keep")}
SWA_PAPER = ("Li et al., Making Substitute Models More Bayesian Can Enhance Transferability of Adversarial "
             "Examples, ICLR 2023")
SWA_TRAINING = 2  # _finetune's revision, in the cache key (2: BatchNorm re-estimated on augmented images)


def _swag_moments(ctx, model, train, hp):
    """``{"state": the mean's state dict, "sq": the parameters' mean of squares}`` along the fine-tuning, the
    mean's BatchNorm buffers re-estimated on the images (``bn_stats: train``, the authors') or the checkpoint's
    (``keep``), and with ``rank`` > 0 ``"dev"``: per parameter, the deviations from the running mean of the last
    ``rank`` snapshots (K, *shape); cached."""
    seed = _seed(ctx)
    key = cache_key("swag_moments", {**hp, "training": SWA_TRAINING}, model, train, seed, ctx.rng.device)
    return cached("refine", key, lambda: _finetune(model, train, seed, **hp))


def _finetune(model, data, seed, *, lr, wd, lam, gamma, sigma, momentum, epochs, batch, snapshots, min_steps,
              bn_stats, rank=0):
    """Li et al.'s flat-posterior fine-tuning (the authors' ``finetune_cifar10``): each step takes the gradient g
    of the cross-entropy at weights with Gaussian noise ``sigma`` (the paper's expectation over N(0, sigma^2 I)),
    then g' at the weights moved by ``gamma g / ||g||`` (the worst case of a ball), and steps along ``g + (lam /
    0.1) (g' - g)``; ``snapshots`` times along the run (the code's ``swa_n`` 300, at most every step) the weights
    update a running mean and mean of squares (SWAG's diagonal moments) and, with ``rank`` > 0, the deviation of
    the weights from the updated mean is kept for the last ``rank`` snapshots (SWAG's low-rank part, Maddox et al.
    2019, ``collect_model``)."""
    net = _trainable(model, bn_stats).train()
    params = _params(net)
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)
    batch, _, total = schedule(len(data.y), batch, epochs, min_steps)
    every = max(1, total // snapshots)
    gen, count = torch.Generator().manual_seed(seed), 0
    mean = [torch.zeros_like(p) for p in params]
    sq = [torch.zeros_like(p) for p in params]
    dev = [[] for _ in params]
    for step, (xb, yb) in enumerate(_batches(data, gen, batch, total)):
        noise = [torch.randn(p.shape, generator=gen).to(p) * sigma for p in params] if sigma > 0 else None
        _shift(params, noise, 1.0)
        g = torch.autograd.grad(F.cross_entropy(net(xb), yb), params)
        norm = torch.sqrt(sum((t * t).sum() for t in g)) + 1e-20
        _shift(params, g, gamma / norm)
        g2 = torch.autograd.grad(F.cross_entropy(net(xb), yb), params)
        _shift(params, g, -gamma / norm)
        _shift(params, noise, -1.0)
        for p, a, b in zip(params, g, g2):
            p.grad = a + (lam / 0.1) * (b - a)
        opt.step()
        if step % every == 0:
            count += 1
            with torch.no_grad():
                for p, m, s, d in zip(params, mean, sq, dev):
                    m.mul_((count - 1) / count).add_(p / count)
                    s.mul_((count - 1) / count).add_(p * p / count)
                    if rank:
                        d.append(p - m)
                        del d[:-rank]
    with torch.no_grad():
        for p, m in zip(params, mean):
            p.copy_(m)
    if bn_stats == "train":  # on an augmentation of the images, as the authors' training loader
        bn_update(net, augment(data.x, gen))
    out = {"state": _cpu_state(net), "sq": [s.cpu() for s in sq]}
    if rank:
        out["dev"] = [torch.stack(d).cpu() for d in dev]
    return out


def _shift(params, deltas, scale):
    if deltas is None:
        return
    with torch.no_grad():
        for p, d in zip(params, deltas):
            p.add_(d, alpha=float(scale))


def _fine_tuned(ctx, block, models, data, *hp):
    """[(surrogate, its SWAG moments)] for every surrogate, fine-tuned on the ``train_images`` asset ``data``."""
    if not models:
        raise BenchError(f"refine '{block}': no surrogate models")
    train = train_data(ctx, block, data)
    return [(model, _swag_moments(ctx, model, train, _swa_hp(model, *hp))) for model in models]


def _swa_hp(model, lr, wd, lam, gamma, sigma, momentum, epochs, batch, snapshots, min_steps, bn_stats, rank=0):
    hp = {"lr": per_arch(lr, model), "wd": per_arch(wd, model), "lam": per_arch(lam, model),
          "gamma": per_arch(gamma, model), "sigma": sigma, "momentum": momentum, "epochs": epochs, "batch": batch,
          "snapshots": snapshots, "min_steps": min_steps, "bn_stats": bn_stats}
    return {**hp, "rank": rank} if rank else hp  # rank 0: the cache key of the diagonal moments stays as it was


@REFINE.register("swa", paper=SWA_PAPER + " (SWA mean)", norms=("linf", "l2"), ranges=SWA_RANGES,
                 asset_params={"data": "train_images"})
def swa(ctx, models, *, lr=0.05, wd=1e-4, lam=0.2, gamma=0.1, sigma=0.002, momentum=0.9, epochs=10, batch=512,
        snapshots=300, min_steps=4, data="train", bn_stats="train"):
    """SWA surrogate: the average of the weights along Li et al.'s fine-tuning (see :func:`_finetune`), with
    the BatchNorm statistics re-estimated on the training images; one model per surrogate. Table VII, CIFAR-10:
    batch 512, 10 epochs, constant lr, momentum 0.9, sigma 0.002; lr / wd / lambda / gamma 0.05 / 1e-4 / 0.2 / 0.1
    (ResNet-50, IncV3), 0.1 / 1e-4 / 1 / 0.02 (VGG-19), 0.1 / 1e-4 / 1 / 0.1 (DenseNet-BC); snapshots 300 (the
    code's swa_n); an epoch at least ``min_steps`` 4 steps. ``bn_stats: keep`` freezes the BatchNorm statistics
    at the checkpoint's (not the authors')."""
    tuned = _fine_tuned(ctx, "swa", models, data, lr, wd, lam, gamma, sigma, momentum, epochs, batch, snapshots,
                        min_steps, bn_stats)
    return [_load(model, moments["state"]) for model, moments in tuned]


@REFINE.register("swag", paper=SWA_PAPER + " (the Bayesian attack: SWAG samples)", norms=("linf", "l2"),
                 ranges={**SWA_RANGES, "n_models": "int [1, inf)", "scale": "[0, inf)", "beta": "[0, inf)",
                         "rank": "int [0, inf)"},
                 asset_params={"data": "train_images"})
def swag(ctx, models, *, n_models=50, scale=1.5, beta=0.0, rank=0, lr=0.05, wd=1e-4, lam=0.2, gamma=0.1,
         sigma=0.002, momentum=0.9, epochs=10, batch=512, snapshots=300, min_steps=4, data="train", bn_stats="train"):
    """Bayesian attack: ``n_models`` samples ``theta = mean + scale * sqrt(var + beta) * z`` per surrogate from the
    diagonal SWAG posterior of the same fine-tuning as ``swa`` (``var`` = mean of squares - mean^2, clamped at
    1e-30), ``z`` from the run's refine stream, BatchNorm statistics the mean's (BlackboxBench's
    ``sample_from_swag``: n_models 50, scale 1.5, beta 0, no low-rank part). The fine-tuning defaults are
    ``swa``'s (Table VII). Fuse the samples with ``longitudinal``.

    ``rank`` K >= 2 (not the paper's): full SWAG (Maddox et al., NeurIPS 2019), covariance half diagonal, half
    low rank from the deviations ``D`` of the last K snapshots: ``theta = mean + scale / sqrt(2) * (sqrt(var +
    beta) * z + D' u / sqrt(K - 1))``, ``u`` K more normals of the same draw (Maddox et al. use K = 20)."""
    if rank == 1:
        raise BenchError("refine 'swag': rank 1 has no spread (K - 1 = 0); use rank >= 2, or 0 for the diagonal "
                         "posterior")
    out = []
    for model, moments in _fine_tuned(ctx, "swag", models, data, lr, wd, lam, gamma, sigma, momentum, epochs, batch,
                                      snapshots, min_steps, bn_stats, rank):
        mean_model = _load(model, moments["state"])
        dev = moments.get("dev")
        k = 0 if dev is None else dev[0].shape[0]
        if rank and k < 2:
            raise BenchError(f"refine 'swag': rank {rank} needs at least 2 snapshots; the fine-tuning took {k} "
                             "(raise epochs or snapshots)")
        diag = scale / math.sqrt(2) if rank else scale
        scales = [diag * ((sq.to(m) - m * m).clamp_min(1e-30) + beta).sqrt()
                  for m, sq in zip(_params(mean_model), moments["sq"])]
        dev_scale = scale / math.sqrt(2 * (k - 1)) if rank else 0.0
        out += [_frozen(_noisy_copy(mean_model, ctx, scales, dev if rank else None, dev_scale))
                for _ in range(int(n_models))]
    return out


# -------------------------------------------------------------------------------------------------- DRA ----

def score_matching(model, x, y, v, scale=None):
    """(logits, per-image loss) of DRA's regulariser: sliced score matching (Song et al., UAI 2019, the
    variance-reduced form) of the classifier's class-conditional score ``s = grad_z log softmax(model)_y``,
    ``(0.5 ||s||^2 + v' (ds/dz) v) / d`` per image (``d`` values per image: the Fisher divergence per input
    dimension), ``v`` the probe directions (standard normal, the shape of ``x``).
    ``z`` is the network's own (normalized) input ``(x - mean) / scale``, so that with ``g`` the gradient in pixels
    ``s = scale * g`` and ``v' (ds/dz) v = u' (dg/dx) u`` with ``u = scale * v``. Differentiable in the model's
    parameters (two nested input gradients with ``create_graph``); ``scale`` None: pixels."""
    x = x.detach().requires_grad_(True)
    logits = model(x)
    g, = torch.autograd.grad(F.log_softmax(logits, 1).gather(1, y[:, None]).sum(), x, create_graph=True)
    u = v if scale is None else v * scale
    s = g if scale is None else g * scale
    hu, = torch.autograd.grad((g * u).sum(), x, create_graph=True)
    return logits, (0.5 * s.flatten(1).pow(2).sum(1) + (hu * u).flatten(1).sum(1)) / x[0].numel()


@REFINE.register("dra", paper="Zhu et al., Toward Understanding and Boosting Adversarial Transferability From a "
                              "Distribution Perspective, IEEE TIP 2022 (DRA)", norms=("linf", "l2"),
                 ranges={"lam": "[0, inf)", "lr": "arch [0, 10]", "wd": "arch [0, 1]", "momentum": "[0, 1)",
                         "epochs": "int [1, inf)", "decay_epoch": "int [0, inf)", "batch": "int [1, inf)",
                         "min_steps": "int [1, inf)"},
                 asset_params={"data": "train_images"})
def dra(ctx, models, *, lam=6.0, lr=0.001, wd=0.0, momentum=0.0, epochs=20, decay_epoch=10, batch=32,
        min_steps=4, data="train"):
    """DRA: each surrogate fine-tuned by SGD on cross-entropy plus ``lam`` times the sliced score matching loss
    of its class-conditional score (:func:`score_matching`), so that the gradient of log p(y|x) follows the score
    of the data distribution; one model per surrogate, attacked as it is (I-FGSM in the ``dra`` recipe). Table
    VII (ImageNet; no CIFAR-10 values): batch 32, 20 epochs, lr 0.001 divided by 10 at epoch 10
    (``decay_epoch``; 0: never), regularization constant 6. Plain SGD (no momentum, no weight decay): the table
    names no optimizer (the recipe records the choice, made on held-out images). One standard normal probe per
    image and step. The network runs in eval mode while it trains: BatchNorm normalizes with the checkpoint's
    statistics, which stay as they are, so that an image's score is its own (a batch's statistics would couple the
    images, and PyTorch's training-mode BatchNorm has no third derivative, which the parameters' gradient of the
    score's derivative needs)."""
    if not models:
        raise BenchError("refine 'dra': no surrogate models")
    train = train_data(ctx, "dra", data)
    out = []
    for model in models:
        hp = {"lam": lam, "lr": per_arch(lr, model), "wd": per_arch(wd, model), "momentum": momentum,
              "epochs": epochs, "decay_epoch": decay_epoch, "batch": batch, "min_steps": min_steps}
        seed = _seed(ctx)
        key = cache_key("dra", hp, model, train, seed, ctx.rng.device)
        out.append(_load(model, cached("refine", key, lambda: _dra_finetune(model, train, seed, **hp))))
    return out


def _dra_finetune(model, data, seed, *, lam, lr, wd, momentum, epochs, decay_epoch, batch, min_steps):
    net = _trainable(model).eval()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    batch, per, total = schedule(len(data.y), batch, epochs, min_steps)
    scale, gen = input_std(model), torch.Generator().manual_seed(seed)
    for step, (xb, yb) in enumerate(_batches(data, gen, batch, total)):
        if decay_epoch and step == per * int(decay_epoch):
            for group in opt.param_groups:
                group["lr"] = lr / 10
        v = torch.randn(xb.shape, generator=gen).to(xb)
        logits, sm = score_matching(net, xb, yb, v, None if scale is None else scale.to(xb))
        opt.zero_grad()
        (F.cross_entropy(logits, yb) + lam * sm.mean()).backward()
        opt.step()
    return _cpu_state(net)
