"""Paddle Inference export: a static graph of the model's forward (input_ids -> logits) saved with
``paddle.jit.save``, with dynamic batch and sequence dimensions, plus the tokenizer files, the model's
config.json and ``bmtrain_export.json`` (what this directory holds).

Serve it with ``paddle.inference.Config(model_file, params_file)`` + ``create_predictor`` (docs/deploy.md);
:class:`Predictor` here does exactly that.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import paddle

from bmtrain_cli.errors import UserError
from bmtrain_cli.export.meta import META_FILE, read_export_meta
from bmtrain_cli.machine import gpu_available

MODEL_PREFIX = "model"
INPUT_NAME = "input_ids"


class _LogitsOnly(paddle.nn.Layer):
    """The graph that is exported: input_ids [batch, seq] int64 -> logits [batch, seq, vocab]."""

    def __init__(self, model: paddle.nn.Layer):
        super().__init__()
        self.model = model

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        # An all-ones mask (one segment, no padding) means plain causal attention; passing it as a tensor
        # keeps the attention bias a tensor on every path, which the static-graph translator needs.
        return self.model(input_ids, attention_mask=paddle.ones_like(input_ids))


def model_files(out_dir: Path) -> Dict[str, Path]:
    """The graph file (model.json under PIR, model.pdmodel for the legacy format) and the params file."""
    out_dir = Path(out_dir)
    for graph in (f"{MODEL_PREFIX}.json", f"{MODEL_PREFIX}.pdmodel"):
        if (out_dir / graph).is_file():
            return {"model": out_dir / graph, "params": out_dir / f"{MODEL_PREFIX}.pdiparams"}
    raise UserError(
        f"{out_dir}: no {MODEL_PREFIX}.json or {MODEL_PREFIX}.pdmodel (not a paddle-inference export)"
    )


def export_paddle_inference(
    model: paddle.nn.Layer, out_dir: str, meta: Optional[Dict[str, Any]] = None
) -> Dict[str, Path]:
    """jit.save ``model``'s forward to ``out_dir/model.*`` with InputSpec([None, None], int64).

    Quantised layers are traced through their dequantising path (int8 buffers + cast and multiply in the
    graph), so the export runs on any device. Returns the written graph and params files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    from bmtrain_cli.export.quantize import QuantLinear

    previous = {}
    for name, layer in model.named_sublayers():
        if isinstance(layer, QuantLinear):
            previous[name] = layer.use_kernel
            layer.use_kernel = "never"
    try:
        spec = [paddle.static.InputSpec([None, None], "int64", name=INPUT_NAME)]
        with warnings.catch_warnings(), _native_stdout_to_stderr():
            warnings.filterwarnings("ignore", message="Tensor do not have 'place' interface")
            paddle.jit.save(_LogitsOnly(model), str(out / MODEL_PREFIX), input_spec=spec)
    finally:
        for name, layer in model.named_sublayers():
            if name in previous:
                layer.use_kernel = previous[name]
    files = model_files(out)
    info: Dict[str, Any] = {
        "format": "paddle-inference",
        "input": INPUT_NAME,
        "output": "logits",
        "paddle": paddle.__version__,
    }
    info.update(meta or {})
    info["files"] = {k: v.name for k, v in files.items()}
    # Paddle Inference loads a params file cut short by a few bytes without a word: the loader compares
    info["sizes"] = {v.name: v.stat().st_size for v in files.values()}
    (out / META_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return files


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 1 to descriptor 2 for the duration, without the
    lines of quiet.INFERENCE_NOISE.

    Paddle Inference's oneDNN passes print lines such as ``ReduceMeanCheckIfOneDNNSupport`` to the C++
    stdout on the first run; they would otherwise end up in the output of ``bmtrain eval --json`` or
    ``bmtrain generate`` and break what reads it.
    """
    from bmtrain_cli.quiet import INFERENCE_NOISE, filtered_stderr

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    with filtered_stderr(INFERENCE_NOISE):  # and without Paddle's internal notices (quiet.INFERENCE_NOISE)
        try:
            os.dup2(2, 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def check_sizes(export_dir: Path, files: Dict[str, Path]) -> None:
    """UserError naming a model file that is missing or not the size the export wrote (bmtrain_export.json
    records it; exports from before that are only checked for presence)."""
    sizes = read_export_meta(export_dir).get("sizes")
    for f in files.values():
        if not f.is_file():
            raise UserError(f"{export_dir}: {f.name} is missing; the export is incomplete, export it again")
        expected = sizes.get(f.name) if isinstance(sizes, dict) else None
        if expected is not None and f.stat().st_size != expected:
            raise UserError(
                f"{f}: {f.stat().st_size} bytes, the export wrote {expected}; the export is truncated or "
                "damaged, export it again"
            )


def predictor_device_id(device_id: Optional[int] = None, device: Optional[str] = None) -> int:
    """The GPU the predictor runs on: ``device_id`` when given, else the one Paddle's current device
    names (``gpu:3`` -> 3; ``paddle.set_device`` or FLAGS_selected_gpus under the launcher), else 0."""
    if device_id is not None:
        return int(device_id)
    if device is None:
        import paddle

        device = str(paddle.get_device())
    name, _, index = device.partition(":")
    return int(index) if name == "gpu" and index.isdigit() else 0


class Predictor:
    """A paddle.inference predictor over an export directory: ``logits(input_ids) -> np.ndarray``."""

    def __init__(
        self,
        export_dir: str,
        use_gpu: Optional[bool] = None,
        threads: int = 1,
        device_id: Optional[int] = None,
    ):
        from paddle import inference

        files = model_files(Path(export_dir))
        check_sizes(Path(export_dir), files)
        config = inference.Config(str(files["model"]), str(files["params"]))
        if use_gpu is None:
            use_gpu = gpu_available()
        if use_gpu:
            config.enable_use_gpu(256, predictor_device_id(device_id))
        else:
            config.disable_gpu()
            config.set_cpu_math_library_num_threads(threads)
        config.disable_glog_info()
        try:
            with _native_stdout_to_stderr():
                self.predictor = inference.create_predictor(config)
        except (RuntimeError, ValueError, OSError) as exc:  # Paddle's C++ errors arrive as RuntimeError
            reason = next(
                (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
            )
            raise UserError(
                f"{export_dir}: cannot load the Paddle Inference model ({files['model'].name}, "
                f"{files['params'].name}): {reason}; the export is truncated or damaged, export it again"
            ) from None
        self._input = self.predictor.get_input_handle(self.predictor.get_input_names()[0])
        self._output = self.predictor.get_output_handle(self.predictor.get_output_names()[0])

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64))
        if ids.ndim == 1:
            ids = ids[None, :]
        self._input.reshape(list(ids.shape))
        self._input.copy_from_cpu(ids)
        with _native_stdout_to_stderr():
            self.predictor.run()
        return self._output.copy_to_cpu()
