"""The query families ``score`` and ``decision``: the unified query loop (Alg. 1 and 2 of the BlackboxBench paper,
Supp. F-A/F-B), batched over slots with continuous batching.

An attack is three blocks: ``init`` -> repeat (``perturb`` -> ``accept``) until each sample succeeds or exhausts
its budget. Block contracts (``ctx`` is the :class:`~blackboxbench.context.BlockContext` of the samples being
attacked; every tensor carries them on dim 0, and blocks use local indices 0..n-1):

* ``init(ctx, **params) -> state``: a dict of per-sample tensors; it must hold ``x_adv`` (n, C, H, W) and
  ``success`` (n,) bool. It may query (e.g. to find a starting adversarial point). Every init of a recipe returns
  the same keys, shapes and dtypes (a sample's state lives in a slot of fixed shape).
* ``perturb(ctx, state, **params) -> proposal``: any object (typically candidate images); it may query.
* ``accept(ctx, state, proposal, **params) -> state``: queries the proposal if needed, keeps what improves, and
  sets ``success`` where the oracle has seen ``x_adv`` adversarial (score attacks) or where the adversarial
  ``x_adv`` lies inside the eps ball (decision attacks).

**Continuous batching.** ``batch_size`` is the number of slots. A sample enters a slot (clean check, target
label, ``init``), is attacked one iteration per ``step`` together with every other sample in a slot, and leaves
when it succeeds, exhausts its budget, or stalls (an iteration that asks nothing for it: it cannot progress).
The next unstarted sample takes its slot at the next ``fill``, so the model sees full batches until the dataset
drains. Blocks receive the samples in slots as a compact working set (their context and a private copy of their
state), rebuilt only when a sample enters or leaves, so they may update the state dict they receive in place.

**Verified success is the record.** A claimed success is confirmed by the oracle on the exact uint8 image the
attack will return (projected to the eps ball and [0, 1], quantized inside the ball: ``Problem.quantize``): one counted query,
or none when that image is the one the oracle answered for the sample in its most recent call (see
:meth:`blackboxbench.oracle.Oracle.confirm`). The success rule ``majority`` (for randomized targets) instead asks
the image ``draws`` times, each a counted query, and needs a strict majority. If the claim is not confirmed, the
sample keeps being attacked. A sample's record holds that confirmation and the query count at which it was made;
the worker's own forward of the returned image is an audit: a disagreement is flagged on the record
(``audit_adv``) and counted in the summary, never turned into a failure. On a GPU an image's logits move with the
batch it is forwarded in, so the audit forwards in calls of one shape (alone on a CPU, 32 padded on CUDA, k under
``fixed_batch: k``; :func:`blackboxbench.family.audit_logits`): its verdict depends on the image only, not on which
samples finished with it.

**Defenses** (``defense:`` of a query run, :mod:`blackboxbench.defense`) sit inside the oracle. The clean check that
picks the samples to attack stays on the undefended model, so every defense of a target attacks the same samples;
a record also holds ``clean_correct_defended`` (one answer of the defended model, drawn from the evaluation
streams). The audit is the *undefended* re-evaluation of the returned image; ``reeval_adv`` is the *defended* one:
the majority of :data:`~blackboxbench.defense.REEVAL_DRAWS` independent answers of a randomized defense (one of a
deterministic one), from the evaluation streams, never counted as queries; both forward the defended model in the
audit's calls of one shape. **EOT** (``attack: {hyper: {eot: k}}``)
sends k queries per logical evaluation and aggregates them (:class:`~blackboxbench.oracle.Oracle`).
"""
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..config import check_keys
from ..context import BlockContext, Pool
from ..defense import EVAL_SALT, REEVAL_DRAWS, DefendedTarget, defense_streams, label, majority_adv
from ..errors import BenchError, ConfigError, QueryError
from ..evaluation import sample_metrics, summarize_query
from ..family import (BlockKind, Family, ModelKey, audit_call_size, audit_logits, base_records, check_outputs,
                      pick_targets, to_uint8)
from ..oracle import Oracle
from ..registry import ACCEPT, FAMILY, INIT, PERTURB, block_label
from ..threat import Problem

# Tables V-VI: 10,000 queries untargeted, 100,000 targeted.
DEFAULT_MAX_QUERIES = {False: 10_000, True: 100_000}
AUDIT_EVERY_S = 1.0  # finished samples wait at most this long (or for a full batch) for the audit forward
SUCCESS_RULES = ("single", "majority")


