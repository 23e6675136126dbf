"""Defenses behind the oracle (registry ``DEFENSE``): the target a query attack sees is the defended model, so no
block can see or bypass a defense (BlackboxBench Supp. A-4, B-A, D-F; spec sheet section 7, gap G7).

A config names them on a query run, ``defense: {name: rnd, sigma: 0.02}``, or as a list that composes:
``defense: [jpeg, {name: rnd, sigma: 0.02}]``. The first listed sees the query first (it sits closest to the
attacker); the last one wraps the model directly. Registered defenses:

* ``rnd`` (Qin et al., NeurIPS 2021): Gaussian noise on every query, ``f(clip(x, 0, 1) + sigma * N(0, I))``, no
  clip after the noise (the RND authors' hook); fresh noise per query.
* ``aaa_linear``, ``aaa_sine`` (Chen et al., NeurIPS 2022, the authors' ``victim.py``): the logits are
  post-processed by ``num_iter`` Adam steps towards a target margin around attractors; top-1 is kept.
* ``jpeg`` (quality 75): JPEG compression of every query (libjpeg through torchvision, the same bytes as PIL),
  straight-through (BPDA) gradients with ``differentiable: true``, for a transfer evaluation that needs them.

Adversarially trained targets are models, not defenses: the zoo entries with registry meta ``defense="at"`` (see
:mod:`blackboxbench.prep.small_models`) are tagged ``at`` in the summary and the leaderboard (:func:`label`).

**Randomness.** A randomized defense draws from the *defender* streams: one counter-based stream per sample
(:class:`~blackboxbench.rng.Streams`), keyed by the run seed mixed with :data:`DEFENDER_SALT`, so they are apart
from the attacker's streams (``ctx.rng``). A sample's k-th query gets the k-th draw of its own stream whatever
batch it is in, so defended results do not depend on the batch size either. The evaluations that are not the
attack (clean accuracy under the defense, the majority-of-k re-evaluation of the returned image) draw from the
*evaluation* streams (:data:`EVAL_SALT`), never from the defender's; in a transfer run each defended target
has evaluation streams of its own (:func:`target_salt`).

Each defense is a callable ``d(forward, x, rng) -> logits``: ``forward`` is what it wraps (the next defense or the
model), ``x`` the queries (m, C, H, W) in [0, 1], ``rng`` a :class:`RowStreams` (random numbers per query row).
"""
import hashlib
import math
from functools import partial

import torch

from .config import check_spec, spec_to_dict
from .errors import BenchError
from .family import audit_logits
from .registry import DEFENSE, MODEL
from .rng import MASK, Streams, mix64_int

DEFENDER_SALT = 0x5EED_DEFE_0000_0001  # the defender streams: apart from the attacker's (same seed)
EVAL_SALT = 0x5EED_DEFE_0000_0002      # the evaluation streams: clean accuracy and re-evaluation under a defense
REEVAL_DRAWS = 5  # the independent re-evaluation of a returned image under a randomized defense: majority of 5


def derived_seed(seed, salt):
    """A seed in [0, 2^63) derived from the run ``seed`` and ``salt`` (splitmix64), for streams apart from the
    attacker's."""
    return mix64_int((int(seed) ^ salt) & MASK) & ((1 << 63) - 1)


class RowStreams:
    """Random numbers for the rows of one call, each row from the stream of the sample that owns it (``who``);
    a sample with several rows gets consecutive parts of its stream, in row order (see
    :meth:`~blackboxbench.rng.StreamView.bits`)."""

    def __init__(self, streams, who):
        uniq, self.rows = torch.unique(who, return_inverse=True)
        self.view = streams.view(uniq)

    def normal(self, shape):
        return self.view.normal(shape, rows=self.rows)


class Defense:
    """Base of the defenses: ``randomized`` (answers are random), ``name`` and the parameters for the label."""

    randomized = False

    def __init__(self, name, **params):
        self.name, self.params = name, params

    def __str__(self):
        args = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({args})" if args else self.name

    def __call__(self, forward, x, rng):
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------- RND

