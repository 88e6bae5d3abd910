"""The parts of a GGUF file the weight loader reads: scalar metadata and the tensor table, with
each tensor's bytes as a view of the memory-mapped file.

``gguf.GGUFReader`` parses every metadata array into numpy views, the tokenizer's 49,152 tokens
and merges included: about 15 s here, for values the loader never reads (the tokenizer comes
from transformers). This reader steps over arrays and checks every tensor against the file's
size, so a truncated or corrupt file is an error naming the tensor, never a crash mid-load.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types -> struct format of a scalar (8: string, 9: array, read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # outermost first, as torch orders them (ggml lists them reversed)
    type_id: int  # ggml's type number (gguf.GGMLQuantizationType)
    data: np.ndarray  # uint8 view of its bytes in the mapped file


@dataclass(frozen=True, slots=True)
class GgufFile:
    fields: dict[str, object]  # scalar and string metadata (arrays are skipped)
    tensors: tuple[GgufTensor, ...]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"model: {self.path} ends inside its GGUF header (truncated?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"model: {self.path} ends inside its GGUF header (truncated?)")
        value = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, type_id: int):
        if type_id in _SCALARS:
            return self.take(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in _SCALARS:  # fixed size: step over all at once
                self.pos += count * struct.calcsize(_SCALARS[item_type])
            else:
                for _ in range(count):
                    self.value(item_type)
            return None
        raise ValueError(f"model: {self.path}: unknown GGUF metadata type {type_id}")


def read_gguf(path: Path) -> GgufFile:
    """Parse ``path``'s header and tensor table; ValueError (naming the file, or the tensor)
    where it is not GGUF, is truncated, or a tensor's bytes lie past the end of the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped), path)
    if bytes(mapped[:4]) != GGUF_MAGIC:
        raise ValueError(f"model: {path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"model: {path} is GGUF version {version}; versions 2 and 3 are read")
    num_tensors, num_fields = cur.take("<Q"), cur.take("<Q")
    fields: dict[str, object] = {}
    for _ in range(num_fields):
        key = cur.string()
        value = cur.value(cur.take("<I"))
        if value is not None:
            fields[key] = value
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, tuple(reversed(dims)), cur.take("<I"), cur.take("<Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, type_id, offset in infos:
        try:
            block_size, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ValueError(f"model: GGUF tensor {name} has unknown type {type_id}") from None
        num_values = int(np.prod(shape)) if shape else 1
        if num_values % block_size:
            raise ValueError(f"model: GGUF tensor {name} {list(shape)} is not a whole number of "
                             f"{block_size}-value blocks (corrupt?)")
        start = data_start + offset
        end = start + num_values // block_size * type_bytes
        if end > len(mapped):
            raise ValueError(f"model: GGUF tensor {name} ends at byte {end}, past the end of "
                             f"{path} ({len(mapped)} bytes): the file is truncated")
        tensors.append(GgufTensor(name, shape, type_id, mapped[start:end]))
    return GgufFile(fields, tuple(tensors))
