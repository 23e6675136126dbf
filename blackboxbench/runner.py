"""Run one experiment: validate and prepare, then stream the dataset's samples through the family's worker,
write each sample's record as it finishes, and resume after a crash.

The runner keeps persistence, resume, scheduling and progress; it never names a family (see
:mod:`blackboxbench.family`). A run directory holds

* ``config.yaml``: the resolved config;
* ``records.jsonl``: one line per sample, appended (and flushed) as samples finish, in the order they finish;
* ``adv/<index>.png``: with ``save_adv: true``, each attacked sample's returned image (uint8, lossless), written
  and fsync'ed before its record (a power loss can lose a record, never leave one without its image);
* ``path/<index>.npz``: with ``save_path_every: k``, each attacked sample's path (its clean image, its iterate
  every k queries or transfer iterations, its returned image; :func:`save_path`), fsync'ed before its record;
* ``progress.json``: the run's cumulative wall time, updated as records are written;
* ``inputs.json``: digests of what the records are made from beyond the config (the dataset's images and labels,
  each model's weights, each asset's content, the LPIPS weights) and the torch version, checked on resume: a data
  root, weights or asset file changed under the same config is a one-line error instead of records of two inputs
  mixed in one run (another torch version is a warning: its kernels may round differently);
* ``summary.json``: the family's summary of all records, written when every sample has one.

A sample's random numbers come from its own stream (seed, index), so its result does not depend on the batch
size, its neighbours or when it entered a slot; re-running an interrupted run keeps every complete record, redoes
the samples without one, and ends with the records of an uninterrupted run. A lock file makes a second process
on the same run directory fail with a one-line error naming the holder (``--fresh`` too: it clears the folder only
once it holds the lock).
"""
import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from . import __version__
from .builder import build_attack, load_recipe, validate_recipe
from .config import ConfigError, check_family_keys, config_hash, finish_threat, import_plugins, plugin_digests
from .defense import DefendedTarget, build_defenses, defense_streams, parse_defenses
from .errors import BenchError, describe
from .evaluation import check_metric_names, distances
from .family import RunInputs, image_fault, not_class_scores
from .oracle import forward_chunk
from .prep.data import resolve_data_root
from .prep.inference import FixedBatch, inference_copy, is_randomized
from .prep.layers import get_layer
from .prep.models import bare_spec, build_model, parse_spec, trained_side
from .prep.targets import choose_targets
from .prep.trained import digest
from .registry import ASSET, DATASET, MODEL, block_label, block_params
from .rng import Streams
from .shared import SharedForward

FSYNC_EVERY_S = 1.0  # records are flushed at once (a killed process loses nothing) and fsync'ed at most this often


