"""The model-level analysis tools (decision surface, dbViz, FSM, FullGrad; BlackboxBench Supp. I) against
independent references: FullGrad's completeness (the input and bias terms sum to the class score), FSM as the DFT
of a linear model's weights, the decision surface of a two-class linear model in closed form, the dbViz plane
through its three images; then every model recipe end to end on a real run's saved images, and one-line errors."""
import copy
import json

import numpy as np
import pytest
from PIL import Image
import torch
from torch import nn

import blackboxbench  # noqa: F401  (registers the tools)
from blackboxbench import catalog
from blackboxbench.analysis.boundary import decision_surface, dbviz, first_crossing, random_directions
from blackboxbench.analysis.inputs import Inputs, load_inputs
from blackboxbench.analysis.saliency import frequency_saliency, full_gradients, fullgrad_map, radial_profile
from blackboxbench.cli import main
from blackboxbench.config import load_config, load_yaml
from blackboxbench.errors import BenchError
from blackboxbench.prep.cifar_resnet import CifarResNet
from blackboxbench.prep.models import Normalized
from blackboxbench.registry import ANALYSIS, ParamError
from blackboxbench.runner import run_experiment

PNG = b"\x89PNG\r\n\x1a\n"
TINY_CGLOW = {"x_hidden_channels": 4, "x_hidden_size": 8, "y_hidden_channels": 8, "flow_depth": 1, "num_levels": 2}
MODEL_TOOLS = [n for n in ANALYSIS.names() if ANALYSIS.get(n).registry_meta.get("inputs") == "model"]


def _bn_with_stats(c, g):
    bn = nn.BatchNorm2d(c)
    bn.running_mean.uniform_(-0.5, 0.5, generator=g)
    bn.running_var.uniform_(0.5, 2.0, generator=g)
    bn.weight.data.uniform_(0.5, 1.5, generator=g)
    bn.bias.data.uniform_(-0.3, 0.3, generator=g)
    return bn


