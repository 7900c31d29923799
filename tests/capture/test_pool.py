"""The shared graph pool: one per device, usable for the life of the process, and cheap.

The lifetime and memory tests run in a fresh interpreter: they need a shared
pool that no earlier test has filled (memory) or kept alive (lifetime), and
on torch 2.11 reusing a pool whose graphs are all gone trips an internal
assert in the caching allocators, which must not take the test session down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Final, cast

import pytest
import torch

from cudagraph_capture import CaptureOptions
from cudagraph_capture._pool import GraphPool, shared_pool

_REPO: Final = Path(__file__).resolve().parents[2]
_SRC_DIRS: Final = [_REPO / "packages" / name / "src" for name in ("dispatch", "capture", "manager")]

#: Capture sizes of the memory test: 16 sizes, captured largest first.
MEMORY_SIZES: Final = (512, 384, 320, 256, 192, 128, 96, 64, 48, 32, 24, 16, 8, 4, 2, 1)
#: 16 sizes largest-first into one pool may cost at most this times the largest alone.
MEMORY_RATIO_LIMIT: Final = 1.3

_PROBE: Final = r'''
import gc
import json
import sys

import torch
from torch.nn.functional import gelu, linear

from cudagraph_capture import (
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    eager_break_during_capture,
    shared_pool,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context

scenario, engine = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
device = torch.device("cuda", torch.cuda.current_device())


@eager_break_during_capture
def halve_(t):
    t.mul_(0.5)


class Model:
    """Residual MLP blocks; the in-place halving is an eager break for the breakable engine."""

    def __init__(self, dim, hidden, layers, dtype):
        self.layers = [
            (
                torch.randn(hidden, dim, device=device, dtype=dtype) / dim**0.5,
                torch.randn(dim, hidden, device=device, dtype=dtype) / hidden**0.5,
            )
            for _ in range(layers)
        ]

    def __call__(self, x):
        for up, down in self.layers:
            h = gelu(linear(x, up))
            halve_(h)
            x = x + linear(h, down)
        return x


def make_wrapper(model, options=None):
    if engine == "monolithic":
        return CUDAGraphWrapper(model, CUDAGraphMode.FULL, options), CUDAGraphMode.FULL
    return BreakableCUDAGraphWrapper(model, options), CUDAGraphMode.PIECEWISE


def rel_err(a, b):
    a, b = a.double(), b.double()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def replay_errors(wrapper, mode, model, x_buf, sizes):
    errors = []
    for n in sizes:
        data = torch.randn(n, x_buf.shape[1], device=device, dtype=x_buf.dtype)
        x_buf[:n].copy_(data)
        expected = model(data)
        with set_forward_context(mode, BatchDescriptor(n)):
            got = wrapper(x_buf[:n]).clone()
        errors.append(rel_err(got, expected))
    return errors


def capture(wrapper, mode, x_buf, sizes):
    for n in sizes:
        with set_forward_context(mode, BatchDescriptor(n)):
            wrapper(x_buf[:n])


def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


if scenario == "lifetime":
    model = Model(256, 512, 2, torch.float32)
    sizes = (64, 16, 4)
    x_buf = torch.randn(max(sizes), 256, device=device)
    for n in sizes:
        model(x_buf[:n])
    pool = shared_pool(device)
    errors = {}

    wrapper, mode = make_wrapper(model)
    capture(wrapper, mode, x_buf, sizes)
    errors["first"] = replay_errors(wrapper, mode, model, x_buf, sizes)

    wrapper.clear()  # every graph of the pool is gone...
    settle()
    capture(wrapper, mode, x_buf, sizes)  # ...and the same pool is used again
    errors["after_clear"] = replay_errors(wrapper, mode, model, x_buf, sizes)

    del wrapper  # every graph gone again, this time with the wrapper
    settle()
    wrapper, mode = make_wrapper(model)
    capture(wrapper, mode, x_buf, sizes)
    errors["after_delete"] = replay_errors(wrapper, mode, model, x_buf, sizes)

    del wrapper
    settle()
    # The pool passed explicitly.
    wrapper, mode = make_wrapper(model, CaptureOptions(pool=shared_pool(device)))
    capture(wrapper, mode, x_buf, sizes)
    errors["explicit_pool"] = replay_errors(wrapper, mode, model, x_buf, sizes)

    print(json.dumps({"errors": errors, "same_pool": shared_pool(device) == pool}))

elif scenario == "memory":
    sizes = [int(s) for s in sys.argv[3].split(",")]
    model = Model(1024, 16384, 2, torch.float16)  # activations: 16 MiB per tensor at 512 tokens
    x_buf = torch.randn(max(sizes), 1024, device=device, dtype=torch.float16)
    # Warm up on the capture stream first: its cuBLAS workspace is then allocated
    # (outside the pool, for good) before the baseline, not counted with the graphs.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for n in sizes:
            model(x_buf[:n])
    torch.cuda.current_stream().wait_stream(stream)
    shared_pool(device)
    settle()
    base = torch.cuda.memory_reserved(device)
    wrapper, mode = make_wrapper(model, CaptureOptions(stream=stream))
    capture(wrapper, mode, x_buf, sizes[:1])
    settle()
    largest = torch.cuda.memory_reserved(device) - base
    capture(wrapper, mode, x_buf, sizes[1:])
    settle()
    total = torch.cuda.memory_reserved(device) - base
    errors = replay_errors(wrapper, mode, model, x_buf, sizes[:: max(1, len(sizes) // 4)])
    report = {"largest": largest, "total": total, "num_captured": wrapper.num_captured, "errors": errors}
    print(json.dumps(report))

else:
    raise SystemExit(f"unknown scenario {scenario!r}")
'''


def _env() -> dict[str, str]:
    paths = [str(p) for p in (*_SRC_DIRS, _REPO)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _run_probe(*args: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"probe {args} failed:\n{result.stderr[-6000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(report, dict)
    return report


def _floats(value: object) -> list[float]:
    assert isinstance(value, list)
    assert value, "no replay was checked"
    return [float(v) for v in value]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["monolithic", "breakable"])
def test_shared_pool_outlives_its_graphs(engine: str) -> None:
    """After clear() or deleting every wrapper, capturing into the shared pool again replays right."""
    report = _run_probe("lifetime", engine)
    assert report["same_pool"] is True
    errors = report["errors"]
    assert isinstance(errors, dict)
    assert set(errors) == {"first", "after_clear", "after_delete", "explicit_pool"}
    for phase, values in errors.items():
        worst = max(_floats(values))
        assert worst < 1e-5, f"{phase}: replay differs from eager, rel err {worst:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["monolithic", "breakable"])
def test_sizes_captured_largest_first_share_the_pool(engine: str) -> None:
    """16 sizes captured largest-first into the shared pool cost at most 1.3x the largest size alone."""
    report = _run_probe("memory", engine, ",".join(str(s) for s in MEMORY_SIZES))
    largest, total = report["largest"], report["total"]
    assert isinstance(largest, int)
    assert isinstance(total, int)
    assert report["num_captured"] == len(MEMORY_SIZES)
    assert max(_floats(report["errors"])) < 2e-2
    mib = 2**20
    # The largest graph holds at least two 16 MiB activations: the measurement saw the pool.
    assert largest >= 32 * mib, f"largest size alone reserved only {largest / mib:.1f} MiB"
    ratio = total / largest
    assert ratio <= MEMORY_RATIO_LIMIT, (
        f"{len(MEMORY_SIZES)} sizes reserved {total / mib:.1f} MiB, "
        f"{ratio:.2f}x the {largest / mib:.1f} MiB of the largest alone"
    )


@pytest.mark.gpu
def test_shared_pool_is_one_handle_per_device() -> None:
    """shared_pool() names the same pool for the current device however the device is given."""
    index = torch.cuda.current_device()
    pool = shared_pool()
    assert isinstance(pool, tuple)
    assert len(pool) == 2
    assert all(isinstance(v, int) for v in pool)
    assert shared_pool(index) == pool
    assert shared_pool(torch.device("cuda", index)) == pool
    assert shared_pool(None) == pool


@pytest.mark.gpu
def test_capture_options_take_the_pools_torch_made_and_refuse_the_rest() -> None:
    """Issue 33: a handle is a plain tuple, so one torch never issued (the next number on) is refused."""
    handle = torch.cuda.graph_pool_handle()
    for pool in (handle, shared_pool(), torch.cuda.graph_pool_handle()):
        assert CaptureOptions(pool=pool).pool == pool
    graph = torch.cuda.CUDAGraph()
    scratch = torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph):  # a graph of its own pool: (k, 0)
        scratch.add_(1)
    assert CaptureOptions(pool=graph.pool()).pool == graph.pool()
    not_yet = cast(GraphPool, (0, torch.cuda.graph_pool_handle()[1] + 1))
    with pytest.raises(ValueError, match=r"^pool: .*which torch never made in this process$"):
        CaptureOptions(pool=not_yet)


def test_capture_options_defaults() -> None:
    """Defaults: weak-ref outputs, gc disabled, no address check, the shared pool, a side stream; frozen."""
    options = CaptureOptions()
    assert options.weak_ref_output is True
    assert options.gc_disable is True
    assert options.check_input_addresses is False
    assert options.pool is None
    assert options.stream is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(options, "gc_disable", False)  # noqa: B010 - mypy rejects assigning a frozen field
