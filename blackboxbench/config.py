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
import math
import operator
import os
import sys
from pathlib import Path

import torch
import yaml

from .errors import BenchError, ConfigError
from .prep.models import bare_spec
from .registry import (ASSET, DATASET, MODEL, TARGET_LABEL, ParamError, check_params, close_matches, restore,
                       snapshot)
from .threat import NORMS

# Threat-model defaults: Tables V-VII of the paper, CIFAR-10 columns (eps); each family adds its own (budget).
DEFAULT_EPS = {"linf": 0.03, "l2": 1.0}
# eps ranges in [0, 1] pixel units. Outputs are quantized to the uint8 grid, so below 1/255 no pixel can move.
EPS_RANGE = {"linf": (1 / 255, 1.0), "l2": (1 / 255, 1e4)}
MAX_SEED = 2 ** 63
MAX_EXPRESSION = 64  # characters of an arithmetic string
VIRTUAL_FS = ("/proc", "/sys", "/dev")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _finite(x):
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def parse_number(value, names=None):
    """A finite number, or a string of arithmetic like ``8/255`` or ``eps/10``: numeric literals, the symbols
    ``names`` gives, unary + -, binary + - * / and parentheses, at most 64 characters. Booleans are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
    if isinstance(value, str):
        value = _evaluate(value, names or {})
    if not _finite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return value


def _evaluate(text, names):
    if len(text) > MAX_EXPRESSION:
        raise ValueError(f"an arithmetic string of {len(text)} characters (at most {MAX_EXPRESSION})")

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"cannot evaluate {text!r} (numbers, + - * / ( ) and "
                         f"{', '.join(sorted(names)) or 'no names'})")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a NUL character
        raise ValueError(f"cannot parse {text!r} as a number") from None
    try:
        return ev(tree.body)
    except ZeroDivisionError:
        raise ValueError(f"division by zero in {text!r}") from None
    except OverflowError:
        raise ValueError(f"{text!r} overflows") from None


# ---------------------------------------------------------------- YAML

def _yaml_problem(e, what):
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark else ""
    return f"{where}{what} ({getattr(e, 'problem', None) or e})"


def _check_duplicates(node, source, path, seen):
    """Raise at the first key that a mapping (at any depth) holds twice (YAML would keep the last silently)."""
    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first = {}
        for k, v in node.value:
            if k.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden by the keys beside it
                continue
            name = k.value if isinstance(k, yaml.ScalarNode) else "?"
            key = f"{path}.{name}" if path else name
            line = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and (k.tag, name) in first:
                before = "twice on that line" if first[k.tag, name] == line else f"first on line {first[k.tag, name]}"
                raise ConfigError(f"duplicate key on line {line} ({before})", source, key)
            first[k.tag, name] = line
            _check_duplicates(v, source, key, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _check_duplicates(v, source, f"{path}[{i}]", seen)


def parse_yaml(text, source, key=None, what="invalid YAML"):
    """YAML text -> Python data (safe types only), with duplicate keys refused; errors name ``source`` and
    ``key`` (a ``--set`` key: its key paths start there) and say ``what`` is wrong."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicates(node, source, key or "", set())
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(e, what), source, key) from None
    except RecursionError:
        raise ConfigError(f"{what} (nested too deeply)", source, key) from None
    except (ValueError, TypeError, OverflowError) as e:  # e.g. a date like 2001-13-01
        raise ConfigError(f"{what} ({type(e).__name__}: {e})", source, key) from None
    finally:
        loader.dispose()


