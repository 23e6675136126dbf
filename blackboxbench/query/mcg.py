"""MCG (Yin, Zhang, Wu, Feng, Zhang, Fan, Yang, *Generalizable Black-Box Adversarial Attack with Meta Learning*,
IEEE TPAMI 2023; BlackboxBench Supp. G, Table VI; spec sheet S13): a conditional Glow meta-trained on the
surrogates gives each image a first adversarial guess, adapted to that image by a few gradient steps on the
surrogates, and an off-the-shelf score attack (Square, the authors' CIFAR-10 script) starts from it.

Written from the authors' ``MCG-Blackbox`` code (``attack.py``, ``trainners/MetaLearner.py``, ``Learner.py``,
``data/data_prehandle.py``, ``utils/finetune.py``, ``attacks/square.py``; read, not copied), on CG-Attack's c-Glow
(``query/cg_attack.py``: the same architecture, decode and training loss, with that module's recorded departures).

**Stage 1, pretraining** (the authors' ``data/data_prehandle.py``, ``trainners/Learner.py`` and
``imagenet_pretrain.sh``): each training image gets a pseudo label, the sign of an MI-FGSM perturbation on the
surrogates (decay 1, ``pseudo_iters`` 30 steps of ``pseudo_step`` 0.005, cross-entropy; theirs attack one surrogate
and keep the images it classifies correctly with probability above 0.5: here every image, against all the
surrogates), and the c-Glow learns those labels by maximum likelihood (``pretrain_epochs`` 40, ``pretrain_lr``
1e-3, batch and gradient-norm clip as below; no dequantisation, as theirs).

**Stage 2, meta-training** (``MetaLearner.meta_train``, Reptile, from the stage-1 weights): every batch of
``batch`` images is a task; a fresh Adam (``lr`` 4e-4, betas 0.9/0.9999) takes ``inner_steps`` (5) steps on the
surrogates' mean CW margin floored at
``-margin`` (5), gradient norm clipped at ``max_grad_norm`` (10), decoding from the top latent 0 with split latents
drawn from their priors (the authors' sampler), for ``epochs`` (5) epochs. The decode is divided by its largest
absolute value before the eps clamp (``cg_attack.max_normalised``: their ``decode(return_prob=True)``, ``tanh``
False, where CG-Attack's training and the per-image fine-tuning below clamp the raw decode), so the loss does not
see the decode's scale. The values are those of the authors'
only meta-training script (``imagenet_metatrain.sh``; Table VI lists the generator only as a path). The outer step
moves the weights ``outer_step`` of the way from the task's start to the inner steps' end. The authors' code
computes that interpolation (factor 0.01-0.02 / batch x 2 / inner steps) into the dict ``state_dict()`` returns and
never loads it back, so the weights their run keeps, and the checkpoint they publish, are the inner steps' end:
``outer_step`` 1, the default here; a smaller value is Reptile as the paper writes it.

**Attack, per image** (``attack.py`` with Table VI's ``finetune_glow``, ``finetune_reload`` True):
1. The latent: top 0, split latents drawn from the meta-trained c-Glow's priors (``latent_initialize``).
2. ``finetune_glow`` (``meta_finetune``): a copy of the c-Glow takes ``finetune_steps`` (2) Adam steps
   (``finetune_lr`` 1e-3, gradient values clipped at ``finetune_clip`` 5) on the surrogates' margin floored at -5 of
   this image's decode at that latent. Their outer step (0.2, skipping normalisation layers) has the same
   never-loaded form, so the default ``finetune_outer`` 1 keeps the fine-tuned copy. ``finetune_reload``: every
   image starts from the meta-trained weights. All samples entering slots together are fine-tuned at once, each
   with its own copy of the weights (``torch.func.vmap``), ``chunk`` samples at a time (memory); a sample's copy
   depends on its image and latent only.
3. The first query: the fine-tuned copy's decode, ``x + eps decode`` clamped to the ball and [0, 1] (their
   ``generate``: the decode clamped at eps), on the uint8 grid.
4. Square Linf from there (``square_linf`` and ``margin_greedy``; the authors' ``SquareAttack``): ``p_init`` 0.3
   and the p schedule entered at iteration ``square_start`` 500 (their ``init_epochs``), so the first windows are
   the schedule's 500th-iteration size.

**Not built: ``finetune_perturbation``** (Table VI: True), the on-line fine-tuning of the surrogates on the target's
answers to earlier images (clean images and the first queried adversarial image of each earlier attack), which in
the authors' code happens between images, one image at a time. It makes an image's result depend on every image
attacked before it, and on the order: the engine keeps a sample's result a function of the seed, its index and the
config (``batch_size`` 1, 7 or 100 give the same records), which that state shared across samples breaks. A
deterministic form (rounds of samples, each fine-tuning on the rounds before it) is left. Their
``finetune_clean`` and ``finetune_latent`` are off in Table VI and not built. Untargeted and Linf: the authors'
generator is trained untargeted, and their attack is Linf.

Measured (``configs/cifar10_mcg.yaml``, ``benchmarks/RESULTS.md``): on the CPU-reduced c-Glow, stage 2 collapses it
to one saturated sign pattern for every image (the universal perturbation its loss favours; with or without the
division above, the same records), which leaves step 2 no gradient; after stage 1 alone the c-Glow keeps a spread
and step 2 halves the queries.
"""
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ..errors import BenchError
from ..registry import INIT
from .cg_attack import STAGE_ONE_RANGES, adversarial_loss, stage_one, trained_cglow, training_point
from .square import linf_state

