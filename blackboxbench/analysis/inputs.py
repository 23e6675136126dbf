"""What the model-level analysis tools read (decision surface, dbViz, FSM, FullGrad): a white-box model, images
with their labels and dataset indices, and, from a finished run saved with ``save_adv: true``, the adversarial
images. An analysis sees the model's gradients: it is a tool for the evaluator, never part of an attack.

:func:`load_inputs` builds them from a run directory (its ``config.yaml`` names the dataset and the model, its
``adv/<index>.png`` hold the returned images) or from a model and a dataset spec.
"""
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image

from ..compare import load_run
from ..config import check_spec, import_plugins, load_yaml
from ..errors import BenchError
from ..family import not_class_scores
from ..prep.data import first_line, resolve_data_root
from ..prep.models import bare_spec, build_model
from ..registry import DATASET
from ..threat import flat_norm


@dataclass
class Inputs:
    """Images ``x`` (N, C, H, W) in [0, 1], labels ``y``, their dataset ``index`` (list of int), the adversarial
    images ``x_adv`` of a run (or None), the ``model`` (eval mode, frozen parameters) and its name, and the
    ``seed`` of the random directions some tools draw (per sample: :class:`blackboxbench.rng.Streams`)."""

    model: torch.nn.Module
    model_name: str
    x: torch.Tensor
    y: torch.Tensor
    index: list
    x_adv: Optional[torch.Tensor] = None
    seed: int = 0
    paths: Optional[dict] = None  # dataset index -> (steps (K,), uint8 images (K, C, H, W)) of a run's attack paths
    models: Optional[list] = None  # tools that compare models (ADM): [(name, model)], the first is ``model``
    data_root: Optional[str] = None  # where the tool may read more data (ADM's training images)
    family: Optional[str] = None  # the run's attack family (score, decision, transfer), None without a run
    targets: Optional[dict] = None  # a targeted run's dataset index -> target class (from its records), else None


def _spec_name(spec):
    return spec if isinstance(spec, str) else spec.get("name", "?")


def import_run_plugins(run, cfg=None):
    """Import the plugins a run directory's config (``cfg`` when already read) names: its datasets, models, blocks,
    analysis tools."""
    if run is not None and (paths := (cfg if cfg is not None else _run_config(run)).get("plugin_paths")):
        import_plugins(paths, str(Path(run) / "config.yaml"), str(run))


def _run_family(cfg):
    return (cfg.get("attack") or {}).get("family") if isinstance(cfg.get("attack"), dict) else None


def _run_config(run):
    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise BenchError(f"not a run directory (no config.yaml): {run}")
    cfg = load_yaml(path)
    if not isinstance(cfg.get("dataset"), dict):
        raise BenchError(f"{path} is not a resolved run config (no dataset mapping)")
    if _run_family(cfg) == "detection":
        raise BenchError(f"{run} is a detection run: the model-level analyses (decision surface, dbViz, FSM, "
                         "FullGrad, ADM) take classification runs")
    return cfg


def _run_model(cfg, path, many=False):
    """The model a run attacked: a query run's target, else a transfer run's first target. ``many``: the run's
    surrogates and then its target(s) (a transfer run's ``targets``, a query run's ``model``)."""
    if many:
        targets = cfg.get("targets") or ([cfg["model"]] if cfg.get("model") else [])
        specs = list(cfg.get("surrogates") or []) + list(targets)
        if len(specs) < 2:
            raise BenchError(f"{path}: the run names fewer than 2 models; give a list with --model")
        return [bare_spec(s) for s in specs]
    spec = cfg.get("model") or (cfg.get("targets") or [None])[0]
    if spec is None:
        raise BenchError(f"{path}: the run names no model; give one with --model")
    return bare_spec(spec)


def _saved(run, folder, suffix, index):
    """The files of samples ``index`` in ``run/folder`` (None when it holds none of them)."""
    paths = [Path(run) / folder / f"{i:06d}{suffix}" for i in index]  # as the runner writes them
    missing = [i for i, p in zip(index, paths) if not p.is_file()]
    if len(missing) == len(index):
        return None
    if missing:
        raise BenchError(f"{run}/{folder} has no file of samples {missing} (not attacked); leave them out of "
                         "--indices")
    return paths


def _adv_images(run, index):
    """The run's returned images of samples ``index`` (None when it saved none of them)."""
    paths = _saved(run, "adv", ".png", index)
    if paths is None:
        return None
    out = [torch.from_numpy(np.array(Image.open(p))).float().div(255) for p in paths]
    return torch.stack([a.permute(2, 0, 1) if a.dim() == 3 else a[None] for a in out])


def _attack_paths(run, index):
    """{index: (steps, uint8 images)} of the run's attack paths (None when it saved none of them)."""
    paths = _saved(run, "path", ".npz", index)
    if paths is None:
        return None
    out = {}
    for i, p in zip(index, paths):
        with np.load(p) as z:
            out[i] = (z["steps"], z["images"])
    return out


def _run_targets(run, cfg):
    """{index: target class} of a targeted run, from its finished, checksum-verified records
    (:func:`blackboxbench.compare.load_run`); None for an untargeted run."""
    if not (cfg.get("threat") or {}).get("targeted"):
        return None
    _, records = load_run(run)
    return {i: r["target"] for i, r in records.items() if isinstance(r.get("target"), int)} or None


def _saved_indices(run):
    found = set()
    for folder in ("adv", "path"):
        found |= {int(p.stem) for p in (Path(run) / folder).glob("*.*") if p.stem.isdigit()}
    return sorted(found)


