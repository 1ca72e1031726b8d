"""Base class for wire messages: pydantic models, JSON on the wire, with a schema version.

Readers accept any message whose major `schema_version` they know; fields added later must have
defaults so older producers stay readable (pydantic ignores unknown fields from newer ones).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 1

M = TypeVar("M", bound="WireModel")


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = SCHEMA_VERSION

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        msg = cls.model_validate_json(data)
        if msg.schema_version > SCHEMA_VERSION:
            raise ValueError(f"{cls.__name__} schema_version {msg.schema_version} is newer than {SCHEMA_VERSION}")
        return msg
