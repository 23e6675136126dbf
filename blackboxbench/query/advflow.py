"""AdvFlow (Dolatabadi, Erfani, Leckie, NeurIPS 2020; spec sheet S7): NES whose search distribution is a Gaussian
in the latent space of a normalizing flow trained on clean images, so that the candidates carry the structure of
natural images instead of pixel noise (paper Alg. 1).

**The attack** (the authors' ``attack.py``): the clean image is encoded once, ``z = f^-1(x)``, and a latent shift
``mu`` starts at ``mu_scale`` (0.001) times a standard normal. Each iteration draws ``n_pop`` (20) normal vectors
``e_k``, decodes ``f(z + mu + sigma e_k)`` (``sigma`` 0.1), clips to [0, 1] and projects onto the eps ball, and
queries them. The loss of a candidate is the CW margin of the log-probabilities clipped to [0, 1000] (zero once it
is adversarial); the rewards ``-loss / 2`` are standardized over the population and ``mu`` moves by
``lr / (n_pop sigma) * sum_k A_k e_k`` (``lr`` 0.02). The success check queries the projected decode of
``z + mu``: the authors do it every tenth iteration, here every iteration (``margin_step``: the engine's verified
success), so an iteration costs ``n_pop + 1`` queries instead of their 20.1. The attack-loop values are the
authors' ``config.py`` (Table VI lists only the flow's architecture; spec sheet "verify": recorded in the recipe).
A population with a refused query (past the budget) leaves ``mu`` as it is.

**The flow** (the authors' ``model.py``, Glow-style couplings in FrEIA; Table VI): on C >= 2 channels and even
sides, ``high_res_blocks`` (4) affine couplings with 3x3 convolutional sub-networks (``channels_hidden`` 128,
leaky ReLU 0.1, no batch norm), each followed by a fixed channel permutation; a 2x2 squeeze; ``low_res_blocks`` (6)
of a fixed random orthogonal 1x1 convolution, a coupling and a permutation; then the image is flattened and its
first quarter goes through ``n_blocks`` (6) couplings with fully connected sub-networks (``internal_width`` 128,
three hidden ReLU layers, dropout 0) and permutations while the rest passes through. On one channel (or odd sides)
it is the authors' MNIST flow: ``n_blocks`` permutations and fully connected couplings on the whole flattened
image. Couplings are Glow's (both halves transformed in turn) with scales soft-clamped by ``clamping`` (1.5):
``log s = 0.636 clamping atan(s' / clamping)``. Parameters start at 0.03 times a normal draw and the last layer of
every sub-network at zero (the flow starts as a fixed orthogonal map).

**Training** (the authors' ``train.py``, ``data.py`` and ``config.py``): maximum likelihood under a standard normal
latent, ``0.5 |z|^2 - log|det J|``, on batches as their CIFAR-10 loader and loop make them (:func:`training_batch`:
a horizontal flip with probability 1/2, their uniform dequantization ``(255 x + u) / 256``, ``u ~ U[0, 1)``, and
Gaussian noise of std ``noise``, 0.02); Adam (lr ``flow_lr`` 1e-4, betas 0.9/0.999, eps 1e-6, weight decay 1e-5),
batches of ``batch`` (64), one warm-up epoch at 0.02 times the lr, then the lr of their ``StepLR`` under their
torch 1.3.1 (:func:`flow_lr_at`), 0.01 times its start at the last of ``epochs`` (350). The authors train on the
50,000 CIFAR-10 training images; here on the attacker's ``train_images`` asset (never the evaluation images:
checked), ``views`` passes per epoch (the first as is, the others randomly cropped and flipped), a small flow on
split A that the leaderboard's ``trained_on`` column flags (spec sheet section 3). Trained on the run's device,
cached in ``BLACKBOXBENCH_CACHE``/flows under a hash of the architecture, the training parameters and their
revision (``TRAINING``), the images, the seed and the device type, and built once per run.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..prep.trained import augment, trained_model
from ..registry import INIT, PERTURB
from .common import bounded_calls, query_margin, start_state

PAPER = ("Dolatabadi, Erfani, Leckie, AdvFlow: Inconspicuous Black-box Adversarial Attacks using Normalizing "
         "Flows, NeurIPS 2020")
ATAN = 0.636  # FrEIA's soft clamp: 0.636 ~ 2 / pi, so |log s| < clamping
INIT_SCALE = 0.03  # the authors' init_scale
LEAKY = 0.1  # FrEIA's F_conv slope
TRAINING = 2  # train_flow's revision, in the cache key (2: the authors' flips, dequantization, lr steps)


def conv_subnet(cin, cout, hidden):
    """FrEIA's ``F_conv``: three 3x3 convolutions, leaky ReLUs between them."""
    return nn.Sequential(nn.Conv2d(cin, hidden, 3, padding=1), nn.LeakyReLU(LEAKY),
                         nn.Conv2d(hidden, hidden, 3, padding=1), nn.LeakyReLU(LEAKY),
                         nn.Conv2d(hidden, cout, 3, padding=1))


