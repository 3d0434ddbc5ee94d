"""Paddle's start-up noise is dropped from standard error, everything else is kept (bmtrain_cli/quiet.py)."""

from __future__ import annotations

import subprocess
import sys


def test_filtered_stderr_drops_only_the_noise_of_this_process_and_its_children() -> None:
    code = r"""
import os, subprocess, sys
from bmtrain_cli.quiet import filtered_stderr
with filtered_stderr():
    print("WARNING: OMP_NUM_THREADS set to 2, not 1.", file=sys.stderr)
    os.write(2, b"a real problem\n")
    subprocess.run([sys.executable, "-c", "import sys; print('PLEASE USE OMP_NUM_THREADS WISELY.', file=sys.stderr); print('child error', file=sys.stderr)"])
print("after", file=sys.stderr)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == ["a real problem", "child error", "after"]


def test_filtered_stderr_passes_output_on_when_the_block_fails() -> None:
    code = r"""
import sys
from bmtrain_cli.quiet import filtered_stderr
try:
    with filtered_stderr():
        print("compiler said: error", file=sys.stderr)
        raise RuntimeError("boom")
except RuntimeError:
    print("caught", file=sys.stderr)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == ["compiler said: error", "caught"]


# what rank 0's log and the launcher wrote when rank 1 of `bmtrain run` was killed (shortened), with the
# C++ dump Paddle's signal handler prints when the launcher stops a rank, as the launcher's pipe carries it
SURVIVOR = """\
step 3/400 loss 5.8237 lr 2e-05 tok/s 135 ETA 1m58s
Traceback (most recent call last):
  File "/work/recipes/train.py", line 16, in <module>
    main(["train", *sys.argv[1:]])
  File "/work/bmtrain_cli/parallel/context.py", line 303, in reduce_gradients
    dist.all_reduce(p.grad, group=g)
  File "/venv/paddle/distributed/communication/stream/all_reduce.py", line 51, in _all_reduce_in_dygraph
    task = group.process_group.all_reduce(tensor, op_type, sync_op)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:576] Read error [127.0.0.1]:40080: Connection reset by peer

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/work/bmtrain_cli/train/trainer.py", line 717, in train
ValueError: (InvalidArgument) The 'shape' in ReshapeOp is invalid.
  [Hint: Expected capacity == in_size, but received capacity:7 != in_size:6.] (at /paddle/phi/unary.cc:2536)
step 4/400 loss 5.8047 lr 2e-05 tok/s 689 ETA 18s
terminate called after throwing an instance of 'gloo::IoException'
  what():  [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:40080


--------------------------------------
C++ Traceback (most recent call last):
--------------------------------------
No stack trace in paddle, may be caused by external reasons.

----------------------
Error Message Summary:
----------------------
FatalError: `Termination signal` is detected by the operating system.
  [TimeInfo: *** Aborted at 1796072159 (unix time) try "date -d @1796072159" if you are using GNU date ***]
  [SignalInfo: *** SIGTERM (@0x748a) received by PID 29837 (TID 0x7f0a9145eb80) from PID 29834 ***]

error: rank 0: no progress for 5 s (parallel_config.fault_timeout_s); waiting on rank 1
----------------------------------------
a table row after a rule
LAUNCH ERROR 2026-11-30 20:53:43,458 Container failed !!!
Container rank 1 status failed cmd ['python', '-u', 'recipes/train.py'] code -9 log out/launch/workerlog.1
ck (most recent call last):
  File "/work/recipes/train.py", line 16, in <module>
step 3/400 loss 5.8237 lr 2e-05 tok/s 135 ETA 1m58s
"""


def _console(text: str) -> str:
    from bmtrain_cli.quiet import LauncherConsole

    console = LauncherConsole()
    shown = [kept for line in text.encode().splitlines(keepends=True) for kept in console.feed(line)]
    return b"".join(shown + console.close()).decode()


def test_the_launcher_console_drops_the_error_dumps_and_keeps_the_rest() -> None:
    """A surviving rank's gloo traceback (chained), Paddle's C++ signal dump, a C++ abort and the
    launcher's copy of the failed rank's log tail are dropped; progress, one-line errors and a rule that
    opens no dump are kept."""
    assert _console(SURVIVOR).splitlines() == [
        "step 3/400 loss 5.8237 lr 2e-05 tok/s 135 ETA 1m58s",
        "step 4/400 loss 5.8047 lr 2e-05 tok/s 689 ETA 18s",
        "error: rank 0: no progress for 5 s (parallel_config.fault_timeout_s); waiting on rank 1",
        "----------------------------------------",
        "a table row after a rule",
    ]


def test_the_launcher_console_keeps_normal_output_whole() -> None:
    normal = "launching\n  indented detail\n[note] bracketed\n\n--------------------\n"
    assert _console(normal) == normal


def test_the_launcher_console_drops_paddles_import_warnings() -> None:
    """Every rank's `import paddle` with OMP_NUM_THREADS=2 (what `make test-slow` and users set) warns."""
    text = (
        "WARNING: OMP_NUM_THREADS set to 2, not 1. The computation speed will not be optimized.\n"
        "PLEASE USE OMP_NUM_THREADS WISELY.\n"
        "step 1/4 loss 5.87\n"
    )
    assert _console(text) == "step 1/4 loss 5.87\n"


def test_python_api_imports_paddle_without_its_ccache_warning() -> None:
    """`import bmtrain_cli as bmt; bmt.init_distributed_mode()` in a user's script: Paddle's import-time
    "No ccache found" warning is not shown (as in the CLI); the API's own line is."""
    code = "import bmtrain_cli as bmt; bmt.init_distributed_mode()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    assert "ccache" not in text and "warnings.warn" not in text
    assert "rank 0 of 1" in text
