"""The capture worker: background captures of a device run on one thread that outlives them.

On the CPU with the fake engines, which record on whatever thread the
session runs: the thread of every recording is observed. GPU wakes are
covered by the sleep and background tests, which run on the worker too.
"""

from __future__ import annotations

import gc
import json
import threading
import weakref
from typing import Final

import pytest
import torch
from torch import nn

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager._graphs._thread import CaptureWorker, capture_worker
from tests.capture.test_lean_import_capture import run_fresh

from .helpers import INPUTS, TOL, FakeEngines, FirstRecordingGate, ToyModel, config_for, make_batch, rel_err

CPU: Final = torch.device("cpu")
WAIT_S: Final = 30.0


class _Threads:
    """An ``on_capture`` hook that notes the thread of each recording."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self) -> None:
        self.seen.append(threading.get_ident())


def _manager(hook: _Threads, model: ToyModel | None = None) -> CUDAGraphManager[torch.Tensor]:
    model = ToyModel(CPU) if model is None else model
    return CUDAGraphManager(
        model,
        INPUTS,
        config_for(CUDAGraphMode.FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(hook)),
    )


def test_a_wake_records_on_the_thread_of_the_capture_before_it() -> None:
    threads = _Threads()
    model = ToyModel(CPU)
    manager = _manager(threads, model)
    manager.start_capture().wait(WAIT_S)
    first = set(threads.seen)
    manager.release()
    threads.seen.clear()
    manager.start_capture().wait(WAIT_S)
    assert set(threads.seen) == first == {capture_worker(CPU).thread.ident}
    assert threading.get_ident() not in first
    batch = make_batch(5, 3, CPU, seed=0)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert manager.stats.eager_steps == 0


def test_a_second_managers_capture_does_not_wait_for_a_busy_worker() -> None:
    gate = FirstRecordingGate(WAIT_S)
    busy = gate.manager_on_cpu(ToyModel(CPU))
    held = busy.start_capture()
    assert gate.entered.wait(WAIT_S)  # the worker is inside the first manager's recording
    threads = _Threads()
    other = _manager(threads)
    report = other.start_capture().wait(WAIT_S)  # done while the worker is still held
    assert report.num_graphs == len(other.dispatcher.keys(CUDAGraphMode.FULL))
    assert capture_worker(CPU).thread.ident not in set(threads.seen)
    assert not held.done
    gate.open()
    assert held.wait(WAIT_S).num_graphs == report.num_graphs


def test_the_worker_stops_once_no_manager_that_used_it_is_alive() -> None:
    manager = _manager(_Threads())
    manager.start_capture().wait(WAIT_S)
    worker = capture_worker(CPU)
    assert worker.alive
    del manager
    gc.collect()
    worker.thread.join(WAIT_S)
    assert not worker.thread.is_alive()
    assert capture_worker(CPU) is not worker  # a new one for the next capture


def test_the_worker_ends_cleanly_at_interpreter_exit() -> None:
    """At exit the worker's thread ends (checked by a hook that runs after the worker's own)."""
    code = (
        "import atexit, threading\n"
        "def check():\n"  # registered first, so it runs last
        "    alive = [t.name for t in threading.enumerate() if 'capture-worker' in t.name]\n"
        "    print('alive at exit:', alive)\n"
        "atexit.register(check)\n"
        "from tests.manager.test_capture_worker import _Threads, _manager\n"
        "manager = _manager(_Threads())\n"
        "print(manager.start_capture().wait(30).num_graphs)\n"
    )
    lines = run_fresh("-W", "error", "-c", code, timeout=120).strip().splitlines()
    assert int(lines[-2]) > 0
    assert lines[-1] == "alive at exit: []"


def test_a_worker_stopped_while_a_job_is_handed_to_it_refuses_the_job() -> None:
    """A finalizer that a collection runs inside ``try_run`` may stop the worker: the job is refused.

    Refused, not queued behind the stop where no thread would run it (the
    caller then runs it on a thread of its own). The user's ``__hash__``
    stands for the collection.
    """
    worker = CaptureWorker("cudagraph-capture-worker-test")

    class StopsWhenHashed:
        def __hash__(self) -> int:
            worker.stop()
            return 0

    ran = threading.Event()
    assert not worker.try_run(ran.set, StopsWhenHashed(), lambda: None)
    worker.join(WAIT_S)
    assert not worker.thread.is_alive()
    assert not ran.is_set()


def _wake_warm_ups(*, replace: bool = False) -> tuple[int, int, float]:
    """(warm-ups of the first background capture, of the wake's, a replay's error): for a fresh process.

    ``replace``: a weight is replaced (assigned a new tensor) while released.
    """
    engines = FakeEngines()
    model = ToyModel(CPU)
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(CUDAGraphMode.FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=engines),
    )
    manager.start_capture().wait(WAIT_S)
    first = engines.engines[CUDAGraphMode.FULL].warm_ups
    manager.release()
    if replace:
        model.w1 = nn.Parameter(model.w1.detach().clone(), requires_grad=False)
    manager.start_capture().wait(WAIT_S)
    wake = engines.engines[CUDAGraphMode.FULL].warm_ups - first
    batch = make_batch(5, 3, CPU, seed=1)
    return first, wake, rel_err(manager.run_batch(batch), model.eager(batch))


@pytest.mark.parametrize(
    ("dynamo", "replace"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["nothing_compiled", "dynamo_loaded", "nothing_compiled_new_weights", "dynamo_loaded_new_weights"],
)
def test_a_wake_on_the_worker_runs_no_warm_up_unless_a_compile_may_change(
    dynamo: bool, replace: bool
) -> None:
    """The worker kept its handles and every key was warmed: the wake queues its recordings at once.

    In a fresh process, where dynamo was never loaded, or where it was and
    the weights are the tensors the last graphs read (no guard changed).
    Where dynamo is loaded and a weight was replaced, the smallest key is
    warmed again, for a recompile that the new tensor may cause.
    """
    code = (
        "import json, sys\n"
        + ("import torch._dynamo.utils\n" if dynamo else "")
        + "from tests.manager.test_capture_worker import _wake_warm_ups\n"
        f"first, wake, err = _wake_warm_ups(replace={replace})\n"
        "assert ('torch._dynamo' in sys.modules) is " + str(dynamo) + "\n"
        "print(json.dumps([first, wake, err]))\n"
    )
    first, wake, err = json.loads(run_fresh("-c", code, timeout=120).strip().splitlines()[-1])
    assert first == (
        2 if dynamo else 1
    )  # the largest, whose warm-up makes the thread's handles; the smallest
    assert wake == (1 if dynamo and replace else 0)
    assert err < TOL


def test_a_manager_that_captured_in_the_background_is_freed_without_a_collection() -> None:
    """No reference cycle through the session: its graphs go with the manager, not at the next collection."""
    manager = _manager(_Threads())
    manager.start_capture().wait(WAIT_S)
    captures = weakref.ref(manager._capturer)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del manager
        assert captures() is None, "the manager's captures outlived it: a reference cycle"
    finally:
        if was_enabled:
            gc.enable()
