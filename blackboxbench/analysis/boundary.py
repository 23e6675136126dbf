"""Decision boundary visualization (DBV; BlackboxBench Tab. III, Supp. I): the decision surface (DBV-A, Yu et al.
2018, eqs. I.11-I.12) and dbViz (DBV-B, Somepalli et al., CVPR 2022).

Model-level tools take :class:`~blackboxbench.analysis.inputs.Inputs` and return ``(header, rows, arrays,
draw)``: a per-image table, the arrays behind the figure (saved as ``.npz``) and ``draw(path, title)``.
"""
import math

import numpy as np
import torch

from ..errors import BenchError
from ..family import forward_logits
from ..plotting import figure, grid_figure
from ..registry import ANALYSIS, ParamError
from ..rng import Streams
from ..threat import flat_norm, margin_loss, per_sample


def unit(v):
    """``v`` scaled to unit L2 norm per sample -> ``(unit rows, their norms)``."""
    size = flat_norm(v, "l2")
    return v / per_sample(size.clamp_min(1e-12), v), size


DIRECTION_SALT = 0x2545F4914F6CDD1D  # the analysis' own streams, apart from the attack's (same seed and index)


def random_directions(seed, index, alpha):
    """A standard normal direction per image from the image's own analysis stream (``seed``, its dataset
    ``index``, :data:`DIRECTION_SALT`), made orthogonal to ``alpha`` (Gram-Schmidt; both unit L2), so a plot's two
    axes are independent directions."""
    salted = (int(seed) ^ DIRECTION_SALT) % 2 ** 63
    beta = Streams(salted, max(index) + 1, "cpu").view(index).normal(alpha.shape[1:]).to(alpha)
    beta = beta - per_sample((beta * alpha).flatten(1).sum(1), alpha) * alpha
    return unit(beta)[0]


def first_crossing(values, steps):
    """The first ``steps`` position where ``values`` (S along a ray from S > 0) reaches 0 or below, linearly
    interpolated between grid points; NaN when it does not within the ray (or starts at or below 0)."""
    if values[0] <= 0:
        return math.nan
    for k in range(1, len(values)):
        if values[k] <= 0:
            return float(steps[k - 1] + (steps[k] - steps[k - 1]) * values[k - 1] / (values[k - 1] - values[k]))
    return math.nan


@ANALYSIS.register("decision_surface", inputs="model", paper="BlackboxBench Supp. I, eqs. I.11-I.12 (DBV-A)",
                   ranges={"steps": "int [3, 401]", "scale": "(0, inf)", "max_images": "int [1, 64]"})
