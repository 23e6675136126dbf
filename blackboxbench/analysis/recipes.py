"""Running an analysis recipe (the ``analysis/`` catalog): :func:`plot` for the tools that read results (AEV),
:func:`analyze` for the tools that read a model and images (decision surface, dbViz, FSM, FullGrad; their
registration says ``inputs="model"``). A recipe names its tool, the paper behind it and default parameters;
``where`` (results tools) fixes components of the scenario. Both write ``<out>.png`` (the figure) and
``<out>.csv`` (the numbers behind it); model tools also ``<out>.npz`` (the maps and grids)."""
import csv
from pathlib import Path

import numpy as np

from ..catalog import find
from ..config import check_keys, check_path_given, load_yaml
from ..errors import BenchError, ConfigError
from ..leaderboard import cell
from ..registry import ANALYSIS, ParamError, check_params
from .aev import load_rows, need, select
from .inputs import import_run_plugins, load_inputs

RECIPE_KEYS = ("name", "tool", "paper", "notes", "params", "where")
PLOT_KEYS = ("recipe", "output", "params", "where")  # an entry of a config's ``plots:``
COMMAND_LINE = "command line (--param)"  # who set the parameters plot() and analyze() are given, by default
COMMANDS = {"results": "blackboxbench plot RESULTS -r", "model": "blackboxbench analyze --run RUN_DIR -r"}


def _check(mapping, allowed, strings, source, prefix):
    """``mapping``'s keys are ``allowed``, those in ``strings`` are required strings, ``params`` and ``where`` are
    mappings when given; errors name ``source`` and the key under ``prefix``."""
    check_keys(mapping, allowed, source, prefix)
    for key in strings:
        if not isinstance(mapping.get(key), str):
            raise ConfigError("required: a string", source, f"{prefix}{key}")
    for key in ("params", "where"):
        if not isinstance(mapping.get(key) or {}, dict):
            raise ConfigError("must be a mapping", source, f"{prefix}{key}")


def load_recipe(recipe, inputs):
    """``(path, recipe dict, tool)`` of a catalog name or a ``.yaml`` path, its keys and types checked; its tool
    must read ``inputs`` (``results`` or ``model``)."""
    path = Path(recipe) if str(recipe).endswith((".yaml", ".yml")) else find(recipe, "analysis")
    r = load_yaml(path)
    _check(r, RECIPE_KEYS, ("name", "tool", "paper"), path, "")
    try:
        tool = ANALYSIS.get(r["tool"])
    except BenchError as e:
        raise ConfigError(str(e), path, "tool") from None
    kind = tool.registry_meta.get("inputs", "results")
    if kind != inputs:
        raise ConfigError(f"tool '{r['tool']}' reads {kind}, not {inputs}: run it with {COMMANDS[kind]} "
                          f"{r['name']}", path, "tool")
    if inputs == "model" and r.get("where"):
        raise ConfigError("only tools that read results take where", path, "where")
    return path, r, tool


def _params(path, r, tool, params, setter):
    """The recipe's parameters overridden by ``params``; an error names whoever set the wrong one: ``setter`` (the
    command line's --param, a config's plots entry) for a parameter of ``params``, else the recipe file."""
    p = {**(r.get("params") or {}), **(params or {})}
    try:
        check_params(tool, p)
    except ParamError as e:
        raise ConfigError(e.message, setter if e.param in (params or {}) else path, f"params.{e.param}") from None
    return p


def check_plot(entry, source, key):
    """A config's ``plots:`` entry, checked before any run: ``{recipe, output, params, where}`` with a results
    recipe and parameters its tool takes. Errors name the config file and the key."""
    if not isinstance(entry, dict):
        raise ConfigError("must be a mapping {recipe: ..., output: ...}", source, key)
    _check(entry, PLOT_KEYS, ("recipe", "output"), source, f"{key}.")
    check_path_given(entry["output"], source, f"{key}.output", none="")
    try:
        _, r, tool = load_recipe(entry["recipe"], "results")
    except BenchError as e:
        raise ConfigError(str(e), source, f"{key}.recipe") from None
    params = entry.get("params") or {}
    try:
        check_params(tool, {**(r.get("params") or {}), **params})
    except ParamError as e:  # the entry's own parameter, else one of the recipe's
        mine = e.param in params
        raise ConfigError(e.message if mine else f"the recipe's params.{e.param}: {e.message}", source,
                          f"{key}.params.{e.param}" if mine else f"{key}.recipe") from None
    return {"recipe": entry["recipe"], "output": entry["output"], "params": entry.get("params") or {},
            "where": entry.get("where") or {}}


def _write(out, header, body, draw, title, arrays=None):
    out = Path(out)
    png, table = out.with_suffix(".png"), out.with_suffix(".csv")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(table, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([header] + [[cell(v) for v in line] for line in body])
        if arrays is not None:
            np.savez_compressed(out.with_suffix(".npz"), **arrays)
    except OSError as e:
        raise BenchError(f"cannot write next to {out}: {e.strerror or e}") from None
    draw(png, title)
    return png, table


def plot(recipe, source, out, params=None, where=None, setter=COMMAND_LINE):
    """Run a results recipe on ``source`` (a leaderboard CSV, a results directory or a list of them); ``params``
    and ``where`` override the recipe's. Returns ``(png, csv, rows used, skipped runs)``."""
    path, r, tool = load_recipe(recipe, "results")
    p = _params(path, r, tool, params, setter)
    w = {**(r.get("where") or {}), **(where or {})}
    rows, skipped = load_rows(source)
    for k in w:  # a filter on no column: the error names whoever set it (--where, a config's plots, the recipe)
        try:
            need(rows, k)
        except BenchError as e:
            if k not in (where or {}):
                raise ConfigError(str(e), path, f"where.{k}") from None
            if setter == COMMAND_LINE:
                raise ConfigError(str(e), "command line (--where)", k) from None
            raise ConfigError(str(e), setter, f"where.{k}") from None
    rows = select(rows, w)
    if not rows:
        raise BenchError(f"no result row in {source} matches where {w}")
    header, body, draw = tool(rows, **p)
    fixed = ", ".join(f"{k}={v}" for k, v in w.items())
    png, table = _write(out, header, body, draw, f"{r['name']}: {p.get('y')} by {p.get('x')}" +
                        (f" ({fixed})" if fixed else ""))
    return png, table, len(rows), skipped


def analyze(recipe, out, params=None, device="cpu", setter=COMMAND_LINE, **source):
    """Run a model recipe on the images of ``source`` (the keyword arguments of
    :func:`~blackboxbench.analysis.inputs.load_inputs`: ``run``, ``model``, ``dataset``, ``data_root``, ``n``,
    ``indices``, ``seed``). Returns ``(png, csv, npz, images used, images loaded)``: a tool with ``max_images``
    uses at most that many of the images loaded."""
    import_run_plugins(source.get("run"))  # a run's plugins may register the tool
    path, r, tool = load_recipe(recipe, "model")
    p = _params(path, r, tool, params, setter)
    inputs = load_inputs(device=device, many=tool.registry_meta.get("models", False), **source)
    try:
        header, body, arrays, draw = tool(inputs, **p)
    except ParamError as e:  # a parameter the tool can only judge on the images: the file or flag that set it
        raise ConfigError(e.message, setter if e.param in (params or {}) else path, f"params.{e.param}") from None
    png, table = _write(out, header, body, draw, f"{r['name']}: {inputs.model_name}", arrays)
    loaded = len(inputs.index)
    return png, table, Path(out).with_suffix(".npz"), min(loaded, p.get("max_images", loaded)), loaded
