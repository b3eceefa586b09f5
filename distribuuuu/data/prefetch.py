"""Prepare batch k+1 on a thread while the model computes batch k (DATA.DECODER batched).

The caller's thread draws the batches from the loader (with TRAIN.WORKERS 0 the dataset's seeded
draws then stay in the training thread, never beside its own use of the RNG) and hands each to one
prepare thread, which decodes and resamples it on the process's one side stream and records an
event there; the training stream waits on that event, never the host. nvJPEG's one host sync per
batch (device_decode.wait_for_queued_kernels) then blocks the prepare thread on the side stream only,
whatever TRAIN.WORKERS is.

The side stream is made once per device and kept for the process (``side_stream``): the caching
allocator reuses a freed block only on the stream that allocated it, so a stream per pass would
leave each pass's resample memory cached on a stream never used again, and streams come round-robin
from a pool that NCCL draws from too. It is a high-priority one, from the pool NCCL's default
(normal-priority) streams do not use. The prepare thread sets its device before anything else
(``use_device``): a thread starts on device 0, where leaving a stream context would otherwise
create a CUDA context for every rank.

The CUDA lines are the seams at the bottom, no-ops on a CPU, so the same thread logic runs in the
CPU tests. PyTorch has no such stage: DataLoader's pin-memory thread only copies, and a worker
process cannot hold the training process's CUDA context. timm's PrefetchLoader uses a side stream
for the copy alone, in the training thread.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

THREAD_NAME = "distribuuuu-batch-prepare"


def prefetched(batches: Iterable, prepare: Callable, device: torch.device, depth: int = 1) -> Iterator:
    """Yield ``prepare(batch)`` for each batch, prepared up to ``depth`` batches ahead on a thread.

    ``prepare`` must not touch the global RNG (the training thread draws from it meanwhile), so
    the batches' per-sample random steps run after, in the caller's thread. An error, the loader's
    or ``prepare``'s, is raised here at the batch it hit; leaving the loop early ends the thread.
    """
    stream = side_stream(device)
    pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME, initializer=use_device, initargs=(device,))
    pending: collections.deque[Future] = collections.deque()
    source = iter(batches)

    def hand_over() -> bool:
        """Hand the loader's next batch to the thread; False once there is none (or it failed)."""
        try:
            batch = next(source)
        except StopIteration:
            return False
        except Exception as e:  # raised at its turn, after the batches before it
            failed: Future = Future()
            failed.set_exception(e)
            pending.append(failed)
            return False
        pending.append(pool.submit(_prepare_on, stream, prepare, batch))
        return True

    try:
        more = all(hand_over() for _ in range(depth))
        while pending:
            more = more and hand_over()  # batch k + depth handed over before batch k is used
            prepared, event = pending.popleft().result()
            wait_ready(event, prepared, device)
            yield prepared
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _prepare_on(stream, prepare: Callable, batch):
    """``prepare(batch)`` on ``stream``, and the event that marks it done there."""
    with on_stream(stream):
        prepared = prepare(batch)
    return prepared, record_ready(stream)


# --- the CUDA seams -----------------------------------------------------------------------------

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_side_streams_lock = threading.Lock()
_HIGH_PRIORITY = -1  # lower is higher; torch maps it to the device's highest


def side_stream(device: torch.device):
    """The process's side stream on ``device`` (CUDA; None on a CPU), made on first use and kept."""
    if device.type != "cuda":
        return None
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    with _side_streams_lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device, priority=_HIGH_PRIORITY)
        return _side_streams[device]


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a thread starts on device 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def on_stream(stream):
    """The block runs on ``stream`` (None: as it is)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def record_ready(stream):
    """An event recorded on ``stream`` now (None on a CPU)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_ready(event, prepared, device: torch.device) -> None:
    """Make the current (training) stream wait for ``event``, and tell the caching allocator that
    ``prepared``'s tensors are used there, so their memory is not reused before it is done."""
    if event is None:
        return
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for tensor in getattr(prepared, "tensors", lambda: [])():
        if tensor.is_cuda:
            tensor.record_stream(current)
