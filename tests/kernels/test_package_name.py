"""Our top-level `kernels` package shares its name with Hugging Face's `kernels` distribution.

transformers 5.25 made that distribution a hard dependency and imports names from whatever
`import kernels` resolves to, which in this project is ours: every model load then failed
("cannot import name 'CUDAProperties' from 'kernels'"). constraints.txt pins a transformers that
keeps it optional; these tests fail at once if an upgrade (or a stray install) brings it back,
instead of as hundreds of unrelated-looking errors across the suite.
"""

from __future__ import annotations

import importlib.metadata

import pytest


def test_no_foreign_kernels_distribution_is_installed():
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    pytest.fail(
        f"a distribution named 'kernels' ({version}) is installed beside our kernels/ package; "
        "transformers would import from ours (see constraints.txt)"
    )


def test_transformers_hub_kernel_integration_imports_beside_our_package():
    import kernels  # ours

    assert kernels.__file__ is not None and "site-packages" not in kernels.__file__
    # The module that imported HF names from `kernels` at import time in transformers 5.25.
    hub_kernels = importlib.import_module("transformers.integrations.hub_kernels")
    assert hub_kernels is not None