def decision_surface(inputs, *, steps=41, scale=2.0, max_images=8):
    """V(i, j) = S(o + i alpha + j beta) (eq. I.11) on a ``steps`` x ``steps`` grid (``steps`` odd: o at its
    centre), i and j from -R to R in L2 units, R = ``scale`` x ||x_adv - o||_2 per image: o the clean image, alpha
    the unit direction of the run's adversarial perturbation, beta a unit random direction orthogonal to it (from
    the image's stream). Points are not clipped to [0, 1] (eq. I.11 has no clip). The table gives each image's
    distance to the boundary (S = 0) along +alpha and along the nearer of +-beta, to the grid's resolution."""
    if inputs.x_adv is None:
        raise BenchError("decision_surface needs the run's adversarial images: give a run saved with save_adv: true")
    if steps % 2 == 0:  # else the clean image o is no grid point: no centre, and the rays start half a cell out
        raise ParamError("steps", f"must be odd, so that the clean image is the grid's centre point; got {steps}")
    x, y = inputs.x[:max_images], inputs.y[:max_images]
    alpha, size = unit(inputs.x_adv[:max_images] - x)
    if bool((size == 0).any()):
        raise BenchError(f"image {inputs.index[int((size == 0).nonzero()[0])]} has no perturbation (not attacked); "
                         "pick attacked images with --indices")
    beta = random_directions(inputs.seed, inputs.index[:len(x)], alpha)
    t = torch.linspace(-1, 1, steps, device=x.device)
    surfaces, header, rows = [], ["index", "label", "l2_adv", "radius", "dist_adv", "dist_random"], []
    for k in range(len(x)):
        radius = float(scale * size[k])
        a, b = torch.meshgrid(t * radius, t * radius, indexing="ij")
        pts = x[k] + a.reshape(-1, 1, 1, 1) * alpha[k] + b.reshape(-1, 1, 1, 1) * beta[k]
        v = margin_loss(forward_logits(inputs.model, pts, inputs.model_name), y[k].expand(len(pts)))
        v = v.view(steps, steps).cpu().numpy()
        surfaces.append(v)
        mid, pos = steps // 2, (t[steps // 2:] * radius).cpu().numpy()
        rand = min(first_crossing(v[mid, mid:], pos), first_crossing(v[mid, mid::-1], pos),
                   key=lambda d: math.inf if math.isnan(d) else d)
        rows.append([inputs.index[k], int(y[k]), float(size[k]), radius, first_crossing(v[mid:, mid], pos), rand])
    arrays = {"surface": np.stack(surfaces), "axis": t.cpu().numpy(), "radius": np.array([r[3] for r in rows]),
              "index": np.array(inputs.index[:len(x)])}

    def panel(ax, k):
        r, s = rows[k][3], surfaces[k].T  # surfaces[k][i, j]: i along alpha (x axis), j along beta (y axis)
        ext, top = (-r, r, -r, r), float(np.abs(s).max()) or 1.0
        im = ax.imshow(s, origin="lower", extent=ext, cmap="RdBu", aspect="auto", vmin=-top, vmax=top)
        ax.contour(s, levels=[0.0], colors="k", extent=ext, origin="lower")
        ax.plot([rows[k][2]], [0], "k*")  # the adversarial image
        ax.set_xlabel("adversarial direction (L2)", fontsize=7)
        ax.set_ylabel("random direction (L2)", fontsize=7)
        ax.set_title(f"index {rows[k][0]}, label {rows[k][1]}", fontsize=8)
        ax.figure.colorbar(im, ax=ax, fraction=0.046)

    def draw(path, title):
        return grid_figure(path, title, list(range(len(rows))), panel)

    return header, rows, arrays, draw


@ANALYSIS.register("dbviz", inputs="model", paper="Somepalli et al., CVPR 2022 (dbViz); BlackboxBench Supp. I (DBV-B)",
                   ranges={"resolution": "int [3, 501]", "margin": "[0, 1]", "planes": "int [1, 16]",
                           "classes_shown": "int [1, 20]"})
