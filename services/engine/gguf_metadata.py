"""The key/value metadata at the head of a GGUF file, read without torch or numpy.

Layout (GGUF v2 and v3, little-endian)::

    "GGUF"  u32 version  u64 tensor_count  u64 kv_count
    kv_count x ( string key, u32 type, value )        string = u64 length + UTF-8 bytes
                                                       array  = u32 element type, u64 count, elements

Only the metadata is read (the tokenizer's vocabulary and merges, the chat template, the
architecture's context length): the tensor table and data that follow are never touched,
so this costs milliseconds where a full reader parses every tensor header.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from services.errors import ModelLoadError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("IQ")
            if elem == _STRING:
                return [self.string() for _ in range(count)]
            if elem not in _SCALARS:
                raise ValueError(f"array of unsupported type {elem}")
            return list(self.unpack(f"{count}{_SCALARS[elem]}"))
        if kind not in _SCALARS:
            raise ValueError(f"unsupported value type {kind}")
        return self.unpack(_SCALARS[kind])[0]


def read_metadata(path: Path) -> dict:
    """Every metadata key of the file and its value (arrays as lists). ModelLoadError if it is not GGUF."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError("it does not start with the GGUF magic bytes")
            cur = _Cursor(buf)
            cur.pos = 4
            version, _tensors, count = cur.unpack("IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (this reader handles 2 and 3)")
            metadata = {}
            for _ in range(count):
                key = cur.string()
                (kind,) = cur.unpack("I")
                metadata[key] = cur.value(kind)
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if "general.architecture" not in metadata:
        raise ModelLoadError(f"{path} has no general.architecture in its GGUF metadata")
    return metadata
