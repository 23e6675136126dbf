"""Surrogate-assisted score attacks (white-box surrogates inside a query attack): PRGF, Subspace attack, BASES.

Core math against independent references (PRGF's lambda* against its objective maximised numerically, the
prior-guided directions against their definition and the objective against Monte Carlo; one Subspace step and
the BASES perturbation machine against hand-written per-sample references on linear models); that surrogate work
never reaches the oracle's count; batch-size invariance on the float64 digits target with a digits surrogate; and
the pretrained CIFAR-10 ResNet-56 target with ResNet-20/32/44 surrogates at Table VI's budget (skipped without
the offline data).
"""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from blackboxbench.builder import build_attack, load_recipe, recipe_family
from blackboxbench.config import finish_threat
from blackboxbench.errors import BenchError
from blackboxbench.prep.models import _digits_model, build_model
from blackboxbench.query.bases import perturbation_machine
from blackboxbench.query.prgf import conv_dropout, lambda_star, prior_guided_directions, surrogate_gradient
from blackboxbench.query.subspace import drop_schedule
from blackboxbench.registry import ACCEPT, INIT, MODEL, PERTURB
from blackboxbench.rng import Streams
from blackboxbench.runner import run_experiment, run_tensors
from blackboxbench.threat import Problem

from attack_utils import Linear, build, check_outputs, correctly_classified, make_ctx, to_result
from test_engine import _exp, records_by_batch_size, records_by_probe_values

RECIPES = ("prgf", "subspace", "bases")


@MODEL.register("test_digits_cnn_f64", dataset="digits")
def digits_cnn_f64(data_root=None):
    """The digits CNN in float64: its input gradients are batch-invariant on CPU (in float32 they move by ~1e-6
    with the batch, and Linf attacks take signs)."""
    return _digits_model("digits_cnn", True).double()


def run_surrogate(name, model, surrogates, x, y, eps, norm, budget, target=None, seed=0, slots=None):
    """``run_query`` with white-box surrogates: the recipe through the real worker; returns (problem, result)."""
    attack, t = build(name, norm, target is not None, eps, max_queries=budget)
    records = run_tensors(attack, t, x, y, {"model": [model], "surrogates": list(surrogates)}, seed=seed,
                          slots=slots, given_target=target)
    problem = Problem(x=x, y=y, eps=eps, norm=norm, target=target, num_classes=10)
    return problem, to_result(records, x)


class Counting(nn.Module):
    """A model that counts the images it forwards."""

    def __init__(self, model):
        super().__init__()
        self.model, self.images = model, 0

    def forward(self, x):
        self.images += x.shape[0]
        return self.model(x)


# ---------------------------------------------------------------- PRGF math

def _objective(lam, a2, d, q):
    """E[g^T ghat]^2 / E||ghat||^2 for ghat = sum_i (g^T u_i) u_i, u_i = sqrt(lam) v + sqrt(1 - lam) xi_i, xi_i
    uniform on the unit sphere of the (d-1)-dim complement of v, ||g|| = 1, g^T v = alpha (derived by hand:
    E t^2 = 1/(d-1) for t = w^T xi, and E[c_i c_j u_i^T u_j] = lam^2 a2 + (1-lam)^2 (1-a2) / (d-1)^2, i != j)."""
    m = lam * a2 + (1 - lam) * (1 - a2) / (d - 1)
    cross = lam ** 2 * a2 + (1 - lam) ** 2 * (1 - a2) / (d - 1) ** 2
    return q * q * m * m / (q * m + q * (q - 1) * cross)


@pytest.mark.parametrize("d,q", [(3072, 50), (64, 50), (3072, 10), (1000, 5)])
def test_lambda_star_maximises_the_estimator_objective(d, q):
    grid = np.linspace(0.0, 1.0, 400_001)
    alphas = np.array([0.0, 0.005, 0.02, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0])
    lam = lambda_star(torch.tensor(alphas ** 2), d, q).numpy()
    for a, got in zip(alphas, lam):
        with np.errstate(invalid="ignore"):  # alpha 0 at lambda 1: 0 / 0
            values = np.nan_to_num(_objective(grid, a * a, d, q), nan=-1.0)
        best = grid[values.argmax()]
        assert abs(got - best) < 1e-4 or _objective(got, a * a, d, q) >= values.max() * (1 - 1e-9), (a, got, best)
    assert lam[0] == 0 and lam[-1] == 1 and np.all(np.diff(lam[alphas > 0.03]) >= -1e-12)


def test_prior_guided_directions_match_their_definition():
    g = torch.Generator().manual_seed(0)
    n, q, shape = 3, 4, (2, 3, 3)
    v = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    v = v / v.flatten(1).pow(2).mean(1).sqrt().view(-1, 1, 1, 1)
    xi = torch.randn(n, q, *shape, generator=g, dtype=torch.float64)
    lam = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
    u = prior_guided_directions(xi, v, lam)
    for i in range(n):
        vi = v[i].flatten().numpy()
        for j in range(q):
            x = xi[i, j].flatten().numpy()
            x = x - (x @ vi) / (vi @ vi) * vi
            x = x / np.sqrt(np.mean(x * x))
            ref = np.sqrt(lam[i].item()) * vi + np.sqrt(1 - lam[i].item()) * x
            assert np.allclose(u[i, j].flatten().numpy(), ref, atol=1e-12)


