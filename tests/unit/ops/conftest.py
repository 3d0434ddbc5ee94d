"""One shared build of the custom-op extension per test session (the first build takes ~15 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ext():
    from bmtrain_cli.ops.build import load_extension

    return load_extension()


@pytest.fixture(scope="session")
def cuda_launchers(tmp_path_factory):
    """The path of kernels/cuda/*.cu compiled by nvcc alone into a shared library (as ops/build.py does where
    Paddle is a CPU build), for one architecture to keep it short; skips without nvcc. A compile error
    fails the tests that use it."""
    from bmtrain_cli.ops.build import compile_cuda_launchers, find_nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PADDLE_CUDA_ARCH_LIST", "8.0")
        return compile_cuda_launchers(tmp_path_factory.mktemp("cuda"))
