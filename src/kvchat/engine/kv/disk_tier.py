"""The disk tier: KV blocks in kvchat's cache dir, across chats and restarts.

One file per block, named by its chained hash (which covers the model identity, the KV layout and
every token before it), in the pool's own precision, with a chain's first block carrying the
full-precision sink rows a quantized pool needs. A file is

    MAGIC | header length (u32) | JSON header | tensor bytes | crc32 of header and bytes (u32)

written to a private temp name and renamed into place, so a reader (this process, another kvchat
on the same cache dir) sees a whole file or none, and a write killed midway leaves only a temp
file. A file that is truncated, damaged or written for another model, layout or prefix is a miss
and is deleted. Capped in bytes, least recently used (mtime) first; pinned blocks (a persona's,
``.pin``) go last. Files are the user's only (0600): a conversation's KV is its text in another form.
"""
import errno
import fcntl
import json
import logging
import os
import stat
import struct
import time
import zlib
from pathlib import Path

import torch

from kvchat.core.paths import cache_dir
from kvchat.engine.kv.host_tier import StoredBlock

log = logging.getLogger("kvchat.disk_tier")
MAGIC = b"KVCHATB1"
PLAIN, PINNED, TMP = ".kvb", ".pin", ".tmp"
DEFAULT_CAP = 4 << 30
STALE_TMP_S = 600  # a temp file this old is a write that died (a live one takes milliseconds)
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SINK_NAMES = ("sink_k", "sink_v")
ALIGN = 64  # every tensor starts at a multiple of this in the file, so it is read in place


