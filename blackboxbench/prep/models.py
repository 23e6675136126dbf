"""Model zoo (registry ``MODEL``): every entry returns a :class:`Normalized` classifier taking [0, 1] NCHW input.

An entry is ``fn(data_root, *, ...) -> nn.Module``; :func:`build_model` parses a spec ("cifar_resnet20",
"timm:resnet18", or {"name": ..., **params}), builds the model, freezes it and moves it to the device.
Nothing is ever downloaded: pretrained weights come from the data root, a local file, or a local cache.
"""
import contextlib
import hashlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..registry import MODEL, block_params, check_params, close_matches
from ..rng import seeded
from .cifar_resnet import DEPTH_BLOCKS, CifarResNet
from .data import data_path, digits, first_line

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGITS_MEAN, DIGITS_STD = (0.3,), (0.375,)  # digits train split: mean 0.306, std 0.375
DIGITS_VERSION = "v1"  # bump when a digits architecture or its training changes (names the cache file)


def _per_channel(v):
    return None if v is None else torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1)


class Normalized(nn.Module):
    """``net`` behind per-channel normalization (and an optional bilinear resize to ``resize`` x ``resize``,
    antialias off), so that it takes [0, 1] images at the dataset resolution and returns logits.

    A wrapped model is a fixed target: eval mode and frozen parameters (input gradients still flow).
    """

    def __init__(self, net, mean=None, std=None, resize=None):
        super().__init__()
        self.net, self.resize = net, resize
        self.register_buffer("mean", _per_channel(mean))
        self.register_buffer("std", _per_channel(std))
        self.requires_grad_(False)
        self.eval()

    def forward(self, x):
        if self.resize and tuple(x.shape[-2:]) != (self.resize, self.resize):
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear", align_corners=False,
                              antialias=False)
        channels = next((t.shape[1] for t in (self.mean, self.std) if t is not None and t.shape[1] > 1), None)
        if channels is not None and x.shape[1] != channels:  # broadcasting would silently make up channels
            raise BenchError(f"the model expects {channels}-channel images, got shape {tuple(x.shape[1:])}")
        if self.mean is not None:
            x = x - self.mean
        if self.std is not None:
            x = x / self.std
        return self.net(x)


def parse_spec(spec):
    """A spec string or dict -> (registry name, params); "timm:resnet18" means name "timm", arch "resnet18"."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise BenchError(f"a model spec is a name or a mapping with a 'name' key, got {spec!r}")
    params = dict(spec)
    name = str(params.pop("name"))
    if ":" in name:
        name, arch = name.split(":", 1)
        if "arch" in params:
            raise BenchError(f"model '{name}:{arch}': arch given twice")
        params["arch"] = arch
    return name, params


RUN_SPEC_KEYS = ("defense", "label")  # model-spec keys the runner reads (never passed to the model's builder)


def bare_spec(spec):
    """A model spec without the runner's keys (:data:`RUN_SPEC_KEYS`): what builds the model."""
    return {k: v for k, v in spec.items() if k not in RUN_SPEC_KEYS} if isinstance(spec, dict) else spec


def _create(spec, data_root, **extra):
    name, params = parse_spec(spec)
    fn = MODEL.get(name)
    params.update({k: v for k, v in extra.items() if k in block_params(fn)})
    check_params(fn, params, where=f"model '{name}': ")
    return fn(data_root, **params)


def arch_name(spec):
    """The architecture a zoo spec builds: its name, or its ``arch`` (``timm:resnet18`` -> ``resnet18``), followed
    through specs that wrap another (``{name: checkpoint, arch: timm:resnet18}`` -> ``resnet18``)."""
    name, params = parse_spec(spec)
    inner = params.get("arch")
    if inner is None:
        return name
    return arch_name(inner) if isinstance(inner, dict) or ":" in str(inner) else str(inner)


def _normalization(model, name):
    inner = next((m for m in model.modules() if isinstance(m, Normalized)), None) \
        if isinstance(model, nn.Module) else None
    return None if inner is None else getattr(inner, name)