def load_yaml(path):
    """A YAML file whose top level is a mapping (UTF-8; no duplicate keys)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("a directory, not a YAML file" if path.is_dir() else "file not found", source=path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the file ({e.strerror})", source=path) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})", source=path) \
            from None
    data = parse_yaml(text, path)
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping", source=path)
    return data


def deep_merge(base, over):
    """Merge mapping ``over`` into a copy of ``base`` (lists and scalars replace)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def parse_assignment(item, source):
    """``a.b=value`` -> ("a.b", value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}", source=source)
    key, raw = item.split("=", 1)
    key = key.strip()
    if not all(key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key name", source=source)
    return key, parse_yaml(raw, source, key, what="--set value is not valid YAML")


def apply_set(cfg, assignments, source):
    """Apply ``--set a.b=value`` overrides (value parsed as YAML)."""
    for item in assignments:
        key, value = parse_assignment(item, source)
        set_dotted(cfg, key, value, source, key)
    return cfg


def apply_file_set(raw, assignments, source):
    """Apply the ``--set`` overrides of whole-file keys (:data:`FILE_KEYS`) to the raw file mapping.

    ``grid.threat.eps=[...]`` sets the grid key ``threat.eps``; ``backend.workers=4`` one backend field; every other
    file key takes a whole value. Returns the file keys set."""
    done = set()
    for item in assignments:
        key, value = parse_assignment(item, source)
        head, _, rest = key.partition(".")
        done.add(head)
        if not rest:
            raw[head] = value
        elif head == "grid":
            grid = raw.setdefault("grid", {})
            if not isinstance(grid, dict):
                raise ConfigError("cannot set inside a non-mapping", source=source, key=key)
            grid[rest] = value
        elif head == "backend":
            if isinstance(raw.get("backend", "serial"), str):
                raw["backend"] = {"name": raw.get("backend", "serial")}
            set_dotted(raw, key, value, source, key)
        else:
            raise ConfigError(f"'{head}' takes a whole value: --set {head}=...", source=source, key=key)
    return done


def rebase_outputs(file_opts, old, new, given):
    """Move the file's leaderboard, robustness and plot paths from output_dir ``old`` to ``new`` (a ``--set
    output_dir``), unless ``--set`` gave them too: a path inside ``old`` keeps its place under ``new``; any other
    path moves into ``new`` under its own file name. So a redirected run never overwrites the earlier board."""
    old = Path(os.path.normpath(old))

    def move(path):
        p = Path(os.path.normpath(path))
        try:
            return str(Path(new) / p.relative_to(old))
        except ValueError:
            return str(Path(new) / p.name)

    for key in ("leaderboard", "robustness"):
        if file_opts.get(key) and key not in given:
            file_opts[key] = move(file_opts[key])
    if "plots" not in given:
        for p in file_opts.get("plots") or []:
            p["output"] = move(p["output"])


def set_dotted(cfg, dotted, value, source, where):
    """Set ``cfg[a][b]... = value`` for the key ``a.b...``, creating missing mappings; a value on the way that is
    not a mapping is a config error at ``where``."""
    parts = dotted.split(".")
    node = cfg
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError("cannot set inside a non-mapping", source=source, key=where)
    node[parts[-1]] = value


# ---------------------------------------------------------------- schema ----------------------------------------

def _check_type(value, kinds, source, key):
    if kinds is None:
        return value
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}", source, key)
    if not isinstance(value, kinds):
        try:  # YAML reads 1e4 (no '.') as text
            hint = f" (YAML reads {value} as text: write {int(float(value))})" if int in kinds and isinstance(
                value, str) and float(value).is_integer() else ""
        except ValueError:
            hint = ""
        raise ConfigError(f"expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__} "
                          f"{value!r}{hint}", source, key)
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
        raise ConfigError(f"out of range: {value} (integers must fit in 64 bits)", source, key)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"must be a finite number, got {value!r}", source, key)
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
    "save_adv": (bool,), "assets": (dict,), "compile": (bool,), "fuse": (bool,), "lpips_path": (str, type(None)),
    "fixed_batch": (int, type(None)),
}
COMMON_THREAT_KEYS = {"norm": (str,), "eps": (int, float, str), "targeted": (bool,), "target_label": SPEC}
# robustness: CSV (+ .png chart); share_forwards: runs on one target model share its forwards (shared.py);
# cascade: each query run attacks only the samples the file's earlier runs on the same images, target and threat
# left robust (runner.link_cascade);
# plots: analysis figures of the runs' results after they finish (analysis/recipes.py); grid: every combination of
# values per dotted key, times the runs; backend: where the runs execute, serial | processes | ray (sweep.py)
FILE_KEYS = {"runs": (list,), "leaderboard": (str, type(None)), "robustness": (str, type(None)),
             "share_forwards": (bool,), "cascade": (bool,),
             "plots": (list,), "grid": (dict,), "backend": (str, dict)}
DEVICES = ("auto", "cpu", "cuda")


def _families():
    from .registry import FAMILY

    return [FAMILY.get(n) for n in FAMILY.names()]


def top_keys():
    """Every top-level key: the common ones and the model keys of every registered family."""
    keys = dict(COMMON_KEYS)
    for fam in _families():
        keys.update({k: (list,) if mk.many else SPEC for k, mk in fam.model_keys.items()})
        keys.update(fam.run_keys)
    return keys


def threat_keys():
    keys = dict(COMMON_THREAT_KEYS)
    for fam in _families():
        keys.update(fam.threat_keys)
    return keys


def _owners(key, attr):
    return [f.name for f in _families() if key in getattr(f, attr)]


def check_family_keys(exp, family, source):
    """Model and threat keys must be the family's own; the family's required model keys must be present; every
    dataset, model and asset named exists and takes the parameters given (:func:`check_spec`)."""
    for key, mk in family.model_keys.items():
        if mk.required and not exp.get(key):
            raise ConfigError(f"a {family.name} attack needs '{key}'" + (" (a non-empty list)" if mk.many else ""),
                              source, key)
    for key in exp:
        if key not in COMMON_KEYS and not key.startswith("_") and key not in family.model_keys and \
                key not in family.run_keys:
            owners = _owners(key, "model_keys") + _owners(key, "run_keys")
            raise ConfigError(f"not used by {family.name} attacks (only by {', '.join(owners)})", source, key)
    for key in exp["threat"]:
        if key not in COMMON_THREAT_KEYS and key not in family.threat_keys:
            raise ConfigError(f"only for {', '.join(_owners(key, 'threat_keys'))} attacks", source, f"threat.{key}")
    specs = [("dataset", DATASET, exp["dataset"])]
    specs += [(f"{key}[{i}]" if family.model_keys[key].many else key, MODEL, bare_spec(spec))
              for key, i, spec in family.roles(exp)]  # a target's defense: checked by the runner
    for key, i, spec in family.roles(exp):
        label = spec.get("label")
        if "label" in spec and (not isinstance(label, str) or not label.strip()):
            raise ConfigError(f"expected a non-empty string, got {label!r}", source,
                              f"{key}[{i}].label" if family.model_keys[key].many else f"{key}.label")
    specs += [(f"assets.{k}", ASSET, spec) for k, spec in exp["assets"].items()]
    for key, registry, spec in specs:
        check_spec(registry, spec, source, key)


def check_spec(registry, spec, source, key):
    """``spec`` ({name, **params}) names an entry of ``registry`` and fits its parameters; returns the entry."""
    try:
        fn = registry.get(spec["name"])
    except BenchError as e:
        raise ConfigError(str(e), source, key) from None
    check_block_params(fn, {k: v for k, v in spec.items() if k != "name"}, source, key)
    return fn


def check_block_params(fn, params, source, key):
    """:func:`~blackboxbench.registry.check_params` with errors at ``key.<param>``."""
    try:
        check_params(fn, params)
    except ParamError as e:
        raise ConfigError(e.message, source, f"{key}.{e.param}") from None


def check_path_given(value, source, key, none="null"):
    """A path a config gives as text must name something: '' (or blanks) would be read as no path at all (no board
    written, the default LPIPS trunk, the environment's data root), silently; ``none`` says how to write 'none'."""
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"an empty path{f'; write {none} for none' if none else ''}", source, key)


