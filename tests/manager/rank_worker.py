"""One rank of the multi-rank manager tests (``python -m tests.manager.rank_worker SCENARIO ...``).

Spawned by ``tests/manager/test_ranks.py`` through ``tests.ranks_support``.
Each scenario runs on every rank, checks what one rank can check (outputs
against eager), and reports facts as JSON for the parent test to compare
across ranks. ``cpu`` runs over gloo with the fake engines (the manager's
whole logic, no GPU); ``cuda`` runs rank ``r`` on GPU ``r`` with the real
engines, NCCL for the model's collectives; ``shared_cuda`` runs every rank on
GPU 0 with the real engines, each rank its own graphs, and gloo for the
model's collectives (NCCL refuses two ranks on one device), so one GPU runs
the data-parallel scenarios.
"""

from __future__ import annotations

import builtins
import datetime
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

if os.environ.get("CUDAGRAPH_TEST_BLOCK_NUMPY"):  # as a clean install with a CPU torch: no numpy at all
    sys.modules["numpy"] = None  # type: ignore[assignment]  # an import of numpy now raises ImportError

import torch
import torch.distributed as dist

from cudagraph_capture import CaptureInvalidatedError, set_capture_enabled
from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement, RanksDisagreeError
from cudagraph_manager.ranks._agreement import Backend
from tests.manager.helpers import INPUTS, TOL, FakeEngines, ToyModel, config_for, make_batch, rel_err
from tests.ranks_support import Result, rank_main

_TIMEOUT: Final = datetime.timedelta(seconds=60)
_FULL: Final = CUDAGraphMode.FULL
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
#: Where ranks run: ``cpu``; ``cuda`` (rank ``r`` on GPU ``r``, NCCL); ``shared_cuda`` (all on GPU 0, gloo).
_DEVICE_KINDS: Final = ("cpu", "cuda", "shared_cuda")

#: The data-parallel cases: per rank ``(num_tokens, num_reqs, uniform_decode, invalid_modes)``.
DP_CASES: Final[dict[str, tuple[tuple[int, int, bool, frozenset[CUDAGraphMode]], ...]]] = {
    "unequal": ((3, 3, True, frozenset()), (13, 5, False, frozenset())),
    "one_idle": ((5, 2, False, frozenset()), (0, 0, False, frozenset())),
    "above_largest": ((4, 4, True, frozenset()), (40, 8, False, frozenset())),
    "invalid_on_one": ((4, 4, True, frozenset({_FULL})), (4, 4, True, frozenset())),
    "all_idle": ((0, 0, False, frozenset()), (0, 0, False, frozenset())),
    "equal_uniform": ((6, 6, True, frozenset()), (8, 8, True, frozenset())),
    # An idle rank while the other runs eagerly: it still calls the model (its collective).
    "idle_while_eager": ((40, 8, False, frozenset()), (0, 0, False, frozenset())),
}


class CollectiveToy:
    """``ToyModel`` plus one collective of the whole group per call, as a data-parallel MoE layer has.

    The all-reduce sums a count of 1 per rank; the output depends on it
    (times 0). Over NCCL it runs on the model's device, so a graph records it
    and every replay runs it too. Over gloo (the CPU, or ranks sharing one
    GPU) it runs on a CPU tensor at each Python call of the model (a warm-up,
    a capture, an eager step, a dummy step) and adds a host number: nothing of
    it enters a graph. A rank that skipped a model call while another made one
    would leave the other waiting: the test fails by timeout.
    """

    def __init__(self, inner: ToyModel) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        self.calls += 1
        on_device = dist.get_backend() == "nccl"
        count = torch.ones(1, device=x.device if on_device else torch.device("cpu"))
        dist.all_reduce(count)  # [1]: the number of ranks
        hidden = self.inner.hidden(ids, x, scale, bias)  # [T, DIM]
        if on_device:
            return hidden + 0.0 * count  # in the graph: a replay runs the all-reduce
        return hidden + 0.0 * float(count.item())  # a host number: never a copy inside a capture


