"""The batch store: batch jobs' durable state, shared by the gateway and the queue service.

The gateway answers the Files and Batches API from it and the queue service runs the jobs
from it; the two never talk to each other, only to this database (docs/batch.md says why).
It lives here, in neither service's package, because it is the contract between the two
processes: the tables, and every status change either of them may make (each a conditional
update, so neither overwrites the other's decision), are reviewable in one place.

- `db`: the tables (SQLAlchemy 2 ORM), the engine (SQLite WAL or PostgreSQL) and
  `BatchDatabase`, which both sides open;
- `api_store`: the gateway's part: files, batch creation, reads, cancel requests;
- `run_store`: the queue service's part: validation outcome, items, results, finalisation;
- `objects`: rows as OpenAI returns them (`file`, `batch`, list pages, `errors`);
- `settings`: where the database is (`TANDEM_DATABASE_URL` / `TANDEM_DATA_DIR`), part of both
  services' settings.
"""
