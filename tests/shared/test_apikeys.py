"""API keys in the batch database (shared/apikeys) and `tandem keys`: format, hashing, the
store, and the in-place upgrade of a database made before keys and owners existed."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from shared.apikeys.keys import KeyLimits, hash_key, key_id_of, key_matches, parse_classes
from shared.apikeys.store import KeyStore
from shared.batchstore.api_store import BatchAPIStore
from shared.batchstore.db import BatchDatabase

pytestmark = pytest.mark.timeout(300)


def test_key_format_and_check():
    from shared.apikeys.keys import new_secret_key

    key = new_secret_key("0123456789ab")
    assert key.startswith("sk-tandem-0123456789ab-") and len(key) > 60
    assert key_id_of(key) == "0123456789ab"
    for bad in ("", "unused", "sk-tandem-", "sk-tandem-0123456789ab", "sk-tandem-0123456789ab-", "sk-tandem-XYZ"):
        assert key_id_of(bad) is None, bad
    assert key_matches(key, hash_key(key)) and not key_matches(key + "x", hash_key(key))
    assert parse_classes("be, RT") == ("be", "rt")
    for bad in ("", "gold", "rt,gold"):
        with pytest.raises(ValueError):
            parse_classes(bad)
    with pytest.raises(ValueError):
        KeyLimits(requests_per_s=0)


def _db(tmp_path) -> BatchDatabase:
    return BatchDatabase(f"sqlite+aiosqlite:///{tmp_path / 'tandem.db'}")


def test_store_create_list_revoke(tmp_path):
    async def main():
        db = _db(tmp_path)
        await db.start()
        store = KeyStore(db)
        assert not await store.any_keys()
        key, secret = await store.create("alice", KeyLimits(2.0, 1000, None), ("rt", "be"))
        other, _ = await store.create("batch-bot", KeyLimits(), ("be",), admin=True)
        assert await store.any_keys()
        found, stored_hash = await store.get(key.id)
        assert found == key and key_matches(secret, stored_hash)
        assert (found.limits.requests_per_s, found.limits.tokens_per_min, found.limits.batch_quota) == (2.0, 1000, None)
        assert other.default_class == "be" and key.default_class == "rt" and other.admin and not key.admin
        assert key.cache_salt != other.cache_salt and len(key.cache_salt) == 32
        revoked = await store.revoke(key.id)
        assert not revoked.active and revoked.revoked_at is not None
        assert await store.revoke("nope") is None
        assert [k.id for k in await store.list_keys()] == [other.id]
        assert [k.id for k in await store.list_keys(include_revoked=True)] == [key.id, other.id]
        assert await store.any_keys()  # revoking keys never reopens the stack
        await db.close()
        return secret

    secret = asyncio.run(main())
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # the database and its WAL
    assert secret.encode() not in raw and secret.split("-")[-1].encode() not in raw  # only its hash is stored


def test_database_from_before_keys_is_upgraded_in_place(tmp_path):
    async def make_old():
        db = _db(tmp_path)
        await db.start()
        await BatchAPIStore(db).add_file(b'{"a": 1}\n', "old.jsonl", "batch")
        await db.close()

    asyncio.run(make_old())
    con = sqlite3.connect(tmp_path / "tandem.db")  # take the database back to its pre-keys schema
    con.executescript(
        """
        DROP INDEX ix_tandem_files_owner; DROP INDEX ix_tandem_batches_owner;
        ALTER TABLE tandem_files DROP COLUMN owner; ALTER TABLE tandem_files DROP COLUMN requests;
        ALTER TABLE tandem_batches DROP COLUMN owner; DROP TABLE tandem_api_keys;
        """
    )
    con.close()

    async def upgrade():
        db = _db(tmp_path)
        await db.start()
        store = BatchAPIStore(db)
        rows, _ = await store.list_files(None, 10, None)
        assert [r.filename for r in rows] == ["old.jsonl"] and rows[0].owner is None
        key, _ = await KeyStore(db).create("k", KeyLimits(), ("rt", "be"))
        mine = await store.add_file(b"x\n\n y\n", "mine.jsonl", "batch", owner=key.id)
        assert mine.requests == 2
        assert [r.id for r in (await store.list_files(None, 10, None, owner=key.id))[0]] == [mine.id]
        assert await store.get_file(mine.id) is None  # not visible without its owner
        await db.close()

    asyncio.run(upgrade())
    con = sqlite3.connect(tmp_path / "tandem.db")
    assert {"owner", "requests"} <= {r[1] for r in con.execute("PRAGMA table_info(tandem_files)")}
    con.close()


# `tandem keys` is a cold start of the CLI each time: ~0.8 CPU-s quiet (the interpreter, and the
# whole `tandem` parser: every subcommand's module is imported to register it, loadgen's and
# sqlalchemy included; no torch). The test runs nine, ~7 CPU-s: at load 50 on two cores a process
# gets a twenty-fifth of a core, ~3 minutes, which overran the 120 s this test had. The bounds
# are safety nets for a hang, sized for that starved host.
CLI_TIMEOUT_S = 300


def _tandem(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path), "TANDEM_DATABASE_URL": ""}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "keys", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=CLI_TIMEOUT_S,
    )


@pytest.mark.timeout(900)
def test_cli_create_list_revoke(tmp_path):
    created = _tandem(tmp_path, "create", "--name", "ci", "--rps", "5", "--classes", "be", "--json")
    assert created.returncode == 0, created.stderr
    record = json.loads(created.stdout)
    assert record["key"].startswith("sk-tandem-") and record["classes"] == ["be"] and record["requests_per_s"] == 5
    plain = _tandem(tmp_path, "create", "--name", "second")
    assert plain.stdout.splitlines()[0].startswith("sk-tandem-") and "not shown again" in plain.stdout
    listed = _tandem(tmp_path, "list")
    assert record["id"] in listed.stdout and "sk-tandem" not in listed.stdout
    assert _tandem(tmp_path, "revoke", record["key"]).returncode == 0  # by the key itself, or by id
    assert [k["id"] for k in json.loads(_tandem(tmp_path, "list", "--json").stdout)] != [record["id"]]
    assert json.loads(_tandem(tmp_path, "list", "--all", "--json").stdout)[0]["revoked_at"] is not None
    bad = _tandem(tmp_path, "create", "--name", "x", "--tpm", "-1")
    assert bad.returncode == 2 and "tandem: error: tokens_per_min must be positive" in bad.stderr
    assert _tandem(tmp_path, "revoke", "nope").returncode == 2