def test_prior_guided_estimator_objective_by_monte_carlo():
    """The objective lambda* maximises, estimated from the directions the block draws (d = 8, q = 3)."""
    d, q, trials, alpha = 8, 3, 40_000, 0.4
    g = torch.Generator().manual_seed(1)
    v = torch.zeros(d, dtype=torch.float64)
    v[0] = 1.0
    grad = torch.zeros(d, dtype=torch.float64)
    grad[0], grad[1] = alpha, (1 - alpha ** 2) ** 0.5
    for lam in (0.0, 0.2, 0.6):
        xi = torch.randn(trials, q, d, generator=g, dtype=torch.float64)
        u = prior_guided_directions(xi, (v * d ** 0.5).expand(trials, d), torch.full((trials,), lam))
        u = u / d ** 0.5  # unit directions (the block's have norm sqrt(D); the scale cancels in the ratio)
        ghat = ((u @ grad)[..., None] * u).sum(1)
        mc = (ghat @ grad).mean().item() ** 2 / ghat.pow(2).sum(1).mean().item()
        assert mc == pytest.approx(_objective(lam, alpha ** 2, d, q), rel=0.03)


def _linear_target(n):
    """A 2-class linear target's weights and bias (seed 2) and ``n`` 3 x 4 x 4 images in [0.25, 0.75], labelled 0."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(2, 48, generator=g), torch.tensor([2.0, 0.0])
    return w, b, torch.rand(n, 3, 4, 4, generator=g) * 0.5 + 0.25, torch.zeros(n, dtype=torch.long)


def _with_surrogates(target, surrogates, x, y, eps, norm, budget):
    """A block context on the 2-class ``target`` whose blocks see ``surrogates``."""
    return dataclasses.replace(make_ctx(target, x, y, eps, norm, budget, num_classes=2), surrogates=surrogates)


def test_prgf_trusts_a_perfect_prior_alone():
    """A 2-class linear target (its margin is linear) with an exact copy as surrogate: alpha is estimated 1, so
    lambda* is 1 and the step is a sign step along the true gradient, after 1 + 10 queries (prior, norm)."""
    w, b, x, y = _linear_target(3)
    target, surrogate = Linear(w, b), Linear(w.clone(), b.clone())
    ctx = _with_surrogates(target, (surrogate,), x, y, 0.1, "linf", 1000)
    state = INIT.get("prgf_init")(ctx)
    out = PERTURB.get("prgf")(ctx, state, q=50, sigma=1e-4, lr=0.005)
    direction = (w[0] - w[1]).view(1, 3, 4, 4)  # gradient of the margin z_0 - z_1
    assert torch.equal(out["x_adv"], (x - 0.005 * direction.sign()).clamp(0, 1))
    assert ctx.oracle.counts.tolist() == [1 + 1 + 10] * 3 and (out["it"] == 1).all()


def test_prgf_flips_a_prior_that_points_uphill():
    """A surrogate whose margin gradient is exactly minus the target's: the prior's finite difference is negative,
    so alpha < 0 and the prior is flipped (paper Sec. 3.2); |alpha| = 1 then trusts it alone, and the sign step
    goes down the target's margin, as with a perfect prior."""
    w, b, x, y = _linear_target(3)
    target, surrogate = Linear(w, b), Linear(-w, torch.zeros(2))
    ctx = _with_surrogates(target, (surrogate,), x, y, 0.1, "linf", 1000)
    state = INIT.get("prgf_init")(ctx)
    out = PERTURB.get("prgf")(ctx, state, q=50, sigma=1e-4, lr=0.005)
    direction = (w[0] - w[1]).view(1, 3, 4, 4)  # gradient of the target's margin z_0 - z_1
    assert torch.equal(out["x_adv"], (x - 0.005 * direction.sign()).clamp(0, 1))
    assert ctx.oracle.counts.tolist() == [1 + 1 + 10] * 3


