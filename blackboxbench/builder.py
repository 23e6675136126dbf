"""The builder: the only place that turns recipe mappings into attacks.

A recipe names its family (registry ``FAMILY``); the family declares which block kinds its recipes are made of
and its hyper-parameters (see :mod:`blackboxbench.family`). Blocks get their parameters bound here with
``functools.partial`` after the parameters are checked against the block's signature, so a wrong key fails
before anything runs; the builder never names a family.
"""
import copy
from functools import partial

from . import catalog
from .config import (ConfigError, check_block_params, check_keys, check_plain_name, deep_merge, load_yaml,
                     parse_number)
from .errors import BenchError
from .registry import FAMILY, block_params, is_numeric
from .threat import NORMS

RECIPE_KEYS = {"name", "family", "paper", "defaults", "norms", "targeted", "blocks", "hyper", "notes", "category",
               "year"}  # category and year: the paper's taxonomy (Supp. ), for the AEV plots
RECIPE_TYPES = {"name": str, "norms": list, "targeted": bool, "blocks": dict, "hyper": dict, "category": str,
                "year": int}
OVERRIDES = {"blocks": dict, "hyper": dict, "name": str}  # what a config may override in a catalog recipe
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
    if "recipe" not in attack:
        return attack, source
    name = attack.pop("recipe")
    if not isinstance(name, str):
        raise ConfigError(f"expected a recipe name, got {name!r}", source, "attack.recipe")
    try:
        path = catalog.find(name)
    except BenchError as e:
        raise ConfigError(str(e), source, "attack") from None
    base = load_yaml(path)
    for key in attack:
        if key not in OVERRIDES:
            raise ConfigError(f"unknown override (a recipe can be overridden in {', '.join(OVERRIDES)})", source,
                              f"attack.{key}")
        if not isinstance(attack[key], OVERRIDES[key]):
            raise ConfigError(f"expected {OVERRIDES[key].__name__}, got {type(attack[key]).__name__} "
                              f"{attack[key]!r}", source, f"attack.{key}")
    # an error in the merged recipe is almost always in the override (shipped recipes are tested): name that first
    return _merge_recipe(base, attack), f"{source} (attack overrides recipe {path})" if attack else str(path)


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


def recipe_family(recipe, source):
    """The :class:`~blackboxbench.family.Family` a recipe names (a one-line error when unknown)."""
    if not isinstance(recipe.get("family"), str):
        raise ConfigError("missing required key" if "family" not in recipe else "must be a family name", source,
                          "attack.family")
    try:
        return FAMILY.get(recipe["family"])
    except BenchError as e:
        raise ConfigError(f"{e}; families: {', '.join(FAMILY.names())}", source, "attack.family") from None


def validate_recipe(recipe, source):
    check_keys(recipe, RECIPE_KEYS, source, "attack.")
    for key in ("name", "family", "norms", "targeted", "blocks"):
        if key not in recipe:
            raise ConfigError("missing required key", source, f"attack.{key}")
    family = recipe_family(recipe, source)
    for key, kind in RECIPE_TYPES.items():
        if key in recipe and not isinstance(recipe[key], kind):
            raise ConfigError(f"expected {kind.__name__}, got {type(recipe[key]).__name__} {recipe[key]!r}", source,
                              f"attack.{key}")
    check_plain_name(recipe["name"], source, "attack.name")
    if not recipe["norms"] or any(n not in NORMS for n in recipe["norms"]):
        raise ConfigError(f"must be a non-empty list of norms among {', '.join(NORMS)}, got {recipe['norms']!r}",
                          source, "attack.norms")
    return family