def check_plain_name(value, source, key):
    """A name that becomes part of a run folder's name: no '/', no control character, not starting with '.'."""
    if not value or value.startswith(".") or any(c == "/" or ord(c) < 32 for c in value) or len(value) > 100:
        raise ConfigError(f"must be a plain name (1-100 characters, no '/' or control characters, not starting "
                          f"with '.'), got {value!r}", source, key)


def check_output_dir(value, source, key="output_dir"):
    """``output_dir`` must be usable before anything is created: an existing writable directory, or a path whose
    nearest existing ancestor is one; paths on virtual filesystems (/proc, /sys, /dev) are refused."""
    try:
        path = Path(os.path.abspath(value)) if value and "\0" not in value else None
        too_long = path is not None and (len(os.fsencode(path)) > 4000 or
                                         any(len(os.fsencode(part)) > 255 for part in path.parts))
    except UnicodeEncodeError:
        path = None
    if path is None:
        raise ConfigError(f"not a usable directory path: {value!r}", source, key)
    if too_long:
        raise ConfigError(f"path too long: {value!r}", source, key)
    for p in (path, Path(os.path.realpath(path))):
        if any(p == Path(v) or Path(v) in p.parents for v in VIRTUAL_FS):
            raise ConfigError(f"{value} is on a virtual filesystem ({', '.join(VIRTUAL_FS)}), not a place for "
                              "results", source, key)
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if not existing.is_dir():
        raise ConfigError(f"{existing} " + ("exists and is not a directory" if existing == path else
                                            "is not a directory, so nothing can be created under it"), source, key)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{existing} is not writable", source, key)