def _setup(device_kind: str) -> tuple[int, torch.device]:
    """Join the default group and pick this rank's device (see ``_DEVICE_KINDS``)."""
    if device_kind not in _DEVICE_KINDS:
        raise ValueError(f"device kind: expected one of {_DEVICE_KINDS}, got {device_kind!r}")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device_kind == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_TIMEOUT)
    else:
        # Index 0 for every rank when they share a GPU (the first of CUDA_VISIBLE_DEVICES, inherited).
        device = torch.device("cuda", rank if device_kind == "cuda" else 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # replays are compared with eager in full fp32
        if device_kind == "cuda":
            dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=_TIMEOUT)
            # NCCL sets a communicator up on its first collective: let that be now, not inside a capture.
            dist.all_reduce(torch.ones(1, device=device))
        else:  # NCCL refuses two ranks on one device: the model's collectives go over gloo
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_TIMEOUT)
    torch.manual_seed(0)  # every rank builds the same model
    return rank, device


def _where(device: torch.device) -> Result:
    """The device this rank ran on, and the GPU behind it (its UUID: equal on ranks that share one)."""
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
    return {"device": str(device), "gpu": gpu}


def _engines(device: torch.device) -> FakeEngines | None:
    return FakeEngines() if device.type == "cpu" else None


def _replayed(manager: CUDAGraphManager[torch.Tensor]) -> list[str]:
    return sorted(f"{mode.name}:{n}" for (mode, n), count in manager.stats.replays.items() if count)


def data_parallel(args: Sequence[str]) -> Result:
    """Every ``DP_CASES`` step on a FULL_AND_PIECEWISE manager: what ran, and its error against eager."""
    device_kind, backend = args
    if device_kind == "shared_cuda" and backend == "nccl":
        raise ValueError("backend 'nccl' needs a GPU per rank: NCCL refuses two ranks on one device")
    rank, device = _setup(device_kind)
    chosen: Backend = "gloo" if backend == "gloo" else "nccl" if backend == "nccl" else "shm"
    ranks = RankAgreement(backend=chosen, timeout=_TIMEOUT)
    model = ToyModel(device)
    collective = CollectiveToy(model)
    manager = CUDAGraphManager(
        collective,
        INPUTS,
        config_for(CUDAGraphMode.FULL_AND_PIECEWISE),
        device=device,
        options=ManagerOptions(engine_factory=_engines(device), ranks=ranks),
    )
    report = manager.capture()
    result: Result = {"captured": report.num_graphs, "backend": ranks.backend, **_where(device)}
    for i, (name, per_rank) in enumerate(DP_CASES.items()):
        num_tokens, num_reqs, uniform, invalid = per_rank[rank]
        batch = make_batch(num_tokens, num_reqs, device, seed=100 * i + rank)
        manager.reset_stats()
        out = manager.run_batch(batch, uniform_decode=uniform, invalid_modes=invalid)
        stats = manager.stats
        err = rel_err(out, model.eager(batch)) if num_tokens else 0.0
        result[name] = {
            "replayed": _replayed(manager),
            "eager_reasons": dict(stats.eager_reasons),
            "dummy_steps": stats.dummy_steps,
            "idle_steps": stats.idle_steps,
            "padded_tokens": stats.padded_tokens,
            "rows": out.shape[0],
            "err": err,
        }
    # Rank 1 frees its graphs: no rank may replay now, an idle one included.
    if rank == 1:
        manager.clear()
    for name, num_tokens in (("after_clear_idle", 5 if rank == 0 else 0), ("after_clear", 3)):
        manager.reset_stats()
        out = manager.run_batch(make_batch(num_tokens, min(num_tokens, 2), device, seed=rank))
        stats = manager.stats
        result[name] = {
            "replayed": _replayed(manager),
            "eager_reasons": dict(stats.eager_reasons),
            "dummy_steps": stats.dummy_steps,
            "rows": out.shape[0],
        }
    result["model_calls"] = collective.calls
    manager.clear()  # graphs freed before the process ends (rank_main never tears the group down)
    return result


