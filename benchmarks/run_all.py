"""Run every benchmark (benchmarks/bench_*.py) in turn: `make bench`.

Each module defines ``main() -> dict`` that prints its own report (ratios against a baseline measured in
the same run). Pass names to run a subset: `python benchmarks/run_all.py model data`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list) -> int:
    wanted = set(argv)
    results = {}
    failed = []
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        if wanted and name not in wanted:
            continue
        print(f"\n=== benchmarks/{path.name}", flush=True)
        spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        t0 = time.perf_counter()
        try:
            spec.loader.exec_module(module)
            results[name] = module.main()
        except Exception:  # a failing benchmark must not hide the others' figures
            traceback.print_exc()
            failed.append(name)
        print(f"=== {path.name}: {time.perf_counter() - t0:.1f} s", flush=True)
    out = HERE / "results.json"
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
