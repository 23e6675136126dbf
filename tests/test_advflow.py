"""AdvFlow: NES in the latent space of a normalizing flow trained on clean images (``query/advflow.py``).

The flow against independent references (its inverse, and its log-determinant against the autograd Jacobian), its
Table VI shape, training that raises the likelihood of held-out images, the NES update against a per-sample loop
of the authors' ``attack.py``, one training per run and a cache across runs, batch-size
invariance (float64 digits target) and the real pretrained CIFAR-10 ResNet-56 at the paper's budget (skipped
without the offline data). The digits contract (tests/test_contract.py) runs the recipe at both norms, targeted
and not.
"""
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from blackboxbench.prep import trained
from blackboxbench.prep.data import digits
from blackboxbench.query import advflow
from blackboxbench.query.advflow import Coupling, ImageFlow, nll, population_step, train_flow
from blackboxbench.runner import run_experiment

from attack_utils import count_calls, make_ctx, spy_lrs
from test_engine import _exp, _records, records_by_batch_size, records_by_probe_values

DATA = os.environ.get("BLACKBOXBENCH_DATA")
needs_data = pytest.mark.skipif(not DATA or not Path(DATA, "cifar10").is_dir(),
                                reason="needs the offline data root (BLACKBOXBENCH_DATA) with cifar10/")
SMALL = {"high_res_blocks": 2, "low_res_blocks": 2, "channels_hidden": 8, "n_blocks": 2, "internal_width": 16,
         "clamping": 1.5}


def _random_flow(shape, seed):
    """A small float64 flow with every parameter random (not the identity start), so that each coupling acts."""
    g = torch.Generator().manual_seed(seed)
    flow = ImageFlow(shape, **SMALL).double()
    for p in flow.parameters():
        p.data = 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
    return flow


