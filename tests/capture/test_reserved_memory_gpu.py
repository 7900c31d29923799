"""``ReservedMemory`` on a CUDA device (issue 48): graphs captured against addresses, memory backed after.

A graph records addresses, not pages: one captured while its range holds
no memory replays bit-exact once the range is backed, after a grow, after a
drop and a re-back, with no recapture. Backing moves the device's free
memory by exactly the bytes backed; ``close`` (or a process that dies
mid-way) gives all of it back. Every graph here touches only bytes backed
when it replays: a kernel that touched an unbacked byte would fault the
CUDA context, which no test provokes (``test_kv_first.py`` checks that the
decoders never let a step do it).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from typing import Final

import pytest
import torch

from cudagraph_capture._reserved import wrap_pointer
from cudagraph_capture.lowlevel import ReservedMemory
from tests.capture.test_lean_import_capture import subprocess_env

pytestmark = pytest.mark.gpu

MIB: Final = 2**20
GIB: Final = 2**30
#: The device's granularity on the machines we run on (H100, H200), and ``cudaMemGetInfo``'s step.
CHUNK: Final = 2 * MIB
ROW: Final = 1024  # fp16 elements per row: 2 KiB
WRITES, READS = 256, 512


def _free() -> int:
    """The device's free memory, torch's cached blocks given back first (a reference's temporaries)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def _distinct(high: int, count: int) -> torch.Tensor:
    return torch.randperm(high, device="cuda")[:count]


class _Graph:
    """A graph that scatters rows into ``kv`` and gathers rows of it (x2): captured once, replayed later."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.wslots = torch.zeros(WRITES, dtype=torch.int64, device="cuda")
        self.wvals = torch.zeros(WRITES, ROW, dtype=torch.float16, device="cuda")
        self.rslots = torch.zeros(READS, dtype=torch.int64, device="cuda")
        self.out = torch.zeros(READS, ROW, dtype=torch.float16, device="cuda")
        warm = torch.empty(4096, ROW, dtype=torch.float16, device="cuda")
        self._body(warm)  # the kernels load on an ordinary tensor: the range is never touched here
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body(kv)

    def _body(self, kv: torch.Tensor) -> None:
        kv.index_copy_(0, self.wslots, self.wvals)
        self.out.copy_(kv.index_select(0, self.rslots) * 2)

    def check(self, rows: int) -> None:
        """Fresh slots in ``[0, rows)`` (backed), a replay, bit-exact against eager on the same memory."""
        self.wslots.copy_(_distinct(rows, WRITES))
        self.wvals.copy_(torch.randn(WRITES, ROW, device="cuda").half())
        self.rslots.copy_(torch.cat([self.wslots, torch.randint(0, rows, (READS - WRITES,), device="cuda")]))
        self.out.fill_(float("nan"))
        self.graph.replay()
        expected = self.kv.index_select(0, self.rslots) * 2
        assert torch.equal(self.out.view(torch.int16), expected.view(torch.int16))
        assert torch.equal(
            self.kv.index_select(0, self.wslots).view(torch.int16), self.wvals.view(torch.int16)
        )


def test_a_graph_captured_against_unbacked_addresses_replays_once_backed_grown_and_backed_again() -> None:
    torch.cuda.synchronize()
    memory = ReservedMemory(8 * GIB, device="cuda", fallback_size=0)
    assert memory.fallback is None, memory.fallback
    assert memory.granularity == CHUNK
    rows = memory.size // (2 * ROW)
    kv = memory.view(torch.float16, (rows, ROW))  # nothing backed: a tensor over addresses alone
    graph = _Graph(kv)
    free = _free()
    start = time.perf_counter()
    assert memory.back(GIB + CHUNK) == GIB + CHUNK
    took = time.perf_counter() - start
    assert free - _free() == GIB + CHUNK  # exactly what was backed
    graph.check((GIB + CHUNK) // (2 * ROW))
    assert memory.back(6 * GIB) == 6 * GIB  # a grow: no recapture
    graph.check(6 * GIB // (2 * ROW))
    assert memory.back(GIB + 1) == GIB + CHUNK  # a shrink ends at a mapping boundary at or above its end
    assert memory.back(GIB) == GIB
    assert memory.back(0) == 0  # a drop: the graph is kept
    assert _free() == free
    memory.back(4 * GIB)  # backed again: new memory, the same addresses
    graph.check(4 * GIB // (2 * ROW))
    print(f"\nbacking 1 GiB + 2 MiB took {took * 1e3:.2f} ms; mappings now {memory.mappings}")
    del graph
    memory.close()
    del kv
    gc.collect()
    torch.cuda.empty_cache()
    assert _free() >= free - CHUNK  # everything back
    with pytest.raises(ValueError, match="close: this ReservedMemory is closed"):
        memory.close()


def test_a_range_larger_than_the_device_is_backed_up_to_what_is_free() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    memory = ReservedMemory(2 * total, device="cuda")
    probe = torch.empty(4096, ROW, dtype=torch.float16, device="cuda")
    probe.fill_(1.0)  # the fill kernel's module loads now (lazy loading takes device memory), not below
    assert float(probe[-1, -1]) == 1.0
    del probe
    free = _free()
    target = (free - 2 * GIB) // CHUNK * CHUNK
    memory.back(target)
    assert free - _free() == target
    kv = memory.view(torch.float16, (memory.size // (2 * ROW), ROW))
    kv[: target // (2 * ROW)].fill_(1.0)  # every backed byte is usable
    assert float(kv[target // (2 * ROW) - 1, -1]) == 1.0
    del kv
    memory.close()
    gc.collect()
    assert _free() >= free - CHUNK


def test_more_than_is_free_is_torchs_out_of_memory_and_backs_nothing() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    memory = ReservedMemory(2 * total, device="cuda")
    memory.back(CHUNK)
    free = _free()
    with pytest.raises(torch.OutOfMemoryError):
        memory.back(total + CHUNK)
    assert memory.backed_bytes == CHUNK
    assert abs(_free() - free) <= CHUNK
    memory.close()


def test_both_ways_of_wrapping_a_pointer_give_the_same_tensor() -> None:
    memory = ReservedMemory(4 * CHUNK, device="cuda")
    memory.back(CHUNK)
    base = memory.view(torch.uint8, (memory.size,)).data_ptr()
    device = torch.device("cuda", torch.cuda.current_device())
    from cudagraph_capture._reserved import _from_cuda_array_interface, _from_dlpack

    for make in (_from_dlpack, _from_cuda_array_interface):
        tensor = make(base, CHUNK, device, memory)
        assert (tensor.data_ptr(), tensor.device, tensor.numel()) == (base, device, CHUNK)
        tensor.fill_(3)
        assert int(tensor.sum()) == 3 * CHUNK
        del tensor
    host = wrap_pointer(base, CHUNK, device, None)
    assert host.data_ptr() == base
    del host
    memory.close()


_CHILD: Final = """
import os, sys
import torch
from cudagraph_capture.lowlevel import ReservedMemory
memory = ReservedMemory(8 << 30, device="cuda")
memory.back(4 << 30)
memory.view(torch.uint8, (4 << 30,)).fill_(1)
torch.cuda.synchronize()
print("backed", flush=True)
os._exit(3)  # dies mid-way: no close, no finalizer, no interpreter shutdown
"""


def test_a_process_that_dies_mid_way_leaks_nothing() -> None:
    before = _free()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert child.returncode == 3, child.stderr[-2000:]
    assert child.stdout.strip() == "backed"
    deadline = time.monotonic() + 10
    while _free() < before - CHUNK and time.monotonic() < deadline:  # the driver tears the context down
        time.sleep(0.05)
    assert _free() >= before - CHUNK, "the dead process's reservation and memory were not given back"


def test_a_reservation_imports_cuda_bindings_and_nothing_else_does() -> None:
    probe = (
        "import sys, torch\n"
        "import cudagraph_capture, cudagraph_capture.lowlevel, cudagraph_manager\n"
        "before = 'cuda.bindings.driver' in sys.modules\n"
        "from cudagraph_capture.lowlevel import ReservedMemory\n"
        "ReservedMemory(1 << 21, device='cuda').close()\n"
        "print(before, 'cuda.bindings.driver' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _, after = done.stdout.split()  # before: False, unless torch itself imported cuda-bindings
    assert after == "True"