def capture_faults(args: Sequence[str]) -> Result:
    """A plan mismatch, a rank that cannot capture, a capture that fails on rank 1: all ranks raise."""
    (device_kind,) = args
    rank, device = _setup(device_kind)
    ranks = RankAgreement(timeout=_TIMEOUT)
    model = ToyModel(device)
    result: Result = _where(device)

    # 1. Different capture sizes on rank 1: both raise before capturing anything.
    sizes = (1, 2, 4, 8) if rank == 0 else (1, 2, 4, 16)
    mismatched = CUDAGraphManager(
        model,
        INPUTS,
        DispatchConfig(_FULL, CaptureSizes(sizes), 16, 1),
        device=device,
        options=ManagerOptions(engine_factory=_engines(device), ranks=ranks),
    )
    try:
        mismatched.estimate_memory()  # the probes too: a rank's probes would not meet the others'
        result["mismatch_estimate"] = "no error"
    except RanksDisagreeError as error:
        result["mismatch_estimate"] = f"RanksDisagreeError: {error}"
    try:
        mismatched.capture()
        result["mismatch"] = "no error"
    except RanksDisagreeError as error:
        result["mismatch"] = f"RanksDisagreeError: {error}"
    result["mismatch_captured"] = mismatched.num_captured

    # 2. Capture disabled on rank 1: both raise, nothing captured.
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(_FULL),
        device=device,
        options=ManagerOptions(engine_factory=_engines(device), ranks=ranks),
    )
    set_capture_enabled(rank != 1)
    try:
        try:
            manager.estimate_memory()
            result["disabled_estimate"] = "no error"
        except RanksDisagreeError as error:
            result["disabled_estimate"] = f"RanksDisagreeError: {error}"
        manager.capture()
        result["disabled"] = "no error"
    except RanksDisagreeError as error:
        result["disabled"] = f"RanksDisagreeError: {error}"
    finally:
        set_capture_enabled(True)
    result["disabled_captured"] = manager.num_captured

    # 3. Rank 1's model fails while its third key is captured: both raise, both drop that key.
    failing = _FailingOnce(model, fail=rank == 1, at_capture=3)
    manager = CUDAGraphManager(
        failing,
        INPUTS,
        config_for(_FULL),
        device=device,
        options=ManagerOptions(engine_factory=_engines(device), ranks=ranks),
    )
    try:
        manager.capture()
        result["failure"] = "no error"
    except Exception as error:
        result["failure"] = f"{type(error).__name__}: {error}"
    result["failure_captured"] = manager.num_captured
    # Capture again: the rest is captured on both ranks, and a step replays on both.
    manager.capture()
    result["recaptured"] = manager.num_captured
    batch = make_batch(5, 3, device, seed=rank)
    out = manager.run_batch(batch)
    result["after_replayed"] = _replayed(manager)
    result["after_err"] = rel_err(out, model.eager(batch))
    manager.clear()  # graphs freed before the process ends (rank_main never tears the group down)
    result.update(_lockstep_capture(model, device, ranks, rank))
    return result


def _lockstep_capture(model: ToyModel, device: torch.device, ranks: RankAgreement, rank: int) -> Result:
    """``start_capture()`` with ranks: started at step 1 on rank 0 and step 3 on rank 1, two keys a step.

    Rank 1's second recording is invalidated: both ranks drop that key and
    try it again (an invalidated capture is worth a retry, on every rank
    alike). Every step's output is compared with eager. Then a release, and
    a second start whose ``wait()`` (steps of 0 tokens on every rank)
    captures every key at once.
    """
    failing = _FailingOnce(model, fail=rank == 1, at_capture=2, invalidated=True)
    manager = CUDAGraphManager(
        failing,
        INPUTS,
        config_for(_FULL),
        device=device,
        options=ManagerOptions(engine_factory=_engines(device), ranks=ranks),
    )
    captured, worst, session = [], 0.0, None
    for step in range(10):
        if step == 1 + 2 * rank:
            session = manager.start_capture(keys_per_step=2)
        batch = make_batch(5, 3, device, seed=step)
        worst = max(worst, rel_err(manager.run_batch(batch), model.eager(batch)))
        captured.append(manager.num_captured)
    assert session is not None
    report = session.wait()  # done already: nothing exchanged
    out: Result = {
        "lockstep_captured": captured,
        "lockstep_replayed": _replayed(manager),
        "lockstep_err": worst,
        "lockstep_graphs": len(report.graphs),
        "lockstep_retries": session.retries,
        "lockstep_errors": len(session.errors),
        "lockstep_progress": list(session.progress),
    }
    manager.release()
    again = manager.start_capture()
    out["lockstep_wait_graphs"] = len(again.wait().graphs)  # every rank calls it: the keys captured together
    batch = make_batch(5, 3, device, seed=99)
    out["lockstep_wait_err"] = rel_err(manager.run_batch(batch), model.eager(batch))
    manager.clear()
    return out


