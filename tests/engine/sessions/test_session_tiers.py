"""Turn n's greedy output is identical whichever tier its session KV came from, and the KV
was really reused (tokens cached, per-tier counters) in every case but recomputation."""

from __future__ import annotations

import shutil
import threading

from tests.engine.sessions.conftest import (
    BS,
    GREEDY,
    KEPT,
    PROMPT1,
    assert_no_leaked_pins,
    evict_device,
    run,
    turn2_prompt,
)


def _turn1(engine, sid="chat"):
    t1 = run(engine, "t1", PROMPT1, session_id=sid)
    info = engine.sessions.info(sid)
    assert info.num_tokens == KEPT and info.nbytes == KEPT * engine.sessions.layout.bytes_per_token
    return t1


def _turn2(engine, t1, reference, tier, sid="chat"):
    t2 = run(engine, "t2", turn2_prompt(t1), session_id=sid)
    assert t2.output_token_ids == reference[1]
    assert t2.num_cached_tokens == KEPT
    stats = engine.sessions.stats
    assert stats.tokens_reused[tier] == KEPT and sum(stats.tokens_reused.values()) == KEPT
    assert stats.tokens_recomputed == 0
    assert engine.sessions.info(sid).num_tokens == (len(turn2_prompt(t1)) + GREEDY.max_tokens - 1) // BS * BS
    assert_no_leaked_pins(engine)
    return t2


def test_device_tier(make_engine, reference):
    engine = make_engine()
    t1 = _turn1(engine)
    assert t1.output_token_ids == reference[0]
    assert engine.sessions.info("chat").tiers == ("gpu", "host", "disk")
    _turn2(engine, t1, reference, "gpu")
    assert engine.sessions.stats.bytes_host_to_gpu == engine.sessions.stats.bytes_disk_to_gpu == 0


def test_host_tier(make_engine, reference):
    engine = make_engine()
    t1 = _turn1(engine)
    evict_device(engine, "chat")
    assert engine.sessions.info("chat").tiers == ("host", "disk")
    _turn2(engine, t1, reference, "host")
    stats = engine.sessions.stats
    assert stats.bytes_host_to_gpu == KEPT * engine.sessions.layout.bytes_per_token and stats.bytes_disk_to_gpu == 0


def test_disk_tier(make_engine, reference):
    engine = make_engine(session_host_gib=0)  # every host copy is evicted at once: disk only
    t1 = _turn1(engine)
    assert engine.sessions.info("chat").tiers == ("gpu", "disk")
    evict_device(engine, "chat")
    assert engine.sessions.info("chat").tiers == ("disk",)
    _turn2(engine, t1, reference, "disk")
    assert engine.sessions.stats.bytes_disk_to_gpu == KEPT * engine.sessions.layout.bytes_per_token


def test_restart_adopts_disk_files(make_engine, reference, tmp_path):
    first = make_engine()
    t1 = _turn1(first)
    first.sessions.close()  # flushes the background writer
    restarted = make_engine()  # same session_dir
    assert restarted.sessions.info("chat").tiers == ("disk",)
    _turn2(restarted, t1, reference, "disk")


def test_peer_file_adopted(make_engine, reference, tmp_path):
    holder = make_engine(session_dir=str(tmp_path / "holder"))
    t1 = _turn1(holder)
    download = tmp_path / "download.kv"
    shutil.copyfile(holder.sessions.export_path("chat"), download)  # what an HTTP pull writes
    puller = make_engine(session_dir=str(tmp_path / "puller"))
    info = puller.sessions.adopt_file(download)
    assert info.tiers == ("disk",) and info.num_tokens == KEPT and not download.exists()
    assert puller.sessions.stats.sessions_adopted == 1
    _turn2(puller, t1, reference, "disk")


def test_peer_file_verified_off_the_engine_thread(make_engine, reference, tmp_path):
    holder = make_engine(session_dir=str(tmp_path / "holder"))
    t1 = _turn1(holder)
    download = tmp_path / "download.kv"
    shutil.copyfile(holder.sessions.export_path("chat"), download)
    puller = make_engine(session_dir=str(tmp_path / "puller"))
    header = {}
    worker = threading.Thread(target=lambda: header.update(h=puller.sessions.verify(download)))
    worker.start()
    worker.join()
    assert puller.sessions.adopt_file(download, verified=header["h"]).tiers == ("disk",)
    _turn2(puller, t1, reference, "disk")


def test_peer_file_adopted_without_disk_tier(make_engine, reference, tmp_path):
    holder = make_engine(session_dir=str(tmp_path / "holder"))
    t1 = _turn1(holder)
    download = tmp_path / "download.kv"
    shutil.copyfile(holder.sessions.export_path("chat"), download)
    puller = make_engine(session_dir=None)  # the layers move into host memory, the file goes
    info = puller.sessions.adopt_file(download)
    assert info.tiers == ("host",) and info.num_tokens == KEPT and not download.exists()
    assert puller.sessions.export_path("chat") is None
    _turn2(puller, t1, reference, "host")


def test_recompute_without_session(make_engine, reference):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1)
    t2 = run(engine, "t2", turn2_prompt(t1))
    assert t2.output_token_ids == reference[1]
    assert engine.sessions.snapshot() == [] and engine.sessions.stats.turns == 0


def test_prefix_mismatch_reuses_common_blocks_only(make_engine, tiny_model_dir):
    from engine import EngineConfig, LLMEngine

    engine = make_engine()
    t1 = _turn1(engine)
    evict_device(engine, "chat")
    prompt = turn2_prompt(t1)
    prompt[BS + 3] += 1  # history re-tokenised differently in the second block
    t2 = run(engine, "t2", prompt, session_id="chat")
    fresh = LLMEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", num_blocks=24, enable_prefix_caching=False)
    )
    assert t2.output_token_ids == run(fresh, "x", prompt).output_token_ids
    assert t2.num_cached_tokens == BS
    stats = engine.sessions.stats
    assert stats.tokens_reused["host"] == BS and stats.tokens_recomputed == 0  # only block 0 was in common
    assert_no_leaked_pins(engine)


def test_unknown_session_is_kept_after_first_turn(make_engine):
    engine = make_engine(session_dir=None)
    assert engine.sessions.info("new") is None
    run(engine, "t1", PROMPT1, session_id="new")
    assert engine.sessions.info("new").tiers == ("gpu", "host")
    assert engine.sessions.export_path("new") is None  # no disk tier configured