def _check_pairing(x_adv, x, index, threat, run):
    """The run's adversarial images must lie in its threat's ball around these clean images (up to uint8 rounding):
    else the dataset is not the run's (another ``--dataset``, a folder that gained files) and image i of one would
    be analysed against image i of the other."""
    eps, norm = threat.get("eps"), threat.get("norm")
    if not isinstance(eps, (int, float)) or norm not in ("linf", "l2"):
        return
    slack = 1 / 255 if norm == "linf" else 0.5 / 255 * x[0].numel() ** 0.5
    dist = flat_norm((x_adv - x).double(), norm)
    far = (dist > eps + slack).nonzero().flatten().tolist()
    if far:
        raise BenchError(f"{run}/adv: the adversarial image of index {index[far[0]]} is {float(dist[far[0]]):.3g} "
                         f"({norm}) from the clean image, beyond the run's eps {eps:.4g}: the dataset is not the one "
                         "the run attacked (another --dataset, or its files changed)")


def load_inputs(run=None, model=None, dataset=None, data_root=None, n=None, indices=None, seed=0, device="cpu",
                many=False):
    """:class:`Inputs` of a run directory (``model`` / ``dataset`` override what its config names) or of a model
    and a dataset spec (a name or ``{name: ..., params}``). ``indices`` picks dataset indices; else the first
    ``n`` (with a run: its first ``n`` samples with a saved adversarial image or path, or its first ``n`` images when
    it saved neither). ``many``: for a tool that compares models, ``model`` is a list of two or more (a run's
    default: its surrogates and targets)."""
    cfg = _run_config(run) if run is not None else {}
    import_run_plugins(run, cfg)
    model = model if model is not None else (_run_model(cfg, run, many) if run is not None else None)
    if model is not None and many != isinstance(model, list):
        raise BenchError("this tool compares models: give a list of two or more, e.g. --model '[cifar_resnet20, "
                         "cifar_resnet56]'" if many else f"this tool reads one model, got the list {model!r}")
    if many and len(model) < 2:
        raise BenchError(f"this tool compares models: give two or more, got {model!r}")
    given = dataset is not None  # on the command line, else the run's config names it
    dataset = dataset if given else cfg.get("dataset")
    if model is None or dataset is None:
        raise BenchError("give a run directory (--run) or both a model (--model) and a dataset (--dataset)")
    root = data_root or cfg.get("data_root_path") or cfg.get("data_root")  # a relative one, as the run resolved it
    root = resolve_data_root(root) if root or os.environ.get("BLACKBOXBENCH_DATA") else None
    ds = dict(dataset) if isinstance(dataset, dict) else {"name": dataset}
    if not isinstance(ds.get("name"), str):
        raise BenchError(f"a dataset spec is a name or a mapping with a 'name' key, got {dataset!r}")
    fn = check_spec(DATASET, ds, "command line" if given else Path(run) / "config.yaml", "--dataset" if given
                    else "dataset")
    data = fn(root, **{k: v for k, v in ds.items() if k != "name"})
    if indices is None:
        saved = _saved_indices(run) if run is not None else []
        indices = [i for i in saved if i < len(data.y)] or list(range(len(data.y)))
        indices = indices[:n] if n else indices
    bad = [i for i in indices if not 0 <= int(i) < len(data.y)]
    if bad or not indices:
        raise BenchError(f"image indices {bad or indices} are not in the dataset ({len(data.y)} images)")
    index = [int(i) for i in indices]
    nets = [(str(_spec_name(m)), build_model(m, root, device)) for m in (model if many else [model])]
    names = [name for name, _ in nets]
    if len(set(names)) < len(names):
        raise BenchError(f"the models to compare repeat a name: {names}")
    for name, net in nets:  # a detector answers boxes: the model-level analyses read class scores
        try:
            with torch.no_grad():
                out = net(data.x[index[:1]].to(device))
        except RuntimeError as e:  # e.g. 3-channel images into a 1-channel model
            raise BenchError(f"model {name} cannot take the images of dataset {ds['name']} (shape "
                             f"{tuple(data.x.shape[1:])}): {first_line(e, 160)}") from None
        if got := not_class_scores(out):
            raise BenchError(f"model {name} answers {got}, not one row of class scores per image: the model-level "
                             "analyses (decision surface, dbViz, FSM, FullGrad, ADM) take classifiers")
        top = int(data.y[index].max())
        if out.shape[1] <= top:
            raise BenchError(f"model {name} outputs {out.shape[1]} classes but dataset {ds['name']} has labels up to "
                             f"{top}")
    x_adv = _adv_images(run, index) if run is not None else None
    paths = _attack_paths(run, index) if run is not None else None
    if x_adv is not None and x_adv.shape != data.x[index].shape:
        raise BenchError(f"{run}/adv: images of shape {tuple(x_adv.shape[1:])}, the dataset's are "
                         f"{tuple(data.x.shape[1:])}")
    if x_adv is not None:
        _check_pairing(x_adv, data.x[index], index, cfg.get("threat") or {}, run)
    return Inputs(nets[0][1], ", ".join(names), data.x[index].to(device), data.y[index].to(device), index,
                  None if x_adv is None else x_adv.to(device), int(seed if not cfg else cfg.get("seed", seed)), paths,
                  nets if many else None, None if root is None else str(root),
                  _run_family(cfg), _run_targets(run, cfg) if run is not None else None)
