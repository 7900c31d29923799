"""The loop engine's CUDA kernels compiled for the host, for CPU tests: one thread per CUDA thread.

``_kernels.SOURCE`` is the device code itself; here it is compiled with the
host's C++ compiler over a small emulation of one CUDA block (a
``std::thread`` per CUDA thread, ``std::barrier`` for ``__syncthreads`` and
for a warp's shuffles, ``static`` for ``__shared__``), and
``HostConditional`` builds loops whose launches run these kernels in the
order the driver graph runs them (``_conditional._GraphNodes``): the
bodies eagerly, every counter, partition, choice and restore by the real
kernels. What this cannot see (the driver's graph, memory ordering on a
GPU) the GPU tests see.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Final

import torch

from cudagraph_capture._conditional import Choice, LoopPlan, ReplayPlan, RowTables, _threads, row_layout
from cudagraph_capture._kernels import SOURCE

_HARNESS: Final = r"""
#include <barrier>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>
typedef unsigned long long cudaGraphConditionalHandle;
struct Dim3 { unsigned x; };
thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barrier[32];
static int shuffled[1024];
static unsigned long long dynamic_shared[1 << 16];
static std::vector<std::pair<unsigned long long, unsigned>> set_values;
static std::mutex set_lock;
#define __syncthreads() block_barrier->arrive_and_wait()
#define __global__
#define __device__
#define __shared__ static
inline int __shfl_up_sync(unsigned, int v, int d) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  shuffled[threadIdx.x] = v;
  warp_barrier[warp]->arrive_and_wait();
  int r = lane >= d ? shuffled[threadIdx.x - d] : v;
  warp_barrier[warp]->arrive_and_wait();
  return r;
}
inline void cudaGraphSetConditional(cudaGraphConditionalHandle h, unsigned v) {
  std::lock_guard<std::mutex> guard(set_lock);
  set_values.push_back({h, v});
}
static void run_block(unsigned block, unsigned threads, const std::function<void()> &body) {
  blockIdx.x = block;
  blockDim.x = threads;
  std::barrier<> barrier(threads);
  block_barrier = &barrier;
  for (unsigned w = 0; w < (threads + 31) / 32; ++w) warp_barrier[w] = new std::barrier<>(32);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back([t, &body] { threadIdx.x = t; body(); });
  for (auto &thread : pool) thread.join();
  for (unsigned w = 0; w < (threads + 31) / 32; ++w) delete warp_barrier[w];
}
"""

#: The entry points the tests call: each runs one kernel launch (a grid of ``blocks``), and says which
#: conditional values it set (``values``: handle, value pairs; ``count``: how many).
_API: Final = r"""
typedef unsigned long long u64;
static void report(u64 *handles, unsigned *values, int *count) {
  *count = (int)set_values.size();
  for (size_t i = 0; i < set_values.size(); ++i) {
    handles[i] = set_values[i].first;
    values[i] = set_values[i].second;
  }
  set_values.clear();
}
extern "C" {
void run_begin(unsigned threads, u64 h, long long *c, int every, int rows, int *order, long long *steps,
               int n, u64 *hs, unsigned *vs, int *count) {
  run_block(0, threads, [&] { loop_begin(h, c, every, rows, order, steps, n); });
  report(hs, vs, count);
}
void run_count(long long *c, const void *stop, int stop_bytes) {
  run_block(0, 1, [&] { loop_count(c, stop, stop_bytes); });
}
void run_check(u64 h, long long *c, const void *stop, int stop_bytes, int every, long long *steps,
               int counts, u64 *hs, unsigned *vs, int *count) {
  run_block(0, 1, [&] { loop_check(h, c, stop, stop_bytes, every, steps, counts); });
  report(hs, vs, count);
}
void run_enter(u64 h, u64 *hs, unsigned *vs, int *count) {
  run_block(0, 1, [&] { loop_enter(h); });
  report(hs, vs, count);
}
void run_stay(unsigned threads, u64 h, long long *c, const void *stop, int stop_bytes, int every,
              const unsigned char *active, const long long *sizes, int n, u64 *hs, unsigned *vs, int *count) {
  run_block(0, threads, [&] { loop_stay(h, c, stop, stop_bytes, every, active, sizes, n); });
  report(hs, vs, count);
}
void run_tail(u64 h, const long long *c, u64 *hs, unsigned *vs, int *count) {
  run_block(0, 1, [&] { loop_tail(h, c); });
  report(hs, vs, count);
}
void run_choose(unsigned threads, const u64 *handles, int num_handles, int is_switch, long long *c,
                unsigned char *active, const long long *sizes, int num_sizes, const RowBuffer *buffers,
                int num_buffers, unsigned char *scratch, int *order, int *orders, long long *epoch_steps,
                int *epoch_rows, int max_epochs, int rows_max, u64 *hs, unsigned *vs, int *count) {
  run_block(0, threads, [&] {
    loop_choose(handles, num_handles, is_switch, c, active, sizes, num_sizes, buffers, num_buffers, scratch,
                order, orders, epoch_steps, epoch_rows, max_epochs, rows_max);
  });
  report(hs, vs, count);
}
void run_restore(unsigned blocks, unsigned threads, const long long *c, long long *history, long long stride,
                 int rows_max, const int *orders, const long long *epoch_steps, const int *epoch_rows,
                 int max_epochs, long long fill) {
  for (unsigned b = 0; b < blocks; ++b)
    run_block(b, threads, [&] {
      loop_restore(c, history, stride, rows_max, orders, epoch_steps, epoch_rows, max_epochs, fill);
    });
}
void run_replay(const u64 *handles, int num_handles, int is_switch, const void *live, int live_bytes,
                const long long *sizes, int n, long long *chosen, u64 *hs, unsigned *vs, int *count) {
  run_block(0, 1, [&] {
    choose_replay(handles, num_handles, is_switch, live, live_bytes, sizes, n, chosen);
  });
  report(hs, vs, count);
}
}
"""


_SIGNATURE: Final = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')


def kernel_signatures() -> dict[str, list[int]]:
    """Each kernel of ``SOURCE`` and its parameters' sizes in bytes (``int``: 4; pointers, handles,
    ``long long``: 8), read from the source."""
    found = _SIGNATURE.finditer(SOURCE.format(prelude=""))
    sizes = {m.group(1): m.group(2).split(",") for m in found}
    return {
        name: [4 if p.strip().startswith("int ") and "*" not in p else 8 for p in ps]
        for name, ps in sizes.items()
    }


def _trampolines() -> str:
    """``launch_NAME(blocks, threads, args)``: the kernel over a grid, ``args`` CUDA's ``void *[]``;
    ``drain``: the conditional values set since the last call."""
    out = [
        'extern "C" {',
        "int drain(u64 *hs, unsigned *vs) {",
        "  int count = 0;",
        "  report(hs, vs, &count);",
    ]
    out += ["  return count;", "}"]
    for match in _SIGNATURE.finditer(SOURCE.format(prelude="")):
        name = match.group(1)
        types = [p.strip().rsplit(" ", 1)[0] + (" *" if "*" in p else "") for p in match.group(2).split(",")]
        args = ", ".join(f"*({t.replace('  ', ' ')} *)args[{i}]" for i, t in enumerate(types))
        out.append(f"void launch_{name}(unsigned blocks, unsigned threads, void **args) {{")
        out.append(
            f"  for (unsigned b = 0; b < blocks; ++b) run_block(b, threads, [&] {{ {name}({args}); }});"
        )
        out.append("}")
    return "\n".join([*out, "}"])


def build_host_kernels(directory: Path) -> ctypes.CDLL | str:
    """The kernels compiled into a shared library under ``directory``; or why they cannot be (a reason)."""
    compiler = shutil.which("g++")
    if compiler is None:
        return "no g++ on this machine"
    source = SOURCE.format(prelude="")
    source = re.sub(
        r'extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional\([^;]*;', "", source
    )
    source = source.replace("extern __shared__ unsigned long long dynamic_shared[];", "")
    source = source.replace('extern "C" __global__', "__global__")
    path = directory / "loop_kernels.cpp"
    path.write_text(_HARNESS + source + _API + _trampolines())
    library = directory / "libloop_kernels.so"
    command = [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-o", str(library), str(path), "-lpthread"]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    if result.returncode != 0:
        return f"g++ cannot compile the emulation (C++20 barriers): {result.stderr[-300:]}"
    return ctypes.CDLL(str(library))


def _p(tensor: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if tensor is None else tensor.data_ptr())


class _Set:
    """The conditional values a launch set: ``(handle, value)`` pairs."""

    def __init__(self) -> None:
        self.handles = (ctypes.c_ulonglong * 1024)()
        self.values = (ctypes.c_uint * 1024)()
        self.count = ctypes.c_int(0)

    def args(self) -> tuple[object, object, object]:
        return self.handles, self.values, ctypes.byref(self.count)

    def pairs(self) -> list[tuple[int, int]]:
        return [(int(self.handles[i]), int(self.values[i])) for i in range(self.count.value)]

    def of(self, handle: int) -> int:
        (value,) = [v for h, v in self.pairs() if h == handle]
        return value


#: The handles' stand-ins: a loop's first WHILE, its tail WHILE, its SWITCH (an IF chain: 100 + body),
#: a body's own WHILE (nested).
FIRST: Final = 1
TAIL: Final = 2
SWITCH: Final = 3
STAY: Final = 4


class HostLoop:
    """A loop graph of ``plan`` whose launches run the kernels on the host, in the driver graph's order.

    ``nested``: a shrinking loop's bodies are WHILE nodes of their own (``loop_enter``, ``loop_stay``).
    """

    def __init__(self, lib: ctypes.CDLL, plan: LoopPlan, choice: Choice | None, *, nested: bool) -> None:
        self.lib, self.plan = lib, plan
        self.choice: Choice | None = choice
        self.nested = nested and plan.rows is not None
        self.choices = 0
        rows = plan.rows
        self.handles = torch.tensor(
            [SWITCH] if choice == "switch" else [100 + i for i in range(len(plan.bodies))], dtype=torch.int64
        )
        if rows is not None:
            buffers = (*rows.buffers, rows.order)
            packed = b"".join(struct.pack("<QqiI", *row_layout(b)) for b in buffers)
            self.table = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            self.num_buffers = len(buffers)

    def launch(self) -> None:
        plan, lib = self.plan, self.lib
        rows, counters = plan.rows, plan.cells.counters
        done = _Set()
        first = FIRST if plan.every > 1 or self.nested else TAIL
        count = 0 if rows is None else rows.rows
        lib.run_begin(
            _threads(count), ctypes.c_ulonglong(first), _p(counters), plan.every, count,
            _p(None if rows is None else rows.order), _p(None if rows is None else rows.branch_steps),
            0 if rows is None else len(plan.bodies), *done.args(),
        )  # fmt: skip
        go = done.of(first)
        if plan.every > 1 or self.nested:
            while go:
                go = self._iteration(plan.every, FIRST, nested=self.nested)
        if plan.every > 1:
            lib.run_tail(ctypes.c_ulonglong(TAIL), _p(counters), *done.args())
            go = done.of(TAIL)
        if plan.every > 1 or not self.nested:
            while go:
                go = self._iteration(1, TAIL, nested=False)
        if rows is not None:
            history = rows.history
            lib.run_restore(
                history.shape[0], _threads(rows.rows), _p(counters), _p(history),
                ctypes.c_longlong(history.stride(0)), rows.rows, _p(rows.orders), _p(rows.epoch_steps),
                _p(rows.epoch_rows), rows.max_epochs, ctypes.c_longlong(rows.fill),
            )  # fmt: skip

    def _iteration(self, every: int, handle: int, *, nested: bool) -> int:
        plan, lib, cells = self.plan, self.lib, self.plan.cells
        rows = plan.rows
        body = plan.bodies[0] if rows is None else plan.bodies[self._choose(rows)]
        stop = (_p(cells.stop), cells.stop.element_size())
        done = _Set()
        stay = 1
        if nested:
            lib.run_enter(ctypes.c_ulonglong(STAY), *done.args())
            stay = done.of(STAY)
        while stay:
            for j in range(every):
                body.replay()
                if j < every - 1:
                    lib.run_count(_p(cells.counters), *stop)
            if rows is None or not nested:
                break
            lib.run_stay(
                _threads(rows.rows), ctypes.c_ulonglong(STAY), _p(cells.counters), *stop, every,
                _p(rows.active), _p(rows.sizes), len(plan.bodies), *done.args(),
            )  # fmt: skip
            stay = done.of(STAY)
        branch_steps = _p(None if rows is None else rows.branch_steps)
        lib.run_check(
            ctypes.c_ulonglong(handle), _p(cells.counters), *stop, every, branch_steps, int(not nested),
            *done.args(),
        )  # fmt: skip
        return done.of(handle)

    def _choose(self, rows: RowTables) -> int:
        done = _Set()
        self.lib.run_choose(
            _threads(rows.rows), _p(self.handles), self.handles.shape[0], int(self.choice == "switch"),
            _p(self.plan.cells.counters), _p(rows.active), _p(rows.sizes), len(self.plan.bodies),
            _p(self.table), self.num_buffers, _p(rows.scratch), _p(rows.order), _p(rows.orders),
            _p(rows.epoch_steps), _p(rows.epoch_rows), rows.max_epochs, rows.rows, *done.args(),
        )  # fmt: skip
        self.choices += 1
        if self.choice == "switch":
            return done.of(SWITCH)
        chosen = [h - 100 for h, v in done.pairs() if v]
        assert len(done.pairs()) == len(self.plan.bodies), done.pairs()  # a value for every IF node
        assert len(chosen) == 1, done.pairs()  # one set
        return chosen[0]


class HostReplay:
    """A replay chosen by ``choose_replay`` on the host."""

    def __init__(self, lib: ctypes.CDLL, plan: ReplayPlan, choice: Choice) -> None:
        self.lib, self.plan = lib, plan
        self.choice: Choice | None = choice
        self.handles = torch.tensor(
            [SWITCH] if choice == "switch" else [100 + i for i in range(len(plan.graphs))], dtype=torch.int64
        )

    def launch(self) -> None:
        plan, done = self.plan, _Set()
        self.lib.run_replay(
            _p(self.handles), self.handles.shape[0], int(self.choice == "switch"), _p(plan.live),
            plan.live.element_size(), _p(plan.sizes), len(plan.graphs), _p(plan.chosen), *done.args(),
        )  # fmt: skip
        if self.choice == "switch":
            branch = done.of(SWITCH)
        else:
            branch = next((h - 100 for h, v in done.pairs() if v), len(plan.graphs))
        if branch < len(plan.graphs):
            plan.graphs[branch].replay()


class HostConditional:
    """A ``ConditionalLoops`` (and its loader) whose graphs run the real kernels on the host."""

    def __init__(self, lib: ctypes.CDLL, *, switch: bool = True, nested: bool = True) -> None:
        self.lib, self.switch, self.nested = lib, switch, nested

    def __call__(self, device: int) -> HostConditional:
        return self

    def build(self, plan: LoopPlan) -> HostLoop:
        choice: Choice = "switch" if self.switch else "if_chain"
        return HostLoop(self.lib, plan, None if plan.rows is None else choice, nested=self.nested)

    def build_replay(self, plan: ReplayPlan) -> HostReplay:
        return HostReplay(self.lib, plan, "switch" if self.switch else "if_chain")
