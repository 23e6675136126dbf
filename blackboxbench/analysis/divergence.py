"""Adversarial divergence measurement (ADM; BlackboxBench Sec. IV model architecture Q2, Fig. 14 right, Tab. III and
Supp. I eqs. I.4-I.10): how far apart two models' conditional adversarial distributions (CADs) are.

Per model, the CAD P(delta | x, theta) is Table VI's c-Glow trained against that model alone
(:func:`blackboxbench.query.cg_attack.fit_cglow`). By default (``pretrain_epochs`` 40, ``epochs`` 0, ``batch``
16) it is a density of that model's adversarial perturbations: maximum likelihood of the signs of its MI-FGSM
perturbations of the training images (MCG's stage 1, the same authors' c-Glow training by likelihood; Supp. I
eqs. I.7-I.8 define the CAD as a density). Supp. I says the CADs follow CG-Attack; CG-Attack's training
(``pretrain_epochs`` 0, ``epochs`` 50, ``batch`` 2: Table VI's ``only``, adversarial loss alone, the same cache
files as CG-Attack's c-Glow against one surrogate) was this tool's first default, and it collapses: its c-Glows
decode one saturated sign pattern for every image, their KLs reach 1e6-1e16 nats and the AD matrix does not follow
transfer (Spearman -0.14 with I-FGSM transfer ASR on four CIFAR-10 models), where the likelihood-trained CADs give
-0.73 (``benchmarks/RESULTS.md``). Every model's c-Glow starts from the same initialisation (the same ``seed``):
two CADs differ by what training against their models made of them, not by two random starts.

For a pair (s, t), eq. I.10's Monte Carlo estimate of KL(P_s || P_t) over the evaluation images x:
perturbations delta ~ P(. | x, theta_s) (the c-Glow's own latent distribution: top latent z0 ~ N(0, I), mu 0 and
sigma 1 of eq. I.5, split latents from their learned priors) and the mean of log P_s(delta | x) - log P_t(delta |
x), both by the change of variables of eq. I.6 (:meth:`CondGlow.encode`); ``samples`` draws in all (the paper:
100,000), spread evenly over the images. Each image's draws come from its own random stream (seed, dataset
index: :class:`blackboxbench.rng.Streams`), the same for every source model, so the estimate depends on the seed,
the images and the config, not on ``chunk`` or on the other images.

Eq. I.4: sim(s, t) = 1 / log2 D_KL(s, t) and AD = 1 - sim / max sim. The paper leaves D_KL <= 1 undefined (log2 <=
0; spec sheet open item 13): here D_KL is floored at ``floor`` (default 2 nats, so sim <= 1 and a pair closer than
2 nats, about nothing over thousands of dimensions, counts as identical), the maximum runs over the pairs of
distinct models, and a model's AD to itself is 0 (its KL is 0 by construction). The raw KL and its standard error
are in the table, so another normalisation can be applied to them.
"""
import math

import numpy as np
import torch

from ..errors import BenchError
from ..plotting import figure, matrix_panel
from ..prep.assets import train_images
from ..prep.trained import shared_images
from ..query.cg_attack import STAGE_ONE_RANGES, expand, fit_cglow, stage_one, unflatten
from ..registry import ANALYSIS, ParamError
from ..rng import Streams

PAPER = ("BlackboxBench Supp. I, eqs. I.4-I.10 (ADM); the CAD is CG-Attack's c-Glow (Feng et al., CVPR 2022), "
         "Table VI")
NOISE_SALT = 0x3C6EF372FE94F82B  # the tool's per-image streams, apart from the attack's (same seed and index)


