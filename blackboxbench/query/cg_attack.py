"""CG-Attack (Feng, Wu, Fan, Liu, Li, Xia, CVPR 2022; spec sheet S12): an evolution strategy over the latent space
of a conditional Glow (c-Glow) that models the surrogates' conditional adversarial distribution (CAD) of a
perturbation given the clean image. The c-Glow's mapping is learned on the surrogates and frozen; only the latent
search distribution adapts to the target ("partial transfer", BlackboxBench Supp. G and I, eq. I.5).

**The c-Glow** (the authors' ``CGlowModel.py`` and ``modules.py``; Table VI: ``x_hidden_channels`` 64,
``x_hidden_size`` 128, ``y_hidden_channels`` 256, ``flow_depth`` K 8, ``num_levels`` L 3, ``learn_top`` False):
L levels of a 2x2 squeeze, K steps and (but at the last level) a split whose second half gets a Gaussian prior
whose mean and log-scale a 3x3 convolution of the first half gives; the top latent has a standard normal prior.
A step is a conditional actnorm (per-channel log-scale and bias), a conditional 1x1 convolution (a C x C matrix per
image) and an affine coupling. The actnorm's and the matrix's numbers come from the clean image through three 2x2
stride-2 convolutions (``x_hidden_channels``), two hidden linear layers (``x_hidden_size``) and a tanh; the
coupling's network sees the first half concatenated with image features resized to the level's side, and gives a
shift and a scale ``sigmoid(h + 2)`` for the second half (3x3 and 1x1 convolutions of ``y_hidden_channels`` with
actnorms, a zero-initialised 3x3 output, tanh). Two departures from the authors' initialisation, both recorded
in the recipe: (1) they start the conditioners' convolutions and hidden layers at zero, which leaves them without a
gradient (their actnorm and 1x1 convolution are then unconditional); here those layers start at PyTorch's default
initialisation so that the image conditions them, as the c-Glow paper describes; (2) their 1x1 matrix is
``tanh`` of a layer drawn with std 0.1, a near-singular C x C matrix whose inverses, chained over the steps, make a
decode from a unit latent reach 1e8 (every training clamp then saturates and passes no gradient); here the matrix
is a learned one starting as a random rotation (Glow's initialisation) plus the conditioner's ``tanh`` output,
which starts at zero. Everything else is initialised as theirs.

**Training** (the authors' ``RLearner.py`` with Table VI's ``only`` True, ``clamp`` True, ``tanh`` False,
``margin`` 20, ``lr`` 2e-4, ``max_grad_norm`` 10, ``max_grad_clip`` 0, ``regularizer`` 0): a perturbation is
decoded from the top latent 0 (their sampler draws it with standard deviation ``logs`` = 0: the prior's mean) and
split latents drawn from their priors; Linf clamps ``eps`` times it to the eps ball (the authors clamp the decode
itself at eps: a unit-scale decode then saturates the 8/255 clamp in about 98 % of its pixels, which pass no
gradient; measuring the decode in units of eps changes no candidate of the attack, which takes its sign), L2
scales it into the ball, and the loss is
the surrogates' mean CW margin on the logits, floored at ``-margin`` (``only``: no likelihood term, the
energy-model KL of eq. I.8 with all its weight on the adversarial loss). Adam (betas 0.9/0.9999), gradient norm
clipped to ``max_grad_norm``. The authors train 50 epochs on the 50,000 CIFAR-10 training images with batches of 2
(their training script's default; Table VI lists none); here on the attacker's ``train_images`` asset (never the
evaluation images: checked) against the run's ``surrogates``, cached in ``BLACKBOXBENCH_CACHE``/cglow under a hash
of the architecture, the training parameters, the surrogates' weights, the images, the threat, the seed and the
device type, and built once per run.

**The attack** (Supp. I eq. I.5 and the authors' ``run_attack.py``; Table VI lists no attack-loop values, spec
sheet "verify"): each sample draws its split latents once from their priors (the authors' start: a decode from the
top latent 0, encoded back) and CMA-ES searches the top latent with ``n_pop`` (20) candidates per generation, from
the c-Glow's own latent distribution: mean 0 and step ``sigma`` 1 (eq. I.5's ``z = mu + sigma z0``, the transferred
CAD at the start; the spec sheet's mu = 0, sigma = 1). The authors' script starts at 1e5, on a c-Glow whose
near-singular 1x1 matrices make a unit latent decode to about 1e8 (see above); on this well-conditioned one, 1e5
drowns every learned shift on the digits (samples at 1e5 fool the target no more often than random signs, 3 %; at
1 four times as often, 12 %), while on CIFAR-10 (``configs/cifar10_cg_attack.yaml``) both steps give the same ASR
and queries. A candidate is ``x + eps sign(decode)`` (L2: ``eps decode / |decode|``)
clipped to [0, 1], its fitness the target's CW margin floored at -20. The authors run pycma's full-covariance
CMA-ES one image at a time; here a batched separable CMA-ES (Ros and Hansen 2008: diagonal covariance, learning
rates scaled by (N + 2) / 3): at the top latent's 768 dimensions, pycma's full covariance moves by about 3e-6 per
generation and stays near the identity over a 10,000-query budget (500 generations). The clean image is the first
query (the init cannot decode: the perturb block builds the c-Glow), the c-Glow's mode the second: a sample's first
perturb call queries ``x + eps sign(decode)`` at the top latent 0 and its split latents alone, without an ES
update (the authors' start, their first query, which stops the attack when it fools the target), so a sample
fooled there costs 2 queries (theirs 1) where it cost 22 (the clean image and a whole generation); each
generation's best candidate is kept when it beats the best so far (no extra query: ``es_best``), and a success is
the oracle's answer on that exact image.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..prep.trained import augment, cache_key, cached, once_per_run, train_data
from ..registry import ACCEPT, INIT, PERTURB
from ..rng import seeded
from ..threat import margin_loss, project
from .common import bounded_calls, keep_better, l2_normalize, merge_proposal, query_margin, start_state
from .prgf import surrogate_gradient, surrogate_loss

PAPER = ("Feng, Wu, Fan, Liu, Li, Xia, Boosting Black-box Attack with Partially Transferred Conditional Adversarial "
         "Distribution, CVPR 2022")
SCALE_OFFSET = 2.0  # the coupling's scale is sigmoid(h + 2)
LOGSCALE_FACTOR = 3.0  # the coupling's output layer: (conv + b) * exp(3 logs)
FLOOR = 20.0  # the attack's fitness: the margin floored at -20 (run_attack.py's threshold)


# ------------------------------------------------------------------------------------------------ c-Glow ----

def check_sides(shape, num_levels, where):
    """A one-line error unless the sides of ``shape`` (C, H, W) are multiples of the c-Glow's ``2 ^ num_levels``
    and of its conditioners' 8 (``where`` names the block)."""
    k = 2 ** max(num_levels, 3)
    if shape[1] % k or shape[2] % k:
        raise BenchError(f"{where}: image sides {shape[1]} x {shape[2]} must be multiples of {k} (num_levels "
                         f"{num_levels}, the conditioners' 8)")