def small_net(inplace=False):
    """A piecewise-linear CNN with every kind of bias FullGrad reads: conv biases, BatchNorm (eval, non-trivial
    statistics), the input normalization, a linear layer; pooling and ReLUs (in place or not)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), _bn_with_stats(6, g), nn.ReLU(inplace=inplace),
                        nn.MaxPool2d(2), nn.Conv2d(6, 8, 3, padding=1, bias=False), _bn_with_stats(8, g),
                        nn.ReLU(inplace=inplace), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5))
    return Normalized(net, mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3]).eval()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("score", ["label", "predicted"])
def test_fullgrad_completeness(inplace, score):
    model = small_net(inplace)
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 3])
    f, inp, biases = full_gradients(model, x, y, score)
    with torch.no_grad():
        logits = model(x)
    cls = y if score == "label" else logits.argmax(1)
    assert torch.allclose(f, logits[torch.arange(4), cls])
    total = inp.flatten(1).sum(1) + sum(b.flatten(1).sum(1) for b in biases)
    assert torch.allclose(total, f, rtol=1e-4, atol=1e-4), (total, f)
    assert len(biases) == 5  # normalization, conv1, bn1, bn2, linear (conv2 has no bias)


def test_fullgrad_completeness_on_the_cifar_resnet():
    torch.manual_seed(0)
    net = CifarResNet(in_channels=3, blocks=1, widths=(8, 16, 32)).eval()
    g = torch.Generator().manual_seed(2)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.load_state_dict(_bn_with_stats(m.num_features, g).state_dict())
    model = Normalized(net, mean=[0.49, 0.48, 0.45], std=[0.25, 0.24, 0.26]).eval()
    x = torch.rand(3, 3, 16, 16, generator=g)
    f, inp, biases = full_gradients(model, x, torch.tensor([0, 1, 2]))
    total = inp.flatten(1).sum(1) + sum(b.flatten(1).sum(1) for b in biases)
    assert torch.allclose(total, f, rtol=1e-4, atol=1e-4)
    s = fullgrad_map(model, x, torch.tensor([0, 1, 2]))
    assert s.shape == (3, 16, 16) and float(s.min()) == 0.0 and float(s.amax(dim=(1, 2)).min()) == 1.0


def test_fullgrad_leaves_the_model_as_it_was():
    model = small_net(True)
    before = copy.deepcopy(model.state_dict())
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)
    full_gradients(model, x, torch.tensor([0, 1]))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_fullgrad_psi_by_hand():
    """psi as the FullGrad authors' code: abs, one min-max over all channels of the term (not per channel; eps 1e-6
    on the maximum), bilinear resize with aligned corners (2 x 2 -> 3 x 3: the corners kept, the midpoints the means
    of their neighbours)."""
    from blackboxbench.analysis.saliency import _psi

    t = torch.tensor([[[[1.0, -2.0], [3.0, 4.0]], [[0.0, 0.5], [-1.0, 2.0]]]], dtype=torch.float64)
    ref = torch.tensor([[[1.0, 1.5, 2.0], [2.0, 2.5, 3.0], [3.0, 3.5, 4.0]],
                        [[0.0, 0.25, 0.5], [0.5, 0.875, 1.25], [1.0, 1.5, 2.0]]], dtype=torch.float64) / (4 + 1e-6)
    assert torch.allclose(_psi(t, (3, 3))[0], ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(_psi(t, (2, 2))[0], t[0].abs() / (4 + 1e-6))  # at the image size: no resize
    shifted = _psi(t.abs() + 1.0, (2, 2))[0]  # the minimum over the whole term is subtracted
    assert float(shifted.min()) == 0.0 and float(shifted[0, 1, 1]) == pytest.approx(1.0, abs=1e-6)


def _bilinear_aligned(m, size):
    """Bilinear resize of a NumPy map (H, W) to ``size`` with the corner pixels aligned, written out."""
    h, w = m.shape
    out = np.empty(size)
    for i in range(size[0]):
        for j in range(size[1]):
            u = i * (h - 1) / (size[0] - 1) if size[0] > 1 else 0.0
            v = j * (w - 1) / (size[1] - 1) if size[1] > 1 else 0.0
            i0, j0 = min(int(u), h - 2) if h > 1 else 0, min(int(v), w - 2) if w > 1 else 0
            a, b = u - i0, v - j0
            i1, j1 = min(i0 + 1, h - 1), min(j0 + 1, w - 1)
            out[i, j] = ((1 - a) * (1 - b) * m[i0, j0] + (1 - a) * b * m[i0, j1] + a * (1 - b) * m[i1, j0]
                         + a * b * m[i1, j1])
    return out


def test_fullgrad_map_against_the_authors_recipe_in_numpy():
    """S_f of eq. I.1 assembled from the full-gradient terms by the FullGrad authors' recipe, written in NumPy:
    per term and image abs, (t - min) / (max - min + 1e-6) over all its channels, aligned-corner bilinear resize
    of 4-D maps (the linear layer's left out), channels and terms summed, then min-max for display."""
    model = small_net()
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    y = torch.tensor([1, 4])
    _, inp, biases = full_gradients(model, x, y, "label")
    ref = []
    for k in range(2):
        total = np.zeros((8, 8))
        for term in [inp] + [b for b in biases if b.dim() == 4]:
            a = np.abs(term[k].double().numpy())
            a = a - a.min()
            a = a / (a.max() + 1e-6)
            total += sum(_bilinear_aligned(c, (8, 8)) for c in a)
        ref.append((total - total.min()) / (total.max() - total.min()))
    got = fullgrad_map(model, x, y, "label").double().numpy()
    assert np.allclose(got, np.stack(ref), atol=1e-5)


class Linear(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False)

    def forward(self, x):
        return x.flatten(1) @ self.w.flatten(1).T + self.b


def test_fsm_is_the_dft_of_a_linear_models_weights():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, 6, 6, generator=g, dtype=torch.float64)
    model = Linear(w.float(), torch.zeros(4))
    x, y = torch.rand(5, 3, 6, 6, generator=g), torch.tensor([0, 1, 1, 3, 0])
    inputs = Inputs(model, "lin", x, y, list(range(5)))
    _, rows, arrays, _ = frequency_saliency(inputs, score="label")
    wn = w.numpy()
    ref = np.mean([np.fft.fftshift(np.abs(np.fft.fft2(wn[c])), axes=(-2, -1)).mean(0) for c in y.tolist()], 0)
    assert np.allclose(arrays["fsm"], ref, rtol=1e-5, atol=1e-6)
    assert np.allclose([r[1] for r in rows], radial_profile(ref))


def test_radial_profile_by_hand():
    m = np.arange(9, dtype=float).reshape(3, 3)  # centre (1, 1): radius 0 -> 4; radius 1 -> 1, 3, 5, 7 (and
    prof = radial_profile(m)                     # the corners at sqrt(2) round to 1): mean of 0..8 without 4
    assert prof[0] == 4 and prof[1] == pytest.approx(np.mean([0, 1, 2, 3, 5, 6, 7, 8]))


