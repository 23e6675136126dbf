"""NP-attack (Bai, Zeng, Jiang, Wang, Xia, Guo, ECCV 2020; spec sheet S8): NES on the representation of an image
learned by an Attentive Neural Process (ANP), so that the candidates are reconstructions of the image from a
perturbed representation instead of the image plus pixel noise.

**The ANP** (the authors' ``ANP_CIFAR`` model and its training script): an image is a function from pixel
coordinates (row, column, channel, each in [0, 1]) to intensities minus 0.5. A deterministic path embeds every
(coordinate, value) point with an MLP (``hidden`` 400, to ``r_dim`` 128) and lets every target coordinate attend to
the context points with 4-head dot-product attention over learned coordinate features, then maps the result to
``z_dim`` (128) numbers per point: the representation ``r`` (P points x ``z_dim``). A latent path averages a second
point embedding into a global Gaussian ``z`` (mean, and a scale in [0.01, 0.1]). The decoder maps (``r`` at the
point, ``z``, coordinate) through four ReLU layers to a mean and a scale per point. The authors' self-attention
layers add a zero-initialised multiple of a freshly drawn attention at every call (an identity), so they are left
out. Training: the Gaussian negative log-likelihood of every pixel, the context and target being the whole image
(so the KL term between the two latent Gaussians is zero), with one latent draw per image broadcast over its points
(the authors' ``reparameterise``), Adam lr 1e-3, batch 8, 50 epochs (the authors: on the 50,000 CIFAR-10 training
images; here on the attacker's ``train_images`` asset, never the evaluation images, and cached in
``BLACKBOXBENCH_CACHE``/np like AdvFlow's flow, the training's revision ``TRAINING`` in the key).

**The attack** (the authors' ``NP_Attack``, type R, their default; Table VI: N 100, I 600, E 0.05, LR 0.05): the
image is encoded once into ``r``, ``mu_z`` and ``sigma_z``. Each iteration draws ``n_pop`` (N, 100) normal tensors
``e_k`` shaped like ``r``, decodes ``r + sigma_z e_k`` with one ``z ~ N(mu_z, sigma_z)`` drawn per point (shared by
the population), clips the decode to the eps ball (and [0, 1]) and queries them; with the unclipped CW margin of
the log-probabilities as the loss, standardized rewards ``A`` and ``lr`` (LR, 0.05), ``r`` moves by
``lr / (n_pop sigma_z) sum_k A_k e_k``. The new point is a decode of ``r`` with a fresh ``z`` (the authors' success
check at the start of each iteration; here ``margin_step`` queries it), so an iteration costs ``n_pop + 1``
queries. Table VI's I (600 iterations) caps nothing below the budget (600 x 101 > 10,000) and E (0.05) is the
authors' eps, the threat's here.

**Search types** (``search``, the authors' ``--type``; both blocks take it and must agree): R above is the default
and the recipe's: every script of the authors defaults to ``--type R`` and their launchers and README commands run
R; Table VI names no type, and its N, I, E, LR are the defaults of their ImageNet script, whose type is R too. The
types below follow their CIFAR-10 scripts (``NPAttack_untargeted.py``, ``NPAttack_targeted.py``). Z leaves ``r``
and searches the latent mean instead: the global ``mu_z`` expanded over the P points (the authors' ``mu1``), so that
it becomes a mean per point after the first update, kept in ``np_init``'s state (P x ``z_dim`` per sample, where R
keeps ``z_dim``). Candidate k decodes the unperturbed ``r`` with ``z_k ~ N(mu1 + sigma_z e_k, sigma_z)``, a fresh
draw per candidate and point, and ``mu1`` moves by ``lr / (n_pop sigma_z) sum_k A_k e_k``. RZ perturbs both, with
independent draws per candidate (``r + sigma_z e_k`` decoded with ``z_k ~ N(mu1 + sigma_z e'_k, sigma_z)``), and
moves both with the same standardized rewards ``A``. In every type the new point decodes ``r`` with
``z ~ N(mu1, sigma_z)`` (per point for Z and RZ), ``sigma_z`` never moves, and the targeted script runs the three
types alike. Z and RZ draw two (three) normal tensors of the population's size per iteration where R draws one.

**Targeted** (the authors' ``NPAttack_targeted.py``): the same NES with the targeted CW margin of the
log-probabilities (the best other class minus the target), and their step-size rule (:func:`targeted_lr`): every
tenth iteration a sample whose population's mean loss rose since the last such check halves its ``lr`` while it
is above 1e-3.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..prep.trained import augment, trained_model
from ..registry import INIT, PERTURB
from ..rng import seeded
from .common import query_margin, start_state

PAPER = ("Bai, Zeng, Jiang, Wang, Xia, Guo, Improving Query Efficiency of Black-box Adversarial Attack, "
         "ECCV 2020")
COORDS = 3  # row, column, channel
CHUNK = 1 << 25  # decoder activations per chunk (rows x points x hidden)
ATTENTION = 1 << 30  # the most values of the ANP's attention (heads x P x P): 4 GiB of float32
TRAINING = 2  # train_anp's revision, in the cache key (2: one latent draw per image, as the authors)


def coordinates(shape, device=None):
    """(P, 3) the coordinates of the P = H*W*C points of an image of ``shape`` (C, H, W), in the authors' order
    (row-major pixels, channels innermost), each in [0, 1]."""
    c, h, w = shape
    lin = lambda k: torch.linspace(0, 1, k, device=device)  # noqa: E731
    rows, cols, chans = torch.meshgrid(lin(h), lin(w), lin(c) if c > 1 else torch.zeros(1, device=device),
                                       indexing="ij")
    return torch.stack([rows, cols, chans], -1).reshape(-1, COORDS)


def to_points(x):
    """(n, C, H, W) images -> (n, P) values minus 0.5 in the order of :func:`coordinates`."""
    return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1) - 0.5


def to_images(values, shape):
    """The inverse of :func:`to_points`."""
    c, h, w = shape
    return values.reshape(-1, h, w, c).permute(0, 3, 1, 2) + 0.5


def mlp(*widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class ANP(nn.Module):
    """The authors' attentive neural process (see the module docstring) for images of ``shape``."""

    def __init__(self, shape, *, r_dim, z_dim, hidden, heads=4):
        super().__init__()
        if r_dim % heads:
            raise ValueError(f"r_dim ({r_dim}) must be a multiple of the {heads} heads")
        self.shape, self.heads = tuple(shape), heads
        self.register_buffer("coords", coordinates(shape))
        self.det = mlp(COORDS + 1, hidden, hidden, r_dim)
        self.lat = mlp(COORDS + 1, hidden, hidden, r_dim)
        self.lat_out = nn.Sequential(nn.Linear(r_dim, r_dim), nn.ReLU())
        self.z_mean, self.z_scale = nn.Linear(r_dim, z_dim), nn.Linear(r_dim, z_dim)
        self.key_net, self.query_net = mlp(COORDS, hidden, COORDS), mlp(COORDS, hidden, COORDS)
        size = r_dim // heads
        self.wq, self.wk = nn.Linear(COORDS, COORDS * heads), nn.Linear(COORDS, COORDS * heads)
        self.wv, self.wo = nn.Linear(r_dim, size * heads), nn.Linear(size * heads, r_dim)
        for lin, std in ((self.wq, COORDS), (self.wk, COORDS), (self.wv, COORDS), (self.wo, r_dim)):
            nn.init.normal_(lin.weight, 0, std ** -0.5)  # the authors' head initialisation
        self.to_r = nn.Linear(r_dim, z_dim)
        self.dec = mlp(2 * z_dim + COORDS, hidden, hidden, hidden, hidden)
        self.dec_mean, self.dec_scale = nn.Linear(hidden, 1), nn.Linear(hidden, 1)

    def attention(self):
        """The attention weights (heads, P, P): queries and keys are features of the coordinates alone, so one
        attention serves every image."""
        q = self._heads(self.wq(self.query_net(self.coords)))  # (heads, P, 3)
        k = self._heads(self.wk(self.key_net(self.coords)))
        return torch.softmax(q @ k.transpose(1, 2) / math.sqrt(COORDS), -1)

    def encode(self, x, weights=None):
        """Images (n, C, H, W) -> (r (n, P, z_dim), z mean (n, z_dim), z scale (n, z_dim)); ``weights``: those of
        :meth:`attention` when already computed."""
        n = x.shape[0]
        xy = torch.cat([self.coords.expand(n, -1, -1), to_points(x)[..., None]], -1)
        s = self.lat_out(self.lat(xy).mean(1))
        scale = (0.1 + 0.9 * torch.sigmoid(self.z_scale(s))) * 0.1
        weights = self.attention() if weights is None else weights
        p, size = self.coords.shape[0], self.wv.out_features // self.heads
        v = self.wv(self.det(xy)).view(n, p, self.heads, size).permute(2, 1, 0, 3).reshape(self.heads, p, n * size)
        att = (weights @ v).view(self.heads, p, n, size).permute(2, 1, 0, 3).reshape(n, p, self.heads * size)
        # the authors sum the heads' output projections: one projection of the concatenated heads
        return self.to_r(self.wo(att)), self.z_mean(s), scale

    def encode_each(self, x):
        """:meth:`encode` of the images one at a time (the attack's), so that an image's encoding does not depend
        on the images encoded with it: the global path's layers and the attention multiply matrices with a row
        (column) per image, and a CPU matrix product's rounding depends on their number (MKL's float32 product of
        fewer than 4 rows sums in another order)."""
        weights = self.attention()
        return tuple(torch.cat(t) for t in zip(*(self.encode(xi[None], weights) for xi in x)))

    def _heads(self, t):
        """(P, heads * m) -> (heads, P, m)."""
        return t.view(t.shape[0], self.heads, -1).transpose(0, 1)

    def decode(self, r, z):
        """Per-point means and scales (m, P) of the images with representation ``r`` (m, P, z_dim) and latent
        ``z`` (m, P, z_dim) (one draw per point), in chunks that bound the memory."""
        hidden = self.dec_mean.in_features
        step = max(1, CHUNK // (r.shape[1] * hidden))
        means, scales = [], []
        for i in range(0, r.shape[0], step):
            rows = slice(i, i + step)
            h = self.dec(torch.cat([r[rows], z[rows], self.coords.expand(r[rows].shape[0], -1, -1)], -1))
            means.append(self.dec_mean(h).squeeze(-1))
            scales.append(0.1 + 0.9 * F.softplus(self.dec_scale(h).squeeze(-1)))
        return torch.cat(means), torch.cat(scales)


def sample_z(mean, scale, normal):
    """A latent per point (m, P, z_dim) from the standard normal draws ``normal`` (m, P, z_dim): ``mean`` is one
    per image (m, z_dim), broadcast over its points, or one per point (m, P, z_dim) (search types Z and RZ)."""
    return (mean[:, None] if mean.dim() == 2 else mean) + scale[:, None] * normal


def nll(net, x, gen=None):
    """The Gaussian negative log-likelihood of the pixels of ``x`` (per image, summed over points), with one latent
    per image drawn from ``gen`` and shared by its points (the authors' ``reparameterise``; the attack draws one per
    point); the authors' training loss (its KL term is zero: context = target)."""
    r, mean, scale = net.encode(x)
    normal = torch.randn((r.shape[0], 1, r.shape[2]), generator=gen).to(x.device)
    mu, sigma = net.decode(r, sample_z(mean, scale, normal).expand(-1, r.shape[1], -1))
    y = to_points(x)
    return (0.5 * ((y - mu) / sigma) ** 2 + sigma.log() + 0.5 * math.log(2 * math.pi)).sum(1)


def train_anp(x, arch, *, epochs, views, np_lr, batch, seed):
    """The state dict of an :class:`ANP` of ``arch`` trained on ``x`` on its device, deterministic in ``seed``, and
    its final negative log-likelihood in nats per pixel on ``x``."""
    gen = torch.Generator().manual_seed(seed)
    with seeded(seed):
        net = ANP(x.shape[1:], **arch).to(x.device)
    opt = torch.optim.Adam(net.parameters(), lr=np_lr)
    for _ in range(epochs):
        data = torch.cat([x] + [augment(x, gen) for _ in range(views - 1)])
        for idx in torch.randperm(len(data), generator=gen).split(batch):
            loss = nll(net, data[idx.to(x.device)], gen).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        per_pixel = torch.cat([nll(net, xb, gen) for xb in x.split(batch)]).mean() / x[0].numel()
    return {"state": {k: v.detach().cpu().clone() for k, v in net.state_dict().items()},
            "nats_per_pixel": per_pixel.reshape(1).cpu()}


def check_points(shape, heads=4):
    """A one-line error when the ANP's attention over the P = C*H*W points of images of ``shape`` (heads x P x P
    values, shared by the images of a batch) would exceed ``ATTENTION`` values."""
    p = math.prod(shape)
    if heads * p * p > ATTENTION:
        gb = heads * p * p * 4 / 1e9
        raise BenchError(f"np_attack: the ANP attends between every pair of an image's P = C*H*W points: at "
                         f"{' x '.join(map(str, shape))} its attention is {heads} x P^2 = {gb:,.0f} GB of float32 "
                         f"(limit {ATTENTION * 4 / 2 ** 30:.0f} GiB: at most {math.isqrt(ATTENTION // heads):,} "
                         "points; CIFAR-10's 3 x 32 x 32 is 3,072): attack smaller images (config key data) or "
                         "use another recipe")


def trained_anp(ctx, data, arch, hp):
    """The frozen ANP of ``arch`` trained with ``hp`` on the ``train_images`` asset ``data``, on the run's device:
    cached on disk and built once per run."""
    with seeded():  # the shell's initialisation is overwritten by the state
        return trained_model(ctx, "np_attack", "np", data, {**arch, **hp, "training": TRAINING},
                             lambda shape: ANP(shape, **arch),
                             lambda x: train_anp(x, arch, **hp))


# ------------------------------------------------------------------------------------------------ blocks ----

SEARCH = ("R", "Z", "RZ")  # the authors' --type: NES on r (their default, the recipe's), on the latent mean, on both


@INIT.register("np_init", paper=PAPER, norms=("linf", "l2"), ranges={"z_dim": "int [1, inf)", "search": SEARCH},
               agree={"search": "perturb"})
def np_init(ctx, *, z_dim=128, search="R"):
    """The clean image (one query) and room for its representation (P points x ``z_dim``, the ANP's, which
    ``np_attack`` checks) and latent, NaN until the perturb block encodes the image at its first step: the latent
    scale (``z_dim``) and mean, one per image (``z_dim``) for ``search`` R, one per point (P x ``z_dim``) for Z and
    RZ, which move it point by point (the perturb block's ``search``, which the recipe repeats here: a slot's state
    has one shape from its init on; the builder rejects a config whose two values differ, naming this key, and
    ``np_attack`` checks the state it is given); for the targeted step-size rule, the sample's ``lr`` (NaN: the
    perturb block's), the loss of its last check (the authors' 100) and its iteration count."""
    x = ctx.problem.x
    n, p = x.shape[0], x[0].numel()
    nan = lambda *shape: torch.full((n, *shape), float("nan"), device=x.device)  # noqa: E731
    z_mean = nan(z_dim) if search == "R" else nan(p, z_dim)
    return start_state(ctx, x.clone(), r=nan(p, z_dim), z_mean=z_mean, z_scale=nan(z_dim), lr=nan(),
                       last_loss=torch.full((n,), 100.0, device=x.device),
                       it=torch.zeros(n, dtype=torch.long, device=x.device))


def population(ctx, r, z_mean, z_scale, decode, n_pop, search="R"):
    """NP-attack's population of ``n_pop`` candidates around the representations ``r`` (n, P, D) and the latent
    means ``z_mean`` (type R: one per image (n, D); Z, RZ: one per point (n, P, D)), projected and queried in one
    oracle call. Type R: ``r + sigma_z e_k`` decoded with one latent draw ``z ~ N(z_mean, sigma_z)`` per point
    shared by the population. Type Z: ``r`` decoded with ``z_k ~ N(z_mean + sigma_z e_k, sigma_z)``, a fresh draw
    per candidate and point. Type RZ: ``r + sigma_z e_k`` decoded with ``z_k ~ N(z_mean + sigma_z e'_k, sigma_z)``,
    ``e`` and ``e'`` independent. Returns the draws ``{state key: e}`` (each (n, n_pop, P, D): ``"r"`` for R and RZ,
    ``"z_mean"`` for Z and RZ), the candidates' margins (n, n_pop) and whether every query of a sample's population
    was answered (n,)."""
    problem = ctx.problem
    n, p, d = r.shape
    scale = z_scale[:, None, None, :]
    idx = torch.arange(n, device=r.device).repeat_interleave(n_pop)
    draws = {}
    if search in ("R", "RZ"):
        draws["r"] = ctx.rng.normal((n_pop, p, d)).to(r.device)
        cand = (r[:, None] + scale * draws["r"]).flatten(0, 1)
    else:
        cand = r[:, None].expand(-1, n_pop, -1, -1).flatten(0, 1)
    if search == "R":
        z = sample_z(z_mean, z_scale, ctx.rng.normal((p, d)).to(r.device))[idx]
    else:  # the authors' Normal(mu1 + S1 e_k, S1).rsample(): a fresh draw per candidate and point
        draws["z_mean"] = ctx.rng.normal((n_pop, p, d)).to(r.device)
        z = ctx.rng.normal((n_pop, p, d)).to(r.device).add_(draws["z_mean"]).mul_(scale).add_(z_mean[:, None])
        z = z.flatten(0, 1)
    candidates = problem.sub(idx).project(decode(cand, z).clamp(0, 1))
    margin, _, ok = query_margin(ctx, candidates, idx)
    return draws, margin.view(n, n_pop), ok.view(n, n_pop).all(1)


def nes_update(r, z_scale, e, margin, ok, lr):
    """``r + lr / (n_pop sigma_z) sum_k A_k e_k`` with the rewards ``-margin`` standardized per sample (1e-7 as the
    authors); ``r`` (n, P, D) is the representation or the per-point latent mean, ``lr`` a number or one per sample
    (n,). A sample with a refused query (not ``ok``) keeps its ``r``."""
    n_pop = margin.shape[1]
    reward = torch.where(ok[:, None], -margin, 0.0)
    a = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-7)
    lr = torch.as_tensor(lr, dtype=r.dtype, device=r.device).reshape(-1, 1, 1)
    return r + lr / (n_pop * z_scale[:, None, :]) * torch.einsum("nk,nkpd->npd", a, e)