def spec_to_dict(spec, source, key):
    """``"timm:resnet18"`` -> {name: timm, arch: resnet18}; ``"x"`` -> {name: x}; dicts need ``name``."""
    if isinstance(spec, str):
        name, _, arch = spec.partition(":")
        return {"name": name, "arch": arch} if arch else {"name": name}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ConfigError("expected a name or a mapping with 'name'", source, key)
    spec = dict(spec)
    name, _, arch = spec["name"].partition(":")
    if arch:  # {name: "timm:resnet18", pretrained: true} as the string form
        if "arch" in spec:
            raise ConfigError(f"arch given twice: in name {spec['name']!r} and as arch {spec['arch']!r}", source,
                              f"{key}.arch")
        spec.update(name=name, arch=arch)
    return spec


def import_plugins(plugins, source, base_dir):
    """Import modules or files whose decorators register new blocks.

    A plugin that fails in any way while imported (an exception, ``sys.exit``, KeyboardInterrupt) is a one-line
    error naming it; every registry is put back as it was before (:func:`~blackboxbench.registry.snapshot`) and
    the module leaves ``sys.modules``, so nothing of it stays behind.
    """
    for i, p in enumerate(plugins):
        key = f"plugins[{i}]"
        if not isinstance(p, str) or not p.strip() or "\0" in p:
            raise ConfigError(f"expected a module name or a .py path, got {p!r}", source, key)
        path, mod_name = None, p
        if p.endswith(".py"):
            path = Path(p) if Path(p).is_absolute() else Path(base_dir) / p
            if not path.is_file():
                raise ConfigError(f"plugin file not found: {path}", source, key)
            mod_name = "bbb_plugin_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
        if mod_name in sys.modules:
            continue
        before = snapshot()
        try:
            _import(mod_name, path)
        except BaseException as e:  # noqa: BLE001 - whatever a plugin does, one line and nothing left behind
            restore(before)
            sys.modules.pop(mod_name, None)
            raise ConfigError(f"cannot import plugin {p!r}: {_failure(e)}", source, key) from None


def plugin_digests(plugins, base_dir):
    """{plugin as written: SHA-256 (16 hex digits) of its source file} of imported plugins (a .py path, or a module's
    own file): part of the run hash, so that an edited plugin runs into a new run folder instead of resuming, and
    silently reusing, the records of its old code. (Files the plugin imports in turn are not hashed.)"""
    out = {}
    for p in plugins:
        if p.endswith(".py"):
            path = Path(p) if Path(p).is_absolute() else Path(base_dir) / p
        else:
            path = getattr(sys.modules.get(p), "__file__", None)
        out[p] = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path and Path(path).is_file() else None
    return out


def _import(mod_name, path):
    if path is None:
        importlib.import_module(mod_name)
        return
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)


def _failure(e):
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    text = " ".join(str(e).split())
    return text if isinstance(e, BenchError) else f"{type(e).__name__}{': ' + text if text else ''}"