@pytest.mark.parametrize("shape", [(3, 4, 4), (1, 4, 4)], ids=["conv", "fully-connected"])
def test_flow_inverts_and_its_log_determinant_is_the_jacobians(shape):
    """decode(forward(x)) = x, and forward's log|det J| equals the log-determinant of the autograd Jacobian, for
    the CIFAR-style flow (couplings, squeeze, orthogonal 1x1, fully connected head) and the MNIST-style flow."""
    flow = _random_flow(shape, 0)
    x = torch.rand(3, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z, logdet = flow(x)
    assert z.shape == (3, x[0].numel())
    assert torch.allclose(flow.decode(z), x, atol=1e-10)
    for i in range(3):
        jac = torch.autograd.functional.jacobian(lambda v: flow(v.view(1, *shape))[0].flatten(), x[i].flatten())
        assert torch.allclose(torch.linalg.slogdet(jac)[1], logdet[i], atol=1e-8)
        # the training loss: minus the log-density of a standard normal latent, less its constant
        assert torch.allclose(nll(flow, x[i:i + 1])[0], 0.5 * z[i].pow(2).sum() - torch.linalg.slogdet(jac)[1])
    assert logdet.abs().min() > 0.01  # the couplings act


def test_flow_has_table_vi_shape_and_starts_as_an_orthogonal_map():
    """Table VI on 3 x 32 x 32: 4 convolutional couplings at full resolution, 6 after the squeeze (12 channels),
    hidden width 128; 6 fully connected couplings on the first quarter (768) of the latent, width 128. The last
    layer of each sub-network starts at zero, so the untrained flow preserves norms and has log-determinant 0."""
    flow = ImageFlow((3, 32, 32), high_res_blocks=4, low_res_blocks=6, channels_hidden=128, n_blocks=6,
                     internal_width=128, clamping=1.5)
    couplings = [m for m in flow.modules() if isinstance(m, Coupling)]
    conv = [m for m in couplings if isinstance(m.net1[0], nn.Conv2d)]
    assert [m.a + m.b for m in conv] == [3] * 4 + [12] * 6
    assert all(m.net1[0].out_channels == 128 and m.clamping == 1.5 for m in conv)
    fc = [m for m in couplings if isinstance(m.net1[0], nn.Linear)]
    assert [(m.a + m.b, m.net1[0].out_features) for m in fc] == [(768, 128)] * 6
    x = torch.rand(2, 3, 32, 32)
    z, logdet = flow(x)
    assert torch.allclose(z.norm(dim=1), x.flatten(1).norm(dim=1), rtol=1e-5) and logdet.abs().max() == 0


def test_coupling_log_scales_are_freeis_soft_clamp():
    """Each log-scale is ``0.636 clamping atan(s' / clamping)`` (FrEIA's soft clamp): about 0.636 s' for a small
    sub-network output s', and for a huge one just under ``clamping`` (0.636 pi / 2 = 0.999 of it); the
    log-determinant sums them."""
    coupling = Coupling(4, advflow.fc_subnet, 8, 1.5)
    x = torch.rand(3, 4)
    for value, each in ((1e-3, 0.636e-3), (1e6, 0.636 * 1.5 * math.pi / 2)):
        for net in (coupling.net1, coupling.net2):
            nn.init.zeros_(net[-1].weight)
            nn.init.zeros_(net[-1].bias)
            nn.init.constant_(net[-1].bias[:2], value)  # the two log-scales of each half
        _, logdet = coupling(x)
        assert torch.allclose(logdet, torch.full((3,), 4 * each), rtol=1e-4), value
    assert 4 * each < 4 * 1.5

def test_training_raises_the_likelihood_of_held_out_images():
    """Trained on 200 digits of the train split, the flow gives the digits of the test split (never seen) at least
    1 bit per dimension less negative log-likelihood than the untrained flow."""
    arch = {**SMALL, "n_blocks": 4, "internal_width": 64}
    train, test = digits(n=200, split="train").x, digits(n=100).x
    out = train_flow(train, arch, epochs=40, views=1, flow_lr=1e-3, batch=64, noise=0.02, seed=0)
    flow, start = ImageFlow(train.shape[1:], **arch), ImageFlow(train.shape[1:], **arch)
    flow.load_state_dict(out["state"])
    with torch.no_grad():
        bits = [(nll(f, test).mean() / (64 * 0.6931)).item() for f in (start, flow)]
    assert bits[1] < bits[0] - 1.0, bits
    assert abs(out["bits_per_dim"].item() - bits[1]) < 1.0  # the reported figure is on the training images


def test_training_batches_are_the_authors_loader_and_noise(monkeypatch):
    """The batches the flow trains on are the authors' (data.py, train.py): each image flipped horizontally with
    probability 1/2, uniformly dequantized, (255 x + u) / 256, then Gaussian noise of std 0.02. Images of zeros with
    one bright pixel at the top left: the bright pixel lands top right in about half of them, its value averages
    (255 + 1/2) / 256 and the dark ones 1/2 / 256 (the mean of 4,096 noise draws varies by about 3e-4)."""
    seen = []
    real = advflow.nll

    def spy(flow, xb):
        seen.append(xb.detach().clone())
        return real(flow, xb)

    monkeypatch.setattr(advflow, "nll", spy)
    x = torch.zeros(64, 1, 8, 8)
    x[:, 0, 0, 0] = 1
    train_flow(x, SMALL, epochs=1, views=1, flow_lr=1e-4, batch=64, noise=0.02, seed=0)
    batches = torch.cat(seen[:-1])  # the last call is the final likelihood on x itself
    assert len(batches) == 128
    left, right = batches[:, 0, 0, 0] > 0.5, batches[:, 0, 0, 7] > 0.5
    assert torch.equal(left, ~right) and 40 < int(right.sum()) < 88  # flips: about 64 of 128
    bright = torch.where(right, batches[:, 0, 0, 7], batches[:, 0, 0, 0])
    assert abs(bright.mean().item() - 255.5 / 256) < 0.005
    dark = torch.cat([batches.flatten(1)[:, 1:7], batches.flatten(1)[:, 8:]], 1)  # 0 in every image
    assert abs(dark.mean().item() - 0.5 / 256) < 0.001  # without the dequantization: 0



def test_training_batches_without_noise_are_only_flipped():
    """With ``noise`` 0 (the authors' ``add_image_noise`` off) a training batch is its images, each as is or flipped
    left to right: no dequantization either."""
    x = torch.rand(32, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    batch = advflow.training_batch(x, 0.0, torch.Generator().manual_seed(1))
    same = (batch == x).flatten(1).all(1)
    flipped = (batch == x.flip(3)).flatten(1).all(1)
    assert (same | flipped).all() and 4 < int(flipped.sum()) < 28

def test_training_learning_rates_are_the_authors_steplr(monkeypatch):
    """The learning rate of each epoch: 0.02 x lr for the warm-up, then the authors' StepLR under their torch 1.3.1
    (base x gamma^k after k steps, the warm-up's included), gamma = 0.01^(1 / epochs): the last epoch runs at
    0.01 x lr; one Adam with the authors' other settings."""
    lrs = spy_lrs(monkeypatch, torch.optim.Adam)
    made = []

    class Adam(torch.optim.Adam):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self.param_groups[0])

    monkeypatch.setattr(torch.optim, "Adam", Adam)
    train_flow(torch.rand(8, 1, 4, 4), SMALL, epochs=2, views=1, flow_lr=1e-3, batch=8, noise=0.02, seed=0)
    assert lrs == pytest.approx([2e-5, 1e-4, 1e-5])  # before: 2e-5, 1e-3, 1e-4
    group, = made  # the authors' Adam: betas 0.9/0.999, eps 1e-6, weight decay 1e-5
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-6, 1e-5)


