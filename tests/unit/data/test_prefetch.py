"""The prepare thread of DATA.DECODER batched (data/prefetch.py): batches in order, errors at their
batch, one persistent side stream per device, the thread's device set before anything else, and a
thread with or without DataLoader workers. CUDA's streams, events and devices are recording
stand-ins: the same thread logic runs as on a GPU."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from distribuuuu.data import prefetch
from distribuuuu.data.prefetch import THREAD_NAME, prefetched


def _prepare_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_the_prepare_thread_keeps_order_raises_where_it_failed_and_ends_when_left():
    names = set()

    def prepare(x):
        names.add(threading.current_thread().name)
        if x == 5:
            raise ValueError("bad batch 5")
        return x * 10

    assert list(prefetched(range(5), prepare, torch.device("cpu"))) == [0, 10, 20, 30, 40]
    assert len(names) == 1 and names.pop().startswith(THREAD_NAME)
    got = []
    with pytest.raises(ValueError, match="bad batch 5"):
        for x in prefetched(range(8), prepare, torch.device("cpu")):
            got.append(x)
    assert got == [0, 10, 20, 30, 40]
    batches = prefetched(iter(range(100)), prepare, torch.device("cpu"))
    assert next(batches) == 0
    batches.close()  # the training loop left early
    assert not _prepare_threads()


def test_a_failing_loader_is_raised_after_the_batches_before_it():
    def loader():
        yield from (1, 2, 3)
        raise OSError("disk gone at batch 3")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for x in prefetched(loader(), lambda b: b, torch.device("cpu")):
            got.append(x)
    assert got == [1, 2, 3] and not _prepare_threads()


class FakeCuda:
    """Recording stand-ins for torch.cuda's streams, events and current device: ``log`` holds
    (call, detail, thread name) in the order the calls were made."""

    def __init__(self):
        self.log: list[tuple] = []
        self.streams: list[FakeCuda.Stream] = []
        self.events = 0
        cuda = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device, self.priority, self.name = torch.device(device), priority, f"side{len(cuda.streams)}"
                cuda.streams.append(self)
                cuda.record("Stream", (str(self.device), priority))

            def wait_event(self, event):
                cuda.record("wait", event.n)

        class Event:
            def record(self, stream):
                cuda.events += 1
                self.n = cuda.events
                cuda.record("record", (self.n, stream.name))

        self.Stream, self.Event = Stream, Event

    def record(self, call: str, detail) -> None:
        self.log.append((call, detail, threading.current_thread().name))

    @contextlib.contextmanager
    def stream(self, stream):
        self.record("enter stream", stream.name)
        yield
        self.record("leave stream", stream.name)

    def set_device(self, device) -> None:
        self.record("set_device", str(device))

    def current_stream(self, device=None):
        training = self.Stream.__new__(self.Stream)
        training.name = "training"
        return training

    def install(self, monkeypatch) -> FakeCuda:
        for name in ("Stream", "Event", "stream", "set_device", "current_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(prefetch, "_side_streams", {}, raising=False)  # none made yet in this process
        return self


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


class Prepared:
    def __init__(self, n):
        self.n = n

    def tensors(self):
        return []


def test_the_training_stream_waits_on_each_batchs_event_before_it_is_used(fake_cuda):
    # The batch is prepared on the side stream, its event recorded there, and the training stream
    # waits on that event (not the host) and marks the batch's tensors as used by it, before the
    # loop sees the batch.
    for prepared in prefetched(range(3), Prepared, torch.device("cuda", 0)):
        fake_cuda.record("use", prepared.n)
    recorded = [(call, detail) for call, detail, thread in fake_cuda.log if call == "record"]
    assert recorded == [("record", (n, "side0")) for n in (1, 2, 3)]
    assert all(thread.startswith(THREAD_NAME) for call, _, thread in fake_cuda.log if call == "record")
    consumer = [(call, detail) for call, detail, _ in fake_cuda.log if call in ("wait", "use")]
    assert consumer == [("wait", 1), ("use", 0), ("wait", 2), ("use", 1), ("wait", 3), ("use", 2)]


def test_one_high_priority_side_stream_per_device_serves_every_pass(fake_cuda):
    # Train, val and precise-BN passes, epoch after epoch, on two devices (two processes' worth):
    # the caching allocator reuses a freed block only on its own stream, so every pass must use the
    # same one, made once.
    for _ in range(6):
        for device in (torch.device("cuda", 0), torch.device("cuda", 1)):
            assert len(list(prefetched(range(2), Prepared, device))) == 2
    made = [detail for call, detail, _ in fake_cuda.log if call == "Stream"]
    assert sorted(made) == [("cuda:0", -1), ("cuda:1", -1)]  # one each, high priority
    entered = {detail for call, detail, _ in fake_cuda.log if call == "enter stream"}
    assert entered == {"side0", "side1"}


def test_the_prepare_thread_sets_its_device_before_anything_else(fake_cuda):
    # A thread starts on device 0: without set_device first, leaving the stream context restores
    # device 0's stream, and CUDA creates a context on GPU 0 for every rank of the node.
    device = torch.device("cuda", 3)
    list(prefetched(range(3), Prepared, device))
    in_thread = [(call, detail) for call, detail, thread in fake_cuda.log if thread.startswith(THREAD_NAME)]
    assert in_thread[0] == ("set_device", "cuda:3"), in_thread
    assert [call for call, _ in in_thread].count("set_device") == 1  # once, when the thread starts
