"""The YAML catalogs (attacks/, defenses/, analysis/): found in the source tree or, after ``pip install .``,
inside the installed package (``blackboxbench/_catalogs/``)."""
from pathlib import Path

from .errors import BenchError
from .registry import close_matches

_PKG = Path(__file__).resolve().parent
KINDS = ("attacks", "defenses", "analysis")
SINGULAR = {"attacks": "attack", "defenses": "defense", "analysis": "analysis"}


def catalog_dir(kind):
    """The directory of catalog ``kind``: the repository's top-level one when running from a checkout, else
    the copy installed with the package."""
    for candidate in (_PKG.parent / kind, _PKG / "_catalogs" / kind):
        if candidate.is_dir():
            return candidate
    raise BenchError(f"catalog '{kind}' not found (looked in {_PKG.parent / kind} and {_PKG / '_catalogs' / kind})")


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
                         f"{close_matches(name, found)}")
    return found[name]
