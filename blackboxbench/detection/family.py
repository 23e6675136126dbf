"""The ``detection`` family: attacks crafted white-box on a surrogate detector, evaluated on every target detector
(a transfer matrix), with mAP@0.5, AP_loc, CSR and the perceptual cost per image (od-robustness benchmark, Sec. 3).

A recipe names a ``craft`` block (registry ``det_craft``: how a batch's adversarial images are made, e.g. the
sign-gradient loop of TOG, DAG's unbounded loop, EBAD's weight search, a universal perturbation) and an
``objective`` block (registry ``det_objective``: the per-image loss the craft maximizes, e.g. TOG vanishing).

Block contracts (``ctx`` is the :class:`~blackboxbench.context.BlockContext`; ``ctx.problem`` is a
:class:`DetProblem`: clean images, eps, norm, the ground truth ``gt`` and the surrogate's clean detections
``clean``; ``ctx.model`` the white-box surrogate :class:`~blackboxbench.detection.models.Detector`,
``ctx.surrogates`` all of them; ``ctx.assets[name]`` the assets its blocks declare, e.g. the attacker's training
images):

* ``objective(ctx, x_adv) -> (N,)``: a per-image loss to *maximize* (differentiable in ``x_adv``).
* ``craft(ctx, objective) -> x_adv``: adversarial images for the batch inside the eps ball and [0, 1]; the worker
  quantizes them to uint8 inside the ball (``Problem.quantize``) and checks the threat model. A targeted attack returns a
  :class:`~blackboxbench.detection.attacks.Crafted` (the images and each one's goal: a label on a box), and every
  target's record says whether its detections meet the goal (``goal``; the summary's ``goal_rate``) and whether
  its clean detections already did (``goal_clean``, the control: ``goal_rate_clean``).

Every sample takes the same work, so a unit of work is one whole batch (as the transfer family). Every detector
answers each image alone (:func:`forward_dets`) wherever a record reads its detections, so what a record says of
an image does not depend on its neighbours; a batched craft forwards the surrogate on the whole batch, or under
``fixed_batch: k`` on parts of exactly k images (:meth:`DetectionWorker.craft`), whose shape then does not depend
on ``batch_size`` either. Records hold, per target detector, the matching of the clean and the adversarial image
(per detection: score, label, TP/FP/ignored flag, for the class-aware and the fused matching), so the summary
computes mAP, AP_loc and CSR over the run as a pure function of the records. Threat keys of the family:
``score_thr`` and ``max_det`` (harmonized post-processing of every detector; None keeps each one's own, both
logged), ``count_thr`` (score at which detections are counted, the fabrication measure; None: every detection the
detector returns). Summaries give mAP and AP_loc with VOC2007 11-point interpolation (``map``, ``ap_loc``) and
all-point (``map_area``, ``ap_loc_area``).
"""
import time
from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional

import numpy as np
import torch

from ..builder import resolve_setting
from ..context import BlockContext, Pool
from ..errors import BenchError, ConfigError, describe
from ..evaluation import distances, distortion_summary
from ..family import BlockKind, Family, ModelKey, WholeBatchWorker, check_outputs, to_uint8
from ..prep.inference import fixed_rows
from ..registry import DET_CRAFT, DET_OBJECTIVE, FAMILY, MODEL, block_label
from ..stats import bootstrap_intervals
from ..threat import Problem
from .attacks import Crafted, goal_met
from .data import DetectionDataset
from .metrics import match_image, pool_matches, weighted_pool
from .models import Detector

ROUND = 5  # decimals of the scores kept in records


@dataclass
class DetProblem(Problem):
    """A batch under a detection attack: :class:`~blackboxbench.threat.Problem` plus the ground truth ``gt`` and
    the surrogate's detections of the clean images ``clean`` (one dict per image, dataset labels)."""

    gt: List[dict] = field(default_factory=list)
    clean: List[dict] = field(default_factory=list)

    def sub(self, idx):
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        rows = [int(i) for i in idx.tolist()]
        kw.update(x=self.x[idx], y=self.y[idx], target=None, gt=[self.gt[i] for i in rows],
                  clean=[self.clean[i] for i in rows])
        return DetProblem(**kw)


@dataclass
class DetectionAttack:
    name: str
    craft: Callable
    objective: Optional[Callable]
    meta: dict = field(default_factory=dict)
    per_image: bool = False


def _to_dev(t, dev):
    return {k: v.to(dev) for k, v in t.items()}