class Scores(nn.Module):
    """Fixed random linear logits over 4 classes."""

    def __init__(self, d, seed, scale=4.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, 4, generator=torch.Generator().manual_seed(seed)), requires_grad=False)
        self.scale = scale

    def forward(self, x):
        return self.scale * x.flatten(1) @ self.w


@pytest.mark.parametrize("scale,norm", [(4.0, "linf"), (10.0, "linf"), (4.0, "l2")])
def test_population_step_is_the_authors_update(scale, norm):
    """One NES update of mu against a per-sample loop of the authors' attack.py (softmax, log, CW loss clamped to
    [0, 1000], standardized rewards, lr / (n_pop sigma) e^T A), with the identity as the flow and the same normal
    draws; logits scaled by 10 give one sample margins above 10 (about 17), inside the clamp (where the authors'
    log(p + 1e-10) moves them by about 1e-3). L2: each candidate clipped to [0, 1], then scaled into the ball."""
    n, d, n_pop, sigma, lr, eps = 3, 12, 20, 0.1, 0.02, 0.05 if norm == "linf" else 0.2
    model = Scores(d, 0, scale)
    x = torch.rand(n, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    y = model(x).argmax(1)
    mu0 = 0.001 * torch.randn(n, d, generator=torch.Generator().manual_seed(2))
    z = x.flatten(1)
    ctx = make_ctx(model, x, y, eps, norm, 1000, num_classes=4)
    mu = population_step(ctx, z, mu0, lambda v: v.reshape(-1, 3, 2, 2), n_pop=n_pop, sigma=sigma, lr=lr)
    e_all = make_ctx(model, x, y, eps, norm, 1000, num_classes=4).rng.normal((n_pop, d))
    for i in range(n):
        e = e_all[i]
        cand = (z[i] + mu0[i] + sigma * e).clamp(0, 1)
        delta = cand - x[i].flatten()
        if norm == "linf":
            cand = x[i].flatten() + delta.clamp(-eps, eps)
        else:
            cand = x[i].flatten() + delta * (eps / delta.norm(dim=1, keepdim=True)).clamp(max=1)
        probs = torch.softmax(model(cand.view(n_pop, 3, 2, 2)), 1)
        onehot = torch.zeros(n_pop, 4)
        onehot[:, y[i]] = 1
        real = torch.log((onehot * probs).sum(1) + 1e-10)
        other = torch.log(((1 - onehot) * probs - onehot * 10000).max(1)[0] + 1e-10)
        reward = -0.5 * torch.clamp(real - other, 0, 1000)
        a = (reward - reward.mean()) / (reward.std() + 1e-10)
        ref = mu0[i] + lr / (n_pop * sigma) * (e.t() @ a)
        assert torch.allclose(mu[i], ref, atol=1e-5 if scale == 4 else 1e-3), i  # 1e-10 moves margins of 17
    assert (ctx.oracle.counts == n_pop).all()



def test_a_population_with_a_refused_query_leaves_mu():
    """Budget 30, populations of 20: the first update moves mu; in the second, 10 of a sample's 20 candidates are
    refused (past the budget) and its mu stays as it was."""
    model = Scores(12, 0)
    x = torch.rand(2, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    ctx = make_ctx(model, x, model(x).argmax(1), 0.05, "linf", 30, num_classes=4)

    def step(mu):
        return population_step(ctx, x.flatten(1), mu, lambda v: v.reshape(-1, 3, 2, 2), n_pop=20, sigma=0.1, lr=0.02)

    mu0 = torch.zeros(2, 12)
    mu1 = step(mu0)
    assert (mu1 - mu0).abs().amax(1).min() > 1e-3
    assert torch.equal(step(mu1), mu1) and (ctx.oracle.counts == 30).all()


def test_the_new_point_is_projected_onto_the_ball(monkeypatch):
    """The iteration's point is the decode of ``z + mu`` clipped to [0, 1] and projected onto the eps ball: with a
    latent shift of 0.5 everywhere (an untrained flow, an orthogonal map, moves the image as far) it lies on the
    Linf sphere of 0.05, inside [0, 1]."""
    flow = ImageFlow((3, 4, 4), **SMALL).eval().requires_grad_(False)
    monkeypatch.setattr(advflow, "trained_flow", lambda *args: flow)
    model = Scores(48, 0)
    x = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    ctx = make_ctx(model, x, model(x).argmax(1), 0.05, "linf", 1000, num_classes=4)
    state = {**advflow.advflow_init(ctx), "mu": torch.full((2, 48), 0.5)}
    out = advflow.advflow(ctx, state, n_pop=4, **SMALL)
    dist = (out["x_adv"] - x).flatten(1).abs().amax(1)
    assert torch.allclose(dist, torch.full((2,), 0.05)) and out["x_adv"].min() >= 0 and out["x_adv"].max() <= 1

def _digits_assets(n=200):
    return {"train": {"name": "train_images", "spec": {"name": "digits", "split": "train", "n": n}}}


FAST = {"epochs": 5, "n_blocks": 2}  # a small flow: these tests check the plumbing, benchmarks/ the fidelity


def test_one_training_per_run_and_a_cache_across_runs(tmp_path, monkeypatch):
    """The flow is trained once in a run (later steps reuse it) and loaded from the cache by the next run."""
    calls = {"train": 0, "cache": 0}
    train, cache = advflow.train_flow, trained.cached

    monkeypatch.setattr(advflow, "train_flow", count_calls(calls, "train", train))
    monkeypatch.setattr(trained, "cached", count_calls(calls, "cache", cache))
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "cache"))
    attack = {"recipe": "advflow", "blocks": {"perturb": {"name": "advflow", **FAST}}}
    for i in range(2):
        exp = _exp(tmp_path / str(i), attack=attack, model="digits_mlp", assets=_digits_assets(),
                   threat={"norm": "linf", "eps": 0.05, "max_queries": 200}, batch_size=2,
                   dataset={"name": "digits", "n": 2})
        trained._RUN.clear()
        run_experiment(exp, progress=False)
        assert calls == {"train": 1, "cache": i + 1}
    assert len(list((tmp_path / "cache" / "flows").glob("*.pt"))) == 1