def input_mean(model):
    """The per-channel mean the first :class:`Normalized` inside ``model`` (itself included) subtracts from its
    [0, 1] input, (1, C, 1, 1), or None (no normalization inside)."""
    return _normalization(model, "mean")


def input_std(model):
    """The per-channel standard deviation the first :class:`Normalized` inside ``model`` divides its [0, 1] input
    by, (1, C, 1, 1), or None."""
    return _normalization(model, "std")


def build_model(spec, data_root=None, device="cpu"):
    """Build a zoo model from ``spec``: frozen, in eval mode, on ``device``; ``model.arch_id`` names its
    architecture (:func:`arch_name`) for per-architecture parameters (:func:`blackboxbench.prep.layers.per_arch`).
    Random weights (``pretrained: false``, an architecture without a checkpoint) come from seed 0."""
    with seeded(0):  # a random init is the same in every run; the caller's stream is kept
        model = _create(spec, data_root)
    model.arch_id = arch_name(spec)
    model.requires_grad_(False)
    return model.eval().to(device)


# ---------------------------------------------------------------- checkpoints

def read_or_explain(read, message, hint=""):
    """``read()`` (a file load); anything it raises except a BenchError, from a KeyError to an unpickling error,
    becomes the one line ``message (its first line)hint``."""
    try:
        return read()
    except BenchError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file raises anything
        raise BenchError(f"{message} ({first_line(e, 160)}){hint}") from None


