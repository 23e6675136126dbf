"""Preparation module: datasets, models, target labels (imported here to register)."""
from .._autoload import import_submodules

import_submodules(__name__, __path__)