class RND(Defense):
    randomized = True

    def __init__(self, sigma):
        super().__init__("rnd", sigma=sigma)
        self.sigma = sigma

    def __call__(self, forward, x, rng):
        noise = rng.normal(x.shape[1:]).to(x)
        return forward(x.clamp(0, 1) + self.sigma * noise)


# RND sigma: the paper gives none (Tables V-VI list sigma 0); 0.02 is the RND paper's CIFAR-10/ImageNet setting and
# the AAA authors' square.py `inRND` value for standard models (0.05 for robust ones). Spec sheet open item 9.
@DEFENSE.register("rnd", paper="Qin et al., Random Noise Defense, NeurIPS 2021", randomized=True,
                  ranges={"sigma": "[0, 1]"})
def rnd(*, sigma=0.02):
    """Gaussian noise of std ``sigma`` ([0, 1] pixel units) on every query, from the defender streams."""
    return RND(float(sigma))


# ---------------------------------------------------------------------------------------------------- AAA

def floor_quantize(x):
    """The AAA authors' input quantization ``floor(255 x) / 255``; the 1e-4 keeps a float32 grid value k/255,
    whose product with 255 may land just below k, at k."""
    return torch.floor(x * 255 + 1e-4) / 255


def aaa_target(margin, interval, kind, reverse_step, dev=0.5):
    """The AAA target margin and attractor of original margins ``margin`` (authors' ``victim.py``):
    attractor ``a = tau (round(m / tau + dev) - dev)``; linear ``t = a - alpha (m - a)``; sine
    ``t = m - 0.7 tau sin(pi (1 - 2 (m - a) / tau))``."""
    attractor = ((margin / interval + dev).round() - dev) * interval
    if kind == "linear":
        target = attractor - reverse_step * (margin - attractor)
    else:
        target = margin - 0.7 * interval * torch.sin((1 - 2 / interval * (margin - attractor)) * math.pi)
    return target, attractor


# The authors' loss is the mean over the rows of one model call: square.py's `--batch_size` (default 128, the
# value of every command in their README) chunks each query batch into calls of 128 rows (victim.py `forward`).
AAA_BATCH = 128


def aaa_logits(z0, *, kind, interval, reverse_step, calibration, iterations, lr, temperature):
    """AAA's post-processed logits of clean logits ``z0`` (m, K): ``iterations`` Adam steps (lr ``lr``, betas
    0.9 / 0.999, eps 1e-8: torch's defaults, as the authors use) from ``z0`` on
    ``|margin(z) - t| + calibration * |softmax(z)[top1_0] - max softmax(z0 / T)|``, where ``margin`` is the gap
    between the current two largest logits and ``top1_0`` the original top class.

    The gradient is written out (sign(margin - t) on the current top-2; the softmax derivative for the
    calibration) and Adam's update is torch's, in place: the same steps as autograd with ``torch.optim.Adam``
    (tests/test_defenses.py checks it against that), at a third of the cost. The authors average the loss over a
    batch of :data:`AAA_BATCH` rows; here every row's loss is divided by that fixed number instead, so each row
    evolves independently of the other rows (an answer does not depend on its batch) and takes exactly the
    authors' steps in a full batch. The scale matters through Adam's eps: the logits of classes with a
    probability near 1e-9 get gradients near eps, and with the plain sum (B = 1) they moved by up to ~14 more over
    the 100 steps than in the authors' batch of 128 (ResNet-20, CIFAR-10; benchmarks/RESULTS.md, issue 12,
    seventeenth session).
    """
    z0 = z0.detach().float()
    m = z0.shape[0]
    if m == 0:
        return z0
    p_max = torch.softmax(z0 / temperature, 1).amax(1, keepdim=True)
    top2 = z0.topk(2, 1)
    top1 = top2.indices[:, :1]
    target, _ = aaa_target(top2.values[:, 0] - top2.values[:, 1], interval, kind, reverse_step)
    target = target[:, None]
    z, g = z0.clone(), torch.empty_like(z0)
    exp_avg, exp_avg_sq = torch.zeros_like(z0), torch.zeros_like(z0)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(1, iterations + 1):
        v, i = z.topk(2, 1)
        s = torch.sign(v[:, :1] - v[:, 1:] - target)  # d|margin - t| / d margin
        p = torch.softmax(z, 1)
        p1 = p.gather(1, top1)
        c = (calibration * torch.sign(p1 - p_max)) * p1  # d(calibration term) / dz = c * (onehot(top1_0) - p)
        torch.mul(p, -c, out=g)
        g.scatter_add_(1, top1, c)
        g.scatter_add_(1, i, torch.cat([s, -s], 1))
        g.div_(AAA_BATCH)  # the authors' mean over their batch, as a fixed number: rows stay independent
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        z.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
    return z


