"""Size the KV cache in both orders: estimate, allocate, capture; or capture, then back it from what is free.

``python -m examples.kv_sizing [reference|8b_like] [--attention rows|flex|gather|varlen|split_decode]
[--order both|estimate|capture] [--margin-mib N] [--json]``

``--attention rows`` (the default) sizes the reference decoder's cache in
request rows; the paged backends size a paged cache in pages
(``examples.paged``).

An engine's start-up, in the order every engine uses today (``estimate``):
build the model (its KV cache at the minimum), ask the manager what
capturing every graph will cost (``estimate_memory()``: a few probe
captures, freed again), give the KV cache every byte the graphs and a
stated margin leave, then capture. What the device has left after the
capture is the margin plus the estimate's error (plus less than one KV row
of rounding).

Turned round (``capture``): build the model with its KV cache over
reserved addresses (``reserve_row_cache``, ``reserve_paged_cache``: only
the rows or page that padding writes are backed), capture every graph, then
back the cache from the free memory measured after the capture minus the
margin (``back_kv_cache(margin_bytes=...)``). Nothing is estimated: what is
left is the margin to within one chunk (2 MiB), and the capture is not
preceded by an estimate. ``both`` (the default) runs each order in a fresh
process and prints them side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from typing import Final, TypeAlias

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_dispatch.lowlevel import check_int
from cudagraph_manager import (
    CaptureReport,
    CUDAGraphManager,
    KVCacheMemory,
    ManagerOptions,
    MemoryEstimate,
)
from cudagraph_manager.attention import AttentionOptions
from examples.config import DecoderConfig
from examples.inputs import make_paged_inputs, make_step_inputs
from examples.paged import BACKENDS, PagedDecoder, max_flex_pages, paged_static_inputs, reserve_paged_cache
from examples.paged.flex import FlexPagedAttention
from examples.paged.flex_kernel import addressable_slots
from examples.reference import ReferenceDecoder, reserve_row_cache, static_inputs

#: What stays free after the start-up: eager steps above the largest size, other allocations.
DEFAULT_MARGIN_MIB: Final = 512
MODELS: Final = {"reference": DecoderConfig, "8b_like": DecoderConfig.llama_8b_like}
#: ``--attention``: the reference decoder's rows, or a paged backend.
ATTENTIONS: Final = ("rows", *BACKENDS)
#: ``--order``: estimate first, capture first, or each in a fresh process, side by side.
ORDERS: Final = ("both", "estimate", "capture")
#: The paged cache's page size (FlexAttention's kernel takes multiples of 64).
PAGE_SIZE: Final = 128
#: A start-up's figures, as its JSON line has them.
Figures: TypeAlias = dict[str, float | int | str]


@dataclasses.dataclass(frozen=True, slots=True)
class KvSizing:
    """What the estimate-first start-up did: the estimate, the KV cache it allowed, the capture, the rest."""

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


@dataclasses.dataclass(frozen=True, slots=True)
class KvFirst:
    """What the capture-first start-up did: the capture, the backing after it, what was left."""

    report: CaptureReport
    kv_units: int  # rows or pages backed: what the engine may hand out
    kv_bytes: int  # those units' bytes
    backed_bytes: int  # what the reservation has backed (a chunk's rest included)
    back_seconds: float  # back_kv_cache(): measuring free memory, backing, zeroing (synchronized)
    back_host_seconds: float  # back_kv_cache()'s host time: its zeroing queued, not waited for
    startup_seconds: float  # capture() + back_kv_cache()
    margin_bytes: int
    left_bytes: int  # the device's free memory after the start-up

    def __str__(self) -> str:
        mib = 2**20
        return (
            f"graphs cost {self.report.device_bytes / mib:.0f} MiB in {self.report.seconds:.2f} s; "
            f"KV cache backed after them: {self.kv_bytes / 2**30:.2f} GiB ({self.kv_units} request rows or "
            f"pages) in {self.back_seconds * 1e3:.1f} ms; start-up {self.startup_seconds:.2f} s; left "
            f"{self.left_bytes / mib:.0f} MiB (margin {self.margin_bytes / mib:.0f} MiB)"
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
    largest = _largest(manager)
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
    cap = kernel_cap(model)
    units = units if cap is None else min(units, cap)
    model.allocate_kv_cache(units)
    report = manager.capture(progress=False)
    return KvSizing(estimate, units, units * unit_bytes, report, margin_bytes, torch.cuda.mem_get_info()[0])


def start_up_capture_first(
    manager: CUDAGraphManager[torch.Tensor], model: ReferenceDecoder | PagedDecoder, margin_bytes: int
) -> KvFirst:
    """Capture every graph against the reserved cache, then back it from what is free minus ``margin_bytes``.

    The manager was built with ``ManagerOptions(kv_cache=...)``, the model over the same memory.
    """
    kv_cache = model.kv_cache
    assert kv_cache is not None, (
        "the model's cache is reserved memory (reserve_row_cache, reserve_paged_cache)"
    )
    if isinstance(model, PagedDecoder):
        model.warm_up(_largest(manager))  # FlexAttention's shape classes, as in the other order
    start = time.perf_counter()
    report = manager.capture(progress=False)
    backing = time.perf_counter()
    units = manager.back_kv_cache(margin_bytes=margin_bytes)
    queued = time.perf_counter()
    torch.cuda.current_stream().synchronize()  # the new memory zeroed: the start-up is done
    done = time.perf_counter()
    return KvFirst(
        report,
        units,
        units * kv_cache.unit_bytes,
        kv_cache.memory.backed_bytes,
        done - backing,
        queued - backing,
        done - start,
        margin_bytes,
        torch.cuda.mem_get_info()[0],
    )


def _largest(manager: CUDAGraphManager[torch.Tensor]) -> int:
    return max(key.num_tokens for _, keys in manager.dispatcher.capture_plan() for key in keys)


def build(
    name: str, attention: str, *, reserved: bool
) -> tuple[CUDAGraphManager[torch.Tensor], ReferenceDecoder | PagedDecoder]:
    """The model and its strict manager, FULL_AND_PIECEWISE up to 512 tokens; ``reserved``: the cache over
    reserved memory (``ManagerOptions(kv_cache=...)``), else ordinary tensors at the minimum."""
    decoder = MODELS[name]()
    config = DispatchConfig(
        CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(512), max_num_seqs=decoder.max_num_seqs
    )
    kv_cache: KVCacheMemory | None = None
    model: ReferenceDecoder | PagedDecoder
    if attention == "rows":
        kv_cache = reserve_row_cache(decoder, device="cuda") if reserved else None
        model = ReferenceDecoder(decoder, device="cuda", kv_cache=kv_cache)
        options: ManagerOptions[torch.Tensor] = ManagerOptions(kv_cache=kv_cache)
        return CUDAGraphManager(
            model.forward, static_inputs(decoder), config, strict=True, options=options
        ), model
    # FlexAttention's fused kernel addresses at most max_flex_pages (32-bit offsets): its cache is capped.
    max_pages = max_flex_pages(decoder, PAGE_SIZE) if attention == "flex" else None
    kv_cache = (
        reserve_paged_cache(decoder, page_size=PAGE_SIZE, max_pages=max_pages, device="cuda")
        if reserved
        else None
    )
    model = PagedDecoder(decoder, backend=attention, device="cuda", kv_cache=kv_cache)
    options = ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend), kv_cache=kv_cache)
    manager = CUDAGraphManager(model, paged_static_inputs(model.layout), config, strict=True, options=options)
    return manager, model


def decode_step(
    manager: CUDAGraphManager[torch.Tensor], model: ReferenceDecoder | PagedDecoder, num_tokens: int = 100
) -> None:
    """A uniform decode step of ``num_tokens`` requests on the units backed: replayed (strict)."""
    decoder = model.config
    if isinstance(model, PagedDecoder):
        pages = model.layout.num_pages if model.kv_cache is None else model.kv_cache.units
        inputs = make_paged_inputs(
            decoder, model.layout, num_tokens, uniform_decode=True, device="cuda", num_pages=pages
        )
    else:
        inputs = make_step_inputs(decoder, num_tokens, uniform_decode=True, device="cuda")
    manager.run_batch(inputs, uniform_decode=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked before anything touches the device (``--help`` works anywhere)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.kv_sizing",
        description="Size a KV cache in both orders: estimate then capture, or capture then back it.",
    )
    parser.add_argument("model", nargs="?", choices=sorted(MODELS), default="reference")
    parser.add_argument(
        "--attention",
        choices=[*ATTENTIONS],
        default="rows",
        help="rows: a cache row per request (default); a paged backend: a paged cache, sized in pages",
    )
    parser.add_argument(
        "--order",
        choices=[*ORDERS],
        default="both",
        help="estimate first, capture first, or both in fresh processes, side by side (default)",
    )
    parser.add_argument("--margin-mib", type=int, default=DEFAULT_MARGIN_MIB, help="free memory to leave")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args(argv)
    if args.margin_mib < 0:
        parser.error(f"--margin-mib must be >= 0, got {args.margin_mib}")
    return args


def kernel_cap(model: ReferenceDecoder | PagedDecoder) -> int | None:
    """The most pages the model's attention kernel can address, where one bounds them; else ``None``.

    FlexAttention's fused kernel addresses keys with 32-bit offsets (``flex_kernel``): one layer's
    keys, ``heads * head_dim`` elements a slot in an ordinary cache, every layer's in a reserved one.
    """
    if not isinstance(model, PagedDecoder) or not isinstance(model.backend, FlexPagedAttention):
        return None
    config, page_size = model.config, model.layout.page_size
    if model.kv_cache is not None:
        return max_flex_pages(config, page_size)
    return addressable_slots(config.num_heads * config.head_dim) // page_size


def figures_of(sizing: KvSizing | KvFirst, model: ReferenceDecoder | PagedDecoder) -> Figures:
    """The start-up's figures, for the JSON line (the tests' and benchmarks')."""
    common: Figures = {
        "device_bytes": sizing.report.device_bytes,
        "capture_s": sizing.report.seconds,
        "kv_units": sizing.kv_units,
        "kv_bytes": sizing.kv_bytes,
        "unit_bytes": model.kv_page_bytes() if isinstance(model, PagedDecoder) else model.kv_row_bytes(),
        "kv_unit": "page" if isinstance(model, PagedDecoder) else "row",
        "num_layers": model.config.num_layers,
        "margin_bytes": sizing.margin_bytes,
        "left_bytes": sizing.left_bytes,
        "kv_cap": kernel_cap(model) or 0,  # 0: no kernel bounds the cache (the device's memory does)
    }
    if isinstance(sizing, KvFirst):
        return {
            "order": "capture",
            **common,
            "backed_bytes": sizing.backed_bytes,
            "back_s": sizing.back_seconds,
            "back_host_s": sizing.back_host_seconds,
            "startup_s": sizing.startup_seconds,
        }
    return {
        "order": "estimate",
        **common,
        "estimate_bytes": sizing.estimate.total_bytes,
        "estimate_s": sizing.estimate.seconds,
        "startup_s": sizing.estimate.seconds + sizing.report.seconds,
    }