def load_state(path, key="state_dict", strip_prefix="module."):
    """A state dict from a local file: ``ckpt[key]`` when present, else the file itself; a list holding one
    dict is unwrapped (ERAN files); ``strip_prefix`` is removed from the keys (DataParallel's ``module.``)."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"checkpoint {path} is a directory, not a file" if path.is_dir() else
                         f"missing checkpoint {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = read_or_explain(lambda: load_file(str(path)), f"cannot read checkpoint {path}: not a safetensors file")
    else:
        sd = read_or_explain(lambda: torch.load(path, map_location="cpu", weights_only=True),
                             f"cannot read checkpoint {path}: not a PyTorch / safetensors state dict")
    if isinstance(sd, dict) and key and key in sd:
        sd = sd[key]
    if isinstance(sd, (list, tuple)) and len(sd) == 1:
        sd = sd[0]
    if not isinstance(sd, dict):
        raise BenchError(f"checkpoint {path}: no state dict (key '{key}')")
    if strip_prefix:
        sd = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in sd.items()}
    return sd


def _load_into(net, sd, path):
    """Load state dict ``sd`` into ``net``; a misfit names the missing and the unexpected keys (a few of each) or
    the first shape mismatch, in one line."""
    try:  # not strict here: torch's own leniencies (an old BatchNorm's num_batches_tracked) stay
        result = net.load_state_dict(sd, strict=False)
    except RuntimeError as err:  # shapes that differ
        lines = [s.strip() for s in str(err).splitlines() if s.strip()]
        raise BenchError(f"checkpoint {path} does not fit the architecture: {' '.join(lines[1:])[:300]}") from None
    parts = [f"{len(v)} {what} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})"
             for v, what in ((result.missing_keys, "keys missing"), (result.unexpected_keys, "unexpected keys")) if v]
    if parts:
        raise BenchError(f"checkpoint {path} does not fit the architecture: {'; '.join(parts)}")
    return net


# ---------------------------------------------------------------- CIFAR-10 ResNets (data README)

def load_cifar_resnet(net, depth, data_root):
    """``net`` (a :class:`CifarResNet` of ``depth``) with the akamaster checkpoint from the data root."""
    folder = data_path(data_root, "models/akamaster_resnet_cifar10")
    found = sorted(folder.glob(f"resnet{depth}-*.th"))
    if not found:
        raise BenchError(f"missing checkpoint {folder}/resnet{depth}-*.th")
    _load_into(net, load_state(found[0]), found[0])
    return net


def _cifar_resnet(depth):
    def build(data_root, *, pretrained=True):
        net = CifarResNet(depth)
        if pretrained:
            load_cifar_resnet(net, depth, data_root)
        return Normalized(net, IMAGENET_MEAN, IMAGENET_STD)

    build.__name__ = build.__qualname__ = f"cifar_resnet{depth}"
    build.__doc__ = (f"He et al. CIFAR ResNet-{depth} (akamaster checkpoint, data README); normalization mean "
                     f"{IMAGENET_MEAN} std {IMAGENET_STD}. ``pretrained=False``: random init.")
    return build


for _depth in DEPTH_BLOCKS:
    MODEL.register(f"cifar_resnet{_depth}", dataset="cifar10", source="akamaster/pytorch_resnet_cifar10")(
        _cifar_resnet(_depth))


# ---------------------------------------------------------------- digits models (trained on first use)

def _digits_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))


def _digits_cnn():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def _digits_lenet():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _digits_resnet():
    return CifarResNet(in_channels=1, blocks=1, widths=(8, 16, 32))


DIGITS_ARCHS = {"digits_mlp": _digits_mlp, "digits_cnn": _digits_cnn, "digits_lenet": _digits_lenet,
                "digits_resnet": _digits_resnet}


TRAINED_SIDE = {"cifar10": 32, "digits": 8, "mnist": 28}  # image side of the dataset a zoo model is trained on


def trained_side(spec):
    """The image side the zoo model of ``spec`` was trained on (its registry ``dataset``), or None."""
    try:
        name, _ = parse_spec(spec)
        return TRAINED_SIDE.get(MODEL.get(name).registry_meta.get("dataset"))
    except BenchError:
        return None


def cache_dir():
    return Path(os.environ.get("BLACKBOXBENCH_CACHE") or Path.home() / ".cache" / "blackboxbench")


def train_digits(name, *, epochs=30, batch=64, lr=3e-3, seed=0):
    """Train ``name`` on the digits train split, deterministically: the init comes from a forked global RNG
    seeded with ``seed``, the shuffling from a local generator, and it runs on one CPU thread (the result does
    not depend on the thread count; tiny nets train faster so). Adam with a one-cycle schedule, cross-entropy;
    1-4 s per model. Test accuracy (last 500 digits): mlp 94.2 %, cnn 95.8 %, lenet 94.6 %."""
    data = digits(None, split="train")
    x = (data.x - torch.tensor(DIGITS_MEAN).view(1, -1, 1, 1)) / torch.tensor(DIGITS_STD).view(1, -1, 1, 1)
    with seeded(seed):
        net = DIGITS_ARCHS[name]()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * -(-len(x) // batch))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net.train()
        for _ in range(epochs):
            for idx in torch.randperm(len(x), generator=gen).split(batch):
                loss = F.cross_entropy(net(x[idx]), data.y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    finally:
        torch.set_num_threads(threads)
    return net.eval()


def cache_folder(path):
    """Create the cache folder of ``path`` before anything is trained into it: a one-line error when it cannot be
    (a file, not writable, a bad BLACKBOXBENCH_CACHE)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise BenchError(f"cache folder {path.parent} cannot be used ({e.strerror or e}); set BLACKBOXBENCH_CACHE to "
                         "a writable folder") from None


def load_cached(path):
    """A cached file (``torch.save``); an unreadable one is a one-line error saying how to make it again."""
    return read_or_explain(lambda: torch.load(path, map_location="cpu", weights_only=True),
                           f"cached file {path} cannot be read", "; delete it and it is made again")


def cached_or_trained(net, file, train):
    """``net`` with the weights cached as ``file`` in :func:`cache_dir`; on first use ``train()`` returns the trained
    net, whose weights are saved (atomically: a concurrent reader never sees a partial file)."""
    path = cache_dir() / file
    trained = train_once(path, train, lambda out: out.state_dict())
    if trained is not None:
        return trained
    try:
        net.load_state_dict(load_cached(path))
    except RuntimeError as e:
        raise BenchError(f"cached file {path} does not fit the model ({first_line(e, 120)}); delete it and it "
                         "is made again") from None
    return net


