"""Local test models built once into a cache directory, whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def build_once(path: Path, build: Callable[[Path], None]) -> Path:
    """Return ``path``, first running ``build`` into a staging directory beside it if it is not
    there yet. The rename makes the model appear whole or not at all, even with concurrent
    builders (the loser's staging copy is left for the cache's owner to clear)."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    staging.mkdir(parents=True, exist_ok=True)
    build(staging)
    try:
        staging.rename(path)
    except OSError:
        if not (path / "config.json").exists():
            raise
    return path
