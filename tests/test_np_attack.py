"""NP-attack: NES on the representation of an image learned by an attentive neural process (``query/np_attack.py``).

The ANP at the authors' CIFAR-10 sizes and their pixel order (against a re-implementation of their grid), training
that lowers the negative log-likelihood of held-out images, the NES update against a per-sample loop of the
authors' ``NP_Attack`` (type R) and of their types Z and RZ against a hand computation, the z_dim and search-type
checks, type R's records pinned, batch-size invariance (float64 digits target; Z and RZ too, with their threat
model) and the real pretrained CIFAR-10 ResNet-56 at the paper's budget (skipped without the offline data). The
digits contract (tests/test_contract.py) runs the recipe at both norms with a small ANP.
"""
import math

import pytest
import torch
from torch import nn

from blackboxbench.errors import BenchError, ConfigError
from blackboxbench.prep.data import digits
from blackboxbench.query import np_attack
from blackboxbench.query.np_attack import (ANP, coordinates, nll, np_init, representation_step, search_step, to_images,
                                            to_points, train_anp)
from blackboxbench.runner import run_experiment

from attack_utils import build, make_ctx
from test_advflow import Scores, needs_data, resnet56_run
from test_engine import _exp, _records, records_by_batch_size



def _authors_grid(h, w, c):
    """The authors' generate_grid (utils/np_utils.py), rewritten: (1, H*W*C, 3) coordinates."""
    rows, cols, dim = torch.linspace(0, 1, h), torch.linspace(0, 1, w), torch.linspace(0, 1, c)
    grid = torch.stack([cols.repeat(h, 1).t().contiguous().view(-1), rows.repeat(w)], dim=1)[None]
    dim = dim.expand(1, h * w, -1).contiguous().view(1, -1, 1)
    return torch.cat([grid.repeat(1, 1, c).view(1, h * w * c, 2), dim], -1)


def test_points_follow_the_authors_grid_and_pixel_order():
    """Point k of an image is the authors' point k: their coordinates, and the value of ``x.permute(0, 2, 3, 1)``
    flattened, minus 0.5 (their Normalize(0.5, 1)); to_images inverts to_points."""
    assert torch.equal(coordinates((3, 32, 32)), _authors_grid(32, 32, 3)[0])
    x = torch.rand(2, 3, 4, 5)
    assert torch.equal(to_points(x), x.permute(0, 2, 3, 1).reshape(2, -1) - 0.5)
    assert torch.allclose(to_images(to_points(x), (3, 4, 5)), x)


def test_anp_has_the_authors_cifar10_sizes():
    """r_dim 128, z_dim 128, hidden 400, 4 heads of 32: r is 3,072 points x 128, the latent 128 numbers with a scale
    in [0.01, 0.1]; the decoder gives a mean and a scale >= 0.1 per point."""
    net = ANP((3, 32, 32), r_dim=128, z_dim=128, hidden=400)
    assert net.wv.out_features == 128 and net.heads == 4 and net.dec[0].in_features == 2 * 128 + 3
    r, mean, scale = net.encode(torch.rand(2, 3, 32, 32))
    assert r.shape == (2, 3072, 128) and mean.shape == scale.shape == (2, 128)
    assert scale.min() >= 0.01 and scale.max() <= 0.1
    mu, sigma = net.decode(r, mean[:, None].expand(-1, 3072, -1))
    assert mu.shape == sigma.shape == (2, 3072) and sigma.min() >= 0.1



