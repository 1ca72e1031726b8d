"""The keys table: create (the key is returned once), list, revoke, look up by id.

A revoked key keeps its row (`revoked_at` set): its batches and files stay owned by it, and
"any key exists" stays true, so revoking the last key never reopens the stack.
"""

from __future__ import annotations

from sqlalchemy import exists, select, update

from shared.apikeys.keys import ApiKey, KeyLimits, hash_key, new_cache_salt, new_key_id, new_secret_key
from shared.batchstore.db import BatchDatabase, KeyRow, now


class KeyStore:
    def __init__(self, db: BatchDatabase) -> None:
        self.session = db.session

    async def create(
        self, name: str, limits: KeyLimits, classes: tuple[str, ...], admin: bool = False
    ) -> tuple[ApiKey, str]:
        """A new key: its record and the key itself (the only time it is ever available)."""
        if not name or len(name) > 128:
            raise ValueError("a key name must have 1 to 128 characters")
        key_id = new_key_id()
        secret = new_secret_key(key_id)
        row = KeyRow(
            id=key_id,
            name=name,
            secret_hash=hash_key(secret),
            created_at=now(),
            revoked_at=None,
            requests_per_s=limits.requests_per_s,
            tokens_per_min=limits.tokens_per_min,
            batch_quota=limits.batch_quota,
            classes=",".join(classes),
            admin=admin,
            cache_salt=new_cache_salt(),
        )
        async with self.session.begin() as s:
            s.add(row)
        return _key(row), secret

    async def get(self, key_id: str) -> tuple[ApiKey, str] | None:
        """A key and its stored hash, revoked or not."""
        async with self.session() as s:
            row = (await s.execute(select(KeyRow).where(KeyRow.id == key_id))).scalar_one_or_none()
        return None if row is None else (_key(row), row.secret_hash)

    async def list_keys(self, include_revoked: bool = False) -> list[ApiKey]:
        async with self.session() as s:
            q = select(KeyRow).order_by(KeyRow.seq)
            if not include_revoked:
                q = q.where(KeyRow.revoked_at.is_(None))
            return [_key(r) for r in (await s.execute(q)).scalars()]

    async def revoke(self, key_id: str) -> ApiKey | None:
        """Revoke (idempotent); None when there is no such key."""
        async with self.session.begin() as s:
            await s.execute(
                update(KeyRow).where(KeyRow.id == key_id, KeyRow.revoked_at.is_(None)).values(revoked_at=now())
            )
            row = (await s.execute(select(KeyRow).where(KeyRow.id == key_id))).scalar_one_or_none()
        return None if row is None else _key(row)

    async def any_keys(self) -> bool:
        """Whether a key was ever created here (revoked ones count): the stack is then closed."""
        async with self.session() as s:
            return bool((await s.execute(select(exists().where(KeyRow.seq.is_not(None))))).scalar())


def _key(row: KeyRow) -> ApiKey:
    return ApiKey(
        id=row.id,
        name=row.name,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        limits=KeyLimits(row.requests_per_s, row.tokens_per_min, row.batch_quota),
        classes=tuple(row.classes.split(",")),
        admin=bool(row.admin),
        cache_salt=row.cache_salt,
    )
