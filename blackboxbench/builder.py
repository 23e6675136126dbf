"""The builder: the only place that turns config mappings into objects (attacks, models, datasets).

Blocks get their parameters bound here with ``functools.partial`` after the parameters are checked against the
block's signature, so a wrong key fails before anything runs.
"""
import copy
from functools import partial

from . import catalog
from .config import ConfigError, check_keys, deep_merge, load_yaml, parse_number
from .errors import BenchError
from .query.pipeline import QueryAttack
from .registry import (ACCEPT, DIRECTION, GRADIENT, INIT, LOSS, PERTURB, REFINE, TRANSFORM, UPDATE,
                       check_params)
from .transfer.pipeline import TransferAttack

FAMILIES = ("score", "decision", "transfer")
RECIPE_KEYS = {"name", "family", "paper", "defaults", "norms", "targeted", "blocks", "hyper", "notes"}
QUERY_BLOCKS = {"init": INIT, "perturb": PERTURB, "accept": ACCEPT}
TRANSFER_SINGLE = {"loss": LOSS, "update": UPDATE}
TRANSFER_LISTS = {"refine": REFINE, "transform": TRANSFORM, "gradient": GRADIENT, "direction": DIRECTION}
TRANSFER_HYPER = {"iterations": 1, "alpha": "eps/10", "random_start": 0}
SETTING_KEYS = {"linf", "l2", "targeted", "untargeted"}


def resolve_setting(value, threat):
    """A mapping keyed by setting (``{untargeted: 100, targeted: 300}``, ``{linf: .., l2: ..}``) -> its value."""
    if isinstance(value, dict) and value and set(value) <= SETTING_KEYS:
        for key in (threat["norm"], "targeted" if threat["targeted"] else "untargeted"):
            if key in value:
                return value[key]
        raise ValueError(f"no value for this setting ({threat['norm']}, "
                         f"{'targeted' if threat['targeted'] else 'untargeted'}) among {sorted(value)}")
    return value


def load_recipe(attack, source):
    """``attack`` from an experiment: a recipe name, ``{recipe: name, <overrides>}``, or an inline recipe.

    Returns ``(recipe, recipe_source)``.
    """
    if isinstance(attack, str):
        attack = {"recipe": attack}
    attack = dict(attack)
    name = attack.pop("recipe", None)
    if name is None:
        return attack, source
    try:
        path = catalog.find(name)
    except BenchError as e:
        raise ConfigError(str(e), source, "attack") from None
    base = load_yaml(path)
    extra = set(attack) - {"blocks", "hyper", "name"}
    if extra:
        raise ConfigError(f"unknown override '{sorted(extra)[0]}' (a recipe can be overridden in blocks, hyper, "
                          f"name)", source, f"attack.{sorted(extra)[0]}")
    return _merge_recipe(base, attack), f"{path} (overridden by {source})" if attack else str(path)


def _merge_recipe(base, over):
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "blocks":
            blocks = out.setdefault("blocks", {})
            for kind, spec in value.items():
                old = blocks.get(kind)
                same = isinstance(spec, dict) and isinstance(old, dict) and spec.get("name", old["name"]) == \
                    old["name"]
                blocks[kind] = deep_merge(old, spec) if same else spec
        elif key == "hyper":
            out["hyper"] = deep_merge(out.get("hyper", {}), value)
        else:
            out[key] = value
    return out


def validate_recipe(recipe, source):
    check_keys(recipe, RECIPE_KEYS, source, "attack.")
    for key in ("name", "family", "norms", "targeted", "blocks"):
        if key not in recipe:
            raise ConfigError("missing required key", source, f"attack.{key}")
    if recipe["family"] not in FAMILIES:
        raise ConfigError(f"must be one of {', '.join(FAMILIES)}", source, "attack.family")
    if not isinstance(recipe["norms"], list) or not recipe["norms"]:
        raise ConfigError("must be a non-empty list", source, "attack.norms")
    if not isinstance(recipe["blocks"], dict):
        raise ConfigError("must be a mapping", source, "attack.blocks")


def _bind(registry, spec, threat, eps, source, key):
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise ConfigError("expected a block name or {name: ..., <params>}", source, key)
    params = {k: v for k, v in spec.items() if k != "name"}
    try:
        fn = registry.get(spec["name"])
        for k, v in params.items():
            v = resolve_setting(v, threat)
            params[k] = parse_number(v, {"eps": eps}) if isinstance(v, str) and _is_arith(v) else v
        check_params(fn, params)
    except (BenchError, ValueError) as e:
        raise ConfigError(str(e), source, key) from None
    return partial(fn, **params)


def _is_arith(s):
    return bool(s) and all(c.isdigit() or c in " .+-*/()e" for c in s.replace("eps", ""))


def build_attack(recipe, threat, source):
    """Build a :class:`QueryAttack` or :class:`TransferAttack` from a validated recipe and the threat model."""
    validate_recipe(recipe, source)
    blocks, eps, name = recipe["blocks"], threat["eps"], recipe["name"]
    meta = {k: recipe.get(k) for k in ("name", "family", "paper", "defaults")}
    if recipe["family"] in ("score", "decision"):
        check_keys(blocks, QUERY_BLOCKS, source, "attack.blocks.")
        for kind in QUERY_BLOCKS:
            if kind not in blocks:
                raise ConfigError("missing required block", source, f"attack.blocks.{kind}")
        bound = {k: _bind(reg, blocks[k], threat, eps, source, f"attack.blocks.{k}")
                 for k, reg in QUERY_BLOCKS.items()}
        if recipe.get("hyper"):
            raise ConfigError("query recipes take parameters in their blocks", source, "attack.hyper")
        return QueryAttack(name, recipe["family"], bound["init"], bound["perturb"], bound["accept"], meta=meta)

    check_keys(blocks, {**TRANSFER_SINGLE, **TRANSFER_LISTS}, source, "attack.blocks.")
    bound = {}
    for kind, reg in TRANSFER_SINGLE.items():
        bound[kind] = _bind(reg, blocks.get(kind, {"loss": "ce", "update": "step"}[kind]), threat, eps, source,
                            f"attack.blocks.{kind}")
    for kind, reg in TRANSFER_LISTS.items():
        specs = blocks.get(kind) or []
        if not isinstance(specs, list):
            raise ConfigError("must be a list of blocks", source, f"attack.blocks.{kind}")
        bound[kind] = [_bind(reg, s, threat, eps, source, f"attack.blocks.{kind}[{i}]")
                       for i, s in enumerate(specs)]
    hyper = dict(TRANSFER_HYPER)
    check_keys(recipe.get("hyper") or {}, TRANSFER_HYPER, source, "attack.hyper.")
    hyper.update(recipe.get("hyper") or {})
    for k, v in hyper.items():
        try:
            hyper[k] = parse_number(resolve_setting(v, threat), {"eps": eps})
        except ValueError as e:
            raise ConfigError(str(e), source, f"attack.hyper.{k}") from None
    if int(hyper["iterations"]) != hyper["iterations"] or hyper["iterations"] < 1:
        raise ConfigError("must be a positive integer", source, "attack.hyper.iterations")
    if hyper["alpha"] <= 0 or hyper["random_start"] < 0:
        raise ConfigError("alpha must be > 0 and random_start >= 0", source, "attack.hyper")
    return TransferAttack(name, int(hyper["iterations"]), float(hyper["alpha"]), bound["loss"], bound["update"],
                          transforms=bound["transform"], gradients=bound["gradient"],
                          directions=bound["direction"], refiners=bound["refine"],
                          random_start=float(hyper["random_start"]), meta=meta)