@dataclass
class QueryAttack:
    """A built query attack: three bound blocks. Built by :func:`blackboxbench.builder.build_attack`."""

    name: str
    family: str
    init: Callable
    perturb: Callable
    accept: Callable
    meta: dict = field(default_factory=dict)
    eot: int = 1  # queries per logical evaluation (EOT), each charged


def check_state(state, x, block, slots=None, kind="init"):
    """The state contract of ``init`` (and of ``accept``, ``kind``): a dict of per-sample tensors (dim 0: the n
    samples) with ``x_adv`` shaped like the images and ``success`` an (n,) bool tensor, and with ``slots`` (the slot
    state an earlier init made) the same keys, per-sample shapes and dtypes; a violation is one line naming the
    block. Metadata only: no tensor is read, so the check costs no device sync."""
    n, bad = x.shape[0], None
    if not isinstance(state, dict):
        bad = f"returned {type(state).__name__}, not a dict of per-sample tensors"
    elif missing := [k for k in ("x_adv", "success") if k not in state]:
        bad = f"must return state['{missing[0]}']"
    else:
        wrong = [k for k, v in state.items() if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n]
        if wrong:
            bad = f"returned state['{wrong[0]}'] that is not a tensor with one row per sample ({n})"
        elif state["x_adv"].shape != x.shape:
            bad = f"returned state['x_adv'] of shape {tuple(state['x_adv'].shape)}, the images' is {tuple(x.shape)}"
        elif state["x_adv"].dtype != x.dtype:
            bad = f"returned state['x_adv'] of {state['x_adv'].dtype}, the images' is {x.dtype}"
        elif state["success"].dtype != torch.bool or state["success"].dim() != 1:
            bad = f"returned state['success'] of dtype {state['success'].dtype} and shape " \
                  f"{tuple(state['success'].shape)}: it is an (n,) bool tensor"
        elif slots is not None and set(state) != set(slots):
            bad = f"returned state keys {sorted(state)}, earlier {sorted(slots)}"
        elif slots is not None and (changed := [k for k, v in state.items() if v.shape[1:] != slots[k].shape[1:]
                                               or v.dtype != slots[k].dtype]):
            k = changed[0]
            bad = (f"returned state['{k}'] of {state[k].dtype} and per-sample shape {tuple(state[k].shape[1:])}, "
                   f"earlier {slots[k].dtype} and {tuple(slots[k].shape[1:])}")
    if bad:
        raise BenchError(f"{kind} block {block_label(block)} {bad}")


def _call(block, kind, *args):
    """``block(*args)``; a query the oracle refuses for its shape is one line naming the block that asked."""
    try:
        return block(*args)
    except QueryError as e:
        raise BenchError(f"{kind} block {block_label(block)}: {e}") from None


def _gather(state, idx):
    return {k: v[idx] for k, v in state.items()}


def rule_label(rule):
    return "single" if rule["name"] == "single" else f"majority of {rule['draws']}"


def verify(ctx, state, draws=1):
    """Confirm the claims of success in ``state`` on the exact images to be returned.

    Returns ``(now, rows, images)``: ``now`` (n,) bool, the samples confirmed now (None when nothing was claimed),
    and the confirmed images with their local rows. Unconfirmed claims are withdrawn from ``state['success']``.
    """
    claim = state["success"].nonzero().squeeze(1)
    if claim.numel() == 0:
        return None, claim, None
    p = ctx.problem.sub(claim)
    candidate = p.quantize(p.project(state["x_adv"][claim]))
    if draws == 1:
        answer, ok = ctx.oracle.confirm(candidate, claim)
        good = p.is_adv(answer) & ok
    else:
        answer, ok = ctx.oracle.confirm(candidate, claim, draws)
        labels = answer.argmax(-1) if answer.dtype.is_floating_point else answer
        votes = (p.is_adv_label(torch.where(ok, labels, -1))).sum(1)
        good = 2 * votes > draws
    now = torch.zeros_like(state["success"])
    now[claim[good]] = True
    state["success"] = state["success"].index_put((claim[~good],), torch.tensor(False, device=claim.device))
    return now, claim[good], candidate[good]


