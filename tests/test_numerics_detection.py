"""Batch-dependent outputs of detectors (the detection family; tests/test_numerics.py and
tests/test_numerics_transfer.py check the classification families). On a GPU a detector's boxes and scores for one
image move slightly with the batch it is forwarded in (cuDNN's kernels chosen per shape, TF32). The proxy here:
the tiny FCOS's first convolution scaled per channel by a factor drawn from the batch size (relative 1e-3), so
that its features, hence its boxes, scores and gradients, move with the batch size as a whole.

* Targets: the family evaluates every target on one image at a time, so a record's matching (and mAP, AP_loc and
  CSR, pure functions of the records) is the detector's answer on the returned image alone, whatever batch the
  image was attacked in: the records and the summary do not depend on ``batch_size``.
* Surrogates: a batched craft (TOG's sign-gradient loop) forwards the whole batch, so the images it returns
  depend on the batch size (the control below). With ``fixed_batch: k`` the worker crafts a batch in parts of
  exactly k images (the last padded with a copy of its last image, whose result is dropped), so that every
  surrogate call of the craft has k images and the records do not depend on ``batch_size``."""
import json
from pathlib import Path

import numpy as np
import torch

from blackboxbench.config import validate_experiment
from blackboxbench.detection.family import forward_dets, match_record
from blackboxbench.prep.models import build_model
from blackboxbench.registry import MODEL
from blackboxbench.runner import Session, run_experiment

N = 6  # shapes test images
ATTACK = {"recipe": "tog_vanishing", "blocks": {"craft": {"iterations": 3}}}


def jittered(det, rel=1e-3):
    """``det`` with its first convolution's output scaled per channel by a factor of the batch size (the sizes
    its calls had are kept in ``det.sizes``)."""
    det.sizes = set()

    def hook(module, inputs, out):
        det.sizes.add(out.shape[0])
        g = torch.Generator().manual_seed(1000 + out.shape[0])
        return out * (1 + (torch.rand(out.shape[1], generator=g) * 2 - 1) * rel).view(1, -1, 1, 1).to(out)

    det.net.backbone.body[0].register_forward_hook(hook)
    return det


SEEN = {}  # the jittered detector last built (the runs build it in a fresh session)


@MODEL.register("test_shapes_fcos_jitter", dataset="shapes", task="detection")
def shapes_fcos_jitter(data_root=None):
    """The tiny FCOS whose outputs move with the batch size (:func:`jittered`)."""
    SEEN["det"] = jittered(build_model("shapes_fcos"))
    return SEEN["det"]


def _run(tmp_path, batch_size, surrogate="shapes_fcos", **extra):
    """A detection run of ``ATTACK`` on ``N`` shapes with ``surrogate`` and the jittered FCOS as the target;
    ``extra``: more experiment keys. Returns ``(run_dir, summary, records sorted by index)``."""
    exp = validate_experiment({"dataset": {"name": "shapes", "n": N}, "attack": ATTACK, "surrogates": [surrogate],
                               "targets": ["test_shapes_fcos_jitter"], "device": "cpu", "batch_size": batch_size,
                               "output_dir": str(tmp_path / f"{surrogate}-{batch_size}-{extra}"), "save_adv": True,
                               "threat": {"score_thr": None, "max_det": None}, **extra}, "numerics")
    exp.update(_source="numerics", _base_dir=".")
    run_dir, summary = run_experiment(exp, progress=False, session=Session())
    records = sorted((json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()),
                     key=lambda r: r["index"])
    for r in records:
        r.pop("time"), r.pop("check", None)  # wall time; the checksum covers it
    return Path(run_dir), summary, records


REPORTED = ("clean_acc", "mean_drop_map", "mean_drop_ap_loc", "mean_drop_csr", "mean_goal_rate", "mean_ssim",
            "mean_linf", "mean_l2")


def test_detection_targets_answer_each_image_alone(tmp_path):
    """Batch sizes 6 and 4 (a batch of 4, then 2): identical records and leaderboard numbers; each record's
    matching of the returned image is the target's detections of that image forwarded alone, which differ from
    its detections inside a batch of 6 (the proxy moves them)."""
    from PIL import Image

    from blackboxbench.detection.data import shapes

    runs = [_run(tmp_path, bs) for bs in (N, 4)]
    assert runs[0][2] == runs[1][2]
    assert {k: runs[0][1][k] for k in REPORTED} == {k: runs[1][1][k] for k in REPORTED}
    assert runs[0][1]["mean_drop_map"] > 0  # the attack moved the detections
    run_dir, summary, records = runs[0]
    data = shapes(None, n=N)
    x_adv = torch.stack([torch.from_numpy(np.array(Image.open(run_dir / "adv" / f"{i:06d}.png"))).permute(2, 0, 1)
                         for i in range(N)]).float().div(255)
    target = shapes_fcos_jitter()  # its own post-processing, as the run's (score_thr and max_det None)
    alone = forward_dets(target, x_adv, "target")
    batched = forward_dets(target, x_adv, "target", chunk=N)
    for k, r in enumerate(records):
        gt = data.targets[k]
        assert r["targets"]["test_shapes_fcos_jitter"]["adv"] == match_record(alone[k], gt, None, False)
    assert any(not torch.equal(a["scores"], b["scores"]) for a, b in zip(alone, batched))


def test_fixed_batch_makes_detection_crafts_batch_invariant(tmp_path):
    """A jittered surrogate: without ``fixed_batch`` TOG's images move with the batch size (measured 2026-12-05:
    all 6 records differ between batch sizes 6 and 4, mean mAP drop 0.387 vs 0.304; before ``fixed_batch`` was
    accepted by detection runs there was no way to avoid it); with ``fixed_batch: 2`` the records are identical at
    batch sizes 6, 4 and 1 (mAP drop 0.331), and the craft's surrogate calls all have 2 images (its clean
    detections and the target's: 1)."""
    plain = [_run(tmp_path, bs, surrogate="test_shapes_fcos_jitter")[2] for bs in (N, 4)]
    assert plain[0] != plain[1]
    fixed = []
    for bs in (N, 4, 1):
        fixed.append(_run(tmp_path, bs, surrogate="test_shapes_fcos_jitter", fixed_batch=2)[2])
        assert SEEN["det"].sizes == {1, 2}, SEEN["det"].sizes  # the target (one at a time) is the same object
    assert fixed[0] == fixed[1] == fixed[2]
