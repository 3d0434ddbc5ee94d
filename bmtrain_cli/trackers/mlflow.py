"""MLflow: MLFLOW_TRACKING_URI when set, else a local store under output_dir (sqlite
output_dir/mlflow/mlflow.db, artifacts beside it: ``mlflow ui --backend-store-uri
sqlite:///output_dir/mlflow/mlflow.db``; MLflow 3 refuses new plain-file stores). The experiment is
MLFLOW_EXPERIMENT_NAME (default bmtrain); the config as the run's parameters, one per dotted key."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from bmtrain_cli.trackers import flatten, run_name

PARAMS_PER_BATCH = 100  # MLflow's limit on parameters in one log_batch
PARAM_VALUE_CHARS = 6000  # MLflow's limit on a parameter value


def local_store(output_dir: Path) -> str:
    return "sqlite:///" + str((output_dir / "mlflow" / "mlflow.db").resolve())


class MLflowTracker:
    def __init__(self, output_dir: Path):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            (output_dir / "mlflow").mkdir(parents=True, exist_ok=True)
            uri = local_store(output_dir)
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "bmtrain")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif os.environ.get("MLFLOW_TRACKING_URI"):
            experiment_id = self.client.create_experiment(name)
        else:
            artifacts = (output_dir / "mlflow" / "artifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name(output_dir)).info.run_id

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_config(self, config: Dict[str, Any]) -> None:
        from mlflow.entities import Param

        params: List[Param] = [Param(k, str(v)[:PARAM_VALUE_CHARS]) for k, v in flatten(config).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_BATCH])

    def log_summary(self, hparams: Dict[str, Any], metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])

    def flush(self) -> None:
        """Each log_batch is written when it returns."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def create(output_dir: Path, resume_step: Optional[int]) -> MLflowTracker:
    return MLflowTracker(output_dir)
