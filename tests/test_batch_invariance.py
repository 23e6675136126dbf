"""Batch invariance over every recipe of the catalog (a new recipe is checked automatically): a sample's record
depends only on the seed, its index and the config, not on the batch size or on its neighbours.

Each classification recipe (detection recipes excepted: tests/test_detection_attacks.py) runs on 7 digits at
batch_size 1 and at batch_size 5 (continuous batching refills the slots as samples finish, so a sample meets
different neighbours in different slots), untargeted and, where the recipe supports it, targeted with random
target labels, on float64 models whose forwards are batch-invariant on CPU (each row's logits do not depend on
the rows computed with it), with a small budget; the two runs' records must be identical.
The experiments are the contract's (tests/test_contract.py: norms, surrogates, assets, reduced blocks), with
smaller budgets and the models swapped for their float64 copies."""
import json
from pathlib import Path

import pytest

from blackboxbench.config import load_yaml, validate_experiment
from blackboxbench.prep.models import _digits_model
from blackboxbench.registry import MODEL
from blackboxbench.runner import run_experiment

import test_contract as contract
import test_engine  # noqa: F401  (registers test_digits_mlp_f64)


@MODEL.register("test_digits_cnn_f64", dataset="digits")
def digits_cnn_f64(data_root=None):
    """The digits CNN in float64 (batch-invariant on CPU): the transfer runs' surrogate and a target."""
    return _digits_model("digits_cnn", True).double()


@MODEL.register("test_digits_resnet_f64", dataset="digits")
def digits_resnet_f64(data_root=None):
    """The residual digits net in float64 (batch-invariant on CPU): the surrogate of the recipes whose blocks
    declare ``surrogate="residual"`` (SGM, IAA, LinBP, GhostNet's skip erosion)."""
    return _digits_model("digits_resnet", True).double()


F64 = {"digits_mlp": "test_digits_mlp_f64", "digits_cnn": "test_digits_cnn_f64",
       "digits_resnet": "test_digits_resnet_f64"}
N, BATCH_SIZES = 7, (1, 5)  # 7 samples in 5 slots: the slots refill as samples finish
QUERY_BUDGET = 300
TRANSFER_ITERATIONS = 3
# Fields that may legitimately differ with the batch size: ``time`` (a sample's share of its batches' wall time)
# and ``check`` (the runner's timing of its verification forward).
BATCH_DEPENDENT = ("time", "check")

CASES = [(name, norm, targeted) for name, norm, targeted, blocks in contract.CASES if blocks is None]


def _case_id(name, norm, targeted):
    return f"{name}-{norm}-{'t' if targeted else 'u'}"


def _experiment(tmp_path, name, norm, targeted, batch_size):
    family, exp = contract._raw_experiment(name, norm, targeted, tmp_path / f"bs{batch_size}")
    exp["dataset"] = {"name": "digits", "n": N}
    exp["batch_size"] = batch_size
    for key in ("model", "surrogates", "targets"):
        if key in exp:
            exp[key] = [F64[m] for m in exp[key]] if isinstance(exp[key], list) else F64[exp[key]]
    threat = exp["threat"]
    if targeted:
        threat["target_label"] = "random"
    if family == "transfer":
        exp["attack"]["hyper"]["iterations"] = TRANSFER_ITERATIONS
    else:
        threat["max_queries"] = QUERY_BUDGET
    exp = validate_experiment(exp, "batch-invariance")
    exp.update(_source="batch-invariance", _base_dir=".")
    return exp


def _records(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]
    for r in rows:
        for k in BATCH_DEPENDENT:
            r.pop(k, None)
    return sorted(rows, key=lambda r: r["index"])


@pytest.mark.parametrize("name,norm,targeted", CASES, ids=[_case_id(*c) for c in CASES])
def test_records_do_not_depend_on_the_batch_size(tmp_path, name, norm, targeted):
    runs = []
    for bs in BATCH_SIZES:
        run_dir, _ = run_experiment(_experiment(tmp_path, name, norm, targeted, bs), progress=False)
        runs.append(_records(run_dir))
    assert len(runs[0]) == N
    assert runs[0] == runs[1]
