"""Side-by-side comparison with peer libraries (torchattacks, ART, foolbox) on CIFAR-10 / ResNet-20.

Sections (``--only`` runs one; otherwise all run and ``--out`` is rewritten):

* ``square``: Square Linf eps 0.03, 10,000 queries: ours (recipe square_linf) vs torchattacks.Square vs ART
  SquareAttack.
* ``hsja``: HSJA Linf eps 0.03, 10,000 queries: ours (hsja_linf) vs ART HopSkipJump vs foolbox
  HopSkipJumpAttack; success = "a queried image with Linf distance <= eps was classified adversarially within the
  sample's first 10,000 queries" for the peers (they minimize the distance and have no budget of their own).
* ``mifgsm``: MI-FGSM ResNet-20 -> ResNet-56 (Linf 0.03, alpha 0.003, 100 iterations, decay 1.0): ours (mi_fgsm)
  vs torchattacks.MIFGSM; transfer ASR over images ResNet-56 classifies correctly.
* ``overhead``: our Square run's wall time / the time of the same model forwards (same batch sizes) run bare.
* ``seeds``: Square (ours vs torchattacks) and HSJA (ours vs ART) repeated over ``--seeds`` seeds, alternating
  which library runs first; single runs differ by more than the libraries do, the means over seeds are the
  comparison.
* ``throughput``: all ``--n-throughput`` images (default the 300 of the data root), untargeted, 10,000 queries:
  Square Linf and NES Linf (ours, ``--slots`` slots of continuous batching) vs torchattacks' Square in batches of
  ``--slots``; HSJA Linf on the first ``--n-hsja-throughput`` images vs ART's HopSkipJump (hits that survive
  uint8 rounding; ``--n-hsja-peer k``: ART on the first k of those images only, ``--hsja-peer-same off``: no
  like-for-like ART row, both for a GPU, where ART's one-image-at-a-time calls are the slow part). Each row: wall
  s, images forwarded, images/s, and images/s as a fraction of a bare forward at the slot size measured in the same
  run. Rows are printed as they finish.

Our attacks are built from the recipes with the builder and run by the runner's worker and scheduler
(``blackboxbench.runner.run_tensors``: continuous batching, oracle, verification), without writing files. Peers count queries through :class:`Counting`, an ``nn.Module`` around the same
model object that attributes every forwarded row to its sample (by batch position, by the sample being attacked,
or by the clean image whose eps ball holds the row) and counts forwards and *distinct* images per sample; its own
bookkeeping time is measured and subtracted from the peers' wall time.

Run: ``python benchmarks/compare_peers.py --n 100 --n-hsja 10 --threads 1 --same-grid`` (data root from env
BLACKBOXBENCH_DATA; about 13 minutes on a loaded 2-core CPU).
"""
import argparse
import math
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from blackboxbench.builder import build_attack, load_recipe, recipe_family  # noqa: E402
from blackboxbench.config import finish_threat, parse_number  # noqa: E402
from blackboxbench.family import check_outputs  # noqa: E402
from blackboxbench.malloc import keep_freed_memory  # noqa: E402
from blackboxbench.prep.data import resolve_data_root  # noqa: E402
from blackboxbench.prep.inference import inference_copy  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.registry import DATASET  # noqa: E402
from blackboxbench.rng import rank_within_group  # noqa: E402
from blackboxbench.runner import resolve_device, run_tensors  # noqa: E402
from blackboxbench.threat import Problem, grid_levels, quantize  # noqa: E402

EPS, BUDGET, TOL = 0.03, 10_000, 1e-6
GRID_EPS = grid_levels(EPS) / 255  # 7/255: the radius our uint8 outputs (rounded towards x) reach
GRID_LABEL = " at eps 7/255 (ours' grid eps)"
SECTIONS = ("throughput", "square", "hsja", "mifgsm", "overhead", "seeds", "boundary", "sign_opt")
CLOCK = "cpu"  # the time compared: process CPU seconds on CPU; wall seconds on CUDA (set in main)
SAME = "like for like: "  # rows where the peer forwards our inference copy
FUSE = True  # ours forward the target's inference copy, as a run does (config ``fuse``; --fuse off: the model)
_COPIES = {}


def peer_models(model):
    """The models a peer runs on: ``model`` as built (as a user gives it), and with the copy on, ``as_ours(model)``
    too ("like for like"); pairs (model, row prefix)."""
    return [(model, "")] + ([(as_ours(model), SAME)] if FUSE else [])


def as_ours(model):
    """The model our runner forwards for the query target ``model``: its inference copy (prep/inference.py, the
    config's ``fuse``, on by default), made once per model; the model itself with ``--fuse off``."""
    if not FUSE:
        return model
    if id(model) not in _COPIES:
        dev = next(model.parameters()).device
        _COPIES[id(model)] = (model, inference_copy(model, torch.rand(4, 3, 32, 32, device=dev), "benchmark"))
    return _COPIES[id(model)][1]
SRC = "benchmarks/compare_peers.py"


def settle(t):
    """Wait for the GPU's queued work, so that a clock read next charges it to whoever queued it (no-op on CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class Stop(Exception):
    """Raised inside a peer's forward to end its run (budget reached, every sample decided, or time cap)."""


