"""The opaque TFLite targets (blackboxbench/prep/tflite.py): the data root's quantized ImageNet MobileNets behind
the zoo's interface, attacked through the oracle like any other target.

Checked against the data README (top-1 on the NIPS-2017 images), against the interpreter called directly on the
uint8 image (an independent reference of the wrapper's resize, rounding and background column), for batch
invariance, and end to end: a score and a decision attack fool it within the budget. Skipped without the data
root or the ai-edge-litert package.
"""
import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from blackboxbench.errors import BenchError
from blackboxbench.prep.inference import inference_copy
from blackboxbench.prep.models import build_model

litert = pytest.importorskip("ai_edge_litert.interpreter", reason="ai-edge-litert is not installed")

# data README, top-1 on the 1000 DEV images: 45.1 / 67.1 / 77.2 / 84.1 / 81.0 %
MODELS = {"mobilenet_v1_0.25_128_quant": 0.40, "mobilenet_v1_0.5_160_quant": 0.60,
          "mobilenet_v1_0.75_192_quant": 0.70, "mobilenet_v2_1.0_224_quant": 0.78,
          "tf2_mobilenet_v2_1.0_224_ptq": 0.75}
SMALL = "tflite:mobilenet_v1_0.25_128_quant"


@pytest.fixture(scope="module")
def nips17(data_root):
    from blackboxbench.registry import DATASET

    return DATASET.get("nips17")(data_root)


@pytest.mark.parametrize("arch", MODELS)
def test_top1_on_the_nips17_images_matches_the_data_readme(arch, data_root, nips17):
    model = build_model(f"tflite:{arch}", data_root)
    with torch.no_grad():
        scores = model(nips17.x)
    assert scores.shape == (100, 1000) and torch.isfinite(scores).all()
    acc = (scores.argmax(1) == nips17.y).float().mean().item()
    assert acc >= MODELS[arch], f"{arch}: top-1 {acc:.2f}"


def test_scores_are_the_interpreters_probabilities_of_the_uint8_image(data_root, nips17):
    """Reference: the interpreter itself on the image resized by torch and rounded to uint8; the
    wrapper's rows are the logs of its 1000 non-background probabilities, zeros at half a quantum."""
    model = build_model(SMALL, data_root)
    x = nips17.x[:3]
    interp = litert.Interpreter(model_path=str(model.path), num_threads=1)
    interp.allocate_tensors()
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    scale, zero = out["quantization"]
    small = F.interpolate(x, size=(128, 128), mode="bilinear", align_corners=False, antialias=True)
    pixels = (small * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i in range(3):
        interp.set_tensor(inp["index"], pixels[i:i + 1])
        interp.invoke()
        probs = (interp.get_tensor(out["index"])[0].astype(np.float64) - zero) * scale
        ref = np.log(np.maximum(probs[1:], scale / 2))
        assert np.allclose(model(x[i:i + 1])[0].numpy(), ref, atol=1e-6)
    assert math.isclose(scale, 1 / 256)


def test_deterministic_and_batch_invariant(data_root, nips17):
    model = build_model(SMALL, data_root)
    x = nips17.x[:20]
    with torch.no_grad():
        whole = model(x)
        parts = torch.cat([model(x[i:i + 7]) for i in range(0, 20, 7)])
        ones = torch.cat([model(x[i:i + 1]) for i in range(20)])
    assert torch.equal(whole, parts) and torch.equal(whole, ones) and torch.equal(whole, model(x))


def test_no_gradient_no_copy_and_one_line_errors(data_root, nips17, tmp_path):
    model = build_model(SMALL, data_root)
    x = nips17.x[:2].clone().requires_grad_(True)
    with pytest.raises(BenchError, match="gives no gradient: it can be a target, not a surrogate") as e:
        model(x)
    assert "\n" not in str(e.value)
    assert inference_copy(model, nips17.x[:2], "tflite") is model  # nothing to fold, no "kept as built" line
    with pytest.raises(TypeError):
        copy.deepcopy(model)
    with pytest.raises(BenchError, match=r"expects \(N, 3, H, W\) images"):
        model(torch.rand(1, 1, 28, 28))
    with pytest.raises(BenchError, match="missing file .*(found: .*mobilenet_v2_1.0_224_quant)"):
        build_model("tflite:mobilenet_v9", data_root)
    with pytest.raises(BenchError, match="either arch"):
        build_model({"name": "tflite", "arch": "x", "path": "y.tflite"}, data_root)
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(b"not a flatbuffer")
    with pytest.raises(BenchError, match="cannot load") as e:
        build_model({"name": "tflite", "path": str(bad)}, data_root)
    assert "\n" not in str(e.value)
    torch.save({}, tmp_path / "sd.pt")  # a state dict cannot load into an opaque model
    with pytest.raises(BenchError, match="checkpoint arch 'tflite:.*': not an architecture a state dict loads into"):
        build_model({"name": "checkpoint", "path": str(tmp_path / "sd.pt"), "arch": SMALL}, data_root)


def test_missing_package_is_a_one_line_error(monkeypatch, data_root):
    import builtins

    real = builtins.__import__

    def no_litert(name, *a, **k):
        if name.startswith("ai_edge_litert"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_litert)
    with pytest.raises(BenchError, match="needs the ai-edge-litert package"):
        build_model(SMALL, data_root)


@pytest.mark.parametrize("attack,norm,eps", [("square_linf", "linf", 0.03), ("rays", "linf", 0.03)])
def test_query_attacks_fool_the_opaque_model_within_budget(attack, norm, eps, tmp_path, data_root):
    """Supp. D-B's ImageNet setting (untargeted Linf 0.03, 10,000 queries) on the first 6 NIPS-2017 images: a score
    attack on the coarse quantized scores and a decision attack on the labels succeed; the runner's checks hold
    (ball, uint8 grid, per-sample budget) and every success is confirmed again by the audit forward."""
    from blackboxbench.config import validate_experiment
    from blackboxbench.runner import run_experiment

    exp = validate_experiment({"dataset": {"name": "nips17", "n": 6}, "model": SMALL, "attack": attack,
                               "device": "cpu", "seed": 0, "batch_size": 6, "output_dir": str(tmp_path),
                               "data_root": str(data_root), "threat": {"norm": norm, "eps": eps}}, "cfg.yaml")
    exp.update(_source="cfg.yaml", _base_dir=".")
    out_dir, summary = run_experiment(exp, progress=False)
    assert summary["n_attacked"] >= 2 and summary["asr"] == 1.0, summary
    assert summary["n_audit_disagree"] == 0
    records = [json.loads(line) for line in (Path(out_dir) / "records.jsonl").read_text().splitlines()]
    attacked = [r for r in records if r["attacked"]]
    assert all(1 <= r["queries"] <= 10_000 and r["audit_adv"] and r["linf"] <= eps for r in attacked)
