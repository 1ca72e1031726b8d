"""Wire messages, one module per topic family (see `shared.topics` for the catalogue)."""
