"""The worker's one settings object (`TANDEM_*` env vars; `tandem worker` flags override)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from shared.settings import ServiceSettings


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tandem")


class WorkerSettings(ServiceSettings):
    worker_id: str = ""  # default: host-pid-random, unique per process start
    model: str = "default"  # "default", a Hugging Face directory or a .gguf file
    load_format: str = "auto"  # "dummy": random weights; `model` may then name a built-in architecture
    served_model_name: str = ""  # the id clients send; default: "default" or the path's last part
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 where the CPU (or GPU) computes it natively, else float32
    kv_cache_gib: float = 1.0
    policy: str = "fcfs"
    uncached_ratio: float = 0.0  # partial KV residency (eLLM, docs/ellm.md): 0 = off; EngineConfig checks it
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    num_threads: int | None = None
    attention: str = "auto"  # attention kernel: auto, fused (CPU), triton or reference (EngineConfig.attention)
    compile_layers: bool = True  # with fused attention: decode-only steps through compiled layers (EngineConfig)
    telemetry_interval_s: float = 1.0
    gil_switch_interval_s: float = 0.0005  # see WorkerService.start
    drain_timeout_s: float = 10.0  # on SIGTERM: how long running requests may finish
    enable_prefix_caching: bool = True  # false: every prompt is computed in full (a benchmark baseline)
    # multi-turn sessions (docs/sessions.md): kept KV tiers, and the KV server peers pull from
    data_dir: str = _default_data_dir()  # the worker's state lives in <data_dir>/workers/<worker id>/
    session_dir: str = ""  # the disk tier; default <data_dir>/workers/<worker id>/sessions (kept across restarts
    #                        when the worker id is fixed, as `tandem up` and Compose do)
    session_host_gib: float = 1.0
    session_disk_gib: float = 20.0
    session_eviction: str = "idle-layer-size"
    session_prefetch_ttl_s: float = 30.0  # a prefetched session's pin is dropped if its turn has not come
    kv_host: str = "127.0.0.1"  # the KV server's bind address
    kv_port: int = 0  # 0: any free port
    kv_advertise_url: str = ""  # how peers reach the KV server (default http://<kv_host>:<port>)
    kv_pull_timeout_s: float = 30.0  # a pull (or a turn waiting for one) gives up after this
    # A turn that lands without its KV (and no prefetch brought it): pull it from the holder when the
    # engine's cost model says that beats recomputing ("cost"), or always / never (ablations, tests).
    session_pull: Literal["cost", "always", "never"] = "cost"

    def resolved_session_dir(self, worker_id: str) -> Path:
        if self.session_dir:
            return Path(self.session_dir).expanduser()
        return Path(self.data_dir).expanduser() / "workers" / worker_id / "sessions"
