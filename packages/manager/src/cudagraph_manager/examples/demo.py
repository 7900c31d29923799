"""Capture and replay the reference decoder, check it against eager, time both.

``python -m cudagraph_manager.demo`` (what ``make demo`` runs). On a GPU it
builds the 8-layer paged decoder (d=1024, bf16), captures every graph of
``--mode`` (``FULL_AND_PIECEWISE``) over ``CaptureSizes.default(256)``,
prints the report (``--mode FULL --attention split_decode``: a downgrade),
runs steps of varying batches, checks each against eager, prints both times,
and exits non-zero when an error exceeds the tolerance; then ``demo_loop``.

Without CUDA (or with ``--cpu``) it says so on its first line and runs a
small float32 decoder under a manager on the CPU, which captures nothing:
each step goes through the same checks, dispatch, static buffers, padding
and attention metadata, then runs eagerly, checked against it unpadded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch

from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, Dispatch, DispatchConfig
from cudagraph_manager import AttentionOptions, CUDAGraphManager, ManagerOptions, StaticInput

from .config import DecoderConfig
from .demo_loop import show_decode_loops
from .paged import BACKENDS, PagedDecoder, PagedLayout, paged_static_inputs
from .reference import ReferenceDecoder, static_inputs
from .testing import make_paged_inputs, make_step_inputs

_DTYPES: Final = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Graph vs eager: the same kernels, but a padded batch may pick other GEMM
# tilings, so the results differ by rounding. A real bug (a stale input, a
# padding row leaking into a request) gives errors of order 1.
_TOLERANCE: Final[dict[torch.dtype, float]] = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# Decode batch sizes (requests of one token) and mixed batch sizes (tokens),
# interleaved two decode steps to one mixed step; the loop ends with a batch
# above the largest capture size, which runs eagerly.
_DECODE_SIZES: Final = (1, 2, 3, 5, 8, 13, 16, 24, 32, 50, 64, 100, 128, 200, 256)
_MIXED_SIZES: Final = (7, 20, 40, 77, 130, 250)
_OVERFLOW: Final = 8  # tokens above the largest capture size for the last step
_CPU_TIMED_ITERS: Final = 3


#: ``--attention``: the paged backends, or ``rows``: the reference decoder's cache of one row per request.
ATTENTIONS: Final = (*BACKENDS, "rows")


@dataclasses.dataclass(frozen=True, slots=True)
class Decoder:
    """The demo's model, whichever attention it runs: how to build its steps and run one eagerly."""

    model: ReferenceDecoder | PagedDecoder
    inputs: dict[str, StaticInput]
    layout: PagedLayout | None  # None: the reference decoder's cache rows

    @classmethod
    def build(cls, config: DecoderConfig, attention: str, page_size: int, device: torch.device) -> Decoder:
        if attention == "rows":
            return cls(ReferenceDecoder(config, device=device), static_inputs(config), None)
        layout = PagedLayout.for_config(config, page_size=page_size)
        model = PagedDecoder(config, layout=layout, backend=attention, device=device)
        return cls(model, paged_static_inputs(layout), layout)

    def make_inputs(
        self, num_tokens: int, uniform: bool, generator: torch.Generator, device: torch.device
    ) -> dict[str, torch.Tensor]:
        config = self.model.config
        if self.layout is None:
            return make_step_inputs(
                config, num_tokens, uniform_decode=uniform, generator=generator, device=device
            )
        return make_paged_inputs(
            config, self.layout, num_tokens, uniform_decode=uniform, generator=generator, device=device
        )

    def num_reqs(self, inputs: dict[str, torch.Tensor]) -> int:
        paged = self.layout is not None
        return int(inputs["query_lens"].shape[0]) if paged else len(set(inputs["cache_rows"].tolist()))

    def eager(self, inputs: dict[str, torch.Tensor], uniform: bool) -> torch.Tensor:
        """The step run eagerly, the attention told whether the batch is uniform (as the manager tells it)."""
        return self.model.step(inputs, uniform_decode=uniform)


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


