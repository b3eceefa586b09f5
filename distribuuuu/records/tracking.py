"""Experiment trackers (W&B, MLflow) behind the metrics writer (writer.py): optional, rank 0 only, never fatal.

The metrics writer hands every tracker the scalars it writes to TensorBoard, each with its x
axis (``epoch`` for the per-epoch records, ``global_step`` for the PRINT_FREQ windows). A tracker
that cannot be imported or that fails is dropped with one warning: training goes on without it.
The tracker run ids live in OUT_DIR/trackers.json, so a resumed run (same OUT_DIR) continues the
same tracker runs, as metrics.jsonl does.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Protocol

import yaml

from distribuuuu.errors import first_line
from distribuuuu.logger import get_logger

logger = get_logger("tracking")
RUN_IDS_FILE = "trackers.json"


class Tracker(Protocol):
    """What the metrics writer needs of a tracker."""

    name: str
    run_id: str
    where: str  # where the run's data goes: a folder or the tracking URI

    def log(self, scalars: dict[str, float], axis: str, step: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrackerSettings:
    """LOG.TRACKERS and their keys, and the run's config (plain nested values) the trackers record."""

    names: tuple[str, ...] = ()
    project: str = "distribuuuu"
    run_name: str = ""  # "" : OUT_DIR's folder name
    wandb_mode: str = "offline"
    mlflow_uri: str = ""  # "" : a file store in OUT_DIR/mlruns
    config: dict = field(default_factory=dict)


def flat(config: dict, prefix: str = "") -> dict:
    """``{"TRAIN": {"BATCH_SIZE": 32}}`` -> ``{"TRAIN.BATCH_SIZE": 32}``: MLflow's params are flat."""
    out: dict = {}
    for name, value in config.items():
        out.update(flat(value, f"{prefix}{name}.") if isinstance(value, dict) else {f"{prefix}{name}": value})
    return out


class WandbTracker:
    """A W&B run (offline by default: OUT_DIR/wandb, uploaded later with ``wandb sync``)."""

    name = "wandb"

    def __init__(self, settings: TrackerSettings, out_dir: str, run_id: str | None):
        import wandb

        # console "off": W&B must not wrap stdout (the progress bar and the log own it); no
        # system-stats thread: the tracker only forwards what the trainer already measured.
        quiet = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        self.run = wandb.init(
            project=settings.project, name=run_name(settings, out_dir), id=run_id, resume="allow" if run_id else None,
            dir=out_dir, mode=settings.wandb_mode, config=settings.config, settings=quiet,
        )  # fmt: skip
        self.run_id = self.run.id
        if settings.wandb_mode == "offline":  # the folder `wandb sync` takes
            self.where = f"{self.run.sync_dir} (offline: upload it with `wandb sync {self.run.sync_dir}`)"
        else:
            self.where = self.run.url or self.run.sync_dir
        # Each tag is plotted against its own axis, not W&B's internal step counter: a resumed
        # run may log an epoch again, which a monotonic `step=` would drop.
        for axis in ("epoch", "global_step"):
            self.run.define_metric(axis)
        self.run.define_metric("train_step/*", step_metric="global_step")
        for prefix in ("train", "val", "val_ema", "test", "test_ema"):
            self.run.define_metric(f"{prefix}/*", step_metric="epoch")

    def log(self, scalars: dict[str, float], axis: str, step: int) -> None:
        self.run.log({**scalars, axis: step})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run, through MlflowClient (no global active run): a local file store by default."""

    name = "mlflow"

    def __init__(self, settings: TrackerSettings, out_dir: str, run_id: str | None):
        uri = settings.mlflow_uri or "file:" + os.path.abspath(os.path.join(out_dir, "mlruns"))
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked:
            # it is the one backend that needs no server and no database package.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            logged = self.client.get_run(run_id).data.params
        else:
            experiment = self.client.get_experiment_by_name(settings.project)
            exp_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.project)
            run_id, logged = self.client.create_run(exp_id, run_name=run_name(settings, out_dir)).info.run_id, {}
        self.run_id, self.where = run_id, _without_credentials(uri)
        # Params are immutable in MLflow: a resumed run adds the keys it lacks; config.yaml is the
        # artifact that always holds the latest merged config.
        params = [Param(k, str(v)[:6000]) for k, v in flat(settings.config).items() if k not in logged]
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(run_id, params=params[start : start + 100])
        self.client.log_text(run_id, yaml.safe_dump(settings.config), "config.yaml")

    def log(self, scalars: dict[str, float], axis: str, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _without_credentials(uri: str) -> str:
    """A tracking URI as the log may show it: a user:password@ in it left out."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


_TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def run_name(settings: TrackerSettings, out_dir: str) -> str:
    return settings.run_name or os.path.basename(os.path.normpath(os.path.abspath(out_dir)))


class Trackers:
    """The configured trackers; every call is guarded, and a failing tracker is dropped with one warning."""

    def __init__(self, settings: TrackerSettings, out_dir: str):
        self.out_dir, self.active = out_dir, []
        ids = _read_run_ids(out_dir)
        for name in settings.names:
            try:
                tracker = _TRACKERS[name](settings, out_dir, ids.get(name))
            except ImportError as e:
                logger.warning("LOG.TRACKERS: %s is not installed (%s); training goes on without it", name, e)
                continue
            except Exception as e:  # noqa: BLE001 - a tracker must never stop training
                _warn(name, "could not start", e)
                continue
            verb = "resumed" if ids.get(name) == tracker.run_id else "started"
            logger.info("LOG.TRACKERS: %s run %s %s, in %s", name, tracker.run_id, verb, tracker.where)
            ids[name] = tracker.run_id
            self.active.append(tracker)
        if self.active:
            _write_run_ids(out_dir, ids)

    def log(self, scalars: dict[str, float], axis: str, step: int) -> None:
        """Send ``scalars`` (tag -> value) at ``axis`` = ``step`` to every tracker still working."""
        for tracker in list(self.active):
            try:
                tracker.log(scalars, axis, step)
            except Exception as e:  # noqa: BLE001
                _warn(tracker.name, "failed", e)
                self.active.remove(tracker)

    def close(self) -> None:
        for tracker in self.active:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001
                _warn(tracker.name, "could not close its run", e)
        self.active = []


def _warn(name: str, what: str, e: Exception) -> None:
    logger.warning("tracker %s %s (%s: %s); training goes on without it", name, what, type(e).__name__, first_line(e))


def _read_run_ids(out_dir: str) -> dict[str, str]:
    path = os.path.join(out_dir, RUN_IDS_FILE)
    try:
        with open(path) as f:
            ids = json.load(f)
        return ids if isinstance(ids, dict) else {}
    except (OSError, ValueError):
        return {}  # no file yet (a new run), or an unreadable one: start new tracker runs


def _write_run_ids(out_dir: str, ids: dict[str, str]) -> None:
    try:
        with open(os.path.join(out_dir, RUN_IDS_FILE), "w") as f:
            json.dump(ids, f)
    except OSError as e:
        logger.warning("tracker run ids not saved (%s): a resumed run will start new tracker runs", e)
