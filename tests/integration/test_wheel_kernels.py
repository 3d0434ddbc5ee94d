"""The wheel carries the kernel sources: `pip wheel .`, install it into a fresh venv outside the checkout,
and train with `kernels: custom` (the extension is built on first use into the user cache, with a line
saying so); without a compiler `kernels: auto` falls back with a message and `custom` is refused."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.tiny import model_dict

REPO = Path(__file__).resolve().parents[2]


def _config(tmp: Path, kernels: str, name: str) -> Path:
    data = tmp / "train.jsonl"
    rows = [{"input": f"add {i} and {i + 3}", "output": str(2 * i + 3)} for i in range(32)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = {
        "model_config": model_dict(kernels=kernels),
        "train_config": {
            "data_path": str(data),
            "output_dir": str(tmp / f"out-{name}"),
            "max_steps": 1,
            "micro_batch_size": 4,
            "warmup_steps": 0,
            "save_steps": 100,
            "num_workers": 0,
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@pytest.mark.slow
def test_installed_wheel_builds_and_trains_with_custom_kernels(tmp_path):
    wheels = tmp_path / "wheels"
    # the ordinary `pip wheel .`: build isolation fetches setuptools and wheel from the package index
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-w", str(wheels)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    if (
        built.returncode != 0
        and "No matching distribution found for setuptools" in built.stdout + built.stderr
    ):
        pytest.skip("pip wheel needs setuptools and wheel from a package index, and none is reachable")
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    (wheel,) = wheels.glob("bmtrain_cli-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(str(p.relative_to(REPO / "kernels")) for p in (REPO / "kernels").rglob("*.c[cu]"))
    assert sources and all(f"bmtrain_cli/_kernels/{s}" in names for s in sources)
    shipped = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    assert shipped and all(f"bmtrain_cli/_configs/{n}" in names for n in shipped)
    recipes = sorted(p.name for p in (REPO / "recipes").glob("*.py"))
    assert {"sft.py", "dpo.py"} <= set(recipes) and all(f"bmtrain_cli/_recipes/{n}" in names for n in recipes)

    # a fresh venv outside the checkout; Paddle and the dependencies come from this interpreter's
    # site-packages through a .pth (a plain path: no editable-install hooks of the dev checkout run)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    (target,) = (venv / "lib").glob("python3*/site-packages")
    (target / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n", encoding="utf-8")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CXX")}
    env.update(BMTRAIN_KERNELS_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    where = subprocess.run(
        [str(python), "-c", "import bmtrain_cli.ops.build as b; print(b.KERNELS_DIR)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(target), where  # the installed copy, not the checkout's kernels/

    # the quickstart from the installed package, in an empty directory: `init` writes it, `--config NAME`
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (
        ["init", "quickstart"],
        ["validate-config", "quickstart.yaml"],
        ["validate-config", "quickstart"],
    ):
        res = subprocess.run(
            [str(python), "-m", "bmtrain_cli", *argv], capture_output=True, text=True, cwd=empty, env=env
        )
        assert res.returncode == 0, res.stdout + res.stderr

    run = subprocess.run(
        [str(python), "-m", "bmtrain_cli", "train", "--config", str(_config(tmp_path, "custom", "custom"))],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    assert "building the custom kernels (" in text and "with the C++ compiler" in text
    assert "building the custom kernels: done in" in text
    assert list((tmp_path / "cache").glob("*/bmt_fused_ops_*/*.so"))
    summary = json.loads((tmp_path / "out-custom" / "summary.json").read_text())
    assert summary["steps"] == 1

    # no compiler: auto falls back with a message, custom is refused (exit 2, one line, no traceback)
    tools = tmp_path / "no-compiler-bin"
    tools.mkdir()
    for folder in ("/usr/bin", "/bin"):
        for exe in Path(folder).iterdir():
            compiler = "++" in exe.name or "gcc" in exe.name or "clang" in exe.name or exe.name == "cc"
            if not compiler and not (tools / exe.name).exists():
                (tools / exe.name).symlink_to(exe)
    bare = dict(env, PATH=f"{venv / 'bin'}:{tools}", BMTRAIN_KERNELS_CACHE=str(tmp_path / "cache-bare"))
    for kernels, code in (("auto", 0), ("custom", 2)):
        res = subprocess.run(
            [
                str(python),
                "-m",
                "bmtrain_cli",
                "train",
                "--config",
                str(_config(tmp_path, kernels, f"bare-{kernels}")),
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=bare,
        )
        text = res.stdout + res.stderr
        assert res.returncode == code, text[-3000:]
        assert "no C++ compiler found" in text and "Traceback" not in text
        if kernels == "auto":  # the ops and the CPU AdamW fall back for one reason: one line says so
            said = [x for x in text.splitlines() if "unavailable" in x or "KernelFallbackWarning" in x]
            assert len(said) == 1 and said[0].startswith("warning: custom kernels unavailable"), said