def _detach(d):
    return {k: v.detach() for k, v in d.items()}


def forward_dets(model, x, name, chunk=1):
    """A detector's detections on ``x`` under no_grad, in chunks (one image at a time by default: on a GPU the
    kernels, and so the last bits of every score and box, change with the batch's shape, and a record must not
    depend on the batch an image was evaluated in); non-finite boxes or scores are refused."""
    out = []
    with torch.no_grad():
        for i in range(0, x.shape[0], chunk):
            out += [_detach(d) for d in model(x[i:i + chunk])]
    for d in out:
        if not (torch.isfinite(d["boxes"]).all() and torch.isfinite(d["scores"]).all()):
            raise BenchError(f"{name} returned non-finite boxes or scores")
    return out


def match_record(det, gt, count_thr, legacy):
    """The JSON form of one image's matching (class-aware ``c``: [score, label, flag]; fused ``l``: [score,
    flag]; ``npos`` per label; ``n``: detections with score >= count_thr)."""
    s, lab, f, npos = match_image(det, gt, legacy=legacy)
    s2, _, f2, _ = match_image(det, gt, fuse=True, legacy=legacy)
    return {"c": [[round(float(a), ROUND), int(b), int(c)] for a, b, c in zip(s, lab, f)],
            "l": [[round(float(a), ROUND), int(c)] for a, c in zip(s2, f2)],
            "npos": {str(k): v for k, v in npos.items()},
            "n": int((det["scores"] >= (count_thr or 0)).sum())}


def _matches(recs, fused):
    out = []
    for r in recs:
        if fused:
            rows = r["l"]
            out.append(([a for a, _ in rows], [0] * len(rows), [c for _, c in rows],
                        {0: sum(r["npos"].values())}))
        else:
            rows = r["c"]
            out.append(([a for a, _, _ in rows], [b for _, b, _ in rows], [c for _, _, c in rows],
                        {int(k): v for k, v in r["npos"].items()}))
    return out


METRICS = ("map", "ap_loc", "csr", "map_area", "ap_loc_area", "n_det")


def metrics_of(recs):
    """{"map", "ap_loc" (11-point), "map_area", "ap_loc_area" (all-point), "csr", "n_det"} pooled over the
    per-image match records ``recs``."""
    if not recs:
        return dict.fromkeys(METRICS)
    cls, loc = _matches(recs, False), _matches(recs, True)
    c11, l11 = pool_matches(cls, "11points"), pool_matches(loc, "11points")
    return {"map": c11["map"], "ap_loc": l11["map"], "csr": c11["tp"] / c11["npos"] if c11["npos"] else None,
            "map_area": pool_matches(cls, "area")["map"], "ap_loc_area": pool_matches(loc, "area")["map"],
            "n_det": sum(r["n"] for r in recs) / len(recs)}


def _mean(v):
    v = [a for a in v if a is not None]
    return float(sum(v) / len(v)) if v else None


def _drop(clean, adv):
    return None if clean in (None, 0) or adv is None else (clean - adv) / clean


DROPS = ("map", "ap_loc", "csr")


def _relative_drop(clean, adv):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(clean > 0, (clean - adv) / clean, np.nan)


def drop_intervals(attacked, names):
    """95 % intervals of each target's relative drops of mAP, AP_loc and CSR (11-point, as the summary's) and of
    their means over the targets: a percentile bootstrap over the attacked images, one resample serving clean and
    adversarial detections and every target (they are paired on the images). ``{(target or None, drop): (low,
    high)}``; None: the mean over targets."""
    pools = {(t, side, fused): _matches([r["targets"][t][side] for r in attacked], fused)
             for t in names for side in ("clean", "adv") for fused in (False, True)}

    def stat(w, _):
        cols = []
        for t in names:
            (c_map, c_tp, c_npos), (a_map, a_tp, a_npos) = (weighted_pool(pools[t, s, False], w)
                                                            for s in ("clean", "adv"))
            c_loc, a_loc = (weighted_pool(pools[t, s, True], w)[0] for s in ("clean", "adv"))
            with np.errstate(invalid="ignore", divide="ignore"):
                cols += [_relative_drop(c_map, a_map), _relative_drop(c_loc, a_loc),
                         _relative_drop(c_tp / c_npos, a_tp / a_npos)]
        d = np.stack(cols, 1)
        return np.concatenate([d, np.stack([np.nanmean(d[:, k::len(DROPS)], 1) for k in range(len(DROPS))], 1)], 1)

    keys = [(t, k) for t in names for k in DROPS] + [(None, k) for k in DROPS]
    return dict(zip(keys, bootstrap_intervals(stat, [np.arange(len(attacked))], len(keys)))) if names else {}


