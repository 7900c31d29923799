"""Start-up against its floor: ``capture()`` of a plan, and a hand-written record + instantiate loop.

The floor records every key of the manager's plan, largest first, as one
``torch.cuda.CUDAGraph(keep_graph=True)`` on a side stream into one pool,
then ``instantiate()``s it: what any capture must pay, and nothing else (no
warm-up, no checks, no bookkeeping). Ours is ``CUDAGraphManager.capture()``
of the same plan on the same static buffers, whose report splits its time
into warm-ups, recordings, instantiations and the rest.

- **Cold**: the process's first capture (``--cold``), then the warm rounds in
  the same process: the cold figure over the warm floor.
- **Warm**: every size was run once before; rounds alternate the floor and
  ours (graphs freed in between) and the medians are compared.

Run as a script (``python -m tests.benchmarks.startup --model reference
--mode FULL [--cold]``): one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Final

import torch

from cudagraph_capture import CaptureOptions
from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions, StaticInput
from examples.config import DecoderConfig
from examples.reference import ReferenceDecoder, static_inputs

MODELS: Final = {"reference": DecoderConfig, "8b_like": DecoderConfig.llama_8b_like}
ROUNDS: Final = 3
MAX_SIZE: Final = 512


def key_views(
    manager: CUDAGraphManager[torch.Tensor], inputs: Mapping[str, StaticInput], key: BatchDescriptor
) -> dict[str, torch.Tensor]:
    """The key's rows of each static buffer, filled with the input's pad value (as a capture's warm-up)."""
    max_num_seqs = manager.dispatcher.config.max_num_seqs
    num_reqs = key.num_reqs if key.num_reqs is not None else min(key.num_tokens, max_num_seqs)
    rows = {"tokens": key.num_tokens, "reqs": num_reqs}
    views: dict[str, torch.Tensor] = {}
    for name, buffer in manager.static_buffers.items():
        spec = inputs[name]
        view = buffer if spec.rows is None else buffer[: rows[spec.rows]]
        if spec.rows is not None:
            view.fill_(spec.pad_value)
        views[name] = view
    return views


def floor_seconds(
    model: Callable[..., torch.Tensor], views: list[dict[str, torch.Tensor]]
) -> tuple[float, float, float]:
    """(total, recording, instantiation) seconds of the hand-written loop over ``views``; frees its graphs."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    graphs: list[torch.cuda.CUDAGraph] = []
    recording = instantiation = 0.0
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for kwargs in views:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            begin = time.perf_counter()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                model(**kwargs)
                graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            recorded = time.perf_counter()
            graph.instantiate()
            instantiation += time.perf_counter() - recorded
            recording += recorded - begin
            graphs.append(graph)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    graphs.clear()
    return total, recording, instantiation


def _phases(report: CaptureReport) -> dict[str, float]:
    phases = report.phases
    return {
        "warmup_s": phases.warmup,
        "recording_s": phases.recording,
        "instantiation_s": phases.instantiation,
        "rest_s": phases.rest,
    }


def main(model_name: str, mode_name: str, *, cold: bool, max_size: int = MAX_SIZE) -> dict[str, object]:
    """The figures of one model and mode (see the module docstring)."""
    torch.manual_seed(0)
    config = MODELS[model_name]()
    decoder = ReferenceDecoder(config, device="cuda")
    inputs = static_inputs(config)
    mode = CUDAGraphMode[mode_name]
    dispatch = DispatchConfig(mode, CaptureSizes.default(max_size), max_num_seqs=config.max_num_seqs)
    manager = CUDAGraphManager(decoder.forward, inputs, dispatch)
    no_warmup = CUDAGraphManager(
        decoder.forward, inputs, dispatch, options=ManagerOptions(capture=CaptureOptions(warmup_runs=0))
    )
    result: dict[str, object] = {
        "model": model_name,
        "mode": mode_name,
        "device": torch.cuda.get_device_name(),
    }
    if cold:
        start = time.perf_counter()
        report = manager.capture(progress=False)
        result["cold_s"] = time.perf_counter() - start
        result["cold_phases"] = _phases(report)
        manager.clear()
    keys = [key for _, group in manager.dispatcher.capture_plan() for key in group]
    views = [key_views(manager, inputs, key) for key in keys]
    with torch.no_grad():
        for kwargs in views:  # every size run once before: a warm process
            decoder.forward(**kwargs)
    torch.cuda.synchronize()
    floors: list[float] = []
    ours: list[float] = []
    bare: list[float] = []
    reports: list[CaptureReport] = []
    floor_split: list[tuple[float, float]] = []
    for _ in range(ROUNDS):
        total, recording, instantiation = floor_seconds(decoder.forward, views)
        floors.append(total)
        floor_split.append((recording, instantiation))
        for target, times in ((manager, ours), (no_warmup, bare)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            report = target.capture(progress=False)
            times.append(time.perf_counter() - start)
            if target is manager:
                reports.append(report)
            target.clear()
    floor = statistics.median(floors)
    result.update(
        graphs=len(keys),
        floor_s=floor,
        floor_recording_s=statistics.median(r for r, _ in floor_split),
        floor_instantiation_s=statistics.median(i for _, i in floor_split),
        warm_s=statistics.median(ours),
        warm_over_floor=statistics.median(o / f for o, f in zip(ours, floors, strict=True)),
        warm_without_warmups_s=statistics.median(bare),
        warm_without_warmups_over_floor=statistics.median(b / f for b, f in zip(bare, floors, strict=True)),
        warm_phases=_phases(reports[len(reports) // 2]),
    )
    if cold:
        result["cold_over_warm_floor"] = float(result["cold_s"]) / floor  # type: ignore[arg-type]  # set above
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="reference")
    parser.add_argument("--mode", choices=["FULL", "FULL_AND_PIECEWISE"], default="FULL")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="turn torch's cuDNN attention off (it builds a plan per new shape: a first-use cost per size)",
    )
    args = parser.parse_args()
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    print(json.dumps(main(args.model, args.mode, cold=args.cold)))
