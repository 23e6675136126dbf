"""Learned probe priors of HSJA-style decision attacks (spec sheet D8 and D9, work package 6a): HopSkipJumpAttack
whose gradient-estimation probes are decodes of random latent codes through an auto-encoder trained to reconstruct
the input gradients of white-box reference models (the run's ``surrogates``).

* **NonLinear-BA** (Li et al., AISTATS 2021), block ``nonlinear_ba``: HSJA (``hsja.py``, Table V's values) with the
  probes ``u_b = Dec(z_b)``, ``z_b`` standard normal scaled to unit norm (the authors' ``generate_ps``).
* **PSBA** (Zhang et al., ICML 2021), blocks ``psba_init`` / ``psba``: the same estimate at a spatial *scale*: the
  auto-encoder works on gradients resized to ``side x side`` and its decodes are resized back to the image. Each
  sample picks its scale progressively at its first iteration (see :func:`pick_scale`), without a query.

**The auto-encoder** is the authors' CIFAR-10 generator (``cifar10_ae_generator.py``, "AE192"): stride-2 4x4
convolutions 3 -> 12 -> 24 -> 48 channels down to 4 x 4, a 4x4 convolution (stride 2, padding 3) to a 12 x 4 x 4
code, ReLUs, the transposed mirror as decoder, code and output scaled to unit L2 norm. At ``side`` 32 it is exactly
theirs; ``side`` 16 and 8 drop the first one and two down/up layers (same 12 x 4 x 4 code). Table V names
"AE9408" for both attacks: the authors' 224 x 224 generator (a 48 x 14 x 14 code); on 32 x 32 their code uses AE192.

**Training** (``train_cifar10_ae_generator.py``, ``gradient_generate.py``): the targets are each reference model's
input gradient of the cross-entropy at its own predicted label, on the attacker's ``train_images`` (never the
evaluation images: checked), scaled to unit norm; the loss is the MSE between unit-norm output and target; Adam,
learning rate 1e-3, batches of 32, as the authors. They train on 5 models x 50,000 CIFAR-10 training images for up
to 100 epochs; here ``views`` passes over the declared images (the first as is, the others randomly cropped and
flipped as CIFAR's loaders) times the surrogates, for ``epochs`` epochs (spec sheet section 3: a small prior on
split A, flagged by the leaderboard's ``trained_on`` column). The trained weights are cached in
``BLACKBOXBENCH_CACHE``/priors under a hash of its side, ``AE_VERSION`` and training parameters, the surrogates'
weights, the images, ``seed`` and the device type; within a run, a block trains or loads them once
(:func:`trained_decoders`).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..prep.trained import augment, cache_key, cached, once_per_run, train_data
from ..registry import INIT, PERTURB
from ..rng import seeded
from ..threat import per_sample
from .common import add_rows_, bounded_calls, l2_normalize
from .hsja import hsja_init, hsja_step
from .prgf import surrogate_gradient, surrogate_loss

NLBA = ("Li, Li, Xu, Zhang, Yang, Li, Nonlinear Projection Based Gradient Estimation for Query Efficient Blackbox "
        "Attacks, AISTATS 2021")
PSBA = ("Zhang, Li, Li, Zhang, Yang, Li, Progressive-Scale Boundary Blackbox Attack via Projective Gradient "
        "Estimation, ICML 2021")
CODE = (12, 4, 4)  # the authors' CIFAR-10 code: 192 numbers
WIDTHS = (12, 24, 48)  # channels after each stride-2 layer of the encoder (side 32)
TRAININGS = 4  # trainings of an auto-encoder tried before a dead code is an error (see train_ae)
AE_VERSION = 2  # in the cache key: 2, the dead-code check (version 1 could cache a dead auto-encoder)
HSJA_RANGES = {"init_num_evals": "int [1, inf)", "max_num_evals": "int [1, inf)",
               "stepsize_search": ("geometric_progression", "grid_search")}
TRAIN_RANGES = {"epochs": "int [1, inf)", "views": "int [1, inf)", "lr": "(0, inf)", "batch": "int [1, inf)",
                "seed": "int [0, inf)"}


# ------------------------------------------------------------------------------------------ auto-encoder ----

class GradientAE(nn.Module):
    """The authors' CIFAR-10 gradient auto-encoder (see the module docstring) on ``channels`` x ``side`` x
    ``side`` inputs; ``side`` is 8, 16 or 32 (4 x 2^k)."""

    def __init__(self, channels, side):
        super().__init__()
        downs = int(math.log2(side // 4)) if side >= 8 else 0
        if side < 8 or side != 4 * 2 ** downs or downs > len(WIDTHS):
            raise BenchError(f"gradient auto-encoder: side must be 8, 16 or 32, got {side}")
        widths = (channels,) + WIDTHS[len(WIDTHS) - downs:]
        enc, dec = [], []
        for a, b in zip(widths, widths[1:]):
            enc += [nn.Conv2d(a, b, 4, stride=2, padding=1), nn.ReLU()]
        enc += [nn.Conv2d(widths[-1], CODE[0], 4, stride=2, padding=3), nn.ReLU()]
        dec += [nn.ConvTranspose2d(CODE[0], widths[-1], 4, stride=2, padding=3), nn.ReLU()]
        for a, b in zip(widths[::-1], widths[-2::-1]):
            dec += [nn.ConvTranspose2d(a, b, 4, stride=2, padding=1), nn.ReLU()]
        self.encoder, self.decoder = nn.Sequential(*enc), nn.Sequential(*dec[:-1])
        self.side = side

    def decode(self, code):
        return l2_normalize(self.decoder(code))

    def forward(self, v):
        return self.decode(l2_normalize(self.encoder(v)))


def resize(v, hw):
    """(m, C, h, w) -> (m, C, *hw): area averaging when shrinking, bilinear (``align_corners`` False) otherwise."""
    if tuple(v.shape[-2:]) == tuple(hw):
        return v
    if hw[0] <= v.shape[-2] and hw[1] <= v.shape[-1]:
        return F.interpolate(v, size=tuple(hw), mode="area")
    return F.interpolate(v, size=tuple(hw), mode="bilinear", align_corners=False)


def reference_gradients(models, x, views, gen):
    """Unit-norm input gradients of each model's cross-entropy at its own predicted label (the authors'
    ``calc_gt_grad``), on ``x`` and on ``views - 1`` randomly cropped and flipped copies of it: (views * K * N, ...)."""
    out = []
    for v in range(views):
        xv = x if v == 0 else augment(x, gen)
        for model in models:
            with torch.no_grad():
                pred = model(xv).argmax(1)
            out.append(surrogate_gradient([model], xv, lambda k, logits, rows: -surrogate_loss(
                logits, pred[rows], kind="ce")))
    return l2_normalize(torch.cat(out))


def train_ae(grads, side, *, epochs, lr, batch, seed):
    """The state dict of a :class:`GradientAE` trained on ``grads`` (N, C, H, W) resized to ``side`` (on the CPU,
    one thread, deterministic in ``seed``), its mean cosine between decode and target on them, and ``restarts``.

    A training can end with a dead code: the encoder's last ReLU is zero for every training gradient, the decoder
    has only seen zeros, and every decode is one fixed direction whatever the code (measured: ResNet-32/44/56's
    gradients on the 200 ``train_images``, side 32, seed 0; decode cosine 0.01 instead of 0.37). Such a training
    starts again from the next initialisation of the same seeded streams, up to ``TRAININGS`` in all (the first
    training is the one an unchecked run makes), then stops with a one-line error."""
    target = l2_normalize(resize(grads.detach().float().cpu(), (side, side)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with seeded(seed):
            gen = torch.Generator().manual_seed(seed)
            for restarts in range(TRAININGS):
                net = GradientAE(target.shape[1], side)
                opt = torch.optim.Adam(net.parameters(), lr=lr)
                for _ in range(epochs):
                    for idx in torch.randperm(len(target), generator=gen).split(batch):
                        loss = F.mse_loss(net(target[idx]), target[idx])
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                with torch.no_grad():
                    if (net.encoder(target) > 0).any():
                        break
            else:
                raise BenchError(f"gradient auto-encoder (side {side}, seed {seed}, lr {lr:g}): every code unit was "
                                 f"zero on every training gradient after each of {TRAININGS} trainings; try another "
                                 "seed or a smaller lr")
        with torch.no_grad():
            cos = (net(target) * target).flatten(1).sum(1).mean()
    finally:
        torch.set_num_threads(threads)
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "cos": cos.reshape(1),
            "restarts": torch.tensor([restarts])}


def trained_decoders(ctx, block, data, sides, hp):
    """The frozen :class:`GradientAE` of each of ``sides``, trained on the ``train_images`` asset ``data`` against
    the run's surrogates with training parameters ``hp``, on the run's device: cached on disk (see the module
    docstring; the gradients are computed once for every side that is not) and, within a run, kept by the identity
    of the run's asset and surrogates so that later steps reuse them."""
    if not ctx.surrogates:
        raise BenchError(f"'{block}' needs white-box surrogates (config key surrogates:)")
    images = ctx.assets.get(data)
    key = ("gradient_ae", id(images), tuple(map(id, ctx.surrogates)), tuple(sides), tuple(sorted(hp.items())),
           str(ctx.device))
    return once_per_run(key, (images, ctx.surrogates), lambda: _decoders(ctx, block, data, sides, hp))


