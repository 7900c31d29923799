"""One rank of the two-GPU benchmarks (``python -m tests.benchmarks.multi_gpu tp WORKDIR``).

Spawned by ``test_bench_multi_gpu.py`` through ``tests.ranks_support``. Both
ranks build the tensor-parallel reference decoder (8 layers, d=1024, bf16,
8 heads per rank) and run the same candidates in the same order, so their
collectives meet; rank 0's timings are the result. Per batch (1, 16, 128),
interleaved rounds of: eager, a hand-written ``torch.cuda.CUDAGraph``, the
manager in FULL and in PIECEWISE, and the FULL manager agreeing every step
over gloo, NCCL and shared memory (``RankAgreement``), each also with a
synchronize after every step. Then the agreement alone, and the bare
all-reduce of each group.
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Final

import torch
import torch.distributed as dist

from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, DispatchConfig, RankRequest
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from examples.tensor_parallel import TensorParallelDecoder
from tests.benchmarks.support import interleave
from tests.ranks_support import Result, rank_main

BATCHES: Final = (1, 16, 128)
_ROUNDS: Final = 15
_CALLS: Final = 20
_AGREE_CALLS: Final = 2000
_TIMEOUT: Final = datetime.timedelta(seconds=120)


def _hand_written(model: TensorParallelDecoder, inputs: dict[str, torch.Tensor]) -> Callable[[], object]:
    """A ``torch.cuda.CUDAGraph`` of one step on ``inputs`` (static), warmed up on a side stream."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped stubs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(**inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        model(**inputs)
    return graph.replay


