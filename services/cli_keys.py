"""`tandem keys create|list|revoke`: API keys in the batch database the gateway reads.

Works against the same database as the gateway (`TANDEM_DATABASE_URL`, or SQLite under
`TANDEM_DATA_DIR`); a running gateway sees a new key at once and a revoke within its key cache
TTL (`TANDEM_KEY_CACHE_TTL_S`, 2 s). `create` prints the key once: only its hash is stored.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keys",
        help="create, list or revoke API keys",
        description="Manage the gateway's API keys (stored hashed in the batch database). "
        "Once any key exists, every /v1 request needs one (Authorization: Bearer <key>).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    create = actions.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", required=True, help="what the key is for (shown by `list`)")
    create.add_argument("--rps", type=float, default=None, help="requests per second (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="tokens (prompt + completion) per minute")
    create.add_argument("--batch-quota", type=int, default=None, help="requests in unfinished batches at once")
    create.add_argument("--classes", default="rt,be", help="allowed service classes: rt,be (default), rt or be")
    create.add_argument("--admin", action="store_true", help="may also manage keys over HTTP (/v1/keys)")
    create.add_argument("--json", action="store_true", help="print the key's record with the key as JSON")
    lister = actions.add_parser("list", help="list keys (never their secrets)")
    lister.add_argument("--all", action="store_true", help="include revoked keys")
    lister.add_argument("--json", action="store_true")
    revoke = actions.add_parser("revoke", help="revoke a key (gateways refuse it within seconds)")
    revoke.add_argument("key_id", help="the id `list` shows (or the key itself)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from shared.apikeys.keys import KeyLimits, key_id_of, parse_classes
    from shared.apikeys.store import KeyStore
    from shared.batchstore.db import BatchDatabase
    from shared.batchstore.settings import BatchStoreSettings

    db = BatchDatabase(BatchStoreSettings().resolved_database_url())
    try:
        await db.start()
        store = KeyStore(db)
        if args.action == "create":
            limits = KeyLimits(args.rps, args.tpm, args.batch_quota)
            key, secret = await store.create(args.name, limits, parse_classes(args.classes), args.admin)
            _print_created(key, secret, args.json)
        elif args.action == "list":
            _print_keys(await store.list_keys(include_revoked=args.all), args.json)
        else:
            key_id = key_id_of(args.key_id) or args.key_id
            key = await store.revoke(key_id)
            if key is None:
                raise ValueError(f"no key with id {key_id!r}")
            print(f"revoked {key.id} ({key.name})")
    finally:
        await db.close()
    return 0


def _print_created(key, secret: str, as_json: bool) -> None:
    import json

    if as_json:
        print(json.dumps({**key.public(), "key": secret}))
        return
    print(secret)
    print(f"(id {key.id}; store it now: it is not shown again)")


def _print_keys(keys, as_json: bool) -> None:
    import json

    if as_json:
        print(json.dumps([k.public() for k in keys]))
        return
    print(f"{'id':<13} {'name':<24} {'classes':<8} {'rps':>7} {'tpm':>9} {'batch':>7} {'admin':<5} status")
    for k in keys:
        lim = k.limits
        cells = [_num(lim.requests_per_s), _num(lim.tokens_per_min), _num(lim.batch_quota)]
        status = "active" if k.active else "revoked"
        print(
            f"{k.id:<13} {k.name[:24]:<24} {','.join(k.classes):<8} {cells[0]:>7} {cells[1]:>9} {cells[2]:>7} "
            f"{'yes' if k.admin else 'no':<5} {status}"
        )


def _num(value) -> str:
    return "-" if value is None else f"{value:g}"
