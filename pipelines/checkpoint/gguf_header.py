"""A GGUF file's header: its key-value metadata and tensor directory, read in one pass.

The `gguf` package's reader builds a numpy view for every element of every array, so the
tokenizer's vocabulary (SmolLM2: 49,152 tokens and 48,900 merges) costs it ~5 s per open, and
the server opens the file in three processes. Loom needs the scalars, the strings and the
length of those arrays: this reader skips array contents it is not asked for and reads the
rest with `struct`, in tens of milliseconds. Every offset is checked against the file's size,
so a truncated or garbled file is a `HeaderError` naming what is wrong, never a read past its
end. (Format: github.com/ggml-org/ggml/blob/master/docs/gguf.md, versions 2 and 3.)

A hostile header costs bounded time and memory too: every count is checked against the bytes
left before anything is read (each element takes at least a few), the counts of keys, tensors
and Python-parsed elements (strings, inner arrays) are capped far above any model's, arrays nest
at most two deep (a model's metadata has none nested), and a string read as text is at most
16 MiB.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# Arrays whose values are read (small numeric ones); others keep only their length.
_MAX_ARRAY_VALUES = 4096
# Bounds on what one header may make this reader do (a model's: tens of keys, a few thousand
# tensors, a vocabulary and its merges of well under a million strings each).
MAX_FIELDS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 21  # strings and inner arrays, over all arrays of the header
MAX_ARRAY_DEPTH = 2  # an array of arrays
MAX_STRING_BYTES = 1 << 24  # a string read as text (a key, a value, a token)
_U64 = struct.Struct("<Q")

# GGML tensor types: number -> (name, elements per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


class HeaderError(ValueError):
    """The header cannot be read; the message says where and why."""


@dataclass
class ArrayValue:
    """An array in the metadata: its length, and its values when they were read."""

    length: int
    values: list | None = None


@dataclass
class TensorInfo:
    name: str
    qtype: str  # GGML type name ("Q4_K"), or "type N" for a number this reader does not know
    dims: tuple[int, ...]  # GGUF's order: fastest-varying first (in_features of a weight)
    offset: int  # from the start of the file
    nbytes: int  # 0 where the type is unknown


@dataclass
class GGUFHeader:
    path: str
    version: int
    fields: dict[str, object]  # int, float, bool, str or ArrayValue
    tensors: list[TensorInfo]
    data: np.ndarray  # the whole file, memory-mapped read-only, as uint8

    def tensor_bytes(self, tensor: TensorInfo) -> np.ndarray:
        return self.data[tensor.offset:tensor.offset + tensor.nbytes]


def read_header(path: str, read_arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    """Parse `path`. String arrays named in `read_arrays` have their values read whatever
    their length; other arrays only up to a few thousand numeric values."""
    size = os.path.getsize(path)
    if size < 24:
        raise HeaderError("too short to be a GGUF file")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(mapped, size, read_arrays)
    if cursor.take(4) != MAGIC:
        raise HeaderError("not a GGUF file (bad magic)")
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version}; loom reads versions 2 and 3")
    n_tensors, n_fields = cursor.scalar("Q"), cursor.scalar("Q")
    # (A key is at least its length and its type, 12 bytes; a tensor's entry 32.)
    cursor.check_count(n_fields, MAX_FIELDS, 12, "metadata keys")
    cursor.check_count(n_tensors, MAX_TENSORS, 32, "tensors")
    fields = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(key)
    infos = [cursor.tensor_info() for _ in range(n_tensors)]
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise HeaderError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        qtype, nbytes = _layout(name, dims, type_id)
        begin = start + offset
        if begin + nbytes > size:
            raise HeaderError(f"tensor {name} lies past the end of the file (truncated?)")
        tensors.append(TensorInfo(name, qtype, dims, begin, nbytes))
    data = np.frombuffer(mapped, dtype=np.uint8)
    return GGUFHeader(path, version, fields, tensors, data)


def _layout(name: str, dims: tuple[int, ...], type_id: int) -> tuple[str, int]:
    if type_id not in GGML_TYPES:
        return f"type {type_id}", 0
    qtype, block, block_bytes = GGML_TYPES[type_id]
    count = 1
    for d in dims:
        count *= d
    if dims and dims[0] % block:
        raise HeaderError(f"tensor {name}: rows of {dims[0]} values are not whole {qtype} "
                          f"blocks of {block}")
    return qtype, count // block * block_bytes


class _Cursor:
    def __init__(self, buf, size: int, read_arrays: frozenset[str]) -> None:
        self.buf, self.size, self.pos, self.read_arrays = buf, size, 0, read_arrays
        self.array_items = 0  # strings and inner arrays stepped through so far

    def take(self, n: int) -> bytes:
        self.skip(n)
        return self.buf[self.pos - n:self.pos]

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise HeaderError(f"the header runs past the end of the file at byte {self.pos} "
                              f"(truncated?)")
        self.pos += n

    def scalar(self, fmt: str):
        width = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(width))[0]

    def check_count(self, count: int, limit: int, min_bytes: int, what: str) -> None:
        """Refuse, before reading any, `count` things of at least `min_bytes` each that the
        rest of the file cannot hold, or more than `limit`."""
        if count > limit:
            raise HeaderError(f"{count:,} {what}, more than the {limit:,} loom reads")
        if count * min_bytes > self.size - self.pos:
            raise HeaderError(f"{count:,} {what} cannot fit in the {self.size - self.pos:,} "
                              f"bytes left of the file (truncated?)")

    def string(self) -> str:
        n = self.scalar("Q")
        if n > MAX_STRING_BYTES:
            raise HeaderError(f"a string of {n:,} bytes at byte {self.pos}, more than the "
                              f"{MAX_STRING_BYTES:,} loom reads")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"a string at byte {self.pos - len(raw)} is not UTF-8") from None

    def value(self, key: str):
        kind = self.scalar("I")
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(key)
        raise HeaderError(f"{key}: unknown value type {kind}")

    def array(self, key: str, depth: int = 1) -> ArrayValue:
        if depth > MAX_ARRAY_DEPTH:
            raise HeaderError(f"{key}: arrays nested more than {MAX_ARRAY_DEPTH} deep (a GGUF "
                              f"model's metadata nests none)")
        kind, length = self.scalar("I"), self.scalar("Q")
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            width = struct.calcsize(fmt)
            self.check_array(key, length, width, "values")
            if length <= _MAX_ARRAY_VALUES:  # (a bigger one is skipped, not parsed)
                raw = self.take(length * width)
                return ArrayValue(length, list(struct.unpack(f"<{length}{fmt}", raw)))
            self.skip(length * width)
            return ArrayValue(length)
        if kind == _STRING:
            self.check_array(key, length, 8, "strings")
            if key in self.read_arrays:
                return ArrayValue(length, self.strings(length))
            self.skip_strings(length)
            return ArrayValue(length)
        if kind == _ARRAY:
            self.check_array(key, length, 12, "arrays")
            for _ in range(length):
                self.array(key, depth + 1)
            return ArrayValue(length)
        raise HeaderError(f"{key}: unknown array element type {kind}")

    def check_array(self, key: str, length: int, min_bytes: int, what: str) -> None:
        """An array's length against the bytes left, and the strings and inner arrays (each
        a step of Python) against what the whole header may hold."""
        if length * min_bytes > self.size - self.pos:
            raise HeaderError(f"{key}: an array of {length:,} {what} cannot fit in the "
                              f"{self.size - self.pos:,} bytes left of the file (truncated?)")
        if what != "values":
            self.array_items += length
            if self.array_items > MAX_ARRAY_ITEMS:
                raise HeaderError(f"{key}: the metadata's arrays hold more than "
                                  f"{MAX_ARRAY_ITEMS:,} strings and arrays, more than loom "
                                  f"reads")

    def strings(self, length: int) -> list[str]:
        """`length` strings, read in a loop as tight as `skip_strings`'s."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out = []
        try:
            for _ in range(length):
                n = unpack(buf, pos)[0]
                if n > MAX_STRING_BYTES or pos + 8 + n > size:
                    break
                pos += 8 + n
                out.append(buf[pos - n:pos].decode("utf-8"))
        except struct.error:  # the length itself runs past the end
            pass
        except UnicodeDecodeError:
            raise HeaderError(f"a string at byte {pos - n} is not UTF-8") from None
        self.pos = pos
        if len(out) < length:
            self.string()  # the one that stopped the loop: its own error
        return out

    def skip_strings(self, length: int) -> None:
        """Step over `length` strings: each one's length read in place, nothing copied (the
        tightest loop this reader has, as a vocabulary's merges go through it)."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        for _ in range(length):
            if pos + 8 > size:
                break
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                break
        else:
            self.pos = pos
            return
        self.pos = min(pos, size)
        raise HeaderError(f"the header runs past the end of the file at byte {self.pos} "
                          f"(truncated?)")

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        n_dims = self.scalar("I")
        if not 1 <= n_dims <= 4:
            raise HeaderError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(self.scalar("Q") for _ in range(n_dims))
        if any(d <= 0 or d > 1 << 40 for d in dims):
            raise HeaderError(f"tensor {name} has dimensions {list(dims)}")
        type_id, offset = self.scalar("I"), self.scalar("Q")
        return name, dims, type_id, offset
