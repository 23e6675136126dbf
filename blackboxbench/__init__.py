"""BlackboxBench: black-box adversarial attacks composed from registered blocks."""
__version__ = "0.1.0"

from . import analysis, defense, detection, prep, query, transfer  # noqa: E402,F401  (registers every block)
