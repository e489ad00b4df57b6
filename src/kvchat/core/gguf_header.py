"""A GGUF file's metadata and tensor list, read from its header without parsing its arrays.

The model library describes every GGUF it finds. ``gguf.GGUFReader`` builds a numpy view of every
field, each of the tokenizer's 49,152 tokens and 48,900 merges included: 2.2 s for the starter's
header, per file, each time the library opened. Here an array is counted and skipped (its strings
by their lengths), and only scalars are decoded: what the library shows needs no more.
"""
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF's value types: struct formats of the fixed-size ones; 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Array:
    """An array field, not read: its element type and length."""
    type: int
    count: int


@dataclass
class Header:
    metadata: dict  # key -> int, float, bool, str, or Array
    tensors: dict  # name -> number of elements


def read_header(path: Path) -> Header:
    """Raises ValueError for a file that is not GGUF or ends inside its header."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _Reader(buf).header()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"not a complete GGUF header ({e})") from None


class _Reader:
    def __init__(self, buf):
        self.buf = buf
        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = struct.unpack_from("<I", buf, 4)[0]
        self.order = "<" if version & 0xFFFF else ">"  # a big-endian file's version reads as n << 24 here
        self.at = 8

    def take(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.at + n
        if end > len(self.buf):
            raise IndexError("a string runs past the end of the file")
        text = self.buf[self.at:end].decode("utf-8")
        self.at = end
        return text

    def value(self, kind: int):
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.take("I"), self.take("Q")
            self.skip(element, count)
            return Array(element, count)
        raise ValueError(f"unknown GGUF value type {kind}")

    def skip(self, kind: int, count: int) -> None:
        if kind in SCALARS:
            self.at += count * struct.calcsize(SCALARS[kind])
        elif kind == STRING:
            lengths = struct.Struct(self.order + "Q")
            for _ in range(count):
                self.at += 8 + lengths.unpack_from(self.buf, self.at)[0]
        else:  # arrays of arrays: each read in turn
            for _ in range(count):
                self.value(kind)
        if self.at > len(self.buf):
            raise IndexError("an array runs past the end of the file")

    def header(self) -> Header:
        tensors, fields = self.take("Q"), self.take("Q")
        metadata = {}
        for _ in range(fields):
            key = self.string()
            metadata[key] = self.value(self.take("I"))
        counts = {}
        for _ in range(tensors):
            name = self.string()
            counts[name] = math.prod(self.take("Q") for _ in range(self.take("I")))
            self.take("I"), self.take("Q")  # the tensor's type and offset
        return Header(metadata, counts)
