"""Several GPUs: the reference decoder, tensor parallel, captured and replayed on every rank.

``python -m examples.several_gpus [--world-size 2] [--device cuda|cpu]
[--backend gloo|shm|nccl]`` starts one process per rank (rank ``r`` on GPU ``r``; ``--device cpu`` runs
the same code over gloo, eagerly). ``--backend`` is the ranks' agreement
(``RankAgreement(backend=...)``: gloo by default, shared memory between the
ranks of one host, or NCCL on the GPUs). Each rank builds the same decoder (same
seed), keeps its shard (``TensorParallelDecoder``: NCCL all-reduces in the
forward), captures it with a ``CUDAGraphManager`` whose ranks agree every
step (``RankAgreement``), decodes a few steps and checks each against the
unsharded decoder. Rank 0 prints what ran.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from examples.tensor_parallel import TensorParallelDecoder, check_shards


def serve(
    rank: int, world_size: int, device_kind: str, steps: int, backend: Literal["gloo", "nccl", "shm"] = "gloo"
) -> None:
    """One rank: join the group, shard the decoder, capture, decode ``steps`` steps, check them."""
    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world_size, timeout=timeout)
    dist.all_reduce(torch.ones(1, device=device))  # NCCL sets its communicator up now, not inside a capture
    torch.manual_seed(0)  # every rank builds the same full model, then keeps its shard
    config = DecoderConfig.small()
    full = ReferenceDecoder(config, device=device)
    model = TensorParallelDecoder(full)
    manager = CUDAGraphManager(
        model,
        static_inputs(config),
        DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes((1, 2, 4, 8, 16)), config.max_num_seqs),
        device=device,
        options=ManagerOptions(ranks=RankAgreement(backend=backend, timeout=timeout)),  # an exchange per step
    )
    report = manager.capture()  # every rank, the same plan: checked before the first capture
    g = torch.Generator().manual_seed(1)  # a TP group runs one batch: the same steps on every rank
    worst = 0.0
    for step in range(steps):
        num_tokens, uniform = (step % 16) + 1, step % 2 == 0
        inputs = make_step_inputs(config, num_tokens, uniform_decode=uniform, generator=g, device=device)
        hidden = manager.run_batch(inputs, uniform_decode=uniform)  # [num_tokens, hidden], on every rank
        with torch.no_grad():
            expected = full(**inputs)
        worst = max(worst, float((hidden - expected).abs().max()))
    if rank == 0:
        print(report)
        stats = manager.stats
        print(
            f"{steps} steps on {world_size} ranks agreeing over {backend}: "
            f"{stats.num_replays} replayed, {stats.eager_steps} eager"
        )
        print(f"largest difference from the unsharded decoder: {worst:.2e}")
    manager.clear()  # free the graphs (they hold NCCL work) before the group goes
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the rendezvous' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.several_gpus", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (one GPU each with --device cuda)")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--backend", choices=("gloo", "shm", "nccl"), default="gloo", help="the ranks' agreement"
    )
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1:
        parser.error(f"--world-size and --steps: expected integers >= 1, got {args.world_size}, {args.steps}")
    try:  # before any rank starts: one line, not a traceback from every process
        check_shards(DecoderConfig.small(), args.world_size)
    except ValueError as error:
        parser.error(f"--world-size {args.world_size}: {error}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        parser.error(f"--world-size {args.world_size}: this machine has {torch.cuda.device_count()} GPU(s)")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl: needs --device cuda")
    # One host: the ranks meet on the loopback interface.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    spawn_args = (args.world_size, args.device, args.steps, args.backend)
    spawn(serve, args=spawn_args, nprocs=args.world_size)  # type: ignore[no-untyped-call]  # untyped in torch


if __name__ == "__main__":
    main()
