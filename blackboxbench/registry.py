"""One small registry mechanism (timm style): ``@REGISTRY.register("name")`` and ``REGISTRY.get("name")``.

There is one registry per block kind (see the bottom of this file). Blocks are plain functions or small
callables whose tunable parameters are keyword-only; the builder validates the parameters a config gives against the block's signature
(:func:`check_params`) before anything runs, so a block never sees YAML.
"""
import difflib
import inspect

from .errors import BenchError


def _where(obj):
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError):
        return getattr(obj, "__module__", "?")


def close_matches(name, choices):
    hits = difflib.get_close_matches(str(name), list(choices), n=3, cutoff=0.5)
    return f" (did you mean: {', '.join(hits)}?)" if hits else ""


class Registry:
    def __init__(self, kind):
        self.kind = kind
        self._entries = {}

    def register(self, name, **meta):
        """Decorator registering ``obj`` under ``name``; ``meta`` is free documentation (paper, norms...)."""

        def deco(obj):
            if name in self._entries:
                raise BenchError(f"duplicate {self.kind} '{name}': registered at {_where(self._entries[name])} "
                                 f"and again at {_where(obj)}")
            self._entries[name] = obj
            obj.registry_meta = dict(meta, name=name, kind=self.kind)
            return obj

        return deco

    def get(self, name):
        if name not in self._entries:
            raise BenchError(f"unknown {self.kind} '{name}'{close_matches(name, self._entries)}")
        return self._entries[name]

    def names(self):
        return sorted(self._entries)

    def __contains__(self, name):
        return name in self._entries

    def __iter__(self):
        return iter(self.names())

    def __repr__(self):
        return f"Registry({self.kind}: {', '.join(self.names())})"


def block_params(fn):
    """Tunable parameters of a block: its keyword-only parameters (after ``*``), with their defaults.

    The positional parameters are what the pipeline passes (the block context, state, ...); a config can only set
    keyword-only ones.
    """
    sig = inspect.signature(fn)
    return {n: p.default for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}


def check_params(fn, params, where=""):
    """Raise a one-line error unless ``params`` fits the block's signature (no unknown, no missing)."""
    allowed = block_params(fn)
    name = getattr(fn, "registry_meta", {}).get("name", getattr(fn, "__name__", "?"))
    for key in params:
        if key not in allowed:
            raise BenchError(f"{where}{key}: unknown parameter of block '{name}'"
                             f"{close_matches(key, allowed)}; allowed: {', '.join(allowed) or 'none'}")
    missing = [k for k, d in allowed.items() if d is inspect.Parameter.empty and k not in params]
    if missing:
        raise BenchError(f"{where}{missing[0]}: missing parameter of block '{name}'")


FAMILY = Registry("family")          # attack families (score, decision, transfer): see family.py
INIT = Registry("init")              # query: adversarial-example initialization
PERTURB = Registry("perturb")        # query: perturbation generation
ACCEPT = Registry("accept")          # query: acceptance check
TRANSFORM = Registry("transform")    # transfer: input transformation
LOSS = Registry("loss")              # transfer: loss
GRADIENT = Registry("gradient")      # transfer: gradient calculation
DIRECTION = Registry("direction")    # transfer: update direction
UPDATE = Registry("update")          # transfer: update step
REFINE = Registry("refine")          # transfer: surrogate refinement
DATASET = Registry("dataset")
MODEL = Registry("model")
TARGET_LABEL = Registry("target_label")
METRIC = Registry("metric")
ASSET = Registry("asset")            # named trained artifacts a config declares under ``assets:``
