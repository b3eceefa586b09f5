"""A session: one process's part in a training run (train_net.py) or an evaluation (test_net.py).

Entered as a context manager by ``train_model`` and ``test_model``: it meets the other ranks, holds
OUT_DIR's lock, prepares this process (logging, seeds), opens the outputs once the inputs
proved good, names failed collectives and stalled ranks by the run's position, and on every way out
lets go of all of it: the run it followed (whose model holds the process group) first, then the
writer, the lock and the process group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import yaml
from yacs.config import CfgNode

from distribuuuu.checkpointing.manager import Checkpointer
from distribuuuu.checkpointing.names import BEST_NAME, BEST_SHARDED, CKPT_DIR
from distribuuuu.config import ConfigError, changes_from_defaults
from distribuuuu.logger import attach_log_file, get_logger, setup_logging
from distribuuuu.progress import show_progress_bar
from distribuuuu.records.manifest import record_start
from distribuuuu.records.out_dir_lock import OutDirLock, is_a_restart
from distribuuuu.records.set_aside import set_aside_earlier_run, set_aside_records_after
from distribuuuu.records.tracking import TrackerSettings
from distribuuuu.records.writer import MetricsWriter, NullWriter, make_writer
from distribuuuu.runtime.faults import naming_failed_collectives
from distribuuuu.runtime.heartbeat import reporting_position, stall_seconds
from distribuuuu.runtime.launcher import DistEnv
from distribuuuu.runtime.preemption import PreemptionHandler
from distribuuuu.runtime.process_group import (
    check_group,
    cleanup_distributed,
    format_rank_table,
    rank0_decides,
    setup_distributed,
)
from distribuuuu.training.resume import checkpointer
from distribuuuu.training.rng import seed_everything
from distribuuuu.training.state import Run, TrainState

logger = get_logger("run")
T = TypeVar("T")


class Session:
    """This process's part in a run: ``with Session(cfg) as session: ...``.

    ``training`` False is an evaluation: OUT_DIR locked as for training, but no config kept in it.
    ``cleanup`` False keeps the process group for a caller that trains several times in one job.
    Outside a ``with`` (a benchmark timing the loops) it is a session without outputs: ``env`` as
    given, records nowhere.
    """

    def __init__(self, cfg: CfgNode, training: bool = True, cleanup: bool = True, env: DistEnv | None = None):
        self.cfg, self.training, self.cleanup = cfg, training, cleanup
        self.env, self.table = env or DistEnv(), []
        self.writer: MetricsWriter | NullWriter = NullWriter()
        self.preempt: PreemptionHandler | None = None
        self.checkpoints: Checkpointer | None = checkpointer(cfg) if training else None
        self.run: Run | None = None
        self._lock: OutDirLock | None = None

    def __enter__(self) -> Session:
        self.env, self.table = start_process_group(self.cfg)
        try:
            # Evaluations too: a test record written into a folder a training run holds would join its record.
            self._lock = out_dir_lock(self.cfg) if self.env.is_main_process else None
            rank0_decides(lambda: self._lock.acquire())  # before OUT_DIR is read: a live holder stops this run
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._leave()

    def _leave(self) -> None:
        self.run = None  # its model holds the process group: let it go with the group, not at interpreter exit
        self.writer.close()
        if self._lock is not None:
            self._lock.release()
        if self.cleanup:
            cleanup_distributed()

    def decide(self, decide: Callable[[], T]) -> T:
        """``decide()`` on rank 0, its result (or its error) on every rank."""
        return rank0_decides(decide)

    def prepare(self) -> None:
        """Logging (the lines for log.txt kept until ``open_outputs``), seeds and cuDNN: nothing written."""
        cfg, env = self.cfg, self.env
        progress_bar = self.training and show_progress_bar(cfg.LOG.PROGRESS)
        setup_logging(None, env.rank, progress_bar, console=cfg.LOG.CONSOLE, pending=True)
        launch = f"{env.launcher} launch" if env.distributed else "no launcher (a plain process)"
        logger.info("%s, %d process(es):\n%s", launch, env.world_size, format_rank_table(self.table))
        if cfg.TRAIN.PRECISION == "fp16" and env.device.type == "cpu":
            logger.warning("TRAIN.PRECISION fp16 on the CPU is slow and meant for testing the fp16 path; use bf16")
        seed_everything(cfg.RNG_SEED + env.rank)
        torch.backends.cudnn.benchmark = cfg.CUDNN.BENCHMARK
        torch.backends.cudnn.deterministic = cfg.CUDNN.DETERMINISTIC

    def open_outputs(self, resumed_from: str | None = None, epochs_done: int = 0) -> MetricsWriter | NullWriter:
        """Create OUT_DIR and its log.txt; keep this start's config and manifest (training); the metrics writer.

        A training run first moves aside what it must not append to (``make_room``): resumed from a
        checkpoint of ``epochs_done`` epochs, the records past it. Called once the inputs proved
        good: a run stopped by bad input leaves OUT_DIR as it found it.
        """
        cfg, env = self.cfg, self.env
        moved = rank0_decides(lambda: make_room(cfg, resumed_from, epochs_done)) if self.training else None
        rank0_decides(lambda: prepare_out_dir(cfg.OUT_DIR, self.training))  # every rank stops on a bad folder
        if env.is_main_process:
            attach_log_file(cfg.OUT_DIR)
            if moved:
                logger.warning("%s", moved)
        if self.training:
            rank0_decides(lambda: record_start(cfg.OUT_DIR, cfg.dump(), cfg.CFG_DEST, env, self.table, resumed_from))
        options = writer_options(cfg) if self.training else {}
        self.writer = make_writer(cfg.OUT_DIR, env.is_main_process, **options)
        return self.writer

    def follow(self, run: Run) -> Run:
        """Name ``run``'s position in failed collectives and heartbeats (``watching``); let go of it on
        the way out. Its config is the session's from here on (a class count taken from the data)."""
        self.run, self.cfg = run, run.cfg
        return run

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """A collective that fails, or a rank that stalls, inside is named with the followed run's position."""
        where = lambda: self.run.state if self.run is not None else TrainState()  # noqa: E731
        with naming_failed_collectives(self.env, self.cfg.DIST.TIMEOUT_S, where):
            with reporting_position(lambda: self.run.position() if self.run is not None else "set-up"):
                yield

    @contextlib.contextmanager
    def preemptible(self) -> Iterator[PreemptionHandler]:
        """SIGTERM/SIGUSR1 (preemption) and Ctrl-C inside are requests to stop at the next sync point."""
        with PreemptionHandler(self.cfg.DIST.PREEMPT_GRACE_S) as self.preempt:
            yield self.preempt

    def report_finished(self, epochs_done: int) -> None:
        """Say that OUT_DIR's run is finished, on the console only: its log, config and summary stay as they are."""
        cfg = self.cfg
        setup_logging(None, self.env.rank)
        if self.env.is_main_process:
            logger.warning(
                "%s already holds a finished run (%d epochs trained, OPTIM.MAX_EPOCH %d): nothing to train, nothing "
                "written; raise OPTIM.MAX_EPOCH to train on, or give another OUT_DIR to start a new run",
                cfg.OUT_DIR, epochs_done, cfg.OPTIM.MAX_EPOCH,
            )  # fmt: skip


