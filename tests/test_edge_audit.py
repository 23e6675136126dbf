"""Valid inputs at the edges, over every recipe of the catalog (a new recipe is checked automatically): budgets of
1, 2 and 3 queries (below many attacks' initialisation cost) and one that is no multiple of a population; one
sample, more slots than samples, one slot; samples misclassified clean and a dataset of nothing but them; every
registered target-label mode; eps of one uint8 level, below half a level (a one-line config error) and the largest
ball; constant images (all zeros, all ones) on the 1-channel digits; transfer attacks at one iteration and the
smallest eps; detection attacks on an image without ground-truth boxes or detections.

Every run must end without a traceback, and its records and summary must agree: the runner's own output check
(eps ball, [0, 1], uint8 grid) passes, each record's distance is inside the ball, a query sample's count is a
non-negative integer never above its budget (a success confirmed by at least one counted query), a sample not
attacked has no queries, no success and no distance, and the summary's counts are the records'. The query
experiments are the contract's (tests/test_contract.py: its models, surrogates, assets and reduced blocks) on a few
digits with a small budget."""
import functools
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blackboxbench.config import ConfigError, load_yaml, validate_experiment
from blackboxbench.prep.data import Dataset, digits
from blackboxbench.registry import DATASET, DET_CRAFT, MODEL, TARGET_LABEL, block_params
from blackboxbench.runner import run_experiment

import test_contract as contract

RECIPES = contract.RECIPES
FAMILY_OF = {name: load_yaml(path)["family"] for name, path in RECIPES.items()}
QUERY = [n for n, f in FAMILY_OF.items() if f in ("score", "decision")]
TRANSFER = [n for n, f in FAMILY_OF.items() if f == "transfer"]
DETECTION = [n for n, f in FAMILY_OF.items() if f == "detection"]
TARGETED = {n for n in RECIPES if load_yaml(RECIPES[n])["targeted"]}
NORMS = {n: load_yaml(RECIPES[n])["norms"] for n in RECIPES}
LARGEST = {"linf": 1.0, "l2": 100.0}  # the whole [0, 1] cube (L2: 8 x 8 digits are at most 8 apart)
TRAIN_IMAGES = 32  # learned assets (priors, flows, fine-tuned surrogates) train on the first 32 train digits


@DATASET.register("test_edge_digits", source="test")
def edge_digits(data_root=None, *, n=None, pick=None, fill=None, labels=None):
    """The digits test images ``pick`` (default: the first ``n``), or with ``fill`` (a list) one constant image per
    value; ``labels`` replaces their labels."""
    d = digits(data_root)
    x, y = (d.x[pick], d.y[pick]) if pick is not None else (d.x[:n], d.y[:n])
    if fill is not None:
        x = torch.tensor(fill, dtype=x.dtype).view(-1, 1, 1, 1).expand(-1, *x.shape[1:]).contiguous()
    if labels is not None:
        y = torch.tensor(labels, dtype=torch.long)
    return Dataset("test_edge_digits", x, y, 10)


@functools.lru_cache(maxsize=None)
def _model(name):
    return MODEL.get(name)()


def _predict(model, x):
    m = _model(model)  # trained on first use: outside no_grad
    with torch.no_grad():
        return m(x).argmax(1)


@functools.lru_cache(maxsize=None)
def _misclassified(model, k):
    """The first ``k`` digits test images ``model`` classifies wrongly."""
    d = digits(None)
    return (_predict(model, d.x) != d.y).nonzero().squeeze(1)[:k].tolist()


def _run(tmp_path, name, norm="linf", targeted=False, *, data=None, budget=None, eps=None, slots=None,
         target_label=None, iterations=None, tag="run"):
    """Run the contract's experiment of ``name`` on ``data`` (a dataset spec; default the first 3 digits) with these
    edge settings; returns ``(experiment, records, summary)`` after checking them against each other."""
    family, exp = contract._raw_experiment(name, norm, targeted, tmp_path / tag)
    exp["dataset"] = data or {"name": "digits", "n": 3}
    exp["assets"] = contract._train_assets(name, n=TRAIN_IMAGES)
    exp["batch_size"] = slots or 2
    t = exp["threat"]
    if eps is not None:
        t["eps"] = eps
    if targeted:
        t["target_label"] = target_label or "random"
    if family == "transfer":
        exp["attack"]["hyper"]["iterations"] = iterations or 1
    else:
        t["max_queries"] = budget or 5
    exp = validate_experiment(exp, "edge")
    exp.update(_source="edge", _base_dir=".")
    run_dir, summary = run_experiment(exp, progress=False)
    records = sorted((json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()),
                     key=lambda r: r["index"])
    _check(exp, family, records, summary)
    return exp, records, summary


