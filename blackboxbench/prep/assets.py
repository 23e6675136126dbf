"""Named trained assets (registry ``ASSET``): what a config declares under ``assets:`` and blocks read from
``ctx.assets[name]``. An entry is ``fn(data_root, device, *, ...) -> object``, built once per run.

Nothing is downloaded: an asset is a local file (relative to the data root, or absolute) or a zoo model.
"""
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..errors import BenchError
from ..registry import ASSET, DATASET, check_params
from .data import data_path
from .models import build_model


@ASSET.register("model", source="the model zoo (prep/models.py)")
def model_asset(data_root, device, *, spec):
    """A zoo model (``spec``: a name like ``cifar_resnet56`` or a mapping), frozen, in eval mode, on the run's
    device: e.g. a generator, an auto-encoder or a white-box prior an attack needs."""
    return build_model(spec, data_root=data_root, device=device)


@ASSET.register("tensors", source="a local .pt (dict of tensors) or .npz file")
def tensors_asset(data_root, device, *, path):
    """A dict of tensors from a local ``.pt`` file (a tensor or a dict of tensors) or ``.npz`` file, on the run's
    device: e.g. a precomputed basis, a mask or trained weights of a small generator."""
    file = data_path(data_root, path) if data_root is not None or Path(path).is_absolute() else Path(path)
    if not file.is_file():
        raise BenchError(f"asset file {file} is a directory, not a file" if file.is_dir() else
                         f"missing asset file {file}")
    if file.suffix == ".npz":
        try:
            with np.load(file) as d:
                out = {k: torch.from_numpy(d[k]) for k in d.files}
        except Exception as e:  # noqa: BLE001 - a truncated, foreign or pickled archive raises anything
            raise BenchError(f"asset file {file} is not an npz of arrays: {type(e).__name__}") from None
    else:
        try:
            out = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a one-line error
            raise BenchError(f"asset file {file} is not a tensor file: {type(e).__name__}") from None
        out = out if isinstance(out, dict) else {"tensor": out}
    if not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise BenchError(f"asset file {file} must hold tensors only")
    return {k: v.to(device) for k, v in out.items()}


@ASSET.register("train_images", source="a classification dataset spec (default: the 200 extra CIFAR-10 test images "
                                       "of cifar10_test_sdp200.npz, disjoint from the evaluation images)")
def train_images(data_root, device, *, spec=None):
    """Labelled images the attacker trains on (the surrogate fine-tuning of LGV, SWA, the Bayesian attack and RD's
    BatchNorm update): the dataset ``spec`` ({name: ..., params}), on the run's device. Default: the spec sheet's
    split A, ``{name: cifar10, file: cifar10/cifar10_test_sdp200.npz}``, never the evaluation images
    (``cifar10_test_first100.npz``); on the digits, ``{name: digits, split: train}``."""
    spec = dict(spec or {"name": "cifar10", "file": "cifar10/cifar10_test_sdp200.npz"})
    name = spec.pop("name", None)
    fn = DATASET.get(name)
    check_params(fn, spec, "train_images: spec.")
    data = fn(data_root, **spec)
    label = " ".join([name] + [f"{k}={v}" for k, v in sorted(spec.items())])  # e.g. "cifar10 file=cifar10/..."
    return replace(data, name=label, x=data.x.to(device), y=data.y.to(device))
