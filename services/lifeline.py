"""Nothing outlives its parent: the tie between a process that starts children and those children.

A `tandem bench sessions` stopped by `timeout` (SIGTERM) used to leave its whole stack running,
and a `tandem up` killed with SIGKILL still does unless its children notice. Two halves:

Parent side
  `tied_env(env)` marks a child's environment with the parent's pid (`TANDEM_PARENT_PID`);
  `tied_argv(argv)` wraps a program that is not ours (the tansu broker) in this module's own
  small launcher, which ties it the same way before it becomes that program.

Child side
  `adopt_parent()` reads (and removes, so grandchildren do not inherit it) the pid and, on Linux,
  asks the kernel for SIGTERM when the parent dies (`PR_SET_PDEATHSIG`, via ctypes). The kernel
  signal is immediate but Linux-only and tied to the thread that forked, so a watcher thread also
  polls `os.getppid()`: once the process has been re-parented (to init or a subreaper) the parent
  is gone, and it sends the process SIGTERM itself. Either way the process takes its ordinary
  SIGTERM path (a service's clean stop, uvicorn's graceful shutdown, `up` stopping its children),
  so nothing here needs to know what kind of process it is in.

Decision: a process watches its parent only when that parent asked (set `TANDEM_PARENT_PID`).
A user's `nohup tandem up &` or a systemd unit must keep running when the shell that started it
exits, so "my parent died" is not a reason to stop unless the parent said so. A child that was
orphaned gets `ORPHAN_STOP_S` to stop cleanly and then exits hard: nobody is left to kill it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PARENT_PID_ENV = "TANDEM_PARENT_PID"
# How often the portable watch looks at its parent pid: the kernel signal is immediate where it
# exists; elsewhere a stack's children notice within this.
WATCH_INTERVAL_S = 0.5
# An orphan's clean stop (a worker saving sessions, a broker client flushing) normally takes a
# few seconds; a stop that hangs must not leave the orphan running for good.
ORPHAN_STOP_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def tied_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that must stop when this process dies."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def tied_argv(argv: list[str]) -> list[str]:
    """`argv` of a foreign program (no `adopt_parent` of its own) wrapped so it dies with us.

    The launcher needs `tied_env` too: it reads the parent pid from there."""
    return [sys.executable, "-m", "services.lifeline", *argv]


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for `sig` when the parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def adopt_parent(on_lost: Callable[[], None] | None = None) -> int | None:
    """Tie this process to the parent that asked for it; the parent's pid, or None (started freely).

    Reads and removes `TANDEM_PARENT_PID`, arms the kernel's parent-death signal and starts the
    watcher (`on_lost` as in `watch_parent`). A parent that died before this (between fork and
    here) is noticed by the watcher's first look."""
    raw = os.environ.pop(PARENT_PID_ENV, None)
    if not raw:
        return None
    try:
        parent = int(raw)
    except ValueError:
        log.warning("ignoring %s=%r (not a pid)", PARENT_PID_ENV, raw)
        return None
    die_with_parent()
    threading.Thread(target=watch_parent, args=(parent, on_lost), name="parent-watch", daemon=True).start()
    return parent


def orphaned(parent: int | None) -> bool:
    return parent is not None and os.getppid() != parent


def watch_parent(parent: int, on_lost: Callable[[], None] | None = None) -> None:
    """Blocks until this process has been re-parented (its parent died), then calls `on_lost`
    (default: stop this process with SIGTERM, exiting hard if that stop hangs)."""
    while not orphaned(parent):
        time.sleep(WATCH_INTERVAL_S)
    (on_lost or _stop_orphan)()


def _stop_orphan() -> None:
    _say(f"lifeline: parent process is gone; stopping (at most {ORPHAN_STOP_S:.0f}s)\n")
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM after the kernel's is harmless
    time.sleep(ORPHAN_STOP_S)  # nobody is left to kill an orphan whose clean stop hangs
    _say("lifeline: the clean stop hung; exiting\n")
    os._exit(1)


def _say(text: str) -> None:
    """Best effort: stderr is often a pipe to the parent that just died (`tandem up` reads its
    children's output), and a BrokenPipeError here used to end this thread before its hard exit."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP in a one-shot command: unwinds like Ctrl-C, so `finally` blocks (which stop
    a benchmark's stack) run; the command exits 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise `Terminated` in the main thread (one-shot commands).

    Long-lived services and `tandem up` install their own loop handlers over this."""

    def _raise(signum: int, _frame) -> None:
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def _launch(argv: list[str]) -> int:
    """The launcher behind `tied_argv`: become `argv`, tied to our parent.

    With the kernel signal the launcher simply execs the program (the signal survives exec);
    without it, it stays as the program's parent, forwards SIGTERM/SIGINT/SIGHUP to it, and stops
    it when its own parent is gone."""
    if sys.platform.startswith("linux"):
        adopt_parent()  # the watcher thread ends with exec; the kernel signal stays
        os.execvp(argv[0], argv)
    child = subprocess.Popen(argv)

    def stop_child() -> None:
        child.terminate()
        try:
            child.wait(ORPHAN_STOP_S)
        except subprocess.TimeoutExpired:
            child.kill()

    adopt_parent(on_lost=stop_child)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    return child.wait()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m services.lifeline PROGRAM [ARGS...]")
    sys.exit(_launch(sys.argv[1:]))
