"""Prepare batch k+1 on a thread while the model computes batch k (DATA.DECODER batched).

The thread decodes and resamples each batch on its own CUDA stream and records an event; the
training stream waits on that event, never the host. nvJPEG's one host sync per batch
(batched.wait_for_queued_kernels) then blocks this thread on its own stream only. The CUDA lines
are the two seams at the bottom, no-ops on a CPU, so the same thread logic runs in the CPU tests.

PyTorch has no such stage: DataLoader's pin-memory thread only copies, and a worker process cannot
hold the training process's CUDA context. timm's PrefetchLoader uses a side stream for the copy
alone, in the training thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Callable

import torch

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def prefetched(batches: Iterable, prepare: Callable, device: torch.device, depth: int = 1) -> Iterator:
    """Yield ``prepare(batch)`` for each batch, prepared up to ``depth`` batches ahead on a thread.

    ``prepare`` must not touch the global RNG (the training thread draws from it meanwhile), so
    the batches' per-sample random steps run after, in the caller's thread. An error in the
    thread is raised here, at the batch it hit; leaving the loop early ends the thread.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            with side_stream(device) as record_ready:
                for batch in batches:
                    if stop.is_set() or not put((prepare(batch), record_ready())):
                        return
        except BaseException as e:  # handed to the consumer, raised there
            put(_Failed(e))
        put(_END)

    thread = threading.Thread(target=work, name="distribuuuu-batch-prepare", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            prepared, event = item
            wait_ready(event, prepared, device)
            yield prepared
    finally:
        stop.set()
        thread.join()


# --- the CUDA seams -----------------------------------------------------------------------------


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Run the block on a stream of its own (CUDA); yields a function recording an event on it."""
    if device.type != "cuda":
        yield lambda: None
        return
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):

        def record_ready() -> torch.cuda.Event:
            event = torch.cuda.Event()
            event.record(stream)
            return event

        yield record_ready


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
