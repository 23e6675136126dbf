"""Model attention visualization (MAV; BlackboxBench Tab. III, Supp. I): FullGrad saliency (MAV-A, Srinivas and
Fleuret, NeurIPS 2019, eq. I.1) and the frequency saliency map (MAV-B, FSM, eqs. I.2-I.3).

Both read the gradient of a class score ``f`` (the logit of the true label, or of the predicted one) with respect
to the image in [0, 1] (the model's own normalization is part of ``f``). Tools return ``(header, rows, arrays,
draw)`` as in :mod:`blackboxbench.analysis.boundary`.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..plotting import figure, grid_figure
from ..prep.models import Normalized
from ..registry import ANALYSIS

SCORES = ("label", "predicted")
CHUNK = 64  # images per backward pass


def class_score(model, x, y, score="label"):
    """The logits of ``x`` and, per image, the logit of its label ``y`` (``score: label``) or of the model's
    top class (``predicted``)."""
    logits = model(x)
    cls = y if score == "label" else logits.argmax(1)
    return logits, logits.gather(1, cls[:, None])[:, 0]


def input_gradient(model, x, y, score="label"):
    """d f / d x for the class score of :func:`class_score`, per image (the images are independent)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        _, f = class_score(model, x, y, score)
        (g,) = torch.autograd.grad(f.sum(), x)
    return g


# ---------------------------------------------------------------- FSM

def fsm(grad):
    """|DFT_{h,w}(grad)| per image and channel, low frequencies in the centre (fftshift): eq. I.3."""
    return torch.fft.fftshift(torch.fft.fft2(grad.double()).abs(), dim=(-2, -1))


