"""The Checkpointer: a run's checkpoints in one place, as torchtitan's ``CheckpointManager`` keeps them.

It owns where they go (OUT_DIR/checkpoints, the best weights beside), their format (``formats.py``),
saving them (now, or in a background thread with one write in flight, its error raised at the next
wait on every rank), pruning to the newest ``keep``, finding the newest good one to resume, and
loading one. The trainer hands it a run's components (``training/components.py``) and never sees a
file name; nothing here knows what a run is.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from distribuuuu.checkpointing.background_write import BackgroundWriter
from distribuuuu.checkpointing.checkpoint import find_resumable, prune_checkpoints
from distribuuuu.checkpointing.formats import Components, Format, format_of
from distribuuuu.checkpointing.names import CKPT_DIR, checkpoint_name
from distribuuuu.runtime.process_group import is_main_process, rank0_decides

logger = logging.getLogger(__name__)


class Checkpointer:
    """Checkpoints of one run, in ``fmt``, under ``out_dir``; ``background``: writes in a thread."""

    def __init__(self, out_dir: str, fmt: Format, keep: int, background: bool = False):
        self.ckpt_dir = os.path.join(out_dir, CKPT_DIR)
        self.best_path = os.path.join(out_dir, fmt.best_name)
        self.format, self.keep = fmt, keep
        self.writer = BackgroundWriter() if background else None

    def path(self, epoch: int, step_in_epoch: int = 0) -> str:
        """Where the checkpoint after ``epoch`` (1-based), or ``step_in_epoch`` steps into it, goes."""
        return os.path.join(self.ckpt_dir, checkpoint_name(epoch, step_in_epoch, self.format.suffix == ".dcp"))

    def save(self, components: Components, epoch: int, step_in_epoch: int, is_best: bool, background: bool) -> str:
        """Write ``components`` (and, ``is_best``, their weights as the best); every rank calls this.

        Returns once it is on disk, unless ``background`` and the Checkpointer writes in the
        background: the state is then copied to host memory and written while training goes on.
        Either way the write in flight is waited for first (one at a time), its error raised here.
        """
        self.wait()
        path, writer = self.path(epoch, step_in_epoch), self.writer if background else None
        finish = self.format.save(components, path, self.best_path if is_best else None, writer)
        if writer is None:
            rank0_decides(lambda: self._complete(finish, path, is_best))  # every rank stops on a failed write
            return path
        if finish is not None:  # this rank has a part to write: rank 0's file, or every rank's shards
            writer.submit(lambda: self._complete(finish, path, is_best))
        logger.info("writing %s%s in the background", path, " (best)" if is_best else "")
        return path

    def _complete(self, finish: Callable[[], None] | None, path: str, is_best: bool) -> None:
        """Finish the write, then (rank 0) prune the old checkpoints and say it is saved. Keeping one,
        the new one is read back first: the previous one, the only other a resume could take, goes
        only once it does (a failed check is the run's error, and the previous one stays)."""
        if finish is not None:
            finish()
        if self.keep == 1 and is_main_process():
            self.format.check_written(path)
        prune_checkpoints(self.ckpt_dir, self.keep, self.format.name)
        logger.info("saved %s%s", path, " (best)" if is_best else "")

    def wait(self) -> None:
        """Return once the write in flight is on disk (collective); a failed write raises its error on every rank.

        Each rank joins its own writer (rank 0 alone writes a single file; every rank its DCP
        shards), then rank 0's outcome is every rank's.
        """
        if self.writer is None:
            return
        failure = None
        try:
            self.writer.wait()
        except Exception as e:
            failure = e

        def outcome() -> None:
            if failure is not None:
                raise failure

        rank0_decides(outcome)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """The block's background writes are on disk when it ends: at a clean exit waited for on every
        rank (a failed write raised on all); on an error, this rank alone lets its write in flight
        finish (no collective: a peer may be gone) and logs its failure."""
        try:
            yield
        except BaseException:
            if self.writer is not None:
                try:
                    self.writer.wait()
                except Exception as e:
                    logger.error("the checkpoint being written when the run failed was not written: %s", e)
            raise
        self.wait()

    def find_resumable(self) -> tuple[str, dict] | tuple[None, dict]:
        """Rank 0: the newest checkpoint that verifies (broken newer ones moved aside; of both formats
        at one position, this format's) and its small state (epoch, cfg); (None, {}) when there is none."""
        small: dict[str, dict] = {}

        def verify(candidate: str) -> None:
            small[candidate] = format_of(candidate).small_state(candidate)

        path = find_resumable(self.ckpt_dir, verify=verify, prefer=self.format.suffix)
        return (path, small[path]) if path is not None else (None, {})

    def load(self, components: Components, path: str) -> None:
        """Put the checkpoint at ``path`` (either format) into ``components``; every rank calls this."""
        format_of(path).load(components, path)