def fc_subnet(cin, cout, hidden):
    """FrEIA's ``F_fully_connected``: three hidden ReLU layers of width ``hidden`` (dropout 0)."""
    return nn.Sequential(nn.Linear(cin, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, cout))


class Coupling(nn.Module):
    """Glow's affine coupling on dim 1: the second half sets the scale and shift of the first, then the new first
    half those of the second; log-scales soft-clamped to (-clamping, clamping)."""

    def __init__(self, channels, subnet, hidden, clamping):
        super().__init__()
        self.a, self.b, self.clamping = channels // 2, channels - channels // 2, clamping
        self.net2 = subnet(self.b, 2 * self.a, hidden)
        self.net1 = subnet(self.a, 2 * self.b, hidden)

    def _scale_shift(self, net, cond, width):
        r = net(cond)
        return self.clamping * ATAN * torch.atan(r[:, :width] / self.clamping), r[:, width:]

    def forward(self, x):
        x1, x2 = x[:, :self.a], x[:, self.a:]
        s2, t2 = self._scale_shift(self.net2, x2, self.a)
        y1 = x1 * s2.exp() + t2
        s1, t1 = self._scale_shift(self.net1, y1, self.b)
        y2 = x2 * s1.exp() + t1
        return torch.cat([y1, y2], 1), s2.flatten(1).sum(1) + s1.flatten(1).sum(1)

    def inverse(self, y):
        y1, y2 = y[:, :self.a], y[:, self.a:]
        s1, t1 = self._scale_shift(self.net1, y1, self.b)
        x2 = (y2 - t1) * (-s1).exp()
        s2, t2 = self._scale_shift(self.net2, x2, self.a)
        return torch.cat([(y1 - t2) * (-s2).exp(), x2], 1)


