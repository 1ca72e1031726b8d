"""Kept sessions of a salted (API-keyed) tenant: reused by the same salt from every tier, after a
restart and after a pull from a peer (the file records the hash root), and by no other salt."""

from __future__ import annotations

import json
import shutil
import struct
import zlib

import pytest

from engine.kv.prefix_hash import salt_root
from engine.sessions.kvfile import KVFormatError, read_file_header, verify_file
from tests.engine.sessions.conftest import GREEDY, KEPT, PROMPT1, assert_no_leaked_pins, evict_device, turn2_prompt

SALT, OTHER = "tenant-a", "tenant-b"


def run(engine, rid, prompt, salt, session_id="chat"):
    request = engine.add_request(rid, prompt, GREEDY, session_id=session_id, cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return request


def _turn2_reuses(engine, t1, salt, tier):
    t2 = run(engine, "t2", turn2_prompt(t1), salt)
    assert t2.num_cached_tokens == KEPT and engine.sessions.stats.tokens_reused[tier] == KEPT
    assert_no_leaked_pins(engine)
    return t2


def test_same_salt_reuses_from_device_and_host(make_engine):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1, SALT)
    _turn2_reuses(engine, t1, SALT, "gpu")
    t3_prompt = turn2_prompt(t1)
    evict_device(engine, "chat")
    t3 = run(engine, "t3", t3_prompt + [5, 6, 7], SALT)
    assert t3.num_cached_tokens > 0 and engine.sessions.stats.tokens_reused["host"] > 0


def test_another_salt_naming_the_session_reuses_nothing(make_engine):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1, SALT)
    evict_device(engine, "chat")  # from host: the promotion compares hashes, and they differ from block 0
    t2 = run(engine, "t2", turn2_prompt(t1), OTHER)
    assert t2.num_cached_tokens == 0 and sum(engine.sessions.stats.tokens_reused.values()) == 0
    unsalted = run(engine, "t3", turn2_prompt(t1), None, session_id="other-chat")
    assert unsalted.num_cached_tokens == 0  # nor does an unsalted request find the salted blocks
    assert_no_leaked_pins(engine)


def test_restart_keeps_the_hash_root(make_engine):
    first = make_engine()
    t1 = run(first, "t1", PROMPT1, SALT)
    first.sessions.close()  # flushes the background writer
    header = read_file_header(first.sessions.disk.file_of("chat"))
    assert header.hash_root == salt_root(SALT)
    restarted = make_engine()  # same session_dir: re-indexed from the file
    _turn2_reuses(restarted, t1, SALT, "disk")


def test_restart_another_salt_reuses_nothing(make_engine):
    first = make_engine()
    t1 = run(first, "t1", PROMPT1, SALT)
    first.sessions.close()
    restarted = make_engine()
    assert run(restarted, "t2", turn2_prompt(t1), OTHER).num_cached_tokens == 0


def test_pulled_file_keeps_the_hash_root(make_engine, tmp_path):
    holder = make_engine(session_dir=str(tmp_path / "holder"))
    t1 = run(holder, "t1", PROMPT1, SALT)
    download = tmp_path / "download.kv"
    shutil.copyfile(holder.sessions.export_path("chat"), download)  # what an HTTP pull writes
    puller = make_engine(session_dir=str(tmp_path / "puller"))
    assert puller.sessions.adopt_file(download).num_tokens == KEPT
    _turn2_reuses(puller, t1, SALT, "disk")


def test_unsalted_files_carry_no_hash_root(make_engine):
    engine = make_engine()
    run(engine, "t1", PROMPT1, None)
    engine.sessions.close()
    path = engine.sessions.disk.file_of("chat")
    assert read_file_header(path).hash_root is None
    assert b"hash_root" not in path.read_bytes()[:4096]  # byte-identical to files written before salts


def test_a_malformed_hash_root_is_refused(make_engine, tmp_path):
    engine = make_engine()
    run(engine, "t1", PROMPT1, SALT)
    engine.sessions.close()
    data = bytearray(engine.sessions.disk.file_of("chat").read_bytes())
    (header_len,) = struct.unpack_from("<I", data, 6)
    doc = json.loads(data[10 : 10 + header_len])
    doc["hash_root"] = "abcd"  # 2 bytes, not 16
    header = json.dumps(doc, separators=(",", ":")).encode()
    bad = data[:6] + struct.pack("<I", len(header)) + header + struct.pack("<I", zlib.crc32(header))
    bad += data[10 + header_len + 4 :]
    path = tmp_path / "bad.kv"
    path.write_bytes(bad)
    with pytest.raises(KVFormatError, match="hash_root"):
        verify_file(path, engine.sessions.layout)
