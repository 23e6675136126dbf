"""CG-Attack: CMA-ES in the latent space of a conditional Glow trained on the surrogates (``query/cg_attack.py``).

The c-Glow against independent references (its inverse, and its log-likelihood against the autograd Jacobian and
the priors), conditioning on the image, finite candidates from an overflowing decode, training that lowers the
surrogate's margin on held-out images, the separable CMA-ES on test functions (a sphere and an ill-conditioned
ellipsoid, two samples at once), one training per run and a cache across runs; over every c-Glow recipe
(CG-Attack, MCG): batch-size invariance (float64 digits target) and the real pretrained CIFAR-10 ResNet-20 at the
paper's budget (skipped without the offline data). The digits contract (tests/test_contract.py)
runs the recipe at both norms with a small c-Glow.
"""
import math

import pytest
import torch

from blackboxbench.prep import trained
from blackboxbench.prep.data import digits
from blackboxbench.prep.models import build_model
from blackboxbench.query import cg_attack
from blackboxbench.query.cg_attack import (CondGlow, cma_constants, gaussian_logp, sep_cma_update, to_boundary,
                                           train_cglow)
from blackboxbench.runner import run_experiment
from blackboxbench.threat import margin_loss

from attack_utils import count_calls
from test_advflow import needs_data, resnet56_run
from test_engine import _exp, _records, records_by_batch_size, records_by_probe_values

SMALL = {"x_hidden_channels": 4, "x_hidden_size": 8, "y_hidden_channels": 8, "flow_depth": 2, "num_levels": 2}


def _random_cglow(shape, seed):
    """A small float64 c-Glow with every parameter random, so that every conditioner and coupling acts."""
    g = torch.Generator().manual_seed(seed)
    flow = CondGlow(shape, **SMALL).double()
    for name, p in flow.named_parameters():
        base = torch.linalg.qr(torch.randn(p.shape, generator=g, dtype=torch.float64))[0] if "rotation" in name else 0
        p.data = base + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
    return flow