class DiskTier:
    def __init__(self, folder: Path | None = None, cap_bytes: int = DEFAULT_CAP):
        self.folder = Path(folder) if folder is not None else cache_dir() / "kv-blocks"
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self.cap_bytes = max(0, int(cap_bytes))
        self.hits = 0
        self.full = False  # a write met a full disk: writes stop until the cache is cleared
        self.used = self._scan()[0]

    def path(self, hash_: bytes, pinned: bool = False) -> Path:
        return self.folder / (hash_.hex() + (PINNED if pinned else PLAIN))

    def find(self, hash_: bytes) -> Path | None:
        for pinned in (False, True):
            path = self.path(hash_, pinned)
            if path.is_file():
                return path
        return None

    def has(self, hash_: bytes) -> bool:
        return self.find(hash_) is not None

    # -- writing --

    def save(self, hash_: bytes, extra_key: str, block: StoredBlock, pinned: bool = False) -> bool:
        """Write one block; False when it was not written (no room, a full disk: ``self.full``)."""
        if self.full or self.cap_bytes == 0:
            return False
        block.wait()
        tensors = dict(block.tensors)
        if block.sinks is not None:
            tensors.update(zip(SINK_NAMES, block.sinks))
        parts = [t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy() for t in tensors.values()]
        header = json.dumps({
            "hash": hash_.hex(), "extra_key": extra_key, "parent": block.parent.hex() if block.parent else None,
            "token_ids": list(block.token_ids),
            "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape), p.nbytes]
                        for (n, t), p in zip(tensors.items(), parts)],
        }).encode()
        header += b" " * (-(len(MAGIC) + 4 + len(header)) % ALIGN)  # tensors start aligned
        head = MAGIC + struct.pack("<I", len(header)) + header
        parts = [q for p in parts for q in (p, bytes(-p.nbytes % ALIGN))]
        crc = zlib.crc32(header)
        for p in parts:
            crc = zlib.crc32(p, crc)
        tmp = self.folder / f"{hash_.hex()}.{os.getpid()}.{time.monotonic_ns()}{TMP}"
        try:
            with _create(tmp) as f:
                f.write(head)
                for p in parts:
                    f.write(p)
                f.write(struct.pack("<I", crc))
            os.replace(tmp, self.path(hash_, pinned))  # a crash before this leaves only the temp file
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in FULL:
                self.full = True
                return False
            raise
        if pinned:
            self.path(hash_).unlink(missing_ok=True)
        self.used += len(head) + sum(len(memoryview(p).cast("B")) for p in parts) + 4
        return True

    def pin(self, hash_: bytes) -> bool:
        """Move a block to the top of the LRU (a persona's): trimmed only when nothing else is left."""
        try:
            os.replace(self.path(hash_), self.path(hash_, True))
            return True
        except FileNotFoundError:
            return self.path(hash_, True).is_file()

    # -- reading --

    def load(self, hash_: bytes, extra_key: str, token_ids) -> StoredBlock | None:
        path = self.find(hash_)
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(data)
        except OSError:  # removed since find (another process trimmed it): a miss
            return None
        try:
            block = self._parse(data, got, hash_, extra_key, token_ids)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, struct.error) as e:
            return self._reject(path, str(e))
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        self.hits += 1
        return block

    def _parse(self, data: bytearray, size: int, hash_: bytes, extra_key: str, token_ids) -> StoredBlock:
        if size != len(data) or size < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
            raise ValueError("not a kvchat block file, or truncated")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        if start + hlen + 4 > size:
            raise ValueError("truncated")
        (crc,) = struct.unpack_from("<I", data, size - 4)
        if zlib.crc32(memoryview(data)[start:size - 4]) != crc:
            raise ValueError("checksum mismatch")
        header = json.loads(bytes(data[start:start + hlen]))
        if header["hash"] != hash_.hex() or header["extra_key"] != extra_key:
            raise ValueError("written for another model, layout or prefix")
        if header["token_ids"] != list(token_ids):
            raise ValueError("token ids differ")
        offset, tensors = start + hlen, {}
        for name, dtype, shape, nbytes in header["tensors"]:
            flat = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
            tensors[name] = flat.view(getattr(torch, dtype)).reshape(shape)
            offset += nbytes + -nbytes % ALIGN
        if offset != size - 4:
            raise ValueError("sizes do not add up")
        sinks = tuple(tensors.pop(n) for n in SINK_NAMES) if SINK_NAMES[0] in tensors else None
        parent = bytes.fromhex(header["parent"]) if header["parent"] else None
        return StoredBlock(tuple(token_ids), parent, tensors, sinks)

    def _reject(self, path: Path, why: str) -> None:
        log.warning("ignoring KV block file %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        return None

    # -- deleting --

    def discard(self, hash_: bytes) -> bool:
        gone = False
        for pinned in (False, True):
            try:
                self.path(hash_, pinned).unlink()
                gone = True
            except FileNotFoundError:
                pass
        return gone

    def clear(self, keep_pinned: bool = True) -> int:
        """Every block (a persona's too unless ``keep_pinned``); a write that met a full disk may
        try again. Returns how many files went."""
        n = 0
        with self._lock():
            for path in self._entries():
                if path.suffix == PLAIN or (path.suffix == PINNED and not keep_pinned):
                    path.unlink(missing_ok=True)
                    n += 1
        self.full = False
        self.used = self._scan()[0]
        return n

    def trim(self) -> None:
        """Keep the folder under the cap: plain blocks least recently used first, pinned ones only
        when nothing else is left; stale temp files go, live ones (another process's write) count.
        Under a lock, so two processes on one cache dir do not both delete for the same excess."""
        with self._lock():
            self.used, entries = self._scan()
            excess = self.used - self.cap_bytes
            for _, size, path in sorted(entries, key=lambda e: (e[2].suffix == PINNED, e[0])):
                if excess <= 0:
                    break
                if path.suffix != TMP:
                    path.unlink(missing_ok=True)
                    excess -= size
                    self.used -= size

    def _scan(self) -> tuple[int, list]:
        entries, now = [], time.time()
        for path in self._entries():
            try:
                st = path.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if path.suffix == TMP and now - st.st_mtime > STALE_TMP_S:
                path.unlink(missing_ok=True)
                continue
            entries.append((st.st_mtime, st.st_size, path))
        return sum(size for _, size, _ in entries), entries

    def _entries(self) -> list[Path]:
        try:
            return [p for p in self.folder.iterdir() if p.suffix in (PLAIN, PINNED, TMP)]
        except OSError as e:
            log.warning("cannot list the KV block cache %s: %s", self.folder, e)
            return []

    def _lock(self):
        return _FolderLock(self.folder / ".lock")


def _create(path: Path):
    """A new file readable by the user only (the mode is set at creation: never readable by others)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


class _FolderLock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