def dbviz(inputs, *, resolution=50, margin=0.1, planes=1, classes_shown=10):
    """The predicted class on the plane through three images x1, x2, x3 (consecutive in the selection): points
    x1 + b v1 + p (v2 - proj_v1 v2), v1 = x2 - x1, v2 = x3 - x1 (the images at (b, p) = (0, 0), (1, 0), (c, 1), c =
    <v1, v2> / <v1, v1>), on a ``resolution`` x ``resolution`` grid over the three images' bounding box widened by
    ``margin`` times its side on each side, as dbViz's ``plane_dataset`` (range_l = range_r = ``margin``): b from
    min(0, c) - ``margin`` L to max(1, c) + ``margin`` L, L = max(1, c) - min(0, c), p from -``margin`` to 1 +
    ``margin`` (no clipping). The figure colours the ``classes_shown`` most frequent classes of the plane (the
    paper shows the top 10) and marks the three images. The table gives, per plane, the number of distinct classes
    and the share of the plane each image's own label holds."""
    if len(inputs.x) < 3 * planes:
        raise BenchError(f"dbviz needs 3 images per plane: {planes} plane(s), {len(inputs.x)} image(s) given")
    t = torch.linspace(-margin, 1 + margin, resolution, device=inputs.x.device)  # p: the images at 0, 0 and 1
    grids, marks, axes_b, header, rows = [], [], [], ["plane", "index_1", "index_2", "index_3", "n_classes",
                                                      "share_1", "share_2", "share_3"], []
    for q in range(planes):
        x1, x2, x3 = inputs.x[3 * q:3 * q + 3]
        v1, v2 = x2 - x1, x3 - x1
        c = float((v1 * v2).sum() / (v1 * v1).sum().clamp_min(1e-12))
        lo, hi = min(0.0, c), max(1.0, c)  # b: the images at 0, 1 and c
        tb = torch.linspace(lo - margin * (hi - lo), hi + margin * (hi - lo), resolution, device=inputs.x.device)
        axes_b.append(tb.cpu().numpy())
        b, p = torch.meshgrid(tb, t, indexing="ij")
        pts = x1 + b.reshape(-1, 1, 1, 1) * v1 + p.reshape(-1, 1, 1, 1) * (v2 - c * v1)
        labels = forward_logits(inputs.model, pts, inputs.model_name).argmax(1)
        labels = labels.view(resolution, resolution).cpu().numpy()
        grids.append(labels)
        marks.append([(0.0, 0.0), (1.0, 0.0), (c, 1.0)])
        own = [int(v) for v in inputs.y[3 * q:3 * q + 3]]
        rows.append([q, *inputs.index[3 * q:3 * q + 3], int(len(np.unique(labels))),
                     *[float((labels == k).mean()) for k in own]])
    arrays = {"labels": np.stack(grids), "axis_b": np.stack(axes_b), "axis_p": t.cpu().numpy(),
              "marks": np.array(marks), "index": np.array(inputs.index[:3 * planes])}

    def panel(ax, q):
        import matplotlib

        counts = np.bincount(grids[q].ravel())
        top = [int(k) for k in np.argsort(-counts)[:classes_shown] if counts[k] > 0]
        shown = np.full(grids[q].shape, len(top), dtype=float)  # the rest: one shared gray
        for rank, k in enumerate(top):
            shown[grids[q] == k] = rank
        colors = matplotlib.colormaps["tab10" if len(top) <= 10 else "tab20"].colors[:len(top)] + ((0.8, 0.8, 0.8),)
        cmap = matplotlib.colors.ListedColormap(colors)
        ext = (float(axes_b[q][0]), float(axes_b[q][-1]), t[0].item(), t[-1].item())
        ax.imshow(shown.T, origin="lower", extent=ext, cmap=cmap, vmin=-0.5, vmax=len(top) + 0.5,
                  interpolation="nearest", aspect="auto")
        for (u, w), lab in zip(marks[q], inputs.y[3 * q:3 * q + 3].tolist()):
            ax.plot([u], [w], "k^", ms=7)
            ax.annotate(str(lab), (u, w), textcoords="offset points", xytext=(4, 4), fontsize=8)
        handles = [matplotlib.patches.Patch(color=colors[r], label=str(k)) for r, k in enumerate(top)]
        ax.legend(handles=handles, fontsize=6, loc="upper right", title="class", title_fontsize=6)
        ax.set_title(f"plane {q}: images {', '.join(map(str, inputs.index[3 * q:3 * q + 3]))}", fontsize=8)

    return header, rows, arrays, lambda path, title: grid_figure(path, title, list(range(planes)), panel)


TSNE_LAYOUTS = ("per_path", "joint")


def tsne(points, perplexity, seed):
    """The 2-D t-SNE embedding of ``points`` (K, D): scikit-learn's, PCA start, ``perplexity`` capped below a third
    of the points, seeded. Fewer than 4 points (too few for t-SNE's neighbourhoods): their first two principal
    components instead (zero where the points span fewer dimensions)."""
    from sklearn.manifold import TSNE

    if len(points) < 4:
        centred = points - points.mean(0)
        _, sv, vt = np.linalg.svd(centred, full_matrices=False)
        out = np.zeros((len(points), 2), dtype=np.float32)
        k = min(2, int((sv > 1e-6 * max(float(sv[0]), 1e-30)).sum())) if len(sv) else 0
        out[:, :k] = centred @ vt[:k].T
        return out
    return TSNE(n_components=2, perplexity=min(perplexity, (len(points) - 1) / 3), init="pca",
                random_state=seed % 2 ** 32).fit_transform(points)


