"""The ``transfer`` family: the unified transfer-attack loop (Alg. 3 of the BlackboxBench paper, Supp. F-C),
batched, and its worker.

Block contracts (``ctx`` is the :class:`~blackboxbench.context.BlockContext`; ``state`` is one dict per batch that
blocks may use to keep per-sample tensors such as momentum):

* ``refine(ctx, models, **params) -> models``: surrogate refinement on the list of surrogates, once per run
  before any sample; it must end with one model (``logit_ensemble``, ``loss_ensemble`` or ``longitudinal`` fuse
  several into a :class:`~blackboxbench.transfer.refine.ModelSet`, whose policy says which members' losses make
  the attack loss at each iteration).
* ``auxiliary(ctx, **params) -> {name: value}``: auxiliary information I (Alg. 3 line 2), once per batch before
  the loop, on the batch's context (``ctx.aux`` holds what earlier auxiliary blocks returned). The merged mapping
  is ``ctx.aux`` of every later block; a value with a ``close()`` method (a feature hook) is closed when the
  batch ends, even on an error.
* ``transform(ctx, x, **params) -> x'``: input transformation. It may return K stacked copies (K*n, C, H, W); the
  loss then sees the label repeated K times. Listed transforms compose in order. The surrogate sees
  ``hyper.copies_per_forward`` copies per forward (default 1: one forward and backward per copy, as the authors'
  ``general_grad`` loops over Admix samples and SI copies and as torchattacks does; on 2 CPU cores it is 25-37 %
  faster at 100 images, 1.4-1.6x slower at 4, see benchmarks/RESULTS.md); 0 forwards all K copies as one batch (fewer, larger calls, which a
  launch-bound GPU may prefer: not measured yet). Both give the same gradient for any surrogate whose rows are
  independent; GhostNet's ghosts differ between the two (each forward draws new ones), each run stays
  reproducible and batch-independent.
* ``loss(ctx, logits, label, **params) -> (N,)``: per-sample loss that the attack *maximizes*.
* ``gradient(ctx, grad_fn, x, state, **params) -> grad``: gradient calculation; ``grad_fn(x)`` is the gradient
  of the summed loss of the transformed input, and a listed gradient block wraps the one before it.
* ``direction(ctx, grad, state, **params) -> direction``: update direction (e.g. momentum). Listed ones chain.
* ``update(ctx, x_adv, direction, **params) -> x_adv``: one step of size ``ctx.alpha``, then projection.

A block may declare at registration ``requires=("direction:momentum",)`` (a block it reads the state of) and
``conflicts=("gradient:pregrad",)`` (blocks it cannot be listed with, itself included when it keeps state under a
fixed key); :func:`~blackboxbench.transfer.compat.check_compatible` turns a violation into a one-line config error
naming both blocks, before anything runs.

``ctx.model`` is the refined surrogate, ``ctx.t`` / ``ctx.iterations`` the loop position. The output is projected
to the eps ball and [0, 1] and quantized to uint8 inside it (``Problem.quantize``). Every sample takes the same number of
iterations, so a unit of work is one whole batch of ``batch_size`` samples; their random numbers come from their
own streams, so a sample's result does not depend on the batch.

**A target's verdicts.** A record's ``targets[name]`` holds the target's verdicts on the clean image
(``clean_correct``, which decides whether the sample counts for that target) and on the returned uint8 image
(``success``). On a GPU a model's answer moves slightly with the batch it is forwarded in (kernels chosen per
shape), so both come from calls of one shape (:func:`~blackboxbench.family.audit_logits`: alone on a CPU), whose
rows are computed independently: a verdict depends on the image only, not on ``batch_size`` or the images
evaluated with it. Behind a defense they are draws from the target's own evaluation streams, its model answering
in the same calls of one shape. (Until 2026-12-05, twenty-sixth session, ``success`` was the forward of the whole
batch and a second forward, the audit ``audit_adv``, checked it alone; records written then still carry it, and the
summary's ``n_audit_disagree`` counts their disagreements.)
"""
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, List

import torch

from ..context import BlockContext, Pool
from ..defense import DefendedTarget, defense_streams, label, target_salt
from ..errors import BenchError, ConfigError, describe
from ..evaluation import sample_metrics, summarize_transfer
from ..family import (BlockKind, Family, ModelKey, WholeBatchWorker, audit_call_size, audit_logits, base_records,
                      check_outputs, forward_logits, pick_targets, to_uint8)