def _decoders(ctx, block, data, sides, hp):
    images = train_data(ctx, block, data)
    grads = []

    def train(side):
        if not grads:
            gen = torch.Generator().manual_seed(hp["seed"])
            grads.append(reference_gradients(ctx.surrogates, images.x.to(ctx.device), hp["views"], gen))
        return train_ae(grads[0], side, epochs=hp["epochs"], lr=hp["lr"], batch=hp["batch"], seed=hp["seed"])

    nets = []
    for side in sides:
        disk = cache_key("gradient_ae", {"side": side, "version": AE_VERSION, **hp}, list(ctx.surrogates), images,
                         hp["seed"], ctx.device)
        net = GradientAE(images.x.shape[1], side)
        net.load_state_dict(cached("priors", disk, lambda: train(side))["state"])
        nets.append(net.to(ctx.device).eval().requires_grad_(False))
    return nets


def decode(net, ctx, owner, shape):
    """(m, *shape) probe directions for rows of local samples ``owner``: unit-norm codes drawn from each sample's
    stream, decoded and resized to the image."""
    code = l2_normalize(ctx.rng.normal(CODE, rows=owner).to(ctx.device))
    with torch.no_grad():
        return resize(net.decode(code), shape[-2:])


def _hp(epochs, views, lr, batch, seed):
    return {"epochs": int(epochs), "views": int(views), "lr": float(lr), "batch": int(batch), "seed": int(seed)}