def test_prgf_alpha_is_the_cosine_so_a_partial_prior_is_mixed():
    """alpha = (L(x + sigma v) - L(x)) / (sigma sqrt(D ||grad||^2)) with v of RMS 1 (norm sqrt(D)) estimates the
    cosine between prior and gradient. A prior at cosine 0.3 (D = 48, q = 50: alpha^2 ~ 0.09 lies between
    1/(D + 2q - 2) and (2q - 1)/(D + 2q - 2)) gets 0 < lambda* < 1, so the q prior-guided probes are asked
    (1 + 1 + 10 + 50 queries); an alpha without the sqrt(D) (sqrt(D) times too large) would trust it alone."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 48, generator=g)
    grad = w[0] - w[1]
    other = torch.randn(48, generator=g)
    other = other - (other @ grad) / (grad @ grad) * grad
    prior = 0.3 * grad / grad.norm() + (1 - 0.09) ** 0.5 * other / other.norm()
    target = Linear(w, torch.tensor([2.0, 0.0]))
    surrogate = Linear(torch.stack([prior, torch.zeros(48)]), torch.zeros(2))
    x = torch.rand(3, 3, 4, 4, generator=g) * 0.5 + 0.25
    y = torch.zeros(3, dtype=torch.long)
    ctx = _with_surrogates(target, (surrogate,), x, y, 0.1, "linf", 1000)
    state = INIT.get("prgf_init")(ctx)
    PERTURB.get("prgf")(ctx, state, q=50, sigma=1e-4, lr=0.005)
    assert ctx.oracle.counts.tolist() == [1 + 1 + 10 + 50] * 3


def test_prgf_norm_estimate_schedule():
    """``||grad L||^2`` is estimated (``norm_samples`` queries) every ``norm_every`` iterations *and* at iteration
    3 (the authors: "the gradient norm may change fast in the early iterations"); a perfect prior needs 1 query
    for itself, and ``margin_step`` 1 for the step: 1 + 10 + 1, 1 + 1, 1 + 1, 1 + 10 + 1, 1 + 1 queries."""
    w, b, x, y = _linear_target(2)
    target, surrogate = Linear(w, b), Linear(w.clone(), b.clone())
    ctx = _with_surrogates(target, (surrogate,), x, y, 0.1, "linf", 1000)
    state = INIT.get("prgf_init")(ctx)
    asked = []
    for _ in range(5):
        before = ctx.oracle.counts.clone()
        state = ACCEPT.get("margin_step")(ctx, state, PERTURB.get("prgf")(ctx, state, q=50, sigma=1e-4, lr=0.005,
                                                                          norm_samples=10, norm_every=10))
        asked.append((ctx.oracle.counts - before).tolist())
    assert asked == [[12, 12], [2, 2], [2, 2], [12, 12], [2, 2]]


def test_prgf_sigma_growth_on_a_flat_target():
    """The authors' numerical guards on a target that never changes its answer: sigma doubles while the prior's
    difference is 0 (``MAX_RETRIES`` 10 rounds, 1 query each) and grows 5x while the guided estimate is 0 (10 rounds
    of q queries), so after one iteration its multiplier is 2^10 5^10; the check that sets a raised sigma back runs
    on even iterations only (2 probes), so the second iteration (it = 1) asks no more than the first minus the
    norm estimate."""
    g = torch.Generator().manual_seed(6)
    target = Linear(torch.zeros(2, 12), torch.tensor([1.0, 0.0]))
    surrogate = Linear(torch.randn(2, 12, generator=g), torch.zeros(2))
    x = torch.rand(2, 3, 2, 2, generator=g) * 0.5 + 0.25
    y = torch.zeros(2, dtype=torch.long)
    ctx = _with_surrogates(target, (surrogate,), x, y, 0.1, "linf", 10_000)
    state = INIT.get("prgf_init")(ctx)
    q, scales = 5, []
    for expected in (1 + 10 + 10 + 10 * q, 1 + 10 + 10 * q):
        before = ctx.oracle.counts.clone()
        state = {**state, **PERTURB.get("prgf")(ctx, state, q=q, sigma=1e-4, lr=0.005)}
        assert (ctx.oracle.counts - before).tolist() == [expected] * 2
        scales.append(state["sigma_scale"].tolist())
    assert scales[0] == [2.0 ** 10 * 5.0 ** 10] * 2 and scales[1] == [(2.0 ** 10 * 5.0 ** 10) ** 2] * 2


def test_l2_steps_are_normalised():
    """Under L2 both PRGF and Subspace step by a fixed length along the unit direction: PRGF with a perfect prior
    ``x - l2_lr (w_0 - w_1) / ||w_0 - w_1||``; Subspace on its first iteration ``x + l2_lr sign(slope) u`` (the
    prior is a multiple of the unit direction u)."""
    w, b, x, y = _linear_target(3)
    ctx = _with_surrogates(Linear(w, b), (Linear(w.clone(), b.clone()),), x, y, 5.0, "l2", 1000)
    out = PERTURB.get("prgf")(ctx, INIT.get("prgf_init")(ctx), q=50, sigma=1e-4, l2_lr=0.12)
    direction = (w[0] - w[1]).view(1, 3, 4, 4)
    assert torch.allclose(out["x_adv"], x - 0.12 * direction / direction.norm(), atol=1e-6)

    ctx = dataclasses.replace(make_ctx(Linear(w, b), x, y, 5.0, "l2", 1000, num_classes=2),
                              surrogates=(Linear(-w, torch.zeros(2)),))
    out = PERTURB.get("subspace")(ctx, INIT.get("subspace_init")(ctx), l2_lr=0.1)
    u = (w[1] - w[0]) / (w[1] - w[0]).norm()  # the reference's z_0 - z_1 gradient, unit norm
    assert torch.allclose((out["x_adv"] - x).flatten(1).norm(dim=1), torch.full((3,), 0.1), atol=1e-6)
    # the target's margin drops along -(w_0 - w_1) = u: the step is +0.1 u
    assert torch.allclose(out["x_adv"], x + 0.1 * u.view(1, 3, 4, 4), atol=1e-6)


class Hinge(nn.Module):
    """Two classes, margin ``1 + relu(10 (mean(x) - 0.5))``: flat below mean 0.5, linear above."""

    def forward(self, x):
        s = (x.flatten(1).mean(1) - 0.5) * 10
        return torch.stack([1 + torch.relu(s), torch.zeros_like(s)], 1)


def test_prgf_sigma_growth_is_per_sample():
    """Sigma grows only for the sample whose finite differences are 0 (on the flat side of the hinge), not for its
    neighbour on the linear side."""
    g = torch.Generator().manual_seed(6)
    surrogate = Linear(torch.randn(2, 12, generator=g), torch.zeros(2))
    x = torch.stack([torch.full((3, 2, 2), 0.3), torch.full((3, 2, 2), 0.7)])
    y = torch.zeros(2, dtype=torch.long)
    ctx = _with_surrogates(Hinge(), (surrogate,), x, y, 0.1, "linf", 10_000)
    out = PERTURB.get("prgf")(ctx, INIT.get("prgf_init")(ctx), q=5, sigma=1e-4, lr=0.005)
    assert out["sigma_scale"][0] > 1 and out["sigma_scale"][1] == 1


def test_prgf_prior_sums_every_surrogate():
    """The prior is the gradient of the surrogates' *summed* losses: two linear surrogates whose margin gradients
    add up to the target's make a perfect prior together (lambda* 1: prior + norm queries only, a sign step along
    the true gradient), though neither is one alone."""
    w, b, x, y = _linear_target(3)
    part = torch.randn(2, 48, generator=torch.Generator().manual_seed(3))  # any split of w works
    surrogates = (Linear(part, torch.zeros(2)), Linear(w - part, torch.zeros(2)))
    ctx = _with_surrogates(Linear(w, b), surrogates, x, y, 0.1, "linf", 1000)
    out = PERTURB.get("prgf")(ctx, INIT.get("prgf_init")(ctx), q=50, sigma=1e-4, lr=0.005)
    direction = (w[0] - w[1]).view(1, 3, 4, 4)
    assert torch.equal(out["x_adv"], (x - 0.005 * direction.sign()).clamp(0, 1))
    assert ctx.oracle.counts.tolist() == [1 + 1 + 10] * 3


def test_bases_weight_search_cycles_through_the_surrogates():
    """Iteration t moves the weight of surrogate ``t mod N`` only (``w +- eta e_k``), and the coordinate advances
    after every select (N = 3 linear surrogates)."""
    g = torch.Generator().manual_seed(8)
    models = tuple(Linear(torch.randn(3, 12, generator=g), torch.zeros(3)) for _ in range(3))
    target = Linear(torch.randn(3, 12, generator=g), torch.tensor([4.0, 0.0, 0.0]))
    x = torch.rand(2, 3, 2, 2, generator=g) * 0.5 + 0.25
    y = torch.zeros(2, dtype=torch.long)
    ctx = dataclasses.replace(make_ctx(target, x, y, 0.05, "l2", 1000, num_classes=3), surrogates=models)
    state = INIT.get("bases_init")(ctx)
    for t in range(5):
        assert state["coord"].tolist() == [t % 3] * 2
        proposal = PERTURB.get("bases")(ctx, state, eta=0.005)
        e = torch.zeros_like(state["w"])
        e[:, t % 3] = 0.005
        assert torch.equal(proposal["w_plus"], state["w"] + e) and torch.equal(proposal["w_minus"], state["w"] - e)
        state = ACCEPT.get("bases_select")(ctx, state, proposal)


def test_surrogate_gradient_is_per_sample_and_one_backward():
    """Weighted losses of two surrogates: each sample's gradient equals the one computed alone, per model."""
    g = torch.Generator().manual_seed(3)
    models = [Linear(torch.randn(10, 12, generator=g), torch.zeros(10)),
              nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10)).requires_grad_(False)]
    x = torch.rand(5, 3, 2, 2, generator=g)
    y = torch.randint(0, 10, (5,), generator=g)
    w = torch.rand(5, 2, generator=g, dtype=torch.float64)
    loss = lambda k, logits, rows: nn.functional.cross_entropy(logits, y[rows], reduction="none")  # noqa: E731
    grad = surrogate_gradient(models, x, loss, weights=w)
    for i in range(5):
        ref = torch.zeros_like(x[i])
        for k, m in enumerate(models):
            xi = x[i:i + 1].clone().requires_grad_(True)
            ref += w[i, k].float() * torch.autograd.grad(nn.functional.cross_entropy(m(xi), y[i:i + 1]), xi)[0][0]
        assert torch.allclose(grad[i], ref, atol=1e-6)


