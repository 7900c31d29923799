"""Size the KV cache from the memory the CUDA graphs will leave: estimate, allocate, then capture.

``python -m examples.kv_sizing [reference|8b_like] [--attention rows|flex|gather]
[--margin-mib N] [--json]``

``--attention rows`` (the default) sizes the reference decoder's cache in
request rows; ``flex`` and ``gather`` size a paged cache in pages
(``examples.paged``).

An engine's start-up, in order: build the model (its KV cache at the
minimum, one row per request of a batch), ask the manager what capturing
every graph will cost (``estimate_memory()``: a few probe captures, freed
again), give the KV cache every byte the graphs and a stated margin leave,
then capture. What the device has left after the capture is the margin plus
the estimate's error (plus less than one KV row of rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_dispatch.lowlevel import check_int
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions, MemoryEstimate
from cudagraph_manager.attention import AttentionOptions
from examples.config import DecoderConfig
from examples.inputs import make_paged_inputs, make_step_inputs
from examples.paged import BACKENDS, PagedDecoder, paged_static_inputs
from examples.reference import ReferenceDecoder, static_inputs

#: What stays free after the capture: eager steps above the largest size, other allocations.
DEFAULT_MARGIN_MIB: Final = 512
MODELS: Final = {"reference": DecoderConfig, "8b_like": DecoderConfig.llama_8b_like}
#: ``--attention``: the reference decoder's rows, or a paged backend.
ATTENTIONS: Final = ("rows", *BACKENDS)


@dataclasses.dataclass(frozen=True, slots=True)
class KvSizing:
    """What the start-up did: the estimate, the KV cache it allowed, the capture, what was left."""

    estimate: MemoryEstimate
    kv_units: int  # request rows, or pages of a paged cache (``kv_unit``)
    kv_bytes: int
    report: CaptureReport
    margin_bytes: int
    left_bytes: int  # the device's free memory after the capture

    def __str__(self) -> str:
        mib = 2**20
        error = self.estimate.total_bytes - self.report.device_bytes
        return (
            f"graphs estimated at {self.estimate.total_bytes / mib:.0f} MiB "
            f"in {self.estimate.seconds:.2f} s, "
            f"cost {self.report.device_bytes / mib:.0f} MiB (error {error / mib:+.0f} MiB); "
            f"KV cache {self.kv_bytes / 2**30:.2f} GiB ({self.kv_units} request rows or pages); "
            f"left after the capture {self.left_bytes / mib:.0f} MiB "
            f"(margin {self.margin_bytes / mib:.0f} MiB)"
        )


def start_up(
    manager: CUDAGraphManager[torch.Tensor], model: ReferenceDecoder | PagedDecoder, margin_bytes: int
) -> KvSizing:
    """Profile an eager step, estimate the graphs, give the KV cache the rest minus ``margin_bytes``, capture.

    The eager step of the largest size comes first, as an engine profiles
    its peak activations: the kernels' first loads are then not the graphs'.
    A bad argument raises ``ValueError`` naming it, before anything runs.
    """
    given: object = manager
    if not isinstance(given, CUDAGraphManager):
        raise ValueError(f"manager: expected a CUDAGraphManager, got {manager!r:.80}")
    given_model: object = model
    if not isinstance(given_model, (ReferenceDecoder, PagedDecoder)):
        raise ValueError(f"model: expected a ReferenceDecoder or a PagedDecoder, got {model!r:.80}")
    check_int("margin_bytes", margin_bytes, minimum=0)
    config = model.config
    largest = max(key.num_tokens for _, keys in manager.dispatcher.capture_plan() for key in keys)
    if isinstance(model, PagedDecoder):
        model.warm_up(largest)  # every shape its attention compiles for, before anything is measured
        profile = make_paged_inputs(config, model.layout, largest, uniform_decode=False, device="cuda")
        unit_bytes, current_units = model.kv_page_bytes(), model.layout.num_pages
    else:
        profile = make_step_inputs(config, largest, uniform_decode=False, device="cuda")
        unit_bytes, current_units = model.kv_row_bytes(), config.max_num_seqs + 1
    model.step(profile)
    estimate = manager.estimate_memory()  # leaves nothing behind: no graph, an emptied cache
    current = unit_bytes * current_units  # the minimal cache, freed when replaced
    budget = torch.cuda.mem_get_info()[0] + current - estimate.total_bytes - margin_bytes
    units = budget // unit_bytes
    model.allocate_kv_cache(units)
    report = manager.capture(progress=False)
    return KvSizing(estimate, units, units * unit_bytes, report, margin_bytes, torch.cuda.mem_get_info()[0])


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked before anything touches the device (``--help`` works anywhere)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.kv_sizing",
        description="Size a KV cache from the memory the CUDA graphs leave: estimate, allocate, capture.",
    )
    parser.add_argument("model", nargs="?", choices=sorted(MODELS), default="reference")
    parser.add_argument(
        "--attention",
        choices=[*ATTENTIONS],
        default="rows",
        help="rows: a cache row per request (default); flex or gather: a paged cache, sized in pages",
    )
    parser.add_argument("--margin-mib", type=int, default=DEFAULT_MARGIN_MIB, help="free memory to leave")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    if args.margin_mib < 0:
        parser.error(f"--margin-mib must be >= 0, got {args.margin_mib}")
    return args


def main(argv: list[str]) -> KvSizing:
    args = parse_args(argv)
    name, attention, margin_mib = args.model, args.attention, args.margin_mib
    if not torch.cuda.is_available():
        raise SystemExit("This example sizes a KV cache on a CUDA device; none is available here.")
    torch.manual_seed(0)
    decoder = MODELS[name]()
    config = DispatchConfig(
        CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(512), max_num_seqs=decoder.max_num_seqs
    )
    model: ReferenceDecoder | PagedDecoder
    if attention == "rows":
        model = ReferenceDecoder(decoder, device="cuda")
        manager = CUDAGraphManager(model.forward, static_inputs(decoder), config, strict=True)
    else:
        model = PagedDecoder(decoder, backend=attention, device="cuda")
        seam = AttentionOptions(metadata_builder=model.backend)
        manager = CUDAGraphManager(
            model,
            paged_static_inputs(model.layout),
            config,
            strict=True,
            options=ManagerOptions(attention=seam),
        )
    with torch.no_grad():
        sizing = start_up(manager, model, margin_mib * 2**20)
        print(sizing)
        inputs = (  # a decode step: replayed
            make_paged_inputs(decoder, model.layout, 100, uniform_decode=True, device="cuda")
            if isinstance(model, PagedDecoder)
            else make_step_inputs(decoder, 100, uniform_decode=True, device="cuda")
        )
        manager.run_batch(inputs, uniform_decode=True)
        print(manager.stats)
        if args.json:  # for the tests and benchmarks: the figures, one line
            figures = {
                "estimate_bytes": sizing.estimate.total_bytes,
                "estimate_s": sizing.estimate.seconds,
                "device_bytes": sizing.report.device_bytes,
                "capture_s": sizing.report.seconds,
                "kv_units": sizing.kv_units,
                "kv_bytes": sizing.kv_bytes,
                "unit_bytes": model.kv_page_bytes()
                if isinstance(model, PagedDecoder)
                else model.kv_row_bytes(),
                "kv_unit": "page" if isinstance(model, PagedDecoder) else "row",
                "num_layers": decoder.num_layers,
                "margin_bytes": sizing.margin_bytes,
                "left_bytes": sizing.left_bytes,
                "eager_steps": manager.stats.eager_steps,
            }
            print(json.dumps(figures))
    return sizing


if __name__ == "__main__":
    main(sys.argv[1:])