class Counting(nn.Module):
    """``model`` plus per-sample query accounting for a batch of clean images ``x`` with labels ``y``.

    ``mode``: ``position`` (a batch of exactly n rows is samples 0..n-1, other sizes fall back to content),
    ``current`` (every row belongs to ``self.current``) or ``content`` (a row belongs to the clean image whose
    Linf ``eps`` ball holds it; rows outside every ball are counted as unattributed). Rows equal to their clean
    image are clean-accuracy checks and are not counted as queries.
    Per sample: ``forwards`` (every row), ``distinct`` (rows never forwarded before for that sample) and the
    forward / distinct index of the first row classified adversarially within ``eps`` (``hit_fwd``,
    ``hit_distinct``; 0 = none). With ``uint8``, a row only counts as a hit if it stays adversarial once saved as
    an image: rounded to the nearest uint8 level and clipped to the eps ball on that grid (the rule our own
    outputs meet); that check's forward is bookkeeping, not a query.
    With ``l2`` (pass ``eps`` 1, so that the Linf rule decides nothing), a hit must lie within L2 ``l2`` and stay
    adversarial as a uint8 image: rounded to the nearest level and, if that leaves the ball, scaled back to ``l2``
    and rounded towards the clean image, as our outputs are (that forward is bookkeeping too).
    """

    def __init__(self, model, x, y, eps, mode, stop_at_hit=False, deadline=None, uint8=False, l2=None):
        super().__init__()
        self.model, self.x, self.y, self.eps, self.mode, self.uint8 = model, x, y, eps, mode, uint8
        self.l2 = l2
        self.stop_at_hit, self.deadline = stop_at_hit, deadline
        n = len(x)
        z = lambda: torch.zeros(n, dtype=torch.long, device=x.device)  # noqa: E731
        self.forwards, self.distinct, self.hit_fwd, self.hit_distinct = z(), z(), z(), z()
        self.seen, self.clean_rows, self.unattributed, self.book, self.current = set(), 0, 0, 0.0, None
        self.cast, self.book_cpu, self.model_time, self.calls = 0, 0.0, 0.0, 0
        g = torch.Generator().manual_seed(0)
        self.probe = torch.randperm(x[0].numel(), generator=g)[:64].to(x.device)
        self.fp = torch.randn(x[0].numel(), generator=g, dtype=torch.float64).to(x.device)
        self.eval()

    def forward(self, inp):
        settle(inp)  # the peer's queued work is the peer's time
        t0, c0 = time.perf_counter(), time.process_time()
        if self.deadline is not None and t0 > self.deadline:
            raise Stop("time cap")
        if inp.dtype != self.x.dtype:  # ART's HSJA binary search hands float64 arrays to predict
            inp = inp.to(self.x.dtype)
            self.cast += 1
        rows = inp.detach()
        self.calls += 1
        ids = self._attribute(rows)
        settle(inp)
        t1, c1 = time.perf_counter(), time.process_time()
        out = self.model(inp)
        settle(out)
        t2, c2 = time.perf_counter(), time.process_time()
        self._record(rows, out.detach(), ids)
        stop = self.stop_at_hit and self._decided()
        settle(out)
        self.book += (t1 - t0) + (time.perf_counter() - t2)
        self.book_cpu += (c1 - c0) + (time.process_time() - c2)
        # The peer's own forwards (the uint8 check's forward is bookkeeping), in the compared clock.
        self.model_time += (c2 - c1) if CLOCK == "cpu" else (t2 - t1)
        if stop:
            raise Stop("decided")
        return out

    def _attribute(self, rows):
        m, n = rows.shape[0], len(self.x)
        if self.mode == "current":
            return torch.full((m,), self.current, dtype=torch.long, device=rows.device)
        if self.mode == "position" and m == n:
            return torch.arange(n, device=rows.device)
        flat, clean = rows.flatten(1), self.x.flatten(1)
        near = (flat[:, None, self.probe] - clean[None, :, self.probe]).abs().amax(-1).argmin(1)
        inside = (flat - clean[near]).abs().amax(1) <= self.eps + 1e-4
        return torch.where(inside, near, torch.full_like(near, -1))

    def _judge_l2(self, rows, out, ids):
        """``out`` with the logits of every row that is not an L2 hit replaced by its true class's one-hot."""
        s = ids.clamp_min(0)
        hit = (ids >= 0) & (out.argmax(1) != self.y[s]) & (self.hit_fwd[s] == 0)
        hit &= (rows - self.x[s]).flatten(1).norm(dim=1) <= self.l2 + TOL
        if hit.any():
            j = hit.nonzero().squeeze(1)
            clean = self.x[s[j]]
            saved = (torch.round(rows[j] * 255) / 255).clamp(0, 1)
            d = (saved - clean).flatten(1).norm(dim=1)
            far = d > self.l2
            if far.any():
                back = clean[far] + (saved[far] - clean[far]) * (self.l2 / d[far]).view(-1, 1, 1, 1)
                saved[far] = quantize(back, clean[far])
            with torch.no_grad():
                hit[j] = self.model(saved).argmax(1) != self.y[s[j]]
        return torch.where(hit[:, None], out, nn.functional.one_hot(self.y[s], out.shape[1]).to(out.dtype))

    def _record(self, rows, out, ids):
        if self.l2 is not None:
            out = self._judge_l2(rows, out, ids)
        known = ids >= 0
        self.unattributed += int((~known).sum())
        rows, out, s = rows[known], out[known], ids[known]
        d = (rows - self.x[s]).flatten(1).abs().amax(1)
        query = d > 0
        self.clean_rows += int((~query).sum())
        rows, out, s, d = rows[query], out[query], s[query], d[query]
        if s.numel() == 0:
            return
        fwd_idx = self.forwards[s] + rank_within_group(s) + 1
        self.forwards.index_add_(0, s, torch.ones_like(s))
        keys = list(zip(s.tolist(), (rows.flatten(1).double() @ self.fp).tolist()))
        new = torch.tensor([k not in self.seen for k in keys], device=s.device)
        self.seen.update(keys)
        new_rank = torch.zeros_like(s)
        new_rank[new] = rank_within_group(s[new])
        dist_idx = torch.where(new, self.distinct[s] + new_rank + 1, self.distinct[s])
        self.distinct.index_add_(0, s[new], torch.ones_like(s[new]))
        hit = (out.argmax(1) != self.y[s]) & (d <= self.eps + TOL) & (self.hit_fwd[s] == 0)
        if self.uint8 and hit.any():
            j = hit.nonzero().squeeze(1)
            levels = grid_levels(self.eps) / 255
            clean = self.x[s[j]]
            saved = torch.minimum(torch.maximum(torch.round(rows[j] * 255) / 255, clean - levels), clean + levels)
            with torch.no_grad():
                hit[j] = self.model(saved.clamp(0, 1)).argmax(1) != self.y[s[j]]
        for j in hit.nonzero().squeeze(1).tolist():  # first hits only: at most once per sample
            if self.hit_fwd[s[j]] == 0:
                self.hit_fwd[s[j]], self.hit_distinct[s[j]] = fwd_idx[j], dist_idx[j]

    def _decided(self):
        idx = [self.current] if self.mode == "current" else range(len(self.x))
        return all(self.hit_fwd[i] > 0 or self.distinct[i] >= BUDGET for i in idx)

    def success(self):
        return (self.hit_distinct > 0) & (self.hit_distinct <= BUDGET)


class Timed(nn.Module):
    """``model`` recording the batch size of every forward and the wall and CPU seconds spent inside it."""

    def __init__(self, model):
        super().__init__()
        self.model, self.sizes, self.seconds, self.cpu = model, [], 0.0, 0.0
        self.eval()

    def forward(self, x):
        settle(x)
        t, c = time.perf_counter(), time.process_time()
        out = self.model(x)
        settle(out)
        self.seconds += time.perf_counter() - t
        self.cpu += time.process_time() - c
        self.sizes.append(x.shape[0])
        return out


# ------------------------------------------------------------------------------------------------ helpers

class Clock:
    """Wall and process CPU seconds since creation (CPU time is the fairer measure on a loaded machine)."""

    def __init__(self):
        self.t, self.c = time.perf_counter(), time.process_time()

    def read(self):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # queued GPU work belongs to the run being timed
        return time.perf_counter() - self.t, time.process_time() - self.c


def linf(a, b):
    return (a - b).flatten(1).abs().amax(1)