def _bind(registry, spec, threat, source, key):
    """The block ``spec`` names, its parameters resolved (per setting; arithmetic like ``eps/10`` for a numeric
    parameter), checked (:func:`~blackboxbench.registry.check_params`) and bound."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ConfigError("expected a block name or {name: ..., <params>}", source, key)
    try:
        fn = registry.get(spec["name"])
    except BenchError as e:
        raise ConfigError(str(e), source, key) from None
    params = {}
    for k, v in spec.items():
        if k == "name":
            continue
        try:
            v = resolve_setting(v, threat)
            params[k] = parse_number(v, {"eps": threat["eps"]}) if isinstance(v, str) and is_numeric(fn, k) else v
        except ValueError as e:
            raise ConfigError(str(e), source, f"{key}.{k}") from None
    check_block_params(fn, params, source, key)
    for k in fn.registry_meta.get("block_params", ()):  # a parameter naming another block of the same registry
        name = params.get(k, block_params(fn)[k])
        if name == spec["name"]:
            raise ConfigError(f"'{spec['name']}' cannot name itself", source, f"{key}.{k}")
        try:
            registry.get(name)
        except BenchError as e:
            raise ConfigError(str(e), source, f"{key}.{k}") from None
    return partial(fn, **params)


def build_attack(recipe, threat, source):
    """Build the attack of a validated recipe for the threat model, with the blocks its family declares."""
    family = validate_recipe(recipe, source)
    blocks = recipe["blocks"]
    check_keys(blocks, family.blocks, source, "attack.blocks.")
    bound = {}
    for kind, bk in family.blocks.items():
        key = f"attack.blocks.{kind}"
        if bk.many:
            specs = blocks.get(kind, [])
            if not isinstance(specs, list):  # {} or '' or null would read as no block at all, silently
                raise ConfigError(f"must be a list of blocks ([] for none), got {type(specs).__name__} {specs!r}",
                                  source, key)
            bound[kind] = [_bind(bk.registry, s, threat, source, f"{key}[{i}]") for i, s in enumerate(specs)]
        elif kind in blocks or bk.default is not None:
            bound[kind] = _bind(bk.registry, blocks.get(kind, bk.default), threat, source, key)
        else:
            raise ConfigError("missing required block", source, key)
    check_agreement(bound, source)
    given = recipe.get("hyper") or {}
    if given and not family.hyper:
        raise ConfigError(f"{family.name} recipes take parameters in their blocks", source, "attack.hyper")
    check_keys(given, family.hyper, source, "attack.hyper.")
    hyper = {**family.hyper, **given}
    for k, v in hyper.items():
        try:
            hyper[k] = parse_number(resolve_setting(v, threat), {"eps": threat["eps"]})
        except ValueError as e:
            raise ConfigError(str(e), source, f"attack.hyper.{k}") from None
    meta = {k: recipe.get(k) for k in ("name", "family", "paper", "defaults")}
    meta.update(source=source, needs=block_needs(bound), assets=block_assets(bound), layers=block_layers(bound))
    return family.build(recipe["name"], bound, hyper, meta)


def _value(block, param):
    return block.keywords.get(param, block_params(block.func)[param])


def check_agreement(bound, source):
    """A one-line error where a bound block registered with ``agree={param: kind}`` gives ``param`` a value other
    than the block bound for ``kind`` (when that block has the parameter; None agrees with anything): two blocks
    that must describe the same object (cg_init's and the cg_attack block's c-Glow levels) cannot drift apart."""
    for kind, block in bound.items():
        if isinstance(block, list):
            continue
        for param, other_kind in block.func.registry_meta.get("agree", {}).items():
            other = bound.get(other_kind)
            if isinstance(other, list) or other is None or param not in block_params(other.func):
                continue
            mine, theirs = _value(block, param), _value(other, param)
            if mine is not None and mine != theirs:
                raise ConfigError(f"must equal attack.blocks.{other_kind}.{param} ({theirs!r}), got {mine!r}", source,
                                  f"attack.blocks.{kind}.{param}")


def _blocks(bound):
    return (b for v in bound.values() for b in (v if isinstance(v, list) else [v]))


def block_assets(bound):
    """{asset name: (block name, asset kind)} of the assets the bound blocks read: a block registered with
    ``asset_params={"context": "detection_context"}`` reads ``ctx.assets[<its parameter context>]``, an asset of
    that registry entry, unless the parameter is None."""
    out = {}
    for b in _blocks(bound):
        for param, kind in b.func.registry_meta.get("asset_params", {}).items():
            name = b.keywords.get(param, block_params(b.func)[param])
            if name is not None:
                out.setdefault(name, (b.func.registry_meta["name"], kind))
    return out


def block_layers(bound):
    """{block name: layer name} of the bound blocks registered with ``layer_param="layer"`` (a block that hooks a
    layer of its model by name), so that a name the model lacks fails before the run starts."""
    out = {}
    for b in _blocks(bound):
        param = b.func.registry_meta.get("layer_param")
        if param:
            out[b.func.registry_meta["name"]] = b.keywords.get(param, block_params(b.func)[param])
    return out


def block_needs(bound):
    """{config key: block name} of what the bound blocks declare they need (``needs=("surrogates",)`` at
    registration: a block that reads ``ctx.surrogates``), so that a config without it fails at validation."""
    needs = {}
    for b in _blocks(bound):
        for need in b.func.registry_meta.get("needs", ()):
            needs.setdefault(need, b.func.registry_meta["name"])
    return needs