def _draw_path(ax, pts, label=None):
    """One path's embedded snapshots ``pts`` (K, 2): a line from the clean image (dot) to the returned one (star)."""
    line, = ax.plot(pts[:, 0], pts[:, 1], "-", lw=1, alpha=0.8, label=label)
    ax.scatter(pts[1:-1, 0], pts[1:-1, 1], s=8, color=line.get_color())
    ax.plot(*pts[0], "o", color="tab:blue", ms=7)
    ax.plot(*pts[-1], "*", color="tab:red", ms=11)


@ANALYSIS.register("path_tsne", inputs="model", paper="BlackboxBench Sec. IV, Fig. 11 (attack paths by t-SNE; not "
                   "among the 10 tools)", ranges={"max_images": "int [1, 16]", "perplexity": "(0, inf)",
                                                  "layout": TSNE_LAYOUTS})
def path_tsne(inputs, *, max_images=3, perplexity=10.0, layout="per_path"):
    """The attack paths of a run saved with ``save_path_every`` in two dimensions: every snapshot of the first
    ``max_images`` paths (clean image first, returned image last) embedded by t-SNE (:func:`tsne`, seeded by the
    run's seed), each path drawn as a line from its clean image (dot) to its returned image (star), as the paper's
    Fig. 11 does for NES and PGD. ``layout``: ``per_path`` (default), each path embedded on its own and drawn in
    its own panel, as Fig. 11 (one panel per sample and method: an easy, a medium and a hard sample for each of
    the two attacks); ``joint``, the paths embedded together in one panel, to compare them on common axes. A path
    (or, joint, all of them) of fewer than 4 snapshots, e.g. a sample fooled before its first saved step, is
    placed by its first two principal components (:func:`tsne`). The
    model is not used: the embedding is of the images alone."""
    if inputs.paths is None:
        raise BenchError("path_tsne needs the run's attack paths: run the attack with save_path_every: k")
    chosen = inputs.index[:max_images]
    owner, steps, points = [], [], []
    for i in chosen:
        s, images = inputs.paths[i]
        owner += [i] * len(s)
        steps += [int(v) for v in s]
        points.append(images.reshape(len(s), -1).astype(np.float32) / 255)
    if layout == "joint":
        emb = tsne(np.concatenate(points), perplexity, inputs.seed)
    else:
        emb = np.concatenate([tsne(p, perplexity, inputs.seed) for p in points])
    rows = [[i, k, st, float(a), float(b)] for k, (i, st, (a, b)) in enumerate(zip(owner, steps, emb))]
    own = np.array(owner)
    arrays = {"embedding": emb, "owner": own, "steps": np.array(steps),  # panel: each point's panel of the figure
              "panel": np.zeros(len(owner), int) if layout == "joint" else np.array([chosen.index(i) for i in owner])}

    def draw_joint(path, title):
        with figure(path, (5.6, 4.8)) as (_, axes):
            ax = axes[0, 0]
            for i in chosen:
                _draw_path(ax, emb[own == i], f"image {i}")
            ax.set_title(title + " (dot: clean image, star: returned image)", fontsize=8)
            ax.legend(fontsize=7)
        return path

    def panel(ax, i):
        _draw_path(ax, emb[own == i])
        for (u, w), st in list(zip(emb[own == i], arrays["steps"][own == i]))[::max(1, int((own == i).sum()) // 5)]:
            ax.annotate(str(st), (u, w), textcoords="offset points", xytext=(3, 3), fontsize=6)
        ax.set_title(f"image {i}", fontsize=8)

    def draw_panels(path, title):
        return grid_figure(path, f"{title} (dot: clean image, star: returned image; labels: steps)", list(chosen),
                           panel, cols=min(len(chosen), 6))

    draw = draw_joint if layout == "joint" else draw_panels
    return ["index", "point", "step", "tsne_1", "tsne_2"], rows, arrays, draw
