"""`tandem batch submit FILE [--wait]`: upload a JSONL file, create a batch, follow it, fetch the output.

Talks to the gateway's OpenAI-compatible Files and Batches API over HTTP (httpx), so it works
against any deployment, and against OpenAI itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

FINAL = {"completed", "failed", "expired", "cancelled"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="submit and follow batch jobs (OpenAI Batch API)",
        description="Submit a JSONL file of requests as a batch job.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    s = actions.add_parser("submit", help="upload FILE, create a batch, optionally wait and download the output")
    s.add_argument("file", type=Path)
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default: %(default)s)")
    s.add_argument("--endpoint", help="default: the url of the file's first line")
    s.add_argument("--completion-window", default="24h")
    s.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--wait", action="store_true", help="show progress until done, then write the output file")
    s.add_argument("--output", type=Path, help="where --wait writes results (default: FILE.output.jsonl)")
    s.add_argument("--poll-interval", type=float, default=1.0)
    s.set_defaults(func=run_submit)


def run_submit(args: argparse.Namespace) -> int:
    import httpx

    if not args.file.is_file():
        raise ValueError(f"{args.file} is not a file")
    endpoint = args.endpoint or _first_url(args.file)
    with httpx.Client(base_url=args.url.rstrip("/") + "/v1", timeout=60) as client:
        with args.file.open("rb") as fh:
            f = _check(client.post("/files", data={"purpose": "batch"}, files={"file": (args.file.name, fh)}))
        batch = _check(
            client.post(
                "/batches",
                json={
                    "input_file_id": f["id"],
                    "endpoint": endpoint,
                    "completion_window": args.completion_window,
                    "metadata": _metadata(args.metadata) or None,
                },
            )
        )
        print(f"batch {batch['id']} created ({batch['status']})", file=sys.stderr)
        if not args.wait:
            print(batch["id"])
            return 0
        batch = _follow(client, batch["id"], args.poll_interval)
        return _finish(client, batch, args.output or args.file.with_suffix(".output.jsonl"))


def _first_url(path: Path) -> str:
    with path.open() as fh:
        for line in fh:
            if line.strip():
                try:
                    return json.loads(line)["url"]
                except (ValueError, KeyError, TypeError):
                    break
    raise ValueError(f"cannot tell the endpoint from the first line of {path}; pass --endpoint")


def _metadata(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--metadata takes KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


def _check(response) -> dict:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ValueError(f"{response.request.method} {response.request.url.path}: {response.status_code} {message}")
    return response.json()


def _follow(client, batch_id: str, interval: float) -> dict:
    from tqdm import tqdm

    with tqdm(desc=batch_id[:18], unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        while True:
            batch = _check(client.get(f"/batches/{batch_id}"))
            counts = batch["request_counts"]
            bar.total = counts["total"] or None
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix(status=batch["status"], failed=counts["failed"], refresh=False)
            bar.refresh()
            if batch["status"] in FINAL:
                return batch
            time.sleep(interval)


def _finish(client, batch: dict, output: Path) -> int:
    status = batch["status"]
    if batch.get("errors"):
        for e in batch["errors"]["data"]:
            where = f"line {e['line']}: " if e.get("line") else ""
            print(f"  {where}{e['code']}: {e['message']}", file=sys.stderr)
    if batch.get("output_file_id"):
        output.write_bytes(client.get(f"/files/{batch['output_file_id']}/content").content)
        print(f"results written to {output}", file=sys.stderr)
    if batch.get("error_file_id"):
        errors = output.with_name(output.name.replace(".jsonl", "") + ".errors.jsonl")
        errors.write_bytes(client.get(f"/files/{batch['error_file_id']}/content").content)
        print(f"failed requests written to {errors}", file=sys.stderr)
    c = batch["request_counts"]
    print(
        f"batch {batch['id']} {status}: {c['completed']} completed, {c['failed']} failed of {c['total']}",
        file=sys.stderr,
    )
    return 0 if status == "completed" else 1