def test_cglow_inverts_and_its_likelihood_is_the_change_of_variables():
    """decode(encode(y)) = y given the image, and encode's log-likelihood equals the standard normal log-density of
    the top latent plus each split's Gaussian log-density under its prior plus the log-determinant of the autograd
    Jacobian from y to the latents. Two images give two different maps (the image conditions every step)."""
    shape = (3, 8, 8)
    flow = _random_cglow(shape, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, *shape, dtype=torch.float64, generator=g)
    y = torch.randn(2, *shape, dtype=torch.float64, generator=g)
    cond, inv = flow.condition(x, inverse=False), flow.condition(x)
    top, zs, logp = flow.encode(cond, y)
    assert top.shape == (2, *flow.top) == (2, 24, 2, 2) and [z.shape[1:] for z in zs] == [(6, 4, 4)]
    assert torch.allclose(flow.decode(inv, top, zs=zs)[0], y, atol=1e-8)
    for i in range(2):
        one = [[tuple(t[i:i + 1] for t in c) for c in level] for level in cond]

        def latents(v):
            t, z, _ = flow.encode(one, v.view(1, *shape))
            return torch.cat([t.flatten()] + [q.flatten() for q in z])

        jac = torch.autograd.functional.jacobian(latents, y[i].flatten())
        ref = torch.linalg.slogdet(jac)[1] - 0.5 * (top[i] ** 2).sum() - 0.5 * top[i].numel() * math.log(2 * math.pi)
        # the split's prior comes from the first half of the level's output, which the top latent's level decodes
        first = flow.decode([[tuple(t[i:i + 1] for t in c) for c in level] for level in inv], top[i:i + 1],
                            zs=[z[i:i + 1] for z in zs])
        assert torch.allclose(first[0], y[i:i + 1], atol=1e-8)
        h = torch.nn.functional.pixel_unshuffle(y[i:i + 1], 2)
        for step, c in zip(flow.steps[0], one[0]):
            h = step(c, h)[0]
        mean, logs = flow.priors[0](h[:, :h.shape[1] // 2])
        ref = ref + gaussian_logp(mean, logs, zs[0][i:i + 1])[0]
        assert torch.allclose(logp[i], ref, atol=1e-7), (logp[i], ref)
    swapped = flow.decode(flow.condition(x.flip(0)), top, zs=zs)[0]
    assert (swapped - y).abs().amax() > 1e-3



def test_split_latents_are_drawn_from_their_priors():
    """Without split latents a decode draws them from their Gaussian priors, ``mean + exp(logs) noise`` with the
    prior's mean and log-scale (the log-density ``gaussian_logp`` reads), and returns the ones it used; given,
    they are used as they are."""
    flow = _random_cglow((1, 8, 8), 0)
    g = torch.Generator().manual_seed(2)
    x = torch.rand(2, 1, 8, 8, generator=g, dtype=torch.float64)
    top = torch.randn(2, *flow.top, generator=g, dtype=torch.float64)
    noise = [torch.randn(2, *s, generator=g, dtype=torch.float64) for s in flow.split_shapes()]
    seen, prior = [], flow.priors[0]
    real = prior.forward
    prior.forward = lambda z1: seen.append(real(z1)) or seen[-1]
    cond = flow.condition(x)
    with torch.no_grad():
        y, used = flow.decode(cond, top, noise=noise)
        (mean, logs), = seen
        assert logs.abs().max() > 0.05 and torch.allclose(used[0], mean + logs.exp() * noise[0])
        again, kept = flow.decode(cond, top, zs=used)
    assert kept[0] is used[0] and torch.equal(again, y)

def test_training_lowers_the_surrogates_margin_on_held_out_images():
    """Trained for 2 epochs (lr 1e-3) on 200 digits of the train split against the digits CNN (Linf 0.2), the
    c-Glow's perturbations of 64 test digits (never seen) lower the CNN's mean margin by at least 1 against the
    untrained c-Glow's, and the MLP's (a model it never saw) by at least 0.5."""
    cnn, mlp = build_model("digits_cnn"), build_model("digits_mlp")
    train, test = digits(n=200, split="train"), digits(n=64)
    arch = {**SMALL, "num_levels": 3, "y_hidden_channels": 16}
    hp = {"eps": 0.2, "norm": "linf", "views": 1, "lr": 1e-3, "batch": 8, "max_grad_norm": 10.0, "margin": 20.0,
          "seed": 0}
    margins, unseen = [], []
    for epochs in (0, 2):
        out = train_cglow([cnn], train.x, train.y, arch, epochs=epochs, **hp)
        flow = CondGlow((1, 8, 8), **arch)
        flow.load_state_dict(out["state"])
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            noise = [torch.randn((64, *s), generator=g) for s in flow.split_shapes()]
            delta = flow.decode(flow.condition(test.x), torch.zeros(64, *flow.top), noise=noise)[0]
            xa = (test.x + 0.2 * delta.clamp(-1, 1)).clamp(0, 1)
            margins.append(margin_loss(cnn(xa), test.y).clamp_min(-20).mean().item())
            unseen.append(margin_loss(mlp(xa), test.y).clamp_min(-20).mean().item())
    assert margins[1] < margins[0] - 1.0, margins
    assert unseen[1] < unseen[0] - 0.5, unseen


def test_candidates_stay_finite_on_the_sphere_when_a_decode_overflows():
    """A decode with NaN and infinite entries (an overflow) maps to a finite point of the eps sphere or inside it,
    never to a NaN image: NaN reads as 0, +-inf as the largest float."""
    y = torch.tensor([[[[float("nan"), float("inf")], [-float("inf"), 0.5]]]])
    linf = to_boundary(y, 0.1, "linf")
    assert torch.equal(linf, torch.tensor([[[[0.0, 0.1], [-0.1, 0.1]]]]))
    ok = torch.tensor([[[[0.3, -0.4], [0.0, 0.0]]]])
    assert torch.isfinite(to_boundary(y, 1.0, "l2")).all()
    assert torch.allclose(to_boundary(ok, 1.0, "l2").flatten(1).norm(dim=1), torch.ones(1))



def test_training_points_and_loss_by_hand():
    """Training's adversarial image: Linf ``x + eps y`` (decodes in units of eps) clipped to the ball, L2 ``x + y``
    scaled into it; the loss is the mean over the models of each one's mean CW margin on its logits, floored at
    -margin."""
    x = torch.full((1, 1, 1, 3), 0.5)
    y = torch.tensor([[[[0.5, -3.0, 0.1]]]])
    assert torch.allclose(cg_attack.training_point(x, y, 0.1, "linf"), torch.tensor([[[[0.55, 0.4, 0.51]]]]))
    l2 = cg_attack.training_point(x, torch.tensor([[[[0.3, 0.0, -0.4]]]]), 0.25, "l2")
    assert torch.allclose(l2, torch.tensor([[[[0.65, 0.5, 0.3]]]]))
    logits = [torch.tensor([[3.0, 1.0, 0.0], [0.0, 9.0, 1.0]]), torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 2.0]])]
    models = [lambda _, t=t: t for t in logits]
    labels = torch.tensor([0, 0])
    # margins: model 0: 2 and -9 (floored at -5); model 1: -1 and -2
    assert cg_attack.adversarial_loss(models, x, labels, 5.0).item() == pytest.approx(((2 - 5) / 2 + (-1 - 2) / 2) / 2)