def predict(model, x, bs=500):
    with torch.no_grad():
        return torch.cat([model(x[i:i + bs]).argmax(1) for i in range(0, len(x), bs)])


def row(attack, lib, n, success, queries, clock, max_linf, images=None, fwd=None, note="", model_time=None,
        calls=None):
    """One result row; ``model_time``: seconds spent inside the model's forwards, in the compared clock (``CLOCK``;
    the rest of that clock's seconds is the attack loop: drawing candidates, bookkeeping, deciding)."""
    q = queries[success].double()
    return dict(attack=attack, lib=lib, n=n, images=images, asr=float(success.float().mean()) if n else float("nan"),
                model=model_time,
                mean_q=float(q.mean()) if q.numel() else float("nan"),
                med_q=float(q.median()) if q.numel() else float("nan"),
                mean_fwd=None if fwd is None or not q.numel() else float(fwd[success].double().mean()),
                wall=clock[0], cpu=clock[1], max_linf=max_linf, note=note, calls=calls)


def build_ours(name, threat=None):
    recipe, source = load_recipe(name, SRC)
    threat = finish_threat(dict(threat or {"norm": "linf", "eps": EPS}), recipe, recipe_family(recipe, source),
                           source)
    return build_attack(recipe, threat, source), threat


class Ours:
    """The attacked samples of one of our runs: ``x_adv``, ``success``, ``queries``, ``audit`` (the worker's own
    forward of each returned image agrees with the oracle's confirmation)."""

    def __init__(self, records, x, device):
        rec = [r for r in records if r["attacked"]]
        idx = torch.tensor([r["index"] for r in rec], dtype=torch.long)
        self.x_adv = torch.stack([r["x_adv"] for r in rec]) if rec else x[:0]
        self.success = torch.tensor([r["success"] for r in rec], dtype=torch.bool, device=device)
        self.queries = torch.tensor([r["queries"] for r in rec], dtype=torch.long, device=device)
        self.audit = all(r["audit_adv"] == r["success"] for r in rec)
        self.index = idx


def run_ours_query(name, model, x, y, device, seed, slots=None):
    """Our attack ``name`` on ``x`` through the runner's worker and scheduler (clean check, continuous batching
    over ``slots``, oracle, verification, output checks, audit).

    Returns the attacked samples (:class:`Ours`), their problem, (wall, CPU) seconds and the :class:`Timed`
    model it ran on.
    """
    model = Timed(as_ours(model))
    attack, t = build_ours(name)
    assert t["max_queries"] == BUDGET and t["eps"] == EPS
    clock = Clock()
    records = run_tensors(attack, t, x, y, {"model": [model]}, seed=seed, slots=slots or len(y), device=device)
    wall = clock.read()
    res = Ours(records, x, device)
    problem = Problem(x[res.index.to(x.device)], y[res.index.to(y.device)], t["eps"], t["norm"], None, 10)
    check_outputs(res.x_adv, problem.x, t["eps"], t["norm"], name)
    assert res.audit, "oracle-verified success differs from the worker's own forward"
    assert int(res.queries.max()) <= BUDGET
    return res, problem, wall, model


def ours_row(attack, name, res, problem, wall, timed, note):
    return row(attack, f"ours ({name})", problem.n, res.success, res.queries, wall,
               float(linf(res.x_adv, problem.x).max()), images=sum(timed.sizes), note=note,
               model_time=timed.cpu if CLOCK == "cpu" else timed.seconds, calls=len(timed.sizes))


def peer_result(attack, lib, cnt, clock, x_adv, x, y, model, note, stopped=None):
    """Success = first adversarial query within eps at distinct index <= BUDGET (see :class:`Counting`)."""
    wall, cpu = clock.read()
    success = cnt.success()
    notes = [note] if note else []
    max_l = float("nan")
    if x_adv is not None:
        max_l = float(linf(x_adv, x).max())
        adv_ok = (predict(model, x_adv) != y) & (linf(x_adv, x) <= cnt.eps + TOL)
        notes.append(f"returned images adversarial within eps: {int(adv_ok.sum())}/{len(y)}")
    if stopped:
        notes.append(stopped)
    if cnt.cast:
        notes.append(f"{cnt.cast} float64 batches cast to float32 by the wrapper")
    if cnt.unattributed:
        notes.append(f"{cnt.unattributed} rows unattributed")
    images = int(cnt.forwards.sum()) + cnt.clean_rows + cnt.unattributed
    return row(attack, lib, len(y), success, cnt.hit_distinct, (wall - cnt.book, cpu - cnt.book_cpu), max_l,
               images=images, fwd=cnt.hit_fwd, note="; ".join(notes), model_time=cnt.model_time, calls=cnt.calls)


def torchattacks_square(args, model, xc, yc, eps, seed, note):
    import torchattacks

    cnt = Counting(model, xc, yc, eps, "content", deadline=time.perf_counter() + args.peer_cap)
    torch.manual_seed(seed)
    atk = torchattacks.Square(cnt, norm="Linf", eps=eps, n_queries=BUDGET, n_restarts=1, p_init=0.05,
                              loss="margin", seed=seed)
    clock, x_adv, stopped = Clock(), None, None
    try:
        x_adv = atk(xc, yc)
    except Stop as e:
        stopped = f"stopped by the {e} ({args.peer_cap:.0f} s)"
    return peer_result("Square Linf", f"torchattacks {torchattacks.__version__}{note}", cnt, clock, x_adv, xc,
                       yc, model, "n_queries counts iterations (1 init query + up to 10,000: <= 10,001 per "
                       "sample); one window and one sign draw shared by the whole batch", stopped)


def run_until_stop(call, args):
    """Run a whole-batch peer attack until :class:`Counting` stops it; returns how it ended."""
    try:
        call()
        return "ran all steps"
    except Stop as e:
        return "stopped when every sample had hit or used 10,000 queries" if str(e) == "decided" else \
            f"stopped by the time cap ({args.peer_cap:.0f} s)"


def art_per_sample(atk, cnt, xc, yc, args):
    """Run an ART attack one sample at a time (as ART does anyway; attribution to ``cnt.current`` is then exact);
    returns why it stopped early (the time cap), or None."""
    for i in range(len(yc)):
        cnt.current = i
        try:
            atk.generate(xc[i:i + 1].cpu().numpy(), y=yc[i:i + 1].cpu().numpy())
        except Stop as e:
            if str(e) == "time cap":
                return f"stopped by the time cap ({args.peer_cap:.0f} s) at sample {i}"
    return None


