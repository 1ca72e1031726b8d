"""`tandem chaos`: kill services under load and count what was lost (docs/reliability.md)."""