def schedule(max_size: int, max_num_seqs: int, steps: int) -> list[tuple[int, bool]]:
    """``steps`` batches ``(num_tokens, uniform_decode)``; the last is above ``max_size``."""
    if steps < 1:
        raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
    decode = [n for n in _DECODE_SIZES if n <= min(max_size, max_num_seqs)]
    mixed = [n for n in _MIXED_SIZES if n <= max_size] or [max(1, max_size // 2)]
    base: list[tuple[int, bool]] = []
    for i in range(max(len(decode), 2 * len(mixed))):
        if i < len(decode):
            base.append((decode[i], True))
        if i % 2 == 1 and i // 2 < len(mixed):
            base.append((mixed[i // 2], False))
    body = [base[i % len(base)] for i in range(steps - 1)]
    return [*body, (max_size + _OVERFLOW, False)]


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


def _time_ms(fn: Callable[[], object], *, iters: int, warmup: int, cuda: bool) -> float:
    """Milliseconds per call of ``fn``: warm-up, then ``iters`` calls between two syncs."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cudagraph_manager.demo",
        description="Capture the reference decoder's graphs, replay them, check and time them against eager.",
    )
    parser.add_argument("--max-size", type=int, default=256, help="largest capture size (default 256)")
    parser.add_argument("--steps", type=int, default=24, help="steps in the loop (default 24)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (GPU 8, CPU 2)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (GPU 1024, CPU 128)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (GPU 16, CPU 4)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="KV cache positions per request")
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help="flex: FlexAttention over a paged KV cache (GPU default); gather: each request's pages "
        "gathered, then SDPA (CPU default); rows: the reference decoder's cache of one row per request",
    )
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV page (GPU 128, CPU 16)")
    parser.add_argument("--mode", choices=[m.name for m in CUDAGraphMode], default="FULL_AND_PIECEWISE")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="GPU dtype")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per step (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=None, help="max relative error (default by dtype)")
    parser.add_argument("--cpu", action="store_true", help="take the CPU path even where CUDA is available")
    return _checked(parser, parser.parse_args(argv))


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked and completed (defaults by path, the model's config); errors through ``parser``."""
    for name, low in (("max_size", 1), ("steps", 1), ("iters", 1), ("warmup", 0), ("page_size", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.tolerance is not None and not args.tolerance > 0:
        parser.error(f"--tolerance must be > 0, got {args.tolerance}")
    args.cpu_path = args.cpu or not torch.cuda.is_available()
    if args.attention is None:
        args.attention = "gather" if args.cpu_path else "flex"
    if args.page_size is None:
        args.page_size = 16 if args.cpu_path else 128
    try:
        CaptureSizes.default(args.max_size)
    except ValueError as error:
        parser.error(f"--max-size: {error}")
    try:  # a model the other arguments cannot make is an argument error, not a traceback
        args.model_config = _config(args, cpu=args.cpu_path)
    except ValueError as error:
        parser.error(f"these arguments make no valid decoder: {error}")
    config: DecoderConfig = args.model_config
    last = args.max_size + _OVERFLOW  # the last step's tokens, above the largest size
    if config.max_num_seqs * config.max_seq_len < last:
        parser.error(
            f"--max-seq-len: the last step has {last} tokens, and {config.max_num_seqs} requests of "
            f"{config.max_seq_len} positions hold {config.max_num_seqs * config.max_seq_len}; "
            f"pass at least {-(-last // config.max_num_seqs)}"
        )
    return args


def _config(args: argparse.Namespace, *, cpu: bool) -> DecoderConfig:
    base = DecoderConfig.small() if cpu else DecoderConfig(dtype=_DTYPES[args.dtype])
    hidden = base.hidden_size if args.hidden is None else args.hidden
    ffn = -(-(hidden * 11 // 4) // 32) * 32  # ~2.75 x hidden, a multiple of 32 (2816 for d=1024)
    return dataclasses.replace(
        base,
        num_layers=base.num_layers if args.layers is None else args.layers,
        hidden_size=hidden,
        num_heads=base.num_heads if args.heads is None else args.heads,
        intermediate_size=base.intermediate_size if args.hidden is None else ffn,
        max_seq_len=base.max_seq_len if args.max_seq_len is None else args.max_seq_len,
        max_num_seqs=args.max_size,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (1 when a step's error is above tolerance)."""
    args = parse_args(argv)
    if args.cpu_path:
        why = "--cpu given" if args.cpu else "no CUDA device is available"
        print(
            f"CPU path ({why}): running a small reference decoder eagerly on the CPU; no graphs are "
            "captured, each step shows the graph it would have replayed."
        )
        return _run(args, cpu=True)
    print(f"CUDA device: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    return _run(args, cpu=False)


def _run(args: argparse.Namespace, *, cpu: bool) -> int:
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    device = torch.device("cpu" if cpu else "cuda")
    config: DecoderConfig = args.model_config
    tolerance = _TOLERANCE[config.dtype] if args.tolerance is None else args.tolerance
    dispatch_config = DispatchConfig(
        mode=CUDAGraphMode[args.mode],
        capture_sizes=CaptureSizes.default(args.max_size),
        max_num_seqs=config.max_num_seqs,
    )
    decoder = Decoder.build(config, args.attention, args.page_size, device)
    manager = _manager(decoder, dispatch_config, device)
    _print_setup(decoder, manager, args.attention, device)
    print(manager.capture())  # without CUDA: captures nothing and says why
    dispatcher = manager.dispatcher
    generator = torch.Generator().manual_seed(args.seed)
    results: list[StepResult] = []
    # Row by row, flushed: a step's log line (an eager step's reason, on stderr) lands
    # next to its row, piped or not.
    _print_header(cpu=cpu)
    with torch.no_grad():
        for num_tokens, uniform in schedule(args.max_size, config.max_num_seqs, args.steps):
            inputs = decoder.make_inputs(num_tokens, uniform, generator, device)
            decision = dispatcher.dispatch(num_tokens, uniform_decode=uniform)
            results.append(_step(decoder, manager, inputs, decision, uniform, args))
            _print_row(len(results) - 1, results[-1])
    _print_summary(results)
    stats = manager.stats
    print(
        f"manager stats: {stats.replays_of(CUDAGraphMode.FULL)} FULL and "
        f"{stats.replays_of(CUDAGraphMode.PIECEWISE)} PIECEWISE replays, {stats.eager_steps} eager steps, "
        f"{stats.padded_tokens} padded tokens"
    )
    if not show_decode_loops(decoder.model, dispatch_config.mode, cpu=cpu, seed=args.seed, iters=args.iters):
        return 1  # the section printed what failed
    failures = [(i, r) for i, r in enumerate(results) if not r.rel_err <= tolerance]
    elapsed = time.perf_counter() - started
    if failures:
        for i, r in failures:
            print(
                f"FAILED: step {i} ({r.num_tokens} tokens, {describe(r.dispatch)}): relative error "
                f"{r.rel_err:.3g} > tolerance {tolerance:.3g}"
            )
        return 1
    worst = max(r.rel_err for r in results)
    what = "padded eager steps match unpadded" if cpu else "graph steps match eager"
    print(
        f"OK: all {len(results)} {what} (max relative error {worst:.2e} <= {tolerance:.0e}); {elapsed:.1f} s"
    )
    return 0


def _print_setup(
    decoder: Decoder, manager: CUDAGraphManager[torch.Tensor], attention: str, device: torch.device
) -> None:
    """The model, its KV cache and the graphs planned (the mode resolved against the attention)."""
    config, layout = decoder.model.config, decoder.layout
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


def _manager(
    decoder: Decoder, dispatch_config: DispatchConfig, device: torch.device
) -> CUDAGraphManager[torch.Tensor]:
    """A manager over the model (its attention's builder, where it has one), not captured yet."""
    seam = decoder.model.backend if isinstance(decoder.model, PagedDecoder) else None  # the builder
    options: ManagerOptions[torch.Tensor] = ManagerOptions(attention=AttentionOptions(metadata_builder=seam))
    return CUDAGraphManager(
        decoder.model.forward, decoder.inputs, dispatch_config, device=device, options=options
    )


def run_graph(
    manager: CUDAGraphManager[torch.Tensor], uniform: bool, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """``manager.run`` on the decoder's step inputs: the final hidden states ``[T, hidden]``."""
    return manager.run_batch(inputs, uniform_decode=uniform)


def _step(
    decoder: Decoder,
    manager: CUDAGraphManager[torch.Tensor],
    inputs: dict[str, torch.Tensor],
    decision: Dispatch,
    uniform: bool,
    args: argparse.Namespace,
) -> StepResult:
    """One step through the manager, checked against the same step run eagerly, and timed.

    The manager first, then eager on the same inputs (writing K/V is
    idempotent); the manager's output aliases graph memory until the next
    run, so it is cloned first. Without CUDA only eager is timed.
    """
    cuda = manager.device.type == "cuda"
    managed_out = run_graph(manager, uniform, inputs).clone()  # [T, hidden]
    eager_out = decoder.eager(inputs, uniform)  # [T, hidden]
    rel_err = _relative_error(managed_out, eager_out)
    iters, warmup = (args.iters, args.warmup) if cuda else (min(args.iters, _CPU_TIMED_ITERS), 1)
    eager_ms = _time_ms(lambda: decoder.eager(inputs, uniform), iters=iters, warmup=warmup, cuda=cuda)
    graph_ms = (
        _time_ms(lambda: run_graph(manager, uniform, inputs), iters=iters, warmup=warmup, cuda=True)
        if cuda
        else None
    )
    num_tokens = inputs["input_ids"].shape[0]
    return StepResult(num_tokens, decoder.num_reqs(inputs), uniform, decision, eager_ms, graph_ms, rel_err)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float32; synchronizes (reads a device scalar)."""
    a, e = actual.to(torch.float32), expected.to(torch.float32)
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e).clamp_min(1e-30))


def _print_header(*, cpu: bool) -> None:
    graph_header = "would replay" if cpu else "replayed"
    header = f"{'step':>4} {'tokens':>6} {'reqs':>4} {'batch':<7} {graph_header:<32} {'eager ms':>9}"
    if not cpu:
        header += f" {'graph ms':>9} {'speedup':>8}"
    header += f" {'rel err':>9}"
    print(header)
    print("-" * len(header), flush=True)


def _print_row(index: int, r: StepResult) -> None:
    line = (
        f"{index:>4} {r.num_tokens:>6} {r.num_reqs:>4} {'decode' if r.uniform else 'mixed':<7} "
        f"{describe(r.dispatch):<32} {r.eager_ms:>9.3f}"
    )
    if r.graph_ms is not None:
        line += f" {r.graph_ms:>9.3f} {r.eager_ms / r.graph_ms:>7.2f}x"
    line += f" {r.rel_err:>9.2e}"
    print(line, flush=True)


def _print_summary(results: Sequence[StepResult]) -> None:
    timed = [r for r in results if r.graph_ms is not None and r.dispatch.mode is not CUDAGraphMode.NONE]
    for kind, uniform in (("decode", True), ("mixed", False)):
        ratios = [r.eager_ms / r.graph_ms for r in timed if r.uniform is uniform and r.graph_ms is not None]
        if ratios:
            mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            print(f"{kind} steps replayed from graphs: geometric mean speedup {mean:.2f}x over {len(ratios)}")


if __name__ == "__main__":
    sys.exit(main())