def art_hsja(args, model, xc, yc, eps, seed, label, uint8=False):
    from art.attacks.evasion import HopSkipJump

    cnt = Counting(model, xc, yc, eps, "current", stop_at_hit=True, deadline=time.perf_counter() + args.peer_cap,
                   uint8=uint8)
    np.random.seed(seed)
    atk = HopSkipJump(art_classifier(cnt, xc.device), norm=np.inf, max_iter=hsja_steps(), max_eval=10000,
                      init_eval=100, init_size=100, verbose=False)
    clock = Clock()
    stopped = art_per_sample(atk, cnt, xc, yc, args)
    rule = "; hits must stay adversarial as uint8 images" if uint8 else ""
    return peer_result("HSJA Linf", f"ART {art_version()}{label}", cnt, clock, None, xc, yc, model,
                       f"max_iter {hsja_steps()}; each sample stopped at its first hit or 10,000 queries{rule}",
                       stopped)


# ------------------------------------------------------------------------------------------------ sections

def section_square(args, ctx):
    from art.attacks.evasion import SquareAttack

    model, device = ctx["m20"], ctx["device"]
    x, y = ctx["data"].x[:args.n].to(device), ctx["data"].y[:args.n].to(device)
    res, problem, wall, timed = run_ours_query("square_linf", model, x, y, device, args.seed)
    ctx["square_ours"] = (timed, wall)
    xc, yc = problem.x, problem.y
    rows = [ours_row("Square Linf", "square_linf", res, problem, wall, timed,
                     f"uint8 outputs rounded towards the clean image (eps {EPS:.5g} -> {round(GRID_EPS * 255)}/255 = "
                     f"{GRID_EPS:.5f}), which is the radius it searches; the returned image is one it queried, so "
                     "confirming it costs no extra query")]

    rows.append(torchattacks_square(args, model, xc, yc, EPS, args.seed, ""))

    cnt = Counting(model, xc, yc, EPS, "content", deadline=time.perf_counter() + args.peer_cap)
    np.random.seed(args.seed)
    clf = art_classifier(cnt, device)
    atk = SquareAttack(clf, norm=np.inf, max_iter=BUDGET, eps=EPS, p_init=0.05, nb_restarts=1, verbose=False)
    clock, x_adv, stopped = Clock(), None, None
    try:
        x_adv = torch.from_numpy(atk.generate(xc.cpu().numpy(), y=yc.cpu().numpy())).to(device)
    except Stop as e:
        stopped = f"stopped by the {e} ({args.peer_cap:.0f} s)"
    rows.append(peer_result("Square Linf", f"ART {art_version()}", cnt, clock, x_adv, xc, yc,
                            model, "max_iter 10,000 (1 new image per iteration, but 3 forwards: it re-predicts "
                            "x_adv and its loss each iteration); window shared by the batch", stopped))
    if args.same_grid:
        rows.append(torchattacks_square(args, model, xc, yc, GRID_EPS, args.seed, GRID_LABEL))
    return rows


def hsja_steps():
    """Iterations whose gradient probes (100 sqrt(t), Table V) plus ~30 search queries reach ~10,000."""
    total, t = 0, 0
    while total < BUDGET:
        t += 1
        total += int(100 * math.sqrt(t)) + 30
    return t


def section_hsja(args, ctx):
    import foolbox as fb

    model, device = ctx["m20"], ctx["device"]
    x, y = ctx["data"].x[:args.n_hsja].to(device), ctx["data"].y[:args.n_hsja].to(device)
    res, problem, wall, timed = run_ours_query("hsja_linf", model, x, y, device, args.seed)
    xc, yc = problem.x, problem.y
    rows = [ours_row("HSJA Linf", "hsja_linf", res, problem, wall, timed,
                     "stops at success (within_eps accept: a boundary point within the grid radius, pushed out and "
                     "rounded outward); queries include 1 confirmation query of the returned uint8 image")]
    steps = hsja_steps()

    def foolbox_hsja(eps, label):
        cnt = Counting(model, xc, yc, eps, "position", stop_at_hit=True,
                       deadline=time.perf_counter() + args.peer_cap)
        torch.manual_seed(args.seed)
        fmodel = fb.PyTorchModel(cnt, bounds=(0, 1), device=device)
        atk = fb.attacks.HopSkipJumpAttack(steps=steps, constraint="linf")
        clock = Clock()
        stopped = run_until_stop(lambda: atk(fmodel, xc, yc, epsilons=eps), args)
        return peer_result("HSJA Linf", f"foolbox {fb.__version__}{label}", cnt, clock, None, xc, yc, model,
                           f"steps {steps}; whole batch queried every time (no per-sample stop)", stopped)

    rows += [art_hsja(args, model, xc, yc, EPS, args.seed, ""),
             art_hsja(args, model, xc, yc, EPS, args.seed, " (uint8 hits)", uint8=True), foolbox_hsja(EPS, "")]
    if args.same_grid:
        rows += [art_hsja(args, model, xc, yc, GRID_EPS, args.seed, GRID_LABEL), foolbox_hsja(GRID_EPS, GRID_LABEL)]
    return rows


def section_sign_opt(args, ctx):
    """Sign-OPT L2 eps 1.0, 10,000 queries, untargeted, on the first ``--n-hsja`` correctly classified images: ours
    (recipe sign_opt) vs ART ``SignOPTAttack`` with the same settings (Table V: k 200, alpha 0.2, beta 0.001, the
    authors' 100 initial directions). ART attacks one sample at a time and checks its ``query_limit`` only after
    each iteration (k + line-search queries) and never during its initial search, so it overshoots 10,000; its
    queries are counted by :class:`Counting` (distinct images per sample), and a peer success is its first queried
    image within L2 eps that stays adversarial as a uint8 image (Counting's L2 rule), at distinct index <= 10,000
    (each sample is stopped there)."""
    from art.attacks.evasion import SignOPTAttack

    eps_l2, model, device = 1.0, ctx["m20"], ctx["device"]
    x, y = ctx["data"].x.to(device), ctx["data"].y.to(device)
    keep = (predict(model, x) == y).nonzero().squeeze(1)[:args.n_hsja]
    x, y = x[keep], y[keep]
    timed = Timed(as_ours(model))
    attack, t = build_ours("sign_opt", {"norm": "l2", "eps": eps_l2})
    assert t["max_queries"] == BUDGET and t["eps"] == eps_l2
    clock = Clock()
    records = run_tensors(attack, t, x, y, {"model": [timed]}, seed=args.seed, slots=len(y), device=device)
    wall = clock.read()
    res = Ours(records, x, device)
    problem = Problem(x[res.index.to(device)], y[res.index.to(device)], eps_l2, "l2", None, 10)
    check_outputs(res.x_adv, problem.x, eps_l2, "l2", "sign_opt")
    assert res.audit and int(res.queries.max()) <= BUDGET
    l2 = float((res.x_adv - problem.x).flatten(1).norm(dim=1).max())
    rows = [ours_row("Sign-OPT L2 1.0", "sign_opt", res, problem, wall, timed,
                     f"max L2 {l2:.4f}; stops at success (within_eps: a boundary point within eps, pushed out to "
                     "it); queries include 1 confirmation query of the returned uint8 image")]
    xc, yc = problem.x, problem.y

    for forward, same in peer_models(model):
        cnt = Counting(forward, xc, yc, 1.0, "current", stop_at_hit=True,
                       deadline=time.perf_counter() + args.peer_cap, l2=eps_l2)
        np.random.seed(args.seed)
        atk = SignOPTAttack(art_classifier(cnt, device), targeted=False, epsilon=0.001, num_trial=100, max_iter=1000,
                            query_limit=BUDGET, k=200, alpha=0.2, beta=0.001, batch_size=1, verbose=False)
        clock = Clock()
        stopped = art_per_sample(atk, cnt, xc, yc, args)
        rows.append(peer_result(same + "Sign-OPT L2 1.0", f"ART {art_version()}", cnt, clock, None, xc, yc, model,
                                "epsilon 0.001 (its name for beta), beta 0.001 (its line-search tolerance / 500), k "
                                "200, alpha 0.2, num_trial 100, query_limit 10,000 (checked per iteration: "
                                "overshoots); each sample stopped at its first L2 hit surviving uint8 rounding or "
                                "10,000 distinct queries", stopped))
    return rows