def _synced(manager: CUDAGraphManager[torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    manager.run_batch(inputs)
    torch.cuda.synchronize()


def median_us(call: Callable[[], object], calls: int, *, warm_up: int = 100) -> float:
    """Median over 5 rounds of ``call``'s host time (microseconds a call), after ``warm_up`` calls."""
    for _ in range(warm_up):
        call()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            call()
        samples.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    return sorted(samples)[len(samples) // 2]


def tensor_parallel(args: Sequence[str]) -> Result:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=_TIMEOUT)
    dist.all_reduce(torch.ones(1, device=device))  # NCCL's communicator set up now, not inside a capture
    torch.manual_seed(0)
    config = DecoderConfig()
    model = TensorParallelDecoder(ReferenceDecoder(config, device=device))
    gloo = RankAgreement(backend="gloo", timeout=_TIMEOUT)
    nccl = RankAgreement(backend="nccl", timeout=_TIMEOUT)
    shm = RankAgreement(backend="shm", timeout=_TIMEOUT)
    sizes = CaptureSizes(BATCHES)

    def manager(mode: CUDAGraphMode, ranks: RankAgreement | None) -> CUDAGraphManager[torch.Tensor]:
        built = CUDAGraphManager(
            model,
            static_inputs(config),
            DispatchConfig(mode, sizes, config.max_num_seqs, 1),
            device=device,
            strict=True,
            options=ManagerOptions(ranks=ranks),
        )
        built.capture()
        return built

    full, piecewise = manager(CUDAGraphMode.FULL, None), manager(CUDAGraphMode.PIECEWISE, None)
    full_gloo, full_nccl = manager(CUDAGraphMode.FULL, gloo), manager(CUDAGraphMode.FULL, nccl)
    full_shm = manager(CUDAGraphMode.FULL, shm)
    result: Result = {"world_size": world_size, "device": torch.cuda.get_device_name(device)}
    g = torch.Generator().manual_seed(1)  # the same steps on every rank
    for batch in BATCHES:
        inputs = make_step_inputs(config, batch, uniform_decode=True, generator=g, device=device)
        static = {name: t.clone() for name, t in inputs.items()}
        graph = _hand_written(model, static)

        def graph_with_copies(
            static: dict[str, torch.Tensor] = static,
            inputs: dict[str, torch.Tensor] = inputs,
            replay: Callable[[], object] = graph,
        ) -> None:
            for name, t in inputs.items():  # what the manager does too: the step into the graph's buffers
                static[name].copy_(t)
            replay()

        def eager(inputs: dict[str, torch.Tensor] = inputs) -> object:
            with torch.no_grad():
                return model(**inputs)

        candidates: dict[str, Callable[[], object]] = {
            "eager": eager,
            "cuda_graph": graph,
            "cuda_graph_with_copies": graph_with_copies,
            "manager_full": functools.partial(full.run_batch, inputs),
            "manager_piecewise": functools.partial(piecewise.run_batch, inputs),
            "manager_full_agreed_gloo": functools.partial(full_gloo.run_batch, inputs),
            "manager_full_agreed_nccl": functools.partial(full_nccl.run_batch, inputs),
            "manager_full_agreed_shm": functools.partial(full_shm.run_batch, inputs),
            # As an engine that reads each step's results before the next: nothing hides the agreement.
            "manager_full_synced": functools.partial(_synced, full, inputs),
            "manager_full_agreed_gloo_synced": functools.partial(_synced, full_gloo, inputs),
            "manager_full_agreed_nccl_synced": functools.partial(_synced, full_nccl, inputs),
            "manager_full_agreed_shm_synced": functools.partial(_synced, full_shm, inputs),
        }
        timed = interleave(candidates, rounds=_ROUNDS, calls_per_round=_CALLS)
        full_us = timed.median("manager_full") * 1e6
        synced_us = timed.median("manager_full_synced") * 1e6
        result[f"batch{batch}"] = {
            "median_us": {name: timed.median(name) * 1e6 for name in candidates},
            "full_over_eager": timed.ratio("manager_full", "eager"),
            "eager_over_full": 1.0 / timed.ratio("manager_full", "eager"),
            "full_over_cuda_graph": timed.ratio("manager_full", "cuda_graph"),
            "full_over_cuda_graph_with_copies": timed.ratio("manager_full", "cuda_graph_with_copies"),
            "piecewise_over_full": timed.ratio("manager_piecewise", "manager_full"),
            "agreed_gloo_minus_full_us": timed.median("manager_full_agreed_gloo") * 1e6 - full_us,
            "agreed_nccl_minus_full_us": timed.median("manager_full_agreed_nccl") * 1e6 - full_us,
            "synced_agreed_gloo_minus_full_us": timed.median("manager_full_agreed_gloo_synced") * 1e6
            - synced_us,
            "synced_agreed_nccl_minus_full_us": timed.median("manager_full_agreed_nccl_synced") * 1e6
            - synced_us,
            "agreed_shm_minus_full_us": timed.median("manager_full_agreed_shm") * 1e6 - full_us,
            "synced_agreed_shm_minus_full_us": timed.median("manager_full_agreed_shm_synced") * 1e6
            - synced_us,
        }
        del graph
    dispatcher = CUDAGraphDispatcher(DispatchConfig(CUDAGraphMode.FULL, sizes, config.max_num_seqs, 1))
    request = RankRequest(1 + rank, True, 0)
    for name, ranks in (("gloo", gloo), ("nccl", nccl), ("shm", shm)):
        table = torch.zeros(10, dtype=torch.int64, device="cpu" if name == "gloo" else device)

        def agree(ranks: RankAgreement = ranks) -> None:
            ranks.agree_step(dispatcher, request, can_replay=True)

        def floor(ranks: RankAgreement = ranks, table: torch.Tensor = table) -> None:
            dist.all_reduce(table, group=ranks.group)  # the same table's all-reduce alone, waited for
            torch.cuda.synchronize()

        result[f"agree_step_{name}_us"] = median_us(agree, _AGREE_CALLS)
        if name != "shm":  # shm has no all-reduce
            result[f"all_reduce_{name}_us"] = median_us(floor, _AGREE_CALLS)
    for built in (full, piecewise, full_gloo, full_nccl, full_shm):
        built.clear()  # graphs with NCCL operations freed before the process ends
    torch.cuda.synchronize()
    return result


if __name__ == "__main__":
    rank_main({"tp": tensor_parallel})