def _normal_(module, std):
    nn.init.normal_(module.weight, std=std)
    if module.bias is not None:
        nn.init.normal_(module.bias, std=std)
    return module


def _zero(module):
    nn.init.zeros_(module.weight)
    nn.init.zeros_(module.bias)
    return module


class Conditioner(nn.Module):
    """Image -> ``out`` numbers in (-1, 1): three 2x2 stride-2 convolutions, two hidden linear layers, tanh (the
    authors' ``x_Con`` and ``x_Linear``), the last layer starting at zero (the step starts unconditional)."""

    def __init__(self, x_shape, channels, size, out):
        super().__init__()
        c, h, w = x_shape
        self.conv = nn.Sequential(nn.Conv2d(c, channels, 2, stride=2), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 2, stride=2), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 2, stride=2), nn.ReLU())
        self.linear = nn.Sequential(nn.Linear(channels * (h // 8) * (w // 8), size), nn.ReLU(),
                                    nn.Linear(size, size), nn.ReLU(),
                                    _zero(nn.Linear(size, out)), nn.Tanh())

    def forward(self, x):
        return self.linear(self.conv(x).flatten(1))


class ActNorm(nn.Module):
    """Glow's actnorm inside the coupling network: ``(x + bias) exp(logs)``, both starting at N(0, 0.05^2)."""

    def __init__(self, channels):
        super().__init__()
        self.bias = nn.Parameter(0.05 * torch.randn(1, channels, 1, 1))
        self.logs = nn.Parameter(0.05 * torch.randn(1, channels, 1, 1))

    def forward(self, x):
        return (x + self.bias) * self.logs.exp()


class ZeroOut(nn.Conv2d):
    """The coupling's zero-initialised 3x3 output: ``(conv(x) + b) exp(3 logs)``."""

    def __init__(self, cin, cout):
        super().__init__(cin, cout, 3, padding=1)
        _zero(self)
        self.newbias = nn.Parameter(torch.zeros(cout, 1, 1))
        self.logs = nn.Parameter(torch.zeros(cout, 1, 1))

    def forward(self, x):
        return (super().forward(x) + self.newbias) * (LOGSCALE_FACTOR * self.logs).exp()


def _cross(h):
    """The authors' ``split_feature(h, "cross")``: even and odd channels."""
    return h[:, 0::2], h[:, 1::2]


class Step(nn.Module):
    """One c-Glow step on C channels at side ``hw``: conditional actnorm, conditional 1x1 convolution, affine
    coupling. :meth:`condition` computes its image-dependent numbers once per image."""

    def __init__(self, x_shape, channels, hw, x_channels, x_size, y_channels):
        super().__init__()
        c, half = channels, channels // 2
        self.c = c
        self.act = Conditioner(x_shape, x_channels, x_size, 2 * c)
        self.mix = Conditioner(x_shape, x_channels, x_size, c * c)
        self.rotation = nn.Parameter(torch.linalg.qr(torch.randn(c, c))[0])
        stride = x_shape[1] // hw
        self.resize_x = nn.Sequential(_normal_(nn.Conv2d(x_shape[0], 16, 3, padding=1), 0.1), nn.ReLU(),
                                      _zero(nn.Conv2d(16, half, stride, stride=stride)), nn.ReLU(),
                                      _normal_(nn.Conv2d(half, half, 3, padding=1), 0.1), nn.ReLU())
        self.f = nn.Sequential(_conv_norm(c, y_channels, 3), ActNorm(y_channels), nn.ReLU(),
                               _conv_norm(y_channels, y_channels, 1), ActNorm(y_channels), nn.ReLU(),
                               ZeroOut(y_channels, 2 * (c - half)), nn.Tanh())

    def condition(self, x, inverse):
        """(actnorm log-scales and biases (n, C, 1, 1), the 1x1 matrices (n, C, C) or their inverses, their
        log|det| (n,), the coupling's image features)."""
        logs, bias = _cross(self.act(x)[:, :, None, None])
        w = self.rotation + self.mix(x).view(-1, self.c, self.c)
        logdet = torch.linalg.slogdet(w)[1]
        if inverse:
            w = torch.linalg.inv(w.double()).to(w.dtype)
        return logs, bias, w, logdet, self.resize_x(x)

    def _shift_scale(self, feat, y1):
        shift, scale = _cross(self.f(torch.cat([feat, y1], 1)))
        return shift, torch.sigmoid(scale + SCALE_OFFSET)

    def forward(self, cond, y):
        logs, bias, w, wlogdet, feat = cond
        hw = y.shape[2] * y.shape[3]
        y = (y + bias) * logs.exp()
        y = torch.einsum("nij,njhw->nihw", w, y)
        y1, y2 = y[:, :self.c // 2], y[:, self.c // 2:]
        shift, scale = self._shift_scale(feat, y1)
        y2 = (y2 + shift) * scale
        logdet = hw * (logs.flatten(1).sum(1) + wlogdet) + scale.log().flatten(1).sum(1)
        return torch.cat([y1, y2], 1), logdet

    def inverse(self, cond, y):
        logs, bias, w_inv, _, feat = cond
        y1, y2 = y[:, :self.c // 2], y[:, self.c // 2:]
        shift, scale = self._shift_scale(feat, y1)
        y = torch.cat([y1, y2 / scale - shift], 1)
        y = torch.einsum("nij,njhw->nihw", w_inv, y)
        return y * (-logs).exp() - bias


def _conv_norm(cin, cout, k):
    conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
    nn.init.normal_(conv.weight, std=0.05)
    return conv


class SplitPrior(nn.Module):
    """The Gaussian prior (mean, log-scale) of a split's second half given its first: 3x3 convolution, tanh."""

    def __init__(self, channels):
        super().__init__()
        self.conv = _normal_(nn.Conv2d(channels // 2, channels, 3, padding=1), 0.1)

    def forward(self, z1):
        return _cross(torch.tanh(self.conv(z1)))


def gaussian_logp(mean, logs, z):
    return (-0.5 * (2 * logs + (z - mean) ** 2 * (-2 * logs).exp() + math.log(2 * math.pi))).flatten(1).sum(1)


class CondGlow(nn.Module):
    """The c-Glow of perturbations of shape ``shape`` (C, H, W) given images of that shape (see the module
    docstring). :meth:`condition` maps images to the per-step numbers, :meth:`decode` maps (conditions, top
    latent, split latents) to perturbations, :meth:`encode` the reverse with the log-likelihood."""

    def __init__(self, shape, *, x_hidden_channels, x_hidden_size, y_hidden_channels, flow_depth, num_levels):
        super().__init__()
        check_sides(shape, num_levels, "cg_attack")
        c, h, w = shape
        self.shape, self.levels = tuple(shape), num_levels
        self.steps, self.priors, self.top = nn.ModuleList(), nn.ModuleList(), None
        for level in range(num_levels):
            c, h, w = 4 * c, h // 2, w // 2
            self.steps.append(nn.ModuleList(Step(shape, c, h, x_hidden_channels, x_hidden_size, y_hidden_channels)
                                            for _ in range(flow_depth)))
            if level < num_levels - 1:
                self.priors.append(SplitPrior(c))
                c //= 2
        self.top = (c, h, w)

    def split_shapes(self):
        """The shapes of the split latents, level by level."""
        c, h, w, out = *self.shape, []
        for _ in range(self.levels - 1):
            c, h, w = 2 * c, h // 2, w // 2
            out.append((c, h, w))
        return out

    def condition(self, x, inverse=True):
        return [[step.condition(x, inverse) for step in level] for level in self.steps]

    def encode(self, cond, y):
        """(top latent, split latents, log-likelihood of ``y`` given the images (n,))."""
        logp, zs = y.new_zeros(y.shape[0]), []
        for level, steps in enumerate(self.steps):
            y = F.pixel_unshuffle(y, 2)
            for step, c in zip(steps, cond[level]):
                y, ld = step(c, y)
                logp = logp + ld
            if level < self.levels - 1:
                y, z2 = y.chunk(2, 1)
                logp = logp + gaussian_logp(*self.priors[level](y), z2)
                zs.append(z2)
        return y, zs, logp + gaussian_logp(torch.zeros_like(y), torch.zeros_like(y), y)

    def decode(self, cond, top, zs=None, noise=None):
        """Perturbations from the ``top`` latent and the split latents ``zs`` (one per split), or, without ``zs``,
        split latents drawn from their priors with the standard normal ``noise`` (one tensor per split); returns
        (perturbations, the split latents used)."""
        y, used = top, [None] * (self.levels - 1)
        for level in reversed(range(self.levels)):
            if level < self.levels - 1:
                if zs is None:
                    mean, logs = self.priors[level](y)
                    used[level] = mean + logs.exp() * noise[level]
                else:
                    used[level] = zs[level]
                y = torch.cat([y, used[level]], 1)
            for step, c in zip(reversed(self.steps[level]), reversed(cond[level])):
                y = step.inverse(c, y)
            y = F.pixel_shuffle(y, 2)
        return y, used


def expand(cond, idx):
    """The conditions of images ``idx`` (rows repeated as many times as they appear)."""
    return [[tuple(t[idx] for t in c) for c in level] for level in cond]


# ---------------------------------------------------------------------------------------------- training ----

def training_point(x, y, eps, norm):
    """Training's adversarial image from decodes ``y``: Linf ``x + eps y`` (the decode measured in units of eps: see
    the module docstring), L2 ``x + y``, projected onto the eps ball and [0, 1] (the authors' ``clamp``)."""
    return project(x + (eps * y if norm == "linf" else y), x, eps, norm)


def to_boundary(y, eps, norm):
    """The attack's map of decodes onto the ball's boundary: ``eps sign`` (the authors' Linf), L2 ``eps y/|y|``. A
    non-finite decode (an overflow) is read as 0 where NaN and as the largest float where infinite."""
    y = torch.nan_to_num(y)
    return eps * (torch.sign(y) if norm == "linf" else l2_normalize(y))


def adversarial_loss(models, x, labels, margin):
    """The authors' ``adv_loss``: the mean over models of the mean CW margin on the logits, floored at -margin."""
    return sum(margin_loss(m(x), labels).clamp_min(-margin).mean() for m in models) / len(models)


def pseudo_labels(models, x, y, eps, iters, step):
    """The authors' MCG stage-1 labels (``data/data_prehandle.py``): the sign of an MI-FGSM perturbation (decay 1,
    ``iters`` steps of ``step``, the models' summed cross-entropy, gradients L1-normalised per image) of the images
    ``x`` in the Linf ball of radius ``eps``; in units of eps (our decodes' unit: see :func:`training_point`)."""
    def loss(k, logits, rows):
        return surrogate_loss(logits, y[rows], None, "ce")

    xa, g = x.clone(), torch.zeros_like(x)
    for _ in range(iters):
        grad = surrogate_gradient(models, xa, loss)
        g = g + grad / grad.abs().flatten(1).sum(1).clamp_min(1e-12).view(-1, 1, 1, 1)
        xa = project(xa - step * g.sign(), x, eps, "linf")
    return (xa - x).sign()


def pretrain_nll(flow, x, labels, *, epochs, lr, batch, max_grad_norm, gen):
    """MCG's stage 1 (the authors' ``trainners/Learner.py``): maximum likelihood of ``labels`` given the images
    ``x`` (no dequantisation, as theirs), Adam (betas 0.9/0.9999), gradient norm clipped at ``max_grad_norm``."""
    opt = torch.optim.Adam(flow.parameters(), lr=lr, betas=(0.9, 0.9999))
    dims = labels[0].numel()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            idx = idx.to(x.device)
            loss = -flow.encode(flow.condition(x[idx], inverse=False), labels[idx])[2].mean() / dims
            opt.zero_grad()
            loss.backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(flow.parameters(), max_grad_norm)
            opt.step()


STAGE_ONE_RANGES = {"pretrain_epochs": "int [0, inf)", "pretrain_lr": "(0, inf)", "pseudo_iters": "int [1, inf)",
                    "pseudo_step": "(0, inf)"}


def check_stage_one(norm, where):
    """A one-line error naming ``where`` when stage 1 is asked for under a threat other than Linf."""
    if norm != "linf":
        raise BenchError(f"{where}.pretrain_epochs: the stage-1 labels are Linf sign perturbations; use norm linf or "
                         "pretrain_epochs 0")


def stage_one(hp, norm, where, pretrain_epochs, pretrain_lr, pseudo_iters, pseudo_step):
    """``hp`` with the stage-1 training parameters when ``pretrain_epochs`` > 0 (otherwise unchanged, so the cache key
    of a c-Glow trained without it stays the same); see :func:`check_stage_one`."""
    if pretrain_epochs <= 0:
        return hp
    check_stage_one(norm, where)
    return {**hp, "pretrain_epochs": int(pretrain_epochs), "pretrain_lr": float(pretrain_lr),
            "pseudo_iters": int(pseudo_iters), "pseudo_step": float(pseudo_step)}


def max_normalised(y, eps):
    """MCG's meta-training decode (the authors' ``decode(return_prob=True)``, ``tanh`` False): each decode divided by
    its largest absolute value, so that the perturbation's largest pixel is 1 against a ball of radius eps (Linf)
    and the decode's overall scale counts for nothing; returned in units of eps, the unit :func:`training_point`
    takes (an all-zero decode stays 0)."""
    peak = y.abs().flatten(1).amax(1).clamp_min(torch.finfo(y.dtype).tiny)
    return y / (eps * peak.view(-1, *[1] * (y.dim() - 1)))


def train_cglow(models, x, y, arch, *, eps, norm, epochs, views, lr, batch, max_grad_norm, margin, seed,
                inner_steps=None, outer_step=1.0, max_norm=False, pretrain_epochs=0, pretrain_lr=1e-3,
                pseudo_iters=30, pseudo_step=0.005):
    """The state dict of a :class:`CondGlow` of ``arch`` trained on images ``x`` with labels ``y`` against
    ``models`` (see the module docstring), deterministic in ``seed``, and the surrogates' mean margin on its
    perturbations of ``x`` before and after training.

    ``inner_steps`` None: one step of one Adam per batch (CG-Attack). An integer: Reptile meta-training (MCG,
    ``query/mcg.py``): every batch is a task; a fresh Adam takes ``inner_steps`` steps on it, then the weights move
    ``outer_step`` of the way from where the task started to where those steps ended (1: keep the inner weights).
    ``max_norm`` (MCG's meta-training, Linf): the adversarial loss sees :func:`max_normalised` decodes.
    ``pretrain_epochs`` > 0 (MCG's stage 1, Linf): first :func:`pretrain_nll` at ``pretrain_lr`` on the
    :func:`pseudo_labels` (``pseudo_iters``, ``pseudo_step``) of ``x`` against ``models``."""
    gen = torch.Generator().manual_seed(seed)
    with seeded(seed):
        flow = CondGlow(x.shape[1:], **arch).to(x.device)
    opt = torch.optim.Adam(flow.parameters(), lr=lr, betas=(0.9, 0.9999))

    def loss_on(xb, yb):
        noise = [torch.randn((len(xb), *s), generator=gen).to(x.device) for s in flow.split_shapes()]
        top = torch.zeros((len(xb), *flow.top), device=x.device)
        delta = flow.decode(flow.condition(xb), top, noise=noise)[0]
        if max_norm:
            delta = max_normalised(delta, eps)
        return adversarial_loss(models, training_point(xb, delta, eps, norm), yb, margin)

    with torch.no_grad():
        before = loss_on(x, y)
    if pretrain_epochs > 0:
        check_stage_one(norm, "train_cglow")
        pretrain_nll(flow, x, pseudo_labels(models, x, y, eps, pseudo_iters, pseudo_step), epochs=pretrain_epochs,
                     lr=pretrain_lr, batch=batch, max_grad_norm=max_grad_norm, gen=gen)

    def step(optimizer, xb, yb):
        loss = loss_on(xb, yb)
        optimizer.zero_grad()
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(flow.parameters(), max_grad_norm)
        optimizer.step()

    for _ in range(epochs):
        data = torch.cat([x] + [augment(x, gen) for _ in range(views - 1)])
        labels = y.repeat(views)
        for idx in torch.randperm(len(data), generator=gen).split(batch):
            idx = idx.to(x.device)
            if inner_steps is None:
                step(opt, data[idx], labels[idx])
                continue
            start = [p.detach().clone() for p in flow.parameters()]
            task = torch.optim.Adam(flow.parameters(), lr=lr, betas=(0.9, 0.9999))
            for _ in range(inner_steps):
                step(task, data[idx], labels[idx])
            with torch.no_grad():
                for p, p0 in zip(flow.parameters(), start):
                    p.copy_(torch.lerp(p0, p, outer_step))
    with torch.no_grad():
        after = loss_on(x, y)
    return {"state": {k: v.detach().cpu().clone() for k, v in flow.state_dict().items()},
            "margin": torch.stack([before, after]).cpu()}


def fit_cglow(models, train_set, arch, hp, eps, norm, device):
    """``(frozen CondGlow, the models' margin before and after training)``: a c-Glow of ``arch`` trained with ``hp``
    on the labelled images ``train_set`` against ``models`` under the threat (``eps``, ``norm``) on ``device``,
    cached on disk (BLACKBOXBENCH_CACHE/cglow; CG-Attack's c-Glow against one surrogate and the ADM tool's CAD of
    that model are the same file)."""
    params = {**arch, **hp, "eps": float(eps), "norm": norm}
    disk = cache_key("cglow", params, list(models), train_set, hp["seed"], device)
    out = cached("cglow", disk, lambda: train_cglow(
        list(models), train_set.x.to(device), train_set.y.to(device), arch, eps=float(eps), norm=norm, **hp))
    flow = CondGlow(train_set.x.shape[1:], **arch)
    flow.load_state_dict(out["state"])
    return flow.to(device).eval().requires_grad_(False), out["margin"]


def trained_cglow(ctx, data, arch, hp, block="cg_attack"):
    """The frozen :class:`CondGlow` trained with ``hp`` on the ``train_images`` asset ``data`` against the run's
    surrogates under the run's threat, on the run's device: cached on disk and built once per run (``block``
    names the asking block in errors)."""
    if not ctx.surrogates:
        raise BenchError(f"'{block}' needs white-box surrogates (config key surrogates:)")
    images = ctx.assets.get(data)
    p = ctx.problem
    params = {**arch, **hp, "eps": float(p.eps), "norm": p.norm}
    key = ("cglow", id(images), tuple(map(id, ctx.surrogates)), tuple(sorted(params.items())), str(ctx.device))

    def build():
        train_set = train_data(ctx, block, data, same_size=True)
        check_sides(train_set.x.shape[1:], arch["num_levels"], block)
        return fit_cglow(ctx.surrogates, train_set, arch, hp, p.eps, p.norm, ctx.device)[0]

    return once_per_run(key, (images, ctx.surrogates), build)


# ----------------------------------------------------------------------------------------- separable CMA ----

def cma_constants(dim, n_pop):
    """Hansen's default CMA-ES constants for ``dim`` and population ``n_pop``, with the separable learning rates
    (Ros and Hansen 2008): a dict of floats and the (mu,) recombination weights, ``ln((n_pop + 1) / 2) - ln i``
    normalised (for an odd ``n_pop`` not ``ln(mu + 1/2)``, which made the last weight too small)."""
    mu = n_pop // 2
    w = math.log((n_pop + 1) / 2) - torch.log(torch.arange(1, mu + 1, dtype=torch.float64))
    w = w / w.sum()
    mu_eff = float(1 / (w ** 2).sum())
    c_sigma = (mu_eff + 2) / (dim + mu_eff + 5)
    c1 = 2 / ((dim + 1.3) ** 2 + mu_eff)
    c_mu = min(1 - c1, 2 * (mu_eff - 2 + 1 / mu_eff) / ((dim + 2) ** 2 + mu_eff))
    sep = (dim + 2) / 3
    c1, c_mu = min(1.0, c1 * sep), min(1 - min(1.0, c1 * sep), c_mu * sep)
    return {"mu": mu, "mu_eff": mu_eff, "c_sigma": c_sigma,
            "d_sigma": 1 + 2 * max(0.0, math.sqrt((mu_eff - 1) / (dim + 1)) - 1) + c_sigma,
            "c_c": (4 + mu_eff / dim) / (dim + 4 + 2 * mu_eff / dim), "c1": c1, "c_mu": c_mu,
            "chi": math.sqrt(dim) * (1 - 1 / (4 * dim) + 1 / (21 * dim ** 2))}, w.float()


def sep_cma_update(es, z, fitness, k, w):
    """One separable CMA-ES update of the per-sample states ``es`` (``mean``, ``sigma``, ``cov`` (diagonal),
    ``p_sigma``, ``p_c``, ``gen``) from the standard normal draws ``z`` (n, n_pop, D) and their ``fitness``
    (n, n_pop), lower is better. Returns the new states."""
    n, n_pop, dim = z.shape
    order = fitness.argsort(dim=1, stable=True)[:, :k["mu"]]
    z_sel = z.gather(1, order[:, :, None].expand(-1, -1, dim))
    w = w.to(z.device)
    z_w = torch.einsum("k,nkd->nd", w, z_sel)
    root = es["cov"].sqrt()
    y_w = root * z_w
    sigma = es["sigma"]
    mean = es["mean"] + sigma[:, None] * y_w
    p_sigma = (1 - k["c_sigma"]) * es["p_sigma"] + math.sqrt(k["c_sigma"] * (2 - k["c_sigma"]) * k["mu_eff"]) * z_w
    gen = es["gen"] + 1
    norm = p_sigma.norm(dim=1)
    h_sigma = (norm / torch.sqrt(1 - (1 - k["c_sigma"]) ** (2 * gen.double())).float()
               < (1.4 + 2 / (dim + 1)) * k["chi"]).float()[:, None]
    p_c = (1 - k["c_c"]) * es["p_c"] + h_sigma * math.sqrt(k["c_c"] * (2 - k["c_c"]) * k["mu_eff"]) * y_w
    rank_mu = torch.einsum("k,nkd->nd", w, (root[:, None] * z_sel) ** 2)
    cov = ((1 - k["c1"] - k["c_mu"]) * es["cov"]
           + k["c1"] * (p_c ** 2 + (1 - h_sigma) * k["c_c"] * (2 - k["c_c"]) * es["cov"]) + k["c_mu"] * rank_mu)
    sigma = sigma * torch.exp(k["c_sigma"] / k["d_sigma"] * (norm / k["chi"] - 1))
    return {"mean": mean, "sigma": sigma, "cov": cov, "p_sigma": p_sigma, "p_c": p_c, "gen": gen}


# ------------------------------------------------------------------------------------------------ blocks ----

ES_KEYS = ("mean", "sigma", "cov", "p_sigma", "p_c", "gen")


def top_size(d, num_levels):
    """The size of a c-Glow's top latent for images of ``d`` values: each of ``num_levels`` levels squeezes (the
    same size) and every level but the last splits half off, so D / 2^(num_levels - 1)."""
    return d >> (num_levels - 1)


@INIT.register("cg_init", paper=PAPER, norms=("linf", "l2"), ranges={"num_levels": "int [1, inf)"},
               agree={"num_levels": "perturb"})
def cg_init(ctx, *, num_levels=None):
    """The clean image (one query; the authors' first query is their start's decode) with the evolution strategy
    not yet started (``gen`` -1: the perturb block starts it, knowing the c-Glow). The ES ``mean`` has the
    image's size D: the c-Glow's top latent (the searched part) first, then its split latents (fixed). ``cov``,
    ``p_sigma`` and ``p_c`` cover the searched part alone: the top latent of a c-Glow of ``num_levels`` levels
    (the perturb block's, which the recipe repeats here: a slot's state has one shape from its init on; the
    builder rejects a config whose two values differ, naming this key), D / 2^(num_levels - 1); None: D (any
    c-Glow; the part past the top latent unused)."""
    n, d = ctx.problem.n, ctx.problem.x[0].numel()
    used = d if num_levels is None else top_size(d, int(num_levels))
    zeros = torch.zeros(n, used, device=ctx.device)
    return start_state(ctx, ctx.problem.x.clone(), mean=torch.zeros(n, d, device=ctx.device),
                       sigma=torch.zeros(n, device=ctx.device), cov=torch.ones(n, used, device=ctx.device),
                       p_sigma=zeros, p_c=zeros.clone(), gen=torch.full((n,), -1, dtype=torch.long, device=ctx.device))


def _start(ctx, flow, cond, state, sigma0):
    """Start the samples that have not (``gen`` -1), given every sample's conditions ``cond``: step ``sigma0`` and
    split latents drawn from their priors at the top latent 0 (``cg_init`` set the mean 0, the identity covariance
    and the empty paths). Writes into ``state``'s tensors (the working set's own copy, see query/pipeline.py).
    Returns the started samples (long (m,)) and their decodes there, the c-Glow's mode (m, C, H, W)."""
    rows, dev = (state["gen"] < 0).nonzero().squeeze(1), ctx.device
    m, dim = len(rows), math.prod(flow.top)
    if m == 0:
        return rows, None
    noise = [ctx.rng.normal(s, rows=rows).to(dev) for s in flow.split_shapes()]
    delta, zs = flow.decode(expand(cond, rows), torch.zeros((m, *flow.top), device=dev), noise=noise)
    state["mean"][rows, dim:] = torch.cat([z.flatten(1) for z in zs], 1)
    state["sigma"][rows] = float(sigma0)
    state["gen"][rows] = 0
    return rows, delta


def _mode(ctx, rows, delta):
    """The first candidate of the samples ``rows``, their c-Glow's mode (the ``delta`` :func:`_start` decoded at the
    top latent 0), queried: its fitness (m,), the oracle's verdict (m,) and the candidates (m, C, H, W)."""
    problem = ctx.problem
    candidates = problem.sub(rows).project(problem.x[rows] + to_boundary(delta, problem.eps, problem.norm))
    f, adv, _ = query_margin(ctx, candidates, rows)
    return f.clamp_min(-FLOOR), adv, candidates


def unflatten(flat, shapes):
    """Rows of ``flat`` (n, D) cut into tensors of ``shapes`` in order (n, *shape)."""
    out, at = [], 0
    for s in shapes:
        d = math.prod(s)
        out.append(flat[:, at:at + d].view(-1, *s))
        at += d
    return out


@PERTURB.register("cg_attack", paper=PAPER, norms=("linf", "l2"), needs=("surrogates",),
                  asset_params={"data": "train_images"},
                  ranges={"n_pop": "int [4, inf)", "sigma": "(0, inf)", "x_hidden_channels": "int [1, inf)",
                          "x_hidden_size": "int [1, inf)", "y_hidden_channels": "int [1, inf)",
                          "flow_depth": "int [1, inf)", "num_levels": "int [1, inf)", "epochs": "int [0, inf)",
                          "views": "int [1, inf)", "lr": "(0, inf)", "batch": "int [1, inf)",
                          "max_grad_norm": "[0, inf)", "margin": "(0, inf)", "seed": "int [0, inf)",
                          **STAGE_ONE_RANGES})
def cg_attack(ctx, state, *, n_pop=20, sigma=1.0, data="train", x_hidden_channels=64, x_hidden_size=128,
              y_hidden_channels=256, flow_depth=8, num_levels=3, epochs=50, views=1, lr=2e-4, batch=2,
              max_grad_norm=10.0, margin=20.0, seed=0, pretrain_epochs=0, pretrain_lr=1e-3, pseudo_iters=30,
              pseudo_step=0.005):
    """One CMA-ES generation of ``n_pop`` c-Glow candidates per sample, queried in calls of whole samples of about
    ``PROBE_VALUES`` values (one call on CIFAR-10), each call's ES updated in the state's tensors in place; proposes
    each sample's best candidate with the oracle's answer on it. A sample's first call starts its ES and queries
    one candidate, the c-Glow's mode (see the module docstring for every parameter)."""
    arch = {"x_hidden_channels": int(x_hidden_channels), "x_hidden_size": int(x_hidden_size),
            "y_hidden_channels": int(y_hidden_channels), "flow_depth": int(flow_depth),
            "num_levels": int(num_levels)}
    hp = {"epochs": int(epochs), "views": int(views), "lr": float(lr), "batch": int(batch),
          "max_grad_norm": float(max_grad_norm), "margin": float(margin), "seed": int(seed)}
    hp = stage_one(hp, ctx.problem.norm, "cg_attack", pretrain_epochs, pretrain_lr, pseudo_iters, pseudo_step)
    top = top_size(ctx.problem.x[0].numel(), int(num_levels))
    if state["cov"].shape[1] < top:  # before the c-Glow is trained
        raise BenchError(f"cg_attack: the ES state covers {state['cov'].shape[1]} latent values, the c-Glow's top "
                         f"latent has {top}: give blocks.init (cg_init) the perturb block's num_levels "
                         f"({num_levels}) or none")
    flow = trained_cglow(ctx, data, arch, hp)
    problem, dev = ctx.problem, ctx.device
    with torch.no_grad():
        cond = flow.condition(problem.x)
        fresh, delta = _start(ctx, flow, cond, state, sigma)
        k, w = cma_constants(math.prod(flow.top), n_pop)
        fit = torch.full((problem.n, n_pop), math.inf, device=dev)
        adv, best = torch.zeros_like(fit, dtype=torch.bool), torch.empty_like(problem.x)
        first = torch.zeros(problem.n, dtype=torch.long, device=dev)  # a fresh sample's row of delta, plus one
        first[fresh] = torch.arange(1, len(fresh) + 1, device=dev)
        running = (first == 0).long()
        # a fresh sample's query: its mode alone, no ES update (the authors' start, queried before their ES)
        for sel in bounded_calls(first.clamp(max=1), problem.x[0].numel()):
            fit[sel, 0], adv[sel, 0], best[sel] = _mode(ctx, sel, delta[first[sel] - 1])
        # calls of whole samples of about PROBE_VALUES values (one on CIFAR-10); each call's population, decode and
        # ES update live only within _generation, so no sample's population outlives its call
        for sel in bounded_calls(running, n_pop * problem.x[0].numel()):
            fit[sel], adv[sel], best[sel] = _generation(ctx, flow, cond, state, sel, n_pop, k, w)
    rows, pick = torch.arange(problem.n, device=dev), fit.argmin(1)
    return {"x_adv": best, "margin": fit[rows, pick], "adv": adv[rows, pick]}


def _searched(t, dim):
    """The searched part of an ES state tensor: the top latent's ``dim`` values of each row (a view; ``cov``,
    ``p_sigma`` and ``p_c`` have no more when ``cg_init`` knew the levels), or the per-sample tensor itself
    (``sigma``, ``gen``)."""
    return t[:, :dim] if t.dim() == 2 else t


def _generation(ctx, flow, cond, state, sel, n_pop, k, w):
    """One CMA-ES generation of the samples ``sel`` (one bounded call): their ``n_pop`` candidates each drawn,
    decoded and queried, and their ES updated in ``state``'s tensors, in place (a generation with a refused query,
    past the budget, leaves a sample's ES as it was). Returns the candidates' fitness (m, n_pop), the oracle's
    verdicts on them (m, n_pop) and each sample's best candidate (m, C, H, W)."""
    problem, dev, dim, m = ctx.problem, ctx.device, math.prod(flow.top), sel.numel()
    es = {key: _searched(state[key], dim)[sel] for key in ES_KEYS}
    z = ctx.rng.normal((n_pop, dim), rows=sel).to(dev)
    latents = es["mean"][:, None] + es["sigma"][:, None, None] * es["cov"].sqrt()[:, None] * z
    idx = sel.repeat_interleave(n_pop)
    zs = unflatten(state["mean"][idx, dim:], flow.split_shapes())
    delta = flow.decode(expand(cond, idx), latents.reshape(m * n_pop, *flow.top), zs=zs)[0]
    candidates = problem.sub(idx).project(problem.x[idx] + to_boundary(delta, problem.eps, problem.norm))
    f, adv, ok = query_margin(ctx, candidates, idx)
    fit, answered = f.clamp_min(-FLOOR).view(m, n_pop), ok.view(m, n_pop).all(1)
    new = sep_cma_update(es, z, fit, k, w)
    for key in ES_KEYS:
        _searched(state[key], dim)[sel] = torch.where(answered.view(-1, *[1] * (new[key].dim() - 1)), new[key],
                                                      es[key])
    best = candidates.view(m, n_pop, *candidates.shape[1:])[torch.arange(m, device=dev), fit.argmin(1)]
    return fit, adv.view(m, n_pop), best


@ACCEPT.register("es_best", paper="population attacks keep their best queried candidate (Supp. F-B, Alg. 2)",
                 norms=("linf", "l2"))
def es_best(ctx, state, proposal):
    """Move to the proposal's candidate where its margin (already asked of the oracle by the perturb block) beats
    the best so far; no query. The proposal holds ``x_adv``, ``margin`` and ``adv`` (the oracle's answers)."""
    candidates, state = merge_proposal(state, {k: v for k, v in proposal.items() if k not in ("margin", "adv")})
    keep_better(state, candidates, proposal["margin"], proposal["adv"])
    return state
