"""Key management over HTTP for admin keys: `GET/POST /v1/keys`, `DELETE /v1/keys/{id}`.

The same operations as `tandem keys list|create|revoke` (the same store), for platforms that
provision tenants from code. Only a key created with `--admin` (or `"admin": true` by another
admin) may call them; on an open stack nobody may (the first key comes from the CLI, run by
whoever can reach the database), so the HTTP API can never be used to lock its owners out.
`POST` answers the new key once, in `key`; nothing else ever shows it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.auth import Authenticator, caller_of
from services.gateway.database import GatewayDatabase
from services.gateway.errors import APIError, parse_json_body
from shared.apikeys.keys import SERVICE_CLASSES, KeyLimits
from shared.apikeys.store import KeyStore

MAX_KEY_BODY_BYTES = 4096


class KeyCreateRequest(BaseModel):
    """`POST /v1/keys`: a new key's name, limits (absent: unlimited), classes and admin flag."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: int | None = Field(None, gt=0)
    batch_quota: int | None = Field(None, gt=0)
    classes: list[str] = Field(default_factory=lambda: list(SERVICE_CLASSES), min_length=1, max_length=2)
    admin: bool = False


def register_keys_api(app: FastAPI, db: GatewayDatabase, auth: Authenticator) -> None:
    api = _KeysAPI(db, auth)
    app.get("/v1/keys")(api.list_keys)
    app.post("/v1/keys")(api.create_key)
    app.delete("/v1/keys/{key_id}")(api.revoke_key)


class _KeysAPI:
    def __init__(self, db: GatewayDatabase, auth: Authenticator) -> None:
        self.db, self.auth = db, auth

    async def _store(self, request: Request) -> KeyStore:
        key = caller_of(request).key
        if key is None or not key.admin:
            raise APIError(
                403,
                "managing keys needs an admin API key (`tandem keys create --name NAME --admin`)",
                code="admin_required",
            )
        return KeyStore(await self.db.get())

    async def list_keys(self, request: Request, include_revoked: bool = False) -> dict:
        keys = await (await self._store(request)).list_keys(include_revoked)
        return {"object": "list", "data": [k.public() for k in keys]}

    async def create_key(self, request: Request) -> dict:
        store = await self._store(request)
        body = parse_json_body(await request.body(), KeyCreateRequest, MAX_KEY_BODY_BYTES)
        bad = sorted(set(body.classes) - set(SERVICE_CLASSES))
        if bad:
            raise APIError(400, f"classes must be among {list(SERVICE_CLASSES)}", param="classes", code="invalid_value")
        limits = KeyLimits(body.requests_per_s, body.tokens_per_min, body.batch_quota)
        classes = tuple(dict.fromkeys(body.classes))
        key, secret = await store.create(body.name, limits, classes, body.admin)
        return {**key.public(), "key": secret}

    async def revoke_key(self, key_id: str, request: Request) -> dict:
        key = await (await self._store(request)).revoke(key_id)
        if key is None:
            raise APIError(404, f"No such API key: {key_id}", param="key_id", code="not_found")
        self.auth.keys.forget(key_id)  # this replica refuses it at once; others within their TTL
        return key.public()
