"""Start the test suite's Python processes without paying the interpreter's start-up each time.

Importing torch and torchvision costs 3-6 s of CPU per process (torchvision.ops pulls in
torch._dynamo), and the suite starts several hundred processes. A server process imports the
heavy modules once, then forks a child per launch. It is single threaded, so a fork of it is as
safe as a fresh interpreter (forking torchrun's agent, which runs store threads, is not: its
workers are forked from the server too). Clients reach it over a Unix socket named by
``DISTRIBUUUU_ZYGOTE`` and pass their stdin/stdout/stderr with the request, so the child writes
where a subprocess would:

- ``helpers.Started`` sends ``python script.py ...``/``python -m module ...`` launches (a torchrun
  agent included) and waits for the exit status;
- torchrun starts ``python -S tests/zygote.py script.py ...`` as each worker (``--no-python``): a
  client of a few milliseconds that has the worker forked, forwards the signals it receives, and
  exits as the worker did. Without a server (a launch that did not come through ``Started``) it
  becomes the worker itself, a fresh interpreter with its own pid. If a client dies, the server
  kills its worker's process group.

Each child takes the request's environment, working directory, argv and ``sys.path``, leads a
session of its own, runs the script as ``__main__`` and then leaves through the interpreter's own
exit path (the server's frames left first, then ``SystemExit`` or an error raised to the top):
threading's exit hooks and the joining of non-daemon threads, ``atexit``, the flushing of the
streams, the exit code or the traceback, exactly as a fresh interpreter ends. (The first version of this server re-created that
ending by hand, skipped threading's exit hooks and so hung on the idle worker threads that
``torch.compile``'s thread pool leaves behind.)

What a fork cannot redo is what the preloaded modules read from the environment on import. The
server refuses a launch (the caller then starts a fresh interpreter) whose environment differs from
its own in a variable that torch, OpenMP or Python read at start-up (``_STARTUP_PREFIXES``), or
whose ``sys.path`` would import ``distribuuuu`` from elsewhere. The OpenMP thread count is set from
``OMP_NUM_THREADS`` in the child, and Python's and numpy's global generators are reseeded as a
fresh interpreter's are. Forked processes share the server's string-hash seed, where fresh ones each
draw their own. ``DISTRIBUUUU_TEST_FORK=0`` starts every process as a fresh interpreter, and so
does a server that cannot start (``stop``'s account then says why).

Standard library only at the top: the worker client runs with ``python -S``.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

# The modules the server imports: these first, then frozen with the plot's (``_freeze_the_preloaded``),
PRELOAD_FROZEN = [
    "torch",
    "torch.distributed.run",
    "torch.distributed.checkpoint",
    "torch.utils.tensorboard",
    "yacs.config",
]
# then these, unfrozen: torchvision imports torch._dynamo, which imports triton.
PRELOAD_AFTER = ["torchvision", "distribuuuu.utils", "distribuuuu.trainer"]
ENABLED = os.environ.get("DISTRIBUUUU_TEST_FORK", "1") != "0"
ADDRESS_VAR = "DISTRIBUUUU_ZYGOTE"
# Read once at start-up by the interpreter, torch or the OpenMP/MKL runtimes: a launch whose value
# differs from the server's is started fresh. (OMP_NUM_THREADS is set in the child; the torchrun
# agent's TORCHELASTIC_* and TORCH_NCCL_* variables are read when used, not on import.)
_STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_", "GOMP_", "CUDA_", "LD_", "MPL")
_READ_WHEN_USED = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
_FORK_HANDLES = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH", "PYTHONFAULTHANDLER"}
_HEADER = struct.Struct("!Q")  # request length / child pid (0: refused) / wait status
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_START_ENV = dict(os.environ)  # the server's, before its imports add their own (TORCHINDUCTOR_CACHE_DIR)
_lock = threading.Lock()
_server: subprocess.Popen | None = None
_log = None
_failed = ""  # why the server could not start: launches run fresh
_address = ""


# ---------------------------------------------------------------------------------------------
# The caller's side: commands that can be forked, the server's address, one launch
# ---------------------------------------------------------------------------------------------
def forkable(cmd: list[str]) -> bool:
    """``python script.py ...`` or ``python -m module ...`` with this interpreter and no flags."""
    if not ENABLED or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    return cmd[1] == "-m" and len(cmd) > 2 or not cmd[1].startswith("-")


def torchrun_options() -> list[str]:
    """torchrun options that start each worker through the client (nothing when disabled)."""
    return ["--no-python"] if ENABLED else []


def torchrun_worker(script: str) -> list[str]:
    """The worker command torchrun runs for ``script`` (after ``torchrun_options``)."""
    return [sys.executable, "-S", __file__, script] if ENABLED else [script]


def address() -> str:
    """The server's socket path, or "" if forking is off or the server could not start (every
    launch then runs fresh; ``stop`` says why). The server starts on first use, ends with ``stop``."""
    global _server, _address, _log
    with _lock:
        if not ENABLED or _failed:
            return ""
        if _server is None:
            _address = os.path.join(tempfile.mkdtemp(prefix="distribuuuu-zygote-"), "socket")
            # Without OMP_NUM_THREADS the server's default thread count is a fresh interpreter's.
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            _log = tempfile.TemporaryFile()  # the server's account of what it did (``stop``)
            _server = subprocess.Popen(
                [sys.executable, __file__, "--serve", _address],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=_log, env=env,
            )  # fmt: skip
            if _server.stdout.readline() != b"ready\n":
                _fail(f"the server did not start (exit {_server.wait()}); every launch runs fresh")
                return ""
        return _address


def _fail(reason: str) -> None:
    global _failed
    _failed = reason
    print(f"zygote.py: {reason}", file=sys.stderr, flush=True)


def stop(timeout: float = 60) -> str:
    """End the server (it kills what it forked and still runs): its account of the launches it
    forked and the ones it refused; empty if it never started."""
    global _server
    with _lock:
        if _server is None:
            return _failed
        _server.stdin.close()
        try:
            _server.wait(timeout)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
        _server = None
        _log.seek(0)
        account = _log.read().decode(errors="replace")
        _log.close()
        return account + (_failed and f"{_failed}\n")


class Launch:
    """A request to fork ``args``: ``pid`` is the child's, or 0 when the server refused it (the
    caller starts a fresh interpreter instead); ``wait`` gives its exit status."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(env.get(ADDRESS_VAR) or address())
        request = json.dumps({"args": args, "env": env, "cwd": cwd}).encode()
        socket.send_fds(self.sock, [_HEADER.pack(len(request))], list(fds))
        self.sock.sendall(request)
        self.pid = _HEADER.unpack(_recv_exactly(self.sock, _HEADER.size))[0]
        if not self.pid:
            self.sock.close()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: the signal that ended it), or None after ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            status = _HEADER.unpack(_recv_exactly(self.sock, _HEADER.size))[0]
        except TimeoutError:
            return None
        self.sock.close()
        return os.waitstatus_to_exitcode(status)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the zygote server closed the connection")
        data += chunk
    return data


