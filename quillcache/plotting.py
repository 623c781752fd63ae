"""matplotlib for the commands' `--plot`: an optional extra, so its absence is a clear
error before any work is done, not a traceback after it."""

from __future__ import annotations

from typing import Any

from quillcache.errors import ConfigError


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'quillcache[plot]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
