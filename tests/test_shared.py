"""Shared forwards (``share_forwards``, blackboxbench/shared.py): runs of one config on the same target model take
turns and share its forwards. A round holds one call of every run still going, in run order; a run that ends or
fails leaves, and the others go on."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import blackboxbench.runner as runner_mod
from blackboxbench.cli import main
from blackboxbench.registry import MODEL
from blackboxbench.shared import SharedForward

import test_engine  # noqa: F401  (registers test_digits_mlp_f64, a batch-invariant model)


class Counting(nn.Module):
    """A linear model that logs the batch size of every call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()
        self.sizes = []

    def forward(self, x):
        self.sizes.append(x.shape[0])
        return self.lin(x)


def _jobs(shared, plans, grad_modes=None):
    """One job per member: its calls (batch sizes ``plans[k]``) through its member; returns the jobs and the
    inputs / outputs / grad modes each job saw."""
    seen = [{"in": [], "out": [], "grad": []} for _ in plans]

    def job(k):
        member = shared.member(k)
        g = torch.Generator().manual_seed(k)
        with torch.set_grad_enabled(True if grad_modes is None else grad_modes[k]):
            for size in plans[k]:
                x = torch.randn(size, 3, generator=g, dtype=torch.float64)
                seen[k]["in"].append(x)
                seen[k]["out"].append(member(x))
                seen[k]["grad"].append(torch.is_grad_enabled())
        return k

    return [lambda k=k: job(k) for k in range(len(plans))], seen


def test_rounds_merge_members_in_order():
    plans = [[5, 1, 2], [3, 3], [0, 4, 2, 7]]
    model = Counting()
    shared = SharedForward(model, len(plans), chunk=6)
    jobs, seen = _jobs(shared, plans)
    assert shared.run(jobs) == [(0, None), (1, None), (2, None)]
    for k in range(len(plans)):  # every member got its own rows' answers (to the last bits a batch's BLAS path
        for x, y in zip(seen[k]["in"], seen[k]["out"]):  # may move: a row mix-up is off by O(1))
            assert torch.allclose(y, model.lin(x).detach(), rtol=0, atol=1e-12)
    # rounds: 5+3+0, 1+3+4, 2+2 (member 1 has ended), 7 (member 0 has ended); forwarded in chunks of 6
    assert model.sizes == [6, 2, 6, 2, 4, 6, 1]
    assert shared.rounds == 4 and shared.asks == [3, 2, 4]


def test_each_member_keeps_its_grad_mode():
    """Grad mode is per thread, and the members share one: each resumes with its own."""
    shared = SharedForward(Counting(), 2, chunk=10)
    jobs, seen = _jobs(shared, [[1, 1, 1], [2, 2]], grad_modes=[False, True])
    before = torch.is_grad_enabled()
    shared.run(jobs)
    assert seen[0]["grad"] == [False] * 3 and seen[1]["grad"] == [True] * 2
    assert torch.is_grad_enabled() == before


def test_a_failing_run_leaves_and_the_others_finish():
    shared = SharedForward(Counting(), 2, chunk=10)
    jobs, seen = _jobs(shared, [[1, 1, 1], [2, 2, 2]])

    def failing():
        shared.member(0)(torch.zeros(1, 3, dtype=torch.float64))
        raise ValueError("run 0 broke")

    outcome = shared.run([failing, jobs[1]])
    assert isinstance(outcome[0][1], ValueError) and outcome[1] == (1, None) and len(seen[1]["out"]) == 3


def test_a_failing_forward_reaches_every_member_of_its_round():
    class Broken(Counting):
        def forward(self, x):
            if x.shape[0] > 4:
                raise RuntimeError("boom")
            return super().forward(x)

    shared = SharedForward(Broken(), 2, chunk=100)
    jobs, _ = _jobs(shared, [[1, 3, 1], [1, 3, 1]])
    outcome = shared.run(jobs)
    assert all(r is None and "boom" in str(e) for r, e in outcome)


CONFIG = """
dataset: {name: digits, n: 40}
model: test_digits_mlp_f64
threat: {norm: linf, eps: 0.2, max_queries: 400}
batch_size: 12
device: cpu
seed: 1
output_dir: OUT
runs:
  - attack: square_linf
  - attack: rays
  - attack: simba_dct
  - {attack: square_linf, model: digits_cnn}
"""


