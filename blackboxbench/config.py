"""Experiment configs: load YAML, merge runs and ``--set`` overrides, validate everything up front.

Only this module and :mod:`builder` read configs; blocks are plain functions. Every error is one line naming the
file and the key path (with close matches for unknown keys and names).
"""
import ast
import copy
import hashlib
import importlib
import importlib.util
import json
import operator
from pathlib import Path

import yaml

from .errors import BenchError, ConfigError
from .registry import close_matches
from .threat import NORMS

# Threat-model defaults: Tables V-VII of the paper, CIFAR-10 columns (eps); each family adds its own (budget).
DEFAULT_EPS = {"linf": 0.03, "l2": 1.0}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def parse_number(value, names=None):
    """A number, or a string of arithmetic like ``8/255`` or ``eps/10`` (``names`` gives the symbols)."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, (int, float)):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    names = names or {}

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"cannot evaluate '{value}' (numbers, + - * / ** and {sorted(names) or 'no names'})")

    try:
        return ev(ast.parse(value, mode="eval"))
    except SyntaxError:
        raise ValueError(f"cannot parse '{value}' as a number") from None
    except ZeroDivisionError:
        raise ValueError(f"division by zero in '{value}'") from None


def load_yaml(path):
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file not found", source=path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(f"{where}invalid YAML ({getattr(e, 'problem', None) or e})", source=path) from None
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping", source=path)
    return data


def deep_merge(base, over):
    """Merge mapping ``over`` into a copy of ``base`` (lists and scalars replace)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def apply_set(cfg, assignments, source):
    """Apply ``--set a.b=value`` overrides (value parsed as YAML)."""
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'", source=source)
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        node = cfg
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError("cannot set inside a non-mapping", source=source, key=key)
        node[parts[-1]] = value
    return cfg


# ---------------------------------------------------------------- schema ----------------------------------------

def _check_type(value, kinds, source, key):
    if kinds is None:
        return value
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}", source, key)
    if not isinstance(value, kinds):
        raise ConfigError(f"expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__} "
                          f"{value!r}", source, key)
    return value


def check_keys(mapping, allowed, source, prefix):
    for k in mapping:
        if k not in allowed:
            raise ConfigError(f"unknown key{close_matches(k, allowed)}; allowed: {', '.join(sorted(allowed))}",
                              source, f"{prefix}{k}")


SPEC = (str, dict)  # a name, or {name: ..., params}
COMMON_KEYS = {
    "name": (str,), "plugins": (list,), "data_root": (str, type(None)), "output_dir": (str,), "seed": (int,),
    "device": (str,), "batch_size": (int,), "dataset": SPEC, "attack": SPEC, "threat": (dict,),
    "save_adv": (bool,), "assets": (dict,), "compile": (bool,),
}
COMMON_THREAT_KEYS = {"norm": (str,), "eps": (int, float, str), "targeted": (bool,), "target_label": SPEC}
FILE_KEYS = {"runs": (list,), "leaderboard": (str,)}
DEVICES = ("auto", "cpu", "cuda")


def _families():
    from .registry import FAMILY

    return [FAMILY.get(n) for n in FAMILY.names()]


def top_keys():
    """Every top-level key: the common ones and the model keys of every registered family."""
    keys = dict(COMMON_KEYS)
    for fam in _families():
        keys.update({k: (list,) if mk.many else SPEC for k, mk in fam.model_keys.items()})
    return keys


def threat_keys():
    keys = dict(COMMON_THREAT_KEYS)
    for fam in _families():
        keys.update(fam.threat_keys)
    return keys


def _owners(key, attr):
    return [f.name for f in _families() if key in getattr(f, attr)]


def check_family_keys(exp, family, source):
    """Model and threat keys must be the family's own; the family's required model keys must be present."""
    for key, mk in family.model_keys.items():
        if mk.required and not exp.get(key):
            raise ConfigError(f"a {family.name} attack needs '{key}'" + (" (a non-empty list)" if mk.many else ""),
                              source, key)
    for key in exp:
        if key not in COMMON_KEYS and not key.startswith("_") and key not in family.model_keys:
            raise ConfigError(f"not used by {family.name} attacks (only by {', '.join(_owners(key, 'model_keys'))})",
                              source, key)
    for key in exp["threat"]:
        if key not in COMMON_THREAT_KEYS and key not in family.threat_keys:
            raise ConfigError(f"only for {', '.join(_owners(key, 'threat_keys'))} attacks", source, f"threat.{key}")


def spec_to_dict(spec, source, key):
    """``"timm:resnet18"`` -> {name: timm, arch: resnet18}; ``"x"`` -> {name: x}; dicts need ``name``."""
    if isinstance(spec, str):
        name, _, arch = spec.partition(":")
        return {"name": name, "arch": arch} if arch else {"name": name}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ConfigError("expected a name or a mapping with 'name'", source, key)
    return dict(spec)