def section_boundary(args, ctx):
    """Boundary attack, L2 eps 1.0 (Table V, CIFAR-10), 10,000 queries, on the first ``--n-hsja`` images ResNet-20
    classifies correctly: ours (recipe boundary) vs ART BoundaryAttack vs foolbox BoundaryAttack, all with Table V's
    step sizes (spherical 0.01, source 0.01, adaptation 1.5; ART's step_adapt 1/1.5). A peer's success is its first
    query within L2 eps that stays adversarial as a uint8 image (rounded to the nearest level; if that leaves the
    ball, scaled back to eps and rounded towards the clean image, as our outputs are) within the sample's first
    10,000 distinct queries (:class:`Counting`, hits re-judged in L2); each peer stops a sample at its first hit."""
    import foolbox as fb
    from art.attacks.evasion import BoundaryAttack

    l2_eps, model, device = 1.0, ctx["m20"], ctx["device"]
    x_all, y_all = ctx["data"].x.to(device), ctx["data"].y.to(device)
    first = (predict(model, x_all) == y_all).nonzero().squeeze(1)[:args.n_hsja]
    xc, yc = x_all[first], y_all[first]

    def counting(mode, forward):
        return Counting(forward, xc, yc, 1.0, mode, stop_at_hit=True, deadline=time.perf_counter() + args.peer_cap,
                        l2=l2_eps)

    timed = Timed(as_ours(model))
    attack, t = build_ours("boundary", {"norm": "l2", "eps": l2_eps})
    assert t["max_queries"] == BUDGET
    clock = Clock()
    records = run_tensors(attack, t, xc, yc, {"model": [timed]}, seed=args.seed, slots=len(yc), device=device)
    wall = clock.read()
    res = Ours(records, xc, device)
    check_outputs(res.x_adv, xc[res.index.to(device)], l2_eps, "l2", "boundary")
    assert res.audit and int(res.queries.max()) <= BUDGET
    max_l2 = float((res.x_adv - xc[res.index.to(device)]).flatten(1).norm(dim=1).max())
    rows = [row("Boundary L2", "ours (boundary)", len(res.success), res.success, res.queries, wall,
                float(linf(res.x_adv, xc[res.index.to(device)]).max()), images=sum(timed.sizes),
                model_time=timed.cpu if CLOCK == "cpu" else timed.seconds, calls=len(timed.sizes),
                note=f"max L2 {max_l2:.4f}; one candidate per step, the spherical candidate also every 10th step; "
                     "stops at success; queries include the init and 1 confirmation query")]

    for forward, same in peer_models(model):
        cnt = counting("current", forward)
        np.random.seed(args.seed)
        atk = BoundaryAttack(art_classifier(cnt, device), targeted=False, delta=0.01, epsilon=0.01,
                             step_adapt=1 / 1.5, max_iter=25000, num_trial=25, sample_size=20, init_size=100,
                             verbose=False)
        clock = Clock()
        stopped = art_per_sample(atk, cnt, xc, yc, args)
        rows.append(peer_result(same + "Boundary L2", f"ART {art_version()}", cnt, clock, None, xc, yc, model,
                                "20 spherical candidates per trial, then source steps of the successful ones; each "
                                "sample stopped at its first L2 hit that survives uint8 rounding, or 10,000 queries",
                                stopped))

        cnt = counting("position", forward)
        torch.manual_seed(args.seed)
        fmodel = fb.PyTorchModel(cnt, bounds=(0, 1), device=device)
        atk = fb.attacks.BoundaryAttack(steps=25000, spherical_step=0.01, source_step=0.01,
                                        source_step_convergance=1e-7, step_adaptation=1.5, update_stats_every_k=10)
        clock = Clock()
        stopped = run_until_stop(lambda: atk(fmodel, xc, yc, epsilons=l2_eps), args)
        rows.append(peer_result(same + "Boundary L2", f"foolbox {fb.__version__}", cnt, clock, None, xc, yc, model,
                                "steps 25,000; whole batch queried every step (no per-sample stop); one Gaussian "
                                "draw shared by the batch; hits must survive uint8 rounding", stopped))
    return rows


def bare_rate(model, batch, device, seconds=3.0):
    """Images per wall second of bare ``no_grad`` forwards of ``batch`` images, measured over ``seconds``."""
    xb = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch)).to(device)
    clock, calls = Clock(), 0
    with torch.no_grad():
        for _ in range(3):
            model(xb)
        clock = Clock()
        while clock.read()[0] < seconds or calls < 3:
            model(xb)
            calls += 1
    return batch * calls / clock.read()[0]


def merged(rows, lib):
    """One row for a peer run in several batches: counts and times add up, rates are weighted by samples."""
    n = sum(r["n"] for r in rows)
    wins = [r["asr"] * r["n"] for r in rows]
    mean_q = sum(w * r["mean_q"] for w, r in zip(wins, rows) if w) / max(sum(wins), 1e-12)
    return dict(rows[0], lib=lib, n=n, asr=sum(wins) / n, mean_q=mean_q, med_q=float("nan"),
                images=sum(r["images"] for r in rows), wall=sum(r["wall"] for r in rows),
                calls=sum(r["calls"] for r in rows),
                cpu=sum(r["cpu"] for r in rows), model=sum(r["model"] for r in rows), mean_fwd=None,
                note=f"{len(rows)} batches of at most {rows[0]['n']}")


