"""One small registry mechanism (timm style): ``@REGISTRY.register("name")`` and ``REGISTRY.get("name")``.

There is one registry per block kind (see the bottom of this file). Blocks are plain functions or small
callables whose tunable parameters are keyword-only; the builder validates the parameters a config gives against
the block's signature (:func:`check_params`) before anything runs, so a block never sees YAML.

A parameter's type comes from its default (a float default takes an int or a float, never a boolean; an int
default an int; a bool default a bool; a str default a str; a None default anything). A registry entry declares
ranges at registration, ``ranges={"p_init": "(0, 1]", "n_iters": "int [1, inf)"}``: an interval with open
``( )`` or closed ``[ ]`` ends, ``inf`` allowed at an open end, optionally preceded by ``int`` (an integer),
``odd`` (an odd integer), ``list`` (a list of numbers, each inside) or ``arch`` (a number, or a per-architecture
mapping ``{pattern: number, ..., default: number}`` resolved per model by
:func:`blackboxbench.prep.layers.per_arch`, as Table VII gives several values per surrogate architecture); or a
tuple of the allowed values, ``("geometric_progression",)``. A declared ``int``/``odd``/``list``/``arch`` is also
the type of a parameter whose default is None; a plain interval on it means a number.

``agree={"num_levels": "perturb"}`` ties a parameter to the parameter of the same name of the block bound for
another kind of the same recipe (two blocks that describe one object): the builder rejects a config where they
differ (:func:`blackboxbench.builder.check_agreement`). The parameter must be the entry's own.
"""
import difflib
import inspect
import math
import re
import weakref
from dataclasses import dataclass

from .errors import BenchError


def _where(obj):
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return getattr(obj, "__module__", "?")


def block_label(block):
    """``'name' (file:line)`` of a block, or of a built one (a ``partial`` of a registered function), for errors."""
    fn = getattr(block, "func", block)
    return f"'{getattr(fn, 'registry_meta', {}).get('name', getattr(fn, '__name__', '?'))}' ({_where(fn)})"


def close_matches(name, choices):
    hits = difflib.get_close_matches(str(name), [str(c) for c in choices], n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(hits)}?)" if hits else ""


def name_hint(name, choices, listing):
    """What an error for an unknown ``name`` adds: close matches, else the names themselves where they are few,
    else the command ``listing`` that lists them."""
    choices = sorted(str(c) for c in choices)
    hint = close_matches(name, choices)
    if hint:
        return hint
    return f" (known: {', '.join(choices)})" if len(choices) <= 12 else f" (`{listing}` lists them)"


# ---------------------------------------------------------------- parameter ranges

_INTERVAL = re.compile(r"(?:(int|odd|list|arch)\s+)?([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])")
KIND_TYPES = {"real": (int, float), "int": (int,), "odd": (int,), "list": (list, tuple), "arch": (int, float, dict)}


def _fmt(x):
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"


@dataclass(frozen=True)
class Interval:
    """A declared range: ``lo``..``hi``, each end open or closed; ``kind`` real, int, odd, list (each item) or
    arch (the number, or each value of a per-architecture mapping)."""

    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    kind: str = "real"

    @classmethod
    def parse(cls, text):
        m = _INTERVAL.fullmatch(text.strip()) if isinstance(text, str) else None
        try:
            kind, left, lo, hi, right = m.groups()
            iv = cls(float(lo), float(hi), left == "(", right == ")", kind or "real")
        except (AttributeError, ValueError):
            raise BenchError(f"range {text!r}: expected an interval such as '(0, 1]', 'int [1, inf)', "
                             "'odd [1, inf)', 'list [0, inf)' or 'arch [0, 1]'") from None
        if math.isnan(iv.lo) or math.isnan(iv.hi) or iv.lo > iv.hi or (iv.lo == -math.inf and not iv.lo_open) \
                or (iv.hi == math.inf and not iv.hi_open):
            raise BenchError(f"range {text!r}: need lo <= hi, and inf only at an open end")
        return iv

    def __str__(self):
        return f"{'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}{')' if self.hi_open else ']'}"

    def __contains__(self, v):
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below  # NaN is in no interval

    def problem(self, value):
        """None when ``value`` (of the right type) lies inside, else what is wrong."""
        if self.kind == "list":
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in self]
            return f"each value must be a number in {self}, got {value!r}" if bad else None
        if self.kind == "arch" and isinstance(value, dict):
            if "default" not in value:
                return f"a per-architecture mapping needs a 'default' entry, got {value!r}"
            bad = {k: v for k, v in value.items() if not isinstance(k, str) or isinstance(v, bool)
                   or not isinstance(v, (int, float)) or v not in self}
            return (f"a per-architecture mapping takes architecture patterns to numbers in {self}, got "
                    f"{bad!r}") if bad else None
        if self.kind == "odd" and value % 2 == 0 or value not in self:
            return f"must be {'an odd integer ' if self.kind == 'odd' else ''}in {self}, got {value!r}"
        return None


