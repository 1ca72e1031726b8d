"""The same sessions cell on a fresh stack and on an aged one (issue 20, session 10).

Session 9's grid ran 16 users and then 8 on one stack per mode, and its 8-user cells were slower
than the 16-user ones in every mode. This runs, on **one** stack, a cell at `--users`, then a
cell at `--age-users` (which fills the broker's topics as the 16-user cell did), then the first
cell again, and records after each cell how deep the stack's topics are (end offsets summed over
their partitions, read from the embedded broker). The two `--users` cells differ only by the
stack's age and the host's drift in between (the same seed: the same prompts, so the mode should
have no prefix cache, as `recompute`); `loadgen/bench/broker_depth.py` measures what depth does
to one hop. The tiny-model plan's settings (`issue20-tiny`):

    python -m loadgen.bench.sessions_age --mode recompute --users 8 --age-users 16 \\
        --duration 150 --age-duration 300 --json docs/results/sessions-bench-s10/stack-age.json
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time

from loadgen.bench.common import write_json
from loadgen.bench.sessions import PLANS, _run_level, mode_stack_env
from loadgen.bench.sessions_stack import MODES
from loadgen.provenance import decided_dtype, stamp

_TOPICS = ("results", "requests.rt", "dispatch", "telemetry", "heartbeats")


async def topic_depths(log_path: str, prefix: str) -> dict[str, int]:
    """End offsets of the stack's topics, summed over partitions, by topic suffix (`dispatch`
    sums every worker's dispatch topic). The broker's address is in the stack's log."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    found = re.search(r"embedded broker on (\S+)", open(log_path).read())
    if not found:
        return {}
    consumer = AIOKafkaConsumer(bootstrap_servers=found.group(1), enable_auto_commit=False)
    await consumer.start()
    try:
        names = [t for t in await consumer.topics() if t.startswith(prefix + ".")]
        out: dict[str, int] = {}
        for topic in names:
            suffix = topic[len(prefix) + 1 :]
            key = next((k for k in _TOPICS if suffix == k or suffix.startswith(k + ".")), None)
            if key is None:
                continue
            parts = consumer.partitions_for_topic(topic) or set()
            ends = await consumer.end_offsets([TopicPartition(topic, p) for p in parts])
            out[key] = out.get(key, 0) + sum(ends.values())
        return out
    finally:
        await consumer.stop()


async def _run(args: argparse.Namespace, model: str) -> list[dict]:
    from loadgen.bench.stack import running_stack

    mode = MODES[args.mode]
    cells = [(args.users, args.duration), (args.age_users, args.age_duration), (args.users, args.duration)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-sessions-age-") as data_dir:
        log = os.path.join(data_dir, "stack.log")
        env = {**mode_stack_env(args, mode), "TANDEM_DATA_DIR": data_dir}
        async with running_stack(model, args.dtype, args.kv_cache_gib, log, args.workers, env) as (url, name):
            prefix = "bench" + url.rsplit(":", 1)[1]
            for i, (users, duration) in enumerate(cells):
                args.duration = duration
                depth_before = await topic_depths(log, prefix)
                cell = await _run_level(args, mode, url, name, users)
                cell.update(stack_cells_before=i, topic_depth_before=depth_before)
                cell["topic_depth_after"] = await topic_depths(log, prefix)
                rows.append(cell)
                s = cell["summary"]
                print(
                    f"{time.strftime('%H:%M:%S')} cell {i} users {users}: next-turn TTFT p50 "
                    f"{cell['next_turn_ttft_p50_s']:.3f} s, TPOT p50 {s['tpot_p50_s']:.3f} s, "
                    f"results depth {depth_before.get('results')} -> {cell['topic_depth_after'].get('results')}, "
                    f"load {cell['load_average']['before'][0]:.0f} -> {cell['load_average']['after'][0]:.0f}",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from loadgen.bench.gateway import _tiny_model
    from loadgen.bench.stack import stop_on_signal

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="recompute", choices=sorted(MODES))
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--age-users", type=int, default=16)
    ap.add_argument("--duration", type=float, default=150.0)
    ap.add_argument("--age-duration", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for key, value in PLANS["issue20-tiny"].items():
        if key not in ("users", "modes", "duration"):
            setattr(args, key, value)
    args.dtype, args.kv_cache_gib, args.workers, args.seed = "auto", 0.25, 2, 0
    config = dict(vars(args))
    provenance = stamp(dtype=decided_dtype(args.dtype)).as_dict()
    with tempfile.TemporaryDirectory(prefix="tandem-sessions-model-") as tmp:
        rows = uvloop.run(stop_on_signal(_run(args, _tiny_model(tmp))))
    write_json({"config": config, "cells": rows, "provenance": provenance}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
