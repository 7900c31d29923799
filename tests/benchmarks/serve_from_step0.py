"""One cold process of the serve-from-step-0 benchmark.

``python -m tests.benchmarks.serve_from_step0 RUN MODEL``:

``RUN`` is ``foreground`` (``capture()``, then serve), ``background``
(``start_capture()`` and serve from step 0) or ``eager`` (serve without a
manager). ``MODEL`` is ``reference`` (the reference decoder, 8 layers,
d=1024, FULL_AND_PIECEWISE over ``CaptureSizes.default(256)``: 70 graphs) or
``small`` (4 layers, d=512, FULL over ``CaptureSizes.default(512)``: 51
graphs), served in a tight loop. Each run starts in a fresh process, because the first use of a
shape is what a start-up pays for (cuBLAS and cuDNN handles and plans, which
are kept per thread, and the allocator's blocks). Prints one JSON line: the
steps served (seconds since the run's start at each step's completion, step
milliseconds, whether it replayed), the capture's seconds, when every graph was
ready, and the steady eager step time measured at the end.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CaptureReport, CUDAGraphManager
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs

STEPS_AFTER: Final = 100  # steps served once every graph is ready


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    """A model, its modes and sizes, and the decode batches served in turn."""

    config: DecoderConfig
    mode: CUDAGraphMode
    sizes: CaptureSizes
    batches: tuple[int, ...]


SETUPS: Final = {
    "reference": Setup(  # with FULL_AND_PIECEWISE: 70 graphs
        DecoderConfig(),
        CUDAGraphMode.FULL_AND_PIECEWISE,
        CaptureSizes.default(256),
        (1, 3, 8, 13, 16, 32, 50, 64, 100, 128, 200, 256),
    ),
    "small": Setup(  # FULL: 51 graphs
        DecoderConfig(
            num_layers=4,
            hidden_size=512,
            num_heads=8,
            intermediate_size=1408,
            max_num_seqs=512,
            max_seq_len=64,
        ),
        CUDAGraphMode.FULL,
        CaptureSizes.default(512),
        (1, 3, 8, 13, 16, 32, 50, 64, 100, 128, 200, 256, 300, 512),
    ),
}


def _step(
    manager: CUDAGraphManager[torch.Tensor] | None, model: ReferenceDecoder, inputs: dict[str, torch.Tensor]
) -> bool:
    """One decode step, synchronized on the serving stream; whether it replayed a graph."""
    if manager is None:
        model(inputs["input_ids"], inputs["positions"], inputs["cache_rows"])
        replayed = False
    else:
        before = manager.stats.num_replays
        manager.run_batch(inputs, uniform_decode=True)
        replayed = manager.stats.num_replays > before
    torch.cuda.current_stream().synchronize()  # this stream only: a device-wide sync breaks captures
    return replayed


def main(run: str, setup_name: str) -> dict[str, object]:
    setup = SETUPS[setup_name]
    config = setup.config
    serving = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    with torch.no_grad(), torch.cuda.stream(serving):
        torch.manual_seed(0)
        model = ReferenceDecoder(config, device="cuda")
        generator = torch.Generator().manual_seed(0)
        steps = [
            make_step_inputs(config, n, uniform_decode=True, generator=generator, device="cuda")
            for n in setup.batches
        ]
        dispatch = DispatchConfig(setup.mode, setup.sizes, max_num_seqs=config.max_num_seqs)
        manager = None if run == "eager" else CUDAGraphManager(model.forward, static_inputs(config), dispatch)
        serving.synchronize()
        served: list[tuple[float, float, bool]] = []
        start = time.perf_counter()
        capture_s = ready_s = None
        retries = 0
        reasons_during: dict[str, int] = {}
        phases: dict[str, float] = {}
        if manager is not None and run == "foreground":
            report = manager.capture(progress=False)
            capture_s = report.seconds
            ready_s = time.perf_counter() - start
            phases = _phases(report)
        handle = manager.start_capture() if manager is not None and run == "background" else None
        start_capture_s = time.perf_counter() - start
        after = 0
        while after < STEPS_AFTER:
            step_start = time.perf_counter()
            replayed = _step(manager, model, steps[len(served) % len(steps)])
            now = time.perf_counter()
            served.append((now - start, (now - step_start) * 1e3, replayed))
            if manager is not None and handle is not None and ready_s is None and handle.done:
                ready_s = now - start
                report = handle.wait(0)
                capture_s, retries = report.seconds, handle.retries
                phases = _phases(report)
                reasons_during = dict(manager.stats.eager_reasons)  # why steps ran eagerly meanwhile
                assert handle.errors == (), handle.errors
            after += run == "eager" or ready_s is not None
        steady = []
        for index in range(30):  # the eager step, warm, on the same steps
            step_start = time.perf_counter()
            _step(None, model, steps[index % len(steps)])
            steady.append((time.perf_counter() - step_start) * 1e3)
    return {
        "run": run,
        "served": served,
        "capture_s": capture_s,
        "ready_s": ready_s,
        "retries": retries,
        "eager_reasons_during": reasons_during,
        "steady_eager_step_ms": statistics.median(steady[5:]),
        "graphs": 0 if manager is None else manager.num_captured,
        # Where the time went: start_capture()'s host time (its warm-ups queued), the capture's phases.
        "start_capture_s": start_capture_s if run == "background" else None,
        "phases": phases,
    }


def _phases(report: CaptureReport) -> dict[str, float]:
    """A capture's host seconds by phase (warm-ups, recordings, instantiations, the rest)."""
    p = report.phases
    return {
        "warmup_s": p.warmup,
        "recording_s": p.recording,
        "instantiation_s": p.instantiation,
        "rest_s": p.rest,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
