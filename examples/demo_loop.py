"""The demo's decode-loop section: many decode steps per call, on the device and from the host.

After the demo's steps, a manager of the same paged decoder with a decode
loop (``DecodeLoop`` of ``greedy_advance``) captures the uniform keys of a
few batch sizes, each with its loop. Each batch (random prompts on pages of
its own) is decoded twice: by ``run_loop`` (one WHILE launch on a GPU) and by
a host loop (``manager.run`` per step, the same advance on the device
without the metadata, the stop flag read back after each step). The tokens
must be identical; the section prints the tokens per second of each.

Without CUDA the device loop is not there: ``run_loop`` loops on the host,
eagerly over the static buffers, and the section checks it against the host
loop on two small batches; both are host loops then, so no speedup is printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions
from cudagraph_manager.attention import AttentionOptions

from .paged import PagedDecoder, paged_static_inputs
from .paged.loop import NO_TOKEN, PagedAdvance, decode_batch, greedy_advance

#: Requests per batch (capped by the model's ``max_num_seqs``), steps per loop, timed calls.
GPU_BATCHES: Final = (1, 8, 64)
CPU_BATCHES: Final = (1, 8)
GPU_STEPS: Final = 64
CPU_STEPS: Final = 8


def show_decode_loops(model: object, mode: CUDAGraphMode, *, cpu: bool, seed: int, iters: int) -> bool:
    """Run the section (prints a table); False (with a FAILED line) when a batch's tokens differ.

    A model other than ``PagedDecoder`` (``--attention rows``) has no advance: the section says so.
    """
    if not isinstance(model, PagedDecoder):
        print("\ndecode loop: shown for the paged decoder (--attention flex, gather, varlen, split_decode)")
        return True
    config = model.config
    batches = [n for n in (CPU_BATCHES if cpu else GPU_BATCHES) if n <= config.max_num_seqs]
    max_steps = CPU_STEPS if cpu else GPU_STEPS
    max_len = min(config.max_seq_len, model.layout.max_seq_len)
    advance = greedy_advance(model, eos_id=None, max_len=max_len)
    dispatch = DispatchConfig(mode, CaptureSizes(batches), max_num_seqs=config.max_num_seqs)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        device=model.body.device,
        options=ManagerOptions(
            attention=AttentionOptions(metadata_builder=model.backend),
            decode_loop=DecodeLoop(advance, max_steps=max_steps),
        ),
    )
    with torch.no_grad():
        manager.capture(progress=False)
    print()
    if cpu:
        print(
            "decode loop: a GPU feature (one WHILE launch); here run_loop loops eagerly on the host, "
            "like the host loop, so there is no speedup to show (their rates differ by noise only)"
        )
    print(f"decode loop: greedy, up to {max_steps} steps, prompts up to {max_len - 1} tokens, {mode.name}")
    head = f"{'loop kind':<10} {'reqs':>4} {'steps':>5} {'tokens':>6} {'host tok/s':>11} {'loop tok/s':>11}"
    print(head if cpu else f"{head} {'speedup':>8}")
    generator = torch.Generator().manual_seed(seed)
    same = True
    for num_reqs in batches:
        lens = torch.randint(1, max_len, (num_reqs,), generator=generator).tolist()
        batch = decode_batch(model, lens, max_len=max_len, generator=generator, device=model.body.device)
        same &= _compare(manager, advance, batch, max_steps, iters=1 if cpu else min(iters, 5), cpu=cpu)
    if not same:
        print("FAILED: the decode loop's tokens differ from the host loop's")
    return same


def _compare(
    manager: CUDAGraphManager[torch.Tensor],
    advance: PagedAdvance,
    batch: Mapping[str, torch.Tensor],
    max_steps: int,
    *,
    iters: int,
    cpu: bool,
) -> bool:
    """One batch both ways: identical tokens, and each way's tokens per second; prints its row.

    The speedup (host loop's time over the loop's) only where the loop runs on the device (not ``cpu``).
    """
    with torch.no_grad():
        result = manager.run_loop(max_steps=max_steps, **batch)
        looped = result.tokens.clone()  # [steps, R]: a view until the next call
        hosted = host_loop(manager, advance, batch, max_steps)
        loop_s = _seconds(lambda: manager.run_loop(max_steps=max_steps, **batch), iters)
        host_s = _seconds(lambda: host_loop(manager, advance, batch, max_steps), iters)
    same = torch.equal(looped, hosted)
    generated = int((looped != NO_TOKEN).sum())
    kind = "host" if result.kind is None else result.kind.value
    speedup = "" if cpu else f" {host_s / loop_s:>7.2f}x"
    print(
        f"{kind:<10} {looped.shape[1]:>4} {result.steps:>5} {generated:>6} {generated / host_s:>11.0f} "
        f"{generated / loop_s:>11.0f}{speedup}" + ("" if same else "  TOKENS DIFFER"),
        flush=True,
    )
    return same


def host_loop(
    manager: CUDAGraphManager[torch.Tensor],
    advance: PagedAdvance,
    batch: Mapping[str, torch.Tensor],
    max_steps: int,
) -> torch.Tensor:
    """The loop driven from the host: ``run`` per step, the advance's input update, a stop read-back.

    Returns ``[steps, R]`` int64 tokens (``NO_TOKEN`` once a request finished).
    The metadata is built afresh by every ``run``, so only the inputs advance.
    """
    inputs = {name: tensor.clone() for name, tensor in batch.items()}  # advanced in place
    num_reqs, device = inputs["input_ids"].shape[0], inputs["input_ids"].device
    state = LoopState(
        torch.zeros((), dtype=torch.int64, device=device),
        torch.zeros((), dtype=torch.bool, device=device),
        torch.ones(num_reqs, dtype=torch.bool, device=device),
        torch.full((max_steps, num_reqs), NO_TOKEN, dtype=torch.int64, device=device),
    )
    for step in range(max_steps):
        state.step.fill_(step)
        advance.step_inputs(manager.run_batch(inputs, uniform_decode=True), inputs, state)
        if bool(state.stop):  # the host synchronization of every step
            return state.tokens[: step + 1]
    return state.tokens


def _seconds(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn`` (one warm-up call first; ``fn`` synchronizes itself)."""
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters
