"""The tensor index of a GGUF file: each tensor's name, type, shape and bytes (a read-only
memory map), read without parsing the metadata's values.

`gguf.GGUFReader` builds every metadata field as numpy views, which takes 20 s for SmolLM2's
49K-token vocabulary and longer for Qwen's 152K; loading weights needs only the tensor index.
The layout (GGUF version 2 and 3, ggml's `docs/gguf.md`): magic `GGUF`, uint32 version,
uint64 tensor count, uint64 metadata count; the metadata key-value pairs; per tensor its
name, uint32 dimension count, uint64 dimensions (innermost first), uint32 type and uint64
offset; then the tensor data, starting at the next multiple of `general.alignment` (32 when
absent), each tensor at its offset from there.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
"""GGUF metadata value types with a fixed size; 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: its GGUF name (`blk.0.attn_q.weight`).
        kind: its type's name (`Q4_K`, `F32`, ...: `gguf.GGMLQuantizationType`).
        shape: its shape outermost first (`(rows, inputs)` for a matrix).
        raw: its bytes, uint8, a read-only view of the file.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    raw: np.ndarray


class _Cursor:
    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.take("<Q")
        self.at += size
        return bytes(self.data[self.at - size : self.at]).decode("utf-8")

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            size = self.take("<Q")
            self.at += size
        elif kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                self.at += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            self.at += struct.calcsize(_SCALARS[kind])


def read_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The tensors of the GGUF file `path`, by name, their bytes memory-mapped.

    Raises:
        ValueError: not a GGUF file (version 2 or 3), a tensor type the `gguf` package does
            not know, or a tensor that runs past the end of the file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    if bytes(mapped[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count, field_count = cursor.take("<Q"), cursor.take("<Q")
    alignment = 32
    for _ in range(field_count):
        key, kind = cursor.string(), cursor.take("<I")
        if key == "general.alignment":
            alignment = cursor.take(_SCALARS[kind])
        else:
            cursor.skip_value(kind)
    index = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        type_id, offset = cursor.take("<I"), cursor.take("<Q")
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has an unknown type {type_id}") from None
        index.append((name, kind, tuple(reversed(dims)), offset))
    start = -(-cursor.at // alignment) * alignment
    tensors = {}
    for name, kind, shape, offset in index:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        size = int(np.prod(shape)) // block * block_bytes
        begin = start + offset
        if begin + size > mapped.size:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        tensors[name] = GGUFTensor(name, kind.name, shape, mapped[begin : begin + size])
    return tensors
