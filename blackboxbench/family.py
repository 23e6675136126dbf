"""Attack families: the protocol between the runner and a kind of attack (registry ``FAMILY``).

The runner keeps persistence, resume, scheduling and progress and never names a family; everything that differs
between families is declared by a :class:`Family` (one file per family: ``query/pipeline.py`` registers
``score`` and ``decision``, ``transfer/pipeline.py`` registers ``transfer``). A new family is new files.

A family declares

* ``blocks``: what its recipes are made of, ``{kind: BlockKind(registry, many, default)}``;
* ``hyper``: recipe-level hyper-parameters with their defaults (e.g. a transfer attack's iterations);
* ``model_keys``: the config keys naming the models it needs, ``{key: ModelKey(role, required, many,
  forward_only, fixed_batch)}``;
* ``threat_keys``: threat-model keys of its own (beyond norm, eps, targeted, target_label), with their types;
* ``run_keys``: top-level config keys of its own (a query run's ``defense``), with their types;
* ``record_fields``: the fields of its per-sample records beyond :data:`COMMON_FIELDS`, with their types;
* ``columns``: its leaderboard columns, each with its direction (``higher`` or ``lower`` is better, or None);

and implements ``finish_threat`` (its threat defaults), ``build`` (an attack from bound blocks), ``worker`` (a
:class:`Worker` that runs one unit of work at a time) and ``summarize`` (per-run summary from records, a pure
function).

A worker holds up to ``slots`` samples at once. ``fill(feed)`` admits samples from the iterator ``feed`` (dataset
indices) until every slot is taken or the feed is empty; ``step()`` runs one unit of work (a query family: one
iteration of every sample in a slot; the transfer family: one whole batch). Both return the records of the
samples that finished; a sample whose slot empties is replaced at the next ``fill``. ``busy`` is True while a
sample is in a slot.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .errors import BenchError
from .prep.inference import FixedBatch
from .prep.targets import choose_targets
from .shared import Member

# Fields of every per-sample record, with their JSON types (None allowed where the tuple says so).
COMMON_FIELDS = {"index": (int,), "label": (int,), "target": (int, type(None)), "clean_correct": (bool,),
                 "attacked": (bool,), "l2": (float, int), "linf": (float, int), "time": (float, int),
                 "ssim": (float, int), "lpips": (float, int, type(None))}
COMMON_COLUMNS = ("attack", "name", "family", "category", "year", "dataset", "dataset_params", "target_model",
                  "defense", "surrogates", "norm", "eps", "targeted", "target_label", "n", "clean_acc")
TRAILING_COLUMNS = ("trained_on", "randomized_models", "cascade_after", "wall_time", "seed", "batch_size", "device",
                    "config_hash", "version", "run")
DIRECTIONS = ("higher", "lower", None)


def not_class_scores(out):
    """None when a model's answer ``out`` is one row of class scores per image (a 2-D tensor), else what it is
    instead (``a list``: a detector's boxes), for a one-line error."""
    if isinstance(out, torch.Tensor):
        return None if out.dim() == 2 else f"a tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


@dataclass(frozen=True)
class BlockKind:
    """A kind of block a family's recipes name: its registry, whether a recipe lists several, the default."""

    registry: Any
    many: bool = False
    default: Optional[str] = None


@dataclass(frozen=True)
class ModelKey:
    """A config key naming models: their role for the worker, whether it is required, whether it is a list, and
    whether the worker only forwards them (no gradient, hook or surgery): such models may be inference copies
    (``prep/inference.py``; the config's ``fuse``), and whether the runner puts them behind
    :class:`~blackboxbench.prep.inference.FixedBatch` under the config's ``fixed_batch`` (None: when forward-only;
    False: the worker gives them fixed shapes itself, as the transfer worker does its surrogates)."""

    role: str
    required: bool
    many: bool
    forward_only: bool = False
    fixed_batch: Optional[bool] = None

    @property
    def wrapped(self):
        """Whether the runner wraps these models in ``FixedBatch`` under ``fixed_batch``."""
        return self.forward_only if self.fixed_batch is None else self.fixed_batch


@dataclass
class RunInputs:
    """What a worker gets from the runner (built once per run; models are never reloaded per batch)."""

    attack: Any
    threat: dict
    data: Any                # prep.data.Dataset (on CPU)
    models: dict             # config key -> list of models (in the config's order)
    model_names: dict        # config key -> list of labels
    streams: Any             # rng.Streams over the dataset's samples
    device: torch.device
    slots: int
    assets: dict
    save_adv: bool = False
    save_path_every: int = 0  # > 0: each sample's iterates every k queries (query) or iterations (transfer)
    defenses: dict = field(default_factory=dict)  # config key -> list (per model) of defense lists (defense.py)
    lpips: Any = None        # the LPIPS network of the perceptual metrics, None when its weights are absent
    fixed_batch: int = 0     # > 0: every model call has exactly that many images (the config's fixed_batch)
    skip: dict = field(default_factory=dict)  # sample index -> the earlier run of a cascade that fooled it
    randomized: tuple = ()   # labels of the models (and defended models) whose two forwards of a probe differed


class Family:
    """Base class of the families. Subclasses set the declarations and implement the four methods."""

    name = None
    blocks = {}
    hyper = {}
    model_keys = {}
    threat_keys = {}
    run_keys = {}  # top-level config keys of its own (e.g. a query run's ``defense``), with their types
    record_fields = {}
    columns = ()
    table = None  # [(summary key, header)] of the terminal table after a run; None: the classification one (cli)
    surrogate_may_be_target = False  # a white-box surrogate equal to a black-box target is a config error
    classifier_models = True  # the runner checks class counts and randomness on logits; else check_inputs does
    # share_forwards: the config key of the one model whose forwards this family's runs may share (shared.py);
    # its worker must only call that model (images in, a tensor out) and read its parameters. None: never shared.
    shared_key = None

    def finish_threat(self, threat, recipe, source):
        """Fill this family's threat defaults and check its threat keys; returns the threat dict."""
        return threat

    def default_eps(self, recipe, norm):
        """The eps a recipe of this family uses when the config gives none (None: the paper tables' default)."""
        return None

    def check_inputs(self, models, data, source, attack, assets):
        """Check the loaded models, data and assets against the attack before a run (families whose models are not
        classifiers)."""

    def check_experiment(self, exp, attack, source):
        """Check an experiment against its built attack before anything loads (one-line config errors)."""

    def after_runs(self, results_dirs, leaderboard):
        """Reports written after a config's runs (next to its leaderboard); returns the paths written."""
        return []

    def build(self, name, blocks, hyper, meta):
        raise NotImplementedError

    def worker(self, run):
        raise NotImplementedError

    def summarize(self, records):
        raise NotImplementedError

    def schema(self):
        """{field: types} of this family's per-sample records."""
        return {**COMMON_FIELDS, **self.record_fields}

    def roles(self, exp):
        """[(config key, index, spec)] of every model the experiment declares for this family."""
        out = []
        for key, mk in self.model_keys.items():
            specs = exp.get(key) if mk.many else ([exp[key]] if key in exp else [])
            out += [(key, i, s) for i, s in enumerate(specs or [])]
        return out


class WholeBatchWorker:
    """Scheduling of a family whose unit of work is one whole batch of up to ``run.slots`` samples that all take
    the same number of steps (transfer, detection): ``fill`` takes the next batch from the feed when idle, and
    the subclass's ``step`` starts with :meth:`take`. Subclasses set ``self.run`` and call ``super().__init__()``."""

    def __init__(self):
        self.batch = None

    @property
    def busy(self):
        return self.batch is not None

    def fill(self, feed):
        if self.batch is None:
            chunk = [i for _, i in zip(range(self.run.slots), feed)]
            self.batch = chunk or None
        return []

    def take(self):
        """The batch's sample indices (empty when idle); the worker is idle again after it."""
        index, self.batch = self.batch, None
        return index or []


def base_records(index, y, target, clean_correct):
    """The common part of the records of samples ``index`` (one device sync for the batch)."""
    y, ok = y.tolist(), clean_correct.tolist()
    target = [None] * len(y) if target is None else target.tolist()
    return [{"index": int(i), "label": y[k], "target": target[k], "clean_correct": bool(ok[k])}
            for k, i in enumerate(index)]


def pick_targets(threat, logits, y, rng, given):
    """Targets of a batch from a model's clean ``logits`` (None when untargeted); ``rng`` is the samples' view of
    their random streams (mode ``random`` draws from it)."""
    if not threat["targeted"]:
        return None
    return choose_targets(threat["target_label"], logits, y, rng, given).to(y.device)


def image_fault(x):
    """None when images ``x`` are finite, in [0, 1] and on the uint8 grid (k/255), else what they are instead: what
    an attack returns (:func:`check_outputs`) and what a dataset gives (the runner's load check)."""
    if not bool(torch.isfinite(x).all()):
        return "non-finite values (NaN or inf)"
    if x.min() < 0 or x.max() > 1:
        return f"values in [{x.min().item():.4g}, {x.max().item():.4g}], outside [0, 1]"
    if (x * 255 - torch.round(x * 255)).abs().max() > 1e-3:
        return "values off the uint8 grid"
    return None


def check_outputs(x_adv, x, eps, norm, name):
    """Guard the threat model on what an attack returns: finite, in [0, 1], on the uint8 grid, inside the ball."""
    bad = f"shape {tuple(x_adv.shape)} != {tuple(x.shape)}" if x_adv.shape != x.shape else image_fault(x_adv)
    if bad is None:
        d = (x_adv - x).flatten(1)
        d = d.abs().amax(1) if norm == "linf" else d.norm(dim=1)
        if (d > eps + 1e-5).any():
            bad = f"a perturbation of {norm} norm {d.max().item():.6f} > eps {eps}"
    if bad:
        raise BenchError(f"attack '{name}' returned invalid images: {bad}")


def forward_logits(model, x, name, chunk=256):
    """A model's logits on ``x`` under no_grad, in chunks; non-finite logits are refused (never read as a class)."""
    with torch.no_grad():
        out = torch.cat([model(x[i:i + chunk]).float() for i in range(0, x.shape[0], chunk)]) if x.shape[0] \
            else model(x).float()
    bad = ~torch.isfinite(out).all(1)
    if bool(bad.any()):
        raise BenchError(f"{name} returned non-finite logits (NaN or inf) for {int(bad.sum())} of {len(bad)} "
                         "images; a NaN is never read as a class")
    return out


AUDIT_CALL_CUDA = 32  # images per audit call on CUDA, padded: a call there costs its launches, about one image's


def audit_call_size(fixed_batch, device):
    """Images per call of an audit's forward (:func:`audit_logits`): a run's ``fixed_batch`` where it gives one (its
    models' calls already have that shape); on CUDA :data:`AUDIT_CALL_CUDA` (a forward of one image there is
    latency-bound: a call of 32 costs about as much); elsewhere 1 (a CPU's cost grows with the images)."""
    if fixed_batch:
        return int(fixed_batch)
    return AUDIT_CALL_CUDA if torch.device(device).type == "cuda" else 1


def audit_logits(model, x, name, size):
    """``model``'s logits on ``x`` in calls of exactly ``size`` images, the last padded with copies of its last
    image (``prep.inference.FixedBatch``): the rows of calls of one shape are computed independently of each
    other, so an image's answer depends on that image only, not on the images audited with it, which on a GPU
    move its logits slightly (kernels chosen per shape). A run of a ``share_forwards`` group audits on the shared
    model itself, not through the group, whose rounds merge its calls with the other runs' (:mod:`.shared`)."""
    model = model.shared.model if isinstance(model, Member) else model
    return forward_logits(model if size == 1 else FixedBatch(model, size), x, name, chunk=size)


def to_uint8(x):
    """[0, 1] images on the uint8 grid -> uint8 tensor on CPU."""
    return torch.round(x * 255).clamp(0, 255).to(torch.uint8).cpu()