def test_decision_surface_of_a_two_class_linear_model():
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(2, 1, 4, 4, generator=g), torch.tensor([0.3, -0.2])
    model = Linear(w, b)
    x = torch.rand(3, 1, 4, 4, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)
    sign = torch.where(y == 0, 1.0, -1.0).view(-1, 1, 1, 1)
    gdir = (w[0] - w[1])[None] * sign  # S(x) = <g, x> + c for the label's side
    x_adv = x - 0.7 * gdir / gdir.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    inputs = Inputs(model, "lin", x, y, [5, 9, 2], x_adv=x_adv, seed=7)
    header, rows, arrays, _ = decision_surface(inputs, steps=201, scale=3.0)
    with torch.no_grad():
        logits = model(x)
    s0 = logits[torch.arange(3), y] - logits[torch.arange(3), 1 - y]  # two classes: the label's minus the other
    for k, row in enumerate(rows):
        slope = float(gdir[k].flatten().norm())  # S falls by |g| per unit L2 along alpha
        assert row[4] == pytest.approx(float(s0[k]) / slope, rel=1e-3)
        surf = arrays["surface"][k]
        assert surf[100, 100] == pytest.approx(float(s0[k]), rel=1e-4)
    alpha = (x_adv - x) / (x_adv - x).flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    beta = random_directions(7, [5, 9, 2], alpha)
    assert torch.allclose((alpha * beta).flatten(1).sum(1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(beta.flatten(1).norm(dim=1), torch.ones(3), atol=1e-5)
    # a sample's direction depends on (seed, index), not on the other images selected with it
    assert torch.equal(random_directions(7, [9], alpha[1:2]), beta[1:2])


def test_decision_surface_needs_an_odd_grid():
    """With an even number of steps the clean image is no grid point: the ray along +alpha starts half a cell
    out (a boundary nearer than that read as none) and the one along -beta is read at the wrong distances."""
    g = torch.Generator().manual_seed(4)
    model = Linear(torch.randn(2, 1, 4, 4, generator=g), torch.tensor([0.3, -0.2]))
    x = torch.rand(2, 1, 4, 4, generator=g)
    inputs = Inputs(model, "lin", x, torch.tensor([0, 1]), [0, 1], x_adv=x + 0.1, seed=7)
    with pytest.raises(ParamError, match="steps: must be odd"):
        decision_surface(inputs, steps=8)
    assert decision_surface(inputs, steps=9)[2]["surface"].shape == (2, 9, 9)


def test_first_crossing():
    steps = np.array([0.0, 1.0, 2.0, 3.0])
    assert first_crossing(np.array([3.0, 1.0, -1.0, -2.0]), steps) == pytest.approx(1.5)
    assert np.isnan(first_crossing(np.array([3.0, 2.0, 1.0, 0.5]), steps))
    assert np.isnan(first_crossing(np.array([-1.0, 2.0, 1.0, 0.5]), steps))
    # interpolated from the last positive point: 1 + 1 / (1 + 3); a ray that starts on the boundary has no crossing
    assert first_crossing(np.array([3.0, 1.0, -3.0, -4.0]), steps) == pytest.approx(1.25)
    assert np.isnan(first_crossing(np.array([0.0, -1.0, -2.0, -3.0]), steps))


def test_dbviz_plane_passes_through_its_images():
    g = torch.Generator().manual_seed(5)
    model = Linear(torch.randn(4, 1, 5, 5, generator=g), torch.zeros(4))
    x = torch.rand(3, 1, 5, 5, generator=g)
    inputs = Inputs(model, "lin", x, torch.tensor([0, 1, 2]), [0, 1, 2])
    _, rows, arrays, _ = dbviz(inputs, resolution=61, margin=0.1)
    labels, t = arrays["labels"][0], arrays["axis_p"]
    with torch.no_grad():
        pred = model(x).argmax(1).tolist()
    (c, one) = arrays["marks"][0][2]
    assert 0 < c < 1 and np.array_equal(arrays["axis_b"][0], t)  # x3 between x1 and x2 along v1: the box is [0, 1]^2
    assert t[5] == pytest.approx(0.0, abs=1e-6) and t[55] == pytest.approx(1.0)
    assert labels[5, 5] == pred[0] and labels[55, 5] == pred[1]
    v1, v2 = x[1] - x[0], x[2] - x[0]
    assert one == 1.0 and torch.allclose(x[0] + c * v1 + (v2 - c * v1), x[2])
    assert rows[0][4] == len(np.unique(labels))
    assert rows[0][5:] == pytest.approx([float((labels == k).mean()) for k in (0, 1, 2)])


def test_dbviz_plane_covers_a_third_image_beyond_the_second():
    """dbViz's plane_dataset spans the three images' bounding box (widened by the margin times its side): with x3
    projecting 5 x (x2 - x1) along v1, b runs from -0.5 to 5.5 and the grid point (5, 1) is x3."""
    g = torch.Generator().manual_seed(8)
    model = Linear(torch.randn(4, 1, 5, 5, generator=g), torch.zeros(4))
    x1, e, f = torch.rand(1, 5, 5, generator=g), torch.randn(1, 5, 5, generator=g), torch.randn(1, 5, 5, generator=g)
    f = f - (f * e).sum() / (e * e).sum() * e  # orthogonal to e
    x = torch.stack([x1, x1 + 0.1 * e, x1 + 0.5 * e + 0.1 * f])
    inputs = Inputs(model, "lin", x, torch.tensor([0, 1, 2]), [0, 1, 2])
    _, _, arrays, _ = dbviz(inputs, resolution=61, margin=0.1)
    (c, one), tb, tp = arrays["marks"][0][2], arrays["axis_b"][0], arrays["axis_p"]
    assert c == pytest.approx(5.0, rel=1e-4) and one == 1.0
    assert tb[0] == pytest.approx(-0.5, abs=1e-4) and tb[-1] == pytest.approx(5.5, abs=1e-4)
    assert tb[55] == pytest.approx(5.0, abs=1e-4) and tb[15] == pytest.approx(1.0, abs=1e-4)
    assert tp[5] == pytest.approx(0.0, abs=1e-6) and tp[55] == pytest.approx(1.0)
    with torch.no_grad():
        pred = model(x).argmax(1).tolist()
    labels = arrays["labels"][0]
    assert [labels[5, 5], labels[15, 5], labels[55, 55]] == pred


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished Square run on 6 digits images with its adversarial images and attack paths saved."""
    return finished_run(tmp_path_factory.mktemp("run"), "dataset: {name: digits, n: 6}\nmodel: digits_cnn\n"
                        "attack: square_linf\nsave_adv: true\nsave_path_every: 5\n"
                        "threat: {norm: linf, eps: 0.3, max_queries: 300}\n")


def finished_run(tmp, config):
    """(run folder, summary) of the run of ``config`` (YAML text without output_dir), results under ``tmp``."""
    cfg = tmp / "run.yaml"
    cfg.write_text(f"output_dir: {tmp / 'results'}\n" + config)
    (exp,), _ = load_config(cfg, [])
    return run_experiment(exp, progress=False)


def test_inputs_of_a_run(saved_run):
    run_dir, _ = saved_run
    inputs = load_inputs(run=run_dir, n=3)
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    attacked = sorted(r["index"] for r in records if r["attacked"])
    assert inputs.index == attacked[:3] and inputs.model_name == "digits_cnn"
    d = (inputs.x_adv - inputs.x).flatten(1).abs().amax(1)
    assert bool((d <= 0.3 + 1e-6).all()) and bool((d > 0).all())


def test_fullgrad_along_the_path(saved_run):
    from blackboxbench.analysis.saliency import fullgrad_path

    inputs = load_inputs(run=saved_run[0], n=2)
    header, rows, arrays, _ = fullgrad_path(inputs, stages=3)
    for i in inputs.index:
        steps, images = inputs.paths[i]
        mine = [r for r in rows if r[0] == i]
        pick = sorted({0, round((len(steps) - 1) / 2), len(steps) - 1})
        assert [r[3] for r in mine] == [int(steps[k]) for k in pick] and mine[0][5] == pytest.approx(1.0)
        first = int(np.flatnonzero(arrays["owner"] == i)[0])  # the path's clean image
        assert arrays["steps"][first] == 0
        assert np.allclose(arrays["maps"][first], fullgrad_map(inputs.model, inputs.x[inputs.index.index(i)][None],
                                                               inputs.y[:1], "predicted")[0].numpy(), atol=1e-5)


def test_path_tsne_embeds_every_snapshot(saved_run):
    from blackboxbench.analysis.boundary import path_tsne

    inputs = load_inputs(run=saved_run[0], n=3)
    steps = [s for i in inputs.index for s in inputs.paths[i][0].tolist()]
    for layout in ("per_path", "joint"):
        _, rows, arrays, _ = path_tsne(inputs, max_images=3, layout=layout)
        assert [r[2] for r in rows] == steps and arrays["embedding"].shape == (len(steps), 2)
        assert [r[0] for r in rows if r[2] == 0] == inputs.index  # each path starts at its clean image
        again = path_tsne(inputs, max_images=3, layout=layout)[2]["embedding"]
        assert np.array_equal(again, arrays["embedding"])  # seeded by the run's seed
    short = Inputs(inputs.model, "m", inputs.x[:1], inputs.y[:1], inputs.index[:1],
                   paths={inputs.index[0]: (np.array([0, 3]), inputs.paths[inputs.index[0]][1][:2])})
    for layout in ("per_path", "joint"):  # 2 snapshots: too few for t-SNE, placed by principal components
        emb = path_tsne(short, layout=layout)[2]["embedding"]
        a, b = short.paths[inputs.index[0]][1].reshape(2, -1).astype(np.float64) / 255
        assert emb.shape == (2, 2) and np.allclose(emb[:, 1], 0) and np.allclose(emb[:, 0], -emb[::-1, 0])
        assert abs(emb[0, 0] - emb[1, 0]) == pytest.approx(np.linalg.norm(a - b), rel=1e-4)


def test_path_tsne_one_panel_per_path(saved_run, monkeypatch, tmp_path):
    """Fig. 11's layout (the default): each path embedded on its own, in its own panel: a path's coordinates are
    those of that path embedded alone, whatever the other paths; the joint layout embeds them together, one panel."""
    import blackboxbench.analysis.boundary as boundary

    inputs = load_inputs(run=saved_run[0], n=3)
    _, _, per, draw = boundary.path_tsne(inputs, max_images=3)
    _, _, joint, draw_joint = boundary.path_tsne(inputs, max_images=3, layout="joint")
    assert per["panel"].tolist() == [inputs.index.index(i) for i in per["owner"]] and set(joint["panel"]) == {0}
    for k, i in enumerate(inputs.index):
        alone = Inputs(inputs.model, "m", inputs.x[k:k + 1], inputs.y[k:k + 1], [i], seed=inputs.seed,
                       paths={i: inputs.paths[i]})
        own = boundary.path_tsne(alone, layout="joint")[2]["embedding"]
        assert np.array_equal(per["embedding"][per["owner"] == i], own)
    assert not np.allclose(joint["embedding"][joint["owner"] == inputs.index[0]],
                           per["embedding"][per["owner"] == inputs.index[0]])
    drawn = []
    monkeypatch.setattr(boundary, "grid_figure", lambda path, title, panels, fn, cols: drawn.append(list(panels)))
    draw(tmp_path / "p.png", "t")
    assert drawn == [inputs.index]  # one panel per path
    assert draw_joint(tmp_path / "j.png", "t").read_bytes()[:8] == PNG and len(drawn) == 1


class _Brightness(nn.Module):
    """Three class scores from an image's mean brightness m (one channel): 0.5 - m, m - 0.5, 6 (m - 0.8) (a 1 x 1
    convolution, then the mean): class 0 below m = 0.5, class 1 above, class 2 above m = 0.9 (m = 0.902 here)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.tensor([-1.0, 1.0, 6.0]).view(3, 1, 1, 1))
            self.conv.bias.copy_(torch.tensor([0.5, -0.5, -4.8]))

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3))