def validate_experiment(cfg, source):
    """Check types and ranges of one experiment; returns a normalized copy (defaults filled in)."""
    keys = top_keys()
    check_keys(cfg, keys, source, "")
    for k, v in cfg.items():
        _check_type(v, keys[k], source, k)
    out = {"name": None, "plugins": [], "data_root": None, "output_dir": "results", "seed": 0, "device": "auto",
           "batch_size": 100, "save_adv": False, "assets": {}, "compile": False, "fuse": True,
           "lpips_path": None}
    out.update(copy.deepcopy(cfg))
    for key in ("dataset", "attack"):
        if key not in out:
            raise ConfigError("missing required key", source, key)
    if out["device"] not in DEVICES:
        raise ConfigError(f"must be one of {', '.join(DEVICES)}{close_matches(out['device'], DEVICES)}",
                          source, "device")
    if out["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'cuda' requested but no CUDA device is available (use auto or cpu)", source, "device")
    if out["batch_size"] < 1:
        raise ConfigError(f"must be >= 1, got {out['batch_size']}", source, "batch_size")
    if out.get("fixed_batch", 0) is None:  # absent unless given, so that other run folders keep their hash
        del out["fixed_batch"]
    if out.get("fixed_batch", 1) < 1:
        raise ConfigError(f"must be >= 1 (images per model call) or null, got {out['fixed_batch']}", source,
                          "fixed_batch")
    if out.get("save_path_every", 0) < 0:  # absent unless given, so that the run folders of other runs keep their hash
        raise ConfigError(f"must be >= 0 (0: off), got {out['save_path_every']}", source, "save_path_every")
    if not 0 <= out["seed"] < MAX_SEED:
        raise ConfigError(f"must be in [0, 2**63), got {out['seed']}", source, "seed")
    if out["name"] is not None:
        check_plain_name(out["name"], source, "name")
    for key in ("data_root", "lpips_path"):
        check_path_given(out[key], source, key)
    check_output_dir(out["output_dir"], source)
    out["dataset"] = spec_to_dict(out["dataset"], source, "dataset")
    n = out["dataset"].get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError("must be a positive integer", source, "dataset.n")
    run_keys = {k for fam in _families() for k in fam.run_keys}
    for key, kinds in keys.items():
        if key in out and key not in COMMON_KEYS and key not in run_keys:  # model keys
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
        default = family.default_eps(recipe, t["norm"])
        t["eps"] = float(parse_number(t.get("eps", DEFAULT_EPS[t["norm"]] if default is None else default)))
    except ValueError as e:
        raise ConfigError(str(e), source, "threat.eps") from None
    lo, hi = EPS_RANGE[t["norm"]]
    if not lo <= t["eps"] <= hi:
        grey = t["norm"] == "linf" and 1 < t["eps"] <= 255  # grey levels written for [0, 1] units: 8 for 8/255
        raise ConfigError(f"out of range: {t['eps']:g}; {t['norm']} eps must be in [1/255, {hi:g}] ([0, 1] "
                          "pixel units; below 1/255 no pixel can move on the uint8 grid the outputs are quantized "
                          "to)" + (f"; did you mean {t['eps']:g}/255?" if grey else ""), source, "threat.eps")
    if "target_label" in t and not t["targeted"]:
        raise ConfigError("only for targeted attacks (set threat.targeted: true, or remove it)", source,
                          "threat.target_label")
    # Supp. D-B: targeted runs pick the target from the model's logits; "median" is the paper's default.
    t["target_label"] = None
    if t["targeted"]:
        t["target_label"] = spec_to_dict(threat.get("target_label", "median"), source, "threat.target_label")
        check_spec(TARGET_LABEL, t["target_label"], source, "threat.target_label")
    return family.finish_threat(t, recipe, source)