class _FailingOnce:
    """``model``, raising once in the ``at_capture``-th capture where ``fail`` (the warm-up runs pass).

    ``invalidated``: as CUDA invalidating the capture (``CaptureInvalidatedError``: tried again), else
    the model's own error.
    """

    def __init__(self, model: ToyModel, *, fail: bool, at_capture: int, invalidated: bool = False) -> None:
        self.model = model
        self.fail = fail
        self.at_capture = at_capture
        self.invalidated = invalidated
        self.captures = 0

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        out = self.model.hidden(**inputs)
        capturing = (
            torch.cuda.is_current_stream_capturing() if out.is_cuda else get_forward_context_mode_is_graph()
        )
        if capturing and self.fail:
            self.captures += 1
            if self.captures == self.at_capture:
                self.fail = False
                if self.invalidated:
                    raise CaptureInvalidatedError("planted invalidated capture on this rank")
                raise RuntimeError("planted capture failure on this rank")
        return out


def get_forward_context_mode_is_graph() -> bool:
    """On the CPU the fake engines set a graph mode in the forward context while they capture."""
    from cudagraph_dispatch import get_forward_context

    context = get_forward_context()
    return context is not None and context.runtime_mode is not CUDAGraphMode.NONE


def tensor_parallel(args: Sequence[str]) -> Result:
    """TP over all ranks: the sharded reference decoder in FULL, PIECEWISE and FULL_AND_PIECEWISE.

    Every step's output is compared with the unsharded decoder on this
    device; every rank draws the same steps (a tensor-parallel group runs one
    batch). On the CPU the all-reduces run over gloo, inside the fake engines' replays.
    """
    from examples.config import DecoderConfig
    from examples.inputs import make_step_inputs
    from examples.reference import ReferenceDecoder, static_inputs
    from examples.tensor_parallel import TensorParallelDecoder

    (device_kind,) = args
    _, device = _setup(device_kind)
    ranks = RankAgreement(timeout=_TIMEOUT)
    config = DecoderConfig.small()
    full = ReferenceDecoder(config, device=device)
    sharded = TensorParallelDecoder(full)
    result: Result = {}
    torch.backends.cuda.matmul.allow_tf32 = False
    for mode in (_FULL, _PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE):
        manager = CUDAGraphManager(
            sharded,
            static_inputs(config),
            DispatchConfig(mode, CaptureSizes((1, 2, 4, 8, 16, 32)), config.max_num_seqs, 1),
            device=device,
            strict=True,
            options=ManagerOptions(engine_factory=_engines(device), ranks=ranks),
        )
        report = manager.capture()
        g = torch.Generator().manual_seed(7)  # the same steps on every rank
        errors = []
        for num_tokens in (1, 3, 8, 13, 16, 29, 32):
            for uniform in (True, False):
                if uniform and num_tokens > config.max_num_seqs:
                    continue
                step = make_step_inputs(
                    config, num_tokens, uniform_decode=uniform, generator=g, device=device
                )
                out = manager.run_batch(step, uniform_decode=uniform).clone()
                with torch.no_grad():
                    expected = full(**step)
                errors.append(rel_err(out, expected))
        result[mode.name] = {
            "captured": report.num_graphs,
            "planned": sum(len(keys) for _, keys in manager.dispatcher.capture_plan()),
            "max_err": max(errors),
            "replays": manager.stats.num_replays,
            "eager_steps": manager.stats.eager_steps,
            "steps": len(errors),
            "tol": TOL,
        }
        manager.clear()  # graphs with NCCL operations freed before the process ends
    return result