def _brightness_path(levels):
    """A path of 4 x 4 gray images of the given uint8 levels, steps 0, 2, 4, ..."""
    return np.arange(len(levels)) * 2, np.stack([np.full((1, 4, 4), v, np.uint8) for v in levels])


def test_fullgrad_path_ends_at_the_first_success():
    """Figs. 28-29: a successful transfer path runs to its first successful snapshot; Figs. 27, 30-32: to its end.
    The brightness model changes its mind at known snapshots: at step 6 (class 0 -> 1) and step 10 (-> 2)."""
    from blackboxbench.analysis.saliency import first_success, fullgrad_path

    model = _Brightness().eval()
    fooled = _brightness_path([26, 77, 115, 153, 179, 230])   # means 0.10, 0.30, 0.45, 0.60, 0.70, 0.90
    never = _brightness_path([26, 51, 77, 102, 115, 120])     # stays below 0.5: class 0 throughout
    x = torch.stack([torch.from_numpy(p[1][0]).float().div(255) for p in (fooled, never)])
    assert model(x).argmax(1).tolist() == [0, 0]
    assert first_success(model, fooled[1], 0) == 3 and first_success(model, fooled[1], 0, target=2) == 5
    assert first_success(model, never[1], 0) is None
    assert first_success(model, _brightness_path([153, 26, 153])[1], 0) == 2  # the clean image itself is not counted

    def run(family, end="auto", targets=None):
        inputs = Inputs(model, "m", x, torch.tensor([0, 0]), [4, 9], paths={4: fooled, 9: never}, family=family,
                        targets=targets)
        header, rows, arrays, _ = fullgrad_path(inputs, stages=6, end=end)
        steps = {i: [r[3] for r in rows if r[0] == i] for i in (4, 9)}
        return steps, arrays["first_success"].tolist(), {i: [r[-1] for r in rows if r[0] == i] for i in (4, 9)}

    whole = [0, 2, 4, 6, 8, 10]
    steps, first, adv = run("transfer")                               # auto: the paper's choice for transfer runs
    assert steps == {4: [0, 2, 4, 6], 9: whole} and first == [6, -1]  # linspace(0, 3, 6) rounded: 0, 1, 2, 3
    assert adv == {4: [False, False, False, True], 9: [False] * 6}
    assert run("transfer", "final")[0] == {4: whole, 9: whole}
    assert run("score")[0] == {4: whole, 9: whole}                    # query runs: 6 stages to the end (Figs. 30-32)
    assert run("score", "first_success")[0][4] == [0, 2, 4, 6]
    steps, first, adv = run("transfer", targets={4: 2, 9: 2})         # targeted: the target class 2 at step 10
    assert steps[4] == whole and first == [10, -1] and adv[4] == [False] * 5 + [True]