# ---------------------------------------------------------------- Subspace and BASES math

def test_drop_schedule_and_conv_dropout():
    it = torch.tensor([0, 9, 10, 11, 110, 10_000])
    p = drop_schedule(it, 0.0, 0.5, 10, 0.01)
    ref = [0.0 if t < 10 else 0.5 - 0.5 * np.exp(-(t - 10) * 0.01) for t in it.tolist()]
    assert np.allclose(p.numpy(), ref)
    conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16, 4)).requires_grad_(False)
    x = torch.rand(4, 1, 4, 4)
    drop = torch.tensor([0.0, 0.5, 0.5, 0.3], dtype=torch.float64)
    streams = Streams(5, 4, "cpu")
    with conv_dropout(conv, streams.view(torch.arange(4)), torch.arange(4), drop):
        batch = conv(x)
    assert streams.counter.tolist() == [0, 2, 2, 2]  # one draw per hooked layer, only for rows that drop
    assert torch.allclose(batch[0], conv(x[:1])[0])  # p = 0: the plain forward
    alone = Streams(5, 4, "cpu")
    with conv_dropout(conv, alone.view(torch.tensor([2])), torch.tensor([0]), drop[2:3]):
        assert torch.allclose(conv(x[2:3])[0], batch[2])  # a sample's masks do not depend on its neighbours
    big = Streams(0, 1, "cpu")
    with conv_dropout(conv, big.view(torch.tensor([0])), torch.tensor([0]), torch.tensor([0.3])) as hook:
        mask = hook._mask(torch.ones(1, 20_000))
    values = mask.unique()
    assert len(values) == 2 and values[0] == 0 and values[1] == pytest.approx(1 / 0.7)
    assert abs((mask == 0).float().mean() - 0.3) < 0.02


def test_subspace_step_matches_a_hand_computed_step():
    """First iteration (prior 0, no dropout) with one linear reference: direction u = normalised gradient of
    z_y - z_o of the reference, probes x +- fd_eta u, prior = sign(slope of the negated margin) u / ||u||_1, step
    x + lr sign(prior)."""
    g = torch.Generator().manual_seed(4)
    w_t, w_s = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    target, ref = Linear(w_t, torch.tensor([3.0, 0.0, 0.0])), Linear(w_s, torch.zeros(3))
    x = torch.rand(2, 3, 2, 2, generator=g) * 0.5 + 0.25
    y = torch.zeros(2, dtype=torch.long)
    ctx = dataclasses.replace(make_ctx(target, x, y, 0.2, "linf", 100, num_classes=3), surrogates=(ref,))
    state = INIT.get("subspace_init")(ctx)
    out = PERTURB.get("subspace")(ctx, state, fd_eta=0.1, exploration=0.1, prior_lr=1.0, lr=0.01)
    logits = x.flatten(1) @ w_t.T + target.b
    assert torch.equal(state["other"], logits[:, 1:].argmax(1) + 1)
    margin = lambda z: z[:, 0] - z[:, 1:].max(1).values  # noqa: E731  (log-softmax shifts cancel)
    for i in range(2):
        o = state["other"][i]
        u = (w_s[0] - w_s[o]) / (w_s[0] - w_s[o]).norm()
        lp = margin(((x[i].flatten() + 0.1 * u) @ w_t.T + target.b)[None])
        lm = margin(((x[i].flatten() - 0.1 * u) @ w_t.T + target.b)[None])
        prior = torch.sign(lm - lp) * u / u.abs().sum()
        assert torch.allclose(out["prior"][i].flatten(), prior, atol=1e-6)
        assert torch.equal(out["x_adv"][i].flatten(), (x[i].flatten() + 0.01 * prior.sign()).clamp(0, 1))
    assert ctx.oracle.counts.tolist() == [3, 3]  # start + 2 probes


def test_subspace_step_refreshes_the_runner_up_and_draws_every_reference():
    """``subspace_step`` keeps the target's runner-up class *at the new point* (the pair of the next direction);
    and every sample draws its reference model uniformly, so with two references over 40 samples both are used
    (one forward row per sample in all)."""
    d = 12
    w = torch.stack([torch.zeros(d), torch.ones(d), -torch.ones(d)])
    target = Linear(w, torch.tensor([5.0, 0.0, 6.0]))  # runner-up 1 at mean 0.75, 2 at mean 0.1
    refs = (Counting(Linear(torch.randn(3, d, generator=torch.Generator().manual_seed(0)), torch.zeros(3))),
            Counting(Linear(torch.randn(3, d, generator=torch.Generator().manual_seed(1)), torch.zeros(3))))
    n = 40
    x = torch.full((n, 3, 2, 2), 0.75)
    y = torch.zeros(n, dtype=torch.long)
    ctx = dataclasses.replace(make_ctx(target, x, y, 1.0, "linf", 100, num_classes=3), surrogates=refs)
    state = INIT.get("subspace_init")(ctx)
    assert (state["other"] == 1).all()
    PERTURB.get("subspace")(ctx, state)
    assert refs[0].images + refs[1].images == n and min(refs[0].images, refs[1].images) >= 10
    out = ACCEPT.get("subspace_step")(ctx, state, dict(x_adv=torch.full_like(x, 0.1), prior=state["prior"],
                                                       it=state["it"] + 1))
    assert (out["other"] == 2).all() and out["margin"].tolist() == pytest.approx([0.2] * n, abs=1e-4)


class Recording(nn.Module):
    """A model that keeps every image it forwards."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return self.model(x)


@pytest.mark.parametrize("fd_eta,exploration,prior_lr", [(0.1, 0.1, 1.0), (0.05, 0.3, 0.5)])
def test_subspace_probes_look_ahead_along_the_prior(fd_eta, exploration, prior_lr):
    """From a non-zero prior v (the authors' attack.py: v estimates the ascent of the attacker's loss, the negated
    margin): probes at x + fd_eta (v +- e u) / ||v +- e u||, Delta = (L(q+) - L(q-)) / (fd_eta e) u with L = -margin,
    v <- v + prior_lr Delta / ||Delta||_1, image step x + lr sign(v). So both probes lie on the side the image steps
    to (the earlier block stepped against its prior and probed behind the step). Distinct fd_eta, e and prior_lr
    pin which constant goes where."""
    g = torch.Generator().manual_seed(6)
    w_t, w_s = torch.randn(3, 12, generator=g), torch.randn(3, 12, generator=g)
    target, ref = Recording(Linear(w_t, torch.tensor([3.0, 0.0, 0.0]))), Linear(w_s, torch.zeros(3))
    x = torch.rand(2, 3, 2, 2, generator=g) * 0.5 + 0.25
    y = torch.zeros(2, dtype=torch.long)
    ctx = dataclasses.replace(make_ctx(target, x, y, 0.2, "linf", 100, num_classes=3), surrogates=(ref,))
    state = INIT.get("subspace_init")(ctx)
    state["prior"] = torch.randn(x.shape, generator=g)  # ||v|| ~ 3.5 >> exploration 0.1
    target.seen.clear()
    out = PERTURB.get("subspace")(ctx, state, fd_eta=fd_eta, exploration=exploration, prior_lr=prior_lr, lr=0.01)
    probes = torch.cat(target.seen).view(2, 2, -1)  # (sample, +/-, pixels)
    loss = lambda z: -(z[:, 0] - z[:, 1:].max(1).values)  # noqa: E731  the negated margin (log-softmax shifts cancel)
    for i in range(2):
        o, v, xi = state["other"][i], state["prior"][i].flatten(), x[i].flatten()
        u = (w_s[0] - w_s[o]) / (w_s[0] - w_s[o]).norm()
        q = torch.stack([v + exploration * u, v - exploration * u])
        assert torch.allclose(probes[i], (xi + fd_eta * q / q.norm(dim=1, keepdim=True)).clamp(0, 1), atol=1e-6)
        lp, lm = loss(probes[i] @ w_t.T + target.model.b)
        delta = (lp - lm) / (fd_eta * exploration) * u
        v_new = v + prior_lr * delta / delta.abs().sum()
        assert torch.allclose(out["prior"][i].flatten(), v_new, atol=1e-5)
        step = out["x_adv"][i].flatten() - xi
        assert torch.equal(step, (xi + 0.01 * v_new.sign()).clamp(0, 1) - xi)
        assert bool((((probes[i] - xi) * step).sum(1) > 0).all())  # both probes ahead of the step


def test_bases_perturbation_machine_matches_a_per_sample_loop():
    """PGD on per-sample weighted CW margins of two surrogates, batched with two rows of one sample, equals a
    plain loop per row (Linf sign steps and L2 normalised steps)."""
    g = torch.Generator().manual_seed(5)
    models = (Linear(torch.randn(4, 12, generator=g), torch.zeros(4)),
              nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4)).requires_grad_(False))
    x = torch.rand(3, 3, 2, 2, generator=g)
    y = torch.tensor([0, 1, 2])
    rows = torch.tensor([0, 1, 2, 1])
    w = torch.rand(4, 2, generator=g, dtype=torch.float64) - 0.2
    for norm, eps in (("linf", 0.1), ("l2", 0.5)):
        ctx = dataclasses.replace(make_ctx(models[0], x, y, eps, norm, 10, num_classes=4), surrogates=models)
        got = perturbation_machine(ctx, x[rows], w, rows, iters=4, step=3.0)
        for r in range(4):
            xr, x0, label = x[rows[r]:rows[r] + 1].clone(), x[rows[r]:rows[r] + 1], y[rows[r]:rows[r] + 1]
            for _ in range(4):
                xr.requires_grad_(True)
                total = 0
                for k, m in enumerate(models):
                    z = m(xr)
                    other = torch.cat([z[:, :label], z[:, label + 1:]], 1).max(1).values
                    total = total + w[r, k].float() * (z[0, label] - other).sum()
                grad, = torch.autograd.grad(total, xr)
                a = 3.0 * eps / 4
                with torch.no_grad():
                    step = grad.sign() if norm == "linf" else grad / grad.norm()
                    xr = Problem(x0, label, eps, norm).project(xr - a * step)
            assert torch.allclose(got[r], xr[0], atol=1e-6), (norm, r)


def test_bases_never_asks_twice_for_an_image():
    """One surrogate: PM(w + eta e) and PM(w - eta e) are the same image (the PM ignores the scale of w), so an
    iteration asks once; a candidate already answered is not asked again, and a sample left with nothing new
    ends as stalled instead of spending its budget on repeats."""
    from blackboxbench.prep.data import digits

    target, surrogate = _digits_model("digits_mlp", True), _digits_model("digits_cnn", True)
    ds = digits(n=12)
    tgt = (ds.y + 3) % 10
    ctx = dataclasses.replace(make_ctx(target, ds.x, ds.y, 0.3, "linf", 10_000, target=tgt), surrogates=(surrogate,))
    state = INIT.get("bases_init")(ctx)
    for _ in range(6):
        before = ctx.oracle.counts.clone()
        proposal = PERTURB.get("bases")(ctx, state)
        fixed = (proposal["plus"] == state["x_adv"]).flatten(1).all(1)
        assert torch.equal(proposal["plus"], proposal["minus"])
        state = ACCEPT.get("bases_select")(ctx, state, proposal)
        asked = ctx.oracle.counts - before
        assert (asked <= 1).all() and (asked[fixed] == 0).all()
    problem, res = run_surrogate("bases", target, [surrogate], ds.x, ds.y, 0.3, "linf", 10_000, target=tgt)
    assert res.stalled.any() and (res.queries[res.stalled] < 20).all() and res.success.sum() >= 4
    check_outputs(problem, res, target, 10_000)


def test_bases_select_counts_like_the_authors_and_never_takes_a_refused_candidate():
    """``bases_select`` on hand-made candidates (the target's margin is 20 mean(x) - 10; a surrogate with zero
    gradient leaves the start at x): an adversarial ``+`` is taken and counts 1 candidate (the authors do not ask
    ``-`` then), a lower ``-`` is taken and both count; where the budget refuses the candidates (margin +inf) the
    sample keeps its image, weights and margin."""
    d = 12
    target = Linear(torch.stack([torch.ones(d), -torch.ones(d)]) * 10 / d, torch.tensor([-5.0, 5.0]))
    flat = Linear(torch.zeros(2, d), torch.zeros(2))
    x = torch.full((2, 3, 2, 2), 0.6)
    y = torch.zeros(2, dtype=torch.long)
    plus = torch.stack([x[0] - 0.2, x[1] - 0.02])  # margins -2 (adversarial) and 1.6
    minus = x - 0.05  # margin 1
    for budget in (1000, 1):
        ctx = dataclasses.replace(make_ctx(target, x, y, 0.25, "linf", budget, num_classes=2), surrogates=(flat,))
        state = INIT.get("bases_init")(ctx)
        assert torch.equal(state["x_adv"], x) and state["margin"].tolist() == pytest.approx([2.0, 2.0], abs=1e-5)
        w = state["w"]
        e = torch.full_like(w, 0.005)
        proposal = dict(plus=plus, minus=minus, w_plus=w + e, w_minus=w - e, live=torch.ones(2, dtype=torch.bool))
        out = ACCEPT.get("bases_select")(ctx, state, proposal)
        if budget == 1:  # refused: nothing moves
            assert torch.equal(out["x_adv"], x) and torch.equal(out["w"], w)
            assert torch.equal(out["margin"], state["margin"]) and not out["success"].any()
            continue
        assert torch.equal(out["x_adv"][0], plus[0]) and torch.equal(out["x_adv"][1], minus[1])
        assert torch.equal(out["w"][0], (w + e)[0]) and torch.equal(out["w"][1], (w - e)[1])
        assert out["success"].tolist() == [True, False]
        assert out["asked"].tolist() == [1 + 1, 1 + 2] and ctx.oracle.counts.tolist() == [3, 3]


@pytest.mark.parametrize("iterw", [6, 50])
def test_bases_stops_after_iterw_candidates(iterw):
    """The authors' search is ``while n_query < iterw``: a sample the weight search does not fool ends stalled
    after its round at ``iterw - 1`` candidates, at ``iterw + 1`` queries, however large the run's budget (L2 on
    the digits, three surrogates, so that the weights move the perturbation machine's output)."""
    from blackboxbench.prep.data import digits

    recipe, source = load_recipe({"recipe": "bases", "blocks": {"perturb": {"iterw": iterw}}}, "tests")
    t = finish_threat({"norm": "l2", "eps": 0.5, "max_queries": 1000}, recipe, recipe_family(recipe, source), source)
    ds = digits(n=12)
    surrogates = [_digits_model(n, True) for n in ("digits_cnn", "digits_lenet", "digits_resnet")]
    records = run_tensors(build_attack(recipe, t, source), t, ds.x, ds.y,
                          {"model": [_digits_model("digits_mlp", True)], "surrogates": surrogates})
    res = to_result(records, ds.x)
    failed = res.attacked & ~res.success
    assert failed.sum() >= 4 and res.success.any()
    assert res.stalled[failed].all() and (res.queries[failed] == iterw + 1).all(), res.queries
    assert (res.queries[res.success] <= iterw + 2).all()


