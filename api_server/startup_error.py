"""StartupError: what `loom serve` reports as one line before it serves."""


class StartupError(RuntimeError):
    """A problem the user can fix; reported as one line, no traceback."""