class QueryWorker:
    """Continuous batching of a query attack over ``run.slots`` slots (see the module docstring)."""

    def __init__(self, family, run):
        t, data = run.threat, run.data
        self.family, self.run, self.attack, self.threat = family, run, run.attack, t
        self.model, self.model_name = run.models["model"][0], run.model_names["model"][0]
        self.device, self.slots = run.device, run.slots
        self.audit_size = audit_call_size(run.fixed_batch, run.device)
        self.draws = t["success_rule"].get("draws", 1)
        n, seed = len(data.y), run.streams.seed
        defenses = run.defenses.get("model", [[]])[0]
        self.defense = label(defenses, self.model_name)
        self.defended = DefendedTarget(self.model, defenses, defense_streams(seed, n, self.device)) \
            if defenses else None
        self.evaluator = None if self.defended is None else \
            self.defended.with_streams(defense_streams(seed, n, self.device, EVAL_SALT), self.audit_size,
                                       self.model_name)
        self.oracle = Oracle(self.model, n, t["max_queries"], data.num_classes, t["feedback"],
                             data.x.shape[1:], name=self.model_name, defense=self.defended, eot=self.attack.eot,
                             device=self.device, randomized=self.model_name in run.randomized)
        self.surrogates = tuple(run.models.get("surrogates", ()))
        self.pool = Pool(data.x.clone(), data.y.clone())  # the blocks' copy: writing to it changes no sample
        s, dev = self.slots, self.device
        self.gid = torch.full((s,), -1, dtype=torch.long, device=dev)
        self.occupied = 0  # slots holding a sample, kept on the host: fill and busy then need no device sync
        self.drained = False  # fill found no more samples to feed
        self.sx = torch.zeros((s, *data.x.shape[1:]), dtype=data.x.dtype, device=dev)
        self.sy = torch.zeros(s, dtype=torch.long, device=dev)
        self.starget = torch.zeros(s, dtype=torch.long, device=dev)
        self.state = None
        self.started = {}   # dataset index -> (perf_counter at admission, its record so far)
        self.ready = []     # clean-checked samples waiting for a slot: (their record so far, target)
        self.ws = None      # working set: (slots, ctx, own, state), rebuilt when a sample enters or leaves
        self.unaudited, self.audited = [], time.perf_counter()  # finished samples waiting for the audit forward
        self.path_every = run.save_path_every  # > 0: keep each sample's iterate every k queries (its path)
        self.paths = {}     # dataset index -> [(queries used, uint8 image)]
        self.mark = torch.zeros(s, dtype=torch.long, device=dev)  # queries // path_every at the last snapshot

    # ------------------------------------------------------------------------------------------ admission
    @property
    def busy(self):
        return self.occupied > 0 or bool(self.unaudited)

    def fill(self, feed):
        done = []
        while self.occupied < self.slots and (self.ready or not self.drained):
            free = (self.gid < 0).nonzero().squeeze(1)
            if free.numel() == 0:
                break
            if not self.ready:
                chunk = [i for _, i in zip(range(self.slots), feed)]
                if not chunk:
                    self.drained = True  # the dataset is drained: later calls return at once
                    break
                done += self._screen(chunk)
                continue
            take, self.ready = self.ready[:free.numel()], self.ready[free.numel():]
            done += self._start(take, free[:len(take)])
        return done

    def _screen(self, index):
        """Clean check and target labels of new samples (model forwards not counted as attacker queries); the
        samples not to attack are finished at once. The clean forward has the audit's calls of one shape
        (:func:`audit_logits`), so which samples are attacked does not depend on the ones checked with them."""
        data, t = self.run.data, self.threat
        idx = torch.tensor(index, dtype=torch.long)
        x, y = data.x[idx].to(self.device), data.y[idx].to(self.device)
        logits = audit_logits(self.model, x, self.model_name, self.audit_size)
        correct = logits.argmax(1) == y
        defended_ok = [None] * len(index) if self.evaluator is None else \
            (self.evaluator(x, idx.to(self.device)).argmax(1) == y).tolist()
        given = None if data.given_target is None else data.given_target[idx].to(self.device)
        target = pick_targets(t, logits, y, self.run.streams.view(idx), given)
        attack = correct if target is None else correct & (target != y)
        records = base_records(index, y, target, correct)
        targets = [None] * len(index) if target is None else target.tolist()
        done, skip = [], self.run.skip
        for i, r, a, tg, d in zip(index, records, attack.tolist(), targets, defended_ok):
            r.update(clean_correct_defended=d, defense=self.defense, eot=self.attack.eot)
            if a and i not in skip:
                self.ready.append((r, tg))
            else:
                r.update(attacked=False, success=False, queries=0, l2=0.0, linf=0.0, ssim=1.0, lpips=None,
                         time=0.0, audit_adv=None, reeval_adv=None, reeval_votes=None, stalled=False,
                         success_rule=rule_label(t["success_rule"]))
                if a:  # a cascade's earlier run fooled it (runner.link_cascade)
                    r["fooled_by"] = skip[i]
                done.append(r)
        return done

    def _context(self, gids, x, y, target):
        """``(ctx, own)``: the blocks' context, whose problem holds copies of the clean images, labels and targets
        (a block that writes to them in place changes only its own view), and the worker's, alike but for the
        problem, which verification, projection, the output check, the metrics and the audit read."""
        t = self.threat
        own = Problem(x, y, t["eps"], t["norm"], target, self.run.data.num_classes)
        ctx = BlockContext(problem=own.copy(), rng=self.run.streams.view(gids), oracle=self.oracle.view(gids),
                           surrogates=self.surrogates, assets=self.run.assets, pool=self.pool)
        return ctx, replace(ctx, problem=own)

    def _start(self, ready, slots):
        """``init`` for ready samples entering ``slots``; the ones decided at once finish here."""
        now = time.perf_counter()
        index = [r["index"] for r, _ in ready]
        gids = torch.tensor(index, dtype=torch.long, device=self.device)
        x, y = self.run.data.x[gids.cpu()].to(self.device), self.run.data.y[gids.cpu()].to(self.device)
        target = None if not self.threat["targeted"] else torch.tensor([t for _, t in ready], device=self.device)
        ctx, own = self._context(gids, x, y, target)
        state = _call(self.attack.init, "init", ctx)
        check_state(state, x, self.attack.init, self.state)
        state = {k: v.clone() for k, v in state.items()}  # the worker's own copy
        for r, _ in ready:
            self.started[r["index"]] = (now, r)
        ok, rows, images = verify(own, state, self.draws)
        leaving = own.oracle.spent() if ok is None else ok | own.oracle.spent()
        self._place(state, slots, x, y, target, gids)
        if self.path_every:  # a path starts at the clean image, then the iterate after init
            uint8 = to_uint8(x)
            self.paths.update({g: [(0, uint8[k])] for k, g in enumerate(index)})
            self.mark[slots] = 0
            self._snapshot(slots, own, state)
        self.ws = None
        if not bool(leaving.any()):
            return []
        return self._finish(slots, leaving, state, own, rows, images, torch.zeros_like(leaving))

    def _place(self, state, slots, x, y, target, gids):
        if self.state is None:
            self.state = {k: torch.zeros((self.slots, *v.shape[1:]), dtype=v.dtype, device=v.device)
                          for k, v in state.items()}
        for k, v in state.items():
            self.state[k][slots] = v
        self.sx[slots], self.sy[slots], self.gid[slots] = x, y, gids
        self.occupied += len(slots)
        if target is not None:
            self.starget[slots] = target

    # ------------------------------------------------------------------------------------------ iteration
    def step(self):
        if self.ws is None:
            slots = (self.gid >= 0).nonzero().squeeze(1)
            if slots.numel() == 0:
                return self._audit(force=True)
            target = self.starget[slots] if self.threat["targeted"] else None
            ctx, own = self._context(self.gid[slots], self.sx[slots], self.sy[slots], target)
            self.ws = (slots, ctx, own, _gather(self.state, slots))
        slots, ctx, own, state = self.ws
        before = ctx.oracle.counts
        proposal = _call(self.attack.perturb, "perturb", ctx, state)
        state = _call(self.attack.accept, "accept", ctx, state, proposal)
        if not isinstance(state, dict) or state.keys() != self.state.keys():
            raise BenchError(f"accept block {block_label(self.attack.accept)} returned "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}: it returns "
                             f"the state dict, with the keys init gave it ({', '.join(sorted(self.state))})")
        check_state(state, own.problem.x, self.attack.accept, self.state, "accept")
        self.ws = (slots, ctx, own, state)
        if self.path_every:
            self._snapshot(slots, own, state)
        stalled = ctx.oracle.counts == before  # nothing was asked for these samples: they cannot progress
        # One check (one sync) per iteration: did a sample claim success, use up its budget or stall?
        if not bool((state["success"] | ctx.oracle.spent() | stalled).any()):
            return []
        ok, rows, images = verify(own, state, self.draws)
        leaving = ctx.oracle.spent() | stalled if ok is None else ok | ctx.oracle.spent() | stalled
        if not bool(leaving.any()):
            return []
        for k, v in state.items():
            self.state[k][slots] = v
        self.ws = None
        return self._finish(slots, leaving, state, own, rows, images, stalled)

    def _snapshot(self, slots, ctx, state):
        """Add the iterate of every sample that has passed a multiple of ``path_every`` queries since its last
        snapshot to its path (projected and quantized, as a returned image would be)."""
        counts = ctx.oracle.counts
        level = torch.div(counts, self.path_every, rounding_mode="floor")
        due = level > self.mark[slots]
        if not bool(due.any()):
            return
        at = due.nonzero().squeeze(1)
        self.mark[slots[at]] = level[at]
        p = ctx.problem.sub(at)
        images = to_uint8(p.quantize(p.project(state["x_adv"][at])))
        for k, (g, q) in enumerate(zip(self.gid[slots[at]].tolist(), counts[at].tolist())):
            self.paths[g].append((int(q), images[k]))

    def _finish(self, slots, leaving, state, ctx, rows, images, stalled):
        """Records of the local samples ``leaving`` (verified ones return their confirmed image); frees their
        slots. The records wait for the audit (:meth:`_audit`), which forwards the returned images of many samples
        in one call."""
        t, p = self.threat, ctx.problem
        out = p.quantize(p.project(state["x_adv"]))
        success = torch.zeros_like(leaving)
        if rows is not None and rows.numel():
            out[rows] = images
            success[rows] = True
        go = leaving.nonzero().squeeze(1)
        x_out, sub = out[go], p.sub(go)
        check_outputs(x_out, sub.x, t["eps"], t["norm"], self.attack.name)
        metrics = sample_metrics(x_out, sub.x, self.run.lpips)
        queries = ctx.oracle.counts[go].tolist()
        success, stalled = success[go].tolist(), stalled[go].tolist()
        now, rule = time.perf_counter(), rule_label(t["success_rule"])
        records = []
        final = to_uint8(x_out) if self.path_every else None
        for j, g in enumerate(self.gid[slots[go]].tolist()):
            start, r = self.started.pop(g)
            r.update(attacked=True, success=bool(success[j]), queries=int(queries[j]), time=now - start,
                     stalled=bool(stalled[j] and not success[j]), success_rule=rule,
                     **{m: v[j] for m, v in metrics.items()})
            if final is not None:  # the returned image ends the path (replacing a snapshot at the same count)
                path = self.paths.pop(g)
                r["_path"] = path[:-1 if path[-1][0] == queries[j] and len(path) > 1 else None] + \
                    [(int(queries[j]), final[j])]
            records.append(r)
        self.gid[slots[go]] = -1
        self.occupied -= len(go)
        self.unaudited.append((records, x_out, sub))
        return self._audit()

    def _audit(self, force=False):
        """The worker's own forward of each returned image in calls of one shape (:func:`audit_logits`), an audit
        of the oracle's confirmations that does not depend on which samples finished with it: it sets
        ``audit_adv`` on the waiting records and releases them, once ``slots`` samples wait, a second has passed,
        or ``force``."""
        waiting = sum(len(r) for r, _, _ in self.unaudited)
        if not waiting or not (force or waiting >= self.slots or time.perf_counter() - self.audited > AUDIT_EVERY_S):
            return []
        x_out = torch.cat([x for _, x, _ in self.unaudited])
        labels = audit_logits(self.model, x_out, self.model_name, self.audit_size).argmax(1)
        records, k = [], 0
        for recs, x, sub in self.unaudited:
            audit = sub.is_adv_label(labels[k:k + len(recs)]).tolist()
            reeval, votes = [None] * len(recs), [None] * len(recs)
            if self.evaluator is not None:  # the defended re-evaluation (evaluation streams, not counted)
                who = torch.tensor([r["index"] for r in recs], dtype=torch.long, device=self.device)
                adv, n_adv = majority_adv(self.evaluator, x, who, sub.is_adv_label, REEVAL_DRAWS)
                reeval, votes = [bool(v) for v in adv.tolist()], n_adv.tolist()
            images = to_uint8(x) if self.run.save_adv else None
            for j, r in enumerate(recs):
                r.update(audit_adv=bool(audit[j]), reeval_adv=reeval[j], reeval_votes=votes[j])
                if images is not None:
                    r["_image"] = images[j]
            records += recs
            k += len(recs)
        self.unaudited, self.audited = [], time.perf_counter()
        return records


