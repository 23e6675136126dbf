"""Run one experiment: prepare data and models, attack batch by batch, write records incrementally, resume.

A run directory holds ``config.yaml`` (the resolved config), ``records.jsonl`` (one line per sample, written a
whole batch at a time and fsync'ed) and ``summary.json``. Batches are fixed slices of the dataset and each has
its own generator seeded from (seed, batch index), so re-running an interrupted run skips the finished batches,
redoes the unfinished one, and ends with exactly the records of an uninterrupted run.
"""
import json
import os
import shutil
import time
from pathlib import Path

import torch
import yaml

from . import __version__
from .builder import build_attack, load_recipe
from .config import ConfigError, config_hash, finish_threat, import_plugins
from .errors import BenchError
from .evaluation import sample_metrics, summarize_query, summarize_transfer
from .oracle import Oracle
from .prep.data import resolve_data_root
from .prep.models import build_model
from .registry import DATASET, MODEL, TARGET_LABEL, check_params
from .threat import Problem

SEED_STRIDE = 1_000_003


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("device: 'cuda' requested but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def make_generator(device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


class Session:
    """Caches shared by the runs of one process (models are built once, never per batch)."""

    def __init__(self):
        self.models = {}

    def model(self, spec, data_root, device, source, key):
        cache_key = (json.dumps(spec, sort_keys=True), str(data_root), str(device))
        if cache_key not in self.models:
            try:
                self.models[cache_key] = build_model(spec, data_root=data_root, device=device)
            except BenchError as e:
                raise ConfigError(str(e), source, key) from None
        return self.models[cache_key]


def spec_label(spec):
    return spec["name"] + (f":{spec['arch']}" if spec.get("arch") else "")


def prepare(exp):
    """Resolve everything that can fail before running (plugins, recipe, threat, names, data root)."""
    source = exp["_source"]
    import_plugins(exp["plugins"], source, exp["_base_dir"])
    recipe, recipe_source = load_recipe(exp["attack"], source)
    threat = finish_threat(exp["threat"], recipe, source)
    attack = build_attack(recipe, threat, recipe_source)
    query = recipe["family"] != "transfer"
    if query and "model" not in exp:
        raise ConfigError("a query attack needs the target 'model'", source, "model")
    if not query and (not exp["surrogates"] or not exp["targets"]):
        raise ConfigError("a transfer attack needs 'surrogates' and 'targets' lists", source,
                          "surrogates" if not exp["surrogates"] else "targets")
    specs = [("dataset", DATASET, exp["dataset"])]
    if threat["targeted"]:
        specs.append(("threat.target_label", TARGET_LABEL, threat["target_label"]))
    models = [("model", exp["model"])] if query else \
        [(f"{k}[{i}]", s) for k in ("surrogates", "targets") for i, s in enumerate(exp[k])]
    specs += [(key, MODEL, spec) for key, spec in models]
    for key, registry, spec in specs:
        params = {k: v for k, v in spec.items() if k != "name"}
        try:
            check_params(registry.get(spec["name"]), params)
        except BenchError as e:
            raise ConfigError(str(e), source, key) from None
    resolved = {k: v for k, v in exp.items() if not k.startswith("_") and k not in ("attack", "threat")}
    resolved.update(attack=recipe, threat=threat, version=__version__)
    if query:
        resolved.pop("surrogates"), resolved.pop("targets")
    return recipe, threat, attack, resolved


def run_dir_for(exp, recipe, threat, resolved, device):
    h = config_hash({k: v for k, v in resolved.items() if k not in ("output_dir", "name")} | {"device": device.type})
    model = spec_label(exp["model"]) if recipe["family"] != "transfer" else \
        "+".join(spec_label(s) for s in exp["surrogates"])
    parts = [exp["name"] or recipe["name"], exp["dataset"]["name"], model.replace(":", "-"), threat["norm"],
             "targeted" if threat["targeted"] else "untargeted", h]
    return Path(exp["output_dir"]) / "_".join(parts), h


def read_records(path, batch_size, n):
    """Records of complete batches only (a crash may leave a partial batch or a torn last line)."""
    if not path.exists():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[r["index"]] = r
    complete = {}
    for start in range(0, n, batch_size):
        idx = range(start, min(start + batch_size, n))
        if all(i in records for i in idx):
            complete.update({i: records[i] for i in idx})
    return complete


def atomic_write(path, text):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_batch(path, records):
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def check_outputs(x_adv, x, eps, norm, name):
    """Guard the threat model on what an attack returns: in [0, 1], on the uint8 grid, inside the eps ball."""
    bad = None
    if x_adv.shape != x.shape:
        bad = f"shape {tuple(x_adv.shape)} != {tuple(x.shape)}"
    elif x_adv.min() < 0 or x_adv.max() > 1:
        bad = "values outside [0, 1]"
    elif (x_adv * 255 - torch.round(x_adv * 255)).abs().max() > 1e-3:
        bad = "values off the uint8 grid"
    else:
        d = (x_adv - x).flatten(1)
        d = d.abs().amax(1) if norm == "linf" else d.norm(dim=1)
        if (d > eps + 1e-5).any():
            bad = f"a perturbation of {norm} norm {d.max().item():.6f} > eps {eps}"
    if bad:
        raise BenchError(f"attack '{name}' returned invalid images: {bad}")


def _targets_for(threat, logits, y, gen, given):
    if not threat["targeted"]:
        return None
    tl = dict(threat["target_label"])
    fn = TARGET_LABEL.get(tl.pop("name"))
    return fn(logits, y, gen, given, **tl).to(y.device)


def _base_records(start, y, target, clean_correct):
    y, ok = y.tolist(), clean_correct.tolist()  # one device sync per batch, not per sample
    target = [None] * len(y) if target is None else target.tolist()
    return [{"index": start + i, "label": y[i], "target": target[i], "clean_correct": bool(ok[i])}
            for i in range(len(y))]


class Runner:
    """Runs one validated experiment (see :func:`run_experiment`)."""

    def __init__(self, exp, session=None, fresh=False, progress=True):
        self.exp, self.session, self.progress = exp, session or Session(), progress
        self.recipe, self.threat, self.attack, self.resolved = prepare(exp)
        self.device = resolve_device(exp["device"])
        self.run_dir, self.hash = run_dir_for(exp, self.recipe, self.threat, self.resolved, self.device)
        if fresh and self.run_dir.exists():
            shutil.rmtree(self.run_dir)

    @property
    def query(self):
        return self.recipe["family"] != "transfer"

    def run(self):
        exp, source = self.exp, self.exp["_source"]
        try:
            data_root = resolve_data_root(exp["data_root"]) if exp["data_root"] or os.environ.get(
                "BLACKBOXBENCH_DATA") else None
        except BenchError as e:
            raise ConfigError(str(e), source, "data_root") from None
        ds_cfg = dict(exp["dataset"])
        try:
            data = DATASET.get(ds_cfg.pop("name"))(data_root, **ds_cfg)
        except BenchError as e:
            raise ConfigError(str(e), source, "dataset") from None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.run_dir / "config.yaml", yaml.safe_dump(self.resolved, sort_keys=False))
        rec_path = self.run_dir / "records.jsonl"
        bs, n = exp["batch_size"], len(data.y)
        done = read_records(rec_path, bs, n)
        atomic_write(rec_path, "".join(json.dumps(done[i]) + "\n" for i in sorted(done)))
        if self.query:
            models = {"model": self.session.model(exp["model"], data_root, self.device, source, "model")}
        else:
            models = {spec_label(t): self.session.model(t, data_root, self.device, source, f"targets[{i}]")
                      for i, t in enumerate(exp["targets"])}
            surrogates = [self.session.model(s, data_root, self.device, source, f"surrogates[{i}]")
                          for i, s in enumerate(exp["surrogates"])]
            models["_surrogate"] = self.attack.refine(surrogates, make_generator(self.device, exp["seed"]))
        bar = _progress(n, len(done), self.progress, self.recipe["name"])
        t0 = time.time()
        for b, start in enumerate(range(0, n, bs)):
            if start in done:
                continue
            end = min(start + bs, n)
            gen = make_generator(self.device, exp["seed"] * SEED_STRIDE + b)
            x, y = data.x[start:end].to(self.device), data.y[start:end].to(self.device)
            given = None if data.given_target is None else data.given_target[start:end].to(self.device)
            step = self._query_batch if self.query else self._transfer_batch
            records = step(models, x, y, given, gen, start, data.num_classes)
            append_batch(rec_path, records)
            done.update({r["index"]: r for r in records})
            bar.update(len(records))
            s = (summarize_query if self.query else summarize_transfer)([done[i] for i in sorted(done)])
            bar.set_postfix(asr=_fmt(s["asr"]), aqn=_fmt(s["aqn"]))
        bar.close()
        summary = self.summary([done[i] for i in range(n)], time.time() - t0)
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return summary

    def summary(self, records, wall):
        s = (summarize_query if self.query else summarize_transfer)(records)
        exp, t = self.exp, self.threat
        s.update(run=self.run_dir.name, attack=self.recipe["name"], family=self.recipe["family"],
                 paper=self.recipe.get("paper"), dataset=exp["dataset"]["name"],
                 target_model=spec_label(exp["model"]) if self.query else "+".join(
                     spec_label(m) for m in exp["targets"]),
                 surrogates=None if self.query else "+".join(spec_label(m) for m in exp["surrogates"]),
                 norm=t["norm"], eps=t["eps"], targeted=t["targeted"], budget=t.get("max_queries"),
                 feedback=t.get("feedback"), seed=exp["seed"], config_hash=self.hash, version=__version__,
                 device=self.device.type, wall_time=wall)
        return s

    def _query_batch(self, models, x, y, given, gen, start, num_classes):
        model, t = models["model"], self.threat
        t0 = time.time()
        with torch.no_grad():
            logits = model(x)
        correct = logits.argmax(1) == y
        target = _targets_for(t, logits, y, gen, given)
        attack_mask = correct if target is None else correct & (target != y)
        records = _base_records(start, y, target, correct)
        idx = attack_mask.nonzero().squeeze(1)
        for r in records:
            r.update(attacked=False, success=False, queries=0, l2=0.0, linf=0.0, time=0.0)
        if idx.numel():
            problem = Problem(x[idx], y[idx], t["eps"], t["norm"], None if target is None else target[idx],
                              num_classes)
            oracle = Oracle(model, len(idx), t["max_queries"], num_classes, t["feedback"], x.shape[1:])
            res = self.attack.run(problem, oracle, gen)
            check_outputs(res.x_adv, problem.x, t["eps"], t["norm"], self.recipe["name"])
            with torch.no_grad():
                success = problem.is_adv_label(model(res.x_adv).argmax(1))
            metrics = sample_metrics(res.x_adv, problem.x)
            per = (time.time() - t0) / idx.numel()
            success, queries = success.tolist(), res.queries.tolist()
            for j, i in enumerate(idx.tolist()):
                records[i].update(attacked=True, success=bool(success[j]), queries=int(queries[j]),
                                  time=per, **{m: v[j] for m, v in metrics.items()})
        return records

    def _transfer_batch(self, models, x, y, given, gen, start, num_classes):
        t, surrogate = self.threat, models["_surrogate"]
        t0 = time.time()
        with torch.no_grad():
            logits = surrogate(x)
        correct = logits.argmax(1) == y
        target = _targets_for(t, logits, y, gen, given)
        problem = Problem(x, y, t["eps"], t["norm"], target, num_classes)
        x_adv = self.attack.run(surrogate, problem, gen)
        check_outputs(x_adv, x, t["eps"], t["norm"], self.recipe["name"])
        per = (time.time() - t0) / len(y)
        metrics = sample_metrics(x_adv, x)
        records = _base_records(start, y, target, correct)
        valid = (torch.ones_like(y, dtype=torch.bool) if target is None else target != y).tolist()
        results = {}
        with torch.no_grad():
            for name, m in models.items():
                if name == "_surrogate":
                    continue
                clean_ok = m(x).argmax(1) == y
                results[name] = (clean_ok.tolist(), problem.is_adv_label(m(x_adv).argmax(1)).tolist())
        for i, r in enumerate(records):
            r.update(attacked=bool(valid[i]), time=per, **{k: v[i] for k, v in metrics.items()},
                     targets={n: {"clean_correct": bool(c[i]), "success": bool(s[i])}
                              for n, (c, s) in results.items()})
        return records


def _fmt(v):
    return "-" if v is None else f"{v:.3g}"


def _progress(total, initial, enabled, desc):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="img", leave=False)


def run_experiment(exp, session=None, fresh=False, progress=True):
    """Run (or resume) one experiment; returns ``(run_dir, summary)``."""
    runner = Runner(exp, session, fresh, progress)
    return runner.run_dir, runner.run()
