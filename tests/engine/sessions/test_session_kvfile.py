"""The session KV file format: round trip and every refusal a reader must make."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sessions.kvfile import (
    KVFormatError,
    KVLayout,
    file_size,
    iter_layers,
    read_header,
    verify_file,
    write_kv_file,
    write_kv_stream,
)

LAYOUT = KVLayout("tiny", "llama", 3, 2, 8, "float32", 4)
TOKENS = list(range(100, 112))  # three blocks of 4


def _layers(layout=LAYOUT, n=len(TOKENS)):  # noqa: B008 (TOKENS is a constant)
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, layout.num_kv_heads, n, layout.head_dim, generator=g).to(layout.torch_dtype)
        for _ in range(layout.num_layers)
    ]


def _bytes(layout=LAYOUT, layers=None) -> bytes:
    buf = io.BytesIO()
    write_kv_stream(buf, "s1", TOKENS, layout, layers or _layers(layout))
    return buf.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip(tmp_path, dtype):
    layout = replace(LAYOUT, dtype=dtype)
    layers = _layers(layout)
    path = tmp_path / "s.kv"
    size = write_kv_file(path, "s1", TOKENS, layout, layers)
    assert size == path.stat().st_size == file_size("s1", TOKENS, layout)
    header = verify_file(path, layout)
    assert (header.session_id, header.token_ids, header.layout) == ("s1", tuple(TOKENS), layout)
    with open(path, "rb") as f:
        for mine, theirs in zip(iter_layers(f, read_header(f)), layers, strict=True):
            assert torch.equal(mine, theirs)
    assert [p.name for p in tmp_path.iterdir()] == ["s.kv"]  # no temporary left behind


def test_byte_layout():
    data = _bytes()
    magic, version, header_len = struct.unpack_from("<4sHI", data)
    assert (magic, version) == (b"TDKV", 1)
    header = data[10 : 10 + header_len]
    assert struct.unpack_from("<I", data, 10 + header_len)[0] == zlib.crc32(header)
    pos = 14 + header_len
    payload = 2 * 2 * len(TOKENS) * 8 * 4
    for i in range(LAYOUT.num_layers):
        index, nbytes, crc = struct.unpack_from("<IQI", data, pos)
        assert (index, nbytes) == (i, payload) and crc == zlib.crc32(data[pos + 16 : pos + 16 + payload])
        pos += 16 + payload
    assert data[pos:] == b"TEND"


def _refused(data: bytes, match: str, layout=LAYOUT) -> None:
    f = io.BytesIO(data)
    with pytest.raises(KVFormatError, match=match):
        for _ in iter_layers(f, read_header(f, layout)):
            pass


def _header_end(data: bytes) -> int:
    return 14 + struct.unpack_from("<I", data, 6)[0]


def test_refusals():
    data = _bytes()
    end = _header_end(data)
    _refused(b"XXXX" + data[4:], "magic")
    _refused(data[:4] + struct.pack("<H", 2) + data[6:], "version 2")
    _refused(data[:20] + bytes([data[20] ^ 1]) + data[21:], "header checksum")
    flipped = bytearray(data)
    flipped[end + 16 + 5] ^= 0x10  # layer 0's payload
    _refused(bytes(flipped), "checksum mismatch in layer 0")
    _refused(data[:-9], "truncated")
    _refused(data + b"x", "trailing bytes")
    swapped = bytearray(data)
    struct.pack_into("<I", swapped, end, 1)  # layer 0's record claims to be layer 1
    _refused(bytes(swapped), "layer record 1 where layer 0")


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other"),
        ("dtype", "bfloat16"),
        ("head_dim", 16),
        ("num_kv_heads", 4),
        ("block_size", 16),
        ("num_layers", 2),
    ],
)
def test_layout_mismatch_names_the_difference(field, value):
    data = _bytes()
    _refused(data, f"{field}: file .* != local {value!r}", layout=replace(LAYOUT, **{field: value}))


def test_write_checks_shapes():
    with pytest.raises(ValueError, match="does not match"):
        _bytes(layers=[t[:, :, :4] for t in _layers()])
    with pytest.raises(ValueError, match="layers given"):
        _bytes(layers=_layers()[:2])


def test_fingerprint_separates_layouts():
    assert LAYOUT.fingerprint == KVLayout(**LAYOUT.__dict__).fingerprint
    assert LAYOUT.fingerprint != replace(LAYOUT, dtype="bfloat16").fingerprint


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_single_byte_change_is_refused(data):
    """Every byte is covered by a check: magic, version, lengths, CRCs, layer order, trailer."""
    blob = bytearray(_bytes())
    pos = data.draw(st.integers(0, len(blob) - 1), label="position")
    blob[pos] ^= data.draw(st.integers(1, 255), label="xor")
    f = io.BytesIO(bytes(blob))
    with pytest.raises(KVFormatError):
        for _ in iter_layers(f, read_header(f, LAYOUT)):
            pass
