"""One tiny training run reporting to every tracker; each tracker's records read back with that tool's
own reader hold the same scalars as TensorBoard's, and the resolved config as run parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.tiny import model_yaml

Series = Dict[str, List[Tuple[int, float]]]

pytestmark = pytest.mark.slow

CONFIG = (
    model_yaml(max_seq_len=24, kv_heads=None)
    + """
train_config:
  demo_data: arithmetic
  output_dir: {out}
  max_steps: 4
  micro_batch_size: 8
  learning_rate: 3.0e-3
  logging_steps: 1
  save_steps: null
  eval_steps: 2
  num_workers: 0
  report_to: [tensorboard, visualdl, wandb, swanlab, mlflow]
"""
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    for name in ("visualdl", "wandb", "swanlab", "mlflow"):
        pytest.importorskip(name)
    mp = pytest.MonkeyPatch()
    for var in ("WANDB_MODE", "SWANLAB_MODE", "MLFLOW_TRACKING_URI", "WANDB_PROJECT"):
        mp.delenv(var, raising=False)  # the defaults are under test: offline, files under output_dir
    tmp = tmp_path_factory.mktemp("trackers")
    cfg = tmp / "c.yaml"
    cfg.write_text(CONFIG.format(out=tmp / "out"), encoding="utf-8")
    res = CliRunner().invoke(app, ["train", "--config", str(cfg)], catch_exceptions=False)
    mp.undo()
    assert res.exit_code == 0, res.output
    return tmp / "out"


def _tensorboard(out: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "logs"))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _same(series: Series, reference: Series, rel: float = 1e-6) -> None:
    assert set(series) == set(reference)
    for tag, points in reference.items():
        got = sorted(series[tag])
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=rel), tag


def test_tensorboard_has_train_eval_and_throughput(run):
    tb = _tensorboard(run)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "eval/loss"} <= set(tb)
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4] and [s for s, _ in tb["eval/loss"]] == [2, 4]


def test_visualdl_log_reader(run):
    from visualdl import LogReader

    (path,) = (run / "visualdl").glob("vdlrecords.*.log")
    reader = LogReader(file_path=str(path))
    tags = reader.get_tags()
    series = {t: [(r.id, r.value) for r in reader.get_data("scalar", t)] for t in tags["scalar"]}
    _same(series, _tensorboard(run))  # VisualDL stores float32, as TensorBoard does
    assert "config" in tags["text"] and "hyper_parameters" in tags


def _wandb_records(out: Path) -> List:
    from swanlab.converter.wb.wbdatastore import WBDataStoreReader  # a reader of the .wandb log format
    from wandb.proto import wandb_internal_pb2

    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = []
    with WBDataStoreReader() as ds:
        ds.open(path)
        while (data := ds.scan()) is not None:
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            records.append(rec)
    return records


def test_wandb_offline_run_files(run):
    series: Series = {}
    config: Dict[str, object] = {}
    for rec in _wandb_records(run):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            # W&B writes a key with "/" as its nested_key
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            if "_step" not in items:
                continue
            step = int(items.pop("_step"))
            for key, value in items.items():
                if not key.startswith("_"):
                    series.setdefault(key, []).append((step, float(value)))
        elif kind in ("config", "run"):
            updates = rec.config.update if kind == "config" else rec.run.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    _same(series, _tensorboard(run))
    assert config["train_config"]["report_to"] == ["tensorboard", "visualdl", "wandb", "swanlab", "mlflow"]
    assert config["train_config"]["learning_rate"] == 3.0e-3


def test_swanlab_local_files(run):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = (run / "swanlog").glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    series: Series = {}
    for data in reader:
        rec = Record()
        rec.ParseFromString(data)
        if rec.HasField("scalar") and not rec.scalar.key.startswith("__swanlab__"):  # its own system stats
            series.setdefault(rec.scalar.key, []).append((rec.scalar.step, rec.scalar.value.number))
    reader.close()
    _same(series, _tensorboard(run))
    (config_file,) = (run / "swanlog").glob("run-*/files/config.yaml")
    config = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    assert config["train_config"]["value"]["learning_rate"] == 3.0e-3


def test_mlflow_client_on_the_local_store(run):
    from mlflow.tracking import MlflowClient

    from bmtrain_cli.trackers.mlflow import local_store

    client = MlflowClient(tracking_uri=local_store(run))
    experiment = client.get_experiment_by_name("bmtrain")
    (found,) = client.search_runs([experiment.experiment_id])
    tb = _tensorboard(run)
    series = {t: [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, t)] for t in tb}
    _same(series, tb)
    assert found.data.params["train_config.learning_rate"] == "0.003"
    assert found.info.status == "FINISHED"
