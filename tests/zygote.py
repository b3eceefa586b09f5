"""Start the test suite's Python processes without paying the interpreter's start-up each time.

Importing torch and torchvision costs ~5 s of CPU per process (torchvision.ops pulls in
torch._dynamo); the suite starts a few hundred processes, so start-up alone took a third of it.
A server process imports the heavy modules once, then forks a child per launch; it is single
threaded, so a fork of it is as safe as a fresh interpreter (forking torchrun's agent, which
runs store threads, aborted now and then). Clients reach it over a Unix socket named by
``DISTRIBUUUU_ZYGOTE`` and pass their stdin/stdout/stderr with the request, so the child writes
where a subprocess would:

- ``helpers.run`` sends ``python script.py ...``/``python -m module ...`` launches (a torchrun
  agent included) and waits for the exit status;
- torchrun starts ``python -S tests/zygote.py script.py ...`` as each worker (``--no-python``): a
  client of a few milliseconds that has the worker forked, forwards the signals it receives,
  and exits as the worker did. If the client dies, the server kills the worker's process group.

Each child takes the request's environment, working directory, argv and ``sys.path``, leads a
session of its own (as torchrun's workers and ``helpers.run``'s processes do), runs the script as
``__main__``, and ends as the interpreter would: non-daemon threads joined, ``atexit`` handlers
run, the code of ``SystemExit``, or 1 after a traceback. What a fork cannot redo is what the
preloaded modules read from the environment on import: only torch, torchvision, the torchrun
agent and distribuuuu (which reads the environment when called) are preloaded, and the OpenMP
thread count, read once at start-up, is set from ``OMP_NUM_THREADS`` in the child.
``DISTRIBUUUU_TEST_FORK=0`` starts every process as a fresh interpreter.

Standard library only at the top: the worker client runs with ``python -S``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

PRELOAD = ["torch", "torchvision", "torch.distributed.run", "distribuuuu.utils", "distribuuuu.trainer"]
ENABLED = os.environ.get("DISTRIBUUUU_TEST_FORK", "1") != "0"
ADDRESS_VAR = "DISTRIBUUUU_ZYGOTE"
IDLE_VAR = "DISTRIBUUUU_TEST_IDLE"  # set: the child runs at idle CPU priority (helpers.background)
_HEADER = struct.Struct("!Q")  # request length / child pid / wait status
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_lock = threading.Lock()
_server: subprocess.Popen | None = None
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
    """torchrun options that start each worker as a fork of the server (nothing when disabled)."""
    return ["--no-python"] if ENABLED else []


def torchrun_worker(script: str) -> list[str]:
    """The worker command torchrun runs for ``script`` (after ``torchrun_options``)."""
    return [sys.executable, "-S", __file__, script] if ENABLED else [script]


def address() -> str:
    """The server's socket path; the server is started on first use and ends with this process."""
    global _server, _address
    with _lock:
        if _server is None:
            _address = os.path.join(tempfile.mkdtemp(prefix="distribuuuu-zygote-"), "socket")
            # Without OMP_NUM_THREADS the server's default thread count is a fresh interpreter's.
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            _server = subprocess.Popen(
                [sys.executable, __file__, "--serve", _address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
            if _server.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the zygote server did not start (exit {_server.wait()})")
        return _address


class Launch:
    """A child forked by the server: its pid, and its exit status once it ends."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int]):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(env.get(ADDRESS_VAR) or address())
        request = json.dumps({"args": args, "env": env, "cwd": cwd}).encode()
        socket.send_fds(self.sock, [_HEADER.pack(len(request))], list(fds))
        self.sock.sendall(request)
        self.pid = _HEADER.unpack(_recv_exactly(self.sock, _HEADER.size))[0]

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code (negative: the signal that ended it), or None after ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            status = _HEADER.unpack(_recv_exactly(self.sock, _HEADER.size))[0]
        except TimeoutError:
            return None
        self.sock.close()
        return os.waitstatus_to_exitcode(status)


def become_idle() -> None:
    """Run at idle CPU priority (SCHED_IDLE): only on a core that nothing else wants."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the zygote server closed the connection")
        data += chunk
    return data


def _worker_client(argv: list[str]) -> None:
    """torchrun's worker: have ``python script.py ...`` forked, relay signals, exit as it did."""
    if ADDRESS_VAR not in os.environ:
        sys.exit(f"zygote.py: {ADDRESS_VAR} is not set: launch the job with helpers.run")
    launch = Launch([sys.executable, *argv], dict(os.environ), os.getcwd(), (0, 1, 2))
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(launch.pid, signum))
    code = launch.wait()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# The server: one thread, a fork per request, exit statuses back to the clients
# ---------------------------------------------------------------------------------------------
def _serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
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
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    pid = _fork(conn, [selector, listener, wake_r, wake_w, *clients.values()])
                except (OSError, ValueError, struct.error):  # a client gone before its request was whole
                    conn.close()
                    continue
                clients[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)  # readable: the client hung up
                with contextlib.suppress(OSError):
                    conn.sendall(_HEADER.pack(pid))
            elif key.fileobj is sys.stdin:
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


def _fork(conn: socket.socket, server_fds: list) -> int:
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    try:
        request = json.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:
        signal.set_wakeup_fd(-1)
        for item in [conn, *server_fds]:
            item.close() if hasattr(item, "close") else os.close(item)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _run(request["args"], request["env"], request["cwd"])
    finally:
        os._exit(70)  # _run ends with os._exit; only a failure before it reaches here


def _run(cmd: list[str], env: dict[str, str], cwd: str) -> None:
    """Become ``cmd`` (see ``forkable``) as a fresh interpreter would, then exit."""
    handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}  # as Python sets
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, handlers.get(sig, signal.SIG_DFL))
    if env.get(IDLE_VAR):
        become_idle()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        stream.reconfigure(line_buffering=True, write_through=bool(env.get("PYTHONUNBUFFERED")))
        setattr(sys, name, stream)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    module = cmd[2] if cmd[1] == "-m" else None
    first = cwd if module else os.path.dirname(os.path.abspath(cmd[1]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *(p for p in sys.path if p not in (first, *extra))]
    sys.argv = [cmd[2], *cmd[3:]] if module else cmd[1:]
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(cmd[1], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    os._exit(_finish(code))


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What the interpreter does at exit: wait for non-daemon threads, run the atexit handlers."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve(sys.argv[2])
    else:
        _worker_client(sys.argv[1:])