def test_anp_attention_and_scales_by_hand():
    """With identity coordinate features, every head's attention is softmax(c_i . c_j / sqrt(3)) over the point
    coordinates (scaled dot-product); the latent scale lies in [0.01, 0.1] and the decoder's in [0.1, inf), both
    reached at saturated layers (pre-activations -50 and +50)."""
    torch.manual_seed(0)
    net = ANP((1, 2, 2), r_dim=8, z_dim=4, hidden=8)
    net.query_net, net.key_net = nn.Identity(), nn.Identity()
    with torch.no_grad():
        for lin in (net.wq, net.wk):
            lin.weight.copy_(torch.eye(3).repeat(4, 1))
            lin.bias.zero_()
        att = net.attention()
    dots = torch.tensor([[0.0, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, 1], [0, 1, 1, 2]])  # (0,0) (0,1) (1,0) (1,1)
    assert torch.allclose(att, torch.softmax(dots / math.sqrt(3), -1).expand(4, -1, -1), atol=1e-6)
    x = torch.rand(1, 1, 2, 2)
    for bias, z_scale, dec_scale in ((-50.0, 0.01, 0.1), (50.0, 0.1, 0.1 + 0.9 * 50)):
        with torch.no_grad():
            for lin in (net.z_scale, net.dec_scale):
                lin.weight.zero_()
                lin.bias.fill_(bias)
            r, mean, scale = net.encode(x)
            _, sigma = net.decode(r, mean[:, None].expand(-1, 4, -1))
        assert torch.allclose(scale, torch.full_like(scale, z_scale)) and torch.allclose(sigma, torch.full_like(
            sigma, dec_scale))


def test_decoding_in_chunks_gives_every_row_once(monkeypatch):
    """The decoder bounds its activations (``CHUNK``): 5 rows decoded 2 at a time equal the rows decoded at once."""
    torch.manual_seed(0)
    net = ANP((1, 2, 2), r_dim=8, z_dim=4, hidden=8)
    r, z = torch.randn(5, 4, 4), torch.randn(5, 4, 4)
    with torch.no_grad():
        whole = net.decode(r, z)
        monkeypatch.setattr(np_attack, "CHUNK", 2 * 4 * 8)  # 2 rows of 4 points x 8 hidden
        cut = net.decode(r, z)
    assert all(a.shape == (5, 4) and torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, cut))

def test_the_attack_encodes_an_image_whatever_is_encoded_with_it():
    """``encode_each`` (the attack's) gives an image the same encoding, bit for bit, alone, with one other image or
    with six (``encode`` of a batch does not: a CPU matrix product's rounding depends on its number of rows), and
    the encoding of the batch up to float32 rounding."""
    torch.manual_seed(0)
    net = ANP((1, 8, 8), r_dim=16, z_dim=16, hidden=32)
    x = digits(n=7).x
    with torch.no_grad():
        full = net.encode_each(x)
        for rows in ([6], [2, 6], [0, 1, 2, 3, 6]):
            assert all(torch.equal(a[rows], b) for a, b in zip(full, net.encode_each(x[rows])))
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(full, net.encode(x)))