def resolve_device(name):
    """The torch device of a run's ``device`` key. On CUDA it also turns TF32 off (:func:`full_fp32`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("device: 'cuda' requested but no CUDA device is available (use auto or cpu)")
    if name == "cuda":
        full_fp32()
    return torch.device(name)


def full_fp32():
    """Float32 convolutions and matrix products in full precision on CUDA, for this process: cuDNN runs
    convolutions in TF32 by default (inputs rounded to 10 mantissa bits), which makes a model's decision a rough
    function of its input at the scales a decision attack probes. Measured on an H200 (torch 2.11, ResNet-20,
    first 32 CIFAR-10 images, ``benchmarks/device/check.sh``): hsja_linf ASR 53-56 % with TF32, 100 % without it
    and on CPU (``benchmarks/RESULTS.md``, "GPU run of 2026-12-04")."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def deterministic_kernels():
    """cuDNN's deterministic algorithms, chosen by heuristics (no benchmarking), for this process: with
    ``fixed_batch`` every model call has one shape, so each call of a shape runs the same kernels and a row's answer
    is a function of the row (``prep.inference.FixedBatch``)."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


class Session:
    """Caches shared by the runs of one process (models are built once, never per batch)."""

    def __init__(self):
        self.models = {}
        self.wrapped = {}  # (id of a model in models, size) -> its FixedBatch wrapper
        self.lpips_nets = {}
        self.held = {}  # id of a model in models -> held_weights(model)

    def lpips(self, path, device, source):
        """The LPIPS network (trunk from ``path`` or the torch hub cache), loaded once; None when absent."""
        from .perceptual import load_lpips

        key = (path, str(device))
        if key not in self.lpips_nets:
            try:
                self.lpips_nets[key] = load_lpips(path, device)
            except BenchError as e:
                raise ConfigError(str(e), source, "lpips_path") from None
        return self.lpips_nets[key]

    def fixed_batch(self, model, size):
        """``model`` behind :class:`~blackboxbench.prep.inference.FixedBatch` of ``size``, one wrapper per model
        and size (so that runs sharing the model's forwards still share one object)."""
        key = (id(model), size)
        if key not in self.wrapped:
            self.wrapped[key] = FixedBatch(model, size)
        return self.wrapped[key]

    def weights(self, model):
        """:func:`held_weights` of a model this session built (hashed once per session, not per run)."""
        if id(model) not in self.held:
            self.held[id(model)] = held_weights(model)
        return self.held[id(model)]

    def model(self, spec, data_root, device, source, key, compiled=False, probe=None):
        """The model of ``spec`` on ``device``, built once; ``compiled``: wrapped by ``torch.compile`` with dynamic
        batch shapes (compiled once, on the first forward); ``probe`` (a few inputs of the run): its inference
        copy (``prep/inference.py``), for a model that is only forwarded."""
        cache_key = (json.dumps(spec, sort_keys=True), str(data_root), str(device), compiled, probe is not None)
        if cache_key not in self.models:
            if compiled:
                self.models[cache_key] = torch.compile(self.model(spec, data_root, device, source, key,
                                                                  probe=probe), dynamic=True)
                return self.models[cache_key]
            if probe is not None:
                self.models[cache_key] = inference_copy(self.model(spec, data_root, device, source, key),
                                                        probe.to(device), spec_label(spec))
                return self.models[cache_key]
            try:
                self.models[cache_key] = build_model(spec, data_root=data_root, device=device)
            except BenchError as e:
                raise ConfigError(str(e), source, key) from None
        return self.models[cache_key]


def spec_label(spec):
    """A model's label: the spec's ``label`` when it gives one, else its name (``timm:arch``), then ``+`` and the
    names of the defenses its spec names."""
    if spec.get("label"):
        return spec["label"]
    label = spec["name"] + (f":{spec['arch']}" if spec.get("arch") else "")
    if spec.get("defense"):
        ds = spec["defense"] if isinstance(spec["defense"], list) else [spec["defense"]]
        label += "".join(f"+{d if isinstance(d, str) else d.get('name')}" for d in ds)
    return label


def _model_identity(spec):
    """What a spec builds: its registry name and every parameter, the builder's defaults filled in (a label, a
    defense or a default written out does not make another model)."""
    name, params = parse_spec(bare_spec(spec))
    try:
        defaults = {k: v for k, v in block_params(MODEL.get(name)).items() if v is not inspect.Parameter.empty}
    except BenchError:
        defaults = {}
    return json.dumps({"name": name, **defaults, **params}, sort_keys=True, default=str)


def _same_model(a, b):
    """Whether two specs build the same model."""
    return _model_identity(a) == _model_identity(b)


def held_weights(obj):
    """The weights ``obj`` holds, as a Counter of per-tensor digests (dtype, shape and values; names ignored): a
    model's parameters (normalization buffers aside), or the tensors of a dict, list or tuple (a ``tensors``
    asset); empty for anything else (a model without parameters, e.g. TFLite, cannot be compared)."""
    if callable(getattr(obj, "parameters", None)):
        tensors = list(obj.parameters())
    elif isinstance(obj, dict):
        tensors = [v for v in obj.values() if isinstance(v, torch.Tensor)]
    elif isinstance(obj, (list, tuple)):
        tensors = [v for v in obj if isinstance(v, torch.Tensor)]
    else:
        tensors = [obj] if isinstance(obj, torch.Tensor) else []
    return Counter(digest(str(t.dtype), list(t.shape), t) for t in tensors)


@dataclass
class Plan:
    """A validated experiment: everything that can fail before a run starts has been checked."""

    exp: dict
    recipe: dict
    family: object
    threat: dict
    attack: object
    resolved: dict


def prepare(exp):
    """Resolve everything that can fail before running (plugins, recipe, family keys, threat, names)."""
    source = exp["_source"]
    import_plugins(exp["plugins"], source, exp["_base_dir"])
    recipe, recipe_source = load_recipe(exp["attack"], source)
    family = validate_recipe(recipe, recipe_source)
    check_family_keys(exp, family, source)
    run_defenses(exp, family, source)  # every defense named checked before anything runs
    threat = finish_threat(exp["threat"], recipe, family, source)
    attack = build_attack(recipe, threat, recipe_source)
    family.check_experiment(exp, attack, source)
    for need, block in attack.meta["needs"].items():
        if not exp.get(need):
            raise ConfigError(f"attack '{recipe['name']}' needs '{need}' (its block '{block}' uses them)", source,
                              need)
    for name, (block, kind) in attack.meta["assets"].items():
        if name not in exp["assets"]:
            raise ConfigError(f"attack '{recipe['name']}' needs an asset named '{name}' (its block '{block}' reads "
                              f"it): declare assets: {{{name}: {{name: {kind}}}}}", source, "assets")
        if exp["assets"][name]["name"] != kind:
            raise ConfigError(f"attack '{recipe['name']}' reads it as a {kind} asset (its block '{block}'), not "
                              f"{exp['assets'][name]['name']}", source, f"assets.{name}.name")
    roles = family.roles(exp)
    seen = {}
    for key, i, spec in roles:  # each model of a list has its own results (a target's column): labels differ
        if family.model_keys[key].many and (j := seen.setdefault((key, spec_label(spec)), i)) != i:
            raise ConfigError(f"same label '{spec_label(spec)}' as {key}[{j}]: their results would merge; drop the "
                              "repeat or tell them apart with label: NAME", source, f"{key}[{i}]")
    if not family.surrogate_may_be_target:  # a white-box surrogate is never the black-box target
        targets = [s for key, _, s in roles if family.model_keys[key].role == "target"]
        for key, i, spec in roles:
            if family.model_keys[key].role == "surrogate" and any(_same_model(spec, t) for t in targets):
                raise ConfigError(f"the surrogate {spec_label(spec)} is the target model: a white-box surrogate "
                                  "must be another model", source, f"{key}[{i}]")
    resolved = {k: v for k, v in exp.items() if not k.startswith("_") and k not in ("attack", "threat")}
    resolved.update(attack=recipe, threat=threat, version=__version__)
    if exp["plugins"]:  # their code, not only their names (configs without plugins keep their hash)
        resolved["plugin_code"] = plugin_digests(exp["plugins"], exp["_base_dir"])
        # where they are, for the tools that read the run later (analyze --run); not part of the hash
        resolved["plugin_paths"] = [str((Path(exp["_base_dir"]) / p).resolve()) if p.endswith(".py") else p
                                    for p in exp["plugins"]]
    if exp.get("data_root") and not Path(exp["data_root"]).is_absolute():  # for tools run later from elsewhere
        resolved["data_root_path"] = str(Path(exp["data_root"]).resolve())  # (analyze --run); not part of the hash
    return Plan(exp, recipe, family, threat, attack, resolved)


def run_defenses(exp, family, source):
    """``{config key: [defense list per model]}`` of an experiment: a query run's ``defense`` (its target) and
    the ``defense`` of each transfer target's spec; every spec checked against the DEFENSE registry."""
    out = {}
    for key in family.run_keys:
        if key == "defense" and exp.get("defense") is not None:  # '' and {} are wrong specs, not 'no defense'
            specs = parse_defenses(exp["defense"], source)
            if specs:  # [] (no defense) runs as a config without the key
                target = next(k for k, mk in family.model_keys.items() if mk.role == "target")
                out[target] = [build_defenses(specs)]
    for key, i, spec in family.roles(exp):
        if "defense" in spec:
            if not family.classifier_models:
                raise ConfigError(f"a defense wraps a classifier's class scores; {family.name} targets take none",
                                  source, f"{key}[{i}].defense")
            if family.model_keys[key].role != "target":
                raise ConfigError("a defense wraps a target model, not a surrogate", source, f"{key}[{i}].defense")
            out.setdefault(key, [[] for _ in (exp.get(key) or [])])[i] = build_defenses(
                parse_defenses(spec["defense"], source, f"{key}[{i}].defense"))
    return out


def safe_part(text):
    """A run-folder name part: letters, digits, '.', '_', '+', '-' only (anything else becomes '_'), never '.'
    or '..', so a name cannot leave ``output_dir`` or nest folders."""
    part = re.sub(r"[^A-Za-z0-9._+-]", "_", str(text))[:80]
    return part if part.strip(".") else part.replace(".", "_") or "_"


# resolved-config keys outside the run hash: where results go, the label, where plugins and the data root are
NOT_HASHED = ("output_dir", "name", "plugin_paths", "data_root_path")


def run_dir_for(plan, device):
    exp, recipe, threat = plan.exp, plan.recipe, plan.threat
    h = config_hash({k: v for k, v in plan.resolved.items() if k not in NOT_HASHED} | {"device": device.type})
    models = [s for _, _, s in plan.family.roles(exp)]
    parts = [exp["name"] or recipe["name"], exp["dataset"]["name"], spec_label(models[0]).replace(":", "-"),
             threat["norm"], "targeted" if threat["targeted"] else "untargeted", h]
    return Path(exp["output_dir"]) / "_".join(safe_part(p) for p in parts), h


def record_check(record, salt):
    """A record's checksum: the first 16 hex digits of SHA-256 over its canonical JSON (without ``check``) and
    the run's config hash, so a record edited by hand, corrupted, or copied from another run is detected."""
    body = json.dumps({k: v for k, v in record.items() if k != "check"}, sort_keys=True)
    return hashlib.sha256(f"{salt}\n{body}".encode()).hexdigest()[:16]


def read_records(path, schema, salt):
    """The valid records of a (possibly interrupted) run: a torn or unparsable line is dropped (its sample is
    redone); a record that breaks the schema or its checksum, or two different records of one sample, are
    errors naming the line."""
    if not path.exists():
        return {}
    records = {}
    schema = {**schema, "check": (str,)}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"{path}: cannot read the records ({type(e).__name__}); move the file away to restart "
                         "the run") from None
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(r, dict) or not all(k in r and isinstance(r[k], types) and not
                                              (isinstance(r[k], bool) and bool not in types)
                                              for k, types in schema.items()):
            raise BenchError(f"{path}:{n}: not a record of this run (expected the fields {', '.join(schema)}); "
                             "remove the line to redo its sample")
        if r["check"] != record_check(r, salt):
            raise BenchError(f"{path}:{n}: record of sample {r['index']} does not match its checksum (edited, "
                             "corrupted or from another run); remove the line to redo the sample")
        if r["index"] in records and records[r["index"]] != r:
            raise BenchError(f"{path}:{n}: a second, different record of sample {r['index']}")
        records[r["index"]] = r
    return records


