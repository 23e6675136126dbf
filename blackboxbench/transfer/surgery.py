"""Backward modification and model surgery (spec sheet T12-T15): SGM, LinBP, IAA and GhostNet as ``refine``
blocks.

Each block deep-copies every surrogate once per run (before any sample) and changes the copy, never the shared
model object (the runner's models and the targets stay untouched). They reach inside the network through the
layer map (:mod:`blackboxbench.prep.layers`) and the residual-block protocol of the CIFAR ResNets
(:class:`~blackboxbench.prep.cifar_resnet.BasicBlock`): a block with a ``branch(x)`` method and the modules
``shortcut``, ``merge`` (a :class:`~blackboxbench.prep.cifar_resnet.ResidualAdd` of branch and skip) and
``relu2``. A surgery that needs a structure the surrogate lacks (SGM: skip connections; LinBP: ReLUs after its
position) is a one-line error, never a silent no-op.
"""
import copy

import torch
from torch import nn

from ..errors import BenchError
from ..prep.cifar_resnet import ResidualAdd
from ..prep.layers import layer_map, per_arch, unwrap
from ..registry import REFINE
from ..rng import RowDraws


def residual_blocks(net):
    """[(stage number, block)] of the residual blocks of ``net`` (blocks with a ``ResidualAdd`` merge), in order;
    the stage number is 1-based where the layer map has stages, else 1."""
    lm = layer_map(net)
    stage_of = {}
    for name, m in lm.layers.items():
        if name.startswith("stage") and name[5:].isdigit():
            for sub in m.modules():
                stage_of.setdefault(id(sub), int(name[5:]))
    return [(stage_of.get(id(m), 1), m) for m in unwrap(net).modules()
            if isinstance(getattr(m, "merge", None), ResidualAdd)]


def _replace(root, old, new):
    """Put ``new`` in place of the child module ``old`` wherever ``root`` holds it."""
    places = [(parent, name) for parent in root.modules() for name, child in parent.named_children()
              if child is old]
    for parent, name in places:
        setattr(parent, name, new)


def _copies(models, block):
    if not models:
        raise BenchError(f"refine '{block}': no surrogate models")
    return [copy.deepcopy(m) for m in models]


def _arch(net):
    return type(unwrap(net)).__name__


def _no_residual(block, net):
    return BenchError(f"refine '{block}': the surrogate {_arch(net)} has no skip connections (no residual block "
                      "with a ResidualAdd merge); use a residual surrogate such as cifar_resnet20")


# ---------------------------------------------------------------------------------------------------- SGM ----

class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class SkipGradientAdd(ResidualAdd):
    """``branch + skip`` whose backward multiplies the residual branch's gradient by ``gamma`` (SGM)."""

    def __init__(self, gamma):
        super().__init__()
        self.gamma = gamma

    def forward(self, branch, skip):
        return _ScaleGrad.apply(branch, self.gamma) + skip


@REFINE.register("sgm", paper="Wu et al., Skip Connections Matter: On the Transferability of Adversarial "
                              "Examples Generated with ResNets (SGM), ICLR 2020", norms=("linf", "l2"),
                 ranges={"gamma": "arch [0, 1]"}, surrogate="residual")
def sgm(ctx, models, *, gamma=0.5):
    """Skip gradient method: in every residual block the gradient through the residual branch is multiplied by
    ``gamma`` and the skip's is kept (the paper's definition; forward unchanged). ``gamma`` 0.5: Table VII,
    CIFAR-10 ResNet-50 (ImageNet 0.2); a per-architecture mapping gives each surrogate its own
    (:func:`~blackboxbench.prep.layers.per_arch`). The authors' code instead hooks the ReLUs (gamma^0.5 each in
    Bottlenecks) and normalizes each block's input gradient by its std: not done here."""
    out = _copies(models, "sgm")
    for net in out:
        blocks = residual_blocks(net)
        if not blocks:
            raise _no_residual("sgm", net)
        for _, b in blocks:
            b.merge = SkipGradientAdd(per_arch(gamma, net))
    return out


# -------------------------------------------------------------------------------------------------- LinBP ----

class LinearBackwardReLU(nn.ReLU):
    """ReLU forward (bit-identical), identity backward: ``x + (relu(x) - x).detach()``."""

    def forward(self, x):
        return x + (torch.relu(x) - x).detach()