def paired_drop(pairs, target):
    """Two detection runs on the same images, one target: ``pairs`` [(record of A, record of B)] of the images both
    attacked. Each run's relative mAP drop (11-point, against its own clean detections), B's minus A's, and a 95 %
    percentile bootstrap interval of that difference whose resamples draw the same images for both runs (the
    pairing: image difficulty cancels)."""
    pools = [_matches([p[k]["targets"][target][side] for p in pairs], False) for k in (0, 1)
             for side in ("clean", "adv")]

    def drops(w):  # (B, 2): A's and B's drop in each resample
        maps = [weighted_pool(pool, w)[0] for pool in pools]
        return np.stack([_relative_drop(maps[0], maps[1]), _relative_drop(maps[2], maps[3])], 1)

    def diff(w, _):
        d = drops(w)
        return d[:, 1:] - d[:, :1]

    a, b = (float(v) for v in drops(np.ones((1, len(pairs))))[0])
    (low, high), = bootstrap_intervals(diff, [np.arange(len(pairs))], 1)
    nan = [not np.isfinite(v) for v in (a, b)]
    return {"n": len(pairs), "drop_a": None if nan[0] else a, "drop_b": None if nan[1] else b,
            "diff": None if any(nan) else b - a, "low": low, "high": high}


def summarize_detection(records):
    """Per target detector: clean and adversarial mAP, AP_loc, CSR, detections per image and the relative
    drops with their 95 % intervals (:func:`drop_intervals`); the run's perceptual cost (means over attacked
    images) and time per image. ``asr`` is the mean relative mAP drop over the targets (the leaderboard's sort
    key), ``asr_low`` / ``asr_high`` its interval; each target's results repeat its mAP drop and clean mAP under
    those names (``asr``, ``clean_acc``), so that per-target analysis rows read the target's own values."""
    attacked = [r for r in records if r["attacked"]]
    names = list(records[0]["targets"]) if records else []
    per, intervals = {}, drop_intervals(attacked, names)
    for t in names:
        clean = metrics_of([r["targets"][t]["clean"] for r in attacked])
        adv = metrics_of([r["targets"][t]["adv"] for r in attacked])
        per[t] = {**{f"clean_{k}": v for k, v in clean.items()}, **{f"adv_{k}": v for k, v in adv.items()},
                  **{f"drop_{k}": _drop(clean[k], adv[k]) for k in DROPS},
                  **{f"drop_{k}_{end}": intervals[t, k][i] for k in DROPS for i, end in enumerate(("low", "high"))},
                  "det_ratio": None if not clean["n_det"] else adv["n_det"] / clean["n_det"],
                  **{f"goal_rate{sfx}": _mean([float(g) for g in (r["targets"][t].get(f"goal{sfx}")
                                                                   for r in attacked) if g is not None])
                     for sfx in ("", "_clean")},
                  "score_thr": attacked[0]["targets"][t]["score_thr"] if attacked else None,
                  "max_det": attacked[0]["targets"][t]["max_det"] if attacked else None}
        per[t].update(clean_acc=per[t]["clean_map"], asr=per[t]["drop_map"], asr_low=per[t]["drop_map_low"],
                      asr_high=per[t]["drop_map_high"])  # the run-level names, per target (analysis rows)
    out = {"n": len(records), "n_attacked": len(attacked), "per_target": per,
           "clean_acc": _mean([p["clean_map"] for p in per.values()]),
           "asr": _mean([p["drop_map"] for p in per.values()]), "aqn": None, "mqn": None,
           "attack_time": sum(r["time"] for r in records),
           "time_per_image": _mean([r["time"] for r in attacked])}
    for k in DROPS:
        out[f"mean_drop_{k}"] = _mean([p[f"drop_{k}"] for p in per.values()])
        out[f"mean_drop_{k}_low"], out[f"mean_drop_{k}_high"] = intervals.get((None, k), (None, None))
    out["asr_low"], out["asr_high"] = out["mean_drop_map_low"], out["mean_drop_map_high"]
    out["mean_goal_rate"] = _mean([p["goal_rate"] for p in per.values()])
    out.update(distortion_summary(attacked))
    return out