# -------------------------------------------------------------------------------------------- NonLinear-BA ----

@PERTURB.register("nonlinear_ba", paper=NLBA, norms=("linf", "l2"), needs=("surrogates",),
                  asset_params={"data": "train_images"},
                  ranges={**HSJA_RANGES, **TRAIN_RANGES, "side": (8, 16, 32)})
def nonlinear_ba(ctx, state, *, init_num_evals=100, max_num_evals=10000, stepsize_search="geometric_progression",
                 data="train", side=32, epochs=30, views=4, lr=1e-3, batch=32, seed=0):
    """One HSJA iteration (Table V's HSJA values) whose probes are decodes of the gradient auto-encoder of ``side``
    trained on the ``train_images`` asset ``data`` against the surrogates (see the module docstring)."""
    net, = trained_decoders(ctx, "nonlinear_ba", data, [side], _hp(epochs, views, lr, batch, seed))
    return hsja_step(ctx, state, lambda owner, shape: decode(net, ctx, owner, shape), init_num_evals,
                     max_num_evals, stepsize_search)


# ---------------------------------------------------------------------------------------------------- PSBA ----

@INIT.register("psba_init", paper=PSBA, norms=("linf", "l2"),
               ranges={"gamma": "(0, inf)", "init_tries": "int [0, inf)"})
def psba_init(ctx, *, gamma=1.0, init_tries=100):
    """HSJA's start (``hsja_init``), with every sample's scale not yet picked (``scale`` -1)."""
    state = hsja_init(ctx, gamma=gamma, init_tries=init_tries)
    state["scale"] = torch.full((ctx.problem.n,), -1, dtype=torch.long, device=ctx.device)
    return state