def _run_es(fns, dim, generations, n_pop=20, sigma=1.0, start=3.0):
    k, w = cma_constants(dim, n_pop)
    n = len(fns)
    es = {"mean": torch.full((n, dim), start), "sigma": torch.full((n,), sigma), "cov": torch.ones(n, dim),
          "p_sigma": torch.zeros(n, dim), "p_c": torch.zeros(n, dim), "gen": torch.zeros(n, dtype=torch.long)}
    g = torch.Generator().manual_seed(0)
    for _ in range(generations):
        z = torch.randn((n, n_pop, dim), generator=g)
        x = es["mean"][:, None] + es["sigma"][:, None, None] * es["cov"].sqrt()[:, None] * z
        fit = torch.stack([fn(x[i]) for i, fn in enumerate(fns)])
        es = sep_cma_update(es, z, fit, k, w)
    return es


def test_separable_cma_es_solves_a_sphere_and_learns_an_ellipsoids_axes():
    """Two samples at once, 10 dimensions: on the sphere the mean reaches 1e-3 of the optimum and the step size
    shrinks; on an ellipsoid with axis weights 1 .. 1e4, the learned diagonal covariance orders the axes inversely
    to their weights (the separable update learns the scaling), and the mean reaches the optimum too."""
    weights = 10.0 ** torch.linspace(0, 4, 10)
    es = _run_es([lambda v: (v ** 2).sum(1), lambda v: (weights * v ** 2).sum(1)], 10, 400)
    assert es["mean"][0].norm() < 1e-3 and es["sigma"][0] < 1e-2
    assert (weights * es["mean"][1] ** 2).sum() < 1e-4
    scaled = es["cov"][1] * weights  # near constant: cov ~ 1 / weight
    assert scaled.max() / scaled.min() < 30 and es["cov"][1].max() / es["cov"][1].min() > 100



def _tutorial_constants(n, lam):
    """The default CMA-ES constants of Hansen's tutorial (arXiv:1604.00772, Table 1, alpha_cov 2) for dimension n
    and population lam, with Ros and Hansen's separable factor (n + 2) / 3 on the covariance learning rates."""
    mu = lam // 2
    raw = [math.log((lam + 1) / 2) - math.log(i) for i in range(1, mu + 1)]
    w = [v / sum(raw) for v in raw]
    mu_eff = 1 / sum(v * v for v in w)
    c1 = 2 / ((n + 1.3) ** 2 + mu_eff)
    c_mu = min(1 - c1, 2 * (mu_eff - 2 + 1 / mu_eff) / ((n + 2) ** 2 + 2 * mu_eff / 2))
    c1_sep = min(1, c1 * (n + 2) / 3)
    c_sigma = (mu_eff + 2) / (n + mu_eff + 5)
    return {"mu": mu, "mu_eff": mu_eff, "c_sigma": c_sigma,
            "d_sigma": 1 + 2 * max(0, math.sqrt((mu_eff - 1) / (n + 1)) - 1) + c_sigma,
            "c_c": (4 + mu_eff / n) / (n + 4 + 2 * mu_eff / n), "c1": c1_sep,
            "c_mu": min(1 - c1_sep, c_mu * (n + 2) / 3),
            "chi": math.sqrt(n) * (1 - 1 / (4 * n) + 1 / (21 * n * n))}, w