def test_fullgrad_path_of_a_targeted_transfer_run(tmp_path):
    """A real targeted transfer run: the inputs know its family and its targets, and by default each path ends at
    its first snapshot that the analysed model (the run's target) puts in the target class."""
    from blackboxbench.analysis.saliency import fullgrad_path

    run_dir, _ = finished_run(tmp_path, "dataset: {name: digits, n: 4}\nsurrogates: [digits_cnn]\n"
                              "targets: [digits_mlp]\nattack: {recipe: mi_fgsm, hyper: {iterations: 10}}\nsave_path_every: 1\n"
                              "threat: {norm: linf, eps: 0.3, targeted: true}\n")
    inputs = load_inputs(run=run_dir)
    records = {r["index"]: r for r in map(json.loads, (run_dir / "records.jsonl").read_text().splitlines())}
    assert inputs.family == "transfer" and inputs.targets == {i: records[i]["target"] for i in inputs.index}
    _, rows, arrays, _ = fullgrad_path(inputs, max_images=4)
    cut = 0
    for k, i in enumerate(inputs.index):
        steps, images = inputs.paths[i]
        with torch.no_grad():
            pred = inputs.model(torch.from_numpy(images).float() / 255).argmax(1).tolist()
        hits = [s for s, p in zip(steps.tolist()[1:], pred[1:]) if p == records[i]["target"]]
        last = hits[0] if hits else int(steps[-1])
        assert [r[3] for r in rows if r[0] == i][-1] == last and arrays["first_success"][k] == (hits or [-1])[0]
        cut += last < steps[-1]
    assert cut >= 1  # some path ends before the final iterate


