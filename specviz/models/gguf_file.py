"""A GGUF file's header read in about a second: its metadata as Python values and where each tensor's bytes are.

gguf's own GGUFReader builds a numpy view per metadata element: ~8 s on the embedded target, whose
tokenizer arrays hold 300,000 strings, before a single weight is touched. This reader walks the same
layout (GGUF v2/v3, little-endian: magic, version, tensor count, key/value count, the key/values, the
tensor table, then the tensor data at the file's alignment) with struct over one memory map, and hands out
each tensor's bytes as a numpy view of the map: nothing is copied until a tensor is packed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# metadata value types (gguf's GGUFValueType): the fixed-size ones as struct formats; 8 is a string, 9 an array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message says where it stopped making sense."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its ggml type, its shape in torch order (rows first) and its bytes."""

    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: GGUF lists the fastest-varying dimension first
    offset: int  # from the start of the file
    nbytes: int

    @property
    def rows(self) -> int:
        """Output rows of a weight (the product of every dimension but the last)."""
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1


class GGUFFile:
    """The header of a GGUF file (metadata, tensor table) and views of its tensors' bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)
        try:
            self.metadata, self.tensors = self._read()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise GGUFFormatError(f"{self.path.name} is not a readable GGUF file: {e}") from e

    def _read(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        buf = self._buffer
        if bytes(buf[:4]) != MAGIC:
            raise GGUFFormatError(f"{self.path.name} does not start with GGUF's magic bytes")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in VERSIONS:
            raise GGUFFormatError(f"{self.path.name} is GGUF version {version}; this reader knows {VERSIONS}")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = self._string(pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            metadata[key], pos = self._value(kind, pos)
        table = []
        for _ in range(tensor_count):
            name, pos = self._string(pos)
            (dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            shape = struct.unpack_from(f"<{dims}Q", buf, pos)
            pos += 8 * dims
            kind, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            table.append((name, GGMLQuantizationType(kind), tuple(reversed(shape)), offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-pos // alignment) * alignment
        tensors = {}
        for name, kind, shape, offset in table:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(shape))
            nbytes = elements // block * block_bytes
            if start + offset + nbytes > len(buf):
                raise GGUFFormatError(f"{self.path.name} is cut short: tensor {name} ends past the end of the file")
            tensors[name] = TensorInfo(name, kind, shape, start + offset, nbytes)
        return metadata, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buffer, pos)
        end = pos + 8 + length
        return str(self._buffer[pos + 8:end], "utf-8"), end

    def _value(self, kind: int, pos: int) -> tuple[Any, int]:
        if kind in _SCALAR:
            fmt = _SCALAR[kind]
            return struct.unpack_from(fmt, self._buffer, pos)[0], pos + struct.calcsize(fmt)
        if kind == STRING:
            return self._string(pos)
        if kind != ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", self._buffer, pos)
        pos += 12
        if item in _NUMPY:  # numbers: one view, converted to a list at once
            values = np.frombuffer(self._buffer, dtype=_NUMPY[item], count=count, offset=pos)
            return values.tolist(), pos + values.nbytes
        out = []
        for _ in range(count):
            value, pos = self._value(item, pos)
            out.append(value)
        return out, pos

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (uint8, a view of the file)."""
        info = self.tensors[name]
        return self._map[info.offset: info.offset + info.nbytes]

    def values(self, name: str) -> np.ndarray:
        """An unquantized tensor (F32, F16, BF16) in its shape, as float32."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.kind == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape)
        if info.kind == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(info.shape)
        if info.kind == GGMLQuantizationType.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
        raise GGUFFormatError(f"{name} holds {info.kind.name} blocks, not plain values")
