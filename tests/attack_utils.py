"""Helpers shared by the attack test files: build a recipe with the real builder, run a query attack through
an oracle, and check the threat model on what an attack returns."""
import torch

from blackboxbench.builder import build_attack, load_recipe
from blackboxbench.oracle import Oracle
from blackboxbench.registry import DATASET
from blackboxbench.threat import Problem, dist

FEEDBACK = {"score": "score", "decision": "label"}


def build(name, norm="linf", targeted=False, eps=1.0, iterations=None):
    """The recipe ``name`` built by the library's builder for this setting (transfer: optional iterations)."""
    recipe, source = load_recipe({"recipe": name, "hyper": {"iterations": iterations}} if iterations else name,
                                 "tests")
    return build_attack(recipe, {"norm": norm, "targeted": targeted, "eps": eps}, source)


def run_query(name, model, x, y, eps, norm, budget, target=None, seed=0, num_classes=10):
    """Run a query recipe through a fresh oracle; returns ``(problem, result)``."""
    attack = build(name, norm, target is not None, eps)
    problem = Problem(x=x, y=y, eps=eps, norm=norm, target=target, num_classes=num_classes)
    oracle = Oracle(model, n=len(x), max_queries=budget, num_classes=num_classes,
                    feedback=FEEDBACK[attack.family], input_shape=x.shape[1:])
    return problem, attack.run(problem, oracle, torch.Generator().manual_seed(seed))


def check_output(x_adv, x, eps, norm):
    """On the uint8 grid, inside [0, 1] and inside the eps ball."""
    q = x_adv * 255
    assert torch.equal(q, q.round()), "output is not on the uint8 grid"
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    d = dist(x_adv, x, norm)
    assert (d <= eps + 1e-5).all(), f"max {norm} distance {d.max():.5f} > eps {eps}"


def check_outputs(problem, res, model, budget):
    """Threat model of a query result, within budget, and every claimed success really adversarial."""
    check_output(res.x_adv, problem.x, problem.eps, problem.norm)
    assert (res.queries <= budget).all()
    with torch.no_grad():
        pred = model(res.x_adv).argmax(1)
    assert problem.is_adv_label(pred)[res.success].all()


def correctly_classified(models, data_root, n, pool):
    """The first ``n`` of the first ``pool`` CIFAR-10 test images that every model classifies correctly."""
    ds = DATASET.get("cifar10")(data_root, n=pool)
    with torch.no_grad():
        ok = torch.stack([m(ds.x).argmax(1) == ds.y for m in models]).all(0)
    idx = ok.nonzero().squeeze(1)[:n]
    return ds.x[idx], ds.y[idx]
