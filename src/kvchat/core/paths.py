"""Where kvchat keeps its files (platformdirs; KVCHAT_HOME overrides both, for tests)."""
import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    root = os.environ.get("KVCHAT_HOME")
    path = Path(root) / "cache" if root else Path(platformdirs.user_cache_dir("kvchat"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    root = os.environ.get("KVCHAT_HOME")
    path = Path(root) / "data" if root else Path(platformdirs.user_data_dir("kvchat"))
    path.mkdir(parents=True, exist_ok=True)
    return path
