"""The in-process side of `tandem bench gateway`: the worker's engine, called without Kafka.

`tandem bench gateway` subtracts this from the same requests through `tandem up`, so the two
sides must differ only by the Kafka path. Before, the baseline ran inside the bench process:
torch threads and OpenMP wait policy as the bench's own defaults (spinning threads,
`OMP_WAIT_POLICY=active`), while the worker under `tandem up` runs with passive OpenMP, so the
engine's own step time differed (first token 1.9 ms in process against 11 ms in the worker on
a loaded 2-core host) and was counted as Kafka's. Now the baseline runs in a child process
started with the environment `tandem up` gives its worker (`OMP_WAIT_POLICY`, torch threads
per worker) and builds its engine from `WorkerSettings`, as the worker does, with the worker's
GIL switch interval: the same engine, in the same runtime, minus the services.

Run as `python -m loadgen.bench.inproc --model M --requests N --max-tokens T --num-threads K`;
prints one JSON object (the TTFT and inter-token latencies, and the runtime it ran with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

PROMPT = "Write one sentence about the sea."
WARMUP = 3


def child_env(base: dict[str, str]) -> dict[str, str]:
    """The environment `tandem up` gives a worker when a benchmark starts it: the caller's, with
    `up`'s OpenMP wait policy (`running_stack` drops the bench's own default, so `up` chooses)."""
    from services.up import OMP_WAIT_POLICY

    return {**base, "OMP_WAIT_POLICY": OMP_WAIT_POLICY}


async def measure(model: str, requests: int, max_tokens: int, num_threads: int) -> dict:
    from engine import ChatPrompt, SamplingParams
    from engine.async_llm import AsyncLLM
    from services.worker.settings import WorkerSettings

    settings = WorkerSettings(model=model, dtype="float32", kv_cache_gib=0.25, num_threads=num_threads)
    sys.setswitchinterval(settings.gil_switch_interval_s)  # as WorkerService.start does
    with tempfile.TemporaryDirectory() as sessions:
        llm = AsyncLLM(settings.engine_config(sessions))
        await llm.start()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompt = await llm.encode(ChatPrompt([{"role": "user", "content": PROMPT}]))
        ttfts, itls = [], []
        for i in range(requests + WARMUP):
            t0 = time.perf_counter()
            times = []
            async for d in llm.generate(f"b{i}", prompt, params):
                times += [time.perf_counter()] * len(d.token_ids)
            if i >= WARMUP:
                ttfts.append(times[0] - t0)
                itls += [b - a for a, b in zip(times, times[1:])]
        await llm.shutdown()
    import torch

    return {
        "ttfts_s": ttfts,
        "itls_s": itls,
        "runtime": {
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gil_switch_interval_s": sys.getswitchinterval(),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--num-threads", type=int, required=True)
    a = ap.parse_args()
    from services import lifeline

    lifeline.adopt_parent()  # stops with the benchmark that started it
    import uvloop  # the worker's event loop (services/runtime.py)

    print(json.dumps(uvloop.run(measure(a.model, a.requests, a.max_tokens, a.num_threads))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