def _worker_client(argv: list[str]) -> None:
    """torchrun's worker: have ``python script.py ...`` forked, relay signals, exit as it did; or,
    with no server to ask or a refusal, become that process."""
    cmd = [sys.executable, *argv]
    launch = Launch(cmd, dict(os.environ), os.getcwd(), (0, 1, 2)) if os.environ.get(ADDRESS_VAR) else None
    if launch is None or not launch.pid:
        os.execv(sys.executable, cmd)

    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):  # the worker ended meanwhile
            os.kill(launch.pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    code = launch.wait()
    # The worker has ended: a later signal (torchrun's SIGTERM to the workers it thinks still run,
    # once another exited) must not end this client with another status than the worker's. SIG_IGN:
    # the interpreter's finalisation resets Python handlers to the default action, not SIG_IGN.
    for sig in _FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# The server: one thread, a fork per request, exit statuses back to the clients
# ---------------------------------------------------------------------------------------------
def _warm_the_plot() -> None:
    """Every finished training run draws OUT_DIR/metrics.png (distribuuuu.records.plots): with pyplot
    imported and its font loaded here, a forked run's plot costs ~0.6 s instead of ~2 s."""
    try:
        import matplotlib
    except ImportError:  # the optional "plot" extra: the runs then draw nothing
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))  # text, and mathtext's parser for a log axis's labels
    ax.set_title("loss")
    ax.plot([1, 2], [0.1, 10])
    ax.set_yscale("log")
    fig.canvas.draw()
    plt.close(fig)


def _freeze_the_preloaded() -> None:
    """Move the objects imported so far (~340,000) to the collector's permanent generation, as
    ``gc.freeze``'s documentation advises for a fork server: a child's collections, and the one at
    its exit, then skip them and do not write to (so copy) their pages. test_finished_run and
    test_launch took 61-82 CPU-s against 99-110 without it (2 runs each, AMD EPYC, 2 vCPUs).

    Not triton's objects: a frozen nanobind type is never freed, and nanobind reports it at exit
    ("nanobind: leaked 64 types!"), which a fresh interpreter does not. So the freeze comes before
    the import of torchvision (torch._dynamo imports triton); with every module frozen the same two
    files took about 40% less CPU instead of a quarter to a third.
    """
    import gc

    if "triton" not in sys.modules:  # a torch that imports it itself: no freeze, forks stay fresh-like
        gc.freeze()