def train_once(path, train, saved=lambda out: out):
    """``train()``'s result, ``saved(result)`` written to the cache file ``path`` (atomically), when the cache does
    not hold ``path``; None when it does, made before or by another process while this one waited for it: one
    process at a time trains a given file (:func:`training_lock`), so the workers of a sweep or of pytest-xdist that
    need the same artifact train it once, not once each (on one GPU, each at a fraction of its speed)."""
    if path.is_file():
        return None
    cache_folder(path)
    with training_lock(path):
        if path.is_file():
            return None
        out = train_noted(train, path)
        kept = saved(out)
        bad = nonfinite(kept)
        if bad is not None:
            raise BenchError(f"training {path.name} ended with non-finite values in {bad or 'its result'}; nothing "
                             "was cached (try another seed or a smaller learning rate)")
        save_atomic(kept, path)
        return out


def nonfinite(obj, where=""):
    """The key path (``"state.conv.weight"``) of the first floating tensor of ``obj`` (tensors, dicts and lists of
    them) that holds a NaN or an infinity, or None: a training that diverged is not cached as if it had worked."""
    if isinstance(obj, torch.Tensor):
        return where if obj.is_floating_point() and not torch.isfinite(obj).all() else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        bad = nonfinite(v, f"{where}.{k}" if where else str(k))
        if bad is not None:
            return bad
    return None