def read_elapsed(path):
    """The cumulative wall time an interrupted run recorded (0 when absent or unreadable)."""
    try:
        value = json.loads(path.read_text()).get("wall_time", 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0
    return float(value) if isinstance(value, (int, float)) and value >= 0 else 0.0


def _content_digest(obj):
    """The digest of a model's weights and buffers, a dict of tensors, or a dataset's images and labels; None for
    what has none of these (an opaque TFLite model)."""
    state = getattr(obj, "state_dict", None)
    if callable(state):
        return digest(dict(state()))
    if isinstance(obj, dict):
        return digest(obj)
    if isinstance(getattr(obj, "x", None), torch.Tensor) and isinstance(getattr(obj, "y", None), torch.Tensor):
        return digest(obj.x, obj.y)
    return None


def input_digests(data, weights, assets=None, lpips=None):
    """{input: digest} of what a run's records are made from beyond its config: ``dataset`` (its images, labels and
    given targets), each model's weights and buffers (``weights``: {label: bare model}), each asset's content
    (``asset:NAME``) and the LPIPS network's weights, so that a resume can tell when a data root, weights or asset
    file changed under the same config; ``torch``: the version the records were computed with."""
    out = {"dataset": digest(data.x, data.y, data.given_target)}
    for label, model in weights.items():
        out[label] = _content_digest(model)
    for name, asset in sorted((assets or {}).items()):
        out[f"asset:{name}"] = _content_digest(asset)
    if lpips is not None:
        out["lpips"] = _content_digest(lpips)
    out["torch"] = torch.__version__
    return out


def check_input_digests(path, digests, n_records):
    """Refuse to resume ``n_records`` records made from other inputs than ``digests`` (their ``inputs.json`` at
    ``path``); a run without the file (older, or killed before its first record) takes these inputs."""
    try:
        before = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: cannot read the run's input digests ({type(e).__name__}); rerun with --fresh to "
                         "discard its records") from None
    if isinstance(before, dict) and before.get("torch", torch.__version__) != torch.__version__:
        warnings.warn(f"{path}: the run's {n_records} records were computed with torch {before['torch']}; this is "
                      f"torch {torch.__version__}, whose kernels may round differently: the resumed samples may "
                      "differ from an uninterrupted run's")
    # an input the older file does not list (a run made before assets and LPIPS were digested) is not compared
    listed = before if isinstance(before, dict) else {}
    changed = [k for k in digests if k != "torch" and (k in listed or k == "dataset") and listed.get(k) != digests[k]]
    if changed:
        raise BenchError(f"{path}: {changed[0]} differs from the one the run's {n_records} records were made with "
                         "(another data root, weights file or model cache under the same config); rerun with "
                         "--fresh to discard them, or set another output_dir")


