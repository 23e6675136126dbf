"""What the attacker trains on its own images, shared by the families: the ``train_images`` check, the cache key of
a trained artifact (the spec sheet's G2 cache) and the cache itself, in ``BLACKBOXBENCH_CACHE``/<kind>/<key>.pt.

Used by the weight-space refinement of transfer attacks (``transfer/weights.py``: LGV, SWA, ...), by the learned
probe priors of decision attacks (``query/priors.py``: NonLinear-BA, PSBA), by AdvFlow's flow (``query/advflow.py``),
by NP-attack's neural process (``query/np_attack.py``) and by the c-Glows of CG-Attack and MCG (``query/cg_attack.py``,
``query/mcg.py``).
:func:`once_per_run` keeps what a block trained or loaded for the later steps of its run.
"""
import hashlib
import weakref

import torch
import torch.nn.functional as F

from ..errors import BenchError
from .inference import bare_model
from .models import cache_dir, load_cached, train_once

CACHE_VERSION = 2  # 2: shapes and dtypes in the key


def digest(*parts):
    """A short hash of numbers, strings, tensors and dicts and lists of them (dict keys sorted)."""
    h = hashlib.sha256()

    def add(p):
        if isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())  # numpy has no bf16
        elif isinstance(p, dict):
            for k in sorted(p):
                h.update(repr(k).encode())
                add(p[k])
        elif isinstance(p, (list, tuple)):
            h.update(f"[{len(p)}]".encode())
            for q in p:
                add(q)
        else:
            h.update(repr(p).encode())

    for p in parts:
        add(p)
    return h.hexdigest()[:24]


def cache_key(block, params, models, data, seed, device):
    """The cache key of a trained artifact: block, resolved parameters, the weights and buffers of the model (or
    list of models) it learns from, the training images and labels, the seed and the device type."""
    models = models if isinstance(models, (list, tuple)) else [models]
    states = [dict(bare_model(m).state_dict()) for m in models]
    # digest hashes a tensor's bytes only: the shapes and dtypes enter the key beside them (images of another
    # layout, or weights stored in another dtype, with the same bytes are another training)
    layout = [[(k, str(t.dtype), list(t.shape)) for k, t in s.items()] for s in states] + \
        [(str(t.dtype), list(t.shape)) for t in (data.x, data.y)]
    return digest(CACHE_VERSION, block, params, states, data.x, data.y, layout, int(seed), torch.device(device).type)


def cached(kind, key, train):
    """The object ``train()`` returns (tensors, lists and dicts of them), cached as ``<kind>/<key>.pt``."""
    path = cache_dir() / kind / f"{key}.pt"
    out = train_once(path, train)
    return load_cached(path) if out is None else out


_RUN = {}  # key -> (the objects whose ids the key holds, value): kept so that those ids stay theirs
_KEEP = 8


def once_per_run(key, alive, build):
    """``build()`` once per ``key`` in this process (the last ``_KEEP`` keys). A key holds the ``id`` of run objects
    (the run's asset first, then e.g. its surrogates): ``alive`` keeps them referenced with the value, so that no
    later object can take one of those ids while the key is remembered; the run's asset only weakly, the entry
    going with it (at the run's end: a later run's key holds its own asset's id and could never use it), so a
    sweep does not keep the trained networks of its last finished runs."""
    if key in _RUN:
        return _RUN[key][1]
    value = build()
    if len(_RUN) >= _KEEP:
        _RUN.pop(next(iter(_RUN)))
    owner, *others = alive if isinstance(alive, tuple) else (alive,)
    try:
        weakref.finalize(owner, _RUN.pop, key, None)  # runs as the owner goes, before its id can be reused
    except TypeError:  # not weakly referenceable: held as the other objects are
        others.append(owner)
    _RUN[key] = (others, value)
    return value


def trained_model(ctx, block, kind, data, params, make, train):
    """A frozen network of the run's attacker, built once per run: ``make(shape)`` loaded with the state dict
    ``train(x)["state"]`` returns for the images ``x`` (on the run's device) of the ``train_images`` asset ``data``,
    cached on disk as ``<kind>/<key>.pt`` with ``params`` (architecture and training, including ``seed``) in the
    key."""
    images = ctx.assets.get(data)
    key = (block, id(images), tuple(sorted(params.items())), str(ctx.device))

    def build():
        train_set = train_data(ctx, block, data, same_size=True)
        disk = cache_key(block, params, [], train_set, params["seed"], ctx.device)
        out = cached(kind, disk, lambda: train(train_set.x.to(ctx.device)))
        net = make(train_set.x.shape[1:])
        net.load_state_dict(out["state"])
        return net.to(ctx.device).eval().requires_grad_(False)

    return once_per_run(key, images, build)


def train_data(ctx, block, name, same_size=False):
    """The ``train_images`` asset ``name``; an error when it holds any of the run's evaluation images
    (``ctx.pool``): the attacker would train on the images it is evaluated on. ``same_size``: also an error when
    its images' shape is not the run's (a generative model of images of one size: AdvFlow's flow, NP-attack's
    ANP, the c-Glows)."""
    if name not in ctx.assets:
        raise BenchError(f"'{block}': no train_images asset named '{name}' (declare assets: "
                         f"{{{name}: {{name: train_images}}}})")
    data = ctx.assets[name]
    have = tuple(data.x.shape[1:])
    if same_size and have != (want := tuple(ctx.problem.x.shape[1:])):
        raise BenchError(f"'{block}': the train_images asset '{name}' holds {' x '.join(map(str, have))} images, "
                         f"the run's are {' x '.join(map(str, want))}; its model learns images of one size: declare "
                         f"the asset's spec (assets: {{{name}: {{name: train_images, spec: ...}}}}) at the run's size")
    if ctx.pool is not None:
        shared = shared_images(data.x, ctx.pool.x)
        if shared:
            raise BenchError(f"'{block}': {shared} of the {len(data.y)} images of asset '{name}' are "
                             "evaluation images of this run; train on other images (the default trains on "
                             "cifar10_test_sdp200.npz: evaluate on cifar10_test_first100.npz)")
    return data


def shared_images(x, others):
    """How many of the images ``x`` are (bit for bit) among ``others``."""
    seen = {digest(im) for im in others}
    return sum(digest(im) in seen for im in x)


def augment(x, gen, pad=None):
    """Random crop after zero padding by ``pad`` pixels (default: side / 8, CIFAR's 4) and a horizontal flip with
    probability 1/2, per image, from ``gen`` (a CPU generator)."""
    n, _, h, w = x.shape
    pad = max(1, h // 8) if pad is None else pad
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=gen).to(x.device)
    flip = (torch.rand(n, generator=gen) < 0.5).to(x.device)
    iy = oy[:, None] + torch.arange(h, device=x.device)
    ix = ox[:, None] + torch.arange(w, device=x.device)
    b = torch.arange(n, device=x.device)[:, None, None]
    out = F.pad(x, (pad,) * 4).permute(0, 2, 3, 1)[b, iy[:, :, None], ix[:, None, :]].permute(0, 3, 1, 2)
    return torch.where(flip.view(-1, 1, 1, 1), out.flip(3), out)
