"""The batch store on a real PostgreSQL server: a job completes and a cancel lands, with the gateway
and the queue service sharing the database through `TANDEM_DATABASE_URL` (asyncpg).

A throwaway cluster is created with Debian's `initdb`/`pg_ctl` (`make test` installs the
`postgresql` package when missing). Skipped, saying why, only where no server can be started.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from services.broker import free_port
from tests.services.conftest import openai_client
from tests.services.test_batch_api import chat_lines, read_lines, submit, wait_final, wait_until

pytestmark = pytest.mark.timeout(400)


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def _as_postgres_user(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@pytest.fixture(scope="module")
def postgres_url():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL is not installed (initdb/pg_ctl not found); `make test` installs it")
    data = Path(tempfile.mkdtemp(prefix="tandem-pg-"))  # not under pytest's root-only tmp dir
    if os.geteuid() == 0:  # the server refuses to run as root
        shutil.chown(data, "postgres")
    port = free_port()
    try:
        subprocess.run(
            _as_postgres_user([initdb, "-D", str(data), "-A", "trust", "-U", "tandem"]),
            check=True,
            capture_output=True,
            timeout=300,
        )
        subprocess.run(
            _as_postgres_user(
                [
                    pg_ctl,
                    "-D",
                    str(data),
                    "-l",
                    str(data / "server.log"),
                    "-w",
                    # pg_ctl's own wait for the server is 60 s by default: a start slower than
                    # that on a starved host made the module skip (the except below), silently
                    "-t",
                    "300",
                    "start",
                    "-o",
                    f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=360,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"a PostgreSQL server could not be started here: {exc} {detail.decode(errors='replace')}")
    yield f"postgresql+asyncpg://tandem@127.0.0.1:{port}/postgres"
    subprocess.run(
        _as_postgres_user([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), capture_output=True, timeout=60
    )
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(make_stack, postgres_url):
    return make_stack(TANDEM_DATABASE_URL=postgres_url, TANDEM_BE_PER_WORKER=6).start(queue=True)


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


def test_job_completes_on_postgresql(stack, client):
    assert not (stack.log_dir / "data" / "tandem.db").exists()  # nothing went to SQLite
    lines = chat_lines(30, prefix="pg")
    done = wait_final(client, submit(client, lines).id, stack)
    assert done.status == "completed" and done.request_counts.completed == 30
    assert sorted(o["custom_id"] for o in read_lines(client, done.output_file_id)) == sorted(
        ln["custom_id"] for ln in lines
    )


def test_cancel_on_postgresql(stack, client):
    batch = submit(client, chat_lines(30, max_tokens=300, prefix="pgc"))
    wait_until(client, batch.id, 1, stack)
    client.batches.cancel(batch.id)
    done = wait_final(client, batch.id, stack)
    c = done.request_counts
    assert done.status == "cancelled" and c.completed >= 1 and c.completed + c.failed == 30
    assert len(read_lines(client, done.error_file_id)) == 30 - c.completed
