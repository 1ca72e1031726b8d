"""Layer-wise promotion: the forward pass starts before the last layer has arrived; corrupt
or mismatched KV is refused (adopt) or recomputed (discovered mid-promotion)."""

from __future__ import annotations

import shutil
import threading

import pytest

from engine.sessions import KVFormatError
from engine.sessions.kvfile import read_file_header
from tests.engine.sessions.conftest import (
    GREEDY,
    KEPT,
    PROMPT1,
    assert_no_leaked_pins,
    evict_device,
    run,
    tokens,
    turn2_prompt,
)


@pytest.mark.timeout(300)
def test_prefill_starts_before_the_last_layer_is_loaded(make_engine, reference):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1, session_id="chat")
    evict_device(engine, "chat")
    events: list[tuple[str, int]] = []
    first_layer_computing = threading.Event()
    last = engine.model_config.num_layers - 1

    def slow_source(load, layer):  # the loader thread, after copying a layer, before announcing it
        if layer == last:  # hold the last layer back until the forward pass is computing layer 0
            first_layer_computing.wait(timeout=120)
        events.append(("ready", layer))

    def computing(layer):
        def hook(module, args):
            events.append(("compute", layer))
            if layer == 0:
                first_layer_computing.set()

        return hook

    engine.sessions.loader.layer_hook = slow_source
    hooks = [m.register_forward_pre_hook(computing(i)) for i, m in enumerate(engine.model.layers)]
    try:
        t2 = run(engine, "t2", turn2_prompt(t1), session_id="chat")
    finally:
        for h in hooks:
            h.remove()
    assert t2.output_token_ids == reference[1] and t2.num_cached_tokens == KEPT
    first_step = events[: events.index(("compute", last)) + 1]
    assert first_step.index(("compute", 0)) < first_step.index(("ready", last))
    for layer in range(last + 1):  # and no layer was computed before its KV was in place
        assert first_step.index(("ready", layer)) < first_step.index(("compute", layer))


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def _payload_offset(path, layer: int) -> int:
    return read_file_header(path).layer_offset(layer) + 16 + 7  # past the layer record's 16-byte header


def _run_together(engine, *requests):
    reqs = [engine.add_request(rid, prompt, GREEDY, session_id=sid) for rid, prompt, sid in requests]
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_corrupt_layer_found_mid_promotion_recomputes(make_engine, reference):
    engine = make_engine(session_host_gib=0)  # disk only, so the promotion reads the file
    t1 = run(engine, "t1", PROMPT1, session_id="chat")
    other_prompt = tokens(30, seed=7)
    other_alone = run(engine, "o1", other_prompt).output_token_ids
    path = engine.sessions.export_path("chat")
    _flip_byte(path, _payload_offset(path, 1))
    evict_device(engine, "chat")
    t2, other = _run_together(engine, ("t2", turn2_prompt(t1), "chat"), ("o2", other_prompt, None))
    assert t2.output_token_ids == reference[1]
    assert other.output_token_ids == other_alone  # its batch-mate's failure did not touch it
    stats = engine.sessions.stats
    assert stats.load_failures == 1 and t2.num_cached_tokens == 0
    assert stats.tokens_recomputed == KEPT and sum(stats.tokens_reused.values()) == 0
    assert_no_leaked_pins(engine)
    engine.sessions.flush()  # turn 2 rewrote a good file: the next turn reuses it again
    evict_device(engine, "chat")
    t3 = run(engine, "t3", turn2_prompt(t1) + t2.output_token_ids + tokens(5, seed=3), session_id="chat")
    assert t3.num_cached_tokens > KEPT and engine.sessions.stats.load_failures == 1


