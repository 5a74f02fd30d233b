"""Where Tandem keeps what it makes or fetches on first use: one directory, from the environment.

A leaf (the standard library only), so the CPU kernels' build cache, the default model, the
tiny models and converted GGUF tokenizers all find it without importing one another.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(environ: dict[str, str] | None = None) -> Path:
    """``$TANDEM_CACHE``, else ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    env = os.environ if environ is None else environ
    if env.get("TANDEM_CACHE"):
        return Path(env["TANDEM_CACHE"])
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tandem"