def side_by_side(model: str, attention: str, margin_mib: int) -> list[Figures]:
    """Each order in a fresh process (``--json``); a table of the two."""
    rows = []
    for order in ORDERS[1:]:
        argv = ["-m", "examples.kv_sizing", model, "--attention", attention, "--order", order]
        argv += ["--margin-mib", str(margin_mib), "--json"]
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"--order {order} failed:\n{done.stderr[-3000:]}")
        row: Figures = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
    mib = 2**20
    print(f"{model}, {attention}: margin {margin_mib} MiB")
    print(
        f"{'order':<9} {'KV GiB':>8} {'units':>8} {'left MiB':>9} {'over margin MiB':>16} {'start-up s':>11}"
    )
    for row in rows:
        left = float(row["left_bytes"])
        print(
            f"{row['order']!s:<9} {float(row['kv_bytes']) / 2**30:8.2f} {row['kv_units']!s:>8} "
            f"{left / mib:9.0f} {(left - margin_mib * mib) / mib:16.1f} {float(row['startup_s']):11.2f}"
        )
    return rows


def main(argv: list[str]) -> KvSizing | KvFirst | None:
    args = parse_args(argv)
    name, attention, margin_mib = args.model, args.attention, args.margin_mib
    if args.order == "both":
        rows = side_by_side(name, attention, margin_mib)
        if args.json:
            print(json.dumps({"estimate": rows[0], "capture": rows[1]}))
        return None
    if not torch.cuda.is_available():
        raise SystemExit("This example sizes a KV cache on a CUDA device; none is available here.")
    torch.manual_seed(0)
    manager, model = build(name, attention, reserved=args.order == "capture")
    with torch.no_grad():
        sizing: KvSizing | KvFirst
        if args.order == "capture":
            sizing = start_up_capture_first(manager, model, margin_mib * 2**20)
        else:
            sizing = start_up(manager, model, margin_mib * 2**20)
        print(sizing)
        decode_step(manager, model)  # replayed: strict
        print(manager.stats)
        if args.json:  # for the tests and benchmarks: the figures, one line
            print(json.dumps({**figures_of(sizing, model), "eager_steps": manager.stats.eager_steps}))
    return sizing


if __name__ == "__main__":
    main(sys.argv[1:])