@contextlib.contextmanager
def training_lock(path):
    """An exclusive advisory lock (``flock``) for training the cache file ``path``, held by one process of this
    machine at a time, in a per-user folder of the temporary directory (not in the cache, whose listing stays the
    cached files). Released by the system if its holder dies. Without ``fcntl`` (Windows) or a usable lock
    folder, no lock: concurrent first uses then each train, and :func:`save_atomic` keeps the file whole."""
    try:
        import fcntl
        folder = Path(tempfile.gettempdir()) / f"blackboxbench-locks-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        name = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:24]
        handle = open(folder / f"{name}.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def train_noted(train, path):
    """``train()``, with a line before and after on a terminal's stderr: a first use that trains for minutes (a
    flow, a c-Glow, a tiny detector) is not silent, even under ``--quiet``. Nothing is written where stderr is
    not a terminal (a log, a test), so one-line errors stay one line."""
    import time

    from tqdm import tqdm

    tty = sys.stderr.isatty()
    if tty:
        tqdm.write(f"training {path.name} on first use (cached in {path.parent}) ...", file=sys.stderr)
    start = time.perf_counter()
    out = train()
    if tty:
        tqdm.write(f"trained {path.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return out


def save_atomic(obj, path):
    """``torch.save(obj)`` to ``path`` through a temporary file in its folder, so that a concurrent reader never
    sees a partial file."""
    cache_folder(path)
    tmp = None
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException as e:  # a failed write leaves no partial file (each try would leave one more)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise BenchError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _digits_model(name, pretrained):
    net = DIGITS_ARCHS[name]()
    if pretrained:
        net = cached_or_trained(net, f"{name}-{DIGITS_VERSION}.pt", lambda: train_digits(name))
    return Normalized(net, DIGITS_MEAN, DIGITS_STD)


@MODEL.register("digits_mlp", dataset="digits")
def digits_mlp(data_root=None, *, pretrained=True):
    """MLP 64-512-10 (ReLU), trained on first use on the digits train split and cached."""
    return _digits_model("digits_mlp", pretrained)


@MODEL.register("digits_cnn", dataset="digits")
def digits_cnn(data_root=None, *, pretrained=True):
    """CNN conv3x3(16)-conv3x3(32)-maxpool-fc64-fc10 (ReLU), trained on first use and cached."""
    return _digits_model("digits_cnn", pretrained)


@MODEL.register("digits_lenet", dataset="digits")
def digits_lenet(data_root=None, *, pretrained=True):
    """LeNet-style conv3x3(16)-maxpool-conv3x3(32)-maxpool-fc64-fc10 (ReLU), trained on first use and cached."""
    return _digits_model("digits_lenet", pretrained)


@MODEL.register("digits_resnet", dataset="digits")
def digits_resnet(data_root=None, *, pretrained=True):
    """A residual net for the digits (the CIFAR ResNet layout with one BasicBlock per stage, 8/16/32 channels,
    1-channel input), so that skip-connection attacks (SGM, IAA, GhostNet) run on the embedded data; trained on
    first use and cached."""
    return _digits_model("digits_resnet", pretrained)


# ---------------------------------------------------------------- ImageNet architectures (timm, torchvision)

def _hub_checkpoint(url):
    """Where torch.hub caches the file of ``url`` (it is only used when already there)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]


def _timm_local_weights(arch):
    """A local file with timm's pretrained weights of ``arch`` (HF hub cache or torch.hub cache), or None."""
    import timm
    from huggingface_hub import try_to_load_from_cache

    cfg = timm.models.get_pretrained_cfg(arch)
    if cfg is None:
        return None, "no pretrained weights are known for it"
    places = []
    if cfg.hf_hub_id:
        for fname in ("model.safetensors", "pytorch_model.bin"):
            hit = try_to_load_from_cache(cfg.hf_hub_id, fname)
            if isinstance(hit, str):
                return Path(hit), ""
        places.append(f"the Hugging Face cache (repo {cfg.hf_hub_id})")
    if cfg.url:
        if _hub_checkpoint(cfg.url).is_file():
            return _hub_checkpoint(cfg.url), ""
        places.append(str(_hub_checkpoint(cfg.url)))
    return None, f"put the weights in {' or '.join(places)}" if places else "no download source is known"


@MODEL.register("timm", source="timm.create_model", ranges={"num_classes": "int [1, inf)",
                "mean": "list (-inf, inf)", "std": "list (0, inf)", "resize": "int [1, inf)"})
def timm_model(data_root, *, arch, num_classes=1000, pretrained=False, checkpoint=None, mean=None, std=None,
               resize=None):
    """A timm architecture: random init, a local ``checkpoint`` (path relative to the data root or absolute),
    or ``pretrained`` weights found in the local caches (never downloaded). mean/std default to the model's
    pretrained config (ImageNet's for most); ``resize`` rescales inputs to ``resize`` x ``resize``."""
    import timm

    if not timm.is_model(arch):
        raise BenchError(f"unknown timm arch '{arch}'{close_matches(arch, timm.list_models())}")
    file = None
    if pretrained and checkpoint is None:
        file, hint = _timm_local_weights(arch)
        if file is None:
            raise BenchError(f"timm:{arch} pretrained weights are not available offline: {hint}, "
                             f"or pass checkpoint=<path>")
    overlay = {"file": str(file)} if file else None
    net = from_cached_weights(lambda: timm.create_model(arch, pretrained=file is not None, num_classes=num_classes,
                                                        pretrained_cfg_overlay=overlay), f"timm:{arch}", file)
    if checkpoint is not None:
        path = data_path(data_root, checkpoint)
        _load_into(net, load_state(path), path)
    cfg = getattr(net, "pretrained_cfg", {}) or {}
    return Normalized(net, mean or cfg.get("mean", IMAGENET_MEAN), std or cfg.get("std", IMAGENET_STD), resize)


def from_cached_weights(build, what, file):
    """``build()``, which loads pretrained weights cached as ``file`` (None: none): a corrupt or foreign file is a
    one-line error naming it, not a traceback from the unpickler or raw size-mismatch lines."""
    if file is None:
        return build()
    return read_or_explain(build, f"{what}: the cached pretrained weights {file} cannot be loaded",
                           "; delete or replace the file")


def torchvision_weights(arch, names, kind, pretrained):
    """torchvision's DEFAULT weights of ``arch`` (one of ``names``) when ``pretrained`` and torch.hub already caches
    them (never downloaded), else None (random init); one-line errors name ``kind`` ("torchvision", ...)."""
    import torchvision

    if arch not in names:
        raise BenchError(f"unknown {kind} arch '{arch}'{close_matches(arch, names)}")
    if not pretrained:
        return None
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    if not _hub_checkpoint(weights.url).is_file():
        raise BenchError(f"{kind}:{arch} pretrained weights are not available offline: put "
                         f"{weights.url.rsplit('/', 1)[-1]} in {_hub_checkpoint(weights.url).parent}, "
                         f"or pass checkpoint=<path>")
    return weights


def torchvision_classifiers(arch):
    """torchvision's image classifiers (float and quantizable); a one-line error when ``arch`` is another of its
    models (a detector, a segmentation, video or optical-flow model): built as a classifier it fails deep inside,
    or reaches for its backbone's weights online."""
    import torchvision.models as tvm

    names = tvm.list_models(module=tvm) + tvm.list_models(module=tvm.quantization)
    if arch not in names and arch in tvm.list_models():
        kinds = (("a detection", tvm.detection, "; name: torchvision_det takes it"),
                 ("a segmentation", tvm.segmentation, ""), ("a video", tvm.video, ""),
                 ("an optical-flow", tvm.optical_flow, ""))
        kind, hint = next(((k, h) for k, m, h in kinds if arch in tvm.list_models(module=m)), ("another task's", ""))
        raise BenchError(f"torchvision:{arch} is {kind} model, not an image classifier{hint}")
    return names


@MODEL.register("torchvision", source="torchvision.models.get_model", ranges={"num_classes": "int [1, inf)",
                "mean": "list (-inf, inf)", "std": "list (0, inf)", "resize": "int [1, inf)"})
def torchvision_model(data_root, *, arch, num_classes=1000, pretrained=False, checkpoint=None, mean=None,
                      std=None, resize=None):
    """A torchvision architecture: random init, a local ``checkpoint``, or the DEFAULT ``pretrained`` weights
    when torch.hub already caches them (never downloaded). mean/std default to ImageNet's."""
    import torchvision

    weights = torchvision_weights(arch, torchvision_classifiers(arch), "torchvision", pretrained and checkpoint is None)
    try:
        net = from_cached_weights(lambda: torchvision.models.get_model(arch, weights=weights, num_classes=num_classes),
                                  f"torchvision:{arch}", weights and _hub_checkpoint(weights.url))
    except ValueError as err:
        raise BenchError(f"torchvision:{arch}: {err}") from None
    if checkpoint is not None:
        path = data_path(data_root, checkpoint)
        _load_into(net, load_state(path), path)
    return Normalized(net, mean or IMAGENET_MEAN, std or IMAGENET_STD, resize)


# ---------------------------------------------------------------- generic checkpoint loader

@MODEL.register("checkpoint", source="a local state dict or TorchScript file",
                ranges={"mean": "list (-inf, inf)", "std": "list (0, inf)", "resize": "int [1, inf)"})
def checkpoint(data_root, *, path, arch=None, mean=None, std=None, strip_prefix="module.", key="state_dict",
               resize=None):
    """Weights from ``path`` (relative to the data root or absolute) loaded into ``arch``, a zoo spec built
    without weights (e.g. "cifar_resnet20", "timm:resnet18"); mean/std/resize default to that entry's.
    With ``arch=None`` the file is a TorchScript module, normalized by mean/std when given."""
    file = data_path(data_root, path)
    if not file.is_file():
        raise BenchError(f"checkpoint {file} is a directory, not a file" if file.is_dir() else
                         f"missing checkpoint {file}")
    if arch is None:
        try:
            with warnings.catch_warnings():  # torch's deprecation notice of jit.load: a second stderr line per run
                warnings.filterwarnings("ignore", message=r".*torch\.jit\.load.* is deprecated",
                                        category=FutureWarning)
                net = torch.jit.load(str(file), map_location="cpu")
        except RuntimeError as err:
            raise BenchError(f"{file} is not a TorchScript file (set arch to load a state dict): "
                             f"{str(err).splitlines()[0]}") from None
        return Normalized(net, mean, std, resize)
    model = _create(arch, data_root, pretrained=False)
    if not isinstance(getattr(model, "net", None), nn.Module):
        raise BenchError(f"checkpoint arch {arch!r}: not an architecture a state dict loads into (a zoo name, "
                         "timm:<arch> or torchvision:<arch>)")
    sd = load_state(file, key, strip_prefix)
    if any(k.startswith("net.") for k in sd) and all(k.startswith("net.") or k in ("mean", "std") for k in sd):
        _load_into(model, sd, file)  # a zoo model's own state dict (build_model(...).state_dict()), normalization too
    else:
        _load_into(model.net, sd, file)
    if mean is not None:
        model.mean = _per_channel(mean)
    if std is not None:
        model.std = _per_channel(std)
    if resize is not None:
        model.resize = resize
    return model
