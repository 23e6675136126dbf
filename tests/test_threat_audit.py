"""Threat-model audit: ways an attack block or a config could reach past the oracle's count, its answers or the
surrogate-is-not-the-target rule without touching a private attribute."""
import pytest
import torch
from torch import nn

from blackboxbench.cli import main
from blackboxbench.errors import QueryError
from blackboxbench.oracle import Oracle
from blackboxbench.prep.models import build_model


class Counting(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen, self.scale = 0, scale

    def forward(self, x):
        self.seen += x.shape[0]
        if self.scale != 1.0:
            x.mul_(self.scale)  # a careless plugin model that writes to the images it is given
        return self.lin(x.flatten(1))


def test_confirm_with_a_repeated_sample_cannot_pass_the_budget():
    """confirm() is one image per sample: rows of one sample repeated used to be charged without the budget check
    of each row (5 forwards on a budget of 3)."""
    model = Counting()
    oracle = Oracle(model, n=2, max_queries=3, num_classes=3)
    view = oracle.view(torch.tensor([0, 1]))
    with pytest.raises(QueryError, match="distinct"):
        view.confirm(torch.rand(5, 1, 2, 2), torch.zeros(5, dtype=torch.long))
    assert oracle.counts.tolist() == [0, 0] and model.seen == 0
    _, ok = view.confirm(torch.rand(2, 1, 2, 2), torch.tensor([1, 0]))  # distinct rows still work
    assert ok.all() and oracle.counts.tolist() == [1, 1]


def test_confirm_does_not_reuse_an_answer_of_a_randomized_model():
    """A randomized target model (no defense) confirms with a fresh, counted draw, as behind a randomized defense:
    the remembered answer is the draw the attack selected the image on."""
    x = torch.rand(2, 1, 2, 2)
    for randomized, seen, counts in ((False, 2, [1, 1]), (True, 4, [2, 2])):
        model = Counting()
        oracle = Oracle(model, n=2, max_queries=5, num_classes=3, randomized=randomized)
        oracle(x)
        _, ok = oracle.confirm(x.clone())
        assert ok.all() and model.seen == seen and oracle.counts.tolist() == counts


def test_the_query_worker_tells_the_oracle_its_target_is_randomized(tmp_path, monkeypatch):
    import blackboxbench.query.pipeline as pipeline
    from blackboxbench.runner import run_experiment
    from test_engine import _exp

    made = []

    class Spy(Oracle):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self.randomized)

    monkeypatch.setattr(pipeline, "Oracle", Spy)
    threat = {"norm": "linf", "eps": 0.1, "max_queries": 4}
    for model, randomized in (("test_noisy_digits_mlp", True), ("digits_mlp", False)):
        exp = _exp(tmp_path / model, attack="square_linf", model=model, threat=threat,
                   dataset={"name": "digits", "n": 2})
        run_experiment(exp, progress=False)
        assert made[-1] is randomized
    # the in-memory API (run_tensors) tells it too
    from blackboxbench.builder import build_attack, load_recipe
    from blackboxbench.config import finish_threat
    from blackboxbench.prep.data import digits
    from blackboxbench.prep.models import build_model
    from blackboxbench.registry import FAMILY
    from blackboxbench.runner import run_tensors

    recipe, src = load_recipe("square_linf", "test")
    t = finish_threat(threat, recipe, FAMILY.get("score"), "test")
    data = digits(None, n=2)
    for model, randomized in (("test_noisy_digits_mlp", True), ("digits_mlp", False)):
        run_tensors(build_attack(recipe, t, src), t, data.x, data.y, {"model": [build_model(model)]})
        assert made[-1] is randomized


def test_a_model_that_writes_to_its_input_is_not_remembered_for_confirm():
    """The oracle's remembered image must be the one forwarded: a model scribbling on its input would otherwise let
    confirm() credit the scribbled image, which no query asked, with the answer of another."""
    model = Counting(scale=0.5)
    oracle = Oracle(model, n=1, max_queries=10, num_classes=3)
    x = torch.rand(1, 1, 2, 2)
    oracle(x)
    oracle.confirm(x * 0.5)
    assert model.seen == 2 and oracle.counts.tolist() == [2]


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    state = build_model("digits_mlp").state_dict()
    torch.save(state, d / "mlp.pt")
    torch.save(state, d / "mlp_copy.pt")
    (d / "mlp_link.pt").symlink_to(d / "mlp.pt")
    torch.save({k: v for k, v in state.items() if k.startswith("net.")}, d / "tensors.pt")
    return d


SAME_WEIGHTS = {
    "checkpoint of the registry model": ("digits_mlp", "surrogates: [{name: checkpoint, path: D/mlp.pt, "
                                         "arch: digits_mlp}]", "surrogates[0]"),
    "a copy of the target's file": ("{name: checkpoint, path: D/mlp.pt, arch: digits_mlp}",
                                    "surrogates: [digits_cnn, {name: checkpoint, path: D/mlp_copy.pt, "
                                    "arch: digits_mlp}]", "surrogates[1]"),
    "a link to the target's file": ("{name: checkpoint, path: D/mlp.pt, arch: digits_mlp}",
                                    "surrogates: [{name: checkpoint, path: D/mlp_link.pt, arch: digits_mlp, "
                                    "label: s}]", "surrogates[0]"),
    "a model asset": ("digits_mlp", "assets: {prior: {name: model, spec: digits_mlp}}", "assets.prior"),
    "a tensors asset": ("digits_mlp", "assets: {w: {name: tensors, path: D/tensors.pt}}", "assets.w"),
}


@pytest.mark.parametrize("case", list(SAME_WEIGHTS))
def test_a_white_box_model_with_the_targets_weights_is_refused(tmp_path, capsys, mlp_files, case):
    """The spec check compares specs; the same weights under another spec (a checkpoint path, a copy or a link of
    the file, an asset) are refused by their weights, before anything is created."""
    target, extra, key = SAME_WEIGHTS[case]
    cfg = tmp_path / "same.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 2}}\nmodel: {target}\n{extra}\nattack: square_linf\n"
                   f"threat: {{max_queries: 3}}\noutput_dir: {tmp_path / 'never'}\n".replace("D/", f"{mlp_files}/"))
    assert main(["run", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"same.yaml:{key}: " in err and "holds the weights of the target model" in err and "\n" not in err
    assert not (tmp_path / "never").exists()


def test_another_model_with_some_equal_tensors_is_accepted(tmp_path, mlp_files):
    """Only a model holding every weight of the target is refused: a surrogate sharing one tensor is another model."""
    from blackboxbench.runner import held_weights

    target = build_model("digits_mlp")
    other = build_model({"name": "digits_mlp", "pretrained": False})
    with torch.no_grad():
        next(other.parameters()).copy_(next(target.parameters()))
    assert held_weights(target) - held_weights(other)
    assert not held_weights(target) - held_weights(target)
    assert not held_weights(object())  # nothing to compare (a model without parameters): never refused
