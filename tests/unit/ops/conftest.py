"""One shared build of the custom-op extension per test session (the first build takes ~15 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ext():
    from bmtrain_cli.ops.build import load_extension

    return load_extension()