def import_plugins(plugins, source, base_dir):
    """Import modules or files whose decorators register new blocks."""
    for i, p in enumerate(plugins):
        key = f"plugins[{i}]"
        if not isinstance(p, str):
            raise ConfigError("expected a module name or a .py path", source, key)
        try:
            if p.endswith(".py"):
                path = Path(p) if Path(p).is_absolute() else Path(base_dir) / p
                if not path.is_file():
                    raise ConfigError(f"plugin file not found: {path}", source, key)
                mod_name = "bbb_plugin_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
                import sys
                if mod_name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(p)
        except ConfigError:
            raise
        except BenchError as e:
            raise ConfigError(str(e), source, key) from None
        except Exception as e:  # noqa: BLE001 - a plugin may fail in any way; report it on one line
            raise ConfigError(f"cannot import plugin '{p}': {type(e).__name__}: {e}", source, key) from None


def validate_experiment(cfg, source):
    """Check types and ranges of one experiment; returns a normalized copy (defaults filled in)."""
    keys = top_keys()
    check_keys(cfg, keys, source, "")
    for k, v in cfg.items():
        _check_type(v, keys[k], source, k)
    out = {"name": None, "plugins": [], "data_root": None, "output_dir": "results", "seed": 0, "device": "auto",
           "batch_size": 100, "save_adv": False, "assets": {}, "compile": False}
    out.update(copy.deepcopy(cfg))
    for key in ("dataset", "attack"):
        if key not in out:
            raise ConfigError("missing required key", source, key)
    if out["device"] not in DEVICES:
        raise ConfigError(f"must be one of {', '.join(DEVICES)}{close_matches(out['device'], DEVICES)}",
                          source, "device")
    for key in ("batch_size",):
        if out[key] < 1:
            raise ConfigError("must be >= 1", source, key)
    if out["seed"] < 0:
        raise ConfigError("must be >= 0", source, "seed")
    out["dataset"] = spec_to_dict(out["dataset"], source, "dataset")
    n = out["dataset"].get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError("must be a positive integer", source, "dataset.n")
    for key, kinds in keys.items():
        if key in out and key not in COMMON_KEYS:  # model keys
            out[key] = [spec_to_dict(s, source, f"{key}[{i}]") for i, s in enumerate(out[key])] \
                if kinds == (list,) else spec_to_dict(out[key], source, key)
    out["assets"] = {k: spec_to_dict(v, source, f"assets.{k}") for k, v in out["assets"].items()}

    threat = dict(out.get("threat") or {})
    tk = threat_keys()
    check_keys(threat, tk, source, "threat.")
    for k, v in threat.items():
        _check_type(v, tk[k], source, f"threat.{k}")
    out["threat"] = threat
    return out


def finish_threat(threat, recipe, family, source):
    """Fill threat defaults (paper tables) given the recipe and its family; check ranges and compatibility."""
    t = dict(threat)
    t.setdefault("norm", recipe["norms"][0])
    if t["norm"] not in NORMS:
        raise ConfigError(f"must be one of {', '.join(NORMS)}{close_matches(t['norm'], NORMS)}", source,
                          "threat.norm")
    if t["norm"] not in recipe["norms"]:
        raise ConfigError(f"attack '{recipe['name']}' supports norms {recipe['norms']}, not '{t['norm']}'",
                          source, "threat.norm")
    t.setdefault("targeted", False)
    if t["targeted"] and not recipe["targeted"]:
        raise ConfigError(f"attack '{recipe['name']}' does not support targeted attacks", source,
                          "threat.targeted")
    try:
        t["eps"] = float(parse_number(t.get("eps", DEFAULT_EPS[t["norm"]])))
    except ValueError as e:
        raise ConfigError(str(e), source, "threat.eps") from None
    if not (t["eps"] > 0) or (t["norm"] == "linf" and t["eps"] > 1):
        raise ConfigError(f"out of range: {t['eps']} (linf eps in (0, 1], l2 eps > 0, in [0,1] pixel units)",
                          source, "threat.eps")
    # Supp. D-B: targeted runs pick the target from the model's logits; "median" is the paper's default.
    t["target_label"] = spec_to_dict(t.get("target_label", "median"), source, "threat.target_label") \
        if t["targeted"] else None
    return family.finish_threat(t, recipe, source)


def config_hash(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def load_config(path, overrides=()):
    """Load a config file into a list of validated experiments (one per entry of ``runs``, else one).

    Returns ``(experiments, file_options)``; each experiment carries ``_source`` for error messages.
    """
    source = str(path)
    raw = load_yaml(path)
    file_opts = {k: raw.pop(k) for k in list(raw) if k in FILE_KEYS}
    for k, v in file_opts.items():
        _check_type(v, FILE_KEYS[k], source, k)
    runs = file_opts.get("runs") or [{}]
    experiments = []
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            raise ConfigError("each run must be a mapping", source, f"runs[{i}]")
        check_keys(run, top_keys(), source, f"runs[{i}].")
        merged = apply_set(deep_merge(raw, run), overrides, source)
        exp = validate_experiment(merged, source)
        exp["_source"] = source
        exp["_base_dir"] = str(Path(path).resolve().parent)
        experiments.append(exp)
    return experiments, file_opts