class AAA(Defense):
    def __init__(self, kind, **params):
        super().__init__(f"aaa_{kind}", **params)
        self.kind, self.p = kind, params

    def __call__(self, forward, x, rng):
        return aaa_logits(forward(floor_quantize(x)), kind=self.kind, **self.p)


# The authors' code defaults (victim.py, square.py; spec sheet section 7). Open item 10: tau 6 for both, the
# square.py CLI value their experiments pass to both classes (the AAALinear class default is 4); temperature 1 (no
# tuned value for a CIFAR ResNet-20 in their get_tuned_temperature table).
AAA_RANGES = {"interval": "(0, inf)", "reverse_step": "[0, inf)", "calibration": "[0, inf)",
              "iterations": "int [0, inf)", "lr": "(0, inf)", "temperature": "(0, inf)"}


@DEFENSE.register("aaa_linear", paper="Chen et al., Adversarial Attack on Attackers, NeurIPS 2022 (AAA-Linear)",
                  randomized=False, ranges=AAA_RANGES)
def aaa_linear(*, interval=6.0, reverse_step=1.0, calibration=5.0, iterations=100, lr=0.1, temperature=1.0):
    """AAA-Linear: the target margin reflects the margin about its attractor (``reverse_step`` alpha)."""
    return AAA("linear", interval=float(interval), reverse_step=float(reverse_step),
               calibration=float(calibration), iterations=int(iterations), lr=float(lr),
               temperature=float(temperature))


@DEFENSE.register("aaa_sine", paper="Chen et al., Adversarial Attack on Attackers, NeurIPS 2022 (AAA-Sine)",
                  randomized=False, ranges=AAA_RANGES)
def aaa_sine(*, interval=6.0, reverse_step=1.0, calibration=5.0, iterations=100, lr=0.1, temperature=1.0):
    """AAA-Sine: the target margin is the margin minus a sine of its offset to the attractor (amplitude 0.7 tau);
    ``reverse_step`` is unused by the sine form (kept for the authors' signature)."""
    return AAA("sine", interval=float(interval), reverse_step=float(reverse_step),
               calibration=float(calibration), iterations=int(iterations), lr=float(lr),
               temperature=float(temperature))


# ---------------------------------------------------------------------------------------------------- JPEG