def test_training_lowers_the_held_out_negative_log_likelihood():
    """Trained on 200 digits of the train split, the ANP gives the digits of the test split (never seen) a lower
    negative log-likelihood than the untrained one, and reconstructs them closer than their mean grey does."""
    arch = {"r_dim": 16, "z_dim": 16, "hidden": 32}
    train, test = digits(n=200, split="train").x, digits(n=100).x
    out = train_anp(train, arch, epochs=15, views=1, np_lr=1e-3, batch=8, seed=0)
    torch.manual_seed(0)
    start, net = ANP(train.shape[1:], **arch), ANP(train.shape[1:], **arch)
    net.load_state_dict(out["state"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before, after = (nll(m, test, gen).mean().item() / 64 for m in (start, net))
        r, mean, _ = net.encode(test)
        rec = to_images(net.decode(r, mean[:, None].expand(-1, 64, -1))[0], (1, 8, 8))
    assert after < before - 0.1, (before, after)
    assert (rec - test).pow(2).mean() < 0.75 * (test - test.mean()).pow(2).mean()  # measured: 0.58


def test_training_draws_one_latent_per_image():
    """The training loss decodes every point of an image with the same latent draw (the authors' reparameterise:
    one draw per image, expanded over its points), different images with different draws; the attack draws one per
    point (test_representation_step_is_the_authors_update)."""
    net = ANP((1, 4, 4), r_dim=8, z_dim=4, hidden=8)
    seen = []
    decode = net.decode
    net.decode = lambda r, z: seen.append(z) or decode(r, z)
    nll(net, torch.rand(3, 1, 4, 4), torch.Generator().manual_seed(0))
    z, = seen
    assert z.shape == (3, 16, 4)
    assert torch.equal(z, z[:, :1].expand(-1, 16, -1))  # before: a draw per point
    assert (z[0, 0] != z[1, 0]).all()


def test_representation_step_is_the_authors_update():
    """One NES update of r against a per-sample loop of the authors' NP_Attack, type R (perturbations scaled by the
    latent scale, one latent draw per point shared by the population, the decode clipped to the eps ball, the
    unclipped CW margin of the log-probabilities, rewards standardized with 1e-7, r += lr / (N S) e^T A), with a
    linear map as the decoder and the same normal draws."""
    n, p, d, n_pop, lr, eps = 3, 12, 4, 20, 0.05, 0.05
    model = Scores(p, 0)
    x = torch.rand(n, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    y = model(x).argmax(1)
    g = torch.Generator().manual_seed(2)
    r0, z_mean, z_scale = torch.randn(n, p, d, generator=g), torch.randn(n, d, generator=g), 0.01 + 0.09 * torch.rand(n, d, generator=g)
    proj = torch.randn(2 * d, generator=g) * 0.1

    def decode(rep, z):
        return (torch.cat([rep, z], -1) @ proj).view(-1, 2, 2, 3).permute(0, 3, 1, 2) + 0.5

    ctx = make_ctx(model, x, y, eps, "linf", 1000, num_classes=4)
    r = representation_step(ctx, r0, z_mean, z_scale, decode, n_pop=n_pop, lr=lr)
    rng = make_ctx(model, x, y, eps, "linf", 1000, num_classes=4).rng
    e_all, normal = rng.normal((n_pop, p, d)), rng.normal((p, d))
    for i in range(n):
        e, z = e_all[i], z_mean[i] + z_scale[i] * normal[i]
        images = decode(r0[i] + e * z_scale[i], z.expand(n_pop, -1, -1)).clamp(0, 1)
        images = x[i] + (images - x[i]).clamp(-eps, eps)
        log_p = torch.log(torch.softmax(model(images), 1))
        onehot = torch.zeros(n_pop, 4)
        onehot[:, y[i]] = 1
        loss = (onehot * log_p).sum(1) - ((1 - onehot) * log_p - onehot * 10000).max(1)[0]
        adv = -loss.view(n_pop, 1)
        a = (adv - adv.mean()) / (adv.std() + 1e-7)
        ref = r0[i] + lr / (n_pop * z_scale[i]) * (e.view(n_pop, -1).t() @ a).view(p, d)
        assert torch.allclose(r[i], ref, atol=1e-4), i
    assert (ctx.oracle.counts == n_pop).all()


def test_targeted_step_size_rule_is_the_authors():
    """The step-size rule of the authors' NPAttack_targeted.py against their loop, for five samples over 80
    iterations of random mean losses: at iterations 0, 10, ... the lr halves where the loss rose since the last
    check (100 at first) while the lr is above 1e-3, and the loss becomes the last."""
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(80, 5, generator=g) * 4 - torch.arange(80)[:, None] * 0.02
    lr, last = torch.full((5,), 0.05), torch.full((5,), 100.0)
    for it in range(80):
        lr, last = np_attack.targeted_lr(lr, last, losses[it], torch.full((5,), it))
    for i in range(5):
        ref_lr, ref_last = 0.05, 100
        for it in range(80):
            loss = losses[it, i].item()
            if it % 10 == 0:
                if loss > ref_last and ref_lr > 1e-3:
                    ref_lr = ref_lr / 2
                ref_last = loss
        assert lr[i].item() == pytest.approx(ref_lr) and last[i].item() == pytest.approx(ref_last)
    assert (lr < 0.05).all() and (lr > 1e-3 / 2).all()



@pytest.mark.parametrize("search", ["R", "RZ"])
def test_a_population_with_a_refused_query_changes_nothing(monkeypatch, search):
    """Targeted, budget 11: the first population (20 candidates, iteration 0, a check of the step-size rule) has 10
    refused queries, so the sample keeps its encoded r and latent mean, its lr (0.05) and last loss (100); the
    rule does not read the refused candidates' infinite losses as a rise."""
    model, x, y, *_ = _tiny()
    torch.manual_seed(0)
    net = ANP((3, 2, 2), r_dim=8, z_dim=4, hidden=8)
    monkeypatch.setattr(np_attack, "trained_anp", lambda *args: net)
    ctx = make_ctx(model, x, y, 0.05, "linf", 11, target=(y + 1) % 4, num_classes=4)
    state = np_init(ctx, z_dim=4, search=search)
    out = np_attack.np_attack(ctx, state, n_pop=20, search=search, z_dim=4)
    with torch.no_grad():
        r, mean, _ = net.encode_each(x)
    assert (ctx.oracle.counts == 11).all()
    assert out["lr"].tolist() == pytest.approx([0.05] * 3) and out["last_loss"].tolist() == [100.0] * 3
    assert torch.equal(out["r"], r)
    assert torch.equal(out["z_mean"], mean if search == "R" else mean[:, None].expand(-1, 12, -1))
    assert torch.isfinite(out["x_adv"]).all()

def test_targeted_runs_halve_the_step_and_untargeted_runs_keep_it(tmp_path, monkeypatch):
    """Targeted runs (the authors' NPAttack_targeted.py) go through the step-size rule, untargeted ones keep
    Table VI's lr: the lr each NES update gets, on digits with a small ANP, with every population's margins raised
    by 10 more at each call (the same for a whole population: its standardized rewards do not change), so that the
    mean loss rises at every check: the lr halves at iterations 10 and 20 (not at 0: below the initial 100)."""
    steps = {False: [], True: []}
    population, update = np_attack.population, np_attack.nes_update
    calls = []

    def rising(*args):
        e, margin, ok = population(*args)
        calls.append(1)
        return e, margin + 10.0 * len(calls), ok

    monkeypatch.setattr(np_attack, "population", rising)
    for targeted in (False, True):
        def spy(r, z_scale, e, margin, ok, lr, targeted=targeted):
            steps[targeted].append(torch.as_tensor(lr).flatten().clone())
            return update(r, z_scale, e, margin, ok, lr)

        monkeypatch.setattr(np_attack, "nes_update", spy)
        calls.clear()
        exp = _exp(tmp_path / str(targeted), attack={"recipe": "np_attack", "blocks": SMALL}, model="digits_mlp",
                   assets=_digits_assets(), dataset={"name": "digits", "n": 2},
                   threat={"norm": "linf", "eps": 0.01, "max_queries": 2200, "targeted": targeted})
        run_experiment(exp, progress=False)
    assert all(torch.equal(s, torch.full_like(s, 0.05)) for s in steps[False])
    lrs = [s.max().item() for s in steps[True]]  # the samples that are still running
    assert len(lrs) >= 21
    assert lrs[:10] == [pytest.approx(0.05)] * 10 and lrs[10:20] == [pytest.approx(0.025)] * 10, lrs
    assert lrs[20:] == [pytest.approx(0.0125)] * len(lrs[20:])


def _digits_assets(n=200):
    return {"train": {"name": "train_images", "spec": {"name": "digits", "split": "train", "n": n}}}


SMALL = {"init": {"name": "np_init", "z_dim": 8},
         "perturb": {"name": "np_attack", "r_dim": 8, "z_dim": 8, "hidden": 16, "epochs": 3}}


def test_init_and_perturb_must_agree_on_z_dim(tmp_path):
    blocks = {"init": {"name": "np_init", "z_dim": 4}, "perturb": SMALL["perturb"]}
    exp = _exp(tmp_path, attack={"recipe": "np_attack", "blocks": blocks}, model="digits_mlp",
               assets=_digits_assets(), threat={"norm": "linf", "eps": 0.2, "max_queries": 300},
               dataset={"name": "digits", "n": 2})
    with pytest.raises(BenchError, match="z_dim 8 differs from np_init's 4"):
        run_experiment(exp, progress=False)


def test_records_do_not_depend_on_the_batch_size(tmp_path):
    """batch_size 1, 7 and 100 give identical records (float64 digits target, a small ANP)."""
    runs = records_by_batch_size(tmp_path, {"recipe": "np_attack", "blocks": SMALL}, "linf", 0.2, False,
                                 budget=2000, assets=_digits_assets(), dataset={"name": "digits", "n": 8})
    assert runs[0] == runs[1] == runs[2]
    assert sum(r["success"] for r in runs[0]) >= 2  # measured: 3 of 8 at 2,000 queries with this tiny ANP


# ResNet-20 test: a small ANP trained briefly on 32 images (CI time: the population's draws and decodes grow with
# z_dim and hidden; benchmarks/ run the CPU config's ANP)
REDUCED = {"init": {"name": "np_init", "z_dim": 4},
           "perturb": {"name": "np_attack", "r_dim": 8, "z_dim": 4, "hidden": 16, "epochs": 2}}


@needs_data
def test_resnet20_at_the_papers_budget(tmp_path):
    """NP-attack with a small ANP (test_advflow.resnet56_run) against the pretrained ResNet-20 at Table VI's E (Linf
    0.05): 3 of the first 4 images within 10,000 queries. (ResNet-56 at Linf 0.03 with the CPU config's ANP:
    benchmarks/RESULTS.md; at CI's 1 thread it costs minutes.)"""
    recs = resnet56_run(tmp_path, {"recipe": "np_attack", "blocks": REDUCED}, n=4, fooled=3, train_n=32,
                        model="cifar_resnet20", eps=0.05)
    print(sorted(r["queries"] for r in recs))


# ------------------------------------------------------------------------------------- search types Z, RZ ----

def _tiny(n=3, p=12, d=4):
    """A 4-class score model over 3 x 2 x 2 images, its images and labels, r (n, P, D), a per-point latent mean
    (n, P, D: all points different, as after a first update), the latent scale and a linear decoder."""
    model = Scores(p, 0)
    x = torch.rand(n, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    y = model(x).argmax(1)
    g = torch.Generator().manual_seed(2)
    r, mu = torch.randn(n, p, d, generator=g), torch.randn(n, p, d, generator=g)
    scale = 0.01 + 0.09 * torch.rand(n, d, generator=g)
    proj = torch.randn(2 * d, generator=g) * 0.1

    def decode(rep, z):
        return (torch.cat([rep, z], -1) @ proj).view(-1, 2, 2, 3).permute(0, 3, 1, 2) + 0.5

    return model, x, y, r, mu, scale, decode


def _standardized(model, x, y, images, eps):
    """The authors' standardized rewards A (n_pop, 1) of one sample's decodes: clipped to the eps ball, the
    unclipped CW margin of the log-probabilities, rewards -loss standardized with 1e-7."""
    images = x + (images.clamp(0, 1) - x).clamp(-eps, eps)
    log_p = torch.log(torch.softmax(model(images), 1))
    onehot = torch.zeros(len(images), 4)
    onehot[:, y] = 1
    loss = (onehot * log_p).sum(1) - ((1 - onehot) * log_p - onehot * 10000).max(1)[0]
    adv = -loss.view(-1, 1)
    return (adv - adv.mean()) / (adv.std() + 1e-7)


@pytest.mark.parametrize("search", ["Z", "RZ"])
def test_z_and_rz_steps_are_the_authors_updates(search):
    """Types Z and RZ of the authors' NP_Attack against a hand computation per sample with the same normal draws
    (their order: r's e, the latent mean's e', then the latent's draw): candidate k decodes r (RZ: r + S e_k) with
    z_k = mu1 + S e'_k + S n_k, a draw per candidate and point around the perturbed per-point mean; mu1 moves by
    lr / (N S) sum_k A_k e'_k and r stays (Z) or moves by lr / (N S) sum_k A_k e_k with the same A (RZ)."""
    n, p, d, n_pop, lr, eps = 3, 12, 4, 20, 0.05, 0.05
    model, x, y, r0, mu0, scale, decode = _tiny(n, p, d)
    seen = []
    ctx = make_ctx(model, x, y, eps, "linf", 1000, num_classes=4)
    r, mu = search_step(ctx, r0, mu0, scale, lambda rep, z: seen.append((rep, z)) or decode(rep, z),
                        n_pop=n_pop, lr=lr, search=search)
    rng = make_ctx(model, x, y, eps, "linf", 1000, num_classes=4).rng
    e_r = rng.normal((n_pop, p, d)) if search == "RZ" else torch.zeros(n, n_pop, p, d)
    e_z, normal = rng.normal((n_pop, p, d)), rng.normal((n_pop, p, d))
    (rep_seen, z_seen), = seen
    for i in range(n):
        s = scale[i]
        rep, z = r0[i] + s * e_r[i], mu0[i] + s * e_z[i] + s * normal[i]
        assert torch.allclose(rep_seen.view(n, n_pop, p, d)[i], rep.expand(n_pop, -1, -1), atol=1e-6)
        assert torch.allclose(z_seen.view(n, n_pop, p, d)[i], z, atol=1e-6), i
        a = _standardized(model, x[i], y[i], decode(rep, z), eps)
        step = lambda e: lr / (n_pop * s) * (e.view(n_pop, -1).t() @ a).view(p, d)  # noqa: E731
        assert torch.allclose(mu[i], mu0[i] + step(e_z[i]), atol=1e-5), i
        assert torch.allclose(r[i], r0[i] + step(e_r[i]), atol=1e-5) if search == "RZ" else torch.equal(r[i], r0[i])
        assert not torch.allclose(mu[i], mu0[i], atol=1e-3) and (search == "Z" or not torch.allclose(r[i], r0[i]))
    assert (ctx.oracle.counts == n_pop).all()


def test_z_candidates_are_drawn_around_their_perturbed_mean():
    """Type Z's candidate latents, less their perturbed means mu1 + S e_k, are S times standard normal draws,
    fresh for every candidate and point (the authors' Normal(mu1 + S1 e_k, S1).rsample(); type R shares one draw per
    point across its population), and r is decoded unperturbed."""
    n, p, d, n_pop = 2, 12, 4, 400
    model, x, y, r0, mu0, scale, decode = _tiny(n, p, d)
    seen = []
    ctx = make_ctx(model, x, y, 0.05, "linf", 10_000, num_classes=4)
    search_step(ctx, r0, mu0, scale, lambda rep, z: seen.append((rep, z)) or decode(rep, z), n_pop=n_pop, lr=0.05,
                search="Z")
    e = make_ctx(model, x, y, 0.05, "linf", 10_000, num_classes=4).rng.normal((n_pop, p, d))
    (rep, z), = seen
    assert torch.equal(rep.view(n, n_pop, p, d), r0[:, None].expand(-1, n_pop, -1, -1))
    noise = (z.view(n, n_pop, p, d) - mu0[:, None] - scale[:, None, None] * e) / scale[:, None, None]
    assert noise.mean().abs() < 0.03 and (noise.std() - 1).abs() < 0.03  # 19,200 draws
    assert (noise[:, 0] != noise[:, 1]).all()  # not shared by the candidates


def _search_blocks(search):
    return {"init": {**SMALL["init"], "search": search}, "perturb": {**SMALL["perturb"], "search": search}}


def test_type_r_records_are_unchanged(tmp_path):
    """Type R (the default, and search R given in both blocks) keeps the records it had before the search types
    were added: the queries, successes and L2 distances of a small digits run (float64 target, small ANP, batch 4),
    pinned from the code before them."""
    runs = []
    for i, blocks in enumerate((SMALL, _search_blocks("R"))):
        exp = _exp(tmp_path / str(i), attack={"recipe": "np_attack", "blocks": blocks}, model="test_digits_mlp_f64",
                   threat={"norm": "linf", "eps": 0.2, "max_queries": 1500}, batch_size=4, assets=_digits_assets(),
                   dataset={"name": "digits", "n": 6})
        runs.append(_records(run_experiment(exp, progress=False)[0]))
    assert runs[0] == runs[1]
    assert [r["queries"] for r in runs[0]] == [911, 1500, 305, 1500, 0, 1500]
    assert [r["success"] for r in runs[0]] == [True, False, True, False, False, False]
    assert [r["l2"] for r in runs[0]] == [1.5195003747940063, 1.5626356601715088, 1.54435133934021,
                                          1.5315018892288208, 0.0, 1.4967811107635498]  # before Z and RZ


@pytest.mark.parametrize("search", ["Z", "RZ"])
def test_z_and_rz_keep_the_threat_model_and_do_not_depend_on_the_batch_size(tmp_path, search):
    """Types Z and RZ (per-point latent mean in np_init's state) give identical records at batch sizes 1, 7 and
    100, inside the eps ball and the budget (the runner checks [0, 1] and the uint8 grid), Linf and L2."""
    for norm, eps in (("linf", 0.2), ("l2", 1.5)):
        runs = records_by_batch_size(tmp_path / norm, {"recipe": "np_attack", "blocks": _search_blocks(search)}, norm,
                                     eps, False, budget=1500, assets=_digits_assets(),
                                     dataset={"name": "digits", "n": 6})
        assert runs[0] == runs[1] == runs[2]
        attacked = [r for r in runs[0] if r["attacked"]]
        assert attacked and all(r[norm] <= eps + 1e-5 and r["queries"] <= 1500 for r in attacked)
        assert all(r["queries"] >= 1 for r in attacked if r["success"])
        print(search, norm, [(r["success"], r["queries"]) for r in runs[0]])


def test_init_and_perturb_must_agree_on_the_search_type(tmp_path):
    """A config whose two blocks differ in search is a one-line error naming the init's key; a state of the other
    type handed to the perturb block (one latent mean per image vs one per point) is a one-line error too, before
    any ANP is trained; a search type the authors do not have is a one-line config error."""
    blocks = {"init": SMALL["init"], "perturb": {**SMALL["perturb"], "search": "Z"}}
    exp = _exp(tmp_path, attack={"recipe": "np_attack", "blocks": blocks}, model="digits_mlp",
               assets=_digits_assets(), threat={"norm": "linf", "eps": 0.2, "max_queries": 300},
               dataset={"name": "digits", "n": 2})
    with pytest.raises(ConfigError, match=r"attack\.blocks\.init\.search.*must equal attack\.blocks\.perturb\.search"
                                          r" \('Z'\), got 'R'") as err:
        run_experiment(exp, progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="search: must be one of R, Z, RZ, got 'X'"):
        build("np_attack", blocks={"perturb": {"name": "np_attack", "search": "X"}})
    model, x, y, *_ = _tiny()
    ctx = make_ctx(model, x, y, 0.05, "linf", 1000, num_classes=4)
    state_r, state_z = np_init(ctx, z_dim=4), np_init(ctx, z_dim=4, search="Z")
    assert state_r["z_mean"].shape == (3, 4) and state_z["z_mean"].shape == (3, 12, 4)
    assert state_r["r"].shape == state_z["r"].shape == (3, 12, 4) and state_z["z_scale"].shape == (3, 4)
    for state, search, msg in ((state_r, "Z", "search Z differs from np_init's R"),
                               (state_r, "RZ", "search RZ differs from np_init's R"),
                               (state_z, "R", "search R differs from np_init's Z/RZ")):
        with pytest.raises(BenchError, match=f"^np_attack: {msg} .*set both\\)$") as err:
            np_attack.np_attack(ctx, state, search=search, z_dim=4, data="missing")
        assert "\n" not in str(err.value)