class Permute(nn.Module):
    """A fixed permutation of dim 1 (FrEIA's ``permute_layer``, seeded by the block's index)."""

    def __init__(self, channels, seed):
        super().__init__()
        perm = torch.randperm(channels, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("perm", perm)
        self.register_buffer("inv", perm.argsort())

    def forward(self, x):
        return x[:, self.perm], x.new_zeros(x.shape[0])

    def inverse(self, y):
        return y[:, self.inv]


class Orthogonal(nn.Module):
    """A fixed random orthogonal 1x1 convolution (FrEIA's ``conv_1x1`` with the authors' ``random_orthog``):
    log-determinant 0."""

    def __init__(self, channels, gen):
        super().__init__()
        w = torch.randn(channels, channels, generator=gen, dtype=torch.float64)
        self.register_buffer("m", torch.linalg.svd(w + w.T)[0].float())

    def forward(self, x):
        return torch.einsum("oc,nchw->nohw", self.m, x), x.new_zeros(x.shape[0])

    def inverse(self, y):
        return torch.einsum("oc,nchw->nohw", torch.linalg.inv(self.m), y)  # exact for the stored matrix


class Squeeze(nn.Module):
    """2x2 space-to-depth (an i-RevNet downsampling): a permutation, log-determinant 0."""

    def forward(self, x):
        return F.pixel_unshuffle(x, 2), x.new_zeros(x.shape[0])

    def inverse(self, y):
        return F.pixel_shuffle(y, 2)


class ImageFlow(nn.Module):
    """AdvFlow's flow on images of ``shape`` (C, H, W) (see the module docstring): :meth:`forward` maps images to
    (latents (n, C*H*W), log|det J| (n,)), :meth:`decode` maps latents back to images."""

    def __init__(self, shape, *, high_res_blocks, low_res_blocks, channels_hidden, n_blocks, internal_width,
                 clamping, seed=0):
        super().__init__()
        c, h, w = shape
        self.shape, d = tuple(shape), c * h * w
        gen = torch.Generator().manual_seed(seed)
        conv = []
        if c >= 2 and h % 2 == 0 and w % 2 == 0:  # the authors' CIFAR-10 / ImageNet flow
            for k in range(high_res_blocks):
                conv += [Coupling(c, conv_subnet, channels_hidden, clamping), Permute(c, k)]
            conv.append(Squeeze())
            for k in range(low_res_blocks):
                conv += [Orthogonal(4 * c, gen), Coupling(4 * c, conv_subnet, channels_hidden, clamping),
                         Permute(4 * c, k)]
            self.width = d // 4
            fc = [m for k in range(n_blocks) for m in (Coupling(self.width, fc_subnet, internal_width, clamping),
                                                       Permute(self.width, k))]
        else:  # the authors' MNIST flow
            self.width = d
            fc = [m for k in range(n_blocks) for m in (Permute(d, k), Coupling(d, fc_subnet, internal_width,
                                                                                 clamping))]
        self.conv, self.fc = nn.ModuleList(conv), nn.ModuleList(fc)
        for p in self.parameters():  # the authors' init_model
            p.data = INIT_SCALE * torch.randn(p.shape, generator=gen)
        for m in self.modules():
            if isinstance(m, Coupling):
                for net in (m.net1, m.net2):
                    nn.init.zeros_(net[-1].weight)
                    nn.init.zeros_(net[-1].bias)

    def forward(self, x):
        logdet = x.new_zeros(x.shape[0])
        for m in self.conv:
            x, ld = m(x)
            logdet = logdet + ld
        x = x.flatten(1)
        head, rest = x[:, :self.width], x[:, self.width:]
        for m in self.fc:
            head, ld = m(head)
            logdet = logdet + ld
        return torch.cat([head, rest], 1), logdet

    def decode(self, z):
        head, rest = z[:, :self.width], z[:, self.width:]
        for m in reversed(self.fc):
            head = m.inverse(head)
        c, h, w = self.shape
        x = torch.cat([head, rest], 1)
        x = x.view(-1, 4 * c, h // 2, w // 2) if self.conv else x.view(-1, c, h, w)
        for m in reversed(self.conv):
            x = m.inverse(x)
        return x


def nll(flow, x):
    """The negative log-likelihood of ``x`` under ``flow`` and a standard normal latent, per image, without the
    constant (the authors' training loss)."""
    z, logdet = flow(x)
    return 0.5 * z.pow(2).sum(1) - logdet


def flow_lr_at(epoch, flow_lr, epochs):
    """The learning rate of ``epoch`` (-1: the warm-up) in the authors' ``train.py``: 0.02 x ``flow_lr`` for the
    warm-up, then their ``StepLR`` (gamma = 0.01^(1 / ``epochs``), one step after every epoch). Under their torch
    1.3.1 a step sets ``flow_lr`` x gamma^k after k steps, so the warm-up's step already gives epoch 0 gamma^1 and
    the last epoch runs at 0.01 x ``flow_lr``."""
    return 0.02 * flow_lr if epoch < 0 else flow_lr * 0.01 ** ((epoch + 1) / epochs)


def training_batch(xb, noise, gen):
    """A training batch as the authors' CIFAR-10 loader and loop make it from images ``xb`` in [0, 1]: each image
    flipped horizontally with probability 1/2 (``RandomHorizontalFlip``), then, when ``noise`` > 0 (their
    ``add_image_noise``), their uniform dequantization ``(255 x + u) / 256`` and Gaussian noise of std ``noise``;
    draws from the CPU generator ``gen``."""
    flip = (torch.rand(len(xb), generator=gen) < 0.5).to(xb.device)
    xb = torch.where(flip.view(-1, 1, 1, 1), xb.flip(3), xb)
    if noise > 0:
        u = torch.rand(xb.shape, generator=gen).to(xb.device)
        xb = (255 * xb + u) / 256 + noise * torch.randn(xb.shape, generator=gen).to(xb.device)
    return xb


def train_flow(x, arch, *, epochs, views, flow_lr, batch, noise, seed):
    """The state dict of an :class:`ImageFlow` of ``arch`` trained on ``x`` (n, C, H, W) on its device (see the
    module docstring), deterministic in ``seed``, and its final negative log-likelihood in bits per dimension on
    ``x``."""
    gen = torch.Generator().manual_seed(seed)
    flow = ImageFlow(x.shape[1:], **arch, seed=seed).to(x.device)
    opt = torch.optim.Adam(flow.parameters(), lr=flow_lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-5)
    for epoch in range(-1, epochs):  # epoch -1: the authors' warm-up
        for group in opt.param_groups:
            group["lr"] = flow_lr_at(epoch, flow_lr, epochs)
        data = torch.cat([x] + [augment(x, gen) for _ in range(views - 1)])
        for idx in torch.randperm(len(data), generator=gen).split(batch):
            loss = nll(flow, training_batch(data[idx.to(x.device)], noise, gen)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        bits = nll(flow, x).mean() / (x[0].numel() * math.log(2))
    return {"state": {k: v.detach().cpu().clone() for k, v in flow.state_dict().items()},
            "bits_per_dim": bits.reshape(1).cpu()}


def trained_flow(ctx, data, arch, hp):
    """The frozen flow of ``arch`` trained with ``hp`` on the ``train_images`` asset ``data``, on the run's
    device: cached on disk and built once per run."""
    return trained_model(ctx, "advflow", "flows", data, {**arch, **hp, "training": TRAINING},
                         lambda shape: ImageFlow(shape, **arch, seed=hp["seed"]), lambda x: train_flow(x, arch, **hp))


# ------------------------------------------------------------------------------------------------ blocks ----

@INIT.register("advflow_init", paper=PAPER, norms=("linf", "l2"), ranges={"mu_scale": "[0, inf)"})
def advflow_init(ctx, *, mu_scale=0.001):
    """The clean image (one query) with the latent shift ``mu`` = ``mu_scale`` x a normal draw (the authors'
    0.001) and the latent of the clean image still to compute (``z`` NaN: the perturb block encodes it)."""
    x = ctx.problem.x
    d = x[0].numel()
    return start_state(ctx, x.clone(), mu=mu_scale * ctx.rng.normal((d,)).to(x.device),
                       z=torch.full((x.shape[0], d), float("nan"), device=x.device))


def population_step(ctx, z, mu, decode, *, n_pop, sigma, lr):
    """AdvFlow's NES update of the latent shifts ``mu`` (n, D) around the latents ``z``: ``n_pop`` decoded and
    projected candidates per sample, queried in calls of whole samples of about ``PROBE_VALUES`` values (one call
    on CIFAR-10; at 299 x 299 a sample's population is 20 images and its decode's temporaries several times that,
    so one call for every slot grew by about 190 MB a slot); returns the new ``mu``."""
    problem = ctx.problem
    n, d = mu.shape
    new = mu.clone()
    for sel in bounded_calls(torch.ones(n, dtype=torch.long, device=mu.device), n_pop * d):
        m = sel.numel()
        e = ctx.rng.normal((n_pop, d), rows=sel).to(mu.device)
        idx = sel.repeat_interleave(n_pop)
        candidates = problem.sub(idx).project(decode((z[sel] + mu[sel])[:, None] + sigma * e).clamp(0, 1))
        margin, _, ok = query_margin(ctx, candidates, idx)
        reward = -0.5 * margin.clamp(0, 1000).view(m, n_pop)
        ok = ok.view(m, n_pop).all(1)
        reward = torch.where(ok[:, None], reward, 0.0)  # a refused query: no step
        a = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-10)
        new[sel] = mu[sel] + lr / (n_pop * sigma) * torch.einsum("nk,nkd->nd", a, e)
    return new


@PERTURB.register("advflow", paper=PAPER, norms=("linf", "l2"), asset_params={"data": "train_images"},
                  ranges={"n_pop": "int [2, inf)", "sigma": "(0, inf)", "lr": "(0, inf)",
                          "high_res_blocks": "int [0, inf)", "low_res_blocks": "int [0, inf)",
                          "channels_hidden": "int [1, inf)", "n_blocks": "int [0, inf)",
                          "internal_width": "int [1, inf)", "clamping": "(0, inf)", "epochs": "int [1, inf)",
                          "views": "int [1, inf)", "flow_lr": "(0, inf)", "batch": "int [1, inf)",
                          "noise": "[0, inf)", "seed": "int [0, inf)"})
def advflow(ctx, state, *, n_pop=20, sigma=0.1, lr=0.02, data="train", high_res_blocks=4, low_res_blocks=6,
            channels_hidden=128, n_blocks=6, internal_width=128, clamping=1.5, epochs=350, views=1, flow_lr=1e-4,
            batch=64, noise=0.02, seed=0):
    """One AdvFlow iteration: the NES update of ``mu`` from ``n_pop`` latent candidates, then the projected
    decode of ``z + mu`` as the new point (see the module docstring for every parameter)."""
    arch = {"high_res_blocks": int(high_res_blocks), "low_res_blocks": int(low_res_blocks),
            "channels_hidden": int(channels_hidden), "n_blocks": int(n_blocks),
            "internal_width": int(internal_width), "clamping": float(clamping)}
    hp = {"epochs": int(epochs), "views": int(views), "flow_lr": float(flow_lr), "batch": int(batch),
          "noise": float(noise), "seed": int(seed)}
    flow = trained_flow(ctx, data, arch, hp)
    problem, z = ctx.problem, state["z"]
    fresh = torch.isnan(z[:, 0])
    with torch.no_grad():
        if fresh.any():
            z = torch.where(fresh[:, None], flow(problem.x)[0], z)

        def decode(latents):
            return flow.decode(latents.reshape(-1, z.shape[1]))

        mu = population_step(ctx, z, state["mu"], decode, n_pop=n_pop, sigma=sigma, lr=lr)
        x_new = problem.project(decode(z + mu).clamp(0, 1))
    return {"x_adv": x_new, "mu": mu, "z": z}