def pick_scale(ctx, nets, x, probes):
    """(n,) the scale index of each sample of ``ctx`` at its points ``x``: PSBA's search for the best scale, with
    the surrogates standing in for the target's gradient (no query).

    For every scale, from the coarsest, the sample's own ``probes`` directions estimate the normal the way HSJA
    does, with the decisions of the linearized boundary (the sign of each probe's product with the surrogates'
    gradient ``g`` of the attack's cross-entropy at ``x``); the sample takes the scale whose estimate has the
    largest cosine with ``g`` (the first on a tie). Stopping at the first scale whose cosine does not grow, as
    before, assumed a cosine that rises then falls with the scale; the trained auto-encoders do not give one
    (CIFAR-10, ResNet-32/44/56: 0.08 / 0.07 / 0.24 at sides 8 / 16 / 32), and that rule kept most samples at
    side 8. The probes come in pieces of whole samples of about ``PROBE_VALUES`` values (one on CIFAR-10; at
    299 x 299 a sample's 100 decodes are 107 MB and their temporaries several times that), every scale of a piece
    before the next piece, so a sample's draws do not depend on its batch.
    """
    problem = ctx.problem
    n = problem.n
    if len(nets) == 1:
        return torch.zeros(n, dtype=torch.long, device=x.device)
    g = l2_normalize(surrogate_gradient(ctx.surrogates, x, lambda k, logits, rows: surrogate_loss(
        logits, problem.y[rows], None if problem.target is None else problem.target[rows], kind="ce")))
    cos = torch.empty((n, len(nets)), device=x.device)
    for sel in bounded_calls(torch.ones(n, dtype=torch.long, device=x.device), probes * x[0].numel()):
        owner = sel.repeat_interleave(probes)
        local = torch.arange(sel.numel(), device=x.device).repeat_interleave(probes)
        for k, net in enumerate(nets):
            u = l2_normalize(decode(net, ctx, owner, x.shape[1:]))
            s = torch.sign((u.flatten(1) * g[owner].flatten(1)).sum(1))
            est = add_rows_(torch.zeros_like(g[sel]), local, per_sample(s, u) * u)
            cos[sel, k] = (l2_normalize(est) * g[sel]).flatten(1).sum(1)
    return cos.argmax(1)


def decode_at(nets, scale, ctx, owner, shape):
    """Probe directions for rows ``owner``, each from the scale ``scale[owner]`` of its sample."""
    out = torch.empty((owner.numel(), *shape), device=ctx.device)
    for k, net in enumerate(nets):
        rows = (scale[owner] == k).nonzero().squeeze(1)
        if rows.numel():
            out[rows] = decode(net, ctx, owner[rows], shape)
    return out


@PERTURB.register("psba", paper=PSBA, norms=("linf", "l2"), needs=("surrogates",),
                  asset_params={"data": "train_images"},
                  ranges={**HSJA_RANGES, **TRAIN_RANGES, "sides": (8, 16, 32), "pick_probes": "int [1, inf)"})
def psba(ctx, state, *, init_num_evals=100, max_num_evals=10000, stepsize_search="geometric_progression",
         data="train", sides=(8, 16, 32), pick_probes=100, epochs=30, views=4, lr=1e-3, batch=32, seed=0):
    """One HSJA iteration whose probes come from the gradient auto-encoder of each sample's scale (``sides``, each
    8, 16 or 32, searched coarsest first whatever their order; one auto-encoder per side, trained as
    ``nonlinear_ba``'s). A sample picks its scale at its first iteration from the boundary point
    (:func:`pick_scale`, ``pick_probes`` simulated probes, no query)."""
    sides = sorted({int(s) for s in sides})
    nets = trained_decoders(ctx, "psba", data, sides, _hp(epochs, views, lr, batch, seed))
    scale = state["scale"]
    new = (scale < 0) & torch.isfinite(state["dist"])
    if new.any():
        rows = new.nonzero().squeeze(1)
        scale = scale.clone()
        scale[rows] = pick_scale(ctx.sub(rows), nets, state["x_bd"][rows], pick_probes)
    out = hsja_step(ctx, state, lambda owner, shape: decode_at(nets, scale, ctx, owner, shape), init_num_evals,
                    max_num_evals, stepsize_search)
    return {**out, "scale": scale}