def tensor_parallel_memory(args: Sequence[str]) -> Result:
    """TP over all ranks, on GPUs: ``estimate_memory()`` against the ``capture()`` it predicts.

    The reference decoder sharded, FULL_AND_PIECEWISE over the 51 default
    sizes up to 512: its graphs hold NCCL all-reduces, so the probes record
    them too. Warmed up by one estimate, capture and release (as the memory
    benchmark is), then timed: the estimate, and the capture whose report
    measures the device's drop of free memory.
    """
    from examples.config import DecoderConfig
    from examples.reference import ReferenceDecoder, static_inputs
    from examples.tensor_parallel import TensorParallelDecoder

    (device_kind,) = args
    _, device = _setup(device_kind)
    ranks = RankAgreement(timeout=_TIMEOUT)
    config = DecoderConfig()
    sharded = TensorParallelDecoder(ReferenceDecoder(config, device=device))
    plan = DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(512), config.max_num_seqs, 1)
    manager = CUDAGraphManager(
        sharded, static_inputs(config), plan, device=device, options=ManagerOptions(ranks=ranks)
    )
    with torch.no_grad():
        manager.estimate_memory()
        manager.capture(progress=False)
        manager.release()
        start = time.perf_counter()
        estimate = manager.estimate_memory()
        estimate_s = time.perf_counter() - start
        start = time.perf_counter()
        report = manager.capture(progress=False)
        capture_s = time.perf_counter() - start
    manager.release()  # graphs with NCCL operations freed before the process ends
    return {
        "graphs": report.num_graphs,
        "estimate_bytes": estimate.total_bytes,
        "measured_bytes": report.device_bytes,
        "estimate_s": estimate_s,
        "capture_s": capture_s,
    }


def late_rank(args: Sequence[str]) -> Result:
    """Rank 1 never joins an exchange: rank 0's raises once the agreement's timeout has passed."""
    (backend,) = args
    rank, _ = _setup("cpu")
    chosen: Backend = "shm" if backend == "shm" else "gloo"
    ranks = RankAgreement(backend=chosen, timeout=datetime.timedelta(seconds=1))
    ranks.exchange((rank,))  # both arrive once
    if rank == 1:
        time.sleep(3)  # then rank 1 stays away three times the timeout
        return {}
    start = time.monotonic()
    try:
        ranks.exchange((rank,))
        return {"late": "no error"}
    except Exception as error:
        return {"late": type(error).__name__, "message": str(error), "waited_s": time.monotonic() - start}


def shm_refused(args: Sequence[str]) -> Result:
    """Rank 1 cannot open the shared table (as another user, or another /dev/shm): both ranks raise."""
    rank, _ = _setup("cpu")
    if rank == 1:
        real_open = builtins.open

        def refusing_open(file: str, *a: Any, **kw: Any) -> Any:
            if "cudagraph-ranks-" in file:
                raise PermissionError(13, "Permission denied", file)
            return real_open(file, *a, **kw)

        builtins.open = refusing_open  # type: ignore[assignment]  # a stand-in with open's behaviour
    try:
        RankAgreement(backend="shm", timeout=_TIMEOUT)
        return {"refused": "no error"}
    except ValueError as error:
        return {"refused": str(error)}


def subgroups(args: Sequence[str]) -> Result:
    """World of 4, data-parallel groups {0, 1} and {2, 3}: each group's members alone build its agreement."""
    (backend,) = args
    rank, _ = _setup("cpu")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    mine = groups[rank // 2]
    chosen: Backend = "shm" if backend == "shm" else "gloo"
    ranks = RankAgreement(mine, backend=chosen, timeout=_TIMEOUT)  # only this group's members
    try:  # every rank passes the same bad row: each is refused by name, before any exchange
        ranks.exchange("abc")  # type: ignore[arg-type]  # the bad input under test
        bad_row = "no error"
    except ValueError as error:
        bad_row = str(error)
    rows = ranks.exchange((rank, 10 * rank))
    # Rank 0 hosts the rendezvous store: it must not leave while the other group still sets up.
    dist.barrier()
    return {
        "group_rank": ranks.rank,
        "world_size": ranks.world_size,
        "rows": [list(r) for r in rows],
        "bad_row": bad_row,
    }


if __name__ == "__main__":
    rank_main(
        {
            "dp": data_parallel,
            "faults": capture_faults,
            "tp": tensor_parallel,
            "tp_memory": tensor_parallel_memory,
            "late": late_rank,
            "subgroups": subgroups,
            "shm_refused": shm_refused,
        }
    )