@pytest.mark.parametrize("n,lam", [(10, 20), (768, 20), (3, 9)])
def test_cma_constants_are_the_tutorials_defaults(n, lam):
    """Recombination weights and learning rates as Hansen's tutorial gives them (the separable rates scaled as Ros
    and Hansen's sep-CMA-ES), e.g. at the top latent's 768 dimensions and CG-Attack's 20 candidates. An odd
    population (9: mu 4) weighs by ln(5) - ln i, not ln(4.5) - ln i."""
    k, w = cma_constants(n, lam)
    want, want_w = _tutorial_constants(n, lam)
    assert k == pytest.approx(want, rel=1e-9)
    assert w.tolist() == pytest.approx(want_w, rel=1e-6) and abs(float(w.sum()) - 1) < 1e-6


def _generations(monkeypatch, budget, n_pop=6):
    """cg_init and two cg_attack calls (the modes, then one generation) on 3 random 1 x 8 x 8 images against fixed
    linear scores (margins of tens), an untrained small c-Glow standing in for the trained one; returns the modes'
    margins and proposal, the candidates and margins the generation queried, the state before it, the proposal and
    the state after it."""
    from test_advflow import Scores
    from attack_utils import make_ctx

    torch.manual_seed(0)
    flow = CondGlow((1, 8, 8), **SMALL).eval().requires_grad_(False)
    monkeypatch.setattr(cg_attack, "trained_cglow", lambda *args: flow)
    seen, real = [], cg_attack.query_margin

    def query(c, images, idx=None):
        seen.append((images, real(c, images, idx)[0]))
        return seen[-1][1], seen[-1][1] < 0, torch.isfinite(seen[-1][1])

    monkeypatch.setattr(cg_attack, "query_margin", query)
    model = Scores(64, 0, 8.0)
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    y = model(x).argsort(1)[:, -2]  # the second class: margins from -9 to -80, some below the floor
    ctx = make_ctx(model, x, y, 0.1, "linf", budget, num_classes=4)
    state = cg_attack.cg_init(ctx, num_levels=2)
    seen.clear()
    first = cg_attack.cg_attack(ctx, state, n_pop=n_pop, sigma=0.5, **SMALL)  # the modes
    (_, modes), = seen
    before = {k: v.clone() for k, v in state.items()}
    seen.clear()
    proposal = cg_attack.cg_attack(ctx, state, n_pop=n_pop, sigma=0.5, **SMALL)
    (images, margin), = seen
    return (modes, first), images.view(3, n_pop, 1, 8, 8), margin.view(3, n_pop), before, proposal, state


def test_a_generation_proposes_each_samples_best_candidate(monkeypatch):
    """Each sample's proposal is its lowest-margin candidate of the generation, with that candidate's margin (floored
    at -20, the authors' fitness) and the oracle's verdict on it; the generation moved every sample's ES. The
    first call proposes the modes, their margins floored too, and starts the ES at step ``sigma``."""
    (modes, first), images, margin, before, proposal, state = _generations(monkeypatch, 1000)
    assert margin.min() < -20 and modes.min() < -20  # the floor acts
    assert torch.equal(first["margin"], modes.clamp_min(-20)) and torch.equal(first["adv"], modes < 0)
    best = margin.clamp_min(-20).argmin(1)  # the first floored candidate on a tie
    assert torch.equal(proposal["x_adv"], images[torch.arange(3), best])
    assert torch.equal(proposal["margin"], margin.min(1).values.clamp_min(-20))
    assert torch.equal(proposal["adv"], margin.min(1).values < 0)
    assert (before["sigma"] == 0.5).all() and (before["gen"] == 0).all()  # the ES started at step sigma
    assert not torch.equal(state["mean"], before["mean"]) and (state["gen"] == before["gen"] + 1).all()