class _RenormBranch(torch.autograd.Function):
    """The residual branch with a linear backward, its input gradient rescaled per sample to the norm of the
    true (non-linear) one: LinBP's ``alpha = ||g_nonlin|| / ||g_lin||`` (the authors' linbp_backw_resnet50, xp 1).
    """

    @staticmethod
    def forward(ctx, x, linear, exact):
        with torch.enable_grad():
            xd = x.detach().requires_grad_(True)
            out_lin, out_exact = linear.branch(xd), exact.branch(xd)
        ctx.saved = (xd, out_lin, out_exact)
        return out_lin.detach()

    @staticmethod
    def backward(ctx, g):
        xd, out_lin, out_exact = ctx.saved
        g_lin = torch.autograd.grad(out_lin, xd, g)[0]
        g_exact = torch.autograd.grad(out_exact, xd, g)[0]
        shape = (-1,) + (1,) * (g.dim() - 1)
        alpha = g_exact.flatten(1).norm(dim=1) / g_lin.flatten(1).norm(dim=1).clamp_min(1e-30)
        return g_lin * alpha.view(shape), None, None


class LinBPBlock(nn.Module):
    """A residual block after LinBP's position: linear backward through the ReLUs of the residual branch, the
    branch gradient renormalized (:class:`_RenormBranch`); the ReLU after the residual sum keeps its exact
    gradient (the authors' ``block_func`` applies the block's own ReLU there). Forward values are the block's."""

    def __init__(self, block):
        super().__init__()
        self.exact = block
        self.linear = copy.deepcopy(block)
        _linearize(self.linear)

    def forward(self, x):
        b = _RenormBranch.apply(x, self.linear, self.exact)
        return self.exact.relu2(self.exact.merge(b, self.exact.shortcut(x)))


def _linearize(root):
    n = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.ReLU:
                setattr(parent, name, LinearBackwardReLU())
                n += 1
    return n


def _after(net, position):
    """The modules of ``net`` at and after the module ``position`` (registration order, which is the forward
    order of the zoo's architectures), as a set of ids."""
    mods = list(unwrap(net).modules())
    start = next(i for i, m in enumerate(mods) if m is position)
    return {id(m) for m in mods[start:]}


@REFINE.register("linbp", paper="Guo et al., Backpropagating Linearly Improves Transferability of Adversarial "
                                "Examples (LinBP), NeurIPS 2020", norms=("linf", "l2"))
def linbp(ctx, models, *, position="late"):
    """LinBP: from ``position`` on, the backward pass treats ReLUs as the identity (the forward is unchanged):
    in residual blocks the ReLUs of the residual branch, whose input gradient is then rescaled to the norm of the
    exact one, while the ReLU after the residual sum keeps its exact gradient (the authors' linbp_forw_resnet50 /
    linbp_backw_resnet50); on a plain network every ReLU past the position.
    ``position`` ``late``: the first block of the last stage (Table VII: CIFAR ResNet-50 "1st bottleneck of the
    4th stage", code '4_0'; for ResNet-20 ``block3_0``); on a plain network the first ReLU of its second half.
    Not for ensembles (as the authors' code): one surrogate."""
    if len(models) != 1:
        raise BenchError(f"refine 'linbp': one surrogate (got {len(models)}), as the authors' code")
    net = _copies(models, "linbp")[0]
    lm = layer_map(net)
    after = _after(net, lm.get(position, what="position (refine 'linbp', parameter position)"))
    root = unwrap(net)
    blocks = [b for _, b in residual_blocks(net) if id(b) in after]
    for b in blocks:
        _replace(root, b, LinBPBlock(b))
    wrapped = {id(m) for b in blocks for m in b.modules()}
    relus = [(p, name) for p in root.modules() for name, c in p.named_children()
             if type(c) is nn.ReLU and id(c) in after and id(c) not in wrapped]
    for parent, name in relus:
        setattr(parent, name, LinearBackwardReLU())
    if not blocks and not relus:
        raise BenchError(f"refine 'linbp': the surrogate {_arch(net)} has no ReLU at or after position "
                         f"'{position}' ({lm.resolve(position)}); LinBP needs ReLUs (nn.ReLU modules) to linearize")
    return [net]


# ---------------------------------------------------------------------------------------------------- IAA ----

class ScaledAdd(ResidualAdd):
    """``decay * branch + skip``."""

    def __init__(self, decay):
        super().__init__()
        self.decay = decay

    def forward(self, branch, skip):
        return self.decay * branch + skip


@REFINE.register("iaa", paper="Zhu et al., Rethinking Adversarial Transferability from a Data Distribution "
                              "Perspective (IAA), ICLR 2022", norms=("linf", "l2"),
                 ranges={"beta": "(0, inf)", "decay": "list [0, inf)"}, surrogate="residual")
