"""Worker join probe (docs/results/cplane/worker-join.json): run from the repository root as
`python docs/results/cplane/worker-join-probe.py N`. Starts a broker, then N times a scheduler,
a gateway and a tiny-model worker; prints the worker's log (its 'engine ready' and 'serving'
lines give the join time) and the time from 'serving' to the first token of a request sent as
soon as the gateway and the scheduler see the worker. Uses the test stack's helpers."""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")
import httpx  # noqa: E402

from loadgen.bench.gateway import _tiny_model  # noqa: E402
from services.broker import start_broker  # noqa: E402
from tests.services.conftest import Stack, chat_body  # noqa: E402

out = []
with tempfile.TemporaryDirectory() as tmp:
    model = Path(_tiny_model(tmp))
    proc, bootstrap = start_broker(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for i in range(int(sys.argv[1])):
            logdir = Path(tmp) / f"s{i}"
            logdir.mkdir()
            stack = Stack(bootstrap, model, logdir, f"join{i}")
            stack.scheduler()
            stack.gateway()
            stack.wait_gateway()
            stack.worker("w0")
            stack.wait_log("w0", "serving")
            t0 = time.monotonic()
            stack.wait_workers(1)
            seen = time.monotonic() - t0
            body = chat_body("hi", max_tokens=2, stream=True)
            with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        break
            out.append(
                {"seen_by_gateway_and_scheduler_s": round(seen, 3), "first_token_s": round(time.monotonic() - t0, 3)}
            )
            print((logdir / "w0.log").read_text()[-3000:])
            stack.stop()
    finally:
        proc.kill()
        proc.wait()
print(json.dumps(out))