def test_a_generation_with_a_refused_query_leaves_the_es(monkeypatch):
    """Budget 5: after the clean image and the mode, 3 of a sample's 6 candidates are answered; its ES (mean, step,
    covariance, paths, generation count) stays as it was."""
    _, _, margin, before, _, state = _generations(monkeypatch, 5)
    assert torch.isinf(margin[:, 3:]).all() and torch.isfinite(margin[:, :3]).all()
    for key in cg_attack.ES_KEYS:
        assert torch.equal(state[key], before[key]), key


def test_sep_cma_update_is_the_tutorials_step():
    """One update against Hansen's tutorial equations with a diagonal covariance (float64, per sample): the mean
    moves by sigma <y>_w of the best half, the paths, the covariance (rank one with h_sigma, rank mu) and the step
    size follow. Sample 1's conjugate path is long: 1.55 chi, under h_sigma's threshold (1.4 + 2 / (n + 1)) chi;
    sample 2's at 1.9 chi is over it (its rank-one path stalls)."""
    n, lam = 5, 10
    g = torch.Generator().manual_seed(0)
    k, w = _tutorial_constants(n, lam)
    es = {"mean": torch.randn(3, n, generator=g), "sigma": torch.tensor([0.5, 1.0, 2.0]),
          "cov": 0.5 + torch.rand(3, n, generator=g), "p_sigma": torch.zeros(3, n),
          "p_c": torch.randn(3, n, generator=g), "gen": torch.tensor([0, 50, 50])}
    unit = torch.randn(n, generator=g)
    unit = unit / unit.norm()
    for i, length in ((1, 1.55), (2, 1.9)):
        es["p_sigma"][i] = length * k["chi"] / (1 - k["c_sigma"]) * unit
    z = 0.01 * torch.randn(3, lam, n, generator=g)
    z[0] *= 100
    fit = torch.randn(3, lam, generator=g)
    new = sep_cma_update(es, z, fit, *cma_constants(n, lam))
    for i in range(3):
        d = {key: v[i].double() for key, v in es.items()}
        best = fit[i].argsort()[:k["mu"]]
        zw = sum(w[j] * z[i, b].double() for j, b in enumerate(best))
        yw = d["cov"].sqrt() * zw
        p_sigma = (1 - k["c_sigma"]) * d["p_sigma"] + math.sqrt(k["c_sigma"] * (2 - k["c_sigma"]) * k["mu_eff"]) * zw
        gen = int(d["gen"]) + 1
        h = float(p_sigma.norm() / math.sqrt(1 - (1 - k["c_sigma"]) ** (2 * gen)) < (1.4 + 2 / (n + 1)) * k["chi"])
        assert h == (i < 2)
        p_c = (1 - k["c_c"]) * d["p_c"] + h * math.sqrt(k["c_c"] * (2 - k["c_c"]) * k["mu_eff"]) * yw
        rank_mu = sum(w[j] * (d["cov"].sqrt() * z[i, b].double()) ** 2 for j, b in enumerate(best))
        cov = ((1 + k["c1"] * (1 - h) * k["c_c"] * (2 - k["c_c"]) - k["c1"] - k["c_mu"]) * d["cov"]
               + k["c1"] * p_c ** 2 + k["c_mu"] * rank_mu)
        sigma = d["sigma"] * math.exp(k["c_sigma"] / k["d_sigma"] * (p_sigma.norm() / k["chi"] - 1))
        want = {"mean": d["mean"] + d["sigma"] * yw, "sigma": sigma, "cov": cov, "p_sigma": p_sigma, "p_c": p_c}
        for key, v in want.items():
            assert torch.allclose(new[key][i].double(), v, rtol=1e-5, atol=1e-6), (i, key)
        assert int(new["gen"][i]) == gen

def _digits_assets(n=200):
    return {"train": {"name": "train_images", "spec": {"name": "digits", "split": "train", "n": n}}}


