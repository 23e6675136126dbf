"""Analysis tools (BlackboxBench Tab. III; Supp. B-1 and I), registry ``analysis``, one recipe each in the
``analysis/`` catalog. Tools that read results (the AEV plots, :mod:`.aev`) are pure functions of result rows;
tools that read a model and images (:mod:`.saliency`, :mod:`.boundary`; registered with ``inputs="model"``) are
functions of :class:`.inputs.Inputs`. Each returns the numbers it plots and a function that draws them;
:mod:`.recipes` runs a recipe (``blackboxbench plot`` / ``blackboxbench analyze``) and writes the figure and its
numbers."""
from .._autoload import import_submodules

import_submodules(__name__, __path__)
