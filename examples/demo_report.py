"""The demo's report: the setup, a row per step, the speedups and the verdict.

Rows are printed as the steps run, flushed, so a step's log line (an eager
step's reason, on stderr) lands next to its row, piped or not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, Dispatch
from cudagraph_manager import CUDAGraphManager

from .config import DecoderConfig
from .paged import PagedLayout


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """One row of the demo's table."""

    num_tokens: int
    num_reqs: int
    uniform: bool
    dispatch: Dispatch
    eager_ms: float
    graph_ms: float | None  # None on the CPU path: nothing was replayed
    rel_err: float


def describe(decision: Dispatch) -> str:
    """A short text for a dispatch decision: the mode and the graph key."""
    mode, key = decision
    if mode is CUDAGraphMode.NONE:
        return "NONE (eager)"
    return f"{mode.name} {_describe_key(key)}"


def _describe_key(key: BatchDescriptor) -> str:
    parts = [f"{key.num_tokens} tok"]
    if key.num_reqs is not None:
        parts.append(f"{key.num_reqs} reqs")
    if key.uniform:
        parts.append("uniform")
    if key.has_lora:
        parts.append(f"{key.num_active_loras} loras")
    return ", ".join(parts)


def print_setup(
    config: DecoderConfig,
    layout: PagedLayout | None,
    manager: CUDAGraphManager[torch.Tensor],
    attention: str,
    device: torch.device,
) -> None:
    """The model, its KV cache (``layout`` None: a row per request) and the graphs planned."""
    cache = (
        f"{config.max_num_seqs}+1 x {config.max_seq_len} positions"
        if layout is None
        else f"{layout.num_pages} pages of {layout.page_size}, {attention} attention"
    )
    print(
        f"decoder: {config.num_layers} layers, d={config.hidden_size}, {config.num_heads} heads, "
        f"ffn {config.intermediate_size}, {str(config.dtype).removeprefix('torch.')}, KV cache "
        f"{cache}, on {device}"
    )
    sizes = manager.dispatcher.config.capture_sizes
    print(f"graphs: {manager.dispatcher.resolution} over {len(sizes)} sizes up to {sizes.max}")


def print_header(*, cpu: bool) -> None:
    graph_header = "would replay" if cpu else "replayed"
    header = f"{'step':>4} {'tokens':>6} {'reqs':>4} {'batch':<7} {graph_header:<32} {'eager ms':>9}"
    if not cpu:
        header += f" {'graph ms':>9} {'speedup':>8}"
    header += f" {'rel err':>9}"
    print(header)
    print("-" * len(header), flush=True)


def print_row(index: int, r: StepResult) -> None:
    line = (
        f"{index:>4} {r.num_tokens:>6} {r.num_reqs:>4} {'decode' if r.uniform else 'mixed':<7} "
        f"{describe(r.dispatch):<32} {r.eager_ms:>9.3f}"
    )
    if r.graph_ms is not None:
        line += f" {r.graph_ms:>9.3f} {r.eager_ms / r.graph_ms:>7.2f}x"
    line += f" {r.rel_err:>9.2e}"
    print(line, flush=True)


def print_summary(results: Sequence[StepResult], manager: CUDAGraphManager[torch.Tensor]) -> None:
    """The geometric mean speedup of each kind of step replayed, and the manager's counts."""
    timed = [r for r in results if r.graph_ms is not None and r.dispatch.mode is not CUDAGraphMode.NONE]
    for kind, uniform in (("decode", True), ("mixed", False)):
        ratios = [r.eager_ms / r.graph_ms for r in timed if r.uniform is uniform and r.graph_ms is not None]
        if ratios:
            mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            print(f"{kind} steps replayed from graphs: geometric mean speedup {mean:.2f}x over {len(ratios)}")
    stats = manager.stats
    print(
        f"manager stats: {stats.replays_of(CUDAGraphMode.FULL)} FULL and "
        f"{stats.replays_of(CUDAGraphMode.PIECEWISE)} PIECEWISE replays, {stats.eager_steps} eager steps, "
        f"{stats.padded_tokens} padded tokens"
    )


def print_verdict(results: Sequence[StepResult], tolerance: float, elapsed: float, *, cpu: bool) -> int:
    """Each step above ``tolerance`` (exit status 1), else the OK line (0)."""
    failures = [(i, r) for i, r in enumerate(results) if not r.rel_err <= tolerance]
    for i, r in failures:
        print(
            f"FAILED: step {i} ({r.num_tokens} tokens, {describe(r.dispatch)}): relative error "
            f"{r.rel_err:.3g} > tolerance {tolerance:.3g}"
        )
    if failures:
        return 1
    worst = max(r.rel_err for r in results)
    what = "padded eager steps match unpadded" if cpu else "graph steps match eager"
    print(
        f"OK: all {len(results)} {what} (max relative error {worst:.2e} <= {tolerance:.0e}); {elapsed:.1f} s"
    )
    return 0