def clear_run_dir(run_dir):
    """Remove everything in a run folder but its lock file (``--fresh``, under the lock)."""
    for p in run_dir.iterdir():
        if p.name == ".lock":
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def fsync_dir(path):
    """Make the entries of directory ``path`` (files created or renamed into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path, write):
    """``write(file)`` into ``path`` (binary), then fsync it: what refers to the file later (a record line, a
    rename) never reaches the disk before its content does."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path, text):
    """Replace ``path`` by ``text`` in one step that survives a crash or a power loss: the new content is on disk
    before the rename, and the rename before this returns."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    durable_write(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    fsync_dir(path.parent)


class RunLock:
    """An exclusive lock on a run directory (held by one process; released when it exits, even by kill -9)."""

    def __init__(self, run_dir):
        self.path = run_dir / ".lock"
        self.file = None

    def __enter__(self):
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise BenchError(f"run directory {self.path.parent} is in use by {holder}; wait for it or use another "
                             "output_dir") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {os.uname().nodename}")
        self.file.flush()
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


class RecordWriter:
    """Appends records as samples finish: images first (``save_adv``), then the lines, flushed at once and
    fsync'ed at most every ``FSYNC_EVERY_S``; the run's cumulative wall time goes to ``progress.json``."""

    def __init__(self, run_dir, elapsed, salt):
        self.run_dir, self.elapsed, self.salt, self.t0 = run_dir, elapsed, salt, time.perf_counter()
        self.file = open(run_dir / "records.jsonl", "a")
        self.synced = time.perf_counter()

    def wall(self):
        return self.elapsed + time.perf_counter() - self.t0

    def write(self, records):
        if not records:
            return
        folders = set()  # where files were written: their entries are made durable before any record line is
        for r in records:
            image, path = r.pop("_image", None), r.pop("_path", None)
            if image is not None:
                folders.add(save_png(self.run_dir / "adv" / f"{r['index']:06d}.png", image))
            if path is not None:
                folders.add(save_path(self.run_dir / "path" / f"{r['index']:06d}.npz", path))
            r["check"] = record_check(r, self.salt)
        for folder in sorted(folders) + ([self.run_dir] if folders else []):  # adv/ or path/ itself may be new
            fsync_dir(folder)
        self.file.write("".join(json.dumps(r) + "\n" for r in records))
        self.file.flush()
        if time.perf_counter() - self.synced > FSYNC_EVERY_S:
            self.sync()

    def sync(self):
        """fsync the records and write the cumulative wall time; returns the wall time written."""
        os.fsync(self.file.fileno())
        wall = self.wall()
        atomic_write(self.run_dir / "progress.json", json.dumps({"wall_time": wall}))
        self.synced = time.perf_counter()
        return wall

    def close(self):
        """Sync and close; returns the wall time written to ``progress.json``, which the summary reports too (a
        rerun starts from that value, so the summary's wall time never decreases across reruns)."""
        wall = self.sync()
        self.file.close()
        return wall


def save_png(path, image):
    """A uint8 (C, H, W) tensor as a lossless PNG (grayscale or RGB), fsync'ed; returns its folder."""
    from PIL import Image

    path.parent.mkdir(exist_ok=True)
    arr = image.permute(1, 2, 0).numpy()
    png = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    durable_write(path, lambda f: png.save(f, format="PNG"))
    return path.parent


def save_path(path, snapshots):
    """A sample's attack path, ``[(step, uint8 (C, H, W) image)]`` (step: queries used, or the transfer
    iteration), as ``steps`` (K,) and ``images`` (K, C, H, W) uint8 in a compressed ``.npz``."""
    import numpy as np

    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    durable_write(tmp, lambda f: np.savez_compressed(f, steps=np.array([k for k, _ in snapshots], dtype=np.int64),
                                                     images=np.stack([im.numpy() for _, im in snapshots])))
    os.replace(tmp, path)
    return path.parent


def schedule(worker, pending, write, on_progress):
    """Continuous batching: fill the worker's free slots from ``pending`` and step it until every sample has a
    record; every finished record goes to ``write`` at once."""
    feed = iter(pending)
    while True:
        done = worker.fill(feed)
        write(done)
        on_progress(done)
        if not worker.busy:
            break
        done = worker.step()
        write(done)
        on_progress(done)


class Runner:
    """Runs one validated experiment (see :func:`run_experiment`)."""

    def __init__(self, exp, session=None, fresh=False, progress=True):
        self.exp, self.session, self.progress = exp, session or Session(), progress
        self.plan = prepare(exp)
        self.recipe, self.threat, self.attack = self.plan.recipe, self.plan.threat, self.plan.attack
        self.family = self.plan.family
        self.device = resolve_device(exp["device"])
        if exp.get("fixed_batch") and self.device.type == "cuda":
            deterministic_kernels()
        self.run_dir, self.hash = run_dir_for(self.plan, self.device)
        self.fresh = fresh
        self.bar_position = None  # the progress bar's line when several runs show theirs at once
        self.shared_with = None   # runs in this run's share_forwards group (its wall time covers their turns)
        self.trained_on = None    # the images its attack trains on (train_images assets), set with its inputs
        self.after = []           # the earlier runs of its cascade (link_cascade): it skips what they fooled

    def _data(self):
        exp, source = self.exp, self.exp["_source"]
        try:
            data_root = resolve_data_root(exp["data_root"]) if exp["data_root"] or os.environ.get(
                "BLACKBOXBENCH_DATA") else None
        except BenchError as e:
            if not exp["data_root"]:  # the environment's, not the file's
                raise BenchError(f"environment variable BLACKBOXBENCH_DATA: {e}") from None
            raise ConfigError(str(e), source, "data_root") from None
        ds_cfg = dict(exp["dataset"])
        try:
            data = DATASET.get(ds_cfg.pop("name"))(data_root, **ds_cfg)
        except BenchError as e:
            raise ConfigError(str(e), source, "dataset") from None
        if not all(isinstance(getattr(data, a, None), torch.Tensor) for a in ("x", "y")):
            raise ConfigError(f"dataset block {block_label(DATASET.get(exp['dataset']['name']))} returned "
                              f"{type(data).__name__}: it returns a Dataset (blackboxbench/prep/data.py) with image "
                              "tensor x and label tensor y", source, "dataset")
        bad = off_grid(data.x)
        if bad:  # every output is quantized to the clean image's grid: off it, the eps check would blame the attack
            raise ConfigError(f"dataset block {block_label(DATASET.get(exp['dataset']['name']))} returned images "
                              f"with {bad}: images are in [0, 1] on the uint8 grid (k/255)", source, "dataset")
        return data_root, data

    def _inputs(self, data_root, data):
        exp, source, fam = self.exp, self.exp["_source"], self.family
        check_metric_names(fam.schema(), [c for c, _ in fam.columns], fam.name)
        distances(data.x[:2], data.x[:2])  # every metric (a plugin's) answers one value per image, before the run
        models, names, notes = {}, {}, []  # notes: warned once the models take the images (else the error alone)
        weights = {}  # label -> the bare model as built (its weights go to the run's input digests)
        for key, i, spec in fam.roles(exp):
            label = f"{key}[{i}]" if fam.model_keys[key].many else key
            bare = bare_spec(spec)  # a defense wraps the model (defense.py); a label names its results
            probe = data.x[:4] if exp["fuse"] and fam.model_keys[key].forward_only else None
            model = self.session.model(bare, data_root, self.device, source, label, exp["compile"], probe)
            weights[label] = self.session.model(bare, data_root, self.device, source, label)  # built once, cached
            if exp.get("fixed_batch") and fam.model_keys[key].wrapped:
                model = self.session.fixed_batch(model, exp["fixed_batch"])
            models.setdefault(key, []).append(model)
            side = trained_side(bare)
            if side and data.x.shape[-2:] != (side, side):  # it runs (global pooling), but not as trained
                notes.append(f"{source}: {label}: {spec_label(spec)} was trained on {side}x{side} images; dataset "
                             f"{data.name} gives {data.x.shape[-2]}x{data.x.shape[-1]} (resize them: the dataset's "
                             "size parameter)")
            names.setdefault(key, []).append(spec_label(spec))
        eps, diameter = self.threat.get("eps"), data.x[0].numel() ** 0.5  # the [0, 1] image cube's diagonal
        if self.threat.get("norm") == "l2" and eps is not None and eps >= diameter:
            notes.append(f"{source}: threat.eps: l2 eps {eps:g} is at least the diameter of the [0, 1] image cube "
                         f"({diameter:.4g} for {'x'.join(map(str, data.x.shape[1:]))} images): the ball constrains "
                         "nothing (eps is in [0, 1] pixel units; the paper's CIFAR-10 L2 eps is 1.0)")
        assets = {}
        for k, spec in exp["assets"].items():
            params = {p: v for p, v in spec.items() if p != "name"}
            try:
                assets[k] = ASSET.get(spec["name"])(data_root, self.device, **params)
            except BenchError as e:
                raise ConfigError(str(e), source, f"assets.{k}") from None
        defenses = run_defenses(exp, fam, source)
        # what the attack trains on (the train_images assets its blocks read): its leaderboard row says so
        read = {name for name, (_, kind) in self.attack.meta["assets"].items() if kind == "train_images"}
        self.trained_on = "; ".join(f"{assets[k].name} ({len(assets[k].y)} images)" for k in sorted(read)) or None
        self._check_layers(models)
        if not fam.surrogate_may_be_target:
            self._check_not_target(weights, assets)
        self.randomized = []
        if not fam.classifier_models:
            fam.check_inputs(models, data, source, self.attack, assets)
        else:
            self._check_classes(models, data)
            self._check_defenses(models, defenses, data)
            probe = data.x[:8].to(self.device)
            self.randomized = sorted({n for key in models for n, m in zip(names[key], models[key])
                                      if is_randomized(m, probe)} |
                                     {f"{n}+{'+'.join(map(str, ds))}" for key, per in defenses.items()
                                      for n, ds in zip(names[key], per) if any(d.randomized for d in ds)})
        for note in notes:
            warnings.warn(note)
        lpips = self.session.lpips(exp["lpips_path"], self.device, source)
        self.input_digests = input_digests(data, weights, assets, lpips)
        return RunInputs(attack=self.attack, threat=self.threat, data=data, models=models, model_names=names,
                         streams=Streams(exp["seed"], len(data.y), self.device), device=self.device,
                         slots=min(exp["batch_size"], len(data.y)), assets=assets, save_adv=exp["save_adv"],
                         save_path_every=exp.get("save_path_every", 0), defenses=defenses,
                         fixed_batch=exp.get("fixed_batch") or 0,
                         lpips=lpips, skip=self.fooled_before(), randomized=tuple(self.randomized))

    @property
    def label(self):
        """The run's name in tables and in a cascade's records: the config's ``name``, else the recipe's."""
        return self.exp["name"] or self.recipe["name"]

    def fooled_before(self):
        """{sample index: label of the first earlier run of this run's cascade that fooled it}; the earlier runs
        must have finished (a one-line error names the first that has not)."""
        fooled = {}
        for p in self.after:
            if not (p.run_dir / "summary.json").exists():
                raise BenchError(f"cascade: the earlier run {p.run_dir} has not finished; this run attacks only the "
                                 "samples the earlier ones left robust (run the config again: it resumes in order)")
            for i, r in read_records(p.run_dir / "records.jsonl", p.family.schema(), p.hash).items():
                if r["success"]:
                    fooled.setdefault(i, p.label)
        return fooled

    def _check_not_target(self, weights, assets):
        """A white-box surrogate or a model asset is never the target, whatever spec builds it (a checkpoint path
        of the target's file, a copy or a link of it): refused when it holds every weight of a target (digests
        of the tensors, once per model and session)."""
        fam, source = self.family, self.exp["_source"]
        roles = {(f"{key}[{i}]" if fam.model_keys[key].many else key): (fam.model_keys[key].role, spec)
                 for key, i, spec in fam.roles(self.exp)}
        if not assets and all(role != "surrogate" for role, _ in roles.values()):
            return  # nothing white-box: no weights hashed
        targets = [(label, self.session.weights(weights[label])) for label, (role, _) in roles.items()
                   if role == "target"]
        targets = [(label, held) for label, held in targets if held]
        white = [(label, f"the surrogate {spec_label(spec)}", self.session.weights(weights[label]))
                 for label, (role, spec) in roles.items() if role == "surrogate" and targets]
        white += [(f"assets.{k}", f"the asset {k}", held_weights(a)) for k, a in assets.items() if targets]
        for key, what, held in white:
            for label, target in targets:
                if held and not target - held:
                    raise ConfigError(f"{what} holds the weights of the target model ({label}: "
                                      f"{spec_label(roles[label][1])}): a white-box model must be another model",
                                      source, key)

    def _check_layers(self, models):
        """A block that hooks a layer by name (``layer_param`` at registration) must find it on the surrogate it
        will hook: checked on a single surrogate (refinement keeps its layers; an ensemble's fused model is only
        built at run time)."""
        keys = [k for k, mk in self.family.model_keys.items() if mk.role == "surrogate"]
        for key in keys:
            if len(models.get(key, [])) != 1:
                continue
            for block, layer in self.attack.meta.get("layers", {}).items():
                try:
                    get_layer(models[key][0], layer)
                except BenchError as e:
                    raise ConfigError(str(e), self.exp["_source"], f"attack (block {block}, parameter layer)") \
                        from None

    def _check_defenses(self, models, defenses, data):
        """A defended model must still answer one row of class scores per image (a plugin defense that drops a
        column, or fails, is a one-line error naming its config key before anything is created)."""
        source, probe = self.exp["_source"], data.x[:1].to(self.device)
        who = torch.zeros(1, dtype=torch.long, device=self.device)
        for key, per in defenses.items():
            for i, ds in enumerate(per):
                if not ds:
                    continue
                m, specs = models[key][i], self.exp.get(key)
                where = f"{key}[{i}].defense" if isinstance(specs, list) else "defense"
                with torch.no_grad():
                    want = tuple(m(probe).shape)  # the bare model answers (checked by _check_classes)
                try:
                    got = DefendedTarget(m, ds, defense_streams(self.exp["seed"], 1, self.device))(probe, who)
                    bad = None if isinstance(got, torch.Tensor) and tuple(got.shape) == want else describe(got)
                except (RuntimeError, BenchError) as e:
                    bad = f"an error ({str(e).splitlines()[0][:160]})"
                if bad:
                    raise ConfigError(f"the model behind defense {'+'.join(str(d) for d in ds)} answers {bad}, not "
                                      f"scores of shape {want} for one image", source, where)

    def _check_classes(self, models, data):
        """Every model must output the dataset's classes (a dataset that leaves ``num_classes`` to the model takes
        the models' common count), every label must be one of them, and targeted runs' target labels too:
        checked before anything is created."""
        # several images (the first 8, as is_randomized's probe, so that a fixed_batch run's model sees no other
        # size; one image twice for a dataset of one): a model answering one row whatever the batch, or a row per
        # channel, fails here and not as a broadcast deep in an attack
        source = self.exp["_source"]
        probe = (data.x[:8] if len(data.x) > 1 else data.x[[0, 0]]).to(self.device)
        for key, ms in models.items():
            for i, m in enumerate(ms):
                where = f"{key}[{i}]" if self.family.model_keys[key].many else key
                try:
                    with torch.no_grad():
                        out = m(probe)
                except (RuntimeError, BenchError) as e:  # e.g. 3-channel images into a 1-channel model
                    raise ConfigError(f"the model cannot take the images of dataset {data.name} (shape "
                                      f"{tuple(data.x.shape[1:])}): {str(e).splitlines()[0][:160]}", source,
                                      where) from None
                if got := not_class_scores(out):  # a detector answers a list of boxes
                    raise ConfigError(f"a {self.family.name} attack needs a classifier answering one row of class "
                                      f"scores per image; this model answers {got} (a detector needs a detection "
                                      "recipe: blackboxbench list attacks)", source, where)
                if out.shape[0] != len(probe):
                    rows = f"{out.shape[0]} row{'' if out.shape[0] == 1 else 's'}"
                    raise ConfigError(f"the model answers {rows} of class scores for {len(probe)} images (tensor of "
                                      f"shape {tuple(out.shape)}); it must answer one row per image", source, where)
                if self.family.model_keys[key].role == "surrogate" and not out.is_floating_point():
                    raise ConfigError(f"the surrogate answers {out.dtype} class scores; a white-box surrogate's "
                                      "logits must be floating point (its gradient is the attack's)", source, where)
                width = out.shape[1]
                if data.num_classes is None:
                    data.num_classes = width
                elif width != data.num_classes:
                    raise ConfigError(f"the model outputs {width} classes but dataset {data.name} has "
                                      f"{data.num_classes}", source, where)
        if data.num_classes is not None and bool(((data.y < 0) | (data.y >= data.num_classes)).any()):
            raise ConfigError(f"labels must be class ids in [0, {data.num_classes}) of the model, got "
                              f"{int(data.y.min())}..{int(data.y.max())}", source, "dataset")
        if self.threat["targeted"]:
            m = len(data.y)
            try:
                choose_targets(self.threat["target_label"], torch.zeros(m, data.num_classes), data.y,
                               Streams(0, m, "cpu").view(torch.arange(m)), data.given_target)
            except BenchError as e:
                raise ConfigError(str(e), source, "threat.target_label") from None

    def inputs(self):
        """The run's data, models (built once per session), assets and defenses, every check done."""
        data_root, data = self._data()
        return self._inputs(data_root, data)

    def shared_model(self, inputs):
        """``(config key, model)`` of the one model this run may share forwards of with other runs
        (:mod:`.shared`): its family's ``shared_key`` model (a query run's target); None for a family that
        declares none (transfer and detection workers do more with their targets than call them)."""
        key = self.family.shared_key
        return None if key is None else (key, inputs.models[key][0])

    def run(self, inputs=None):
        inputs = inputs or self.inputs()  # every model, asset and class check before anything is created
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(self.run_dir)
        except OSError as e:
            raise ConfigError(f"cannot create the run folder {self.run_dir}: {e.strerror or e}", self.exp["_source"],
                              "output_dir") from None
        with lock:  # --fresh clears the folder only under the lock: never under a run still writing to it
            if self.fresh:
                try:
                    clear_run_dir(self.run_dir)
                except OSError as e:
                    raise ConfigError(f"cannot clear the run folder {self.run_dir}: {e.strerror or e}",
                                      self.exp["_source"], "output_dir") from None
            return self._run_locked(inputs)

    def _run_locked(self, inputs):
        data = inputs.data
        n = len(data.y)
        atomic_write(self.run_dir / "config.yaml", yaml.safe_dump(self.plan.resolved, sort_keys=False))
        rec_path = self.run_dir / "records.jsonl"
        done = {i: r for i, r in read_records(rec_path, self.family.schema(), self.hash).items() if i < n}
        if done:
            check_input_digests(self.run_dir / "inputs.json", self.input_digests, len(done))
        atomic_write(rec_path, "".join(json.dumps(done[i]) + "\n" for i in sorted(done)))
        atomic_write(self.run_dir / "inputs.json", json.dumps(self.input_digests, indent=1))  # before any record
        elapsed = read_elapsed(self.run_dir / "progress.json")
        writer = RecordWriter(self.run_dir, elapsed if done else 0.0, self.hash)
        pending = [i for i in range(n) if i not in done]
        bar = _progress(n, len(done), self.progress, self.recipe["name"], self.bar_position)
        try:
            if pending:
                worker = self.family.worker(inputs)

                def on_progress(records):
                    done.update({r["index"]: r for r in records})
                    bar.update(len(records))

                schedule(worker, pending, writer.write, on_progress)
        finally:
            wall = writer.close()
            bar.close()
        summary = self.summary([done[i] for i in range(n)], wall)
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return summary

    def summary(self, records, wall):
        s = self.family.summarize(records)
        exp, t, fam = self.exp, self.threat, self.family
        by_role = {}  # models of one role joined by ", ": a model's own label joins its defenses with "+"
        for key, _, spec in fam.roles(exp):
            by_role.setdefault(fam.model_keys[key].role, []).append(spec_label(spec))
        s.update(run=self.run_dir.name, attack=self.recipe["name"], name=exp["name"], family=fam.name,
                 paper=self.recipe.get("paper"), category=self.recipe.get("category"), year=self.recipe.get("year"),
                 dataset=exp["dataset"]["name"], dataset_params=dataset_params(exp["dataset"]),
                 target_model=", ".join(by_role.get("target", [])) or None,
                 surrogates=", ".join(by_role.get("surrogate", [])) or None,
                 norm=t["norm"], eps=t["eps"], targeted=t["targeted"],
                 target_label=target_label_text(t.get("target_label")), budget=t.get("max_queries"),
                 feedback=t.get("feedback"), seed=exp["seed"], batch_size=exp["batch_size"],
                 config_hash=self.hash, version=__version__, device=self.device.type, wall_time=wall,
                 randomized_models=", ".join(self.randomized) or None, shared_forwards=self.shared_with,
                 trained_on=self.trained_on,
                 cascade_after=", ".join(p.label for p in self.after) or None)
        return s


def target_label_text(spec):
    """A targeted run's target-label mode as text (``random``, ``specified(label=3)``); None when untargeted: the
    leaderboard and the worst case tell apart runs that aim at other classes by it."""
    if not spec:
        return None
    params = ", ".join(f"{k}={v}" for k, v in sorted(spec.items()) if k != "name" and v is not None)
    return f"{spec['name']}({params})" if params else spec["name"]


def off_grid(x, chunk=1024):
    """:func:`~blackboxbench.family.image_fault` of images ``x``, ``chunk`` images at a time (the first found)."""
    return next((bad for bad in map(image_fault, x.split(chunk)) if bad), None)


def dataset_params(spec):
    """A dataset spec's parameters other than its name and ``n`` as text (``size 64, split train``), None if it has
    none: the leaderboard tells runs on differently made images apart by it."""
    parts = [f"{k} {v}" for k, v in sorted(spec.items()) if k not in ("name", "n") and v is not None]
    return ", ".join(parts) or None


def run_tensors(attack, threat, x, y, models, *, seed=0, slots=None, given_target=None, num_classes=10,
                device=None, assets=None, names=None, defenses=None, lpips=None):
    """Run a built attack on in-memory images ``x`` (N, C, H, W) in [0, 1] with labels ``y`` (no files): the
    worker and scheduler of a run, without its persistence. ``models`` maps the family's model keys to lists of
    models (``{"model": [m]}``; ``{"surrogates": [...], "targets": [...]}``); ``defenses`` maps them to lists of
    defense lists (``{"model": [[rnd]]}``); ``lpips`` is the LPIPS network or None. Returns the records sorted by
    index, each attacked one with ``x_adv`` (its returned image, float in [0, 1])."""
    from .prep.data import Dataset
    from .registry import FAMILY

    device = torch.device(device or x.device)
    if device.type == "cuda":
        full_fp32()
    data = Dataset("tensors", x.cpu().contiguous(), y.cpu(), num_classes,
                   None if given_target is None else given_target.cpu())
    family = FAMILY.get(attack.meta["family"])
    names = names or {k: [f"{k}[{i}]" for i in range(len(v))] for k, v in models.items()}
    probe = x[:8].to(device)  # as a run: a randomized model's confirmations are fresh draws
    randomized = tuple(n for k in models for n, m in zip(names[k], models[k])
                       if family.classifier_models and is_randomized(m, probe))
    run = RunInputs(attack=attack, threat=threat, data=data, models=models, model_names=names,
                    streams=Streams(seed, len(y), device), device=device, slots=slots or len(y),
                    assets=assets or {}, save_adv=True, defenses=defenses or {}, lpips=lpips, randomized=randomized)
    records = []
    schedule(family.worker(run), range(len(y)), records.extend, lambda _: None)
    for r in records:
        image = r.pop("_image", None)
        if image is not None:
            r["x_adv"] = image.float().div(255).to(device)
    return sorted(records, key=lambda r: r["index"])


def _progress(total, initial, enabled, desc, position=None):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="img", leave=False,
                position=position)


