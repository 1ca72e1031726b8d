"""The sessions benchmark's figures, on hand-made request records."""

from __future__ import annotations

import pytest

from loadgen.bench.sessions import compare_modes, max_users_at, session_figures, stats_delta
from loadgen.metrics import RequestRecord


def _rec(sid: str, turn: int, worker: str, ttft: float, prompt: int, cached: int) -> RequestRecord:
    r = RequestRecord(f"{sid}-t{turn}", "rt", 10.0 * turn, prompt, 4, session_id=sid, worker=worker, turn=turn)
    r.token_times_s = [r.arrival_s + ttft + 0.1 * i for i in range(4)]
    r.finish_s, r.finish_reason = r.token_times_s[-1], "length"
    r.usage_prompt_tokens, r.cached_tokens = prompt, cached
    return r


def test_session_figures_split_next_turns_by_worker_and_count_recomputed_tokens():
    recs = [
        _rec("a", 0, "w0", 0.5, 100, 0),
        _rec("a", 1, "w0", 0.2, 300, 240),
        _rec("b", 0, "w1", 0.6, 80, 0),
        _rec("b", 1, "w0", 0.4, 200, 160),
    ]
    f = session_figures(recs)
    assert f["next_turn_requests"] == 2
    assert f["next_turn_ttft_p50_s"] == pytest.approx(0.3)
    assert f["next_turn_same_worker"] == {"count": 1, "ttft_p50_s": pytest.approx(0.2)}
    assert f["next_turn_moved_worker"] == {"count": 1, "ttft_p50_s": pytest.approx(0.4)}
    assert (f["prompt_tokens"], f["prompt_tokens_reused"], f["prompt_tokens_recomputed"]) == (680, 400, 280)
    work = f["per_worker"]["workers"]
    assert work["w0"] == {"requests": 3, "prefill_tokens": 100 + 60 + 40} and work["w1"]["prefill_tokens"] == 80
    assert f["per_worker"]["imbalance"] == pytest.approx(200 / 140)


def test_capacity_is_the_most_users_within_the_latency_bar():
    levels = [
        {"users": 2, "next_turn_ttft_p99_s": 0.5},
        {"users": 4, "next_turn_ttft_p99_s": 1.9},
        {"users": 8, "next_turn_ttft_p99_s": 3.0},
        {"users": 16, "next_turn_ttft_p99_s": None},
    ]
    assert max_users_at(levels, 2.0) == 4
    assert max_users_at(levels, 0.1) is None
    # a lucky large cell past a smaller one that missed the bound does not count as held
    noisy = [{"users": 4, "next_turn_ttft_p99_s": 1.2}, {"users": 16, "next_turn_ttft_p99_s": 1.8}]
    assert max_users_at([*noisy, {"users": 8, "next_turn_ttft_p99_s": 2.6}], 2.0) == 4
    modes = {
        "recompute": {"levels": [{"next_turn_ttft_p50_s": 1.0}], "max_users_at_target": 2},
        "sticky": {"levels": [{"next_turn_ttft_p50_s": 0.20}], "max_users_at_target": 4},
        "hints": {"levels": [{"next_turn_ttft_p50_s": 0.21}], "max_users_at_target": 8},
    }
    cmp = compare_modes(modes, 2.0)
    assert cmp["hint_vs_on_device_ttft_p50"] == pytest.approx(1.05)
    assert cmp["hints_vs_recompute_users"] == 4


def test_stats_delta_sums_counter_growth_over_workers():
    before = {"workers": {"w0": {"bytes_pulled": 10, "tier": "x"}}}
    after = {"workers": {"w0": {"bytes_pulled": 30, "tier": "x"}, "w1": {"bytes_pulled": 5}}}
    assert stats_delta(before, after) == {"bytes_pulled": 25}