FAST = {**SMALL, "num_levels": 3, "y_hidden_channels": 16, "epochs": 2, "batch": 16}


def test_one_training_per_run_and_a_cache_across_runs(tmp_path, monkeypatch):
    """The c-Glow is trained once in a run (later steps reuse it) and loaded from the cache by the next run."""
    calls = {"train": 0, "cache": 0}
    monkeypatch.setattr(cg_attack, "train_cglow", count_calls(calls, "train", cg_attack.train_cglow))
    monkeypatch.setattr(trained, "cached", count_calls(calls, "cache", trained.cached))
    monkeypatch.setattr(cg_attack, "cached", trained.cached)
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "cache"))
    attack = {"recipe": "cg_attack", "blocks": {"perturb": {"name": "cg_attack", **FAST}}}
    for i in range(2):
        exp = _exp(tmp_path / str(i), attack=attack, model="digits_mlp", assets=_digits_assets(),
                   surrogates=["digits_cnn"], threat={"norm": "linf", "eps": 0.2, "max_queries": 200},
                   batch_size=2, dataset={"name": "digits", "n": 2})
        trained._RUN.clear()
        run_experiment(exp, progress=False)
        assert calls == {"train": 1, "cache": i + 1}
    assert len(list((tmp_path / "cache" / "cglow").glob("*.pt"))) == 1


# a reduced c-Glow that trains in about half a minute on 2 cores (benchmarks/ run the CPU config's)
REDUCED = {"x_hidden_channels": 8, "x_hidden_size": 16, "y_hidden_channels": 16, "flow_depth": 2, "epochs": 2,
           "batch": 16}
# every recipe on a c-Glow: its block kind and name, a small c-Glow for the digits, a reduced one for CIFAR-10
CGLOW_RECIPES = {"cg_attack": ("perturb", "cg_attack", FAST, REDUCED),
                 "mcg": ("init", "mcg_init", {**FAST, "pretrain_epochs": 2},
                         {**REDUCED, "pretrain_epochs": 2})}


def _attack(recipe, size):
    kind, block, fast, reduced = CGLOW_RECIPES[recipe]
    return {"recipe": recipe, "blocks": {kind: {"name": block, **(fast if size == "fast" else reduced)}}}


@pytest.mark.parametrize("recipe", CGLOW_RECIPES)
def test_records_do_not_depend_on_the_batch_size(tmp_path, recipe):
    """batch_size 1, 7 and 100 give identical records on 8 digits (float64 target, a small c-Glow against the digits
    CNN) and at least 6 are fooled."""
    runs = records_by_batch_size(tmp_path, _attack(recipe, "fast"), "linf", 0.2, False, budget=2000,
                                 assets=_digits_assets(), surrogates=["digits_cnn"], dataset={"name": "digits", "n": 8})
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 6


@needs_data
@pytest.mark.parametrize("recipe", CGLOW_RECIPES)
def test_resnet20_at_the_papers_budget(tmp_path, recipe):
    """The recipe with a small c-Glow trained against ResNet-32 on 64 images, against the pretrained ResNet-20 at
    Linf 0.03 (Table V's CIFAR-10 eps): see test_advflow.resnet56_run."""
    recs = resnet56_run(tmp_path, _attack(recipe, "reduced"), n=4, fooled=3, train_n=64, model="cifar_resnet20",
                        surrogates=["cifar_resnet32"])
    print(sorted(r["queries"] for r in recs))