PAPER = ("Yin, Zhang, Wu, Feng, Zhang, Fan, Yang, Generalizable Black-Box Adversarial Attack with Meta Learning, "
         "IEEE TPAMI 2023")
BETAS = (0.9, 0.9999)  # the authors' Adam, in meta-training and in the per-image fine-tuning
ADAM_EPS = 1e-8
FINETUNE_MARGIN = 5.0  # utils/finetune.py's adv_loss threshold


class _Decoder(nn.Module):
    """A c-Glow as one forward, image and latents to perturbation, so that ``torch.func`` can swap its weights."""

    def __init__(self, flow):
        super().__init__()
        self.flow = flow

    def forward(self, x, top, zs):
        return self.flow.decode(self.flow.condition(x), top, zs=zs)[0]


def finetuned_decodes(flow, models, x, y, top, zs, *, eps, norm, steps, lr, clip, outer, chunk):
    """The decodes at latents (``top``, ``zs``) of per-sample copies of ``flow``, each after ``steps`` Adam steps
    (``lr``, betas 0.9/0.9999, gradient values clipped at ``clip`` when > 0) on ``models``' mean margin floored at
    -5 of its own image's training point, then moved ``outer`` of the way from the start (the authors'
    ``meta_finetune``). ``chunk`` samples are fine-tuned at once; each sample's result depends on its own inputs
    only."""
    if steps == 0:  # nothing to fine-tune: every sample decodes with the shared weights
        return flow.decode(flow.condition(x), top, zs=zs)[0].detach()
    dec = _Decoder(flow)
    base = {k: v.detach() for k, v in dec.named_parameters()}

    def decode_one(p, x1, t1, z1):
        return functional_call(dec, p, (x1[None], t1[None], [z[None] for z in z1]))

    def loss_one(p, x1, y1, t1, z1):
        return adversarial_loss(models, training_point(x1[None], decode_one(p, x1, t1, z1), eps, norm), y1[None],
                                FINETUNE_MARGIN)

    grads, decodes = vmap(grad(loss_one)), vmap(decode_one)
    out = []
    for rows in torch.arange(len(x), device=x.device).split(chunk):
        m = len(rows)
        args = (x[rows], top[rows], [z[rows] for z in zs])
        p = {k: v.expand(m, *v.shape).clone() for k, v in base.items()}
        m1 = {k: torch.zeros_like(v) for k, v in p.items()}
        m2 = {k: torch.zeros_like(v) for k, v in p.items()}
        for t in range(1, steps + 1):
            g = grads(p, args[0], y[rows], *args[1:])
            for k in p:
                gk = g[k].clamp(-clip, clip) if clip > 0 else g[k]
                m1[k].mul_(BETAS[0]).add_(gk, alpha=1 - BETAS[0])
                m2[k].mul_(BETAS[1]).addcmul_(gk, gk, value=1 - BETAS[1])
                denom = (m2[k] / (1 - BETAS[1] ** t)).sqrt_().add_(ADAM_EPS)
                p[k] = p[k] - lr / (1 - BETAS[0] ** t) * m1[k] / denom
        if outer != 1:
            p = {k: torch.lerp(base[k].expand_as(v), v, outer) for k, v in p.items()}
        with torch.no_grad():
            out.append(decodes(p, *args)[:, 0])
    return torch.cat(out)


