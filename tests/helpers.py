"""Shared test helpers: tools in this process, real time-bounded launches, every rank in one process."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import processes
from models import TINY_ARCH
from PIL import Image

from distribuuuu.runtime.launcher import find_free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "tools" / "train_net.py")
TEST = str(REPO / "tools" / "test_net.py")
RESNET18 = str(REPO / "config" / "resnet18.yaml")  # the design card's config (unit and integration tests)

# Small, fast settings for runs that test behaviour rather than accuracy: a light torchvision model
# (one training step at 16 px, batch 32, one thread: 61 ms against resnet18's 240 ms here); no plot (~1 s).
FAST_ARCH = "shufflenet_v2_x0_5"
FAST = ["MODEL.ARCH", FAST_ARCH, "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "10",
        "LOG.PLOT", "False"]  # fmt: skip
# Smaller still, for runs whose property holds for any model: tests/models.py's tiny CNN (registered
# here by conftest, in a launch by tiny_train.py: train_net.py with fault hooks; ONNX export 2 s, not 12).
TINY_TRAIN = str(REPO / "tests" / "scripts" / "tiny_train.py")
EVAL_TINY = ["MODEL.ARCH", TINY_ARCH, "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16"]
# Synthetic images: no decoding, for the tests that only need the loop to run.
DUMMY_OPTS = ["MODEL.DUMMY_INPUT", "True", "DATA.DUMMY_SIZE", "64", "TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "64",
              "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16", "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "1", "LOG.PLOT", "False"]  # fmt: skip

# fp32: FSDP2 reduce-scatters where DDP all-reduces (HSDP: within, then across nodes): the same gradients
# summed in another order, a few ulps (2**-23) apart a step; over ~22 steps of SGD with momentum, clipping,
# mixup, far below 2**-14 of each tensor's largest value (2**-22.2 here); HSDP without its all-reduce: 1.0.
DDP_FSDP_REL = 2**-14

ERROR_PREFIX = "distribuuuu: error:"  # how a tool's one-line error starts

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without launcher variables, one thread, the repo importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_", "TORCHELASTIC_"))
    }
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def lone_env(**extra: str) -> dict[str, str]:
    """``clean_env`` with a thread per core: for runs not compared bit for bit with a run of another
    thread count (a kernel's sums may round otherwise with more threads)."""
    env = clean_env(**extra)
    del env["OMP_NUM_THREADS"]
    return env


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; kill it and every process it started if it outlives ``timeout``."""
    with Started(cmd, env, cwd) as started:
        return started.result(timeout)


def in_process(script: str, *args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``python script *args`` in this process, as ``run`` would in a new one (and ~5 s of imports
    sooner): the tool's own ``__main__``, its stdout/stderr (file descriptors included) and exit code,
    with the environment, working directory, thread count, signal handlers, RNGs and loggers put back.
    From the main thread, one at a time: the environment, directory and descriptors are the process's."""
    assert threading.current_thread() is threading.main_thread(), "in_process runs on the main thread only"
    with contextlib.ExitStack() as stack:
        stack.enter_context(_restored_process_state(env or clean_env(), cwd))
        out, err = stack.enter_context(_captured_fds())
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else (print(e.code, file=sys.stderr) or 1)
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess([sys.executable, script, *args], code or 0, out.text, err.text)


@contextlib.contextmanager
def _restored_process_state(env: dict, cwd: Path) -> Iterator[None]:
    import random
    from multiprocessing import resource_tracker

    import torch
    import torch.distributed as dist

    tracker_running = resource_tracker._resource_tracker._fd is not None  # a spawn start would start it
    saved_env, saved_cwd, saved_argv, saved_path = dict(os.environ), os.getcwd(), sys.argv[:], sys.path[:]
    saved_threads, saved_rng = (
        torch.get_num_threads(),
        (random.getstate(), np.random.get_state(), torch.get_rng_state()),
    )
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
    saved_signals = {sig: signal.getsignal(sig) for sig in signals}
    loggers = {name: logging.getLogger(name) for name in ("", "distribuuuu")}
    saved_loggers = {name: (log.handlers[:], log.level, log.propagate) for name, log in loggers.items()}
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", saved_threads)))
    try:
        with warnings.catch_warnings():
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if not tracker_running:  # started by a tool that spawned workers (--nproc): it would outlive the test
            resource_tracker._resource_tracker._stop()
        for name, log in loggers.items():
            for handler in set(log.handlers) - set(saved_loggers[name][0]):
                handler.close()
            log.handlers, log.level, log.propagate = saved_loggers[name]
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        torch.set_rng_state(saved_rng[2])
        torch.set_num_threads(saved_threads)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path


@contextlib.contextmanager
def _captured_fds() -> Iterator[tuple[types.SimpleNamespace, types.SimpleNamespace]]:
    """stdout and stderr, at the file descriptors (DataLoader workers write there too), into files: ``.text`` after."""
    captured = tuple(types.SimpleNamespace(file=tempfile.TemporaryFile(), text="") for _ in range(2))
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        stream.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    try:
        for fd, c in zip((1, 2), captured):
            os.dup2(c.file.fileno(), fd)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, encoding="utf-8", closefd=False) for fd in (1, 2))
        yield captured
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        for c in captured:
            c.file.seek(0)
            c.text = c.file.read().decode(errors="replace")
            c.file.close()


