"""MCG: a meta-trained c-Glow, fine-tuned per image on the surrogates, starts Square (``query/mcg.py``).

Stage 1 (MI-FGSM sign labels that fool the model, learned by maximum likelihood), Reptile's outer step
against its definition (no move, a straight line between the task's start and end, one inner
step of a fresh Adam equal to CG-Attack's training), the batched per-image fine-tuning against an independent
reference (a copy of the c-Glow per image trained by ``torch.optim.Adam``, float64). Batch-size invariance and the
pretrained ResNet-20 at the paper's budget: tests/test_cg_attack.py, over every c-Glow recipe. The digits contract
(tests/test_contract.py) runs the recipe with a small c-Glow.
"""
import copy

import torch

from blackboxbench.prep.data import digits
from blackboxbench.prep.models import build_model
from blackboxbench.query.cg_attack import CondGlow, adversarial_loss, pseudo_labels, train_cglow, training_point
from blackboxbench.query.mcg import finetuned_decodes
from blackboxbench.threat import margin_loss

from test_cg_attack import _random_cglow

TINY = {"x_hidden_channels": 4, "x_hidden_size": 8, "y_hidden_channels": 8, "flow_depth": 1, "num_levels": 2}


def _meta(models, x, y, **kw):
    hp = {"eps": 0.2, "norm": "linf", "epochs": 1, "views": 1, "lr": 1e-2, "batch": len(x), "max_grad_norm": 10.0,
          "margin": 5.0, "seed": 0, **kw}
    return train_cglow(models, x, y, TINY, **hp)["state"]


def test_reptile_outer_step():
    """One task (one batch, one epoch): outer step 0 keeps the initial weights, 0.5 lands halfway on the line from
    them to where the inner steps end (outer step 1), and one inner step of a fresh Adam is CG-Attack's first
    step."""
    cnn, data = build_model("digits_cnn"), digits(n=16, split="train")
    start = _meta([cnn], data.x, data.y, epochs=0)
    end = _meta([cnn], data.x, data.y, inner_steps=3, outer_step=1.0)
    half = _meta([cnn], data.x, data.y, inner_steps=3, outer_step=0.5)
    still = _meta([cnn], data.x, data.y, inner_steps=3, outer_step=1e-12)
    moved = max((end[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3
    for k in start:
        assert torch.allclose(half[k], (start[k] + end[k]) / 2, atol=1e-6), k
        assert torch.allclose(still[k], start[k], atol=1e-9), k
    one, plain = _meta([cnn], data.x, data.y, inner_steps=1), _meta([cnn], data.x, data.y)
    assert all(torch.equal(one[k], plain[k]) for k in one)


def test_stage_one_learns_the_pseudo_labels():
    """The stage-1 labels are MI-FGSM signs that fool the digits CNN (accuracy 1.0 -> below 0.1 at Linf 0.2), and 20
    epochs of maximum likelihood on them make the c-Glow's decodes agree with them in sign more than the untrained
    c-Glow's (which agree by chance)."""
    cnn, data = build_model("digits_cnn"), digits(n=64, split="train")
    labels = pseudo_labels([cnn], data.x, data.y, 0.2, 30, 0.03)
    assert set(labels.unique().tolist()) <= {-1.0, 0.0, 1.0}
    with torch.no_grad():
        assert (cnn((data.x + 0.2 * labels).clamp(0, 1)).argmax(1) == data.y).float().mean() < 0.1
    arch = {**TINY, "y_hidden_channels": 16, "flow_depth": 2}
    agree = []
    for epochs in (0, 20):
        state = train_cglow([cnn], data.x, data.y, arch, eps=0.2, norm="linf", epochs=0, views=1, lr=1e-3, batch=16,
                            max_grad_norm=10.0, margin=5.0, seed=0, pretrain_epochs=epochs, pseudo_step=0.03)["state"]
        flow = CondGlow((1, 8, 8), **arch)
        flow.load_state_dict(state)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            noise = [torch.randn((64, *s), generator=g) for s in flow.split_shapes()]
            delta = flow.decode(flow.condition(data.x), torch.zeros(64, *flow.top), noise=noise)[0]
        agree.append((delta.sign() == labels)[labels != 0].float().mean().item())
    assert agree[1] > agree[0] + 0.05 and abs(agree[0] - 0.5) < 0.05, agree


def _flow_and_linear_model(seed, scale):
    """A random c-Glow on 1 x 8 x 8 images, a generator seeded ``seed`` and a float64 linear model of weights
    ``scale`` * N(0, 1) drawn from it."""
    shape = (1, 8, 8)
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)).double()
    with torch.no_grad():
        model[1].weight.copy_(scale * torch.randn(10, 64, generator=g, dtype=torch.float64))
    return shape, _random_cglow(shape, 0), g, model


def test_per_image_finetuning_matches_a_copy_per_image():
    """The batched fine-tuning (per-sample weights through vmap, chunks of 2) gives, for each of 3 images, the
    decode of a deep copy of the c-Glow trained by torch.optim.Adam on that image alone (2 steps, values clipped),
    and the outer step's line; the fine-tuned decodes lower the model's floored margin."""
    shape, flow, g, model = _flow_and_linear_model(3, 0.05)
    x = torch.rand(3, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (3,), generator=g)
    top = torch.randn(3, *flow.top, generator=g, dtype=torch.float64)
    zs = [torch.randn(3, *s, generator=g, dtype=torch.float64) for s in flow.split_shapes()]
    kw = {"eps": 0.2, "norm": "linf", "steps": 2, "lr": 1e-2, "clip": 0.05, "chunk": 2}
    got = finetuned_decodes(flow, [model], x, y, top, zs, outer=1.0, **kw)
    halfway = finetuned_decodes(flow, [model], x, y, top, zs, outer=0.5, **kw)
    for i in range(3):
        ref, one = copy.deepcopy(flow), slice(i, i + 1)
        opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.9, 0.9999), eps=1e-8)
        for _ in range(2):
            delta = ref.decode(ref.condition(x[one]), top[one], zs=[z[one] for z in zs])[0]
            loss = adversarial_loss([model], training_point(x[one], delta, 0.2, "linf"), y[one], 5.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.05)
            opt.step()
        with torch.no_grad():
            want = ref.decode(ref.condition(x[one]), top[one], zs=[z[one] for z in zs])[0]
            assert torch.allclose(got[one], want, atol=1e-9), (got[one] - want).abs().max()
            mid = copy.deepcopy(flow)
            for p, q, r in zip(mid.parameters(), flow.parameters(), ref.parameters()):
                p.copy_((q + r) / 2)
            want = mid.decode(mid.condition(x[one]), top[one], zs=[z[one] for z in zs])[0]
            assert torch.allclose(halfway[one], want, atol=1e-9)
    with torch.no_grad():
        before = flow.decode(flow.condition(x), top, zs=zs)[0]
        margins = [margin_loss(model(training_point(x, d, 0.2, "linf")), y).clamp_min(-5) for d in (before, got)]
    assert (margins[1] < margins[0]).all(), margins


