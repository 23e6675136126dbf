"""The YAML catalogs (attacks/, defenses/, analysis/): found in the source tree or, after ``pip install .``,
inside the installed package (``blackboxbench/_catalogs/``)."""
from pathlib import Path

from .errors import BenchError
from .registry import name_hint

_PKG = Path(__file__).resolve().parent
KINDS = ("attacks", "defenses", "analysis")
SINGULAR = {"attacks": "attack", "defenses": "defense", "analysis": "analysis"}


def catalog_dir(kind):
    """The directory of catalog ``kind``: the copy installed with the package, else (a checkout, where there is
    none) the repository's top-level one. The installed copy comes first: next to an installed package the parent
    is site-packages, where another distribution's top-level ``analysis`` or ``attacks`` folder may lie."""
    for candidate in (_PKG / "_catalogs" / kind, _PKG.parent / kind):
        if candidate.is_dir():
            return candidate
    raise BenchError(f"catalog '{kind}' not found (looked in {_PKG / '_catalogs' / kind} and {_PKG.parent / kind})")


def entries(kind="attacks"):
    """{name: path} of every recipe of a catalog; names are file stems, unique across sub-folders."""
    found = {}
    for path in sorted(catalog_dir(kind).rglob("*.yaml")):
        if path.stem in found:
            raise BenchError(f"duplicate recipe name '{path.stem}': {found[path.stem]} and {path}")
        found[path.stem] = path
    return found


def find(name, kind="attacks"):
    found = entries(kind)
    if name not in found:
        raise BenchError(f"unknown {SINGULAR.get(kind, kind)} recipe '{name}'"
                         f"{name_hint(name, found, f'blackboxbench list {kind}')}")
    return found[name]
