"""Reading and writing the safetensors format (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length, a JSON header (dtype, shape, byte offsets per tensor), then raw tensor
bytes. Implemented directly over numpy memory maps so that bfloat16 (which numpy lacks) is read as
fp32 and written as BF16 without going through any pickle-based format.
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from bmtrain_cli.errors import UserError

_NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_CODES = {np.dtype(v): k for k, v in _NP_DTYPES.items()}


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bfloat16 bit patterns (uint16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))
    return (rounded >> 16).astype(np.uint16)


class SafetensorsFile:
    """Lazy reader of one .safetensors file: ``names()``, ``get(name) -> np.ndarray``.
    BF16 tensors come back as fp32 (exact)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or n > 100_000_000:
                    raise ValueError("bad header length")
                self.header = json.loads(f.read(n).decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise UserError(f"{self.path}: not a readable safetensors file ({exc})") from None
        self.metadata = self.header.pop("__metadata__", None) or {}
        self._offset = 8 + n
        try:
            needed = max((int(v["data_offsets"][1]) for v in self.header.values()), default=0)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise UserError(f"{self.path}: not a readable safetensors file (bad header: {exc})") from None
        for name, info in self.header.items():
            self._check_entry(name, info)
        have = self.path.stat().st_size - self._offset
        if needed > have:
            raise UserError(
                f"{self.path}: truncated safetensors file (the header describes {needed} bytes of "
                f"tensor data, the file holds {max(have, 0)}); copy or download it again"
            )

    def _check_entry(self, name: str, info: Any) -> None:
        """A tensor's shape and dtype must fill its byte range exactly (else reading it fails to reshape)."""
        try:
            shape = [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
            code = info["dtype"]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"{self.path}: not a readable safetensors file (bad entry {name}: {exc})"
            ) from None
        size = 2 if code == "BF16" else np.dtype(_NP_DTYPES[code]).itemsize if code in _NP_DTYPES else None
        if size is None:
            raise UserError(f"{self.path}: tensor {name} has unsupported dtype {code}")
        if (
            any(d < 0 for d in shape)
            or start < 0
            or end < start
            or int(np.prod(shape, dtype=object)) * size != end - start
        ):
            raise UserError(
                f"{self.path}: damaged safetensors header: tensor {name} of shape {shape} ({code}) needs "
                f"{int(np.prod(shape, dtype=object)) * size} bytes, its byte range holds {end - start}; copy or "
                "download the file again"
            )

    def names(self) -> List[str]:
        return list(self.header)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        start, end = info["data_offsets"]
        # read, not memory-mapped: a mapped file's pages stay resident (and counted) after each tensor is
        # copied out, so loading tensor by tensor would still peak at the file's size
        return self._decode(
            name,
            np.fromfile(self.path, dtype=np.uint8, count=end - start, offset=self._offset + start),
            info["shape"],
        )

    def get_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0..r1 of a tensor (its first axis), read from the file alone: a large matrix quantised a
        block of rows at a time is never read whole (quant/vocab.py)."""
        info = self.header[name]
        shape = [int(d) for d in info["shape"]]
        rows = max(shape[0], 1)
        row_bytes = (int(info["data_offsets"][1]) - int(info["data_offsets"][0])) // rows
        start = self._offset + int(info["data_offsets"][0]) + r0 * row_bytes
        raw = np.fromfile(self.path, dtype=np.uint8, count=(r1 - r0) * row_bytes, offset=start)
        return self._decode(name, raw, [r1 - r0, *shape[1:]])

    def _decode(self, name: str, raw: np.ndarray, shape: List[int]) -> np.ndarray:
        info = self.header[name]
        code = info["dtype"]
        if code == "BF16":
            return bf16_bits_to_fp32(raw.view(np.uint16)).reshape(shape)
        if code not in _NP_DTYPES:
            raise UserError(f"{self.path}: tensor {name} has unsupported dtype {code}")
        return raw.view(_NP_DTYPES[code]).reshape(shape)


def write_safetensors(
    path: Path, tensors: Dict[str, np.ndarray], bf16: Tuple[str, ...] = (), metadata: Optional[dict] = None
) -> None:
    """Write ``tensors`` (numpy arrays) to ``path``; names in ``bf16`` are stored as BF16."""
    header: Dict[str, dict] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs: List[bytes] = []
    offset = 0
    for name, arr in tensors.items():
        if name in bf16:
            data = fp32_to_bf16_bits(arr)
            code = "BF16"
        else:
            data = np.ascontiguousarray(arr)
            if data.dtype not in _CODES:
                raise ValueError(f"cannot store dtype {data.dtype} of {name} in safetensors")
            code = _CODES[data.dtype]
        blob = data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    tmp.replace(path)


def current_umask() -> int:
    """The process's file-creation mask (read without changing it where /proc says; else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_numpy_file(tensors: Dict[str, np.ndarray], path: Path, metadata: Optional[dict] = None) -> None:
    """safetensors' own writer (every dtype it knows), with the file mode every other file gets: the
    library creates its file 0600 whatever the umask, which hides an exported adapter from a serving
    process or a teammate; the mode is set to 0666 less the umask (0644 under umask 022)."""
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def checkpoint_files(directory: Path) -> Iterator[SafetensorsFile]:
    """The safetensors files of a Hugging Face-style checkpoint directory (index first, then
    model.safetensors, then any *.safetensors). Refuses pickle-based weights with a clear error."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as exc:
            raise UserError(f"{index}: not a valid safetensors index ({exc})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise UserError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        files = [d / n for n in names]
    elif (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt*"))
        hint = (
            f" (found {', '.join(pickled)}: pickle-based weights are not loaded; convert them to "
            "safetensors first, e.g. with transformers' save_pretrained(safe_serialization=True))"
            if pickled
            else ""
        )
        raise UserError(f"{d}: no *.safetensors weights{hint}")
    for f in files:
        yield SafetensorsFile(f)


class LazyTensors(MutableMapping):
    """The tensors of a checkpoint's files by name, each read from its file when it is looked up (and not
    kept): loading walks them one at a time, so the host holds one checkpoint tensor at a time beside the
    model. Assigned entries (split or renamed tensors) are held as given."""

    def __init__(self, files: Iterable[SafetensorsFile]) -> None:
        self._where: Dict[str, Any] = {}
        for f in files:
            for name in f.names():
                self._where[name] = f

    def __getitem__(self, name: str) -> np.ndarray:
        where = self._where[name]
        return where.get(name) if isinstance(where, SafetensorsFile) else where

    def row_reader(self, name: str) -> Optional[Tuple[Callable[[int, int], np.ndarray], Tuple[int, ...]]]:
        """(read(r0, r1) -> rows r0..r1, shape) of a tensor still in its file; None for an assigned one."""
        where = self._where[name]
        if not isinstance(where, SafetensorsFile):
            return None
        return (lambda r0, r1: where.get_rows(name, r0, r1)), where.shape(name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._where[name] = value

    def __delitem__(self, name: str) -> None:
        del self._where[name]

    def __contains__(self, name: object) -> bool:  # without reading the tensor (Mapping's would)
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)