def test_finetuning_stops_at_the_margin_floor_of_5():
    """The fine-tuning loss is the margin floored at -5 (utils/finetune.py): a sample whose margin is about -10
    whatever its decode gets no gradient and keeps the meta-trained decode, one at about +10 moves (after one step
    or two)."""
    shape, flow, g, model = _flow_and_linear_model(4, 0.01)
    with torch.no_grad():
        model[1].bias.zero_()
        model[1].bias[1] = 10.0
    x = torch.rand(2, *shape, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1])  # margins about -10 and +10
    top = torch.randn(2, *flow.top, generator=g, dtype=torch.float64)
    zs = [torch.randn(2, *s, generator=g, dtype=torch.float64) for s in flow.split_shapes()]
    got, one = (finetuned_decodes(flow, [model], x, y, top, zs, eps=0.2, norm="linf", steps=steps, lr=1e-2,
                                  clip=0.05, outer=1.0, chunk=2) for steps in (2, 1))
    with torch.no_grad():
        plain = flow.decode(flow.condition(x), top, zs=zs)[0]
        margins = margin_loss(model(training_point(x, plain, 0.2, "linf")), y)
    assert margins[0] < -8 and margins[1] > 8
    assert torch.allclose(got[0], plain[0], atol=1e-12, rtol=0)
    assert (got[1] - plain[1]).abs().max() > 1e-4 and (one[1] - plain[1]).abs().max() > 1e-4  # one step moves too


