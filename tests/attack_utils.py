"""Helpers shared by the attack test files: build a recipe with the real builder, run a query attack through the
real worker (oracle, continuous batching, verification), and check the threat model on what it returns."""
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from blackboxbench.builder import build_attack, load_recipe, recipe_family
from blackboxbench.config import finish_threat
from blackboxbench.registry import DATASET
from blackboxbench.runner import run_tensors
from blackboxbench.threat import Problem, dist


def build(name, norm="linf", targeted=False, eps=1.0, iterations=None, hyper=None, blocks=None, **threat):
    """The recipe ``name`` built by the library's builder for this setting (transfer: optional iterations and
    other ``hyper`` overrides; ``blocks``: block parameter overrides, as a config's). Returns ``(attack, threat)``."""
    hyper = {**({"iterations": iterations} if iterations else {}), **(hyper or {})}
    over = {**({"hyper": hyper} if hyper else {}), **({"blocks": blocks} if blocks else {})}
    recipe, source = load_recipe({"recipe": name, **over} if over else name, "tests")
    t = {"norm": norm, "targeted": targeted, "eps": eps, **threat}
    if targeted:
        t["target_label"] = "specified"
    t = finish_threat(t, recipe, recipe_family(recipe, source), source)
    return build_attack(recipe, t, source), t


@dataclass
class Result:
    x_adv: torch.Tensor      # (n, C, H, W): the returned images (the clean image where not attacked)
    success: torch.Tensor    # (n,) bool: the oracle confirmed the returned image
    queries: torch.Tensor    # (n,) long
    attacked: torch.Tensor   # (n,) bool
    stalled: torch.Tensor    # (n,) bool
    records: list


def run_query(name, model, x, y, eps, norm, budget, target=None, seed=0, num_classes=10, slots=None, blocks=None,
              **threat):
    """Run a query recipe on ``x`` through the real worker; returns ``(problem, result)``."""
    attack, t = build(name, norm, target is not None, eps, blocks=blocks, max_queries=max(budget, 1), **threat)
    t["max_queries"] = budget  # a budget of 0 (configs need >= 1) checks that nothing is asked at all
    records = run_tensors(attack, t, x, y, {"model": [model]}, seed=seed, slots=slots, given_target=target,
                          num_classes=num_classes)
    problem = Problem(x=x, y=y, eps=eps, norm=norm, target=target, num_classes=num_classes)
    return problem, to_result(records, x)


def to_result(records, x):
    col = lambda k: torch.tensor([bool(r[k]) if isinstance(r[k], bool) else r[k] for r in records])  # noqa: E731
    x_adv = torch.stack([r.get("x_adv", x[r["index"]]) for r in records])
    return Result(x_adv, col("success"), col("queries").long(), col("attacked"), col("stalled"), records)


def check_output(x_adv, x, eps, norm):
    """On the uint8 grid, inside [0, 1] and inside the eps ball."""
    q = x_adv * 255
    assert torch.equal(q, q.round()), "output is not on the uint8 grid"
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    d = dist(x_adv, x, norm)
    assert (d <= eps + 1e-5).all(), f"max {norm} distance {d.max():.5f} > eps {eps}"


def check_outputs(problem, res, model, budget):
    """Threat model of a query result, within budget, and every recorded success really adversarial, each image
    checked alone (an independent forward at batch size 1)."""
    check_output(res.x_adv, problem.x, problem.eps, problem.norm)
    assert (res.queries <= budget).all()
    with torch.no_grad():
        pred = torch.cat([model(res.x_adv[i:i + 1]).argmax(1) for i in range(len(res.x_adv))])
    assert problem.is_adv_label(pred)[res.success].all()


def correctly_classified(models, data_root, n, pool):
    """The first ``n`` of the first ``pool`` CIFAR-10 test images that every model classifies correctly."""
    ds = DATASET.get("cifar10")(data_root, n=pool)
    with torch.no_grad():
        ok = torch.stack([m(ds.x).argmax(1) == ds.y for m in models]).all(0)
    idx = ok.nonzero().squeeze(1)[:n]
    return ds.x[idx], ds.y[idx]


def resnet20_images(data_root, n, pool):
    """(ResNet-20, x, y): the pretrained CIFAR-10 ResNet-20 and the first ``n`` of the first ``pool`` test images it
    classifies correctly."""
    from blackboxbench.prep.models import build_model

    model = build_model("cifar_resnet20", data_root)
    return (model, *correctly_classified([model], data_root, n=n, pool=pool))