def _serve(path: str) -> None:
    import importlib

    here = os.path.dirname(os.path.abspath(__file__))
    own_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path if p != here and p not in own_path]  # a fresh interpreter's, less PYTHONPATH
    for name in PRELOAD_FROZEN:
        importlib.import_module(name)
    _warm_the_plot()
    _freeze_the_preloaded()
    for name in PRELOAD_AFTER:
        importlib.import_module(name)
    # (numpy's OpenBLAS starts a native thread pool on import, and stops it around a fork itself.)
    if threading.active_count() != 1:
        sys.exit("zygote.py: importing the preloaded modules started threads; a fork of this process is unsafe")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # EOF: the test session has ended
    selector.register(wake_r, selectors.EVENT_READ)
    clients: dict[int, socket.socket] = {}  # child pid -> its client
    forked = 0
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    pid = _fork(conn, base_path, [selector, listener, wake_r, wake_w, *clients.values()])
                except (OSError, ValueError, struct.error):  # a client gone before its request was whole
                    conn.close()
                    continue
                if not pid:
                    with contextlib.suppress(OSError):
                        conn.sendall(_HEADER.pack(0))
                    conn.close()
                    continue
                clients[pid], forked = conn, forked + 1
                selector.register(conn, selectors.EVENT_READ, pid)  # readable: the client hung up
                with contextlib.suppress(OSError):
                    conn.sendall(_HEADER.pack(pid))
            elif key.fileobj is sys.stdin:
                print(f"forked {forked} launches; {len(clients)} still running killed", file=sys.stderr)
                for pid in clients:
                    _kill_group(pid)
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
                return
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(clients, selector)
            else:  # the client hung up before its child ended: end the child too
                selector.unregister(key.fileobj)
                _kill_group(key.data)


def _reap(clients: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is None:
            continue
        with contextlib.suppress(KeyError):  # unregistered already if its client hung up
            selector.unregister(conn)
        with contextlib.suppress(OSError):  # a client that hung up gets no status
            conn.sendall(_HEADER.pack(status))
        conn.close()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _fork(conn: socket.socket, base_path: list[str], server_fds: list) -> int:
    """Fork the request's child: its pid in the server, 0 if refused. In the child, never returns."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    try:
        request = json.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
        args, env, cwd = request["args"], request["env"], request["cwd"]
        path = _child_path(args, env, cwd, base_path)
        refusal = _refusal(env, path)
        if refusal:
            print(f"started fresh: {' '.join(args)[:200]}: {refusal}", file=sys.stderr, flush=True)
        pid = -1 if refusal else os.fork()
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    if pid != 0:  # the server: the child's pid, or -1 when refused
        for fd in fds:
            os.close(fd)
        return max(pid, 0)
    try:
        signal.set_wakeup_fd(-1)
        for item in [conn, *server_fds]:
            item.close() if hasattr(item, "close") else os.close(item)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _become(args, env, cwd, path)
    except BaseException:
        os._exit(70)
    raise _Child(args)  # out of the server's frames, past its handlers; runs at the top (below)


class _Child(BaseException):
    """Raised in a forked child to leave the server's loop and run the launch (``args[0]``)."""


def _child_path(args: list[str], env: dict[str, str], cwd: str, base_path: list[str]) -> list[str]:
    """The ``sys.path`` a fresh ``python script.py``/``python -m module`` would start with."""
    first = cwd if args[1] == "-m" else os.path.dirname(os.path.abspath(os.path.join(cwd, args[1])))
    extra = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *(p for p in base_path if p not in (first, *extra))]


def _refusal(env: dict[str, str], path: list[str]) -> str:
    """Why a fork of the server would not be the process a fresh interpreter with ``env`` and
    ``path`` would be; empty if it would."""
    import importlib.machinery

    def startup(environ) -> dict[str, str]:
        return {
            k: v
            for k, v in environ.items()
            if k.startswith(_STARTUP_PREFIXES) and not k.startswith(_READ_WHEN_USED) and k not in _FORK_HANDLES
        }

    ours, theirs = startup(_START_ENV), startup(env)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        return f"start-up variables differ: {', '.join(differ)}"
    spec = importlib.machinery.PathFinder.find_spec("distribuuuu", path)
    if spec is None or spec.origin != sys.modules["distribuuuu"].__file__:
        return (
            f"its sys.path imports distribuuuu from {spec and spec.origin}, not {sys.modules['distribuuuu'].__file__}"
        )
    return ""


def _become(args: list[str], env: dict[str, str], cwd: str, path: list[str]) -> None:
    """Take the launch's signal dispositions, priority, directory, environment, streams, threads,
    generators, ``sys.path`` and ``sys.argv``, as a fresh interpreter starting ``args`` has them."""
    import faulthandler
    import random

    handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}  # as Python sets
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, handlers.get(sig, signal.SIG_DFL))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        stream.reconfigure(line_buffering=True, write_through=bool(env.get("PYTHONUNBUFFERED")))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    random.seed()  # a fresh interpreter seeds these from the OS
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.path[:] = path
    sys.argv = [args[2], *args[3:]] if args[1] == "-m" else args[1:]


def _run(args: list[str]) -> None:
    """Run the script or module as ``__main__``; whatever it raises goes on up, as in a fresh
    interpreter (``SystemExit`` included); a normal end exits with 0."""
    import runpy

    if args[1] == "-m":
        sys.modules.pop(args[2], None)  # preloaded (its imports are what saves the time): run anew, as fresh
        runpy.run_module(args[2], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args[1], run_name="__main__")
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        launch = None
        try:
            _serve(sys.argv[2])
        except _Child as child:
            launch = child.args[0]
        if launch:  # a forked child, outside the except block: no exception context to chain to
            _run(launch)
    else:
        _worker_client(sys.argv[1:])
