"""The worker's one settings object (`TANDEM_*` env vars; `tandem worker` flags override)."""
from __future__ import annotations

from shared.settings import ServiceSettings


class WorkerSettings(ServiceSettings):
    worker_id: str = ""  # default: host-pid-random, unique per process start
    model: str = "default"  # "default", a Hugging Face directory or a .gguf file
    served_model_name: str = ""  # the id clients send; default: "default" or the path's last part
    device: str = "cpu"
    dtype: str = "bfloat16"
    kv_cache_gib: float = 1.0
    policy: str = "fcfs"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    num_threads: int | None = None
    telemetry_interval_s: float = 1.0
    gil_switch_interval_s: float = 0.0005  # see WorkerService.start
    drain_timeout_s: float = 10.0  # on SIGTERM: how long running requests may finish
