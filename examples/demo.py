"""Capture and replay the reference decoder, check it against eager, time both.

``python -m examples.demo`` (what ``make demo`` runs). On a GPU it
builds the 8-layer paged decoder (d=1024, bf16), captures every graph of
``--mode`` (``FULL_AND_PIECEWISE``) over ``CaptureSizes.default(256)``,
prints the report (``--mode FULL --attention split_decode``: a downgrade),
runs steps of varying batches, checks each against eager, prints both times,
and exits non-zero when an error exceeds the tolerance; then ``demo_loop``.
Its command line is ``demo_args``, its table ``demo_report``.

Without CUDA (or with ``--cpu``) it says so on its first line and runs a
small float32 decoder under a manager on the CPU, which captures nothing:
each step goes through the same checks, dispatch, static buffers, padding
and attention metadata, then runs eagerly, checked against it unpadded.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, Dispatch, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager.attention import AttentionOptions

from .config import DecoderConfig
from .demo_args import OVERFLOW, parse_args
from .demo_loop import show_decode_loops
from .demo_report import StepResult, print_header, print_row, print_setup, print_summary, print_verdict
from .inputs import make_paged_inputs, make_step_inputs
from .paged import PagedDecoder, PagedLayout, paged_static_inputs
from .reference import ReferenceDecoder, static_inputs

# Graph vs eager: the same kernels, but a padded batch may pick other GEMM
# tilings, so the results differ by rounding. A real bug (a stale input, a
# padding row leaking into a request) gives errors of order 1.
_TOLERANCE: Final[dict[torch.dtype, float]] = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# Decode batch sizes (requests of one token) and mixed batch sizes (tokens),
# interleaved two decode steps to one mixed step; the loop ends with a batch
# above the largest capture size, which runs eagerly.
_DECODE_SIZES: Final = (1, 2, 3, 5, 8, 13, 16, 24, 32, 50, 64, 100, 128, 200, 256)
_MIXED_SIZES: Final = (7, 20, 40, 77, 130, 250)
_CPU_TIMED_ITERS: Final = 3


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
    return [*body, (max_size + OVERFLOW, False)]


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
    print_setup(config, decoder.layout, manager, args.attention, device)
    print(manager.capture())  # without CUDA: captures nothing and says why
    dispatcher = manager.dispatcher
    generator = torch.Generator().manual_seed(args.seed)
    results: list[StepResult] = []
    print_header(cpu=cpu)
    with torch.no_grad():
        for num_tokens, uniform in schedule(args.max_size, config.max_num_seqs, args.steps):
            inputs = decoder.make_inputs(num_tokens, uniform, generator, device)
            decision = dispatcher.dispatch(num_tokens, uniform_decode=uniform)
            results.append(_step(decoder, manager, inputs, decision, uniform, args))
            print_row(len(results) - 1, results[-1])
    print_summary(results, manager)
    if not show_decode_loops(decoder.model, dispatch_config.mode, cpu=cpu, seed=args.seed, iters=args.iters):
        return 1  # the section printed what failed
    return print_verdict(results, tolerance, time.perf_counter() - started, cpu=cpu)


def _manager(
    decoder: Decoder, dispatch_config: DispatchConfig, device: torch.device
) -> CUDAGraphManager[torch.Tensor]:
    """A manager over the model (its attention's builder, where it has one), not captured yet."""
    builder = decoder.model.backend if isinstance(decoder.model, PagedDecoder) else None
    options: ManagerOptions[torch.Tensor] = ManagerOptions(
        attention=AttentionOptions(metadata_builder=builder)
    )
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


if __name__ == "__main__":
    sys.exit(main())