from ..prep.inference import fixed_rows
from ..registry import AUXILIARY, DIRECTION, FAMILY, GRADIENT, LOSS, REFINE, TRANSFORM, UPDATE, block_label
from ..rng import drawing_from, run_stream
from ..threat import Problem
from .compat import check_compatible
from .refine import active

REFINE_SALT = 1  # run-level stream of the refine blocks


def _chain_transforms(ctx, transforms, x):
    for t in transforms:
        out = t(ctx, x)
        if not (isinstance(out, torch.Tensor) and out.shape[1:] == x.shape[1:] and out.shape[0] and
                out.shape[0] % x.shape[0] == 0):
            raise BenchError(f"transform {block_label(t)} returned {describe(out)} for an input of shape "
                             f"{tuple(x.shape)}: a transform returns K stacked copies of its input's rows, shaped "
                             f"(K x {x.shape[0]}, {', '.join(map(str, x.shape[1:]))})")
        x = out
    return x


def _expect_like(out, ref, kind, block):
    """``out`` if it is a tensor shaped like ``ref``, of its dtype (a gradient, direction or update block's
    contract), else a one-line error naming the block."""
    shaped = isinstance(out, torch.Tensor) and out.shape == ref.shape
    if shaped and out.dtype == ref.dtype:
        return out
    raise BenchError(f"{kind} {block_label(block)} returned {f'a tensor of {out.dtype}' if shaped else describe(out)}: "
                     f"it returns a tensor shaped like the images, {tuple(ref.shape)}, of their dtype {ref.dtype}")


def _checked_models(out, block):
    """``out`` as a list if it is a non-empty list or tuple of callables (a refine block's contract: the surrogates
    it made), else a one-line error naming the block."""
    if not (isinstance(out, (list, tuple)) and out and all(callable(m) for m in out)):
        raise BenchError(f"refine {block_label(block)} returned {describe(out)}: a refine block returns a non-empty "
                         "list of models (callables from images to logits)")
    return list(out)


def _checked_aux(out, block):
    """``out`` if it is a dict keyed by names (an auxiliary block's contract), else a one-line error."""
    if not (isinstance(out, dict) and all(isinstance(k, str) for k in out)):
        raise BenchError(f"auxiliary {block_label(block)} returned {describe(out)}: an auxiliary block returns a "
                         "dict of named values for the loop's blocks (ctx.aux)")
    return out