def nes_updates(r, z_mean, z_scale, draws, margin, ok, lr):
    """:func:`nes_update` of each tensor :func:`population` perturbed (its ``draws``: r, z_mean or both, RZ's with
    the same standardized rewards); returns the new ``(r, z_mean)``."""
    new = {"r": r, "z_mean": z_mean}
    for key, e in draws.items():
        new[key] = nes_update(new[key], z_scale, e, margin, ok, lr)
    return new["r"], new["z_mean"]


def search_step(ctx, r, z_mean, z_scale, decode, *, n_pop, lr, search="R"):
    """NP-attack's NES update of type ``search`` (:func:`population`, :func:`nes_updates`); returns the new
    ``(r, z_mean)``."""
    draws, margin, ok = population(ctx, r, z_mean, z_scale, decode, n_pop, search)
    return nes_updates(r, z_mean, z_scale, draws, margin, ok, lr)


def representation_step(ctx, r, z_mean, z_scale, decode, *, n_pop, lr):
    """NP-attack's NES update of type R of the representations ``r`` (n, P, D); returns the new ``r``."""
    return search_step(ctx, r, z_mean, z_scale, decode, n_pop=n_pop, lr=lr)[0]


def targeted_lr(lr, last_loss, loss, it):
    """The step-size rule of the authors' targeted attack, per sample: at iterations ``it`` 0, 10, 20, ... the
    population's mean ``loss`` is compared with ``last_loss`` (that of the last check; 100 at first), ``lr`` halves
    where it rose and ``lr`` is above 1e-3, and ``loss`` becomes the last; returns (lr, last_loss)."""
    check = it % 10 == 0
    halve = check & (loss > last_loss) & (lr > 1e-3)
    return torch.where(halve, lr / 2, lr), torch.where(check, loss, last_loss)