def test_records_do_not_depend_on_the_batch_size(tmp_path):
    """batch_size 1, 7 and 100 give identical records (float64 digits target, a small flow)."""
    attack = {"recipe": "advflow", "blocks": {"perturb": {"name": "advflow", **FAST}}}
    runs = records_by_batch_size(tmp_path, attack, "linf", 0.2, False, budget=2000, assets=_digits_assets(),
                                 dataset={"name": "digits", "n": 8})
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 6


# ResNet-56 test: a reduced flow that trains in about a minute on 2 cores (benchmarks/ run the CPU config's)
REDUCED = {"channels_hidden": 16, "high_res_blocks": 2, "low_res_blocks": 3, "n_blocks": 2, "epochs": 15}


def resnet56_run(tmp_path, attack, n=6, fooled=4, train_n=None, model="cifar_resnet56", eps=0.03, surrogates=None):
    """Untargeted Linf ``eps`` on the first ``n`` CIFAR-10 test images, target ``model``, Table V's budget 10,000, the
    generator trained on the 200 images of cifar10_test_sdp200.npz (its first ``train_n``): at least ``fooled`` of
    the correctly classified images fooled inside eps (the runner also checks [0, 1] and the uint8 grid), within
    budget, every success confirmed by the oracle and by the worker's own forward of the returned image. The
    attacker's white-box ``surrogates``, when it has any, train the generator."""
    spec = {"name": "cifar10", "file": "cifar10/cifar10_test_sdp200.npz", **({"n": train_n} if train_n else {})}
    exp = _exp(tmp_path, attack=attack, model=model, data_root=DATA, batch_size=n,
               assets={"train": {"name": "train_images", "spec": spec}},
               dataset={"name": "cifar10", "file": "cifar10/cifar10_test_first100.npz", "n": n},
               threat={"norm": "linf", "eps": eps, "max_queries": 10_000},
               **({"surrogates": surrogates} if surrogates else {}))
    run_dir, _ = run_experiment(exp, progress=False)
    recs = [r for r in _records(run_dir, drop=()) if r["attacked"]]
    assert sum(r["success"] and r["audit_adv"] for r in recs) >= fooled, recs
    assert all(r["queries"] <= 10_000 and r["linf"] <= eps + 1e-5 for r in recs)
    return recs


@needs_data
def test_resnet56_at_the_papers_budget(tmp_path):
    """AdvFlow with a reduced flow: see :func:`resnet56_run`."""
    resnet56_run(tmp_path, {"recipe": "advflow", "blocks": {"perturb": {"name": "advflow", **REDUCED}}})


def test_population_calls_hold_whole_samples_within_the_bound(tmp_path, monkeypatch):
    """With room for one sample's population (20 digits of 64 values) a call, every population call holds one
    sample's candidates, where the unbounded run's first call holds every sample's; the records are the same (at
    299 x 299 one call of every slot's population grew by about 190 MB a slot)."""
    attack = {"recipe": "advflow", "blocks": {"perturb": {"name": "advflow", **FAST}}}
    (whole, largest), (cut, largest_cut) = records_by_probe_values(
        tmp_path, monkeypatch, attack, advflow, (1 << 26, 20 * 64), "linf", 0.2, budget=300,
        assets=_digits_assets())
    assert largest >= 8 * 20 and largest_cut == 20
    assert whole == cut and sum(r["success"] for r in whole) >= 6