def test_population_calls_hold_whole_samples_within_the_bound(tmp_path, monkeypatch):
    """With room for one sample's population (20 digits of 64 values) a call, every generation's call holds one
    sample's candidates, where the unbounded run's holds every sample's; the records are the same (at 296 x 296 one
    call of every slot's population grew by about 150 MB a slot).

    And nothing of a call outlives it: the ES update runs on the call's samples alone (no population of every slot
    kept for one update after the last call), and a call's candidates are freed before the next call decodes (at
    296 x 296 with them, the previous call's candidates, decodes and split latents beside the next call's decode,
    the peak grew by 62.7 MB a slot from 16 to 32 slots; without, 14-16 MB: benchmarks/RESULTS.md)."""
    import weakref

    from blackboxbench.query import common

    updated, left = {}, {}  # PROBE_VALUES -> the samples of each ES update, the candidates alive at each decode
    calls = []              # weak references to every population call's candidates
    real_query, real_update, real_decode = cg_attack.query_margin, cg_attack.sep_cma_update, CondGlow.decode

    def query(ctx, images, idx=None):
        calls.append(weakref.ref(images))
        return real_query(ctx, images, idx)

    def update(es, z, fitness, k, w):
        updated.setdefault(common.PROBE_VALUES, []).append(len(z))
        return real_update(es, z, fitness, k, w)

    def decode(self, *args, **kw):
        left.setdefault(common.PROBE_VALUES, []).append(sum(ref() is not None for ref in calls))
        return real_decode(self, *args, **kw)

    monkeypatch.setattr(cg_attack, "query_margin", query)
    monkeypatch.setattr(cg_attack, "sep_cma_update", update)
    monkeypatch.setattr(CondGlow, "decode", decode)
    (whole, largest), (cut, largest_cut) = records_by_probe_values(
        tmp_path, monkeypatch, _attack("cg_attack", "fast"), cg_attack, (1 << 26, 20 * 64), "linf", 0.2,
        budget=300, assets=_digits_assets(), surrogates=["digits_cnn"])
    assert largest >= 8 * 20 and largest_cut == 20
    assert whole == cut and sum(r["success"] for r in whole) >= 4
    assert max(updated[1 << 26]) >= 8 and set(updated[20 * 64]) == {1}
    assert len(left[20 * 64]) > 100 and set(left[20 * 64]) == {0}