def _check(exp, family, records, summary):
    t = exp["threat"]
    assert [r["index"] for r in records] == list(range(summary["n"]))
    attacked = [r for r in records if r["attacked"]]
    assert summary["n_attacked"] == len(attacked)
    for r in records:
        assert r[t["norm"]] <= t["eps"] + 1e-5, r
        assert r["l2"] >= 0 and r["linf"] >= 0
        if not r["attacked"]:  # its record is the clean image's: no distance, no success
            assert r["l2"] == 0 and r["linf"] == 0 and r["ssim"] == 1, r
            assert not r.get("success") and not any(v["success"] for v in r.get("targets", {}).values()), r
    if family == "transfer":
        for name, v in summary["per_target"].items():
            valid = [r for r in attacked if r["targets"][name]["clean_correct"]]
            assert v["n"] == len(valid)
            assert v["asr"] == (sum(r["targets"][name]["success"] for r in valid) / len(valid) if valid else None)
        return
    budget = t["max_queries"]
    for r in records:
        assert isinstance(r["queries"], int) and 0 <= r["queries"] <= budget, r
        if not r["attacked"]:
            assert not r["success"] and r["queries"] == 0, r
        if r["success"]:
            assert r["queries"] >= 1, r
    wins = [r for r in attacked if r["success"]]
    assert summary["n_success"] == len(wins)
    assert summary["asr"] == (len(wins) / len(attacked) if attacked else None)
    assert summary["aqn"] == (sum(r["queries"] for r in wins) / len(wins) if wins else None)


# ------------------------------------------------------------------------------------------ query recipes

@pytest.mark.parametrize("name", QUERY)
def test_query_budgets_below_the_init_cost(tmp_path, name):
    """Budgets 1, 2, 3 and 37 (prime: no multiple of a population, a probe count or a block count), with one slot,
    more slots than samples, fewer; the 5 samples end with one the target misclassifies clean."""
    five = {"name": "test_edge_digits", "pick": [0, 1, 2, 3, *_misclassified("digits_mlp", 1)]}
    for budget, data, slots in ((1, five, 1), (2, five, 8), (3, {"name": "digits", "n": 1}, 4), (37, five, 2)):
        n = len(data.get("pick", [0]))
        _, records, _ = _run(tmp_path, name, NORMS[name][0], data=data, budget=budget, slots=slots,
                             tag=f"b{budget}")
        assert len(records) == n
        assert all(r["queries"] == budget for r in records if r["attacked"] and not r["success"]
                   and not r["stalled"]), records
        if n == 5:
            assert not records[4]["clean_correct"] and not records[4]["attacked"], (budget, data, records[4])


@pytest.mark.parametrize("name", QUERY)
def test_query_misclassified_samples_are_not_attacked(tmp_path, name):
    """A dataset of nothing but samples the target misclassifies clean: every record is 'not attacked', the summary
    has no ASR and no query count."""
    wrong = _misclassified("digits_mlp", 3)
    _, records, summary = _run(tmp_path, name, NORMS[name][0], data={"name": "test_edge_digits", "pick": wrong},
                               budget=3)
    assert not any(r["attacked"] or r["clean_correct"] for r in records)
    assert summary["n_attacked"] == 0 and summary["asr"] is None and summary["aqn"] is None


TARGET_MODES = [{"name": m, "label": 3} if m == "specified" else m for m in TARGET_LABEL.names()]


@pytest.mark.parametrize("name", sorted(TARGETED & set(QUERY)))
def test_query_target_modes(tmp_path, name):
    """``specified`` label 3 on digits 0..4 (index 3 is a 3: not attacked), and one more registered target-label
    mode, each in turn over the recipes (every mode runs on several recipes; they share the runner's target
    choice)."""
    k = sorted(TARGETED & set(QUERY)).index(name)
    others = [m for m in TARGET_MODES if not isinstance(m, dict)]
    for mode in ({"name": "specified", "label": 3}, others[k % len(others)]):
        _, records, _ = _run(tmp_path, name, NORMS[name][0], True, data={"name": "digits", "n": 5}, budget=4,
                             slots=3, target_label=mode, tag=str(mode))
        assert all(r["target"] != r["label"] for r in records if r["attacked"])
        if isinstance(mode, dict):
            assert [r["target"] for r in records] == [3] * 5 and not records[3]["attacked"]


@pytest.mark.parametrize("name,norm", [(n, m) for n in QUERY for m in NORMS[n]])
def test_query_extreme_eps(tmp_path, name, norm):
    """One uint8 level, the largest ball; below half a level (0.001) is a one-line config error naming the key."""
    for k, eps in enumerate((1 / 255, LARGEST[norm])):
        _run(tmp_path, name, norm, eps=eps, budget=6, tag=f"e{k}")
    with pytest.raises(ConfigError, match=r"threat\.eps"):
        _run(tmp_path, name, norm, eps=0.001, tag="tiny")


@pytest.mark.parametrize("name", QUERY)
def test_query_constant_images(tmp_path, name):
    """All-zero and all-one 1-channel images, labelled as the target classifies them (attacked), then the same
    labelled otherwise (misclassified clean: not attacked)."""
    fill = [0.0, 1.0, 0.0, 1.0]
    label = _predict("digits_mlp", torch.tensor(fill[:2]).view(-1, 1, 1, 1).expand(-1, 1, 8, 8)).tolist()
    labels = label + [(k + 1) % 10 for k in label]
    _, records, _ = _run(tmp_path, name, NORMS[name][0], budget=5, slots=4,
                         data={"name": "test_edge_digits", "fill": fill, "labels": labels})
    assert [r["attacked"] for r in records] == [True, True, False, False]


# ------------------------------------------------------------------------------------------ transfer recipes

@pytest.mark.parametrize("name", TRANSFER)
def test_transfer_one_iteration_smallest_eps(tmp_path, name):
    """One iteration at eps 1/255 over 3 samples in 2 slots (the last batch is short), targeted where the recipe
    allows, at label 1 for every sample: digit 1 is not attacked and its record is the clean image's (it held the
    crafted image's distances and the targets' clean answers as successes); below half a uint8 level is a
    one-line config error naming the key."""
    norm = NORMS[name][0]
    targeted = name in TARGETED
    _, records, _ = _run(tmp_path, name, norm, targeted, eps=1 / 255, slots=2, tag="one",
                         target_label={"name": "specified", "label": 1})
    assert len(records) == 3 and [r["attacked"] for r in records] == [True, not targeted, True]
    with pytest.raises(ConfigError, match=r"threat\.eps"):
        _run(tmp_path, name, norm, eps=0.001, tag="tiny")


@pytest.mark.parametrize("name", TRANSFER)
def test_transfer_edge_samples(tmp_path, name):
    """One sample in 4 slots at the largest ball (targeted where the recipe allows, each target mode in turn);
    samples every target misclassifies clean (a transfer run attacks every sample; no target counts them: every
    per-target ASR and the average are None); a constant image."""
    norm = NORMS[name][0]
    mode = TARGET_MODES[TRANSFER.index(name) % len(TARGET_MODES)]  # each mode in turn
    _run(tmp_path, name, norm, name in TARGETED, eps=LARGEST[norm], data={"name": "digits", "n": 1}, slots=4,
         target_label=mode, tag="one")
    white = "digits_resnet" if contract._residual_surrogate(name) else "digits_cnn"
    wrong = sorted(set(_misclassified(white, 500)) & set(_misclassified("digits_mlp", 500)))[:2]
    _, records, summary = _run(tmp_path, name, norm, data={"name": "test_edge_digits", "pick": wrong}, tag="wrong")
    assert not any(v["clean_correct"] for r in records for v in r["targets"].values())
    assert summary["asr"] is None and all(v["asr"] is None for v in summary["per_target"].values())
    zero = int(_predict(white, torch.zeros(1, 1, 8, 8)))
    _, records, _ = _run(tmp_path, name, norm, data={"name": "test_edge_digits", "fill": [0.0], "labels": [zero]},
                         tag="zeros")
    assert records[0]["attacked"]


# ------------------------------------------------------------------------------------------ detection recipes

EMPTY = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long),
         "difficult": torch.zeros(0, dtype=torch.bool)}
SHORT = {"iterations": 1, "epochs": 1, "queries": 1, "steps": 1, "patience": 1}  # the craft's loop parameters


@functools.lru_cache(maxsize=None)
def _detector():
    from blackboxbench.prep.models import build_model
    return build_model("shapes_fcos")


def _shapes(boxes):
    """Two synthetic shapes images whose second is a constant grey with no ground-truth box (``boxes`` False: the
    first has none either)."""
    from blackboxbench.detection.data import shapes

    d = shapes(None, n=2)
    x = d.x.clone()
    x[1] = 128 / 255  # on the uint8 grid, as every dataset
    targets = [d.targets[0] if boxes else EMPTY, EMPTY]
    return replace(d, x=x, targets=targets)


def _detection_assets(name):
    """The assets a detection recipe's craft reads: CAA's context tables (test_detection_attacks' default), the
    attacker's images of a universal perturbation (16 shapes train images)."""
    from blackboxbench.detection.data import detection_images
    from test_detection_attacks import context

    craft = load_yaml(RECIPES[name])["blocks"]["craft"]
    kinds = DET_CRAFT.get(craft["name"]).registry_meta.get("asset_params", {})
    made = {"detection_context": context, "detection_images": lambda: detection_images(None, "cpu", spec={"n": 16})}
    return {craft.get(p, block_params(DET_CRAFT.get(craft["name"]))[p]): made[k]() for p, k in kinds.items()}


@pytest.mark.parametrize("name", DETECTION)
def test_detection_images_without_boxes(name):
    """One step of the craft loop at eps 1/255 (phantom sponges: L2 1/255) on an image with boxes and a constant one
    with none (no box and no detection), in one slot and in 4; then a dataset with no box at all: the metrics that
    need a box are None, never NaN, and no run fails."""
    from test_detection_attacks import run_recipe

    craft = load_yaml(RECIPES[name])["blocks"]["craft"]
    params = {k: v for k, v in SHORT.items() if k in block_params(DET_CRAFT.get(craft["name"]))}
    overrides = {"blocks": {"craft": params}, "hyper": {"eps": {NORMS[name][0]: 1 / 255}}}
    for boxes, slots in ((True, 1), (True, 4), (False, 2)):
        data = _shapes(boxes)
        records, summary, t = run_recipe(name, _detector(), data, slots=slots, overrides=overrides,
                                         assets=_detection_assets(name))
        assert len(records) == 2 and summary["n"] == 2
        for r in records:
            img = r["_image"].float() / 255
            d = (img - data.x[r["index"]]).flatten()
            assert (d.abs().max() if t["norm"] == "linf" else d.norm()) <= t["eps"] + 1e-5
        for v in summary["per_target"].values():
            assert all(not (isinstance(x, float) and math.isnan(x)) for x in v.values()), v
        if not boxes:
            assert all(v["clean_map"] is None for v in summary["per_target"].values()), summary


# ------------------------------------------------------------------------------------------ datasets

@DATASET.register("test_edge_off_grid", source="test")
def edge_off_grid(data_root=None, *, n=2, value=0.5):
    """``n`` constant digits-sized images of ``value`` (0.5 lies between two uint8 levels)."""
    return Dataset("test_edge_off_grid", torch.full((n, 1, 8, 8), float(value)), torch.zeros(n, dtype=torch.long), 10)


@pytest.mark.parametrize("value,says", [(0.5, "off the uint8 grid"), (1.5, "outside [0, 1]")])
@pytest.mark.parametrize("name", ["square_linf", "i_fgsm"])
def test_a_dataset_off_the_grid_is_a_config_error(tmp_path, name, value, says):
    """A constant grey of 0.5 is no uint8 image: every output is quantized to the clean image's grid level, so the
    run failed mid-way with the eps check blaming the attack ("attack 'square_linf' returned invalid images: a
    perturbation of linf norm 0.001961 > eps"); now it is a one-line config error naming the dataset block."""
    with pytest.raises(ConfigError, match=rf"edge:dataset: dataset block 'test_edge_off_grid' .*{re.escape(says)}"):
        _run(tmp_path, name, data={"name": "test_edge_off_grid", "value": value})


def test_transfer_sample_whose_target_is_its_label_keeps_the_clean_image(tmp_path):
    """A sample whose target is its own label is not attacked: its record is the clean image's (no distance, no
    success) even where the crafted image moved (8/255, 5 steps: far above half a uint8 level, which the one-step
    1/255 test above rounds away)."""
    _, records, _ = _run(tmp_path, "i_fgsm", "linf", True, eps=8 / 255, iterations=5, slots=2, tag="own",
                         target_label={"name": "specified", "label": 1})
    assert [r["attacked"] for r in records] == [True, False, True]
    assert records[0]["linf"] > 1 / 255 and records[1]["l2"] == records[1]["linf"] == 0
