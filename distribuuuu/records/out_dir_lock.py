"""One run per OUT_DIR at a time: a lock file that names its holder and goes stale with it.

Two runs in one OUT_DIR (a command launched twice, a requeued job whose predecessor has not
exited) would overwrite each other's checkpoints and records. So a run holds ``OUT_DIR/.lock``
from before it reads the folder until it ends. What the lock relies on works on the shared file
systems clusters use (NFS included), where ``flock``/``fcntl`` locks may be missing or local to a
host: the holder writes its lock whole under a name of its own and hard-links it to ``.lock``
(``link`` fails if the name exists, atomically, also over NFS), then touches it every
``REFRESH_S`` while it runs. A lock is stale when its holder is gone: on this host, its process no
longer runs; on any host, it has not been touched for ``stale_s``. A stale lock is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from distribuuuu.errors import ConfigError
from distribuuuu.files import temporary_name
from distribuuuu.logger import get_logger

logger = get_logger("out_dir_lock")

LOCK_NAME = ".lock"
REFRESH_S = 30.0  # how often the holder touches its lock: what shows a holder on another host alive
_POLL_S = 1.0


class OutDirBusy(ConfigError):
    """Another run holds OUT_DIR."""


@dataclass(frozen=True)
class Holder:
    """Who holds an OUT_DIR: enough to name the run, and to tell on its host whether it still runs."""

    host: str
    pid: int
    started: float  # time.time() when it took the lock
    process_start: str = ""  # the process's start time (/proc), so a reused pid is not taken for it
    job: str = ""  # SLURM_JOB_ID, if any

    @classmethod
    def this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, time.time(), _process_start(pid), os.environ.get("SLURM_JOB_ID", ""))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        job = f", Slurm job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, since {when}"

    def is_gone(self) -> bool:
        """True if this holder is known to be gone: only a process on this host can be looked at."""
        if self.host != socket.gethostname():
            return False
        start = _process_start(self.pid)
        if start is None:  # cannot tell
            return False
        return start == "" or (bool(self.process_start) and start != self.process_start)


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from /proc); '' if it does not
    run, None where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return ""
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return ""
        except PermissionError:
            pass
        return None


class OutDirLock:
    """Hold ``out_dir`` for this process: ``acquire`` (or OutDirBusy), then ``release`` at the end.

    ``wait_s``: how long to wait for a live holder to let go (a requeued job's predecessor still
    writing its last checkpoint); 0 fails at once. ``stale_s``: how long an untouched lock lasts.
    """

    def __init__(self, out_dir: str, stale_s: float, wait_s: float = 0.0):
        self.out_dir, self.stale_s, self.wait_s = out_dir, stale_s, wait_s
        self.path = os.path.join(out_dir, LOCK_NAME)
        self._made_out_dir = False
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._held = False

    def acquire(self) -> None:
        """Take the lock (a stale one taken over), waiting up to ``wait_s`` for a live holder; else OutDirBusy."""
        self._made_out_dir = not os.path.isdir(self.out_dir)
        deadline = time.monotonic() + self.wait_s
        while not self._try_create():
            holder, raw = self._read()
            if holder is None or self._is_stale(holder):
                self._take_over(raw, holder)
                continue
            if time.monotonic() >= deadline:
                self._remove_made_out_dir()
                raise OutDirBusy(
                    f"OUT_DIR {self.out_dir} is in use by another run ({holder.describe()}; its lock: {self.path}): "
                    "let it finish, give this run its own OUT_DIR, or delete the lock if that run is gone"
                )
            time.sleep(_POLL_S)
        self._refresher = threading.Thread(target=self._refresh, name="out-dir-lock", daemon=True)
        self._refresher.start()
        self._held = True

    def release(self) -> None:
        """Let go of the lock (if it is still ours), and of OUT_DIR if this run made it and left it empty."""
        if not self._held:
            return
        self._held = False
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        holder, _ = self._read()
        if holder is not None and (holder.host, holder.pid) == (socket.gethostname(), os.getpid()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._remove_made_out_dir()

    def _try_create(self) -> bool:
        """Write our lock whole under a name of our own, then link it to ``.lock``: True if it was free."""
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            tmp = temporary_name(self.path)
            with open(tmp, "w") as f:
                json.dump(asdict(Holder.this_process()), f)
        except OSError as e:  # not a folder, not writable: the same line as every other unwritable OUT_DIR
            raise ConfigError(f"OUT_DIR: cannot write to {self.out_dir}: {e.strerror or e}") from None
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _read(self) -> tuple[Holder | None, str]:
        """The lock's holder (None if there is no lock, or it names none) and its raw text."""
        try:
            with open(self.path) as f:
                raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None, ""
        try:
            return Holder(**json.loads(raw)), raw
        except (ValueError, TypeError):  # not a lock this version wrote: nobody to wait for
            return None, raw

    def _is_stale(self, holder: Holder) -> bool:
        try:
            untouched_s = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return True
        return holder.is_gone() or untouched_s > self.stale_s

    def _take_over(self, raw: str, holder: Holder | None) -> None:
        """Remove the stale lock we read (``raw``), never a fresh one another run took over meanwhile."""
        aside = temporary_name(self.path)
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # gone already: try again
        with open(aside) as f:
            moved = f.read()
        if moved != raw:  # another run replaced the stale lock between our read and our rename: put it back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        elif holder is not None:
            logger.warning("OUT_DIR %s: took over the lock of a run that is gone (%s)", self.out_dir, holder.describe())
        os.unlink(aside)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _remove_made_out_dir(self) -> None:
        if self._made_out_dir:
            with contextlib.suppress(OSError):  # not empty: this run wrote into it
                os.rmdir(self.out_dir)


# How many times a scheduler or launcher started this job again: Slurm's requeue count, torchrun's
# restart count, and a restarted JobSet's attempt (its pods' jobset.sigs.k8s.io/restart-attempt
# annotation, which docs/k8s's manifests hand the container as this variable).
RESTART_VARIABLES = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "JOBSET_RESTART_ATTEMPT")


def is_a_restart() -> bool:
    """True for a job that a scheduler requeued or restarted: its predecessor may still hold OUT_DIR."""
    return any(int(os.environ.get(v, "0") or 0) > 0 for v in RESTART_VARIABLES)