@dataclass
class TransferAttack:
    """A built transfer attack. Built by :func:`blackboxbench.builder.build_attack`."""

    name: str
    iterations: int
    alpha: float
    loss: Callable
    update: Callable
    transforms: List[Callable] = field(default_factory=list)
    gradients: List[Callable] = field(default_factory=list)
    directions: List[Callable] = field(default_factory=list)
    refiners: List[Callable] = field(default_factory=list)
    auxiliaries: List[Callable] = field(default_factory=list)
    random_start: float = 0.0
    copies_per_forward: int = 1
    meta: dict = field(default_factory=dict)

    def refine(self, ctx, models):
        """Apply the refiners to the list of surrogates; returns the single model to attack."""
        for r in self.refiners:
            models = _checked_models(r(ctx, models), r)
        if len(models) != 1:
            raise BenchError(f"attack '{self.name}': {len(models)} surrogates but no refine block fuses them "
                             "(add e.g. logit_ensemble)")
        return models[0]

    def loss_grad(self, ctx, transforms):
        """``fn(x)``: the gradient of the summed loss of ``transforms`` applied to ``x`` (n rows, the samples)."""
        problem = ctx.problem
        label = problem.target if problem.targeted else problem.y

        def fn(x):
            x = x.detach().clone().requires_grad_(True)  # a transform writing to x.data leaves the iterate alone
            xt = _chain_transforms(ctx, transforms, x)
            k = xt.shape[0] // x.shape[0]
            per = self.copies_per_forward or k
            if per >= k:
                return torch.autograd.grad(self._loss(ctx, xt, label.repeat(k)), x)[0]
            # the model forwards ``per`` copies at a time; the transforms' graph is differentiated once
            grads = [self._rows_grad(ctx, part, label.repeat(part.shape[0] // x.shape[0]))
                     for part in xt.detach().split(per * x.shape[0])]
            return torch.autograd.grad(xt, x, torch.cat(grads))[0]

        return fn

    def _rows_grad(self, ctx, rows, label):
        rows = rows.detach().requires_grad_(True)
        return torch.autograd.grad(self._loss(ctx, rows, label), rows)[0]

    def _loss(self, ctx, xt, label):
        """The summed attack loss of ``xt`` at iteration ``ctx.t``: over the members a model set makes active
        (:func:`~blackboxbench.transfer.refine.active`), weighted."""
        return sum(w * self._checked_loss(ctx, m(xt), label).sum() for w, m in active(ctx.model, ctx.t))

    def _checked_loss(self, ctx, logits, label):
        out = self.loss(ctx, logits, label)
        if not isinstance(out, torch.Tensor) or out.shape != label.shape:
            raise BenchError(f"loss {block_label(self.loss)} returned {describe(out)} for {label.shape[0]} rows: a "
                             f"loss returns one value per row, shaped ({label.shape[0]},)")
        return out

    def grad_fn(self, ctx, state):
        """The gradient function at ``ctx`` (its model and loop position), wrapped by the gradient blocks; they
        get ``ctx.raw_grad``, the same gradient without the input transformations, and ``ctx.grad_of(x, model)``,
        the gradient with them on another model (one member of an ensemble: CWA, AdaEA)."""
        ctx = ctx.at(raw_grad=self.loss_grad(ctx, ()),
                     grad_of=lambda x, model: self.loss_grad(ctx.at(model=model), self.transforms)(x))
        fn = self.loss_grad(ctx, self.transforms)
        for g in self.gradients:
            fn = partial(g, ctx, fn, state=state)
        return fn

    def run(self, ctx, on_iterate=None):
        """Craft adversarial images for ``ctx.problem`` on the refined surrogate ``ctx.model``; ``on_iterate(t,
        x_adv)`` (optional) sees the iterate after each iteration ``t`` (0-based). A random surrogate (GhostNet)
        draws from the samples' streams ``ctx.rng`` meanwhile."""
        with drawing_from(ctx.model, ctx.rng):
            return self._run(ctx, on_iterate)

    def _run(self, ctx, on_iterate):
        aux = {}
        try:
            for a in self.auxiliaries:
                aux.update(_checked_aux(a(ctx.at(aux=dict(aux))), a))
            return self._loop(ctx.at(aux=aux), on_iterate)
        finally:
            for value in aux.values():
                if callable(getattr(value, "close", None)):
                    value.close()

    def _loop(self, ctx, on_iterate=None):
        problem, state = ctx.problem, {}
        x_adv = problem.x.clone()
        if self.random_start > 0:
            noise = ctx.rng.uniform(problem.x.shape[1:]).to(x_adv.dtype) * 2 - 1
            x_adv = problem.project(x_adv + self.random_start * noise)
        for t in range(self.iterations):
            c = ctx.at(t=t)
            d = self.grad_fn(c, state)(x_adv.clone() if self.gradients else x_adv)  # a block may write to x
            if self.gradients:
                _expect_like(d, x_adv, "gradient", self.gradients[-1])
            for direction in self.directions:
                d = _expect_like(direction(c, d, state), x_adv, "direction", direction)
            x_adv = problem.project(_expect_like(self.update(c, x_adv, d), x_adv, "update", self.update))
            if on_iterate is not None:
                on_iterate(t, x_adv)
        return problem.quantize(x_adv)


class TransferWorker(WholeBatchWorker):
    """One whole batch per step: clean check and targets on the surrogate, the attack, every target model."""

    def __init__(self, family, run):
        self.run, self.attack, self.threat = run, run.attack, run.threat
        self.surrogates = run.models["surrogates"]
        self.targets = list(zip(run.model_names["targets"], run.models["targets"]))
        self.audit_size = audit_call_size(run.fixed_batch, run.device)
        # A target's defenses (its spec's ``defense``) wrap it, drawing per sample from evaluation streams of that
        # target's own (keyed by its name and defenses), whatever targets come before it; its model answers in
        # the audit's calls of one shape, so that a verdict does not depend on the images evaluated with it.
        per = run.defenses.get("targets") or [[] for _ in self.targets]
        self.labels = [label(ds, name.split("+")[0]) for (name, _), ds in zip(self.targets, per)]
        n, seed = len(run.data.y), run.streams.seed
        self.defended = [DefendedTarget(m, ds, defense_streams(seed, n, run.device, target_salt(f"{name}={lab}")),
                                        size=self.audit_size, name=name)
                         if ds else None for (name, m), ds, lab in zip(self.targets, per, self.labels)]
        self.pool = Pool(run.data.x.clone(), run.data.y.clone())  # the blocks' copy: writing to it changes no sample
        base = BlockContext(problem=None, rng=run_stream(run.streams.seed, run.device, REFINE_SALT),
                            surrogates=tuple(self.surrogates), assets=run.assets, pool=self.pool)
        self.model = self.attack.refine(base, list(self.surrogates))
        super().__init__()

    def _parts(self, n):
        """The rows of a batch of ``n`` samples that each attack call takes: all of them, or under ``fixed_batch``
        calls of exactly that many samples (:func:`~blackboxbench.prep.inference.fixed_rows`), so that every
        forward and backward of the surrogate, feature hooks and auxiliary steps included, has one shape."""
        k = self.run.fixed_batch
        return fixed_rows(n, k) if k else [torch.arange(n)]

    def _craft(self, idx, x, y):
        """Clean check and targets on the surrogate, then the attack, for samples ``idx`` (distinct but for a
        padding copy of the last): (x_adv, clean correct, target or None, attack paths or None). A random
        surrogate (GhostNet) draws from these samples' streams meanwhile."""
        rng = self.run.streams.view(idx)
        with drawing_from(self.model, rng):
            return self._attack(rng, x, y, idx)

    def _attack(self, rng, x, y, idx):
        run, t = self.run, self.threat
        logits = forward_logits(self.model, x, "the surrogate", chunk=max(1, len(x)))
        correct = logits.argmax(1) == y
        given = None if run.data.given_target is None else run.data.given_target[idx].to(x.device)
        target = pick_targets(t, logits, y, rng, given)
        # the blocks' copy: the output check, the metrics, the records and the targets' evaluation read x, y, target
        problem = Problem(x, y, t["eps"], t["norm"], target, run.data.num_classes).copy()
        ctx = BlockContext(problem=problem, rng=rng, surrogates=tuple(self.surrogates), assets=run.assets,
                           pool=self.pool, model=self.model, iterations=self.attack.iterations,
                           alpha=self.attack.alpha)
        every = run.save_path_every
        paths = [[(0, im)] for im in to_uint8(x)] if every else None

        def keep(it, x_it):  # the path: every ``every`` iterations, as a returned image would be
            if every and (it + 1) % every == 0 and it + 1 < self.attack.iterations:
                for path, im in zip(paths, to_uint8(problem.quantize(x_it))):
                    path.append((it + 1, im))

        return self.attack.run(ctx, keep if every else None), correct, target, paths

    def step(self):
        index = self.take()
        if not index:
            return []
        run, t, dev = self.run, self.threat, self.run.device
        t0 = time.perf_counter()
        idx = torch.tensor(index, dtype=torch.long)
        x, y = run.data.x[idx].to(dev), run.data.y[idx].to(dev)
        n, every = len(index), run.save_path_every
        parts = [self._craft(idx[r], x[r], y[r]) for r in self._parts(n)]
        x_adv, correct, target, paths = zip(*parts)  # the padding rows (at the end) dropped
        x_adv, correct = torch.cat(x_adv)[:n], torch.cat(correct)[:n]
        target = None if target[0] is None else torch.cat(target)[:n]
        paths = None if paths[0] is None else [p for part in paths for p in part][:n]
        problem = Problem(x, y, t["eps"], t["norm"], target, run.data.num_classes)
        check_outputs(x_adv, x, t["eps"], t["norm"], self.attack.name)
        # a sample whose target is its label is not attacked (as a query run): its record is the clean image's
        valid = torch.ones_like(y, dtype=torch.bool) if target is None else target != y
        x_adv = torch.where(valid.view(-1, *([1] * (x.dim() - 1))), x_adv, x)
        metrics = sample_metrics(x_adv, x, run.lpips)
        results = {}
        who = idx.to(dev)
        for (name, m), defended in zip(self.targets, self.defended):
            # calls of one shape, an image's answer its own (behind a defense: draws from the target's evaluation
            # streams, the clean images first)
            logits = partial(audit_logits, m, name=name, size=self.audit_size) if defended is None else \
                (lambda z, d=defended, n=name: forward_logits(lambda v: d(v, who), z, n, chunk=z.shape[0] or 1))
            clean_ok = logits(x).argmax(1) == y
            adv = problem.is_adv_label(logits(x_adv).argmax(1)) & valid
            results[name] = (clean_ok.tolist(), adv.tolist())
        per = (time.perf_counter() - t0) / len(index)
        images = to_uint8(x_adv) if run.save_adv else None
        final = to_uint8(x_adv) if every else None
        records, valid = base_records(index, y, target, correct), valid.tolist()
        for i, r in enumerate(records):
            r.update(attacked=bool(valid[i]), time=per, **{k: v[i] for k, v in metrics.items()},
                     targets={n: {"clean_correct": bool(c[i]), "success": bool(s[i]), "defense": lab}
                              for (n, (c, s)), lab in zip(results.items(), self.labels)})
            if images is not None and valid[i]:
                r["_image"] = images[i]
            if every and valid[i]:
                r["_path"] = paths[i] + [(self.attack.iterations, final[i])]
        return records


class TransferFamily(Family):
    name = "transfer"
    blocks = {"refine": BlockKind(REFINE, many=True), "auxiliary": BlockKind(AUXILIARY, many=True),
              "transform": BlockKind(TRANSFORM, many=True), "loss": BlockKind(LOSS, default="ce"),
              "gradient": BlockKind(GRADIENT, many=True),
              "direction": BlockKind(DIRECTION, many=True), "update": BlockKind(UPDATE, default="step")}
    hyper = {"iterations": 1, "alpha": "eps/10", "random_start": 0, "copies_per_forward": 1}
    model_keys = {"surrogates": ModelKey("surrogate", True, True),
                  "targets": ModelKey("target", True, True, forward_only=True)}
    record_fields = {"targets": (dict,)}
    run_keys = {"save_path_every": (int,)}  # the attack path of every sample, every k iterations (runner.save_path)
    surrogate_may_be_target = True  # a target equal to the surrogate reports the white-box success rate
    columns = (("asr", "higher"), ("asr_low", None), ("asr_high", None), ("mean_l2", "lower"), ("median_l2", "lower"),
               ("mean_linf", "lower"), ("median_linf", "lower"), ("mean_ssim", "higher"), ("median_ssim", "higher"), ("mean_lpips", "lower"),
               ("median_lpips", "lower"), ("n_audit_disagree", "lower"))

    def build(self, name, blocks, hyper, meta):
        if int(hyper["iterations"]) != hyper["iterations"] or hyper["iterations"] < 1:
            raise ConfigError("must be a positive integer", meta["source"], "attack.hyper.iterations")
        if hyper["alpha"] <= 0 or hyper["random_start"] < 0:
            raise ConfigError("alpha must be > 0 and random_start >= 0", meta["source"], "attack.hyper")
        per = hyper["copies_per_forward"]
        if int(per) != per or per < 0:
            raise ConfigError("must be an integer >= 0 (0: all copies in one forward)", meta["source"],
                              "attack.hyper.copies_per_forward")
        check_compatible(blocks, meta["source"])
        return TransferAttack(name, int(hyper["iterations"]), float(hyper["alpha"]), blocks["loss"],
                              blocks["update"], transforms=blocks["transform"], gradients=blocks["gradient"],
                              directions=blocks["direction"], refiners=blocks["refine"],
                              auxiliaries=blocks["auxiliary"],
                              random_start=float(hyper["random_start"]), copies_per_forward=int(per),
                              meta=meta)

    def check_experiment(self, exp, attack, source):
        n = len(exp.get("surrogates") or [])
        if n > 1 and not attack.refiners:  # the loop attacks one model: several need a refine block that fuses them
            raise ConfigError(f"{n} surrogates, but attack '{attack.name}' has no refine block to fuse them: add "
                              "one, e.g. attack: {recipe: ..., blocks: {refine: [logit_ensemble]}}", source,
                              "surrogates")

    def worker(self, run):
        return TransferWorker(self, run)

    def summarize(self, records):
        return summarize_transfer(records)


FAMILY.register("transfer", paper="BlackboxBench Supp. F-C, Alg. 3")(TransferFamily())
