"""Sleep and wake: ``release()``, then ``start_capture()`` while serving, against a foreground capture (GPU).

Per model (the reference decoder, and the 8B-like preset), in one warm
process: a cold foreground ``capture()`` first, then cycles of

    serve (replays) -> release() -> serve asleep (eager) -> start_capture() and serve -> all graphs ready
    -> release() -> capture() (a foreground recapture of the same plan, for comparison)

Recorded in ``extra_info`` (medians over the cycles): the release's wall
time, the memory it gave back over what the wake's capture took (device free
memory, ``cudaMemGetInfo``), the wake's first served step (from calling
``start_capture()`` to that step's outputs, synchronized) over a warm eager
step of the same batch (and the process's first wake's, alone: the capture
worker's first session), the wake's time until every graph is ready over
the foreground recapture's, and the cold capture's time. A plot of the step
times after a wake is written next to the benchmark JSON as ``sleep_wake.png``.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.benchmarks.support import BenchmarkFixture, pyplot_or_none

pytestmark = pytest.mark.gpu

PLOT_NAME: Final = "sleep_wake.png"
#: Decode batches served in turn (the wake's first step is the first of them).
BATCHES: Final = (32, 1, 8, 64, 128, 256, 16, 100)
STEPS_SERVED: Final = 40  # replays before each release


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    config: DecoderConfig
    sizes: CaptureSizes
    cycles: int
    label: str


SETUPS: Final = {
    "reference": Setup(DecoderConfig(), CaptureSizes.default(256), 5, "reference decoder (8 layers, d=1024)"),
    "8b_like": Setup(
        DecoderConfig.llama_8b_like(), CaptureSizes.default(256), 5, "8B-like decoder (32 layers, d=4096)"
    ),
}
MODE: Final = CUDAGraphMode.FULL_AND_PIECEWISE


def _free() -> int:
    return torch.cuda.mem_get_info()[0]


def _measure(setup: Setup) -> tuple[dict[str, float], list[tuple[float, float, bool]]]:
    torch.manual_seed(0)
    config = setup.config
    model = ReferenceDecoder(config, device="cuda")
    manager = CUDAGraphManager(
        model.forward,
        static_inputs(config),
        DispatchConfig(MODE, setup.sizes, max_num_seqs=config.max_num_seqs),
    )
    generator = torch.Generator().manual_seed(1)
    inputs = [
        make_step_inputs(config, n, uniform_decode=True, generator=generator, device="cuda") for n in BATCHES
    ]
    serving = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    served = 0

    def step() -> float:
        """One synchronized step of the next batch; its wall time in seconds."""
        nonlocal served
        start = time.perf_counter()
        manager.run_batch(inputs[served % len(inputs)], uniform_decode=True)
        serving.synchronize()
        served += 1
        return time.perf_counter() - start

    figures: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    timeline: list[tuple[float, float, bool]] = []
    with torch.no_grad(), torch.cuda.stream(serving):
        for _ in range(3 * len(BATCHES)):  # warm eager steps: lazy initialization, allocator blocks
            step()
        eager_first = []  # warm eager steps of the wake's first batch
        for _ in range(10):
            served = 0
            eager_first.append(step())
        serving.synchronize()
        free_cold = _free()
        start = time.perf_counter()
        report = manager.capture(progress=False)
        note("cold_capture_s", time.perf_counter() - start)
        took = free_cold - _free()
        note("cold_capture_mib", took / 2**20)
        graphs = report.num_graphs
        for cycle in range(setup.cycles):
            for _ in range(STEPS_SERVED):
                step()
            for wake in ("background", "foreground"):
                serving.synchronize()
                free_awake = _free()
                start = time.perf_counter()
                manager.release()
                note("release_ms", (time.perf_counter() - start) * 1e3)
                free_asleep = _free()
                note("release_returned_mib", (free_asleep - free_awake) / 2**20)
                note("returned_over_took", (free_asleep - free_awake) / took)
                gc.collect()
                for _ in range(3):  # served asleep, eagerly
                    step()
                served = 0  # the wake's first step is BATCHES[0], as eager_first was
                serving.synchronize()
                free_asleep = _free()
                start = time.perf_counter()
                if wake == "foreground":
                    manager.capture(progress=False)
                    note("foreground_recapture_s", time.perf_counter() - start)
                    took = free_asleep - _free()
                    continue
                handle = manager.start_capture()
                step()
                note("wake_first_step_ms", (time.perf_counter() - start) * 1e3)
                while not handle.done:
                    replays = manager.stats.num_replays
                    ms = step() * 1e3
                    if cycle == setup.cycles - 1:
                        timeline.append(
                            (time.perf_counter() - start, ms, manager.stats.num_replays > replays)
                        )
                handle.wait(600)
                note("wake_ready_s", time.perf_counter() - start)
                assert handle.errors == ()
                assert manager.num_captured == graphs
                took = free_asleep - _free()
                note("wake_capture_mib", took / 2**20)
        manager.release()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    medians["min_returned_over_took"] = min(figures["returned_over_took"])
    # The process's first wake is the capture worker's first session: its thread's library handles
    # and plans are made then (the medians are of the later wakes' state).
    medians["first_wake_first_step_ms"] = figures["wake_first_step_ms"][0]
    medians["graphs"] = graphs
    medians["eager_step_ms"] = statistics.median(eager_first) * 1e3
    medians["wake_first_step_minus_eager_ms"] = medians["wake_first_step_ms"] - medians["eager_step_ms"]
    medians["wake_ready_over_foreground_recapture"] = (
        medians["wake_ready_s"] / medians["foreground_recapture_s"]
    )
    return medians, timeline


@pytest.mark.parametrize("name", list(SETUPS))
def test_bench_sleep_wake(benchmark: BenchmarkFixture, request: pytest.FixtureRequest, name: str) -> None:
    setup = SETUPS[name]
    results: list[tuple[dict[str, float], list[tuple[float, float, bool]]]] = []
    benchmark.group = f"sleep and wake: {setup.label}, {MODE.name}"
    benchmark.pedantic(lambda: results.append(_measure(setup)), rounds=1, iterations=1)
    medians, timeline = results[0]
    benchmark.extra_info.update(medians)
    _plot(request, name, setup, medians, timeline)


def _plot(
    request: pytest.FixtureRequest,
    name: str,
    setup: Setup,
    medians: dict[str, float],
    timeline: list[tuple[float, float, bool]],
) -> None:
    """Step time after a wake, eager and replayed, next to the benchmark JSON (skipped without matplotlib)."""
    json_path = request.config.getoption("benchmark_json", None)
    plt = pyplot_or_none()
    if json_path is None or not timeline or plt is None:
        return
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for replayed, label in ((False, "eager (graph not ready yet)"), (True, "replayed")):
        points = [(t, ms) for t, ms, r in timeline if r is replayed]
        axes.plot([t for t, _ in points], [ms for _, ms in points], ".", markersize=3, label=label)
    axes.axvline(medians["wake_ready_s"], color="C2", linestyle=":", label="all graphs ready (median)")
    axes.axvline(
        medians["foreground_recapture_s"], color="C3", linestyle=":", label="foreground recapture (median)"
    )
    axes.axhline(medians["eager_step_ms"], color="grey", linewidth=0.8, label="warm eager step (32 tokens)")
    axes.set_xlabel("seconds since start_capture() (the wake)")
    axes.set_ylabel("step time (ms, synchronized)")
    axes.set_yscale("log")
    axes.set_title(
        f"{setup.label}: release {medians['release_ms']:.0f} ms gives back "
        f"{medians['release_returned_mib']:.0f} MiB; wake serves at once"
    )
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    out = Path(str(getattr(json_path, "name", json_path))).parent / PLOT_NAME.replace(".png", f"_{name}.png")
    figure.savefig(out, dpi=120)
    plt.close(figure)