def config_hash(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def output_files(file_opts):
    """[(file, key)] of what the whole-file outputs write: the leaderboard CSV, the robustness CSV, its chart and
    its worst-case CSV, each plot's PNG and CSV."""
    from .robustness import chart_path
    from .worst_case import worst_case_path
    out = [(Path(file_opts["leaderboard"]), "leaderboard")] if file_opts.get("leaderboard") else []
    if file_opts.get("robustness"):
        r = file_opts["robustness"]
        out += [(Path(r), "robustness"), (chart_path(r), "robustness"), (worst_case_path(r), "robustness")]
    for i, p in enumerate(file_opts.get("plots") or []):
        out += [(Path(p["output"]).with_suffix(s), f"plots[{i}].output") for s in (".png", ".csv")]
    return out


def check_outputs_apart(file_opts, source):
    """No two outputs of a file write one path (a plot named like the leaderboard would replace its CSV), and each
    can be written (checked like ``output_dir``)."""
    seen = {}
    try:
        files = output_files(file_opts)
    except BenchError as e:
        raise ConfigError(str(e), source, "robustness") from None
    for path, key in files:
        first = seen.setdefault(os.path.normcase(os.path.abspath(path)), key)
        if first != key:
            raise ConfigError(f"writes {path}, which {first} writes too: give one of them another path", source,
                              key)
        # written after the runs: a folder it cannot be written to must fail now, not after hours of runs
        check_output_dir(str(path.parent), source, key)
        if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(f"{path} is " + ("a directory" if path.is_dir() else "not writable"), source, key)


def check_grid_keys(grid, source):
    """A grid key's run key (and its threat key) exist, named as the file writes them (``grid.threat.epz``): after
    the expansion the same typo would be named ``runs[0].threat.epz``, a key the file does not have."""
    for key in grid or {}:
        if not isinstance(key, str) or not all(key.split(".")):
            continue  # expand_grid names it
        head, _, rest = key.partition(".")
        if head in FILE_KEYS:
            raise ConfigError("applies to the whole file: the grid varies the keys of a run", source, f"grid.{key}")
        check_keys([head], top_keys(), source, "grid.")
        if head == "threat" and rest:
            check_keys([rest.partition(".")[0]], threat_keys(), source, "grid.threat.")


def load_config(path, overrides=()):
    """Load a config file into a list of validated experiments (one per entry of ``runs``, else one).

    Returns ``(experiments, file_options)``; each experiment carries ``_source`` for error messages.
    """
    source = str(path)
    raw = load_yaml(path)
    file_set = [o for o in overrides if o.partition("=")[0].strip().split(".")[0] in FILE_KEYS]
    run_set = [o for o in overrides if o not in file_set]
    given = apply_file_set(raw, file_set, source)
    check_keys(raw, {**top_keys(), **FILE_KEYS}, source, "")
    for item in run_set:
        check_keys([parse_assignment(item, source)[0].split(".")[0]], {**top_keys(), **FILE_KEYS}, source, "")
    file_opts = {k: raw.pop(k) for k in list(raw) if k in FILE_KEYS}
    for k, v in file_opts.items():
        _check_type(v, FILE_KEYS[k], source, k)
    for k in ("leaderboard", "robustness"):
        check_path_given(file_opts.get(k), source, k)
    if "plots" in file_opts:
        from .analysis.recipes import check_plot
        # a plot may use an analysis tool the file's plugins register
        import_plugins(_check_type(raw.get("plugins", []), (list,), source, "plugins"), source,
                       str(Path(path).resolve().parent))
        file_opts["plots"] = [check_plot(p, source, f"plots[{i}]") for i, p in enumerate(file_opts["plots"])]
    new_dir = [parse_assignment(o, source)[1] for o in run_set if o.partition("=")[0].strip() == "output_dir"]
    if new_dir:
        check_output_dir(_check_type(new_dir[-1], (str,), source, "output_dir"), source)
        old_dir = raw.get("output_dir")
        rebase_outputs(file_opts, old_dir if isinstance(old_dir, str) else "results", new_dir[-1], given)
    check_outputs_apart(file_opts, source)
    from .sweep import check_backend, expand_grid

    file_opts["backend"] = check_backend(file_opts.get("backend"), source)
    if file_opts["backend"]["name"] != "serial" and file_opts.get("share_forwards"):
        raise ConfigError("share_forwards needs the runs in one process: backend serial", source, "share_forwards")
    if file_opts["backend"]["name"] != "serial" and file_opts.get("cascade"):
        raise ConfigError("cascade runs the runs one after another, in the file's order: backend serial", source,
                          "cascade")
    if file_opts.get("share_forwards") and file_opts.get("cascade"):
        raise ConfigError("cascade runs the runs one after another; share_forwards runs them together: choose one",
                          source, "cascade")
    check_grid_keys(file_opts.get("grid"), source)
    runs = expand_grid(file_opts.get("runs") or [{}], file_opts.get("grid"), source)
    experiments = []
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            raise ConfigError("each run must be a mapping", source, f"runs[{i}]")
        for k in run:
            if k in FILE_KEYS:
                raise ConfigError("applies to the whole file: set it at the top level, not in a run", source,
                                  f"runs[{i}].{k}")
        check_keys(run, top_keys(), source, f"runs[{i}].")
        merged = apply_set(deep_merge(raw, run), run_set, source)
        exp = validate_experiment(merged, source)
        exp["_source"] = source
        exp["_base_dir"] = str(Path(path).resolve().parent)
        experiments.append(exp)
    return experiments, file_opts
