"""Compatibility of the blocks listed in one transfer recipe, checked when the attack is built.

A block declares at registration what it needs from the other blocks and what it cannot be listed with, as
``"kind:name"`` strings: ``requires=("direction:momentum",)`` (e.g. NI reads the momentum state) and
``conflicts=("gradient:pregrad",)`` (two look-ahead points; or the block itself, when it keeps per-sample state
under a fixed key and so cannot be listed twice). A violation is one :class:`~blackboxbench.errors.ConfigError`
naming both blocks, raised before anything runs, never a crash inside the loop.
"""
from ..errors import ConfigError


def _listed(blocks):
    """``[(kind, name, fn)]`` of the bound blocks (``{kind: partial or [partials]}``), in recipe order."""
    return [(kind, b.func.registry_meta["name"], b.func) for kind, bound in blocks.items()
            for b in (bound if isinstance(bound, list) else [bound])]


def check_compatible(blocks, source):
    """Raise a one-line ConfigError when a listed block's ``requires`` is missing or two listed blocks conflict."""
    listed = _listed(blocks)
    present = {f"{k}:{n}" for k, n, _ in listed}
    for i, (kind, name, fn) in enumerate(listed):
        meta = fn.registry_meta
        for need in meta.get("requires", ()):
            if need not in present:
                nk, nn = need.split(":")
                raise ConfigError(f"{kind} '{name}' needs {nk} '{nn}' in the same recipe", source,
                                  f"attack.blocks.{kind}")
        for j, (okind, oname, _) in enumerate(listed):
            if j != i and f"{okind}:{oname}" in meta.get("conflicts", ()):
                why = meta.get("conflict_reason", "declared incompatible")
                raise ConfigError(f"{kind} '{name}' and {okind} '{oname}' cannot be combined ({why})", source,
                                  f"attack.blocks.{kind}")