def _records(out):
    runs = {}
    for f in sorted(Path(out).glob("*/records.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        for r in rows:
            r.pop("time"), r.pop("check")
        runs[f.parent.name] = sorted(rows, key=lambda r: r["index"])
    return runs


def test_shared_runs_give_the_records_of_separate_runs(tmp_path, monkeypatch):
    """Three runs on the batch-invariant float64 MLP share its forwards (a fourth, on another model, runs alone):
    their records equal those of the same config run one after the other, with fewer model calls."""
    groups = []

    class Recording(SharedForward):
        def __init__(self, *a):
            super().__init__(*a)
            groups.append(self)

    monkeypatch.setattr(runner_mod, "SharedForward", Recording)
    paths = {}
    for mode in ("seq", "share"):
        paths[mode] = tmp_path / mode
        cfg = tmp_path / f"{mode}.yaml"
        cfg.write_text(CONFIG.replace("OUT", str(paths[mode])) + ("share_forwards: true\n" if mode == "share" else ""))
        assert main(["run", str(cfg), "--quiet"]) == 0
    seq, share = _records(paths["seq"]), _records(paths["share"])
    shared_with = {f.parent.name: json.loads(f.read_text())["shared_forwards"]
                   for f in paths["share"].glob("*/summary.json")}
    assert sorted(shared_with.values(), key=str) == [3, 3, 3, None]  # the digits_cnn run went alone
    assert len(seq) == 4 and seq == share
    assert len(groups) == 1 and len(groups[0].asks) == 3  # one group: the MLP's three runs
    g = groups[0]  # a round per call of the run that asks most (every round waits for it), not of every run
    assert g.rounds == max(g.asks) and g.calls == g.rounds and g.rounds < 0.6 * sum(g.asks)


def test_share_forwards_is_a_checked_config_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(tmp_path / "o")) + "share_forwards: yes please\n")
    assert main(["run", str(cfg), "--quiet"]) == 2
    assert "share_forwards" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["flag", "key", "neither"])
def test_cli_flag_and_key_agree(tmp_path, monkeypatch, how):
    """``--share-forwards`` on the command line does what the config key does; without either, no group."""
    groups = []
    monkeypatch.setattr(runner_mod, "SharedForward", lambda *a: groups.append(SharedForward(*a)) or groups[-1])
    cfg, out = tmp_path / "c.yaml", tmp_path / "o"
    cfg.write_text(CONFIG.replace("OUT", str(out)).replace("n: 40", "n: 12")
                   + ("share_forwards: true\n" if how == "key" else ""))
    assert main(["run", str(cfg), "--quiet"] + (["--share-forwards"] if how == "flag" else [])) == 0
    assert len(_records(out)) == 4 and len(groups) == (0 if how == "neither" else 1)


def test_without_greenlet_a_group_is_a_clear_error(monkeypatch):
    import blackboxbench.shared as shared_mod
    from blackboxbench.errors import BenchError

    monkeypatch.setattr(shared_mod, "greenlet", None)
    with pytest.raises(BenchError, match="pip install greenlet"):
        SharedForward(Counting(), 1, chunk=4).run([lambda: None])


