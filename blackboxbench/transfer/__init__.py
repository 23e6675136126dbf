"""Transfer-based attacks: the pipeline and one file per block kind (imported here to register)."""
from .._autoload import import_submodules
from .pipeline import TransferAttack  # noqa: F401

import_submodules(__name__, __path__)