def section_throughput(args, ctx):
    """Continuous batching against peers at the slot size (see the module docstring); prints rows as they
    finish."""
    model, device, slots = ctx["m20"], ctx["device"], args.slots
    n = args.n_throughput
    x, y = ctx["data"].x[:n].to(device), ctx["data"].y[:n].to(device)
    bare = bare_rate(model, slots, device)
    print(f"| bare forward, batch {slots} | {bare:,.0f} images/s |", flush=True)
    if FUSE:
        print(f"| bare forward of our inference copy, batch {slots} | {bare_rate(as_ours(model), slots, device):,.0f}"
              " images/s |", flush=True)
    out = []

    def emit(r):
        r = dict(r, rate=(r["images"] / r["wall"]) if r.get("images") else None)
        r["of_bare"] = None if r["rate"] is None else r["rate"] / bare
        out.append(r)
        print(throughput_table([r], header=not out[:-1], bare=bare)[-1], flush=True)

    for name, attack in (("square_linf", "Square Linf"), ("nes", "NES Linf")):
        res, problem, wall, timed = run_ours_query(name, model, x, y, device, args.seed, slots=slots)
        emit(ours_row(attack, name, res, problem, wall, timed, f"{slots} slots"))
    with torch.no_grad():
        keep = torch.cat([model(x[i:i + 500]).argmax(1) for i in range(0, n, 500)]) == y
    xc, yc = x[keep], y[keep]
    for forward, same in peer_models(model):
        peer = [torchattacks_square(args, forward, xc[i:i + slots], yc[i:i + slots], EPS, args.seed, "")
                for i in range(0, len(yc), slots)]
        r = merged(peer, peer[0]["lib"])
        emit(dict(r, attack=same + "Square Linf", note=("on our inference copy; " if same else "") + r["note"]))
    m = args.n_hsja_throughput
    res, problem, wall, timed = run_ours_query("hsja_linf", model, x[:m], y[:m], device, args.seed, slots=slots)
    with torch.no_grad():
        alone = torch.cat([model(res.x_adv[i:i + 1]).argmax(1) for i in range(len(res.x_adv))]) \
            if len(res.x_adv) else y[:0]
    still = problem.is_adv_label(alone)[res.success].float().mean().item() if res.success.any() else float("nan")
    emit(ours_row("HSJA Linf", "hsja_linf", res, problem, wall, timed,
                  f"{min(slots, m)} slots; successes still adversarial as uint8 images, each forwarded alone: "
                  f"{still:.0%}"))
    keep = keep[:m]
    xa, ya = x[:m][keep], y[:m][keep]
    k = len(ya) if args.n_hsja_peer is None else min(args.n_hsja_peer, len(ya))
    sample = "" if k == len(ya) else (f"the first {k} of the {len(ya)} correctly classified images ours ran "
                                      "(--n-hsja-peer; compare wall per image); ")
    for forward, same in peer_models(model)[:None if args.hsja_peer_same == "on" else 1]:
        r = art_hsja(args, forward, xa[:k], ya[:k], EPS, args.seed, " (uint8 hits)", uint8=True)
        emit(dict(r, attack=same + "HSJA Linf",
                  note=sample + ("on our inference copy; " if same else "") + r["note"]))
    return out, bare


def throughput_table(rows, header=True, bare=None):
    out = ["| attack | library | n | ASR | mean q | images fwd | model calls | wall s | images/s | of bare fwd | "
           "notes |", "|---" * 11 + "|"] if header else []
    for r in rows:
        out.append(f"| {r['attack']} | {r['lib']} | {r['n']} | {fmt(r['asr'] * 100, '.1f')}% | "
                   f"{fmt(r['mean_q'], '.0f')} | {fmt(r['images'], 'd')} | {fmt(r.get('calls'), 'd')} | "
                   f"{fmt(r['wall'], '.1f')} | "
                   f"{fmt(r['rate'], ',.0f')} | {fmt(r['of_bare'], '.0%')} | {r['note']} |")
    return out


def throughput_ratios(rows):
    by = {(r["attack"], r["lib"].split(" ")[0]): r for r in rows}
    out = []
    for attack, peer in (("Square Linf", "torchattacks"), ("HSJA Linf", "ART")):
        ours, theirs, same = by.get((attack, "ours")), by.get((attack, peer)), by.get((SAME + attack, peer))
        if not ours:
            continue

        def per(r):
            """A peer run on fewer images (--n-hsja-peer) compares per image (ART attacks one at a time)."""
            return ("", 1.0) if r["n"] == ours["n"] else \
                (f" per image ({peer} on {r['n']} of the {ours['n']} images)", r["n"] / ours["n"])

        if same:
            label, k = per(same)
            out.append(f"- {attack}: like for like ({peer} forwarding our inference copy too): our wall time{label} "
                       f"{ours['wall'] * k / same['wall']:.2f}x {peer}'s")
        if theirs:
            label, k = per(theirs)
            out.append(f"- {attack}: our wall time{label} {ours['wall'] * k / theirs['wall']:.2f}x {peer}'s; ASR "
                       f"{ours['asr'] * 100:.1f} vs {theirs['asr'] * 100:.1f}%; mean queries {ours['mean_q']:.0f} vs "
                       f"{theirs['mean_q']:.0f}; images/s {ours['of_bare']:.0%} vs {theirs['of_bare']:.0%} of the "
                       f"bare forward; model calls (the cost on a launch-bound GPU) {ours['calls']} vs "
                       f"{theirs['calls']} ({ours['calls'] * k / theirs['calls']:.2f}x{' per image' if label else ''})")
    return out


def section_seeds(args, ctx):
    """Square (ours vs torchattacks, ``--n`` images) and HSJA (ours vs ART, ``--n-hsja`` images) over seeds
    ``--seed`` .. ``--seed + --seeds - 1``, the two libraries in alternating order, at ``--eps``: one run is noisy
    (the hardest image sets the length of the tail, and the CPU is shared), the mean over seeds is the comparison."""
    model, device = ctx["m20"], ctx["device"]
    rows = []
    def art_uint8(args, model, x, y, eps, seed, label):
        return art_hsja(args, model, x, y, eps, seed, " (uint8 hits)" + label, uint8=True)

    for attack, name, n, peers in (("Square Linf", "square_linf", args.n, [torchattacks_square]),
                                   ("HSJA Linf", "hsja_linf", args.n_hsja, [art_hsja, art_uint8])):
        x, y = ctx["data"].x[:n].to(device), ctx["data"].y[:n].to(device)
        for k, seed in enumerate(range(args.seed, args.seed + args.seeds)):
            def ours():
                res, problem, wall, timed = run_ours_query(name, model, x, y, device, seed)
                mine = ours_row(attack, name, res, problem, wall, timed, "")
                return dict(mine, lib=f"{mine['lib']} seed {seed}")

            with torch.no_grad():
                keep = model(x).argmax(1) == y
            if k % 2 == 0:
                mine = ours()
            theirs = [peer(args, model, x[keep], y[keep], EPS, seed, f" seed {seed}") for peer in peers]
            if k % 2 == 1:
                mine = ours()
            rows += [mine] + [dict(r, note="") for r in theirs]
    return rows