def test_a_run_without_some_images(saved_run, tmp_path):
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run[0], run_dir)
    (run_dir / "adv" / "000001.png").unlink()  # as for a sample the run did not attack
    (run_dir / "path" / "000001.npz").unlink()
    with pytest.raises(BenchError, match=r"adv has no file of samples \[1\] \(not attacked\)"):
        load_inputs(run=run_dir, indices=[0, 1])
    assert load_inputs(run=run_dir).index == [0, 2, 3, 4, 5]  # by default, the saved ones


@pytest.mark.parametrize("tool", MODEL_TOOLS)
def test_every_model_recipe_on_a_run(saved_run, tmp_path, capsys, tool):
    run_dir, _ = saved_run
    recipe = next(n for n, p in catalog.entries("analysis").items() if load_yaml(p)["tool"] == tool)
    args = {"fsm": ["--param", "log=false"], "dbviz": ["--param", "resolution=9"],
            "adm": ["--model", "[digits_cnn, digits_mlp]", "--param", "train={name: digits, split: train, n: 40}",
                    "--param", "epochs=1", "--param", "pretrain_epochs=1", "--param", "samples=12", "--param",
                    "eps=0.3", "--param", "batch=8",
                    *[a for k, v in TINY_CGLOW.items() for a in ("--param", f"{k}={v}")]]}
    args = args.get(tool, ["--param", "max_images=3"])
    assert main(["analyze", "-r", recipe, "--run", str(run_dir), *args, "--device", "cpu", "-o",
                 str(tmp_path / "fig.png")]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    if "max_images=3" in args:  # more images loaded: the count printed is the images drawn, and a note says so
        loaded = len(load_inputs(run=run_dir).index)
        assert loaded > 3 and "(3 images)" in out, out
        assert f"draws its first max_images=3 of the {loaded} images loaded" in err, err
    assert (tmp_path / "fig.png").read_bytes()[:8] == PNG
    assert (tmp_path / "fig.csv").read_text().count("\n") >= 2 and np.load(tmp_path / "fig.npz").files


def test_model_analysis_errors_are_one_line(saved_run, tmp_path, capsys):
    run_dir, _ = saved_run
    cases = [
        (["-r", "decision_surface", "--model", "digits_cnn", "--dataset", "digits"],
         "decision_surface needs the run's adversarial images"),
        (["-r", "aev_line", "--run", str(run_dir)], "tool 'aev_line' reads results, not model: run it with "
                                                    "blackboxbench plot"),
        (["-r", "fsm", "--run", str(run_dir), "--indices", "5000"], "image indices [5000] are not in the dataset"),
        (["-r", "fsm", "--run", str(run_dir), "--indices", "a,b"], "--indices expects comma-separated integers"),
        (["-r", "fsm"], "give a run directory (--run) or both a model"),
        (["-r", "fsm", "--model", "digits_cnn", "--dataset", "{name: digits, nn: 3}"],
         "command line:--dataset.nn: unknown parameter of block 'digits' (did you mean: n?)"),
        (["-r", "fsm", "--model", "digits_cnn", "--dataset", "{n: 3}"], "a dataset spec is a name or a mapping"),
        (["-r", "fsm", "--run", str(tmp_path)], "not a run directory (no config.yaml)"),
        (["-r", "fsm", "--run", str(run_dir), "--model", "digits_cn"], "unknown model 'digits_cn'"),
        (["-r", "dbviz", "--run", str(run_dir), "--n", "2"], "dbviz needs 3 images per plane"),
        (["-r", "fsm", "--run", str(run_dir), "--param", "score=logit"], "params.score: must be one of label"),
        (["-r", "fullgrad_path", "--model", "digits_cnn", "--dataset", "digits"],
         "fullgrad_path needs the run's attack paths"),
        (["-r", "fsm", "--run", str(run_dir), "--n", "0"], "--n must be >= 1 (the first n images), got 0"),
        (["-r", "fsm", "--run", str(run_dir), "--n", "-3"], "--n must be >= 1"),  # once the last 3 dropped
        (["-r", "fsm", "--run", str(run_dir), "--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
        (["-r", "fullgrad", "--model", "{name: shapes_fcos, pretrained: false}", "--dataset", "{name: shapes, n: 2}"],
         "model shapes_fcos answers a list, not one row of class scores per image: the model-level analyses"),
        (["-r", "fsm", "--model", "digits_cnn", "--dataset", "{name: shapes, n: 2}"],
         "model digits_cnn cannot take the images of dataset shapes (shape (3, 64, 64))"),
        (["-r", "fsm", "--run", str(run_dir), "--dataset", "{name: digits, split: train}"],
         "beyond the run's eps 0.3: the dataset is not the one the run attacked (another --dataset, or its files "
         "changed)"),
        (["-r", "fsm", "--model", "digits_cnn", "--dataset", f"{{name: imagefolder, path: {tmp_path / 'imf'}, "
          "classes: {a: 15}, grayscale: true}"], "model digits_cnn outputs 10 classes but dataset imagefolder has "
                                                  "labels up to 15"),
    ]
    (tmp_path / "imf" / "a").mkdir(parents=True)  # two 8 x 8 grayscale images of class 15
    for k in range(2):
        Image.fromarray(np.full((8, 8), 40 * k, dtype=np.uint8)).save(tmp_path / "imf" / "a" / f"{k}.png")
    det = tmp_path / "det_run"  # a detection run's resolved config: no classifier to analyse
    det.mkdir()
    (det / "config.yaml").write_text("dataset: {name: shapes}\nattack: {name: tog_vanishing, family: detection}\n")
    cases.append((["-r", "fsm", "--run", str(det)], f"{det} is a detection run: the model-level analyses"))
    for args, message in cases:
        assert main(["analyze", *args, "--device", "cpu", "-o", str(tmp_path / "e.png")]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (args, err)
    assert main(["analyze", "-r", "fsm", "--run", str(run_dir), "--device", "tpu", "-o", str(tmp_path / "e.png")]) == 2
    assert capsys.readouterr().err == "error: --device must be one of auto, cpu, cuda, got 'tpu'\n"
    assert main(["plot", str(tmp_path), "-r", "fullgrad"]) == 2
    assert "tool 'fullgrad' reads model, not results: run it with blackboxbench analyze" in capsys.readouterr().err


def test_fsm_adversarial_training_moves_attention_to_low_frequencies(data_root):
    """The paper's Fig. 25 reading, in direction: the adversarially trained CIFAR models' FSM holds a larger share
    of its magnitude at low frequencies than the normally trained ResNets' (benchmarks/RESULTS.md: 0.11-0.15 vs
    0.03 on 100 images)."""
    def low_share(name):
        inputs = load_inputs(model=name, dataset={"name": "cifar10", "n": 32}, data_root=data_root)
        m = frequency_saliency(inputs)[2]["fsm"]
        yy, xx = np.indices(m.shape)
        return float(m[np.hypot(yy - 16, xx - 16) <= 4].sum() / m.sum())

    normal = [low_share(n) for n in ("cifar_resnet20", "cifar_resnet56")]
    robust = [low_share(n) for n in ("cifar_resnet4b_adv", "cifar_cnn_a_adv")]
    assert max(normal) < 0.06 and min(robust) > 0.08, (normal, robust)


def test_plugin_analysis_tools_and_datasets_reach_plots_and_analyze(tmp_path, capsys, fresh_registries):
    """A config's plugins are imported before its plots are checked (a plot may use a plugin tool); analyze --run
    imports the run's own plugins (its dataset came from one); plot and analyze take --plugin."""
    plug = tmp_path / "aplug.py"
    plug.write_text(
        "from blackboxbench.registry import ANALYSIS, DATASET\nfrom blackboxbench.prep.data import digits\n\n\n"
        "@DATASET.register('flipped_digits_t', paper='test')\ndef flipped_digits_t(data_root=None, *, n=None):\n"
        "    d = digits(None, n=n)\n    d.x = d.x.flip(-1)\n    return d\n\n\n"
        "@ANALYSIS.register('row_count_t', paper='test')\ndef row_count_t(rows, *, y='asr'):\n"
        "    return ['y'], [[r.get(y)] for r in rows], lambda path, title: __import__('pathlib').Path(path)"
        ".write_bytes(b'\\x89PNG\\r\\n\\x1a\\n') and path\n\n\n"
        "@ANALYSIS.register('mean_pixel_t', inputs='model', paper='test')\ndef mean_pixel_t(inputs):\n"
        "    m = inputs.x.mean(dim=(1, 2, 3)).cpu().numpy()\n"
        "    return ['mean'], [[float(v)] for v in m], {'m': m}, lambda path, title: __import__('pathlib')"
        ".Path(path).write_bytes(b'\\x89PNG\\r\\n\\x1a\\n') and path\n")
    (tmp_path / "rows.yaml").write_text("name: rows\ntool: row_count_t\npaper: test\n")
    (tmp_path / "mean.yaml").write_text("name: mean\ntool: mean_pixel_t\npaper: test\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plugins: [aplug.py]\ndataset: {{name: flipped_digits_t, n: 4}}\nmodel: digits_mlp\n"
                   f"attack: square_linf\nthreat: {{norm: linf, eps: 0.2, max_queries: 20}}\nsave_adv: true\n"
                   f"output_dir: {tmp_path / 'res'}\nplots:\n  - {{recipe: {tmp_path / 'rows.yaml'}, "
                   f"output: {tmp_path / 'res' / 'rows.png'}}}\n")
    import sys

    from blackboxbench.registry import restore, snapshot

    before = snapshot()
    assert main(["run", str(cfg), "--quiet"]) == 0, capsys.readouterr().err
    assert (tmp_path / "res" / "rows.csv").read_text().count("\n") == 2
    (run,) = (tmp_path / "res").glob("square_linf_*")
    restore(before)  # as in a new process: the plugin's registrations gone, its module not imported
    for name in [m for m, mod in sys.modules.items() if getattr(mod, "__file__", None) == str(plug)]:
        del sys.modules[name]
    assert main(["analyze", "-r", str(tmp_path / "mean.yaml"), "--run", str(run), "--device", "cpu", "-o",
                 str(tmp_path / "m.png")]) == 0, capsys.readouterr().err
    assert main(["plot", str(tmp_path / "res"), "-r", str(tmp_path / "rows.yaml"), "--plugin", str(plug), "-o",
                 str(tmp_path / "p.png")]) == 0, capsys.readouterr().err
    assert main(["analyze", "-r", str(tmp_path / "mean.yaml"), "--plugin", str(plug), "--model", "digits_mlp",
                 "--dataset", "flipped_digits_t", "--n", "2", "--device", "cpu", "-o", str(tmp_path / "a.png")]) == 0


def test_analyze_finds_a_relative_data_root_from_elsewhere(tmp_path, monkeypatch):
    """A run whose config gives a relative data_root records where it was; analyze --run from another directory
    reads the same images (it used to say the data root is not a directory)."""
    for k in range(3):
        (tmp_path / "droot" / "imf" / "a").mkdir(parents=True, exist_ok=True)
        image = np.full((8, 8), 60 * k + 20, dtype=np.uint8)
        Image.fromarray(image).save(tmp_path / "droot" / "imf" / "a" / f"{k}.png")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("data_root: droot\ndataset: {name: imagefolder, path: imf, classes: {a: 1}, grayscale: true}\n"
                   "model: digits_cnn\nattack: square_linf\nsave_adv: true\nthreat: {norm: linf, eps: 0.3, "
                   f"max_queries: 50}}\noutput_dir: {tmp_path / 'results'}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(cfg), "--quiet"]) == 0
    (run,) = (tmp_path / "results").iterdir()
    monkeypatch.chdir(tmp_path / "results")
    assert main(["analyze", "-r", "fsm", "--run", str(run), "--device", "cpu", "-o", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").exists()
