"""``python -m blackboxbench ...``: the ``blackboxbench`` command."""
import sys

from .cli import main

sys.exit(main())
