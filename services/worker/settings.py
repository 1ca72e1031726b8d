"""The worker's one settings object (`TANDEM_*` env vars; `tandem worker` flags override).

The engine's fields are not copied here: every `EngineConfig` field becomes a field of the same
name, type and default (`TANDEM_DTYPE`, `TANDEM_KV_CACHE_GIB`, `TANDEM_BLOCK_SIZE`, ...), so a
new engine option reaches workers without a second definition to keep in step, and
`engine_config()` hands them back. The one exception is `session_dir`, whose default the
worker derives from its data directory and id.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Literal

from pydantic import SecretStr, create_model

from engine.config import EngineConfig
from shared.settings import ServiceSettings

_WORKER_DECIDES = frozenset({"session_dir"})  # engine fields with a worker-specific meaning


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tandem")


def _engine_fields() -> dict[str, tuple[object, object]]:
    hints = typing.get_type_hints(EngineConfig)
    return {
        f.name: (hints[f.name], f.default) for f in dataclasses.fields(EngineConfig) if f.name not in _WORKER_DECIDES
    }


# ServiceSettings plus one field per EngineConfig field (pydantic builds the class from the dataclass).
_EngineSettings = create_model("_EngineSettings", __base__=ServiceSettings, **_engine_fields())


class WorkerSettings(_EngineSettings):
    worker_id: str = ""  # default: host-pid-random, unique per process start
    served_model_name: str = ""  # the id clients send; default: "default" or the path's last part
    # Telemetry is looked at every `telemetry_interval_s` but sent only when it says something new
    # (load, KV, finished requests, tokens) or `telemetry_keepalive_s` passed: its readers keep the
    # latest report without judging its age, so an idle worker's unchanged report every second only
    # woke them; the keepalive is for a reader that started since (it reads from the topic's end).
    telemetry_interval_s: float = 1.0
    # An `Accepted` waits this long for the request's first delta to leave with it as one message
    # (services/worker/outbox.py): the gateway's response headers come at most this much later
    # on a long prefill, and the first token's path carries one Kafka message instead of two.
    accept_hold_s: float = 0.01
    # Accepted dispatches are committed this long after they were read, not at once, so the
    # commit's round trip does not share the event loop with the first engine step
    # (WorkerService._commit_dispatches).
    dispatch_commit_delay_s: float = 0.05
    telemetry_keepalive_s: float = 10.0
    gil_switch_interval_s: float = 0.0005  # see WorkerService.start
    drain_timeout_s: float = 10.0  # on SIGTERM: how long running requests may finish
    # multi-turn sessions (docs/sessions.md): kept KV tiers, and the KV server peers pull from
    data_dir: str = _default_data_dir()  # the worker's state lives in <data_dir>/workers/<worker id>/
    session_dir: str = ""  # the disk tier; default <data_dir>/workers/<worker id>/sessions (kept across restarts
    #                        when the worker id is fixed, as `tandem up` and Compose do)
    kv_host: str = "127.0.0.1"  # the KV server's bind address
    kv_port: int = 0  # 0: any free port
    kv_advertise_url: str = ""  # how peers reach the KV server (default http://<kv_host>:<port>)
    # Shared by every worker of a deployment: KV servers serve only requests signed with it
    # (services/worker/kv_auth.py). Empty: open, for one machine on loopback.
    cluster_secret: SecretStr = SecretStr("")
    kv_pull_timeout_s: float = 30.0  # a pull (or a turn waiting for one) gives up after this
    # A turn that lands without its KV (and no prefetch brought it): pull it from the holder when the
    # engine's cost model says that beats recomputing ("cost"), or always / never (ablations, tests).
    session_pull: Literal["cost", "always", "never"] = "cost"

    def resolved_session_dir(self, worker_id: str) -> Path:
        if self.session_dir:
            return Path(self.session_dir).expanduser()
        return Path(self.data_dir).expanduser() / "workers" / worker_id / "sessions"

    def engine_config(self, session_dir: Path) -> EngineConfig:
        """The engine this worker runs: every engine field as set here, sessions kept in `session_dir`."""
        fields = {name: getattr(self, name) for name in _engine_fields()}
        return EngineConfig(**fields, session_dir=str(session_dir))
