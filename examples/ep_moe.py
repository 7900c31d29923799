"""Expert parallelism inside CUDA graphs: DP attention + EP MoE on two ranks, checked against one process.

``python -m examples.ep_moe [--device cuda|cpu] [--steps 64] [--top-k 2]
[--capacity-factor F] [--backend gloo|shm|nccl]`` starts two rank processes
(rank ``r`` on GPU ``r``; ``--device cpu`` runs the same code over gloo,
eagerly). Each builds the decoder of ``examples.ep`` (its own requests'
attention, half the experts), captures it FULL_AND_PIECEWISE with a manager
whose ranks agree every step, runs random steps whose sizes each rank draws
on its own (0 and above the largest size included) and checks each against
the single-process oracle. Rank 0 prints what ran.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from cudagraph_dispatch import CUDAGraphMode
from examples.config import DecoderConfig
from examples.ep.moe import MoeConfig
from examples.ep.steps import build_rank, check_steps, dispatch_config
from examples.several_gpus import free_port

SIZES = (1, 2, 4, 8, 16, 32)


def serve(
    rank: int, device_kind: str, steps: int, moe: MoeConfig, backend: Literal["gloo", "nccl", "shm"]
) -> None:
    """One rank: join, build, capture, run ``steps`` checked steps, free the graphs, leave."""
    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # compared with the oracle in float32
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=2, timeout=timeout)
    dist.all_to_all_single(torch.empty(2, device=device), torch.zeros(2, device=device))  # connect now
    config = DecoderConfig.small()
    built = build_rank(
        config, moe, dispatch_config(CUDAGraphMode.FULL_AND_PIECEWISE, config, SIZES), device, backend=backend
    )
    report = built.manager.capture()  # every rank, the same plan
    tally = check_steps(built, steps, seed=3, sizes=SIZES)
    if rank == 0:
        print(report)
        print(f"{tally.steps} steps on 2 ranks agreeing over {backend}: {dict(tally.routes)}")
        print(
            f"compared with the oracle: {tally.compared}, mismatches: {tally.mismatches}, "
            f"largest relative difference {tally.worst:.2e}"
        )
        print(f"pairs dropped for capacity on rank 0: {tally.dropped} (the oracle: {tally.dropped_expected})")
    built.manager.clear()  # free the graphs (they hold NCCL work) before the group goes
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.ep_moe", description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2, choices=(1, 2))
    parser.add_argument("--capacity-factor", type=float, default=None, help="default: exact, nothing dropped")
    parser.add_argument("--backend", choices=("gloo", "shm", "nccl"), default="gloo", help="the agreement")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected an integer >= 1, got {args.steps}")
    try:
        moe = MoeConfig(top_k=args.top_k, expert_size=64, capacity_factor=args.capacity_factor)
    except ValueError as error:
        parser.error(f"--capacity-factor: {error}")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error(f"--device cuda: needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl: needs --device cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    spawn(serve, args=(args.device, args.steps, moe, args.backend), nprocs=2)  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