def iaa(ctx, models, *, beta=25.0, decay=None):
    """IAA surgery: every ReLU becomes Softplus(``beta``) and the residual branch of every block of stage s is
    multiplied by ``decay[s-1]`` (no training). Table VII gives ResNet-50 ImageNet values only (beta 25, decay
    [1.0, 0.85, 0.65, 0.15]); the CIFAR-10 values of the recipe were chosen on held-out images (see it).
    ``decay`` None: no residual scaling; else one value per stage of a residual surrogate."""
    out = _copies(models, "iaa")
    for net in out:
        blocks = residual_blocks(net)
        if decay is not None:
            if not blocks:
                raise _no_residual("iaa", net)
            stages = max(s for s, _ in blocks)
            if len(decay) != stages:
                raise BenchError(f"refine 'iaa': decay has {len(decay)} values, the surrogate {_arch(net)} has "
                                 f"{stages} stages")
            for s, b in blocks:
                b.merge = ScaledAdd(float(decay[s - 1]))
        root = unwrap(net)
        relus = [(p, name) for p in root.modules() for name, c in p.named_children() if isinstance(c, nn.ReLU)]
        if not relus:
            raise BenchError(f"refine 'iaa': the surrogate {_arch(net)} has no ReLU module to smooth")
        for parent, name in relus:
            setattr(parent, name, nn.Softplus(beta=beta))
    return out


# ----------------------------------------------------------------------------------------------- GhostNet ----

class GhostAdd(ResidualAdd):
    """``branch + lambda * skip``, one lambda ~ U[1 - r, 1 + r] per channel of the skip (dimension 1), drawn at
    every forward for every row from ``draws`` (a :class:`~blackboxbench.rng.RowDraws`; skip erosion). Per
    channel as the GhostNet authors' code (``tf.random_uniform((depth,), ...)`` on the shortcut of every residual
    unit) and TransferAttack's ghost ResNets (shape (1, C, 1, 1))."""

    def __init__(self, r, draws):
        super().__init__()
        self.r, self.draws = r, draws

    def forward(self, branch, skip):
        m, c = skip.shape[:2]
        u = self.draws.uniform((c,), m, torch.float64)
        lam = (1 - self.r + 2 * self.r * u).to(skip.dtype).view(m, c, *[1] * (skip.dim() - 2))
        return branch + lam * skip


class GhostDropout(nn.Module):
    """Inverted dropout with probability ``p``, a fresh mask at every forward for every row from ``draws``
    (dropout erosion)."""

    def __init__(self, p, draws):
        super().__init__()
        self.p, self.draws = p, draws

    def forward(self, x):
        keep = self.draws.uniform(x.shape[1:], x.shape[0]).to(x.device) >= self.p
        return x * keep.to(x.dtype) / (1 - self.p)


@REFINE.register("ghost", paper="Li et al., Learning Transferable Adversarial Examples via Ghost Networks, "
                                "AAAI 2020", norms=("linf", "l2"), ranges={"r": "arch [0, 1]", "p": "arch [0, 1)"})
def ghost(ctx, models, *, r=1.0, p=0.1):
    """Ghost network: a residual surrogate gets skip erosion (every block computes branch + lambda * skip with
    lambda ~ U[1 - ``r``, 1 + ``r``] per channel, redrawn at every forward); a surrogate without residual blocks
    gets dropout erosion (inverted dropout with probability ``p`` after every activation, a fresh mask at every
    forward). So each iteration attacks a new ghost (a longitudinal ensemble). Table VII CIFAR-10: r 1 (ResNet-50),
    p 0.1 (VGG-19); ``r`` and ``p`` may be per-architecture mappings (:func:`~blackboxbench.prep.layers.per_arch`).
    Each sample attacks its own ghosts: its lambdas (one per channel per block per forward) and masks come from its
    own stream while the transfer worker attacks it (:func:`~blackboxbench.rng.drawing_from`), from ``ctx.rng`` (the
    run's stream) otherwise. The authors draw one lambda per channel per block per forward for the whole batch; per
    sample, the ghosts an image meets follow the same law, and its result does not depend on its batch."""
    out = _copies(models, "ghost")
    for net in out:
        draws = RowDraws(ctx.rng)
        blocks = residual_blocks(net)
        for _, b in blocks:
            b.merge = GhostAdd(per_arch(r, net), draws)
        if blocks:
            continue
        root = unwrap(net)
        acts = [(par, name, c) for par in list(root.modules()) for name, c in par.named_children()
                if isinstance(c, nn.ReLU)]
        if not acts:
            raise BenchError(f"refine 'ghost': the surrogate {_arch(net)} has neither residual blocks nor ReLU "
                             "modules to erode")
        for par, name, c in acts:
            setattr(par, name, nn.Sequential(c, GhostDropout(per_arch(p, net), draws)))
    return out