def hyperplane_toy(g, n=4, w=None):
    """``n`` images of shape (3, 8, 8) near 0.5 on the uint8 grid and the two-class :class:`Linear2` whose hyperplane
    ``w . (x - 0.5) = t`` lies beyond every image, at Linf distance >= 0.02 (``t`` = max score + 0.02 |w|_1).
    ``w(g)`` (flat or image-shaped) is drawn after the images (default: Gaussian). Returns the model, the
    images, labels 0 and each image's score gap ``t - w . (x - 0.5)``, from which the distances follow."""
    x = torch.round((0.5 + 0.1 * (torch.rand(n, 3, 8, 8, generator=g) - 0.5)) * 255) / 255
    w = torch.randn(3 * 8 * 8, generator=g) if w is None else w(g)
    s = (x - 0.5).flatten(1) @ w.flatten()
    t = s.max().item() + 0.02 * w.abs().sum().item()
    return Linear2(w, t), x, torch.zeros(n, dtype=torch.long), t - s


def make_ctx(model, x, y, eps, norm, budget, feedback="score", target=None, seed=0, num_classes=10, pool=None):
    """A block context over ``x`` (samples 0..n-1) with a fresh oracle and fresh random streams, for calling
    blocks and helpers directly."""
    from blackboxbench.context import BlockContext
    from blackboxbench.oracle import Oracle
    from blackboxbench.rng import Streams

    n = len(x)
    everyone = torch.arange(n)
    oracle = Oracle(model, n=n, max_queries=budget, num_classes=num_classes, feedback=feedback,
                    input_shape=x.shape[1:])
    problem = Problem(x=x, y=y, eps=eps, norm=norm, target=target, num_classes=num_classes)
    return BlockContext(problem=problem, rng=Streams(seed, n, x.device).view(everyone), oracle=oracle.view(everyone),
                        pool=pool)


def transfer_ctx(x, y, eps=1.0, norm="linf", target=None, model=None, alpha=0.0, seed=0, iterations=0):
    """A transfer-block context over ``x`` (samples 0..n-1) with fresh random streams."""
    from blackboxbench.context import BlockContext
    from blackboxbench.rng import Streams

    problem = Problem(x=x, y=y, eps=eps, norm=norm, target=target, num_classes=10)
    return BlockContext(problem=problem, rng=Streams(seed, len(x), x.device).view(torch.arange(len(x))), model=model,
                        alpha=alpha, iterations=iterations)


def refine_ctx(seed=0):
    """The run-level context the refine blocks get."""
    from blackboxbench.context import BlockContext
    from blackboxbench.rng import run_stream

    return BlockContext(problem=None, rng=run_stream(seed, "cpu", 1))


def returned_images(run_dir, records, x):
    """A run's returned uint8 images (``adv/<index>.png``, ``save_adv: true``) as floats; the clean image where a
    record was not attacked."""
    import numpy as np
    from PIL import Image

    out = x.clone()
    for r in records:
        if r["attacked"]:
            img = np.array(Image.open(Path(run_dir) / "adv" / f"{r['index']:06d}.png"))
            out[r["index"]] = torch.from_numpy(img).float().div(255).reshape(out.shape[1:])
    return out


class Jitter(nn.Module):
    """Logits that move by a relative ``rel``, differently for each batch size (a CPU proxy of TF32 and of GPU
    kernels chosen per batch shape)."""

    def __init__(self, model, rel=1e-3):
        super().__init__()
        self.model, self.rel, self.factors = model, rel, {}

    def forward(self, x):
        out = self.model(x)
        m = x.shape[0]
        if m not in self.factors:
            g = torch.Generator().manual_seed(1000 + m)
            self.factors[m] = 1 + (torch.rand(out.shape[1], generator=g) * 2 - 1) * self.rel
        return out * self.factors[m].to(out)


class Linear(nn.Module):
    """A linear classifier ``x.flatten(1) @ w.T + b`` (frozen): known gradients and boundaries for unit tests."""

    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False)

    def forward(self, x):
        return x.flatten(1) @ self.w.T + self.b


class Linear2(nn.Module):
    """Two classes: label 1 iff w . (x - 0.5) > t (a known hyperplane)."""

    def __init__(self, w, t=0.0):
        super().__init__()
        self.w, self.t = nn.Parameter(w.flatten(), requires_grad=False), t

    def forward(self, x):
        s = (x - 0.5).flatten(1) @ self.w - self.t
        return torch.stack([torch.zeros_like(s), s], 1)


def spy_lrs(monkeypatch, optimizer):
    """A list that gets the learning rate of the first parameter group at every ``optimizer.step`` (a class)."""
    lrs, step = [], optimizer.step

    def spy(self, *args, **kwargs):
        lrs.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(optimizer, "step", spy)
    return lrs


def count_calls(calls, name, fn):
    """``fn`` wrapped to add one to ``calls[name]`` at every call (for monkeypatching a training or cache step)."""
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper
