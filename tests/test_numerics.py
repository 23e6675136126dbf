"""Batch-dependent logits for every score and decision recipe of the catalog (a new recipe is covered
automatically). On a GPU a model's logits for one image move slightly with the batch it is forwarded in (cuDNN's
kernels chosen per shape, TF32). The engine's rule: a recorded success is the oracle's confirmation on the exact
returned image, and a decision attack's returned point keeps a margin on the adversarial side
(``decision.CLAIM_MARGIN``), so that an independent forward still agrees.

Each recipe runs at its first native norm, untargeted, on the first ``N`` test digits against the float32 digits
MLP wrapped in :class:`attack_utils.Jitter` (logits scaled by a per-batch-size factor, relative 1e-3), through the
contract's experiment (tests/test_contract.py: its eps, surrogates, learned assets and reduced generative blocks)
with a small budget. Every recorded success must be adversarial again when its returned uint8 image is forwarded
alone (batch size 1) and inside a batch of another size; the runner's audit (its own forward of each returned
image alone) gives that image's verdict alone, whatever samples finished with it, and its every disagreement is
flagged on its record and counted in the summary, and never turns a failure into a success. Decision recipes also run on the clean model: measured (2026-12-05) every
decision recipe fools the same number of the 15 attacked digits with and without the jitter (12 to 15 of 15);
the jittered run may trail the clean one by ``ASR_SLACK`` sample and must keep the contract's bar (60 %), which a
search returning its non-adversarial end (its claims never confirmed) does not."""
import json
from pathlib import Path

import pytest
import torch

from blackboxbench.config import load_yaml, validate_experiment
from blackboxbench.prep.data import digits
from blackboxbench.prep.models import _digits_model
from blackboxbench.registry import MODEL
from blackboxbench.runner import run_experiment

import test_contract as contract
from attack_utils import Jitter, check_output, returned_images


@MODEL.register("test_digits_mlp_jitter", dataset="digits")
def digits_mlp_jitter(data_root=None):
    """The float32 digits MLP whose logits move by a relative 1e-3 with the batch size (:class:`Jitter`)."""
    return Jitter(_digits_model("digits_mlp", True))


N = 16  # the first 16 test digits; the MLP misclassifies one, so 15 are attacked
BUDGET = {"score": 1_000, "decision": 2_000}
ASR_SLACK = 1  # of the attacked samples: the jittered decision ASR may trail the clean one by one sample
ASR_BAR = 0.6  # the contract's untargeted bar
OTHER_BATCH = 2 * N + 3  # the second independent forward: the returned images among the clean ones and padding
FAMILY = {name: load_yaml(path)["family"] for name, path in contract.RECIPES.items()}
CASES = [(name, next(n for n in load_yaml(path)["norms"] if contract._native(name, n)))
         for name, path in contract.RECIPES.items() if FAMILY[name] in ("score", "decision")]


def _run(tmp_path, name, norm, model):
    """The contract's untargeted experiment of ``name`` on ``N`` digits against ``model``, saving the returned
    images. Returns ``(run_dir, summary, records sorted by index, experiment)``."""
    family, exp = contract._raw_experiment(name, norm, False, tmp_path / model)
    exp.update(dataset={"name": "digits", "n": N}, batch_size=N, model=model, save_adv=True)
    exp["threat"]["max_queries"] = BUDGET[family]
    exp = validate_experiment(exp, "numerics")
    exp.update(_source="numerics", _base_dir=".")
    run_dir, summary = run_experiment(exp, progress=False)
    records = sorted((json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()),
                     key=lambda r: r["index"])
    return Path(run_dir), summary, records, exp


@pytest.mark.parametrize("name,norm", CASES, ids=[n for n, _ in CASES])
def test_successes_survive_batch_dependent_logits(tmp_path, name, norm):
    run_dir, summary, records, exp = _run(tmp_path, name, norm, "test_digits_mlp_jitter")
    data = digits(n=N)
    x, y = data.x, data.y
    x_adv = returned_images(run_dir, records, x)
    attacked = torch.tensor([r["attacked"] for r in records])
    success = torch.tensor([r["success"] for r in records])
    assert attacked.sum() >= N - 1 and not (success & ~attacked).any()
    check_output(x_adv[attacked], x[attacked], exp["threat"]["eps"], norm)
    assert all(r["queries"] <= exp["threat"]["max_queries"] for r in records)
    model = digits_mlp_jitter()
    with torch.no_grad():
        alone = torch.cat([model(x_adv[i:i + 1]).argmax(1) for i in range(N)]) != y
        among = model(torch.cat([x_adv, x, x[:OTHER_BATCH - 2 * N]])).argmax(1)[:N] != y
    assert alone[success].all(), f"not adversarial at batch size 1: {(success & ~alone).nonzero()}"
    assert among[success].all(), f"not adversarial in a batch of {OTHER_BATCH}: {(success & ~among).nonzero()}"
    # the audit: flagged on the record, counted in the summary, never folded into the success count
    flagged = [r for r in records if r["attacked"] and r["audit_adv"] != r["success"]]
    audit = torch.tensor([bool(r["audit_adv"]) for r in records])  # each returned image forwarded alone
    assert torch.equal(audit[attacked], alone[attacked]), (audit & attacked ^ alone & attacked).nonzero()
    assert summary["n_audit_disagree"] == len(flagged)
    assert summary["n_success"] == int(success.sum()) and summary["n_attacked"] == int(attacked.sum())
    if FAMILY[name] == "decision":
        assert not flagged, flagged  # the claim margin: the audit agrees with every decision record
        _, clean, _, _ = _run(tmp_path, name, norm, "digits_mlp")
        assert summary["n_success"] >= clean["n_success"] - ASR_SLACK, (clean["asr"], summary["asr"])
        assert summary["asr"] >= ASR_BAR, summary["asr"]


