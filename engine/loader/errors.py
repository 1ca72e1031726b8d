"""The one exception the loading layer raises for user-fixable problems."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model reference could not be resolved or its files could not be understood.

    A ValueError because the cause is always the value the user passed (a path, a file,
    a config) rather than a bug; the message says what was expected instead.
    """