def paired_ratio(peer, ours):
    """Per-seed CPU ratios ``peer[i] / ours[i]`` -> (geometric mean, 95% confidence interval low, high), the
    interval from Student's t on the log ratios (None, None without at least two seeds)."""
    from scipy import stats

    logs = [math.log(p / o) for p, o in zip(peer, ours)]
    k = len(logs)
    mid = sum(logs) / k
    if k < 2:
        return math.exp(mid), None, None
    half = stats.t.ppf(0.975, k - 1) * math.sqrt(sum((v - mid) ** 2 for v in logs) / (k - 1) / k)
    return math.exp(mid), math.exp(mid - half), math.exp(mid + half)


def seed_summary(rows):
    """Mean over seeds per (attack, library): ASR, queries, seconds of the compared clock (``CLOCK``); the peer /
    ours ratio of the means, and the paired per-seed ratio with its 95% interval (each seed runs ours and the
    peer)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["attack"], r["lib"].rsplit(" seed ", 1)[0]), []).append(r)
    unit = clock_label()
    out = [f"| attack | library | seeds | mean ASR | mean of mean q | mean images fwd | mean {unit} s | "
           f"mean model {unit} s | mean loop {unit} s | {unit} s per seed |", "|---" * 10 + "|"]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    took, loop = {}, {}
    for (attack, lib), rs in groups.items():
        took[(attack, lib)] = mean([r[CLOCK] for r in rs])
        loop[(attack, lib)] = mean([loop_time(r) for r in rs])
        per_seed = ", ".join(format(r[CLOCK], ".1f") for r in rs)
        out.append(f"| {attack} | {lib} | {len(rs)} | {mean([r['asr'] for r in rs]) * 100:.1f}% | "
                   f"{mean([r['mean_q'] for r in rs]):.0f} | {mean([r['images'] for r in rs]):.0f} | "
                   f"{took[(attack, lib)]:.2f} | {mean([r['model'] for r in rs]):.2f} | {loop[(attack, lib)]:.2f} | "
                   f"{per_seed} |")
    out.append("")
    for attack in dict.fromkeys(a for a, _ in groups):
        libs = [lib for a, lib in groups if a == attack]
        ours, peers = libs[0], libs[1:]
        for lib in peers:
            gm, lo, hi = paired_ratio([r[CLOCK] for r in groups[(attack, lib)]],
                                      [r[CLOCK] for r in groups[(attack, ours)]])
            ci = "" if lo is None else f" (95% interval {lo:.2f}-{hi:.2f})"
            out.append(f"- {attack}: {lib} mean {unit} time {took[(attack, lib)] / took[(attack, ours)]:.2f}x ours; "
                       f"paired per-seed ratio {gm:.2f}x{ci}; mean loop {unit} time (outside the model) "
                       f"{loop[(attack, lib)] / loop[(attack, ours)]:.2f}x ours")
    return out


def section_mifgsm(args, ctx):
    import torchattacks

    m20, m56, device = ctx["m20"], ctx["m56"], ctx["device"]
    x, y = ctx["data"].x[:args.n].to(device), ctx["data"].y[:args.n].to(device)
    ok56 = predict(m56, x) == y
    attack, t = build_ours("mi_fgsm")
    assert t["eps"] == EPS and attack.iterations == 100 and abs(attack.alpha - 0.003) < 1e-12
    clock = Clock()
    records = run_tensors(attack, t, x, y, {"surrogates": [m20], "targets": [m56]}, seed=args.seed, slots=len(y),
                          device=device)
    ours = torch.stack([r["x_adv"] for r in records])
    wall_ours = clock.read()

    atk = torchattacks.MIFGSM(m20, eps=EPS, alpha=0.003, steps=100, decay=1.0)
    clock = Clock()
    peer = atk(x, y)
    wall_peer = clock.read()
    rows = []
    for lib, adv, wall, note in (("ours (mi_fgsm)", ours, wall_ours, "uint8-quantized outputs"),
                                 (f"torchattacks {torchattacks.__version__}", peer, wall_peer, "float outputs")):
        success = (predict(m56, adv) != y)[ok56]
        white = float((predict(m20, adv) != y).float().mean())
        r = row("MI-FGSM R20->R56", lib, int(ok56.sum()), success, torch.zeros(len(success)), wall,
                float(linf(adv, x).max()), note=f"{note}; white-box ASR on ResNet-20 {white:.1%} (all {len(y)})")
        r["mean_q"] = r["med_q"] = None
        rows.append(r)
    return rows


def section_overhead(args, ctx):
    if "square_ours" not in ctx:
        model, device = ctx["m20"], ctx["device"]
        x, y = ctx["data"].x[:args.n].to(device), ctx["data"].y[:args.n].to(device)
        _, _, wall, timed = run_ours_query("square_linf", model, x, y, device, args.seed)
        ctx["square_ours"] = (timed, wall)
    timed, wall = ctx["square_ours"]
    model, device = ctx["m20"], ctx["device"]
    bufs = {b: torch.rand(b, 3, 32, 32, generator=torch.Generator().manual_seed(b)).to(device)
            for b in set(timed.sizes)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    clock = Clock()
    with torch.no_grad():
        for b in timed.sizes:
            model(bufs[b])
    sync()
    bare = clock.read()
    return dict(wall=wall[0], cpu=wall[1], bare=bare[0], bare_cpu=bare[1], inside=timed.seconds,
                calls=len(timed.sizes), images=sum(timed.sizes))


# ------------------------------------------------------------------------------------------------ report

def art_classifier(model, device):
    from art.estimators.classification import PyTorchClassifier

    return PyTorchClassifier(model=model, loss=nn.CrossEntropyLoss(), input_shape=(3, 32, 32), nb_classes=10,
                             clip_values=(0.0, 1.0), device_type="gpu" if device.type == "cuda" else "cpu")


def art_version():
    import art

    return art.__version__


def fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def clock_label():
    return "CPU" if CLOCK == "cpu" else "wall"


def loop_time(r):
    """Seconds of the compared clock outside the model's forwards (None when the model time was not measured)."""
    return None if r.get("model") is None else r[CLOCK] - r["model"]


def table(rows):
    out = ["| attack | library | n | ASR | mean q | median q | mean fwd to success | images fwd | wall s | CPU s | "
           f"model {clock_label()} s | loop {clock_label()} s | max Linf | notes |", "|---" * 14 + "|"]
    for r in rows:
        out.append(f"| {r['attack']} | {r['lib']} | {r['n']} | {fmt(r['asr'] * 100, '.1f')}% | "
                   f"{fmt(r['mean_q'], '.0f')} | {fmt(r['med_q'], '.0f')} | {fmt(r['mean_fwd'], '.0f')} | "
                   f"{fmt(r['images'], 'd')} | {fmt(r['wall'], '.1f')} | {fmt(r['cpu'], '.1f')} | "
                   f"{fmt(r.get('model'), '.1f')} | {fmt(loop_time(r), '.2f')} | {fmt(r['max_linf'], '.5f')} | "
                   f"{r['note']} |")
    return out