def log_ratios(flows, x, index, samples, seed, chunk):
    """Per image, the sum and the sum of squares of log P_s(delta | x) - log P_t(delta | x) over its m =
    ceil(samples / n) draws delta ~ P_s(. | x): float64 (K, K, n) each, and m."""
    k, n = len(flows), len(x)
    m = -(-samples // n)
    dim = x[0].numel()
    total = torch.zeros(k, k, n, dtype=torch.float64)
    squares = torch.zeros_like(total)
    per = max(1, chunk // m)  # whole images per group: each image's draws are one draw of its own stream
    streams = Streams((int(seed) ^ NOISE_SALT) % 2 ** 63, max(index) + 1, "cpu")
    with torch.no_grad():
        inverse = [f.condition(x) for f in flows]  # decoding
        forward = [f.condition(x, inverse=False) for f in flows]  # encoding
        for g in range(0, n, per):
            group = torch.arange(g, min(n, g + per))
            owner = group.repeat_interleave(m)
            z = streams.view([index[i] for i in group]).normal((dim,), rows=owner - g)
            for a in range(0, len(z), chunk):
                idx, zz = owner[a:a + chunk], z[a:a + chunk].to(x)  # the images' device and dtype
                rows = idx.to(x.device)
                for s, flow in enumerate(flows):
                    top, *noise = unflatten(zz, [flow.top] + flow.split_shapes())
                    delta = flow.decode(expand(inverse[s], rows), top, noise=noise)[0]
                    logp = torch.stack([f.encode(expand(c, rows), delta)[2]
                                        for f, c in zip(flows, forward)]).double().cpu()
                    r = logp[s] - logp  # (K, rows)
                    total[s].index_add_(1, idx, r)
                    squares[s].index_add_(1, idx, r * r)
    return total, squares, m


def divergence_from_kl(kl, floor):
    """Eq. I.4 on a (K, K) KL matrix: ``(sim, AD)``, sim = 1 / log2 max(KL, floor) off the diagonal, AD = 1 - sim /
    max sim over distinct pairs, AD 0 on the diagonal; a non-finite KL gives NaN."""
    kl = np.asarray(kl, dtype=float)
    off = ~np.eye(len(kl), dtype=bool)
    sim = np.full(kl.shape, np.nan)
    ok = off & np.isfinite(kl)
    sim[ok] = 1 / np.log2(np.maximum(kl[ok], floor))
    top = np.nanmax(sim[ok]) if ok.any() else np.nan
    ad = 1 - sim / top
    ad[~off] = 0.0
    return sim, ad


def family_average(m, names, families):
    """``(family names, matrix)``: the mean of the entries of ``m`` over each (surrogate family, target family)
    block, leaving out a model's entry with itself (the paper's Fig. 14, second row)."""
    fam = [families[n] for n in names]
    labels = list(dict.fromkeys(fam))
    out = np.full((len(labels), len(labels)), np.nan)
    for a, fa in enumerate(labels):
        for b, fb in enumerate(labels):
            vals = [m[i][j] for i in range(len(names)) for j in range(len(names))
                    if i != j and fam[i] == fa and fam[j] == fb and np.isfinite(m[i][j])]
            out[a, b] = np.mean(vals) if vals else np.nan
    return labels, out


def _train_set(inputs, train):
    try:
        data = train_images(inputs.data_root, inputs.x.device, spec=train)
    except BenchError as e:
        raise ParamError("train", str(e)) from None
    if data.x.shape[1:] != inputs.x.shape[1:]:
        raise ParamError("train", f"images of shape {tuple(data.x.shape[1:])}, the evaluation images' are "
                                  f"{tuple(inputs.x.shape[1:])}")
    shared = shared_images(data.x, inputs.x)
    if shared:
        raise ParamError("train", f"{shared} of its {len(data.y)} images are evaluation images; the CADs must "
                                  "learn from other images (default train: cifar10_test_sdp200.npz, evaluate on "
                                  "cifar10_test_first100.npz)")
    return data


@ANALYSIS.register("adm", inputs="model", models=True, paper=PAPER,
                   ranges={"norm": ("linf", "l2"), "eps": "(0, inf)", "samples": "int [1, inf)",
                           "floor": "(1, inf)", "chunk": "int [1, inf)", "x_hidden_channels": "int [1, inf)",
                           "x_hidden_size": "int [1, inf)", "y_hidden_channels": "int [1, inf)",
                           "flow_depth": "int [1, inf)", "num_levels": "int [1, inf)", "epochs": "int [0, inf)",
                           "views": "int [1, inf)", "lr": "(0, inf)", "batch": "int [1, inf)",
                           "max_grad_norm": "[0, inf)", "margin": "(0, inf)", "seed": "int [0, inf)",
                           **STAGE_ONE_RANGES})
def adversarial_divergence(inputs, *, norm="linf", eps=0.03, samples=100000, floor=2.0, train=None, families=None,
                           chunk=256, x_hidden_channels=64, x_hidden_size=128, y_hidden_channels=256, flow_depth=8,
                           num_levels=3, epochs=0, views=1, lr=2e-4, batch=16, max_grad_norm=10.0, margin=20.0,
                           seed=0, pretrain_epochs=40, pretrain_lr=1e-3, pseudo_iters=30, pseudo_step=0.005):
    """The adversarial divergence between every ordered pair (surrogate s, target t) of the models: each model's
    CAD a c-Glow trained against it on ``train`` (a dataset spec, default the ``train_images`` asset's split A)
    under the threat (``norm``, ``eps``), KL estimated on the evaluation images from ``samples`` draws (see the
    module docstring). ``families`` ({model name: family}) adds the family-averaged matrix. The table: one row per
    pair (KL in nats, its standard error, sim, AD) and per family pair; the figure: the AD matrix (and the family
    one). ``pretrain_epochs`` > 0 first trains each c-Glow by maximum likelihood on the signs of that model's
    MI-FGSM perturbations (MCG's stage 1, :func:`blackboxbench.query.cg_attack.pretrain_nll`; Linf); ``epochs``
    then trains it on the adversarial loss (CG-Attack's training)."""
    names = [name for name, _ in inputs.models]
    if families is not None:
        missing = [n for n in names if not isinstance(families, dict) or not isinstance(families.get(n), str)]
        if missing:
            raise ParamError("families", f"must map every model to a family name; missing {missing}")
    arch = {"x_hidden_channels": x_hidden_channels, "x_hidden_size": x_hidden_size,
            "y_hidden_channels": y_hidden_channels, "flow_depth": flow_depth, "num_levels": num_levels}
    hp = {"epochs": epochs, "views": views, "lr": lr, "batch": batch, "max_grad_norm": max_grad_norm,
          "margin": margin, "seed": seed}
    hp = stage_one(hp, norm, "adm: params", pretrain_epochs, pretrain_lr, pseudo_iters, pseudo_step)
    data = _train_set(inputs, train)
    fitted = [fit_cglow([model], data, arch, hp, eps, norm, inputs.x.device) for _, model in inputs.models]
    flows = [f for f, _ in fitted]
    total, squares, m = log_ratios(flows, inputs.x, inputs.index, samples, seed, chunk)
    count = m * len(inputs.x)
    kl = (total.sum(2) / count).numpy()
    var = np.clip(squares.sum(2).numpy() / count - kl ** 2, 0, None) * count / max(count - 1, 1)
    se = np.sqrt(var / count)
    sim, ad = divergence_from_kl(kl, floor)
    header = ["level", "surrogate", "target", "kl_nats", "kl_se", "sim", "ad"]
    k = len(names)
    rows = [["model", names[i], names[j], float(kl[i, j]), float(se[i, j]), float(sim[i, j]), float(ad[i, j])]
            for i in range(k) for j in range(k)]
    arrays = {"models": np.array(names), "kl": kl, "kl_se": se, "ad": ad, "index": np.array(inputs.index),
              "kl_per_image": (total / m).numpy(), "samples_per_image": np.array(m),
              "train_margin": torch.stack([mg for _, mg in fitted]).numpy()}
    panels = [("models", names, ad)]
    if families is not None:
        labels, fam_ad = family_average(ad, names, families)
        _, fam_kl = family_average(kl, names, families)
        rows += [["family", labels[a], labels[b], float(fam_kl[a, b]), math.nan, math.nan, float(fam_ad[a, b])]
                 for a in range(len(labels)) for b in range(len(labels))]
        arrays.update(families=np.array(labels), family_ad=fam_ad, family_kl=fam_kl)
        panels.append(("families", labels, fam_ad))

    def draw(path, title):
        with figure(path, (3.2 + 1.6 * sum(len(p[1]) for p in panels), 1.6 + 0.5 * k), 1, len(panels)) as (fig, ax):
            for a, (what, labels, mat) in zip(ax[0], panels):
                matrix_panel(fig, a, labels, labels, mat, f"AD ({what}): surrogate (row) x target (column)")
            fig.suptitle(title, fontsize=9)
        return path

    return header, rows, arrays, draw
