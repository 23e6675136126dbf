"""Query-based attacks: the pipeline (families ``score`` and ``decision``) and one file per attack family of
blocks (imported here to register)."""
from .._autoload import import_submodules
from .pipeline import QueryAttack  # noqa: F401

import_submodules(__name__, __path__)