def test_adopt_refuses_corrupt_file(make_engine, tmp_path):
    holder = make_engine(session_dir=str(tmp_path / "holder"))
    run(holder, "t1", PROMPT1, session_id="chat")
    download = tmp_path / "download.kv"
    shutil.copyfile(holder.sessions.export_path("chat"), download)
    _flip_byte(download, _payload_offset(download, 1))
    puller = make_engine(session_dir=str(tmp_path / "puller"))
    again = tmp_path / "again.kv"
    shutil.copyfile(download, again)
    with pytest.raises(KVFormatError, match="checksum mismatch in layer 1"):
        puller.sessions.adopt_file(download)
    assert not download.exists() and puller.sessions.info("chat") is None
    with pytest.raises(KVFormatError, match="checksum mismatch in layer 1"):
        puller.sessions.verify(again)  # the off-engine-thread check refuses (and deletes) too
    assert not again.exists()


def test_adopt_refuses_other_layout(make_engine, tiny_model_dir, tmp_path):
    holder = make_engine(session_dir=str(tmp_path / "holder"))
    run(holder, "t1", PROMPT1, session_id="chat")
    for name, overrides, differs in [
        ("bf16", dict(dtype="bfloat16"), "dtype"),
        ("qwen3", dict(model=str(tiny_model_dir("qwen3"))), "head_dim"),
    ]:
        download = tmp_path / f"{name}.kv"
        shutil.copyfile(holder.sessions.export_path("chat"), download)
        other = make_engine(session_dir=str(tmp_path / name), **overrides)
        with pytest.raises(KVFormatError, match=differs):
            other.sessions.adopt_file(download)
        assert not download.exists() and other.sessions.snapshot() == []


def test_restart_ignores_files_of_another_layout(make_engine, tmp_path):
    first = make_engine()
    run(first, "t1", PROMPT1, session_id="chat")
    first.sessions.close()
    other = make_engine(block_size=8)  # same session_dir, another layout
    assert other.sessions.snapshot() == []
    again = make_engine()
    assert [i.session_id for i in again.sessions.snapshot()] == ["chat"]


def test_turn_kept_although_generation_params_differ(make_engine):
    engine = make_engine()
    params = GREEDY.__class__(temperature=0, max_tokens=3, ignore_eos=True)
    run(engine, "t1", PROMPT1, session_id="chat", params=params)
    assert engine.sessions.info("chat").num_tokens == 32  # 42 tokens, 41 with KV: two full blocks


def test_file_rewritten_with_other_tokens_is_refused_mid_promotion(make_engine, reference):
    engine = make_engine(session_host_gib=0)
    t1 = run(engine, "t1", PROMPT1, session_id="chat")
    run(engine, "x1", tokens(40, seed=8), session_id="intruder")
    shutil.copyfile(engine.sessions.export_path("intruder"), engine.sessions.export_path("chat"))
    evict_device(engine, "chat")
    t2 = run(engine, "t2", turn2_prompt(t1), session_id="chat")
    assert t2.output_token_ids == reference[1] and t2.num_cached_tokens == 0
    assert engine.sessions.stats.load_failures == 1
    assert_no_leaked_pins(engine)


@pytest.mark.timeout(300)
def test_turn_shares_a_prefetch_still_loading(make_engine, reference):
    engine = make_engine()
    t1 = run(engine, "t1", PROMPT1, session_id="chat")
    evict_device(engine, "chat")
    turn_added = threading.Event()
    order: list[str] = []

    def hold_first_layer(load, layer):
        if layer == 0:
            turn_added.wait(timeout=120)
            order.append("layer 0 ready")

    engine.sessions.loader.layer_hook = hold_first_layer
    assert engine.sessions.prefetch("chat").tokens_promoted == KEPT
    request = engine.add_request("t2", turn2_prompt(t1), GREEDY, session_id="chat")
    order.append("turn added")
    turn_added.set()
    while engine.has_unfinished():
        engine.step()
    assert order == ["turn added", "layer 0 ready"]  # the turn really met a load in flight
    assert request.output_token_ids == reference[1] and request.num_cached_tokens == KEPT
    assert engine.sessions.stats.tokens_reused["gpu"] == KEPT  # found pinned by the prefetch
    assert engine.sessions.stats.bytes_host_to_gpu == KEPT * engine.sessions.layout.bytes_per_token  # moved once
    assert_no_leaked_pins(engine)