def writer_options(cfg: CfgNode) -> dict:
    """A training run's metrics writer: LOG.PLOT, LOG.TRACKERS (with the run's config) and what the
    summary lists of the config."""
    log = cfg.LOG
    trackers = TrackerSettings(
        tuple(log.TRACKERS), log.PROJECT, log.RUN_NAME, log.WANDB_MODE, log.MLFLOW_URI, yaml.safe_load(cfg.dump())
    )
    return {"plot": log.PLOT, "trackers": trackers, "config_changes": changes_from_defaults(cfg)}


def start_process_group(cfg: CfgNode) -> tuple[DistEnv, list[dict]]:
    """Meet the other ranks (fast start-up check), and return where each one runs."""
    d = cfg.DIST
    stall_s = stall_seconds(d.STALL_S, d.TIMEOUT_S)
    env = setup_distributed(d.BACKEND, d.TIMEOUT_S, join_timeout_s=d.INIT_CHECK_TIMEOUT_S, stall_s=stall_s)
    return env, check_group(env, d.INIT_CHECK_TIMEOUT_S)


def out_dir_lock(cfg: CfgNode) -> OutDirLock:
    """The lock of this run's OUT_DIR: a requeued or restarted job waits for its predecessor to let go."""
    return OutDirLock(cfg.OUT_DIR, cfg.DIST.LOCK_STALE_S, cfg.DIST.LOCK_WAIT_S if is_a_restart() else 0.0)


def make_room(cfg: CfgNode, resumed_from: str | None, epochs_done: int) -> str | None:
    """Rank 0, before a training start writes: a fresh run moves an earlier run's outputs aside, a
    resumed one the records past its checkpoint (records/set_aside.py); what to log, or None."""
    if resumed_from is not None:
        return set_aside_records_after(cfg.OUT_DIR, epochs_done, resumed_from)
    return set_aside_earlier_run(cfg.OUT_DIR, [cfg.CFG_DEST, CKPT_DIR, BEST_NAME, BEST_SHARDED])


def prepare_out_dir(out_dir: str, training: bool = True) -> None:
    """Create OUT_DIR (and its checkpoints folder) and prove it writable, or raise a ConfigError naming it."""
    try:
        os.makedirs(os.path.join(out_dir, CKPT_DIR) if training else out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"OUT_DIR: cannot write to {out_dir}: {e.strerror or e}") from None
