"""bmtrain_cli/cpu_env.py: MKL_DEBUG_CPU_TYPE=5 on AMD CPUs with AVX2 only, never over a user's value."""

from __future__ import annotations

import os

from bmtrain_cli.cpu_env import MKL_VAR, use_mkl_avx2_on_amd

AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
INTEL = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma\n"
OLD_AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx\n"


def _cpuinfo(tmp_path, text):
    p = tmp_path / "cpuinfo"
    p.write_text(text)
    return str(p)


def test_sets_the_avx2_path_on_amd(tmp_path):
    env: dict = {}
    assert use_mkl_avx2_on_amd(env, _cpuinfo(tmp_path, AMD)) == "5"
    assert env == {MKL_VAR: "5"}


def test_leaves_intel_old_cpus_and_user_values_alone(tmp_path):
    for text in (INTEL, OLD_AMD):
        env: dict = {}
        assert use_mkl_avx2_on_amd(env, _cpuinfo(tmp_path, text)) is None
        assert env == {}
    env = {MKL_VAR: "2"}
    assert use_mkl_avx2_on_amd(env, _cpuinfo(tmp_path, AMD)) is None
    assert env == {MKL_VAR: "2"}
    assert use_mkl_avx2_on_amd({}, str(tmp_path / "missing")) is None


def test_importing_the_package_applied_it():
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        info = fh.read(1 << 16)
    if "AuthenticAMD" in info and " avx2" in info:
        assert os.environ.get(MKL_VAR)  # set by `import bmtrain_cli` (or by the user before it)
