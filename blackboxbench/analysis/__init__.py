"""Analysis tools (BlackboxBench Tab. III; Supp. B-1 and I), registry ``analysis``, recipes in the ``analysis/``
catalog. A tool is a pure function of result rows that returns the table it plots and a function that draws it;
:func:`blackboxbench.analysis.aev.run_recipe` runs one and writes the figure and its numbers."""
from .._autoload import import_submodules

import_submodules(__name__, __path__)