# the threat keys a cascade's runs share (with the images, the target and its defense): AutoAttack's "same threat"
CASCADE_THREAT = ("norm", "eps", "targeted", "target_label", "max_queries", "success_rule")


def cascade_group(runner):
    """What a query run attacked, as text (runs of one cascade group attack the same samples under the same threat
    model); None for the other families, which no cascade skips."""
    from .robustness import QUERY_FAMILIES

    if runner.family.name not in QUERY_FAMILIES:
        return None
    exp, t = runner.exp, runner.threat
    return json.dumps([exp["dataset"], exp.get("model"), exp.get("defense"), exp.get("data_root"),
                       {k: t.get(k) for k in CASCADE_THREAT}], sort_keys=True, default=str)


def link_cascade(runners):
    """The config's ``cascade`` (AutoAttack's order of attacks): each query run attacks only the samples that the
    earlier runs of the file on the same images, target, defense and threat left robust; the others get a record
    with ``attacked`` false and ``fooled_by`` (the earlier run that fooled it). The earlier runs' folders become
    part of a run's config (``cascade_after``), hence of its hash: a cascaded run never resumes a run made alone."""
    groups = {}
    for r in runners:
        key = cascade_group(r)
        if key is None:
            continue
        r.after = list(groups.get(key, []))
        if r.after:
            r.plan.resolved["cascade_after"] = [p.run_dir.name for p in r.after]
            r.run_dir, r.hash = run_dir_for(r.plan, r.device)
        groups.setdefault(key, []).append(r)


