"""Reading CTranslate2's model.bin (binary version 6): named numpy arrays and aliases, checked as they are read."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

CT2_BINARY_VERSION = 6


class CT2FormatError(ValueError):
    """A CTranslate2 model file is malformed or not what the reader supports; the message says where."""


@dataclass
class CT2Model:
    """A parsed CTranslate2 model.bin. `variables` also holds every alias name, bound to its target's array."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)


# dtype code -> numpy dtype as stored (little-endian); bf16 is read as raw uint16 and widened afterwards
_CT2_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: np.dtype("<u2"),
}
_BF16 = 5


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bit patterns (uint16) to float32 exactly: bf16 is the top half of an f32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class _Cursor:
    """Bounds-checked sequential reads over the file's bytes, naming what was being read on failure."""

    def __init__(self, data: np.ndarray, path: str):
        self.data = data
        self.mv = memoryview(data)
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise CT2FormatError(
                f"{self.path}: truncated: {what} needs {n:,} bytes at offset {start:,}, "
                f"but the file ends at {len(self.data):,}"
            )
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        start = self.need(size, what)
        return struct.unpack_from(fmt, self.mv, start)[0]

    def string(self, what: str) -> str:
        n = self.unpack("<H", f"the length of {what}")
        start = self.need(n, what)
        raw = bytes(self.mv[start:start + n])
        if n == 0 or raw[-1] != 0:
            raise CT2FormatError(f"{self.path}: {what} at offset {start:,} is not NUL-terminated")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CT2FormatError(f"{self.path}: {what} at offset {start:,} is not UTF-8: {e}") from e


def read_ct2(path: str | os.PathLike) -> CT2Model:
    """Read a CTranslate2 model.bin (binary version 6). Arrays are zero-copy views of a read-only memory map,
    except bf16 ones, which are widened to float32."""
    path = str(path)
    if os.path.getsize(path) == 0:
        raise CT2FormatError(f"{path}: truncated: the file is empty")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data, path)
    version = cur.unpack("<I", "the binary version")
    if version != CT2_BINARY_VERSION:
        raise CT2FormatError(
            f"{path}: CTranslate2 binary version {version}; only version {CT2_BINARY_VERSION} is supported"
        )
    spec = cur.string("the spec name")
    revision = cur.unpack("<I", "the spec revision")
    count = cur.unpack("<I", "the variable count")
    variables: dict[str, np.ndarray] = {}
    for index in range(count):
        name = cur.string(f"the name of variable {index}")
        rank = cur.unpack("<B", f"the rank of {name!r}")
        dims = tuple(cur.unpack("<I", f"dimension {d} of {name!r}") for d in range(rank))
        code = cur.unpack("<B", f"the dtype of {name!r}")
        if code not in _CT2_DTYPES:
            raise CT2FormatError(f"{path}: variable {name!r} has unknown dtype code {code} (known: 0-5)")
        dtype = _CT2_DTYPES[code]
        nbytes = cur.unpack("<I", f"the byte count of {name!r}")
        expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        if nbytes != expected:
            raise CT2FormatError(
                f"{path}: variable {name!r} declares {nbytes:,} bytes, but shape {list(dims)} of "
                f"{'bf16' if code == _BF16 else dtype.name} needs {expected:,}"
            )
        start = cur.need(nbytes, f"the data of {name!r}")
        array = np.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=start).reshape(dims)
        if code == _BF16:
            array = bf16_bits_to_float32(array)
        if name in variables:
            raise CT2FormatError(f"{path}: variable {name!r} appears twice")
        variables[name] = array
    alias_count = cur.unpack("<I", "the alias count")
    aliases: dict[str, str] = {}
    for index in range(alias_count):
        alias = cur.string(f"alias {index}")
        aliases[alias] = cur.string(f"the target of alias {alias!r}")
    if cur.pos != len(data):
        raise CT2FormatError(
            f"{path}: {len(data) - cur.pos:,} unexpected bytes after the aliases at offset {cur.pos:,}"
        )
    for alias in aliases:
        if alias in variables:
            raise CT2FormatError(f"{path}: alias {alias!r} shadows a variable of the same name")
        target, seen = aliases[alias], {alias}
        while target in aliases:  # aliases may point at aliases; follow them, refusing cycles
            if target in seen:
                raise CT2FormatError(f"{path}: alias {alias!r} is part of a cycle")
            seen.add(target)
            target = aliases[target]
        if target not in variables:
            raise CT2FormatError(f"{path}: alias {alias!r} points at {aliases[alias]!r}, which does not exist")
        variables[alias] = variables[target]
    return CT2Model(spec=spec, revision=revision, variables=variables, aliases=aliases)
