"""One rank of the two-GPU expert-parallel benchmark (``python -m tests.benchmarks.ep_moe ep WORKDIR``).

Spawned by ``test_bench_ep_moe.py`` through ``tests.ranks_support`` (or by
hand). Both ranks build the DP-attention + EP-MoE decoder (``examples.ep``:
4 layers, d=1024, bf16, 8 experts of 1024, 4 a rank, top-2, exact capacity)
and run the same candidates in the same order, every step synchronized, so
their all-to-alls meet; rank 0's figures are the result. Per decode batch
(1, 16, 64, 256 a rank): eager, the FULL graph without an agreement, and the
FULL graph agreeing every step over shm, NCCL and gloo; then one
``agree_step`` alone per backend; then the graphs' memory, exact capacity
against a capacity factor of 1: the peak one step allocates (what a graph's
pool holds for it) and the exchange buffers of one layer.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from typing import Final

import torch
import torch.distributed as dist

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig, RankRequest
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement
from cudagraph_manager.ranks._agreement import Backend
from examples.config import DecoderConfig
from examples.ep.decoder import ExpertParallelDecoder
from examples.ep.moe import MoeConfig, MoeWeights
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.benchmarks.multi_gpu import median_us
from tests.ranks_support import Result, rank_main

BATCHES: Final = (1, 16, 64, 256)
_CALLS: Final = 100
_AGREE_CALLS: Final = 1000
_TIMEOUT: Final = datetime.timedelta(seconds=120)
_MIB: Final = 2**20


def _synced(step: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        step()
        torch.cuda.synchronize()

    return call


def _stepper(
    manager: CUDAGraphManager[torch.Tensor], inputs: dict[str, torch.Tensor]
) -> Callable[[], object]:
    return lambda: manager.run_batch(inputs)


def _step_peak(model: ExpertParallelDecoder, inputs: dict[str, torch.Tensor]) -> int:
    """The bytes one eager step allocates at its peak, over what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(**inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _setup() -> torch.device:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=_TIMEOUT)
    dist.all_to_all_single(torch.empty(2, device=device), torch.zeros(2, device=device))  # NCCL connects now
    return device


def expert_parallel(args: Sequence[str]) -> Result:
    device = _setup()
    torch.manual_seed(0)
    config = DecoderConfig(num_layers=4, max_num_seqs=256, max_seq_len=256)
    moe = MoeConfig(num_experts=8, top_k=2, expert_size=1024)
    full = ReferenceDecoder(config, device=device)
    shape = {"num_layers": 4, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    weights = MoeWeights(moe, **shape, device=device, dtype=config.dtype)
    model = ExpertParallelDecoder(full, weights, moe)
    plan = DispatchConfig(CUDAGraphMode.FULL, CaptureSizes(BATCHES), config.max_num_seqs, 1)
    backends: tuple[Backend, ...] = ("shm", "nccl", "gloo")
    agreements = {b: RankAgreement(backend=b, timeout=_TIMEOUT) for b in backends}

    def manager(
        ranks: RankAgreement | None, of: ExpertParallelDecoder = model
    ) -> CUDAGraphManager[torch.Tensor]:
        return CUDAGraphManager(
            of, static_inputs(config), plan, device=device, strict=True, options=ManagerOptions(ranks=ranks)
        )

    alone = manager(None)
    memory: dict[str, float] = {"first_capture_bytes": alone.capture(progress=False).device_bytes}
    agreeing = {name: manager(ranks) for name, ranks in agreements.items()}
    for built in agreeing.values():
        built.capture(progress=False)
    result: Result = {"device": torch.cuda.get_device_name(device), "world_size": dist.get_world_size()}
    g = torch.Generator().manual_seed(1)
    for batch in BATCHES:
        inputs = make_step_inputs(config, batch, uniform_decode=True, generator=g, device=device)

        def eager(inputs: dict[str, torch.Tensor] = inputs) -> None:
            with torch.no_grad():
                model(**inputs)

        figures = {"eager": median_us(_synced(eager), _CALLS, warm_up=20)}
        figures["graph"] = median_us(_synced(_stepper(alone, inputs)), _CALLS, warm_up=20)
        for name, built in agreeing.items():
            figures[f"graph_{name}"] = median_us(_synced(_stepper(built, inputs)), _CALLS, warm_up=20)
        figures["speedup"] = figures["eager"] / figures["graph"]
        figures["speedup_shm"] = figures["eager"] / figures["graph_shm"]
        result[f"batch{batch}_us"] = figures
    request = RankRequest(1, True, 0, frozenset())
    for name, ranks in agreements.items():
        step = lambda r=ranks: r.agree_step(alone.dispatcher, request, can_replay=True)  # noqa: E731
        result[f"agree_step_us_{name}"] = median_us(step, _AGREE_CALLS, warm_up=20)
    for built in (alone, *agreeing.values()):
        built.clear()
    factor = MoeConfig(num_experts=8, top_k=2, expert_size=1024, capacity_factor=1.0)
    dropping = ExpertParallelDecoder(full, weights, factor)
    g = torch.Generator().manual_seed(2)
    for batch in BATCHES:  # what one step allocates beyond the weights and caches: a graph's pool holds it
        inputs = make_step_inputs(config, batch, uniform_decode=True, generator=g, device=device)
        for label, of, layout in (("exact", model, moe), ("factor1", dropping, factor)):
            memory[f"{label}_step_peak_mib_batch{batch}"] = _step_peak(of, inputs) / _MIB
            memory[f"{label}_layer_buffers_mib_batch{batch}"] = (
                layout.buffer_bytes(batch, 2, config.hidden_size, 2) / _MIB
            )
    result["memory"] = memory
    if dist.get_rank() == 0:
        print(result, flush=True)
    return result


if __name__ == "__main__":
    rank_main({"ep": expert_parallel})