def run_all(runners, session, share=False, done=lambda runner: None):
    """Run ``runners`` (validated) with one ``session``; ``done(runner)`` after each. Returns their summaries in
    order. ``share`` (the config's ``share_forwards``): runs whose family's shared model
    (:meth:`Runner.shared_model`) is the same object, on images of one shape, take turns and share its forwards
    (:mod:`.shared`); every run's inputs are built first, in order, so models are built once and every check
    passes before any run starts. A run of a group that fails lets the others finish; its error is raised then."""
    for r in runners:
        r.session = session
    if not share:  # a run that fails lets the others run; the first error is raised at the end
        from .sweep import attempt, collect
        return collect(len(runners), ((i, attempt(lambda r: (r, r.run()), r)) for i, r in enumerate(runners)), done)
    inputs = [r.inputs() for r in runners]
    groups = {}  # one group per model and image shape (a round's images go in one tensor): [shared, members]
    for i, (r, inp) in enumerate(zip(runners, inputs)):
        shared = r.shared_model(inp)
        where = ("model", id(shared[1]), tuple(inp.data.x.shape[1:])) if shared else ("alone", i)
        groups.setdefault(where, [shared, []])[1].append(i)
    summaries = [None] * len(runners)
    for target, members in groups.values():
        if len(members) == 1:
            i = members[0]
            summaries[i] = runners[i].run(inputs[i])
            done(runners[i])
            continue
        key, model = target
        shared = SharedForward(model, len(members), forward_chunk(runners[members[0]].device))
        for slot, i in enumerate(members):
            inputs[i].models[key] = [shared.member(slot)]
            runners[i].bar_position, runners[i].shared_with = slot, len(members)
        outcome = shared.run([lambda r=runners[i], inp=inputs[i]: r.run(inp) for i in members])
        for i, (summary, error) in zip(members, outcome):
            summaries[i] = summary
            if error is None:
                done(runners[i])
        for _, error in outcome:
            if error is not None:
                raise error
    return summaries


def run_experiment(exp, session=None, fresh=False, progress=True):
    """Run (or resume) one experiment; returns ``(run_dir, summary)``."""
    runner = Runner(exp, session, fresh, progress)
    return runner.run_dir, runner.run()
