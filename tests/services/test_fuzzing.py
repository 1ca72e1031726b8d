"""Schemathesis against a live stack (issue 22): every operation of `/openapi.json`, stateful
(upload -> batch -> retrieve -> cancel -> content, key create -> revoke, through the document's
links), with a real broker, a tiny worker and the batch queue. Asserts no 5xx, no hang (a
request that takes longer than the request timeout fails the run) and answers that match the
declared schemas. The example count is bounded so the run stays within a minute or two here."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.services.test_api_keys import create_key

pytestmark = pytest.mark.timeout(900)
MAX_EXAMPLES = 25
REQUEST_TIMEOUT_S = 60  # far above any answer here: only a hang reaches it


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack(TANDEM_MAX_FILE_BYTES=100_000, TANDEM_MAX_BATCH_LINES=50)
    s.log_dir.joinpath("data").mkdir(exist_ok=True)
    s.admin_key = create_key(s, "fuzzer", "--admin")  # an admin key reaches /v1/keys too
    return s.start(("w0",), queue=True)


def test_schemathesis_finds_no_server_error_and_no_hang(stack):
    report_dir = stack.log_dir / "schemathesis"
    schema_file = stack.log_dir / "openapi.json"
    schema_file.write_text(json.dumps(_with_served_model(httpx.get(f"{stack.url}/openapi.json", timeout=60).json())))
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        str(schema_file),
        "--url",
        stack.url,
        "--header",
        f"Authorization: Bearer {stack.admin_key['key']}",
        "--checks",
        "not_a_server_error,response_schema_conformance",
        "--phases",
        "examples,fuzzing,stateful",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        "--workers",
        "1",
        "--seed",
        "22",
        "--report",
        "ndjson",
        "--report-dir",
        str(report_dir),
        "--no-color",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=800, env=stack.env, cwd=stack.log_dir)
    (stack.log_dir / "schemathesis.log").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, f"{run.stdout[-8000:]}\n{run.stderr[-4000:]}\n{stack.logs()}"
    statuses = _statuses(report_dir)
    assert statuses, run.stdout[-4000:]
    assert not [s for s in statuses if s >= 500], run.stdout[-8000:]
    # the stateful phase went past the upload: batches were created and read back by their real ids
    assert "Stateful" in run.stdout, run.stdout[-4000:]


def _with_served_model(doc: dict) -> dict:
    """The document with `model` pinned to the served one, so generated requests reach the
    worker instead of stopping at a 404 `model_not_found` (test data, as a fuzzer is given ids)."""
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[name]["properties"]["model"] = {"const": "tiny", "type": "string"}
    return doc


def _statuses(report_dir) -> list[int]:
    """Every HTTP status the run received, from its ndjson event log."""
    statuses: list[int] = []
    for path in report_dir.glob("*.ndjson"):
        for line in path.read_text().splitlines():
            _collect(json.loads(line), statuses)
    return statuses


def _collect(node, out: list[int]) -> None:
    if isinstance(node, dict):
        status = node.get("status_code")
        if isinstance(status, int) and "elapsed" in node:
            out.append(status)
        for value in node.values():
            _collect(value, out)
    elif isinstance(node, list):
        for value in node:
            _collect(value, out)