# ---------------------------------------------------------------- engine contracts

@pytest.mark.parametrize("name", RECIPES)
def test_surrogate_work_never_reaches_the_oracle_count(name):
    """The target forwards exactly the images the oracle counted, plus the worker's clean check and audit (one
    image per sample each) and the randomized-model check (the first 8 clean images, twice); the surrogates
    forward images too, and none of them is counted."""
    from blackboxbench.prep.data import digits

    target, surrogate = Counting(_digits_model("digits_mlp", True)), Counting(_digits_model("digits_cnn", True))
    ds = digits(n=12)
    problem, res = run_surrogate(name, target, [surrogate], ds.x, ds.y, 0.1, "linf", budget=60)
    attacked = int(res.attacked.sum())
    assert target.images == int(res.queries.sum()) + len(ds.y) + attacked + 16, (target.images, res.queries)
    assert surrogate.images > 0
    check_outputs(problem, res, target, 60)


PAPER_CONSTANTS = {  # the papers' / authors' code values (none of the three is in Table VI), typed by hand
    "prgf": {"init": {"name": "prgf_init"},
             "perturb": {"name": "prgf", "q": 50, "sigma": 0.0001, "lr": 0.005, "l2_lr": 0.12, "norm_samples": 10,
                         "norm_every": 10, "prior_loss": "margin"},
             "accept": {"name": "margin_step"}},
    "subspace": {"init": {"name": "subspace_init"},
                 "perturb": {"name": "subspace", "fd_eta": 0.1, "exploration": 0.1, "prior_lr": 1.0, "lr": 1 / 255,
                             "l2_lr": 0.1, "init_drop": 0.0, "max_drop": 0.5, "drop_grow_iter": 10,
                             "drop_gamma": 0.01},
                 "accept": {"name": "subspace_step"}},
    "bases": {"init": {"name": "bases_init", "iters": 10, "step": 3.0},
              "perturb": {"name": "bases", "eta": 0.005, "iters": 10, "step": 3.0, "iterw": 50},
              "accept": {"name": "bases_select"}},
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_ship_the_papers_constants(name):
    """PRGF: q 50, sigma 1e-4, Linf lr 0.005, norm from 10 samples every 10 iterations; Subspace: fd_eta 0.1,
    exploration 0.1, prior lr 1, image lr 1/255, dropout 0 -> 0.5 after 10 iterations, gamma 0.01; BASES: PGD 10
    iterations of 3 eps / 10, eta 0.005, iterw 50."""
    recipe, _ = load_recipe(name, "tests")
    assert recipe["blocks"] == PAPER_CONSTANTS[name]


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_need_surrogates(tmp_path, name):
    with pytest.raises(BenchError, match="needs 'surrogates'"):
        run_experiment(_exp(tmp_path, attack=name, model="digits_mlp", threat={"norm": "linf", "eps": 0.2}),
                       progress=False)


BATCH_CASES = [("prgf", "linf", 0.2, False, 1000), ("subspace", "l2", 1.5, True, 1000),
               ("bases", "linf", 0.3, True, 1000)]


@pytest.mark.parametrize("attack,norm,eps,targeted,budget", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_records_do_not_depend_on_the_batch_size(tmp_path, attack, norm, eps, targeted, budget):
    """batch_size 1, 7 and 100 give identical records (float64 digits MLP target, the digits CNN surrogate in
    float64)."""
    runs = records_by_batch_size(tmp_path, attack, norm, eps, targeted, budget,
                                 surrogates=["test_digits_cnn_f64"])
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 6



def test_prgf_probe_calls_hold_whole_samples_within_the_bound(tmp_path, monkeypatch):
    """PRGF's q = 50 prior-guided probes per sample come in calls of whole samples of at most ``PROBE_VALUES``
    values, as are its norm-estimate calls (10 probes per sample due for one, plus the prior's probe): with room
    for 50 images a call, a call holds at most 50 plus one sample's 11 - 1 rows, where the unbounded run's largest
    holds every sample's; the records are the same."""
    from blackboxbench.query import prgf

    (whole, largest), (cut, largest_cut) = records_by_probe_values(
        tmp_path, monkeypatch, "prgf", prgf, (1 << 26, 50 * 64), "linf", 0.2, surrogates=["test_digits_cnn_f64"])
    assert largest >= 100 and largest_cut <= 60
    assert whole == cut and sum(r["success"] for r in whole) >= 6

# ---------------------------------------------------------------- CIFAR-10 ResNet-56 with ResNet-20/32/44

@pytest.fixture(scope="module")
def resnets(data_root):
    target = build_model("cifar_resnet56", data_root)
    surrogates = [build_model(f"cifar_resnet{d}", data_root) for d in (20, 32, 44)]
    return (target, surrogates, *correctly_classified([target], data_root, n=8, pool=24))


# Measured (seed 0, these 8 images, Linf 0.03, budget 10,000): all three fool 8/8; median (mean) queries
# prgf 16 (129), subspace 11 (11.8), bases 2 (2.0), against nes 188 (250) and square_linf 45 (81) on the same
# images. L2 1.0: 8/8 each, median prgf 19 (mean 193), subspace 17 (17), bases 2 (2). Targeted (4 images,
# target y + 1, Linf): 4/4 each, median prgf 132, subspace 23, bases 2. The caps leave ~5x (prgf's queries are
# bimodal, ~15 or ~300-600 per image, hence its wider cap).
REAL = [("prgf", 100), ("subspace", 60), ("bases", 10)]


@pytest.mark.parametrize("norm,eps", [("linf", 0.03), ("l2", 1.0)])
@pytest.mark.parametrize("name,max_median", REAL)
def test_untargeted_resnet56_with_resnet_surrogates(resnets, name, max_median, norm, eps):
    target, surrogates, x, y = resnets
    problem, res = run_surrogate(name, target, surrogates, x, y, eps, norm, budget=10_000)
    check_outputs(problem, res, target, 10_000)
    assert res.success.float().mean() >= 0.875, res.queries
    assert res.queries[res.success].float().median() <= max_median, res.queries


@pytest.mark.parametrize("name", RECIPES)
def test_targeted_resnet56(resnets, name):
    target, surrogates, x, y = resnets
    x, y = x[:4], y[:4]
    tgt = (y + 1) % 10
    problem, res = run_surrogate(name, target, surrogates, x, y, 0.03, "linf", budget=10_000, target=tgt)
    check_outputs(problem, res, target, 10_000)
    assert res.success.float().mean() >= 0.75, res.queries


@pytest.mark.parametrize("name,norm", [(n, m) for n in RECIPES for m in ("linf", "l2")])
def test_tiny_budget_never_claims_a_false_success(resnets, name, norm):
    target, surrogates, x, y = resnets
    eps = {"linf": 1 / 255, "l2": 0.05}[norm]
    problem, res = run_surrogate(name, target, surrogates, x[:4], y[:4], eps, norm, budget=5)
    check_outputs(problem, res, target, 5)
    assert (res.queries <= 5).all()