def test_es_state_covers_the_top_latent_alone(tmp_path, monkeypatch):
    """The recipe's init knows the c-Glow's levels (cg_init num_levels 3, as the perturb block's): ``cov``,
    ``p_sigma`` and ``p_c`` have the top latent's D / 4 values, ``mean`` keeps D (the split latents after the top
    latent); at 296 x 296 that drops 3 x 788,544 unused bytes a copy. The records are those of the full-width
    state (cg_init without num_levels, the old layout): 4 digits, 2 slots, both norms. An init whose levels
    exceed the c-Glow's is a one-line error."""
    from blackboxbench import catalog
    from blackboxbench.config import load_yaml
    from blackboxbench.errors import BenchError

    widths, real = [], cg_attack.start_state

    def start(ctx, x, **state):
        widths.append({k: v.shape[1] for k, v in state.items() if v.dim() == 2})
        return real(ctx, x, **state)

    monkeypatch.setattr(cg_attack, "start_state", start)
    recipe = load_yaml(catalog.find("cg_attack"))
    assert recipe["blocks"]["init"] == {"name": "cg_init", "num_levels": recipe["blocks"]["perturb"]["num_levels"]}

    def records(init, perturb=FAST, norm="linf", eps=0.2):
        attack = {**recipe, "blocks": {**recipe["blocks"], "init": init,
                                       "perturb": {**recipe["blocks"]["perturb"], **perturb}}}
        run_dir, _ = run_experiment(_exp(tmp_path / f"{len(init)}_{norm}_{len(perturb)}", attack=attack, model="digits_mlp",
                                         assets=_digits_assets(), surrogates=["digits_cnn"], batch_size=2,
                                         threat={"norm": norm, "eps": eps, "max_queries": 200},
                                         dataset={"name": "digits", "n": 4}), progress=False)
        return _records(run_dir)

    d = 64  # 8 x 8 digits
    for norm, eps in (("linf", 0.2), ("l2", 2.0)):
        widths.clear()
        full = records({"name": "cg_init"}, norm=norm, eps=eps)
        assert widths and all(w == {"mean": d, "cov": d, "p_sigma": d, "p_c": d} for w in widths)
        widths.clear()
        assert records(recipe["blocks"]["init"], norm=norm, eps=eps) == full
        assert widths and all(w == {"mean": d, "cov": d // 4, "p_sigma": d // 4, "p_c": d // 4} for w in widths)
        assert d // 4 == math.prod(CondGlow((1, 8, 8), **{**SMALL, "num_levels": 3}).top)
    with pytest.raises(BenchError, match=r"attack\.blocks\.init\.num_levels: must equal "
                                         r"attack\.blocks\.perturb\.num_levels \(2\), got 3"):
        records({"name": "cg_init", "num_levels": 3}, {"num_levels": 2})


def test_init_and_perturb_levels_must_agree(tmp_path):
    """cg_init sizes the ES state to the top latent of a c-Glow of its ``num_levels``, which the perturb block
    builds: a config that changes one block's levels and not the other's is a one-line config error naming the
    init's key, before anything runs; both changed, or the init's None (a full-width state), build."""
    from blackboxbench.errors import ConfigError
    from blackboxbench.runner import prepare

    def exp(init, perturb):
        attack = {"recipe": "cg_attack", "blocks": {"init": {"name": "cg_init", **init},
                                                    "perturb": {"name": "cg_attack", **FAST, **perturb}}}
        return prepare(_exp(tmp_path, attack=attack, model="digits_mlp", assets=_digits_assets(),
                            surrogates=["digits_cnn"], threat={"norm": "linf", "eps": 0.2, "max_queries": 200},
                            dataset={"name": "digits", "n": 2}))

    with pytest.raises(ConfigError, match=r"attack\.blocks\.init\.num_levels: must equal "
                                          r"attack\.blocks\.perturb\.num_levels \(2\), got 3$"):
        exp({}, {"num_levels": 2})
    with pytest.raises(ConfigError, match=r"attack\.blocks\.init\.num_levels: .* \(3\), got 2$"):
        exp({"num_levels": 2}, {})
    exp({"num_levels": 2}, {"num_levels": 2})
    exp({"num_levels": None}, {"num_levels": 2})


def test_first_candidate_is_the_cglows_mode(tmp_path, monkeypatch):
    """A sample's first perturb call queries one candidate, ``x + eps sign(decode)`` at the top latent 0 with the
    split latents its ES keeps (the authors' start, queried before their CMA-ES: run_attack.py), and no
    generation; its generations of ``n_pop`` follow. 3 digits in 2 slots: the first call queries the 2 modes
    alone, every later call a multiple of 20 candidates or the third sample's mode, and each mode is the decode
    of the c-Glow at the split latents its ES got, recomputed here."""
    calls, starts, real_query, real_start = [], [], cg_attack.query_margin, cg_attack._start

    def query(ctx, images, idx=None):
        calls.append(images.clone())
        return real_query(ctx, images, idx)

    def start(ctx, flow, cond, state, sigma0):
        rows, delta = real_start(ctx, flow, cond, state, sigma0)
        dim = math.prod(flow.top)
        starts.append((flow, ctx.problem.x[rows].clone(), state["mean"][rows, dim:].clone(), ctx.problem.eps))
        return rows, delta

    monkeypatch.setattr(cg_attack, "query_margin", query)
    monkeypatch.setattr(cg_attack, "_start", start)
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "cache"))
    attack = {"recipe": "cg_attack", "blocks": {"perturb": {"name": "cg_attack", **FAST}}}
    run_experiment(_exp(tmp_path, attack=attack, model="digits_mlp", assets=_digits_assets(), surrogates=["digits_cnn"],
                        threat={"norm": "linf", "eps": 0.2, "max_queries": 100}, batch_size=2,
                        dataset={"name": "digits", "n": 3}), progress=False)
    sizes = [len(c) for c in calls]
    assert sizes[0] == 2 and all(k <= 2 or k % 20 == 0 for k in sizes), sizes
    modes = torch.cat([c for c in calls if len(c) <= 2])
    assert len(modes) == 3
    want = []
    with torch.no_grad():
        for flow, x, tail, eps in starts:
            if len(x):
                zs = cg_attack.unflatten(tail, flow.split_shapes())
                delta = flow.decode(flow.condition(x), torch.zeros(len(x), *flow.top), zs=zs)[0]
                want.append((x + eps * delta.sign()).clamp(0, 1))
    assert torch.allclose(modes, torch.cat(want), atol=1e-6)