@PERTURB.register("np_attack", paper=PAPER, norms=("linf", "l2"), asset_params={"data": "train_images"},
                  ranges={"n_pop": "int [2, inf)", "lr": "(0, inf)", "search": SEARCH, "r_dim": "int [4, inf)",
                          "z_dim": "int [1, inf)", "hidden": "int [1, inf)", "epochs": "int [1, inf)",
                          "views": "int [1, inf)", "np_lr": "(0, inf)", "batch": "int [1, inf)",
                          "seed": "int [0, inf)"})
def np_attack(ctx, state, *, n_pop=100, lr=0.05, search="R", data="train", r_dim=128, z_dim=128, hidden=400,
              epochs=50, views=1, np_lr=1e-3, batch=8, seed=0):
    """One NP-attack iteration: the NES update of type ``search`` (R: the representation, Z: the per-point latent
    mean, RZ: both) from ``n_pop`` candidates (targeted: with the authors' step-size rule), then a decode of it as
    the new point (see the module docstring for every parameter)."""
    arch = {"r_dim": int(r_dim), "z_dim": int(z_dim), "hidden": int(hidden)}
    hp = {"epochs": int(epochs), "views": int(views), "np_lr": float(np_lr), "batch": int(batch),
          "seed": int(seed)}
    problem = ctx.problem
    check_points(problem.x.shape[1:])
    r, z_mean, z_scale = state["r"], state["z_mean"], state["z_scale"]
    if r.shape[-1] != arch["z_dim"]:
        raise BenchError(f"np_attack: z_dim {arch['z_dim']} differs from np_init's {r.shape[-1]} (set both)")
    if (z_mean.dim() == 2) != (search == "R"):
        raise BenchError(f"np_attack: search {search} differs from np_init's {'R' if z_mean.dim() == 2 else 'Z/RZ'}"
                         f" (its latent mean is one per {'image' if z_mean.dim() == 2 else 'point'}; set both)")
    net = trained_anp(ctx, data, arch, hp)
    with torch.no_grad():
        fresh = torch.isnan(z_scale[:, 0])
        if fresh.any():  # the samples new to their slots
            enc_r, enc_mean, enc_scale = net.encode_each(problem.x[fresh])
            if search != "R":  # the authors' mu1: the latent mean expanded over the points
                enc_mean = enc_mean[:, None].expand(-1, r.shape[1], -1)
            r, z_mean, z_scale = r.clone(), z_mean.clone(), z_scale.clone()
            r[fresh], z_mean[fresh], z_scale[fresh] = enc_r, enc_mean, enc_scale

        def decode(rep, z):
            return to_images(net.decode(rep, z)[0], net.shape)

        step, last_loss, it = state["lr"], state["last_loss"], state["it"]
        step = torch.where(torch.isnan(step), float(lr), step)
        draws, margin, ok = population(ctx, r, z_mean, z_scale, decode, n_pop, search)
        if problem.target is not None:  # a population with a refused query changes nothing
            new_step, new_last = targeted_lr(step, last_loss, margin.mean(1), it)
            step, last_loss = torch.where(ok, new_step, step), torch.where(ok, new_last, last_loss)
        r, z_mean = nes_updates(r, z_mean, z_scale, draws, margin, ok, step)
        z = sample_z(z_mean, z_scale, ctx.rng.normal(r.shape[1:]).to(r.device))
        x_new = problem.project(decode(r, z).clamp(0, 1))
    return {"x_adv": x_new, "r": r, "z_mean": z_mean, "z_scale": z_scale, "lr": step, "last_loss": last_loss,
            "it": it + 1}
