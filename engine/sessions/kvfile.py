"""The session KV file: the same bytes on disk and over HTTP.

Byte layout (all integers little endian):

    b"TDKV"                       magic
    u16 version                   1
    u32 header_len
    header_len bytes              header JSON, utf-8: {session_id, token_ids, num_tokens, layout,
                                  hash_root?}; hash_root (32 hex digits) only for a salted session:
                                  the root its block hashes chain from (engine/kv/prefix_hash.py)
    u32 crc32(header bytes)
    per layer i = 0 .. L-1:
        u32 layer_index           must equal i
        u64 nbytes                2 * kv_heads * num_tokens * head_dim * itemsize(dtype)
        u32 crc32(payload)
        payload                   K then V, contiguous [2, kv_heads, num_tokens, head_dim] in dtype
    b"TEND"

Readers check every one of these (magic, version, both kinds of CRC, layer order, sizes, the
trailer) and that the layout equals the reader's own; any difference is a `KVFormatError`
whose message says what differs. Layers come one at a time, so a reader can hand layer i to
the model before layer i+1 has arrived.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

import torch

MAGIC = b"TDKV"
TRAILER = b"TEND"
VERSION = 1
_PREAMBLE = struct.Struct("<4sHI")  # magic, version, header_len
_U32 = struct.Struct("<I")
_LAYER = struct.Struct("<IQI")  # layer_index, nbytes, crc32
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_HEADER = 64 << 20  # a header is token ids + a few fields; anything bigger is garbage

if sys.byteorder != "little":  # payloads are raw tensor bytes; a big-endian host would need swaps
    raise ImportError("the session KV format assumes a little-endian host")


class KVFormatError(ValueError):
    """A KV file or transfer that is corrupt, truncated, or made for another model/layout."""


@dataclass(frozen=True)
class KVLayout:
    """Everything the bytes of a session's KV depend on besides the tokens."""

    model: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    @classmethod
    def of(cls, model_config, dtype: str, block_size: int) -> KVLayout:
        return cls(
            model_config.name,
            model_config.architecture,
            model_config.num_layers,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            block_size,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def bytes_per_token_layer(self) -> int:
        """K+V bytes of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.num_layers

    @property
    def fingerprint(self) -> str:
        """Directory name for files of this layout (a restart only re-indexes its own)."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def mismatch(self, other: dict) -> str | None:
        """None when `other` (a header's layout) equals this layout, else what differs."""
        mine = asdict(self)
        diffs = [f"{k}: file {other.get(k)!r} != local {v!r}" for k, v in mine.items() if other.get(k) != v]
        extra = sorted(set(other) - set(mine))
        if extra:
            diffs.append(f"unknown layout fields {extra}")
        return "; ".join(diffs) or None


@dataclass(frozen=True)
class KVHeader:
    session_id: str
    token_ids: tuple[int, ...]
    layout: KVLayout
    data_offset: int  # byte offset of layer 0's record
    hash_root: bytes | None = None  # a salted session's hash root (its cache salt's, never the salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def layer_nbytes(self) -> int:
        return self.num_tokens * self.layout.bytes_per_token_layer

    def layer_offset(self, layer: int) -> int:
        return self.data_offset + layer * (_LAYER.size + self.layer_nbytes)

    @property
    def file_size(self) -> int:
        return self.layer_offset(self.layout.num_layers) + len(TRAILER)


def file_size(session_id: str, token_ids: Sequence[int], layout: KVLayout, hash_root: bytes | None = None) -> int:
    """Bytes of the file `write_kv_file` produces (for budgets, before writing)."""
    header = _header_bytes(session_id, token_ids, layout, hash_root)
    return (
        _PREAMBLE.size
        + len(header)
        + _U32.size
        + layout.num_layers * (_LAYER.size + len(token_ids) * layout.bytes_per_token_layer)
        + len(TRAILER)
    )


# -- writing ------------------------------------------------------------------------------


def write_kv_file(
    path: Path,
    session_id: str,
    token_ids: Sequence[int],
    layout: KVLayout,
    layers: Sequence[torch.Tensor],
    hash_root: bytes | None = None,
) -> int:
    """Write atomically (temporary file, then rename). Returns the file's size in bytes."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            size = write_kv_stream(f, session_id, token_ids, layout, layers, hash_root)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def write_kv_stream(
    f: BinaryIO,
    session_id: str,
    token_ids: Sequence[int],
    layout: KVLayout,
    layers: Sequence[torch.Tensor],
    hash_root: bytes | None = None,
) -> int:
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} layers given for a {layout.num_layers}-layer layout")
    header = _header_bytes(session_id, token_ids, layout, hash_root)
    f.write(_PREAMBLE.pack(MAGIC, VERSION, len(header)) + header + _U32.pack(zlib.crc32(header)))
    size = _PREAMBLE.size + len(header) + _U32.size
    for i, tensor in enumerate(layers):
        payload = _payload(tensor, len(token_ids), layout)
        f.write(_LAYER.pack(i, payload.nbytes, zlib.crc32(payload)))
        f.write(payload)
        size += _LAYER.size + payload.nbytes
    f.write(TRAILER)
    return size + len(TRAILER)


def _header_bytes(session_id: str, token_ids: Sequence[int], layout: KVLayout, hash_root: bytes | None) -> bytes:
    header = {
        "session_id": session_id,
        "token_ids": list(token_ids),
        "num_tokens": len(token_ids),
        "layout": asdict(layout),
    }
    if hash_root is not None:  # absent for unsalted sessions: their files are what they always were
        header["hash_root"] = hash_root.hex()
    return json.dumps(header, separators=(",", ":")).encode()


def _payload(tensor: torch.Tensor, num_tokens: int, layout: KVLayout):
    shape = (2, layout.num_kv_heads, num_tokens, layout.head_dim)
    if tuple(tensor.shape) != shape or tensor.dtype != layout.torch_dtype:
        raise ValueError(f"layer tensor {tuple(tensor.shape)} {tensor.dtype} does not match {shape} {layout.dtype}")
    # uint8 view: numpy has no bfloat16, and a byte view writes the raw little-endian values
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()


# -- reading ------------------------------------------------------------------------------


def read_header(f: BinaryIO, expect: KVLayout | None = None) -> KVHeader:
    """Parse and check the preamble and header; `expect` also checks the layout."""
    magic, version, header_len = _PREAMBLE.unpack(_read_exact(f, _PREAMBLE.size, "preamble"))
    if magic != MAGIC:
        raise KVFormatError(f"not a session KV file (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise KVFormatError(f"unsupported KV format version {version} (this reader knows {VERSION})")
    if header_len > _MAX_HEADER:
        raise KVFormatError(f"header length {header_len} is implausible")
    raw = _read_exact(f, header_len, "header")
    (crc,) = _U32.unpack(_read_exact(f, _U32.size, "header checksum"))
    if zlib.crc32(raw) != crc:
        raise KVFormatError("header checksum mismatch")
    header = _parse_header(raw, _PREAMBLE.size + header_len + _U32.size)
    if expect is not None:
        diff = expect.mismatch(asdict(header.layout))
        if diff:
            raise KVFormatError(f"KV layout differs from this engine's: {diff}")
    return header


def _parse_header(raw: bytes, data_offset: int) -> KVHeader:
    try:
        doc = json.loads(raw)
        layout = KVLayout(**doc["layout"])
        token_ids = tuple(int(t) for t in doc["token_ids"])
        session_id = str(doc["session_id"])
        num_tokens = int(doc["num_tokens"])
        hash_root = None if doc.get("hash_root") is None else bytes.fromhex(doc["hash_root"])
    except (ValueError, KeyError, TypeError) as exc:
        raise KVFormatError(f"malformed KV header: {exc}") from None
    if hash_root is not None and len(hash_root) != 16:
        raise KVFormatError(f"hash_root must be 16 bytes, not {len(hash_root)}")
    if layout.dtype not in _DTYPES:
        raise KVFormatError(f"unknown dtype {layout.dtype!r} in KV header")
    if num_tokens != len(token_ids) or num_tokens % layout.block_size:
        raise KVFormatError(
            f"header says {num_tokens} tokens, lists {len(token_ids)} "
            f"(must be equal and a multiple of block size {layout.block_size})"
        )
    return KVHeader(session_id, token_ids, layout, data_offset, hash_root)


def read_layer(f: BinaryIO, header: KVHeader, layer: int) -> torch.Tensor:
    """Layer `layer` as `[2, kv_heads, num_tokens, head_dim]`, checksum verified.

    `f` must be positioned at the layer's record (sequential reads) or seekable.
    """
    if f.seekable():
        f.seek(header.layer_offset(layer))
    index, nbytes, crc = _LAYER.unpack(_read_exact(f, _LAYER.size, f"layer {layer} record"))
    if index != layer:
        raise KVFormatError(f"layer record {index} where layer {layer} was expected")
    if nbytes != header.layer_nbytes:
        raise KVFormatError(f"layer {layer} has {nbytes} bytes, expected {header.layer_nbytes}")
    payload = bytearray(nbytes)
    if f.readinto(payload) != nbytes:
        raise KVFormatError(f"truncated KV data in layer {layer}")
    if zlib.crc32(payload) != crc:
        raise KVFormatError(f"checksum mismatch in layer {layer}")
    lay = header.layout
    tensor = torch.frombuffer(payload, dtype=lay.torch_dtype) if nbytes else torch.empty(0, dtype=lay.torch_dtype)
    return tensor.view(2, lay.num_kv_heads, header.num_tokens, lay.head_dim)


def read_trailer(f: BinaryIO, header: KVHeader) -> None:
    if f.seekable():
        f.seek(header.layer_offset(header.layout.num_layers))
    if _read_exact(f, len(TRAILER), "trailer") != TRAILER:
        raise KVFormatError("missing end marker (truncated or trailing garbage)")
    if f.read(1):
        raise KVFormatError("trailing bytes after the end marker")


def iter_layers(f: BinaryIO, header: KVHeader) -> Iterator[torch.Tensor]:
    """Every layer in order, then the trailer check."""
    for i in range(header.layout.num_layers):
        yield read_layer(f, header, i)
    read_trailer(f, header)


def verify_file(path: Path, expect: KVLayout) -> KVHeader:
    """Check a whole file (header, every layer's checksum, trailer) against `expect`. Thread-safe."""
    with open(path, "rb") as f:
        header = read_header(f, expect)
        for _ in iter_layers(f, header):
            pass
    return header


def read_file_header(path: Path, expect: KVLayout | None = None) -> KVHeader:
    with open(path, "rb") as f:
        return read_header(f, expect)


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise KVFormatError(f"truncated KV data in {what}")
    return data