CLEAN_FOOLED = {"opt": 9, "sign_opt": 14}  # of 24, measured on the clean model (both before and after the fix)


@pytest.mark.parametrize("name", sorted(CLEAN_FOOLED))
def test_opt_searches_keep_their_asr_near_the_boundary(name):
    """At L2 eps 0.6 on the digits MLP (about the median distance to the boundary: 9 and 14 of 24 fooled by OPT
    and Sign-OPT in 2,000 queries), where a search converges to the boundary. OPT's RGF differences
    ``g(theta + beta u) - g(theta)`` and Sign-OPT's single-query signs compare searches to ``beta / 500`` with
    beta 0.001; logits that move by 1e-3 with the batch size shift the boundary by more, so the signs of a sample's
    probes all agreed (Sign-OPT: 57 % of the sample-iterations 95 % on one side, 4 % without the jitter) and the
    estimates were noise: 6 and 8 of 24 fooled. Beta now grows tenfold after such an iteration
    (``decision.grow_lopsided``): 9 and 12 of 24 (the clean runs are unchanged); Sign-OPT 13 since it grows at
    ``probe_balance`` 0.7 (signs 3 standard errors outside 15-85 %; its clean run: 14, 848 mean queries, 823 before)."""
    from attack_utils import run_query

    base = _digits_model("digits_mlp", True)
    data = digits(n=40)
    with torch.no_grad():
        ok = base(data.x).argmax(1) == data.y
    x, y = data.x[ok][:24], data.y[ok][:24]
    _, res = run_query(name, Jitter(base), x, y, 0.6, "l2", budget=2_000, slots=16)
    assert res.success.sum() >= CLEAN_FOOLED[name] - 2, res.success.sum()


@pytest.mark.parametrize("name, norm, eps, n, floor", [("geoda_l2", "l2", 1.0, 8, 4), ("geoda_linf", "linf", 0.05, 16, 13)])
def test_geoda_keeps_its_asr_with_batch_dependent_logits(data_root, name, norm, eps, n, floor):
    """GeoDA on the first ``n`` CIFAR-10 images ResNet-20 classifies correctly (wrapped in :class:`Jitter`), 3,000
    queries. Its probes (alpha 2e-4) lie below the boundary's shift with the batch size, so some estimates get
    lopsided answers and are noise. geoda_l2 on 8: 2 fooled when such estimates were kept, 4 when alpha grew after
    one whose probes all agreed (twentieth session), 6 now (5 on the model as it is). geoda_linf on 16: 11 with the
    growth alone, 14 now that an estimate lopsided at ``probe_balance`` 0.5 is dropped (14 on the model as it is)."""
    from attack_utils import check_outputs, correctly_classified, run_query
    from blackboxbench.prep.models import build_model

    base = build_model("cifar_resnet20", data_root)
    x, y = correctly_classified([base], data_root, n=n, pool=40)
    model = Jitter(build_model("cifar_resnet20", data_root))
    problem, res = run_query(name, model, x, y, eps, norm, budget=3_000)
    check_outputs(problem, res, model, 3_000)
    assert res.success.sum() >= floor, res.success.sum()


def test_audit_calls_have_one_shape_whatever_the_images_audited_together():
    """The audit's forward (:func:`family.audit_logits`): in calls of exactly ``size`` images (alone on a CPU, 32
    on CUDA, k under ``fixed_batch``), so an image's answer from a model whose logits move with the batch size is
    the same whatever other images, and however many, are audited with it."""
    from blackboxbench.family import AUDIT_CALL_CUDA, audit_call_size, audit_logits

    assert audit_call_size(None, "cpu") == 1 and audit_call_size(0, torch.device("cpu")) == 1
    assert audit_call_size(None, "cuda") == AUDIT_CALL_CUDA == 32 and audit_call_size(None, "cuda:1") == 32
    assert audit_call_size(4, "cuda") == 4 and audit_call_size(4, "cpu") == 4
    model = digits_mlp_jitter()
    x = digits(n=N).x
    with torch.no_grad():
        for size in (1, 8):
            few, many = audit_logits(model, x[:3], "m", size), audit_logits(model, x.flip(0), "m", size)
            assert torch.equal(few, many.flip(0)[:3]), size
            assert torch.equal(few, torch.cat([model(torch.cat([x[i:i + 1]] * size))[:1] for i in range(3)]))
        assert not torch.equal(audit_logits(model, x, "m", 1), model(x))  # the jitter: the batch of 16 differs