def radial_profile(m):
    """Mean of the (H, W) centred spectrum ``m`` per integer radius from the centre (the zero frequency)."""
    h, w = m.shape
    yy, xx = np.indices((h, w))
    r = np.rint(np.hypot(yy - h // 2, xx - w // 2)).astype(int)
    return np.bincount(r.ravel(), weights=m.ravel()) / np.bincount(r.ravel())


@ANALYSIS.register("fsm", inputs="model", paper="BlackboxBench Supp. I, eqs. I.2-I.3 (MAV-B, FSM)",
                   ranges={"score": SCORES})
def frequency_saliency(inputs, *, score="label", adversarial=False, log=True):
    """The frequency saliency map: the magnitude of the channel-wise 2-D DFT of the class score's input gradient,
    averaged over the images and channels (the paper's Fig. 25 shows one map per model). ``adversarial``: on the
    run's adversarial images instead of the clean ones. The table is the map's radial profile (mean magnitude per
    integer frequency radius), the figure the map (``log``: on a log scale)."""
    x = _images(inputs, adversarial)
    m = sum(fsm(input_gradient(inputs.model, x[i:i + CHUNK], inputs.y[i:i + CHUNK], score)).sum(dim=(0, 1))
            for i in range(0, len(x), CHUNK)) / (len(x) * x.shape[1])
    m = m.cpu().numpy()
    prof = radial_profile(m)

    def draw(path, title):
        with figure(path, (4.2, 3.6)) as (fig, axes):
            ax = axes[0, 0]
            im = ax.imshow(np.log10(m + 1e-12) if log else m, cmap="viridis")
            ax.set_title(title + (" (log10)" if log else ""), fontsize=8)
            ax.axis("off")
            fig.colorbar(im, ax=ax, fraction=0.046)
        return path

    return (["radius", "mean_magnitude"], [[r, float(v)] for r, v in enumerate(prof)],
            {"fsm": m, "index": np.array(inputs.index)}, draw)


def _images(inputs, adversarial):
    if not adversarial:
        return inputs.x
    if inputs.x_adv is None:
        raise BenchError("adversarial: true needs the run's adversarial images (a run saved with save_adv: true)")
    return inputs.x_adv


# ---------------------------------------------------------------- FullGrad

def implicit_bias(module):
    """``(where, bias)`` of a layer with a bias, per channel: ``where`` is ``"out"`` (the bias is added at the
    module's output: convolution and linear layers with a bias, BatchNorm in eval mode, whose bias is
    beta - gamma mu / sqrt(var + eps)) or ``"net"`` (a :class:`Normalized` model: -mean / std added before its
    network); None for other modules."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) and module.bias is not None:
        return "out", module.bias.detach()
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not module.training and module.running_mean is not None:
        scale = torch.rsqrt(module.running_var + module.eps)
        w = module.weight if module.affine else torch.ones_like(scale)
        b = module.bias if module.affine else torch.zeros_like(scale)
        return "out", (b - w * module.running_mean * scale).detach()
    if isinstance(module, Normalized) and module.mean is not None:
        std = module.std if module.std is not None else torch.ones_like(module.mean)
        return "net", (-module.mean / std).flatten()
    return None


def full_gradients(model, x, y, score="label"):
    """``(f, input term, bias terms)`` of eq. I.1 before post-processing: the class scores ``f`` (N,), grad_x f * x
    (N, C, H, W) and, per layer with a bias, grad_b f * b as a map (N, C_l, ...) at the point the bias is added.
    For a network of ReLUs, convolutions, linear layers, BatchNorm in eval mode, pooling and additions, the input
    term and the bias terms sum to ``f`` exactly (FullGrad's completeness)."""
    sites, handles = [], []

    def keep(bias):
        def hook(_module, args, out=None):
            t = args[0] if out is None else out
            if not t.requires_grad:
                return None
            t.retain_grad()
            sites.append((t, bias))
            c = t.clone()  # a later in-place op (ReLU(inplace=True)) must not change the tensor whose gradient is read
            return (c, *args[1:]) if out is None else c
        return hook

    for m in model.modules():
        found = implicit_bias(m)
        if found is not None:
            where, bias = found
            handles.append(m.register_forward_hook(keep(bias)) if where == "out"
                           else m.net.register_forward_pre_hook(keep(bias)))
    x = x.detach().clone().requires_grad_(True)
    try:
        with torch.enable_grad():
            _, f = class_score(model, x, y, score)
            f.sum().backward()
    finally:
        for h in handles:
            h.remove()
    shape = lambda b, t: b.view(1, -1, *[1] * (t.dim() - 2))  # noqa: E731  (the bias per channel)
    return f.detach(), (x.grad * x).detach(), [(t.grad * shape(b, t)).detach() for t, b in sites if t.grad is not None]


PSI_EPS = 1e-6  # added to the maximum before dividing, as the FullGrad authors' post-processing


def _psi(t, size):
    """FullGrad's post-processing psi of one term (N, C, H, W), as the FullGrad authors' code (idiap/fullgrad-saliency,
    ``FullGrad._postProcess`` then ``F.interpolate``): absolute value; min-max rescaling over the whole term of each
    image (all its channels together, so a channel keeps its size relative to the layer's others: (t - min) /
    (max - min + 1e-6)); bilinear resize to the image size with the corner pixels aligned (``align_corners=True``).
    The channels are summed by the caller."""
    t = t.abs()
    flat = t.flatten(1)
    flat = flat - flat.amin(1, keepdim=True)
    t = (flat / (flat.amax(1, keepdim=True) + PSI_EPS)).view_as(t)
    return F.interpolate(t, size=size, mode="bilinear", align_corners=True) if t.shape[-2:] != size else t


def fullgrad_map(model, x, y, score="label"):
    """S_f(x) of eq. I.1, (N, H, W): psi of the input term plus psi of every bias term (:func:`_psi`: rescaled per
    layer, as the FullGrad authors' code), summed over channels and layers (maps of fewer than 2 spatial
    dimensions, e.g. a linear layer's, carry no spatial information and are left out, as in the FullGrad authors'
    code), then rescaled to [0, 1] per image for display (as their ``save_saliency_map``)."""
    _, inp, biases = full_gradients(model, x, y, score)
    size = tuple(x.shape[-2:])
    s = _psi(inp, size).sum(1)
    for b in biases:
        if b.dim() == 4:
            s = s + _psi(b, size).sum(1)
    flat = s.flatten(1)
    lo, hi = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
    return ((flat - lo) / (hi - lo).clamp_min(1e-12)).view_as(s)


@ANALYSIS.register("fullgrad", inputs="model", paper="Srinivas and Fleuret, NeurIPS 2019; BlackboxBench Supp. I, "
                   "eq. I.1 (MAV-A)", ranges={"score": SCORES, "max_images": "int [1, 64]"})
def fullgrad(inputs, *, score="predicted", max_images=8):
    """FullGrad saliency of the clean images and, from a run saved with ``save_adv``, of their adversarial
    versions side by side (the paper's Figs. 16, 27-32: how an attack moves the model's attention). ``score``:
    the logit of the predicted class (default, as the FullGrad authors) or of the true label. The table gives, per
    image, the predicted classes and the overlap of the two maps (cosine similarity)."""
    n = min(max_images, len(inputs.x))
    x, y = inputs.x[:n], inputs.y[:n]
    clean = fullgrad_map(inputs.model, x, y, score)
    with torch.no_grad():
        pred = inputs.model(x).argmax(1)
    adv = pred_adv = None
    if inputs.x_adv is not None:
        adv = fullgrad_map(inputs.model, inputs.x_adv[:n], y, score)
        with torch.no_grad():
            pred_adv = inputs.model(inputs.x_adv[:n]).argmax(1)
    header = ["index", "label", "predicted"] + (["predicted_adv", "cosine_clean_adv"] if adv is not None else [])
    rows = []
    for k in range(n):
        row = [inputs.index[k], int(y[k]), int(pred[k])]
        if adv is not None:
            row += [int(pred_adv[k]), float(F.cosine_similarity(clean[k].flatten(), adv[k].flatten(), dim=0))]
        rows.append(row)
    arrays = {"clean": clean.cpu().numpy(), "index": np.array(inputs.index[:n])}
    if adv is not None:
        arrays["adversarial"] = adv.cpu().numpy()
    panels = [("clean", k) for k in range(n)] + ([("adversarial", k) for k in range(n)] if adv is not None else [])
    images = {"clean": x, "adversarial": inputs.x_adv}

    def panel(ax, which):
        kind, k = which
        p = rows[k][2] if kind == "clean" else rows[k][3]
        overlay(ax, images[kind][k], arrays[kind][k], f"{kind} {rows[k][0]}: label {rows[k][1]}, pred {p}")

    return header, rows, arrays, lambda path, title: grid_figure(path, title, panels, panel)


def overlay(ax, image, saliency, title):
    """An image (C, H, W) in [0, 1] with its saliency map (H, W) over it."""
    img = image.permute(1, 2, 0).cpu().numpy()
    ax.imshow(img if img.shape[2] == 3 else img[..., 0], cmap=None if img.shape[2] == 3 else "gray")
    ax.imshow(saliency, cmap="jet", alpha=0.5)
    ax.set_title(title, fontsize=7)
    ax.axis("off")


PATH_ENDS = ("auto", "first_success", "final")


def fools(pred, label, target=None):
    """Whether predictions ``pred`` (a tensor, or one class) are adversarial: another class than ``label``, or,
    for a targeted run (``target`` a class), ``target``."""
    return pred == target if target is not None else pred != label


def first_success(model, images, label, target=None, device="cpu"):
    """The position in ``images`` (a path's uint8 snapshots (K, C, H, W), the clean image first) of the first
    snapshot after the clean image that fools ``model``: its prediction differs from ``label``, or, for a targeted
    run (``target`` a class), is ``target``. None when none does."""
    x = torch.from_numpy(images).float().div(255)
    with torch.no_grad():
        pred = torch.cat([model(x[i:i + CHUNK].to(device)).argmax(1).cpu() for i in range(0, len(x), CHUNK)])
    found = np.flatnonzero(fools(pred[1:], label, target).numpy())
    return int(found[0]) + 1 if len(found) else None


@ANALYSIS.register("fullgrad_path", inputs="model", paper="BlackboxBench Supp. I, eq. I.1 and Figs. 27-32 (MAV-A "
                   "along the attack path)", ranges={"score": SCORES, "max_images": "int [1, 16]",
                                                     "stages": "int [2, 12]", "end": PATH_ENDS})
def fullgrad_path(inputs, *, score="predicted", max_images=4, stages=6, end="auto"):
    """FullGrad saliency along each image's attack path (a run saved with ``save_path_every``): ``stages``
    snapshots evenly spaced from the clean image to the path's end (the paper shows 6), the maps on the path
    image's own prediction (``score``). The table gives, per stage, the step (queries, or the transfer
    iteration), the prediction, the cosine of the map to the clean image's and whether the stage's image fools the
    model analysed (the label changed, or a targeted run's target class reached).

    ``end``: ``final``, the returned image, as the paper's query attacks (Figs. 30-32: "6 stages from the
    beginning to the end, no matter fails or succeeds") and its failed transfer attacks (Fig. 27: "between the
    first iteration and the final iteration"); ``first_success``, the first snapshot after the clean image that
    fools the model analysed, as its successful transfer attacks (Figs. 28-29: "between the first iteration and the
    first successfully attacked iteration"; a path that never fools it runs to its final iterate, as Fig. 27);
    ``auto`` (default), the paper's choice: ``first_success`` for a transfer run, ``final`` for any other. The first
    success is found among the saved snapshots, so to the nearest ``save_path_every`` iterations."""
    if inputs.paths is None:
        raise BenchError("fullgrad_path needs the run's attack paths: run the attack with save_path_every: k")
    cut = end == "first_success" or (end == "auto" and inputs.family == "transfer")
    stage_rows, images, labels, width, ends = [], [], [], 1, []  # every chosen stage of every image, one batch
    for k in range(min(max_images, len(inputs.index))):
        i = inputs.index[k]
        steps, path = inputs.paths[i]
        hit = first_success(inputs.model, path, int(inputs.y[k]), (inputs.targets or {}).get(i),
                            inputs.x.device) if cut else None
        last = len(steps) - 1 if hit is None else hit
        ends.append(-1 if hit is None else int(steps[hit]))
        pick = sorted(set(np.linspace(0, last, stages).round().astype(int).tolist()))
        stage_rows += [(i, j, int(steps[s])) for j, s in enumerate(pick)]
        images.append(torch.from_numpy(path[pick]))
        labels += [int(inputs.y[k])] * len(pick)
        width = max(width, len(pick))
    xs = torch.cat(images).float().div(255).to(inputs.x.device)
    maps = fullgrad_map(inputs.model, xs, torch.tensor(labels, device=xs.device), score)
    with torch.no_grad():
        pred = inputs.model(xs).argmax(1).tolist()
    clean = {i: n for n, (i, j, _) in enumerate(stage_rows) if j == 0}  # each path's clean-image row
    flat = maps.flatten(1)
    cos = F.cosine_similarity(flat, flat[[clean[i] for i, _, _ in stage_rows]], dim=1).tolist()
    goal = [(inputs.targets or {}).get(i) for i, _, _ in stage_rows]
    fooled = [bool(fools(p, lab, g)) for p, g, lab in zip(pred, goal, labels)]
    header = ["index", "label", "stage", "step", "predicted", "cosine_to_clean", "adversarial"]
    rows = [[i, labels[n], j, st, pred[n], cos[n], fooled[n]] for n, (i, j, st) in enumerate(stage_rows)]
    arrays = {"maps": maps.cpu().numpy(), "owner": np.array([i for i, _, _ in stage_rows]),
              "steps": np.array([st for _, _, st in stage_rows]),
              "first_success": np.array(ends)}  # per path: the step of its first success, -1 (none, or end final)

    def panel(ax, n):
        overlay(ax, xs[n], arrays["maps"][n], f"{rows[n][0]} step {rows[n][3]}: pred {rows[n][4]}")

    return header, rows, arrays, lambda path, title: grid_figure(path, title, list(range(len(rows))), panel,
                                                                 cols=width)