class Started(contextlib.AbstractContextManager):
    """``cmd`` started in a session of its own: ``out``/``err`` its output files (``stdout``: a descriptor
    instead), ``result`` waits for its end, ``close`` kills every process it started, in any session:
    each carries its tag (tests/processes.py; torchrun's workers lead sessions of their own)."""

    def __init__(self, cmd: list[str], env: dict | None = None, cwd: Path = REPO, stdout=None):
        self.cmd, self.tag, self._dir = cmd, processes.new_launch_tag(), tempfile.TemporaryDirectory()
        self.out, self.err = Path(self._dir.name, "stdout"), Path(self._dir.name, "stderr")
        env = {**(env or clean_env()), processes.LAUNCH_VAR: self.tag}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self._proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out if stdout is None else stdout, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        self.pid = self._proc.pid

    def __exit__(self, *exc) -> None:
        self.close()

    def output(self) -> tuple[str, str]:
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def tail(self) -> str:
        return "stdout:\n{}\nstderr:\n{}".format(*(text[-3000:] for text in self.output()))

    def poll(self) -> int | None:  # its exit code if it has ended, else None (at once)
        return self._proc.poll()

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait at most ``timeout`` seconds from now; the finished process, or AssertionError (with
        its output and the processes it left) after killing it and them."""
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            left = self._kill()
            killed = "".join(f"\n  {process}" for process in left)
            raise AssertionError(
                f"{self.cmd} did not finish in {timeout}s; killed {len(left)} process(es):{killed}\n{self.tail()}"
            ) from None
        return subprocess.CompletedProcess(self.cmd, code, *self.output())

    def wait_until(self, predicate, timeout: float, what: str) -> float:
        """Poll ``predicate`` until true; the seconds it took. Fails naming ``what`` if it ends first."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if predicate():
                return time.monotonic() - start
            if self.poll() is not None:
                raise AssertionError(f"exited {self.poll()} before {what}\n{self.tail()}")
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout}s\n{self.tail()}")

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the processes it started with a RANK (torchrun's workers), from /proc."""
        return {
            int(dict(v.split("=", 1) for v in process.environ)["RANK"]): process.pid
            for process in processes.tagged(processes.LAUNCH_VAR, self.tag)
            if process.ppid == self.pid and any(v.startswith("RANK=") for v in process.environ)
        }

    def close(self) -> None:
        self._kill()
        self._dir.cleanup()

    def _kill(self) -> list[processes.Process]:
        left = processes.kill_tagged(processes.LAUNCH_VAR, self.tag)
        self._proc.wait()
        return left


def torchrun(nproc: int, script: str, *args: str, extra: list[str] = ()) -> list[str]:
    """A torchrun command line on 127.0.0.1 with a free port (``extra``: torchrun options)."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
        f"--master_port={find_free_port()}", *extra, script, *args,
    ]  # fmt: skip


def run_torchrun(nproc: int, script: str, *args: str, timeout: float = 300, env: dict | None = None, cwd: Path = REPO):
    """``run(torchrun(nproc, script, *args))`` with torchrun's agent run in this process (``hosted``)."""
    return hosted(torchrun(nproc, script, *args)[3:], timeout, env, cwd)


def hosted(torchrun_args: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO):
    """torchrun's agent (``torch.distributed.run``'s ``__main__``) run by ``in_process``: the same fresh
    workers, ~4 s sooner than an agent interpreter (its torch import and exit). Past ``timeout`` its
    workers (tagged) are killed, which ends the agent, and the test fails."""
    import torch.distributed.run

    tag, killed = processes.new_launch_tag(), []
    timer = threading.Timer(timeout, lambda: killed.extend(processes.kill_tagged(processes.LAUNCH_VAR, tag)))
    timer.start()
    try:
        env = {**(env or clean_env()), processes.LAUNCH_VAR: tag}
        with tempfile.TemporaryDirectory(prefix="torchelastic-") as logs:  # its default folder is never removed
            result = in_process(torch.distributed.run.__file__, f"--log-dir={logs}", *torchrun_args, env=env, cwd=cwd)
    finally:
        timer.cancel()
    assert not killed, (
        f"torchrun {torchrun_args} ran past {timeout}s; killed {len(killed)} worker(s)\n{result.stderr[-3000:]}"
    )
    return result


def two_nodes(nproc: int, script: str, node_args: list[list[str]], timeout: float = 400) -> list:
    """Two torchrun agents as two nodes of ``nproc`` processes on 127.0.0.1 (c10d rendezvous), each with its
    arguments: node 1's agent a process, node 0's hosted here. Either may arrive first, and hold rank 0."""
    endpoint, env = f"127.0.0.1:{find_free_port()}", clean_env()

    def node(rank: int) -> list[str]:
        return [
            "--nnodes=2", f"--nproc_per_node={nproc}", f"--node_rank={rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes", f"--rdzv-conf=join_timeout={int(timeout)}",
            script, *node_args[rank],
        ]  # fmt: skip

    with Started([sys.executable, "-m", "torch.distributed.run", *node(1)], env) as other:
        here = hosted(node(0), timeout, env)
        return [here, other.result(timeout)]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(server: http.server.HTTPServer) -> Iterator[str]:
    """Run ``server`` (bound to 127.0.0.1) in a thread of this process; its URL; shut down after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_folder(folder: Path | str) -> Iterator[str]:
    """``folder`` served by a real HTTP server on 127.0.0.1 (a thread of this process): its URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    with serving(http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        yield url


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, script, *args]


def read_metrics(out_dir: Path | str) -> list[dict]:
    """The records of OUT_DIR/metrics.jsonl."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _without_timings(record: dict) -> dict:
    """A metrics record without its timings (what two runs of the same training share): seconds, rates
    and the telemetry read from clocks (the data share, the ranks' step times, TFLOP/s, MFU, stragglers),
    and its checkpoint's path (each run's own OUT_DIR; the epoch and the weights' hash stay)."""
    from distribuuuu.records.telemetry import EPOCH_FIELDS

    clocked = set(EPOCH_FIELDS) - {"flops_per_image"}  # the FLOPs are counted, not timed
    kept = {
        k: v
        for k, v in record.items()
        if "time" not in k and "per_s" not in k and not k.endswith("_s") and k not in clocked
    }
    if isinstance(kept.get("checkpoint"), dict):
        kept["checkpoint"] = {k: v for k, v in kept["checkpoint"].items() if k != "path"}
    return kept


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    )


def truncated_jpeg(path: Path) -> Path:
    """A JPEG written by PIL, then cut in half: its header opens, its pixels do not decode."""
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def gloo_threads() -> set[int]:
    """The ids of this process's gloo threads (Linux names them gloo_tcp_loop, pt_gloo_runloop): they
    end with their process group's last reference, not with ``destroy_process_group``."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if "gloo" in Path(f"/proc/self/task/{tid}/comm").read_text():
                found.add(int(tid))
    return found


def on_ranks(world_size: int, fn, timeout: float = 120) -> list:
    """``fn(rank)`` on every rank of a ``world_size`` process group of threads of this process (torch's
    test backend "threaded": the real collectives across the threads): the results in rank order, or
    the first rank's error. For collective bookkeeping. The ranks share what a process has once:
    torch's global RNG (a rank drawing augmentations loads under a lock), threads, ``os.environ``."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    results, errors, store = [None] * world_size, [], dist.HashStore()

    def rank_thread(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(e)
            threaded.ProcessLocalGroup.exception_handle(e)  # wakes the ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    threaded._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=rank_thread, args=(rank,), daemon=True) for rank in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), f"a rank of {world_size} still runs after {timeout}s"
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()
        threaded.ProcessLocalGroup.reset()
    if errors:
        raise errors[0]
    return results


class Payload:
    """Unpickling this runs ``fn(*args)``: what a crafted checkpoint does to a plain ``pickle.load``."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class PlainState:
    """A Stateful over a plain dict: DCP saves its tensors, and pickles its other entries."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state.update(state)