class Perceptual:
    """SSIM and LPIPS per image from :mod:`blackboxbench.perceptual` (LPIPS None when its AlexNet trunk is not
    cached: one warning, never a download)."""

    def __init__(self, device):
        try:
            from .. import perceptual
        except ImportError:
            perceptual = None
        self.mod = perceptual
        self.net = perceptual.load_lpips(device=device) if perceptual is not None else None

    def __call__(self, x_adv, x):
        n = x.shape[0]
        if self.mod is None:
            return [None] * n, [None] * n
        with torch.no_grad():
            ssim = self.mod.ssim(x_adv, x).float().cpu().tolist()
            lp = self.mod.lpips_distance(self.net, x_adv, x).float().cpu().tolist() if self.net is not None \
                else [None] * n
        return ssim, lp


def _checked_craft(out, x, block):
    """``out`` if it is images shaped like the batch ``x`` or a :class:`Crafted` holding them with one goal per
    image (a craft block's contract), else a one-line error naming the block."""
    images = out.x if isinstance(out, Crafted) else out
    if not isinstance(images, torch.Tensor) or images.shape != x.shape:
        bad = describe(images)
    elif not images.dtype.is_floating_point:
        bad = f"a tensor of dtype {images.dtype}"
    else:
        bad = None
    if bad and images is not out:
        bad = f"a Crafted holding {bad}"
    elif not bad and isinstance(out, Crafted) and not len(out.boxes) == len(out.labels) == x.shape[0]:
        bad = f"a Crafted with {len(out.boxes)} goal boxes and {len(out.labels)} labels"
    if bad:
        raise BenchError(f"craft {block_label(block)} returned {bad} for {x.shape[0]} images: a craft block returns "
                         f"the adversarial images, a float tensor shaped {tuple(x.shape)}, or a Crafted holding them "
                         "with one goal per image")
    return out


class DetectionWorker(WholeBatchWorker):
    """One whole batch per step: the surrogate's clean detections, the craft, then every target detector."""

    def __init__(self, family, run):
        self.run, self.attack, self.threat = run, run.attack, run.threat
        t = run.threat
        self.surrogates = run.models["surrogates"]
        self.targets = list(zip(run.model_names["targets"], run.models["targets"]))
        for m in [*self.surrogates, *(m for _, m in self.targets)]:
            m.harmonize(t["score_thr"], t["max_det"])
        self.model = self.surrogates[0]
        self.pool = Pool(run.data.x.clone(), run.data.y)  # the blocks' copy of the images
        self.perceptual = Perceptual(run.device)
        super().__init__()
        self.clean_cache = {}

    def craft(self, ctx):
        """The craft block on the batch, or one image at a time for a block registered ``per_image=True``: an
        attack that adapts per image (EBAD's surrogate weights, CAA's plans) on torchvision training losses, which
        are batch means (normalised by the batch's positives, R-CNN's sampled proposals), so a batched run would
        make an image's result depend on its neighbours. The authors run both one image at a time.

        Under ``fixed_batch: k`` a batched craft runs on parts of exactly k images, the last padded with copies of
        its last image (:func:`~blackboxbench.prep.inference.fixed_rows`; the padding's images dropped): on a GPU
        the surrogate's answers, hence its gradients, move with the shape of its calls, so the images returned
        would otherwise depend on ``batch_size``."""
        a, n = self.attack, ctx.problem.n
        if a.per_image:
            rows = list(torch.arange(n, device=ctx.device).split(1))
        elif self.run.fixed_batch:
            rows = fixed_rows(n, self.run.fixed_batch, ctx.device)
        else:
            return _checked_craft(a.craft(ctx, a.objective), ctx.problem.x, a.craft)
        parts = [_checked_craft(a.craft(ctx.sub(r), a.objective), ctx.problem.x[r], a.craft) for r in rows]
        if isinstance(parts[0], Crafted):
            out = Crafted.cat(parts)
            return Crafted(out.x[:n], out.boxes[:n], out.labels[:n], out.iou)
        return torch.cat(parts)[:n]

    def step(self):
        index = self.take()
        if not index:
            return []
        run, t, dev = self.run, self.threat, self.run.device
        data = run.data
        t0 = time.perf_counter()
        idx = torch.tensor(index, dtype=torch.long)
        x = data.x[idx].to(dev)
        y = data.y[idx].to(dev)
        gt = [_to_dev(data.targets[i], dev) for i in index]
        # one image at a time: the attacks' pseudo truth, whose box coordinates steer FCOS's target assignment
        # (a 1e-5 shift flips 4 % of a gradient's signs), must not move with the batch's conv numerics
        clean = forward_dets(self.model, x, "the surrogate")
        # the blocks get a copy; the projection, the output check and the targets' evaluation read the worker's own
        own = DetProblem(x, y, t["eps"], t["norm"], None, data.num_classes, gt=gt, clean=clean)
        problem = own.copy()
        ctx = BlockContext(problem=problem, rng=run.streams.view(idx), surrogates=tuple(self.surrogates),
                           assets=run.assets, pool=self.pool, model=self.model)
        out = self.craft(ctx)
        goal = out if isinstance(out, Crafted) else None  # the attack's own goal per image (EBAD, CAA)
        x_adv = own.quantize(own.project((out.x if goal else out).detach()))
        check_outputs(x_adv, x, t["eps"], t["norm"], self.attack.name)
        per = (time.perf_counter() - t0) / len(index)  # the attack's time (evaluation excluded)
        legacy, count_thr = getattr(data, "legacy_coords", False), t["count_thr"]
        results = {}
        for name, m in self.targets:
            c = forward_dets(m, x, name)
            a = forward_dets(m, x_adv, name)
            met, met0 = ([goal_met(d, goal.boxes, goal.labels, goal.iou) for d in (a, c)] if goal else
                         ([None] * len(index), [None] * len(index)))
            results[name] = [{"clean": match_record(c[k], gt[k], count_thr, legacy),
                              "adv": match_record(a[k], gt[k], count_thr, legacy), "goal": met[k],
                              "goal_clean": met0[k]} for k in range(len(index))]
        ssim, lp = self.perceptual(x_adv, x)
        dist = distances(x_adv, x)
        images = to_uint8(x_adv) if run.save_adv else None
        records = []
        for k, i in enumerate(index):
            r = {"index": int(i), "label": 0, "target": None, "clean_correct": True, "attacked": True,
                 **{m: v[k] for m, v in dist.items()}, "ssim": ssim[k], "lpips": lp[k], "time": per,
                 "n_gt": int((~gt[k]["difficult"]).sum()),
                 "goal": None if goal is None or int(goal.labels[k]) < 0 else
                 {"box": [round(float(v), ROUND) for v in goal.boxes[k]], "label": int(goal.labels[k]),
                  "iou": goal.iou},
                 "targets": {name: dict(res[k], score_thr=m.score_thr, max_det=m.max_det)
                             for (name, m), res in zip(self.targets, results.values())}}
            if images is not None:
                r["_image"] = images[k]
            records.append(r)
        return records


