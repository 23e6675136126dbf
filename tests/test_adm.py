"""The adversarial divergence tool (ADM, ``analysis/divergence.py``): eq. I.4 against a by-hand reference, the
family averages, the KL estimate of eq. I.10 against the closed-form KL of two Gaussians (c-Glows made affine),
and the tool end to end on the digits with small c-Glows (one training per model and a cache, results that do not
depend on the chunk or on the other images, one-line errors)."""
import math

import numpy as np
import pytest
import torch

from blackboxbench.analysis.divergence import divergence_from_kl, family_average, log_ratios
from blackboxbench.cli import main
from blackboxbench.query import cg_attack
from blackboxbench.query.cg_attack import CondGlow, unflatten

SMALL = {"x_hidden_channels": 4, "x_hidden_size": 8, "y_hidden_channels": 8, "flow_depth": 2, "num_levels": 2}
TINY = ["--param", "train={name: digits, split: train, n: 60}", "--param", "eps=0.2", "--param", "epochs=1",
        "--param", "pretrain_epochs=1",
        "--param", "batch=8", "--param", "lr=0.001", "--param", "x_hidden_channels=4", "--param",
        "x_hidden_size=8", "--param", "y_hidden_channels=8", "--param", "flow_depth=2", "--param", "num_levels=2"]


def test_adversarial_divergence_by_hand():
    """sim = 1 / log2 max(KL, floor) off the diagonal, AD = 1 - sim / max sim over distinct pairs, 0 on the
    diagonal; a KL below the floor (here one that is negative, an estimate's noise) counts as the floor, an infinite
    one gives NaN."""
    kl = np.array([[0.0, 8.0, 1.5], [-0.3, 0.0, 32.0], [math.inf, 4.0, 0.0]])
    sim, ad = divergence_from_kl(kl, floor=2.0)
    ref_sim = {(0, 1): 1 / 3, (0, 2): 1.0, (1, 0): 1.0, (1, 2): 1 / 5, (2, 1): 1 / 2}
    for (i, j), s in ref_sim.items():
        assert sim[i, j] == pytest.approx(s) and ad[i, j] == pytest.approx(1 - s)
    assert np.isnan(sim[2, 0]) and np.isnan(ad[2, 0]) and (np.diag(ad) == 0).all()


def test_family_average_by_hand():
    m = np.arange(16, dtype=float).reshape(4, 4) + 100 * np.eye(4)  # a diagonal that would move any mean it joined
    labels, fam = family_average(m, ["a", "b", "c", "d"], {"a": "F", "b": "G", "c": "F", "d": "G"})
    assert labels == ["F", "G"]
    assert fam[0, 0] == pytest.approx((m[0, 2] + m[2, 0]) / 2)  # within F, no model with itself
    assert fam[0, 1] == pytest.approx((m[0, 1] + m[0, 3] + m[2, 1] + m[2, 3]) / 4)
    assert fam[1, 1] == pytest.approx((m[1, 3] + m[3, 1]) / 2)


