"""API keys: who may call the gateway, how much, in which class (issue 22).

- `keys`: the key format, its hash and check, and `ApiKey` (what the gateway needs of a key:
  limits, allowed classes, admin, cache salt);
- `store`: the keys table in the batch database (`tandem_api_keys`): create, list, revoke,
  look up; `tandem keys` and the gateway both use it.

Keys live in the batch database because every deployment has one (SQLite or PostgreSQL) and
the gateway already reads it; a key's batches and files are owned by its id there.
"""