def test_issue20_plan_sweeps_five_modes_at_four_user_counts(capsys):
    from services.cli import main

    assert main(["bench", "sessions", "--plan", "issue20", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("20 cells, 100 minutes")
    for mode in ("recompute ", "recompute-cached", "sticky", "load-aware", "hints"):
        assert f"  {mode}" in out
    assert "users  16  300 s" in out


def test_tiny_plan_keeps_the_four_modes_that_answer_the_question_in_short_cells(capsys):
    """Issue 20 on a busy host: the tiny model, shorter answers, more turns and faster people,
    so 2-minute cells can put 100 next turns behind a p99; the plan says so in its cells."""
    from loadgen.bench.sessions import PLANS
    from services.cli import main

    assert main(["bench", "sessions", "--plan", "issue20-tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("12 cells, 24 minutes")
    for mode in ("recompute ", "recompute-cached", "load-aware", "hints"):
        assert f"  {mode}" in out
    assert "sticky" not in out
    plan = PLANS["issue20-tiny"]
    assert plan["model"] == "tiny" and plan["turns_mean"] > 4 and plan["speedup"] > 10


def test_new_modes_separate_hints_from_routing_and_cache_from_sessions():
    from loadgen.bench.sessions import MODES

    aware, hints = MODES["load-aware"], MODES["hints"]
    assert aware.session_ids and not aware.hints and hints.hints  # differs from hints only by the hint
    assert aware.env.get("TANDEM_SESSION_ROUTING", "advisory") == hints.env.get("TANDEM_SESSION_ROUTING", "advisory")
    cached = MODES["recompute-cached"]
    assert not cached.session_ids and "TANDEM_ENABLE_PREFIX_CACHING" not in cached.env  # prefix cache on
    assert MODES["recompute"].env["TANDEM_ENABLE_PREFIX_CACHING"] == "false"


def test_the_bench_document_builds_without_a_stack():
    """`_bench`'s own code path (it imported the removed `common.host_info` and failed before
    starting any stack); with no mode to run it still writes the config and the comparison."""
    import argparse
    import asyncio

    from loadgen.bench.sessions import _bench

    args = argparse.Namespace(users="2", duration=1.0, ttft_p99_target=2.0, func=None)
    out = asyncio.run(_bench(args, [], [2]))
    assert out == {
        "config": {"users": "2", "duration": 1.0, "ttft_p99_target": 2.0},
        "complete": True,
        "modes": {},
        "stack_settings": {},
        "comparison": {"ttft_p99_target_s": 2.0},
    }


def test_a_p99_from_fewer_than_100_next_turns_is_flagged(tmp_path):
    """Issue 20: every p99 says how many turns are behind it, and a thin one is marked."""
    from loadgen.bench.sessions_figures import MIN_P99_SAMPLES, format_result

    few = session_figures([_rec("a", 0, "w0", 0.5, 100, 0), _rec("a", 1, "w0", 0.2, 300, 240)])
    many = session_figures([_rec(f"s{i}", t, "w0", 0.3, 100, 0) for i in range(MIN_P99_SAMPLES) for t in (0, 1)])
    assert (few["next_turn_requests"], few["p99_samples_ok"]) == (1, False)
    assert (many["next_turn_requests"], many["p99_samples_ok"]) == (MIN_P99_SAMPLES, True)
    cell = lambda users, f: {"users": users, "kv_moved": {}, **f}  # noqa: E731
    loaded = {**cell(8, many), "load_average": {"before": [31.6, 20.0, 10.0], "after": [18.2, 19.0, 11.0]}}
    table = format_result({"modes": {"hints": {"levels": [cell(2, few), loaded]}}, "comparison": {}})
    assert "| hints | 2 | 1 (<100) |" in table and f"| hints | 8 | {MIN_P99_SAMPLES} |" in table
    # every next turn stayed on w0: none moved, the stayed ones' p50 beside; the load it ran at
    row8 = next(line for line in table.splitlines() if line.startswith("| hints | 8 |"))
    assert "| 0 (- / 300 ms) |" in row8 and row8.endswith("| 32 -> 18 |")


def test_every_finished_cell_is_on_disk_before_the_grid_ends(tmp_path, monkeypatch):
    """A grid stopped part-way keeps its finished cells: `_bench` rewrites the JSON after each
    (`complete` false until the last). The stack and the load are replaced here by a recorder
    that reads the file back when the next cell starts."""
    import argparse
    import asyncio
    import json

    from loadgen.bench import sessions

    path = tmp_path / "grid.json"
    seen_on_disk: list[list[int]] = []

    async def fake_run_mode(args, mode, levels, on_cell=None, *, model=None):
        runs = []
        for users in levels:
            if path.exists():
                seen_on_disk.append([lv["users"] for lv in json.loads(path.read_text())["modes"][mode.name]["levels"]])
            runs.append({"users": users, "next_turn_ttft_p99_s": 0.1})
            on_cell(mode.name, runs)
        assert json.loads(path.read_text())["complete"] is False
        return {"levels": runs, "max_users_at_target": sessions.max_users_at(runs, args.ttft_p99_target)}

    monkeypatch.setattr(sessions, "_run_mode", fake_run_mode)
    args = argparse.Namespace(users="2,4,8", duration=1.0, ttft_p99_target=2.0, func=None, json=str(path))
    out = asyncio.run(sessions._bench(args, [sessions.MODES["hints"]], [2, 4, 8], {"commit": "abc"}))
    assert seen_on_disk == [[2], [2, 4]]
    assert out["complete"] is True and out["provenance"] == {"commit": "abc"}


def test_turns_that_failed_are_counted_by_cause():
    """An overloaded stack 503s turns no worker accepted in time; a cell with no completed
    turn must say so rather than show empty latencies."""
    from loadgen.bench.sessions_figures import failures

    ok = _rec("a", 0, "w0", 0.5, 100, 0)
    busy = [_rec(f"b{i}", 0, "w0", 0.5, 100, 0) for i in range(2)]
    for r in busy:
        r.error = 'HTTP 503: {"error": {"code": "no_capacity", "message": "no worker accepted the request in time"}}'
    odd = _rec("c", 0, "w0", 0.5, 100, 0)
    odd.error = "ReadTimeout"
    assert failures([ok, *busy, odd]) == {"HTTP 503 no_capacity": 2, "error": 1}
    assert session_figures([ok, *busy, odd])["failed"] == {"HTTP 503 no_capacity": 2, "error": 1}


def test_the_5_minute_plan_runs_contended_user_counts_in_every_mode_first(capsys):
    """Issue 20 part C: 5-minute cells at 2, 4, 8, 16 users take longer than a session's
    window, so the grid runs in passes (16 and 8 users in every mode, then 4, then 2) and a run
    cut at its deadline keeps the contended cells of every mode."""
    from services.cli import main

    assert main(["bench", "sessions", "--plan", "issue20-tiny-5min", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("16 cells, 80 minutes of load, 16 stack starts (one per cell)")
    order = [(line.split()[0], int(line.split()[2])) for line in out.splitlines()[1:]]
    modes = ["recompute", "recompute-cached", "load-aware", "hints"]
    assert order == [(m, u) for m in modes for u in (16, 8)] + [(m, 4) for m in modes] + [(m, 2) for m in modes]
    assert "300 s" in out


def test_passes_reject_a_user_count_measured_twice():
    import argparse

    from loadgen.bench.sessions import user_passes

    assert user_passes(argparse.Namespace(users="8,2,4", passes=None)) == [[2, 4, 8]]
    assert user_passes(argparse.Namespace(users="", passes="16,8;4; 2")) == [[16, 8], [4], [2]]
    with pytest.raises(ValueError, match="two passes"):
        user_passes(argparse.Namespace(users="", passes="8;8"))


@pytest.mark.parametrize("shared_stack", [False, True])
def test_a_grid_in_passes_keeps_every_modes_cells_in_user_order(tmp_path, monkeypatch, shared_stack):
    """Each pass runs every mode, every cell on a fresh stack (`--shared-stack`: a pass's cells
    of one mode on one stack, in order, the way before session 10); the JSON written after a
    cell holds that mode's cells of the earlier passes too, sorted by users."""
    import argparse
    import asyncio
    import json

    from loadgen.bench import sessions

    path = tmp_path / "grid.json"
    calls: list[tuple[str, list[int]]] = []

    async def fake_run_mode(args, mode, levels, on_cell=None, *, model=None):
        calls.append((mode.name, list(levels)))
        runs = []
        for users in levels:
            runs.append({"users": users, "next_turn_ttft_p99_s": users / 10})
            on_cell(mode.name, runs)
        return {"levels": runs, "max_users_at_target": sessions.max_users_at(runs, args.ttft_p99_target)}

    monkeypatch.setattr(sessions, "_run_mode", fake_run_mode)
    args = argparse.Namespace(
        users="", duration=1.0, ttft_p99_target=1.0, func=None, json=str(path), shared_stack=shared_stack
    )
    modes = [sessions.MODES["load-aware"], sessions.MODES["hints"]]
    out = asyncio.run(sessions._bench(args, modes, [2, 4, 8, 16], None, None, [[16, 8], [4], [2]]))
    first = [("load-aware", [16, 8]), ("hints", [16, 8])]
    if not shared_stack:
        first = [("load-aware", [16]), ("load-aware", [8]), ("hints", [16]), ("hints", [8])]
    assert calls == first + [("load-aware", [4]), ("hints", [4]), ("load-aware", [2]), ("hints", [2])]
    on_disk = json.loads(path.read_text())
    for doc in (out, on_disk):
        for name in ("load-aware", "hints"):
            assert [lv["users"] for lv in doc["modes"][name]["levels"]] == [2, 4, 8, 16]
            assert doc["modes"][name]["max_users_at_target"] == 8


def test_stack_settings_are_shared_by_every_mode_and_never_redefine_one():
    """`--stack-env` and `--scale-hint-timers` shape every mode's stack alike; a mode's own keys
    (routing, prefix cache) stay the mode's, and a bad pair fails before any stack starts."""
    from loadgen.bench.sessions_stack import MODES, parse_stack_env, scaled_hint_timers, stack_env

    extra = parse_stack_env(["TANDEM_HOLDER_SLACK=0", " TANDEM_MAX_NUM_SEQS = 8"])
    assert extra == {"TANDEM_HOLDER_SLACK": "0", "TANDEM_MAX_NUM_SEQS": "8"}
    for bad in ("HOLDER_SLACK=0", "TANDEM_HOLDER_SLACK", "TANDEM_SESSION_ROUTING=sticky"):
        with pytest.raises(ValueError, match="--stack-env"):
            parse_stack_env([bad])
    timers = scaled_hint_timers(50.0)
    assert timers == {
        "TANDEM_PLACEMENT_TTL_S": "0.6",
        "TANDEM_MAX_PLACEMENT_TTL_S": "6",
        "TANDEM_TYPING_DEBOUNCE_S": "0.04",
        "TANDEM_DEFAULT_ARRIVAL_S": "1.2",
        "TANDEM_TURN_GRACE_S": "0.04",
    }
    recompute = stack_env(MODES["recompute"], extra, 50.0, scale_timers=True)
    assert recompute == {**timers, **extra, "TANDEM_ENABLE_PREFIX_CACHING": "false"}
    assert stack_env(MODES["hints"], {}, 50.0, scale_timers=False) == {}


def test_the_moves_plan_isolates_the_hint_with_scaled_timers(capsys):
    """Issue 20 part C, step 2: load-aware and hints only, with the advisory target's rule for
    the unhinted router, the hint path's timers at the people's speed and hints that say when
    their turn comes; the dry run shows every stack's settings."""
    from services.cli import main

    assert main(["bench", "sessions", "--plan", "issue20-tiny-moves", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 cells, 20 minutes of load, 4 stack starts")
    assert "recompute" not in out and "  load-aware        users  16" in out and "  hints             users   8" in out
    timers = "TANDEM_PLACEMENT_TTL_S=0.6 TANDEM_MAX_PLACEMENT_TTL_S=6 TANDEM_TYPING_DEBOUNCE_S=0.04"
    assert f"every stack: {timers} TANDEM_DEFAULT_ARRIVAL_S=1.2 TANDEM_TURN_GRACE_S=0.04 " in out
    assert "TANDEM_HOLDER_SLACK=1" in out and "expected arrival" in out


def test_a_bad_stack_setting_fails_before_any_stack_starts(capsys):
    """The check runs before the provenance stamp, the model and the first stack: a clear error."""
    from services.cli import main

    assert main(["bench", "sessions", "--modes", "hints", "--stack-env", "TANDEM_ENABLE_PREFIX_CACHING=false"]) != 0
    assert "--stack-env TANDEM_ENABLE_PREFIX_CACHING: the mode sets it" in capsys.readouterr().err


def test_every_stack_of_a_grid_in_passes_keeps_its_own_log(tmp_path):
    """Session 9's grid lost its first pass's stack logs: each pass reopened the mode's log."""
    import argparse

    from loadgen.bench.sessions import stack_log_path, user_passes

    passes = user_passes(argparse.Namespace(users="", passes="16,8;4;2"))
    paths = {stack_log_path(str(tmp_path), mode, levels) for mode in ("hints", "load-aware") for levels in passes}
    assert len(paths) == 6 and str(tmp_path / "sessions-hints-u16-8.log") in paths
    assert stack_log_path(None, "hints", [2]) is None


def test_the_dry_run_counts_a_stack_per_cell_unless_shared(capsys):
    from services.cli import main

    argv = ["bench", "sessions", "--modes", "hints,load-aware", "--passes", "16,8;4", "--dry-run"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("6 cells, 9 minutes of load, 6 stack starts (one per cell)")
    assert main([*argv, "--shared-stack"]) == 0
    assert capsys.readouterr().out.startswith("6 cells, 9 minutes of load, 4 stack starts (one per mode and pass)")


def test_the_first_sigterm_stops_a_run_even_inside_a_callback_that_swallows_exceptions():
    """Session 9: a SIGTERM that came while an HTTP transport's callback ran was raised inside
    it and swallowed ("Fatal error on transport"), and the run went on. `stop_on_signal` takes
    the signal on the event loop instead: code that catches everything cannot eat it, the run is
    cancelled (its `finally` runs: where the stack stops), `Terminated` says which signal, and
    the process's own handler is back afterwards."""
    import asyncio
    import os
    import signal

    from loadgen.bench.stack import stop_on_signal
    from services.lifeline import Terminated, interrupt_on_termination

    before = signal.getsignal(signal.SIGTERM)
    interrupt_on_termination()  # what `tandem` installs: the old way's handler, raising Terminated
    installed = signal.getsignal(signal.SIGTERM)
    swallowed: list[BaseException] = []
    cleaned_up = asyncio.Event()

    async def run() -> None:
        try:
            try:  # a callback that catches everything, as the transport's did
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(100_000))  # Python-level handlers run between bytecodes, here
            except BaseException as exc:  # noqa: BLE001
                swallowed.append(exc)
            await asyncio.Event().wait()  # the run goes on (a cell) until the cancellation ends it
        finally:
            cleaned_up.set()

    try:
        with pytest.raises(Terminated) as caught:
            asyncio.run(asyncio.wait_for(stop_on_signal(run()), 60))
        assert caught.value.signum == signal.SIGTERM
        assert swallowed == [] and cleaned_up.is_set()
        assert signal.getsignal(signal.SIGTERM) is installed
    finally:
        signal.signal(signal.SIGTERM, before)
