"""Object detection (family ``detection``): metrics, datasets, detectors, attacks and adversarial training
(od-robustness benchmark, arXiv 2602.16494). Every module is imported here so that its registrations run."""
from .._autoload import import_submodules

import_submodules(__name__, __path__)