class QueryFamily(Family):
    """``score`` (log-probability feedback) and ``decision`` (label feedback) attacks."""

    blocks = {"init": BlockKind(INIT), "perturb": BlockKind(PERTURB), "accept": BlockKind(ACCEPT)}
    model_keys = {"model": ModelKey("target", True, False, forward_only=True),
                  "surrogates": ModelKey("surrogate", False, True, fixed_batch=True)}
    threat_keys = {"max_queries": (int,), "feedback": (str,), "success_rule": (str, dict)}
    # defenses inside the oracle (defense.py); the attack path of every sample, every k queries (runner.save_path)
    run_keys = {"defense": (str, dict, list), "save_path_every": (int,)}
    shared_key = "model"  # the target: only called, by the oracle, the clean check and the audit
    hyper = {"eot": 1}  # EOT (spec sheet section 7): k queries per logical evaluation; 1 is the paper's default
    record_fields = {"success": (bool,), "queries": (int,), "audit_adv": (bool, type(None)), "stalled": (bool,),
                     "success_rule": (str,), "defense": (str,), "eot": (int,),
                     "clean_correct_defended": (bool, type(None)), "reeval_adv": (bool, type(None)),
                     "reeval_votes": (int, type(None))}
    columns = (("budget", None), ("feedback", None), ("success_rule", None), ("eot", None), ("asr", "higher"),
               ("asr_low", None), ("asr_high", None), ("aqn", "lower"), ("aqn_low", None), ("aqn_high", None),
               ("mqn", "lower"), ("mqn_low", None), ("mqn_high", None), ("mean_l2", "lower"), ("median_l2", "lower"),
               ("mean_linf", "lower"), ("median_linf", "lower"), ("mean_ssim", "higher"), ("median_ssim", "higher"),
               ("mean_lpips", "lower"), ("median_lpips", "lower"), ("clean_acc_defended", None),
               ("asr_reeval_defended", None), ("asr_reeval_undefended", None), ("reeval_gap", None),
               ("n_audit_disagree", "lower"), ("n_stalled", None))

    def __init__(self, name, feedback):
        self.name, self.feedback = name, feedback

    def finish_threat(self, threat, recipe, source):
        t = threat
        t.setdefault("max_queries", DEFAULT_MAX_QUERIES[t["targeted"]])
        if t["max_queries"] < 1:
            raise ConfigError("must be >= 1", source, "threat.max_queries")
        t.setdefault("feedback", self.feedback)
        if t["feedback"] not in ("score", "label"):
            raise ConfigError("must be 'score' or 'label'", source, "threat.feedback")
        if self.feedback == "score" and t["feedback"] == "label":
            raise ConfigError(f"score-based attack '{recipe['name']}' needs feedback 'score'", source,
                              "threat.feedback")
        t["success_rule"] = parse_success_rule(t.get("success_rule", "single"), source)
        return t

    def build(self, name, blocks, hyper, meta):
        eot = hyper["eot"]
        if isinstance(eot, bool) or int(eot) != eot or eot < 1:
            raise ConfigError(f"must be a positive integer, got {eot!r}", meta["source"], "attack.hyper.eot")
        return QueryAttack(name, self.name, blocks["init"], blocks["perturb"], blocks["accept"], meta=meta,
                           eot=int(eot))

    def worker(self, run):
        return QueryWorker(self, run)

    def summarize(self, records):
        return summarize_query(records)


def parse_success_rule(value, source):
    """``single`` (default: the one confirming draw) or ``{name: majority, draws: k}`` (k odd >= 3: k counted
    draws of the returned image, a strict majority adversarial)."""
    rule = {"name": value} if isinstance(value, str) else dict(value)
    check_keys(rule, {"name", "draws"}, source, "threat.success_rule.")
    if rule.get("name") not in SUCCESS_RULES:
        raise ConfigError(f"must be one of {', '.join(SUCCESS_RULES)}", source, "threat.success_rule")
    if rule["name"] == "single":
        if "draws" in rule:
            raise ConfigError("'single' takes no draws", source, "threat.success_rule.draws")
        return {"name": "single"}
    draws = rule.get("draws", 5)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 3 or draws % 2 == 0:
        raise ConfigError(f"must be an odd integer >= 3, got {draws!r}", source, "threat.success_rule.draws")
    return {"name": "majority", "draws": draws}


FAMILY.register("score", paper="BlackboxBench Supp. F-B, Alg. 2")(QueryFamily("score", "score"))
FAMILY.register("decision", paper="BlackboxBench Supp. F-A, Alg. 1")(QueryFamily("decision", "label"))
