"""Read and write safetensors files with numpy, bf16 included (via ml_dtypes).

Own reader because `safetensors.numpy` cannot represent bf16; tensors are memory-mapped and
read one at a time, so importing a checkpoint never holds the whole model in host memory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            self.header = json.loads(handle.read(size))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + size

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        entry = self.header[name]
        if entry["dtype"] not in _DTYPES:
            raise SafetensorsError(f"{self.path}: {name} has unsupported dtype {entry['dtype']}")
        start, stop = entry["data_offsets"]
        dtype = _DTYPES[entry["dtype"]]
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + start,
                         shape=tuple(entry["shape"])) if stop > start else np.zeros(entry["shape"], dtype)


class CheckpointTensors:
    """All tensors of an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            single = directory / "model.safetensors"
            files = {name: single for name in SafetensorsFile(single).keys()}
        else:
            raise SafetensorsError(f"{directory}: no model.safetensors or model.safetensors.index.json")
        self._files = files
        self._open: dict[Path, SafetensorsFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def get(self, name: str) -> np.ndarray:
        if name not in self._files:
            raise SafetensorsError(f"checkpoint has no tensor {name!r}")
        path = self._files[name]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path].get(name)


def save_file(tensors: dict[str, np.ndarray], path: str | Path) -> None:
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in _NAMES:
            raise SafetensorsError(f"{name}: dtype {array.dtype} cannot be written")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format wants 8-byte aligned tensor data
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for array in arrays:
            handle.write(array.tobytes())