def ratios(rows):
    ours = rows[0]
    out = []
    for r in rows[1:]:
        loop = "" if loop_time(r) is None or loop_time(ours) is None else \
            f", loop {clock_label()} time (outside the model) {loop_time(r) / loop_time(ours):.2f}x ours"
        same = " (on our inference copy)" if r["attack"].startswith(SAME) else ""
        out.append(f"- {r['lib']}{same}: wall {r['wall'] / ours['wall']:.2f}x ours, CPU {r['cpu'] / ours['cpu']:.2f}x "
                   f"ours{loop}, ASR {(r['asr'] - ours['asr']) * 100:+.1f} points vs ours")
    return out


def machine(args, device):
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if device.type == "cuda" else ""
    return (f"{cpu} x{os.cpu_count()}{gpu}; device {device.type}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s); Python {platform.python_version()}"
            + (f"; malloc {args.malloc}" if hasattr(args, "malloc") else ""))


def render(name, args, ctx, result, load):
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lines = [f"<!-- section:{name} -->", f"## {name}", "",
             f"Command: `{cmd}`  ", f"Machine: {machine(args, ctx['device'])}  ",
             f"Load average (1 min) before/after: {load[0]:.2f} / {load[1]:.2f}; section time {load[2]:.0f} s", ""]
    if name.startswith("throughput"):
        rows, bare = result
        lines += [f"Bare forward of ResNet-20 at batch {args.slots}: {bare:,.0f} images/s (wall).", ""]
        lines += throughput_table(rows) + [""] + throughput_ratios(rows)
    elif name.startswith("overhead"):
        r = result
        lines += [f"Our Square run: {r['wall']:.1f} s wall ({r['cpu']:.1f} s CPU); {r['calls']} model forwards "
                  f"({r['images']} images) took {r['inside']:.1f} s inside the run; the same forwards replayed bare "
                  f"took {r['bare']:.1f} s wall ({r['bare_cpu']:.1f} s CPU).", "",
                  f"- overhead (wall / bare replay wall): **{r['wall'] / r['bare']:.2f}x** (target <= 1.2x)",
                  f"- overhead (CPU / bare replay CPU): **{r['cpu'] / r['bare_cpu']:.2f}x**",
                  f"- overhead (wall / time inside the model during the run): {r['wall'] / r['inside']:.2f}x"]
    elif name.startswith("seeds"):
        lines += seed_summary(result) + ["", "Per run:", ""] + table(result)
    else:
        lines += table(result) + [""] + ratios(result)
    return lines + [f"<!-- /section:{name} -->"]


def write(out, sections):
    """Replace the named sections of ``out`` (keeping the others and any text around them)."""
    text = out.read_text() if out.exists() else "# Benchmarks against peer libraries\n\n"
    for name, lines in sections:
        block = "\n".join(lines)
        pat = re.compile(rf"<!-- section:{name} -->.*?<!-- /section:{name} -->", re.S)
        text = pat.sub(lambda _: block, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    out.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", default=os.environ.get("BLACKBOXBENCH_DATA"))
    ap.add_argument("--n", type=int, default=100, help="images for Square and MI-FGSM (first n of the 300)")
    ap.add_argument("--n-hsja", type=int, default=20, help="images for HSJA")
    ap.add_argument("--n-throughput", type=int, default=300, help="images for the throughput section")
    ap.add_argument("--n-hsja-throughput", type=int, default=50, help="images for HSJA in the throughput section")
    ap.add_argument("--n-hsja-peer", type=int, default=None,
                    help="ART's HopSkipJump in the throughput section on only the first k correctly classified of "
                    "the --n-hsja-throughput images (default: all of them), stated in its row: ART attacks one image "
                    "at a time in small launch-bound calls, the slow part of the section on a GPU")
    ap.add_argument("--hsja-peer-same", default="on", choices=("on", "off"),
                    help="off: no like-for-like ART HopSkipJump row (ART on our inference copy) in the throughput "
                    "section")
    ap.add_argument("--slots", type=int, default=100, help="our slots (batch_size) in the throughput section")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=5, help="seeds for the 'seeds' section")
    ap.add_argument("--peer-cap", type=float, default=900.0, help="seconds after which a peer run is stopped")
    ap.add_argument("--same-grid", action="store_true",
                    help="also run the query peers at eps 7/255, the radius our uint8 outputs actually reach")
    ap.add_argument("--fuse", default="on", choices=("on", "off"),
                    help="ours forward the target's inference copy (the config's fuse, on by default in runs); "
                    "the throughput section then adds rows where the peer forwards the same copy")
    ap.add_argument("--malloc", default="keep", choices=("keep", "default"),
                    help="keep: glibc keeps freed memory in the process, as `blackboxbench run` does by default "
                    "(blackboxbench/malloc.py; process-wide, so the peers run under it too); default: glibc as is")
    ap.add_argument("--out", default="benchmarks/RESULTS.md")
    ap.add_argument("--only", choices=SECTIONS)
    ap.add_argument("--eps", default=None, help="Linf eps for every attack, e.g. 8/255 (default 0.03, Tables V-VII); "
                    "results go to their own sections, suffixed with the eps")
    args = ap.parse_args(argv)
    global EPS, GRID_EPS, GRID_LABEL, CLOCK, FUSE
    suffix = ""
    if args.eps is not None:
        EPS = float(parse_number(args.eps))
        GRID_EPS = grid_levels(EPS) / 255
        GRID_LABEL = f" at eps {round(GRID_EPS * 255)}/255 (ours' grid eps)"
        suffix = "@" + args.eps.replace("/", "_")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    FUSE = args.fuse == "on"
    device = resolve_device(args.device)
    CLOCK = "wall" if device.type == "cuda" else "cpu"  # process CPU time says little about GPU work
    root = resolve_data_root(args.data_root)
    ctx = {"device": device, "data": DATASET.get("cifar10")(root, n=300),
           "m20": build_model("cifar_resnet20", root, device), "m56": build_model("cifar_resnet56", root, device)}
    runs = {"throughput": section_throughput, "square": section_square, "hsja": section_hsja, "mifgsm": section_mifgsm, "overhead": section_overhead,
            "seeds": section_seeds, "boundary": section_boundary,
            "sign_opt": section_sign_opt}
    done = []
    for name in [args.only] if args.only else SECTIONS:
        l0, t0 = os.getloadavg()[0], time.perf_counter()
        result = runs[name](args, ctx)
        lines = render(name + suffix, args, ctx, result, (l0, os.getloadavg()[0], time.perf_counter() - t0))
        print("\n".join(lines), flush=True)
        done.append((name + suffix, lines))
        write(Path(args.out), done[-1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