def parse_ranges(fn, ranges):
    """``{param: interval text or tuple of choices}`` -> ``{param: Interval or tuple}``; every name must be a
    keyword-only parameter of ``fn``."""
    params = block_params(fn)
    out = {}
    for name, rule in ranges.items():
        if name not in params:
            raise BenchError(f"range for '{name}': not a keyword-only parameter of {_where(fn)}"
                             f"{close_matches(name, params)}")
        out[name] = tuple(rule) if isinstance(rule, (tuple, list)) else Interval.parse(rule)
    return out


def check_signature(fn, kind, name, args):
    """A pipeline block's signature: the ``args`` the pipeline passes (positionally), then keyword-only parameters
    (a parameter before ``*`` would receive a pipeline argument, or never its YAML value); no ``*args`` or
    ``**kwargs`` (they would swallow misspelt parameters). A one-line error naming the block and its file."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problem = None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        problem = "*args / **kwargs would swallow misspelt parameters"
    elif with_default := [p.name for p in positional if p.default is not p.empty]:
        problem = f"parameter '{with_default[0]}' must be keyword-only (after *) to take its value from YAML"
    elif len(positional) != len(args):
        problem = f"it takes {len(positional)} positional argument(s), the pipeline passes {len(args)}"
    if problem:
        raise BenchError(f"{kind} block '{name}' ({_where(fn)}): {problem}; the contract is "
                         f"def {getattr(fn, '__name__', name)}({', '.join(args)}, *, <parameters>)")


class Registry:
    instances = weakref.WeakSet()  # every registry, so that a failed plugin import can be undone (snapshot)

    def __init__(self, kind, args=None, choices=None):
        """``args``: for a registry of pipeline blocks, the arguments the pipeline passes, in order (the context
        first); a block registered there must take exactly those, then keyword-only parameters. ``choices``:
        {meta key: allowed values} of the registration metadata this registry reads (a metric's ``better``)."""
        self.kind, self.args, self.choices = kind, args, choices or {}
        self._entries = {}
        Registry.instances.add(self)

    def register(self, name, *, ranges=None, **meta):
        """Decorator registering ``obj`` under ``name``; ``ranges`` declares parameter ranges (see the module
        docstring), parsed once into ``registry_meta["ranges"]``; ``meta`` is free documentation (paper, norms...)."""

        def deco(obj):
            if name in self._entries:
                raise BenchError(f"duplicate {self.kind} '{name}': registered at {_where(self._entries[name])} "
                                 f"and again at {_where(obj)}")
            if self.args is not None:
                check_signature(obj, self.kind, name, self.args)
            for key, allowed in self.choices.items():
                if key in meta and meta[key] not in allowed:
                    raise BenchError(f"{self.kind} '{name}' ({_where(obj)}): {key} must be one of "
                                     f"{', '.join(map(str, allowed))}, got {meta[key]!r}")
            own = inspect.signature(obj).parameters if callable(obj) else {}
            for param in (meta.get("agree") or {}):
                if param not in own:
                    raise BenchError(f"{self.kind} '{name}' ({_where(obj)}): agree names {param!r}, which is not "
                                     "one of its parameters")
            parsed = parse_ranges(obj, ranges) if ranges else {}
            self._entries[name] = obj
            obj.registry_meta = dict(meta, name=name, kind=self.kind, ranges=parsed)
            return obj

        return deco

    def get(self, name):
        if not isinstance(name, str) or name not in self._entries:
            raise BenchError(f"unknown {self.kind} '{name}'"
                             f"{name_hint(name, self._entries, 'blackboxbench list blocks')}")
        return self._entries[name]

    def names(self):
        return sorted(self._entries)

    def __contains__(self, name):
        return name in self._entries

    def __iter__(self):
        return iter(self.names())

    def __repr__(self):
        return f"Registry({self.kind}: {', '.join(self.names())})"


def snapshot():
    """The entries of every registry, to :func:`restore` after a failed plugin import."""
    return {reg: dict(reg._entries) for reg in Registry.instances}


def restore(snap):
    """Put every registry of ``snap`` back as it was (registrations made since are dropped)."""
    for reg, entries in snap.items():
        reg._entries.clear()
        reg._entries.update(entries)


def block_params(fn):
    """Tunable parameters of a block: its keyword-only parameters (after ``*``), with their defaults.

    The positional parameters are what the pipeline passes (the block context, state, ...); a config can only set
    keyword-only ones.
    """
    sig = inspect.signature(fn)
    return {n: p.default for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}


_DEFAULT_TYPES = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
_TYPE_NAMES = {(bool,): "a boolean", (int,): "an integer", (int, float): "a number", (str,): "a string",
               (list, tuple): "a list", (int, float, dict): "a number or a per-architecture mapping"}


def param_rule(fn, param):
    """``(types, rule)`` of keyword parameter ``param``: the accepted types (None: anything) and its declared
    range (an :class:`Interval`, a tuple of choices, or None)."""
    rule = getattr(fn, "registry_meta", {}).get("ranges", {}).get(param)
    types = _DEFAULT_TYPES.get(type(block_params(fn)[param]))
    if isinstance(rule, Interval) and (rule.kind != "real" or types is None):
        types = KIND_TYPES[rule.kind]
    return types, rule


def is_numeric(fn, param):
    """Whether keyword parameter ``param`` of ``fn`` takes a number (so a string like ``8/255`` is arithmetic)."""
    return param in block_params(fn) and param_rule(fn, param)[0] in ((int,), (int, float))


class ParamError(BenchError):
    """A block parameter is wrong: ``param`` names it, ``message`` says why (``where`` prefixes ``str``)."""

    def __init__(self, param, message, where=""):
        self.param, self.message = param, message
        super().__init__(f"{where}{param}: {message}")


def value_problem(fn, param, value):
    """None when ``value`` suits keyword parameter ``param`` of ``fn`` (type, finiteness, range), else why not."""
    if value is None and block_params(fn)[param] is None:
        return None
    types, rule = param_rule(fn, param)
    if types is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        return f"expected {_TYPE_NAMES[types]}, got {type(value).__name__} {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite, got {value!r}"
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
        return f"an integer out of the 64-bit range: {value}"
    if isinstance(rule, tuple):
        choices = ", ".join(map(str, rule))
        if isinstance(block_params(fn)[param], (list, tuple)):  # a list parameter: choices for each item
            if not isinstance(value, (list, tuple)) or not value:
                return f"expected a non-empty list of {choices}, got {value!r}"
            bad = [v for v in value if v not in rule]
            return f"each item must be one of {choices}, got {bad[0]!r}" if bad else None
        return None if value in rule else f"must be one of {choices}, got {value!r}"
    return rule.problem(value) if rule is not None else None


def check_params(fn, params, where=""):
    """Raise a one-line :class:`ParamError` unless ``params`` fits the block: no unknown or missing parameter,
    each value of its type and inside its declared range."""
    allowed = block_params(fn)
    name = getattr(fn, "registry_meta", {}).get("name", getattr(fn, "__name__", "?"))
    for key in params:
        if key not in allowed:
            raise ParamError(key, f"unknown parameter of block '{name}'{close_matches(key, allowed)}; allowed: "
                                  f"{', '.join(allowed) or 'none'}", where)
    missing = [k for k, d in allowed.items() if d is inspect.Parameter.empty and k not in params]
    if missing:
        raise ParamError(missing[0], f"missing parameter of block '{name}'", where)
    for key, value in params.items():
        problem = value_problem(fn, key, value)
        if problem:
            raise ParamError(key, problem, where)


# attack families (score, decision, transfer): see family.py
FAMILY = Registry("family")
INIT = Registry("init", ("ctx",))                                  # query: adversarial-example initialization
PERTURB = Registry("perturb", ("ctx", "state"))                    # query: perturbation generation
ACCEPT = Registry("accept", ("ctx", "state", "proposal"))          # query: acceptance check
TRANSFORM = Registry("transform", ("ctx", "x"))                    # transfer: input transformation
LOSS = Registry("loss", ("ctx", "logits", "label"))                # transfer: loss
GRADIENT = Registry("gradient", ("ctx", "grad_fn", "x", "state"))  # transfer: gradient calculation
DIRECTION = Registry("direction", ("ctx", "grad", "state"))        # transfer: update direction
UPDATE = Registry("update", ("ctx", "x_adv", "direction"))         # transfer: update step
REFINE = Registry("refine", ("ctx", "models"))                     # transfer: surrogate refinement
# transfer: once-per-batch precompute before the loop (Alg. 3 line 2)
AUXILIARY = Registry("auxiliary", ("ctx",))
DATASET = Registry("dataset")
MODEL = Registry("model")
TARGET_LABEL = Registry("target_label")
# per-sample distances ``fn(x_adv, x) -> (N,)``; ``better``: the leaderboard direction of their summaries
METRIC = Registry("metric", ("x_adv", "x"), choices={"better": ("lower", "higher", None)})
# named trained artifacts a config declares under ``assets:``
ASSET = Registry("asset")
# analysis tools: result rows -> (table, draw); see analysis/__init__.py
ANALYSIS = Registry("analysis")
# defenses that wrap a target inside the oracle: see defense.py
DEFENSE = Registry("defense")
# detection: how a batch's adversarial images are crafted (detection/attacks.py)
DET_CRAFT = Registry("det_craft", ("ctx", "objective"))
# detection: the per-image loss a craft block maximizes
DET_OBJECTIVE = Registry("det_objective", ("ctx", "x"))
