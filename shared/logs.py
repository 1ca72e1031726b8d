"""Structured logs: `time level service [request_id] message`, or one JSON object per line.

Pass request ids as `log.info("...", extra={"request_id": rid})`; the formatter shows them.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class _TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"{ts} {record.levelname:<7} {self.service}{f' [{rid}]' if rid else ''} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": record.created,
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            obj["request_id"] = rid
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def configure_logging(service: str, level: str = "INFO", as_json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(service) if as_json else _TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