@INIT.register("mcg_init", paper=PAPER, norms=("linf",), needs=("surrogates",),
               asset_params={"data": "train_images"},
               ranges={"x_hidden_channels": "int [1, inf)", "x_hidden_size": "int [1, inf)",
                       "y_hidden_channels": "int [1, inf)", "flow_depth": "int [1, inf)",
                       "num_levels": "int [1, inf)", "epochs": "int [0, inf)", "lr": "(0, inf)",
                       "inner_steps": "int [1, inf)", "outer_step": "(0, 1]", "batch": "int [1, inf)",
                       "max_grad_norm": "[0, inf)", "margin": "(0, inf)", "seed": "int [0, inf)", **STAGE_ONE_RANGES,
                       "finetune_steps": "int [0, inf)", "finetune_lr": "(0, inf)", "finetune_clip": "[0, inf)",
                       "finetune_outer": "(0, 1]", "square_start": "int [0, inf)", "chunk": "int [1, inf)"})
def mcg_init(ctx, *, data="train", x_hidden_channels=64, x_hidden_size=128, y_hidden_channels=256, flow_depth=8,
             num_levels=3, epochs=5, lr=4e-4, inner_steps=5, outer_step=1.0, batch=16, max_grad_norm=10.0,
             margin=5.0, seed=0, pretrain_epochs=40, pretrain_lr=1e-3, pseudo_iters=30, pseudo_step=0.005,
             finetune_steps=2, finetune_lr=1e-3, finetune_clip=5.0, finetune_outer=1.0,
             square_start=500, chunk=16):
    """The meta-trained c-Glow's guess for each image, fine-tuned on the surrogates for that image, as the start of
    Linf Square (one query; see the module docstring for every parameter)."""
    problem, dev = ctx.problem, ctx.device
    if problem.norm != "linf":
        raise BenchError(f"mcg_init attacks the linf ball (the authors' MCG), got norm '{problem.norm}'")
    arch = {"x_hidden_channels": int(x_hidden_channels), "x_hidden_size": int(x_hidden_size),
            "y_hidden_channels": int(y_hidden_channels), "flow_depth": int(flow_depth),
            "num_levels": int(num_levels)}
    hp = {"epochs": int(epochs), "views": 1, "lr": float(lr), "batch": int(batch),
          "max_grad_norm": float(max_grad_norm), "margin": float(margin), "seed": int(seed),
          "inner_steps": int(inner_steps), "outer_step": float(outer_step),
          **({"max_norm": True} if int(epochs) > 0 else {})}  # a stage-1-only c-Glow keeps its cache key
    hp = stage_one(hp, problem.norm, "mcg_init", pretrain_epochs, pretrain_lr, pseudo_iters, pseudo_step)
    flow = trained_cglow(ctx, data, arch, hp, block="mcg_init")
    x, n = problem.x, problem.n
    with torch.no_grad():
        cond = flow.condition(x)
        top = torch.zeros((n, *flow.top), device=dev)
        noise = [ctx.rng.normal(s).to(dev) for s in flow.split_shapes()]
        zs = flow.decode(cond, top, noise=noise)[1]
    delta = finetuned_decodes(flow, list(ctx.surrogates), x, problem.y, top, zs, eps=problem.eps, norm="linf",
                              steps=int(finetune_steps), lr=float(finetune_lr), clip=float(finetune_clip),
                              outer=float(finetune_outer), chunk=int(chunk))
    x0 = problem.quantize(training_point(x, torch.nan_to_num(delta), problem.eps, "linf"))
    return linf_state(ctx, x0, square_start)
