"""Persona KV on disk: a restarted app answers a long-persona chat without prefilling it again.

One safetensors file per persona prefix (its full blocks), named by the chained hash of its last
block, which already covers the model identity, the KV precision and every token. The file also
records that key, the token ids and a checksum of the tensors: a truncated, corrupt or foreign file
is a miss and is deleted. The folder is capped in bytes, least recently used first.
"""
import hashlib
import logging
import os
import stat
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvchat.core.paths import cache_dir

log = logging.getLogger("kvchat.persona_store")
DEFAULT_CAP = 2 << 30
STALE_TMP_S = 600  # a .tmp this old is a write that died (a live one takes well under a second)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class PersonaStore:
    def __init__(self, folder: Path | None = None, cap_bytes: int = DEFAULT_CAP):
        self.folder = folder or cache_dir() / "persona-kv"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cap_bytes = cap_bytes

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.safetensors"

    def has(self, key: bytes) -> bool:
        return self.path(key).is_file()

    def save(self, key: bytes, extra_key: str, token_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        tensors = {**tensors, "token_ids": torch.tensor(token_ids, dtype=torch.int64)}
        meta = {"key": key.hex(), "extra_key": extra_key, "checksum": checksum(tensors)}
        tmp = self.folder / f"{key.hex()}.{os.getpid()}.tmp"  # two apps writing one persona do not collide
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
            os.replace(tmp, self.path(key))  # a crash mid-write never leaves a half file under the real name
        finally:
            tmp.unlink(missing_ok=True)
        self.trim()

    def load(self, key: bytes, extra_key: str, token_ids: list[int]) -> dict[str, torch.Tensor] | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            tensors = load_file(path)
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            return self._reject(path, f"unreadable ({e})")
        if meta.get("key") != key.hex() or meta.get("extra_key") != extra_key:
            return self._reject(path, "written for another model, precision or prefix")
        if meta.get("checksum") != checksum(tensors):
            return self._reject(path, "checksum mismatch")
        if tensors.get("token_ids") is None or tensors.pop("token_ids").tolist() != list(token_ids):
            return self._reject(path, "token ids differ")
        os.utime(path)  # recently used
        return tensors

    def _reject(self, path: Path, why: str):
        log.warning("ignoring persona cache file %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        return None

    def trim(self) -> None:
        """Keep the folder under the cap, least recently used first. Leftover ``.tmp`` files count,
        and stale ones are removed; an entry that cannot be read or removed (a folder, a file
        another program holds) is skipped, never the cap. Never raises: the write succeeded."""
        entries = []
        for path in self._entries():
            try:
                st = path.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if path.suffix == ".tmp" and time.time() - st.st_mtime > STALE_TMP_S:
                self._remove(path)
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.cap_bytes:
                return
            if path.suffix != ".tmp" and self._remove(path):  # a fresh .tmp is a write under way
                total -= size

    def _entries(self) -> list[Path]:
        try:
            return [p for p in self.folder.iterdir() if p.suffix in (".safetensors", ".tmp")]
        except OSError as e:
            log.warning("cannot list the persona cache %s: %s", self.folder, e)
            return []

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink(missing_ok=True)
            return True
        except OSError as e:
            log.warning("cannot remove %s from the persona cache: %s", path, e)
            return False