def _affine_cglow(seed):
    """A float64 c-Glow that is an affine map of its latent given the image: coupling outputs and split priors at
    zero (the coupling's shift 0, its scale the constant sigmoid(2); the splits standard normal), the image
    conditioning the actnorms and the 1x1 matrices (random last conditioner layers)."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the layers' initialisation, apart from the global stream
        flow = CondGlow((1, 8, 8), **SMALL).double()
    with torch.no_grad():
        for prior in flow.priors:
            prior.conv.weight.zero_()
            prior.conv.bias.zero_()
        for level in flow.steps:
            for step in level:
                for cond in (step.act, step.mix):
                    last = cond.linear[4]
                    last.weight.copy_(0.3 * torch.randn(last.weight.shape, generator=g, dtype=torch.float64))
                    last.bias.copy_(0.3 * torch.randn(last.bias.shape, generator=g, dtype=torch.float64))
    return flow.eval()


def _gaussian(flow, x):
    """Per image, the mean b and the matrix A of delta = A u + b, u ~ N(0, I) (the tool's latent layout)."""
    d = x[0].numel()
    out = []
    with torch.no_grad():
        for i in range(len(x)):
            cond = flow.condition(x[i:i + 1].expand(d + 1, -1, -1, -1))
            u = torch.cat([torch.zeros(1, d, dtype=torch.float64), torch.eye(d, dtype=torch.float64)])
            top, *noise = unflatten(u, [flow.top] + flow.split_shapes())
            delta = flow.decode(cond, top, noise=noise)[0].flatten(1)
            out.append((delta[0], (delta[1:] - delta[0]).T))
    return out


def _kl_gaussians(m0, a0, m1, a1):
    s0, s1 = a0 @ a0.T, a1 @ a1.T
    inv = torch.linalg.inv(s1)
    diff = m1 - m0
    return 0.5 * (torch.trace(inv @ s0) + diff @ inv @ diff - len(m0) + torch.logdet(s1) - torch.logdet(s0))


def test_kl_estimate_matches_the_gaussian_closed_form():
    """For affine c-Glows both CADs are Gaussians N(b_x, A_x A_x^T) given the image: eq. I.10's estimate (log-
    likelihoods by the c-Glows' own change of variables) agrees with the closed-form KL averaged over the images
    within 4 standard errors, is exactly 0 for a c-Glow against itself, and the reverse direction differs."""
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    flows = [_affine_cglow(0), _affine_cglow(1)]
    total, squares, m = log_ratios(flows, x, [0, 1], samples=4000, seed=0, chunk=500)
    n = m * len(x)
    est = total.sum(2) / n
    se = ((squares.sum(2) / n - est ** 2) / (n - 1)).sqrt()
    g = [_gaussian(f, x) for f in flows]
    for s, t in ((0, 1), (1, 0)):
        ref = sum(_kl_gaussians(*g[s][i], *g[t][i]) for i in range(len(x))) / len(x)
        assert ref > 1.0 and abs(est[s, t] - ref) < 4 * se[s, t] + 1e-9, (s, t, float(est[s, t]), float(ref))
    assert est[0, 0] == 0 and est[1, 1] == 0 and abs(est[0, 1] - est[1, 0]) > 4 * (se[0, 1] + se[1, 0])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "cache"))
    calls = []
    real = cg_attack.train_cglow
    monkeypatch.setattr(cg_attack, "train_cglow", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _analyze(tmp_path, name, *extra, models="[digits_cnn, digits_mlp, digits_lenet]", dataset="{name: digits, n: 3}"):
    out = tmp_path / f"{name}.png"
    code = main(["analyze", "-r", "adm", "--model", models, "--dataset", dataset, "--device", "cpu", *TINY, *extra,
                 "-o", str(out)])
    return code, out


def test_adm_on_the_digits(tmp_path, cache, capsys):
    """Three digits models, 60 training digits, 3 evaluation digits: the figure and one table row per ordered pair
    and per family pair; KL 0 and AD 0 on the diagonal, AD in [0, 1] with 0 at the closest pair; each c-Glow
    trained once (the second call reads the cache); the same numbers with another chunk, and each image's KL the
    same without the other images."""
    code, out = _analyze(tmp_path, "a", "--param", "samples=30", "--param",
                         "families={digits_cnn: conv, digits_lenet: conv, digits_mlp: mlp}")
    assert code == 0, capsys.readouterr().err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(cache) == 3
    z = np.load(out.with_suffix(".npz"))
    kl, ad = z["kl"], z["ad"]
    assert (np.diag(kl) == 0).all() and (np.diag(ad) == 0).all() and np.isfinite(kl).all()
    off = ~np.eye(3, dtype=bool)
    assert (ad[off] >= 0).all() and (ad[off] <= 1).all() and ad[off].min() == 0
    rows = out.with_suffix(".csv").read_text().splitlines()
    assert rows[0] == "level,surrogate,target,kl_nats,kl_se,sim,ad" and len(rows) == 1 + 9 + 4
    assert z["family_ad"].shape == (2, 2) and np.isnan(z["family_ad"][1, 1])  # one mlp: no pair within its family
    code, again = _analyze(tmp_path, "b", "--param", "samples=30", "--param", "chunk=7")
    assert code == 0 and len(cache) == 3  # cached
    assert np.allclose(np.load(again.with_suffix(".npz"))["kl"], kl, rtol=1e-6, atol=1e-6)
    code, two = _analyze(tmp_path, "c", "--param", "samples=20", "--indices", "1,2", dataset="digits")
    per = np.load(out.with_suffix(".npz"))["kl_per_image"]
    assert code == 0 and np.allclose(np.load(two.with_suffix(".npz"))["kl_per_image"], per[:, :, 1:], rtol=1e-6,
                                     atol=1e-6)


def test_adm_with_cg_attacks_cads(tmp_path, cache, capsys):
    """``pretrain_epochs`` 0 (CG-Attack's c-Glows, the adversarial loss alone) trains other c-Glows than the
    default stage-1 CADs and gives finite KLs; stage 1 under L2 is a one-line error before any training."""
    code, out = _analyze(tmp_path, "s", "--param", "samples=10", "--param", "pretrain_epochs=0")
    assert code == 0, capsys.readouterr().err
    assert len(cache) == 3 and np.isfinite(np.load(out.with_suffix(".npz"))["kl"]).all()
    code, _ = _analyze(tmp_path, "l2", "--param", "norm=l2", "--param", "eps=1.0")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "params.pretrain_epochs: the stage-1 labels" in err, err
    assert len(cache) == 3


def test_adm_errors_are_one_line(tmp_path, cache, capsys):
    cases = [
        (dict(models="digits_cnn"), "this tool compares models: give a list of two or more"),
        (dict(models="[digits_cnn]"), "this tool compares models: give two or more"),
        (dict(models="[digits_cnn, digits_cnn]"), "the models to compare repeat a name"),
        (dict(dataset="{name: digits, split: train, n: 3}"), "command line (--param):params.train: 3 of its 60 "
                                                            "images are evaluation images"),
        (dict(extra=("--param", "families={digits_cnn: conv}")), "command line (--param):params.families: must map "
                                                                 "every model to a family name; missing ['digits_mlp'"),
        (dict(extra=("--param", "train={name: digitz}")), "command line (--param):params.train: unknown dataset "
                                                          "'digitz'"),
        (dict(extra=("--param", "floor=1")), "params.floor:"),
    ]
    for kw, message in cases:
        code, _ = _analyze(tmp_path, "e", *kw.pop("extra", ()), **kw)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, (kw, err)
    recipe = tmp_path / "my_adm.yaml"  # the train set a recipe file names: the error names that file
    recipe.write_text("name: my_adm\ntool: adm\npaper: test\nparams: {train: {name: digits, split: train, n: 60}}\n")
    args = [a for flag, v in zip(TINY[::2], TINY[1::2]) if not v.startswith("train=") for a in (flag, v)]
    assert main(["analyze", "-r", str(recipe), "--model", "[digits_cnn, digits_mlp]", "--dataset",
                 "{name: digits, split: train, n: 3}", "--device", "cpu", *args, "-o", str(tmp_path / "r.png")]) == 2
    assert f"{recipe}:params.train: 3 of its 60 images are evaluation images" in capsys.readouterr().err
    assert main(["analyze", "-r", "fsm", "--model", "[digits_cnn, digits_mlp]", "--dataset", "digits", "-o",
                 str(tmp_path / "f.png")]) == 2
    assert "this tool reads one model, got the list" in capsys.readouterr().err
    assert not cache  # every error comes before any training