@MODEL.register("test_pooled_cnn", dataset="digits")
def pooled_cnn(data_root=None):
    """A grayscale CNN that takes any image size (adaptive pooling): one model object for two datasets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(32, 10)).eval()


def test_runs_on_images_of_another_shape_form_their_own_group(tmp_path, monkeypatch, data_root):
    """The same model object on 8x8 digits and 28x28 MNIST: two groups (a round's images share one tensor)."""
    groups = []
    monkeypatch.setattr(runner_mod, "SharedForward", lambda *a: groups.append(SharedForward(*a)) or groups[-1])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
model: test_pooled_cnn
data_root: {data_root}
threat: {{norm: linf, eps: 0.2, max_queries: 50}}
device: cpu
output_dir: {tmp_path / "o"}
share_forwards: true
runs:
  - {{attack: square_linf, dataset: {{name: digits, n: 6}}}}
  - {{attack: rays, dataset: {{name: digits, n: 6}}}}
  - {{attack: square_linf, dataset: {{name: mnist, n: 6}}}}
  - {{attack: rays, dataset: {{name: mnist, n: 6}}}}
""")
    assert main(["run", str(cfg), "--quiet"]) == 0
    assert len(groups) == 2 and all(len(g.asks) == 2 for g in groups)


def test_runs_of_a_family_without_shared_key_run_alone(tmp_path, monkeypatch):
    """Transfer runs with one target each do not share it: the family declares no ``shared_key`` (its worker does
    more with its targets than a query run's oracle does)."""
    groups = []
    monkeypatch.setattr(runner_mod, "SharedForward", lambda *a: groups.append(SharedForward(*a)) or groups[-1])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
dataset: {{name: digits, n: 6}}
surrogates: [digits_cnn]
targets: [digits_mlp]
threat: {{norm: linf, eps: 0.2}}
device: cpu
output_dir: {tmp_path / "o"}
share_forwards: true
runs:
  - {{attack: {{recipe: i_fgsm, hyper: {{iterations: 2}}}}}}
  - {{attack: {{recipe: mi_fgsm, hyper: {{iterations: 2}}}}}}
""")
    assert main(["run", str(cfg), "--quiet"]) == 0
    assert not groups and len(list((tmp_path / "o").glob("*/summary.json"))) == 2


def test_the_audit_forwards_on_the_shared_model_itself():
    """A run's audit (``family.audit_logits``) calls the shared model directly: through the group its calls of one
    image would each wait for a round and be merged with the other runs' inputs, which on a GPU move its answers.
    Called outside a group's job, a member would have no group to hand its input to."""
    from blackboxbench.family import audit_logits

    model = nn.Linear(4, 3)
    shared = SharedForward(model, 2, 256)
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(audit_logits(shared.member(1), x, "m", 1), torch.cat([model(v[None]) for v in x]))
    assert shared.asks == [0, 0] and shared.rounds == 0


def test_a_defended_evaluation_forwards_on_the_shared_model_itself():
    """A defended run's evaluations (its clean accuracy under the defense, its re-evaluation of the returned image)
    go through ``audit_logits`` too: on the shared model itself, never through the group's rounds."""
    from blackboxbench.defense import EVAL_SALT, DefendedTarget, build_defenses, defense_streams

    model = nn.Linear(4, 3)
    shared = SharedForward(model, 2, 256)
    x = torch.randint(0, 256, (5, 4)) / 255  # on the uint8 grid: AAA's input quantization keeps it
    streams = defense_streams(0, 5, torch.device("cpu"), EVAL_SALT)
    evaluator = DefendedTarget(shared.member(1), build_defenses([{"name": "aaa_linear", "iterations": 0}]), streams,
                               size=1)
    with torch.no_grad():
        assert torch.equal(evaluator(x, torch.arange(5)), torch.cat([model(v[None]) for v in x]))
    assert shared.asks == [0, 0] and shared.rounds == 0


def test_run_all_raises_a_grouped_runs_error_after_the_others_finish():
    """A run of a share group that fails lets the others of its group finish (each ``done``) and its error is
    raised by ``run_all`` at the end, never swallowed (the config would exit 0 with a run missing)."""
    from types import SimpleNamespace

    model = Counting()

    class Fake:
        device = torch.device("cpu")

        def __init__(self, k, fail):
            self.k, self.fail = k, fail

        def inputs(self):
            return SimpleNamespace(models={"model": [model]}, data=SimpleNamespace(x=torch.zeros(2, 3)))

        def shared_model(self, inp):
            return "model", inp.models["model"][0]

        def run(self, inp):
            inp.models["model"][0](torch.zeros(1, 3, dtype=torch.float64))
            if self.fail:
                raise ValueError(f"run {self.k} broke")
            return {"run": self.k}

    runners = [Fake(0, False), Fake(1, True), Fake(2, False)]
    done = []
    with pytest.raises(ValueError, match="run 1 broke"):
        runner_mod.run_all(runners, session=None, share=True, done=lambda r: done.append(r.k))
    assert done == [0, 2] and model.sizes == [3]  # one round of the three runs, the two others finished