class DetectionFamily(Family):
    name = "detection"
    blocks = {"craft": BlockKind(DET_CRAFT, default="sign_pgd"), "objective": BlockKind(DET_OBJECTIVE, default="none")}
    hyper = {"eps": None}
    model_keys = {"surrogates": ModelKey("surrogate", True, True), "targets": ModelKey("target", True, True)}
    threat_keys = {"score_thr": (int, float, type(None)), "max_det": (int, type(None)),
                   "count_thr": (int, float, type(None))}
    record_fields = {"targets": (dict,), "ssim": (float, int, type(None)), "lpips": (float, int, type(None)),
                     "n_gt": (int,), "goal": (dict, type(None))}
    surrogate_may_be_target = True  # a target equal to the surrogate is the white-box result
    classifier_models = False
    columns = (("mean_drop_map", "higher"), ("mean_drop_map_low", None), ("mean_drop_map_high", None),
               ("mean_drop_ap_loc", "higher"), ("mean_drop_ap_loc_low", None), ("mean_drop_ap_loc_high", None),
               ("mean_drop_csr", "higher"), ("mean_drop_csr_low", None), ("mean_drop_csr_high", None),
               ("mean_goal_rate", "higher"), ("mean_ssim", "higher"), ("mean_lpips", "lower"),
               ("time_per_image", "lower"))
    table = [("label", "attack"), ("target_model", "targets"), ("norm", "norm"), ("eps", "eps"), ("n", "n"),
             ("clean_acc", "clean mAP"), ("mean_drop_map", "mAP drop"), ("mean_drop_map_interval", "mAP drop 95 %"),
             ("mean_drop_ap_loc", "AP_loc drop"),
             ("mean_drop_csr", "CSR drop"), ("mean_linf", "mean Linf"), ("mean_ssim", "mean SSIM"),
             ("time_per_image", "s / image")]

    def default_eps(self, recipe, norm):
        eps = (recipe.get("hyper") or {}).get("eps")
        try:
            return resolve_setting(eps, {"norm": norm, "targeted": False}) if eps is not None else None
        except ValueError:
            return None

    def finish_threat(self, threat, recipe, source):
        t = dict(threat)
        t.setdefault("score_thr", None)
        t.setdefault("max_det", None)
        t.setdefault("count_thr", None)
        if t["score_thr"] is not None and not 0 <= t["score_thr"] < 1:
            raise ConfigError(f"must be in [0, 1), got {t['score_thr']}", source, "threat.score_thr")
        if t["max_det"] is not None and t["max_det"] < 1:
            raise ConfigError(f"must be >= 1, got {t['max_det']}", source, "threat.max_det")
        if t["count_thr"] is not None and not 0 <= t["count_thr"] <= 1:
            raise ConfigError(f"must be in [0, 1], got {t['count_thr']}", source, "threat.count_thr")
        if t["targeted"]:
            raise ConfigError("detection attacks choose their own targets (mislabel recipes); set targeted: false",
                              source, "threat.targeted")
        return t

    def build(self, name, blocks, hyper, meta):
        craft = blocks["craft"]
        return DetectionAttack(name, craft, blocks.get("objective"), meta,
                               per_image=bool(craft.func.registry_meta.get("per_image")))

    def check_inputs(self, models, data, source, attack, assets):
        if not isinstance(data, DetectionDataset):
            raise ConfigError(f"dataset {data.name} has no boxes: the detection family needs a detection dataset "
                              "(shapes, voc2007, coco_json)", source, "dataset")
        if data.boxes_only:
            raise ConfigError("boxes_only reads no pixels: it is for assets that need the boxes alone", source,
                              "dataset.boxes_only")
        for key, ms in models.items():
            for i, m in enumerate(ms):
                if not isinstance(m, Detector):
                    names = [n for n in MODEL.names() if MODEL.get(n).registry_meta.get("task") == "detection"]
                    raise ConfigError(f"not a detector (use one of: {', '.join(names)}; torchvision_det takes "
                                      "arch: <a torchvision detection model>)", source, f"{key}[{i}]")
                if int(m.label_map.max()) >= data.num_classes:
                    raise ConfigError(f"the detector outputs class ids up to {int(m.label_map.max())} but dataset "
                                      f"{data.name} has {data.num_classes} classes", source, f"{key}[{i}]")
        bad = [int(t["labels"].max()) for t in data.targets if len(t["labels"]) and
               int(t["labels"].max()) >= data.num_classes]
        if bad:
            raise ConfigError(f"box labels must be in [0, {data.num_classes}), got {bad[0]}", source, "dataset")
        self._check_attack(models, data, source, attack, assets)

    def _check_attack(self, models, data, source, attack, assets):
        """What the attack's blocks need of the inputs: a craft block that reads per-candidate class scores
        (``heads`` at registration) runs on a one-stage surrogate; a trained asset's images share the dataset's
        size (a universal perturbation is one image) and its boxes the dataset's classes (CAA's context tables)."""
        craft = attack.craft.func.registry_meta
        heads = craft.get("heads")
        for key, ms in models.items():
            for i, m in enumerate(ms):
                if heads and self.model_keys[key].role == "surrogate" and m.kind not in heads:
                    raise ConfigError(f"{craft['name']} reads a one-stage head's per-candidate class scores "
                                      f"({', '.join(heads)}); the {m.kind} detector has none", source, f"{key}[{i}]")
        for name in attack.meta["assets"]:
            a = assets.get(name)
            size = tuple(a.data.x.shape[-2:]) if hasattr(a, "data") else None
            if size is not None and size != tuple(data.x.shape[-2:]):
                raise ConfigError(f"its images are {size[0]}x{size[1]}, the dataset's {data.x.shape[-2]}x"
                                  f"{data.x.shape[-1]}: give the asset's spec the dataset's size", source,
                                  f"assets.{name}")
            k = getattr(a, "num_classes", None)
            if k is not None and k != data.num_classes:
                raise ConfigError(f"its tables cover {k} classes, dataset {data.name} has {data.num_classes}: build "
                                  "them from a dataset of the same classes", source, f"assets.{name}")

    def worker(self, run):
        return DetectionWorker(self, run)

    def summarize(self, records):
        return summarize_detection(records)

    def after_runs(self, results_dirs, leaderboard):
        from .report import write_reports

        return write_reports(results_dirs, leaderboard)


FAMILY.register("detection", paper="od-robustness benchmark (arXiv 2602.16494), Sec. 3")(DetectionFamily())