def jpeg(x, quality=75, differentiable=False):
    """JPEG compression and decompression of images ``x`` (m, C, H, W) in [0, 1] (rounded to uint8 first; libjpeg
    through torchvision: the same bytes as PIL's ``save(format="jpeg", quality=q)``, 4:2:0 chroma). With
    ``differentiable``, the gradient passes straight through (BPDA, Athalye et al. 2018)."""
    from torchvision.io import decode_jpeg, encode_jpeg

    if x.shape[0] == 0:
        return x
    u8 = (x.detach().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    out = torch.stack(decode_jpeg(encode_jpeg(list(u8), quality=quality))).to(x.device, x.dtype) / 255
    return x + (out - x).detach() if differentiable else out


class JPEG(Defense):
    def __init__(self, quality, differentiable):
        super().__init__("jpeg", quality=quality)
        self.quality, self.differentiable = quality, differentiable

    def __call__(self, forward, x, rng):
        return forward(jpeg(x, self.quality, self.differentiable))


@DEFENSE.register("jpeg", paper="Dziugaite et al. 2016 / Guo et al., ICLR 2018 (JPEG compression)",
                  randomized=False, ranges={"quality": "int [1, 100]"})
def jpeg_defense(*, quality=75, differentiable=False):
    """JPEG compression of every query at ``quality``; ``differentiable``: straight-through gradients."""
    return JPEG(int(quality), bool(differentiable))


# ---------------------------------------------------------------------------------------------------- wiring

def parse_defenses(value, source, key="defense"):
    """A config's ``defense`` (None, a name, ``{name, params}`` or a list of them) -> list of specs, each
    checked against its registry entry (a one-line error naming the key)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]" if isinstance(value, list) else key
        spec = spec_to_dict(item, source, where)
        check_spec(DEFENSE, spec, source, where)
        out.append(spec)
    return out


def build_defenses(specs):
    """The defense objects of checked ``specs``, in order."""
    return [DEFENSE.get(s["name"])(**{k: v for k, v in s.items() if k != "name"}) for s in specs]


def model_tag(spec):
    """``"at"`` when the zoo entry ``spec`` names is adversarially trained (registry meta ``defense``), else
    None."""
    name = spec.get("name") if isinstance(spec, dict) else spec
    try:
        return MODEL.get(name).registry_meta.get("defense")
    except BenchError:
        return None


def label(defenses, model_spec=None):
    """The leaderboard's ``defense`` cell: ``at`` for an adversarially trained target, then the defenses joined by
    ``+`` (``rnd(sigma=0.02)``), or ``none``."""
    parts = ([model_tag(model_spec)] if model_spec is not None and model_tag(model_spec) else [])
    parts += [str(d) for d in defenses]
    return "+".join(parts) or "none"


class DefendedTarget:
    """A model behind a list of defenses, answering queries per sample: ``target(x, who)`` with ``who`` (m,) the
    sample of each row (its randomness comes from ``streams``, the defender's or the evaluation's). The defenses
    see the whole call (each answers every row on its own: a row's draws come from its sample's stream). The model
    is forwarded in chunks of ``chunk`` images (the attacker's queries, like an undefended target's), or, given
    ``size``, in calls of exactly ``size`` images (:func:`~blackboxbench.family.audit_logits`; ``name`` names the
    model in its error): an evaluation's answer for an image then depends on the image and its draw only, not on
    the images evaluated with it, whose number moves logits slightly on a GPU."""

    def __init__(self, model, defenses, streams, chunk=128, size=None, name="the defended model"):
        self.model, self.defenses, self.streams, self.chunk = model, list(defenses), streams, chunk
        self.size, self.name = size, name
        self.randomized = any(d.randomized for d in self.defenses)

    def __str__(self):
        return "+".join(str(d) for d in self.defenses)

    def _forward(self, x):
        if self.size:
            return audit_logits(self.model, x, self.name, self.size)
        if x.shape[0] <= self.chunk:
            return self.model(x).float()
        return torch.cat([self.model(x[i:i + self.chunk]).float() for i in range(0, x.shape[0], self.chunk)])

    def with_streams(self, streams, size=None, name=None):
        """The same defended model drawing from other streams (e.g. the evaluation streams); ``size``: its
        forwards in calls of that many images (an evaluation's, see the class)."""
        return DefendedTarget(self.model, self.defenses, streams, self.chunk, size, name or self.name)

    def __call__(self, x, who):
        rng = RowStreams(self.streams, who)
        f = self._forward
        for d in reversed(self.defenses):
            f = partial(d, f, rng=rng)
        with torch.no_grad():
            return f(x)


def target_salt(key):
    """The evaluation salt of one defended transfer target, from its ``key`` (its name and defense label): each
    target draws from streams of its own, so a randomized target's answers do not depend on which targets are
    listed before it or on their order."""
    return EVAL_SALT ^ int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def defense_streams(seed, n, device, salt=DEFENDER_SALT):
    """The defender (or, with :data:`EVAL_SALT`, the evaluation) streams of ``n`` samples of a run with
    ``seed``."""
    return Streams(derived_seed(seed, salt), n, device)


def majority_adv(target, x, who, is_adv_label, draws):
    """The independent re-evaluation of images ``x`` (one per sample ``who``) under a defended ``target``:
    ``draws`` answers each (one when the target is deterministic); returns ``(adversarial by a strict majority,
    adversarial votes)``."""
    k = draws if target.randomized else 1
    m = x.shape[0]
    labels = target(x.repeat(k, 1, 1, 1), who.repeat(k)).argmax(1).view(k, m)
    votes = torch.stack([is_adv_label(labels[j]) for j in range(k)]).sum(0)
    return 2 * votes > k, votes

