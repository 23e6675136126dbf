"""User-facing errors: one line, no traceback (the CLI prints ``str(err)`` and exits 2)."""


class BenchError(Exception):
    """Any error caused by user input (config, path, name, shape)."""


def one_line_warning(message, category, filename, lineno, line=None):
    """``warnings.formatwarning`` of the command line and its workers: a library warning as one line, as errors."""
    return f"warning: {' '.join(str(message).split())}\n"


class QueryError(BenchError):
    """A block asked the oracle wrongly (the shape of its queries): the pipeline names the asking block."""


class ConfigError(BenchError):
    """A config value is wrong. The message names the file and the key path."""

    def __init__(self, message, source=None, key=None):
        self.source, self.key = source, key
        where = ":".join(str(p) for p in (source, key) if p)
        super().__init__(f"{where}: {message}" if where else message)


def describe(value):
    """What a block returned, for a contract error: ``a tensor of shape (8, 3)`` or the type's name (no import
    of torch here: anything with a ``shape`` reads as a tensor)."""
    shape = getattr(value, "shape", None)
    return f"a tensor of shape {tuple(shape)}" if shape is not None else type(value).__name__
