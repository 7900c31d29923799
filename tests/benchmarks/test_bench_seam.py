"""Host cost of the attention seam per step: ``run()`` with a metadata builder against ``run()`` without.

Three managers of one tiny FULL graph (``x * 2`` over 64 tokens, 16
requests), captured alike: no builder (today's ``run()``), a builder that
returns metadata built once (the seam's own cost: the ``StepBatch``, the
call), and a builder that fills one per-request buffer (``pad_rows``: a copy
and a fill, what the smallest real builder does). Rounds alternate the three
(``interleave``: each round ``_CALLS`` calls and one sync). Target: the seam
adds at most 10 us per step for a builder that only fills buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_dispatch.support import AttentionSupport
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, attention_metadata, pad_rows
from tests.benchmarks.support import BenchmarkFixture, interleave

pytestmark = pytest.mark.gpu

_TOKENS: Final = 64
_REQS: Final = 16
_CALLS: Final = 500
_ROUNDS: Final = 41
_INPUTS: Final = {
    "x": StaticInput(dtype=torch.float32, rows="tokens"),
    "lens": StaticInput(dtype=torch.int32, rows="reqs", pad_value=1),
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Lens:
    lens: torch.Tensor  # [R] int32


class _Builder:
    """``fill``: pads the step's lengths into its buffer; else returns the metadata built once."""

    support = AttentionSupport(name="bench")

    def __init__(self, fill: bool) -> None:
        self.buffer = torch.ones(_REQS, dtype=torch.int32, device="cuda")
        self.fixed = _Lens(self.buffer)
        self.fill = fill

    def build(self, batch: StepBatch, shape: BatchShape, /) -> _Lens:
        if not self.fill:
            return self.fixed
        if batch.num_reqs:
            return _Lens(pad_rows(self.buffer[: shape.num_reqs], batch.inputs["lens"], 1))
        return _Lens(self.buffer[: shape.num_reqs].fill_(1))  # a warm-up's: all padding

    def build_for_capture(self, shape: BatchShape, /) -> _Lens:
        return _Lens(self.buffer[: shape.num_reqs])


def _manager(builder: _Builder | None) -> CUDAGraphManager[torch.Tensor]:
    def double(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        if builder is not None:
            attention_metadata(builder)  # read as an attention would
        return x * 2  # [T]

    config = DispatchConfig(CUDAGraphMode.FULL, CaptureSizes([_TOKENS]), max_num_seqs=_REQS)
    manager = CUDAGraphManager(
        double, _INPUTS, config, options=ManagerOptions(attention=AttentionOptions(metadata_builder=builder))
    )
    manager.capture(progress=False)
    return manager


def test_bench_seam_host_cost(benchmark: BenchmarkFixture) -> None:
    x = torch.randn(_TOKENS, device="cuda")
    lens = torch.randint(1, 9, (_REQS,), dtype=torch.int32, device="cuda")
    managers = {"no_builder": _manager(None), "seam_only": _manager(_Builder(False))}
    managers["fill_builder"] = _manager(_Builder(True))
    for manager in managers.values():
        torch.testing.assert_close(manager.run(x=x, lens=lens), x * 2)
    results: list[dict[str, float]] = []

    def measure() -> None:
        timed = interleave(
            {name: functools.partial(m.run, x=x, lens=lens) for name, m in managers.items()},
            rounds=_ROUNDS,
            calls_per_round=_CALLS,
        )
        medians = {name: statistics.median(s) * 1e6 for name, s in timed.samples.items()}
        for name in ("seam_only", "fill_builder"):
            pairs = zip(timed.samples[name], timed.samples["no_builder"], strict=True)
            medians[f"{name}_minus_no_builder_us"] = statistics.median(a - b for a, b in pairs) * 1e6
        results.append(medians)

    benchmark.group = f"attention seam: host us per run() of a {_TOKENS}-token FULL graph"
    benchmark.pedantic(measure, rounds=1, iterations=1)
    (medians,) = results
    benchmark.extra_info.update({f"{k}_us" if not k.endswith("_us") else k: v for k, v in medians.items()})
    for manager in managers.values():
        assert manager.stats.eager_steps == 0
