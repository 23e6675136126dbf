"""Batch invariance over every recipe of the catalog (a new recipe is checked automatically): a sample's record
depends only on the seed, its index and the config, not on the batch size or on its neighbours.

Every case of the contract (tests/test_contract.py: each classification recipe at each of its norms, untargeted
and, where the recipe supports it, targeted, here with random target labels; the transfer blocks no recipe uses,
composed onto I-FGSM; detection recipes: tests/test_detection_attacks.py) runs on 7 digits at batch_size 1 and
at batch_size 5 (continuous batching refills the slots as samples finish, so a sample meets other neighbours in
other slots, and the batches shrink at the end), with a small budget (300 queries, 3 transfer iterations), and
the two runs' records must be identical. The two runs start from different global random states (torch, numpy,
Python's ``random``), so a block drawing from them instead of its samples' streams fails too. The experiments are the contract's (surrogates, assets, reduced blocks)
with their digits models swapped for float64 copies, whose forwards are batch-invariant on CPU (a row's logits
do not depend on the rows computed with it), so that a difference is the attack's."""
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from blackboxbench.config import validate_experiment
from blackboxbench.prep.models import _digits_model
from blackboxbench.registry import MODEL
from blackboxbench.runner import run_experiment

import test_contract as contract
from test_engine import digits_mlp_f64
from test_score_surrogate import digits_cnn_f64  # the digits CNN in float64 (registered there, once)


@MODEL.register("test_digits_resnet_f64", dataset="digits")
def digits_resnet_f64(data_root=None):
    """The residual digits net in float64 (batch-invariant on CPU): the surrogate of the recipes whose blocks
    declare ``surrogate="residual"`` (SGM, IAA)."""
    return _digits_model("digits_resnet", True).double()


F64 = {name: fn.registry_meta["name"] for name, fn in (("digits_mlp", digits_mlp_f64), ("digits_cnn", digits_cnn_f64),
                                                        ("digits_resnet", digits_resnet_f64))}
N, BATCH_SIZES = 7, (1, 5)  # 7 samples in 5 slots: the slots refill as samples finish
QUERY_BUDGET = 300
TRANSFER_ITERATIONS = 3
TRAIN_IMAGES = 200  # learned assets (priors, flows, fine-tuned surrogates) train on the first 200 train digits
# Fields that legitimately differ with the batch size, left out of the comparison: ``time`` (wall time: a query
# sample's own, a transfer sample's share of its batch's) and ``check`` (the record's checksum, over ``time`` and
# the run's config hash, which hashes batch_size).
BATCH_DEPENDENT = ("time", "check")

# the contract's cases: every recipe but detection's, every norm it declares, untargeted and (where the recipe
# supports it) targeted, and the transfer blocks no recipe uses composed onto I-FGSM (e.g. i_fgsm+cw)
CASES = contract.CASES


def _experiment(tmp_path, name, norm, targeted, batch_size, blocks=None, **extra):
    """The contract's experiment of a case on ``N`` digits and the float64 models, at ``batch_size``; ``extra``:
    more experiment keys (e.g. ``fixed_batch``)."""
    family, exp = contract._raw_experiment(name, norm, targeted, tmp_path / f"bs{batch_size}", blocks)
    exp.update(extra)
    exp["dataset"] = {"name": "digits", "n": N}
    exp["batch_size"] = batch_size
    for key in ("model", "surrogates", "targets"):
        if key in exp:
            exp[key] = [F64[m] for m in exp[key]] if isinstance(exp[key], list) else F64[exp[key]]
    threat = exp["threat"]
    if targeted:
        threat["target_label"] = "random"
    exp["assets"] = contract._train_assets(name.split("+")[0], n=TRAIN_IMAGES)  # both runs load the same
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


@pytest.mark.parametrize("name,norm,targeted,blocks", CASES,
                         ids=[f"{n}-{m}-{'t' if t else 'u'}" for n, m, t, _ in CASES])
def test_records_do_not_depend_on_the_batch_size(tmp_path, name, norm, targeted, blocks):
    runs = []
    for k, bs in enumerate(BATCH_SIZES):
        torch.manual_seed(1000 + k), np.random.seed(1000 + k), random.seed(1000 + k)  # the global states differ
        run_dir, _ = run_experiment(_experiment(tmp_path, name, norm, targeted, bs, blocks), progress=False)
        runs.append(_records(run_dir))
    assert len(runs[0]) == N
    assert runs[0] == runs[1]
    assert any(r["attacked"] for r in runs[0])