def test_first_query_is_the_quantized_guess_of_the_cglows_mode(monkeypatch):
    """Without fine-tuning, mcg_init's start is the c-Glow's decode at the top latent 0 and split latents drawn from
    their priors with each sample's normal draws, ``x + eps decode`` clipped to the ball and [0, 1], rounded to the
    uint8 grid (towards x); Square's p schedule starts at ``square_start``."""
    from blackboxbench.context import BlockContext
    from blackboxbench.query import mcg
    from blackboxbench.threat import quantize

    from attack_utils import make_ctx

    torch.manual_seed(0)
    flow = CondGlow((1, 8, 8), **TINY).eval().requires_grad_(False)
    monkeypatch.setattr(mcg, "trained_cglow", lambda *args, **kw: flow)
    cnn = build_model("digits_cnn")
    x = (torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 255).round() / 255

    def ctx():
        c = make_ctx(cnn, x, cnn(x).argmax(1), 0.1, "linf", 100)
        return BlockContext(problem=c.problem, rng=c.rng, oracle=c.oracle, surrogates=(cnn,))

    state = mcg.mcg_init(ctx(), finetune_steps=0, square_start=123, **TINY)
    noise = [ctx().rng.normal(s) for s in flow.split_shapes()]
    with torch.no_grad():
        delta = flow.decode(flow.condition(x), torch.zeros(3, *flow.top), noise=noise)[0]
    want = quantize(torch.minimum(torch.maximum(x + 0.1 * delta, x - 0.1), x + 0.1).clamp(0, 1), x)
    assert torch.equal(state["x_adv"], want) and state["it"].tolist() == [123] * 3
    assert torch.equal(want * 255, (want * 255).round()) and (want - x).abs().max() <= 0.1 + 1e-6

def test_meta_training_loss_sees_max_normalised_decodes(tmp_path, monkeypatch):
    """Stage 2's loss clamps each decode divided by its largest absolute value (the authors' meta-training decode,
    ``decode(return_prob=True)``): the margin train_cglow reports before training is that of
    ``clamp(x + clamp(decode / max|decode|, +-eps), 0, 1)``, recomputed here from the same c-Glow and draws, and
    differs from the raw decode's clamp (CG-Attack's training point). mcg_init asks for it when it meta-trains
    (``epochs`` > 0) and leaves a stage-1-only c-Glow's parameters (its cache key) as they were."""
    from blackboxbench.query import mcg
    from blackboxbench.rng import seeded
    from blackboxbench.runner import run_experiment
    from test_cg_attack import _digits_assets
    from test_engine import _exp

    cnn, data, eps = build_model("digits_cnn"), digits(n=16, split="train"), 0.2
    out = train_cglow([cnn], data.x, data.y, TINY, eps=eps, norm="linf", epochs=0, views=1, lr=1e-2, batch=16,
                      max_grad_norm=10.0, margin=5.0, seed=0, inner_steps=5, max_norm=True)
    with seeded(0):
        flow = CondGlow(data.x.shape[1:], **TINY)
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn((16, *s), generator=g) for s in flow.split_shapes()]
    with torch.no_grad():
        delta = flow.decode(flow.condition(data.x), torch.zeros(16, *flow.top), noise=noise)[0]
        peak = delta.abs().amax(dim=(1, 2, 3), keepdim=True)
        want = adversarial_loss([cnn], (data.x + (delta / peak).clamp(-eps, eps)).clamp(0, 1), data.y, 5.0)
        raw = adversarial_loss([cnn], training_point(data.x, delta, eps, "linf"), data.y, 5.0)
    assert abs(out["margin"][0].item() - want.item()) < 1e-5 and abs(raw - want).item() > 1e-2

    asked = []

    def fake(ctx, data, arch, hp, block):
        asked.append(hp)
        return CondGlow(ctx.problem.x.shape[1:], **arch).eval().requires_grad_(False)

    monkeypatch.setattr(mcg, "trained_cglow", fake)
    for epochs in (1, 0):
        attack = {"recipe": "mcg", "blocks": {"init": {"name": "mcg_init", **TINY, "epochs": epochs, "chunk": 2}}}
        run_experiment(_exp(tmp_path / str(epochs), attack=attack, model="digits_mlp", assets=_digits_assets(16),
                            surrogates=["digits_cnn"], threat={"norm": "linf", "eps": eps, "max_queries": 5},
                            batch_size=2, dataset={"name": "digits", "n": 2}), progress=False)
    assert asked[0]["max_norm"] is True and "max_norm" not in asked[1]
