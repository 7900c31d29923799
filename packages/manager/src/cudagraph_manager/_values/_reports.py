"""What the manager did: the capture report and the run statistics, as values."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, EagerReason
from cudagraph_dispatch._support import ModeResolution

_UNITS: Final = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheBacking:
    """How much of a KV cache's reservation is backed: ``KVCacheMemory.backing()``, the reports, ``stats``.

    ``units`` of ``max_units`` are backed (the unit ids below ``units``:
    what the engine may hand out, its scratch unit included), each of
    ``unit_bytes``; ``backed_bytes`` of the ``reserved_bytes`` reserved are
    backed, in ``mappings`` mappings, exact to ``chunk_bytes`` (the device's
    granularity; a fallback's whole allocation). ``seconds`` is the host time
    the last change of the backing took (creating, mapping and giving access
    to the memory, or unmapping it; measuring free memory included),
    ``changes`` how many changes there were. ``fallback`` says why the cache
    is an ordinary allocation (``None``: reserved addresses, backed on demand).
    """

    units: int
    max_units: int
    unit_bytes: int
    backed_bytes: int
    reserved_bytes: int
    chunk_bytes: int
    mappings: int
    seconds: float = 0.0
    changes: int = 0
    fallback: str | None = None

    def __str__(self) -> str:
        gib, mib = 2**30, 2**20
        if self.fallback is not None:
            return (
                f"KV cache: {self.units} of {self.max_units} units usable, an ordinary allocation of "
                f"{self.backed_bytes / gib:.2f} GiB ({self.fallback})"
            )
        return (
            f"KV cache: {self.units} of {self.max_units} units backed ({self.backed_bytes / gib:.2f} of "
            f"{self.reserved_bytes / gib:.2f} GiB reserved, {self.mappings} mappings, chunks of "
            f"{self.chunk_bytes / mib:g} MiB); last change {self.seconds * 1e3:.2f} ms"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class CapturedGraph:
    """One captured graph: its key, what it cost in host time and in device memory.

    ``seconds`` is host time of the warm-up and the capture (the device is not
    synchronized per graph), split into ``warmup_seconds`` (the eager runs
    before it, where the key had one), ``recording_seconds`` (the capture's
    begin to end, the model's calls included), ``instantiation_seconds``
    (building the executable) and ``rest_seconds`` (the checks and the
    bookkeeping around them). ``pool_bytes`` is the growth of the device's
    reserved memory during the recording: the new memory this graph needed
    from the shared pool (torch's allocator). Graphs captured later (smaller)
    mostly reuse the pool, so their share is often 0. ``driver_bytes`` is
    what the device's free memory lost during the recording on top of that:
    memory the CUDA driver took outside torch's allocator, chiefly the
    graph's executable (kernel nodes, their parameters). The driver reports
    free memory in 2 MiB steps, so one graph's figure is coarse; totals are
    what adds up.
    """

    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    seconds: float
    pool_bytes: int
    driver_bytes: int = 0
    warmup_seconds: float = 0.0
    recording_seconds: float = 0.0
    instantiation_seconds: float = 0.0
    #: A decode loop's graph (``run_loop``), beside the key's one-step graph.
    loop: bool = False

    @property
    def rest_seconds(self) -> float:
        """``seconds`` not spent warming up, recording or instantiating."""
        return self.seconds - self.warmup_seconds - self.recording_seconds - self.instantiation_seconds


@dataclasses.dataclass(frozen=True, slots=True)
class CapturePhases:
    """A capture's host seconds by phase: what the floor (recording, instantiation) is, and what is not."""

    warmup: float
    recording: float
    instantiation: float
    rest: float

    def __str__(self) -> str:
        return (
            f"warm-up {self.warmup:.3f} s, recording {self.recording:.3f} s, "
            f"instantiation {self.instantiation:.3f} s, rest {self.rest:.3f} s"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class CaptureReport:
    """Every graph one ``capture()`` call captured, in capture order, and the totals.

    ``seconds`` is the wall time of the whole phase, its stream synchronized at
    the end; ``reserved_bytes`` is the growth of reserved device memory over
    it (the graphs' pool plus the allocator blocks of the eager warm-ups).
    ``device_bytes`` is what the device's free memory (``cudaMemGetInfo``)
    lost over it: ``reserved_bytes`` plus ``outside_allocator_bytes``, the
    memory taken outside torch's allocator (the graphs' executables, whose
    share per recording is each graph's ``driver_bytes``, and the cuBLAS
    handles a capture thread creates). Counted: the pool, the
    warm-ups' allocator blocks, the executables, and whatever another thread
    or process allocated on the device meanwhile. Not counted: the static
    buffers (allocated with the manager), and the shared pool's anchor graph
    when the first capture of the process created it before the phase.
    ``no_graphs`` says why nothing was captured where graphs cannot be
    (a manager on a device without CUDA graphs); ``None`` otherwise.
    ``shrink_fallback`` says why the decode loops it captured do not shrink
    (``"one_graph: ..."``, ``"no_row_order: ..."``, ``"no_device_choice:
    ..."``: each loop then runs every step on its first key); ``None`` where
    they shrink, or where it captured no loop.
    ``resolution`` is the configured mode resolved against the model's
    attention support (``ModeResolution``: the mode the graphs follow, and
    why it was downgraded, if it was; printed when it was). ``compiles``
    is how many graphs ``torch.compile`` (dynamo) compiled during the
    capture, recompiles included: a compiled model compiles in its first
    warm-up; ``None`` when dynamo was never loaded. Dynamo's count is
    process-wide: a compile by another thread meanwhile counts too.
    ``kv_cache``: how much of the KV cache's reservation was backed when the
    capture ended (``ManagerOptions.kv_cache``; ``None`` without one): in
    the capture-first order, ``min_units`` only, backed for good before any
    warm-up wrote padding's K/V there.
    """

    graphs: tuple[CapturedGraph, ...]
    seconds: float
    reserved_bytes: int
    no_graphs: str | None = None
    compiles: int | None = None
    device_bytes: int = 0
    resolution: ModeResolution | None = dataclasses.field(default=None, compare=False)
    kv_cache: KVCacheBacking | None = dataclasses.field(default=None, compare=False)
    shrink_fallback: str | None = None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    @property
    def outside_allocator_bytes(self) -> int:
        """What the device lost outside torch's allocator: ``device_bytes - reserved_bytes``."""
        return self.device_bytes - self.reserved_bytes

    @property
    def pool_bytes(self) -> int:
        """The memory the graphs took from the pool: the sum of their shares."""
        return sum(g.pool_bytes for g in self.graphs)

    @property
    def phases(self) -> CapturePhases:
        """``seconds`` split: the graphs' warm-ups, recordings and instantiations, and the rest."""
        warmup = sum(g.warmup_seconds for g in self.graphs)
        recording = sum(g.recording_seconds for g in self.graphs)
        instantiation = sum(g.instantiation_seconds for g in self.graphs)
        rest = self.seconds - warmup - recording - instantiation
        return CapturePhases(warmup=warmup, recording=recording, instantiation=instantiation, rest=rest)

    def __str__(self) -> str:
        if self.no_graphs is not None:
            return f"Captured no CUDA graphs: {self.no_graphs}"
        header = (
            f"Captured {self.num_graphs} CUDA graph(s) in {self.seconds:.3f} s; "
            f"pool {format_bytes(self.pool_bytes)}, reserved {format_bytes(self.reserved_bytes)}, "
            f"device {format_bytes(self.device_bytes)} "
            f"(outside the allocator {format_bytes(self.outside_allocator_bytes)})"
        )
        phases = self.phases
        header += f"\n{phases}"
        if self.compiles:
            header += f"; {self.compiles} torch.compile graph(s) compiled"
        if self.resolution is not None and self.resolution.downgraded:
            header += f"\nmode {self.resolution}"
        if self.kv_cache is not None:
            header += f"\n{self.kv_cache}"
        if self.shrink_fallback is not None:
            header += f"\ndecode loops do not shrink: {self.shrink_fallback}"
        rows = [_graph_row(g) for g in self.graphs]
        total = (
            "total",
            *("",) * 4,
            f"{sum(g.seconds for g in self.graphs):.4f}",
            f"{phases.warmup:.4f}",
            f"{phases.recording:.4f}",
            f"{phases.instantiation:.4f}",
            format_bytes(self.pool_bytes),
            format_bytes(sum(g.driver_bytes for g in self.graphs)),
        )
        right = frozenset({1, 2, *range(4, 11)})
        return "\n".join([header, *format_table(_GRAPH_COLUMNS, [*rows, total], right=right)])


#: The columns of a capture report's table of graphs.
_GRAPH_COLUMNS: Final = (
    "mode",
    "tokens",
    "reqs",
    "uniform",
    "loras",
    "seconds",
    "warm-up",
    "record",
    "instantiate",
    "pool",
    "driver",
)


def _graph_row(g: CapturedGraph) -> tuple[str, ...]:
    """One graph's row of the report's table (``_GRAPH_COLUMNS``)."""
    key = g.descriptor
    return (
        g.mode.name + (" loop" if g.loop else ""),
        str(key.num_tokens),
        "-" if key.num_reqs is None else str(key.num_reqs),
        "yes" if key.uniform else "no",
        str(key.num_active_loras),
        f"{g.seconds:.4f}",
        f"{g.warmup_seconds:.4f}",
        f"{g.recording_seconds:.4f}",
        f"{g.instantiation_seconds:.4f}",
        format_bytes(g.pool_bytes),
        format_bytes(g.driver_bytes),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """What ``capture()`` of the pending keys will cost the device, predicted by ``estimate_memory()``.

    ``total_bytes`` is the predicted drop of the device's free memory over the
    capture, the figure a ``CaptureReport`` measures as ``device_bytes``:
    ``warmup_bytes`` (the blocks the warm-ups' eager runs leave in torch's
    cache) plus ``pool_bytes`` (the graph pool's growth) plus
    ``driver_bytes`` (the graphs' executables, outside torch's allocator).
    ``num_graphs`` keys were estimated from ``probes``, the captures measured
    (and freed again); ``seconds`` is the estimate's wall time.
    ``no_graphs`` says why the estimate is 0 where nothing will be
    captured (no CUDA graphs on the device); ``None`` otherwise.
    """

    total_bytes: int
    warmup_bytes: int
    pool_bytes: int
    driver_bytes: int
    num_graphs: int
    probes: tuple[CapturedGraph, ...]
    seconds: float
    no_graphs: str | None = None

    def __str__(self) -> str:
        if self.no_graphs is not None:
            return f"No CUDA graphs to estimate: {self.no_graphs}"
        return (
            f"{self.num_graphs} CUDA graph(s) will cost the device about {format_bytes(self.total_bytes)}: "
            f"warm-ups {format_bytes(self.warmup_bytes)}, pool {format_bytes(self.pool_bytes)}, "
            f"driver {format_bytes(self.driver_bytes)} (from {len(self.probes)} probe captures "
            f"in {self.seconds:.3f} s)"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerStats:
    """What ``run`` did since the manager was built (or its stats were reset).

    ``replays`` counts replays per ``(runtime mode, padded num_tokens)``.
    ``eager_steps`` counts steps run without a graph, for any reason;
    ``eager_reasons`` splits them by ``EagerReason`` (its value as the key);
    ``uncaptured_steps`` is the part whose graph exists in the plan but was
    not captured yet. ``idle_steps`` counts steps of 0 tokens (no model
    call). ``dummy_steps`` counts steps of 0 tokens run because other ranks
    (``RankAgreement``) had tokens: a graph replayed on pad values (counted
    as a replay too), or the model run eagerly on one padding row.
    ``padded_tokens`` is the padding rows computed on top of the real tokens:
    by replays, and by the padded eager steps of a manager without CUDA
    graphs (which run what the graph would have). ``loop_steps`` counts the
    steps ``run_loop`` took, on the device or the host; ``host_loop_steps``
    the part looped on the host (no captured loop), each also counted as a
    replay of its one-step graph or as an eager step; ``device_loop_steps``
    the steps looped on the device by the ``num_tokens`` of the key that ran
    them (a shrinking loop's smaller keys too). ``resolution``: the mode
    the graphs follow, resolved against the attention's support, and why
    (not compared: two stats are equal when their counts are).
    """

    replays: Mapping[tuple[CUDAGraphMode, int], int]
    eager_steps: int
    uncaptured_steps: int
    padded_tokens: int
    eager_reasons: Mapping[str, int] = dataclasses.field(default_factory=dict)
    idle_steps: int = 0
    dummy_steps: int = 0
    loop_steps: int = 0
    host_loop_steps: int = 0
    resolution: ModeResolution | None = dataclasses.field(default=None, compare=False)
    kv_cache: KVCacheBacking | None = dataclasses.field(default=None, compare=False)
    device_loop_steps: Mapping[int, int] = dataclasses.field(default_factory=dict)

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def replays_of(self, mode: CUDAGraphMode) -> int:
        """Replays in runtime mode ``mode``, over all sizes."""
        return sum(n for (m, _), n in self.replays.items() if m is mode)

    def __str__(self) -> str:
        """One line: replays per (mode, size), eager steps per reason, then the other counts."""
        replays = ", ".join(
            f"{mode.name} {size}: {n}"
            for (mode, size), n in sorted(self.replays.items(), key=lambda kv: (kv[0][0].name, kv[0][1]))
        )
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.eager_reasons.items()))
        by_size = ", ".join(f"{size}: {n}" for size, n in sorted(self.device_loop_steps.items()))
        line = f"{self.num_replays} replays"
        if replays:
            line += f" ({replays})"
        line += f", {self.eager_steps} eager steps"
        if reasons:
            line += f" ({reasons})"
        line += f", {self.idle_steps} idle steps, {self.dummy_steps} dummy steps"
        line += f", {self.padded_tokens} padded tokens"
        if self.loop_steps:
            on_device = f"; on the device by key size: {by_size}" if by_size else ""
            line += f", {self.loop_steps} loop steps ({self.host_loop_steps} on the host{on_device})"
        if self.resolution is not None and self.resolution.downgraded:
            line += f"; mode {self.resolution}"
        if self.kv_cache is not None:
            line += f"; {self.kv_cache}"
        return line


class StepCounts:
    """The running counts behind ``ManagerStats`` that are not per key (the serving thread's alone)."""

    __slots__ = (
        "device_loop_steps",
        "dummy_steps",
        "eager",
        "host_loop_steps",
        "idle_steps",
        "loop_steps",
        "padded_tokens",
    )

    def __init__(self) -> None:
        self.eager: dict[EagerReason, int] = {}
        self.padded_tokens = 0
        self.idle_steps = 0
        self.dummy_steps = 0
        self.loop_steps = 0
        self.host_loop_steps = 0
        self.device_loop_steps: dict[int, int] = {}

    def snapshot(
        self,
        replays: Mapping[tuple[CUDAGraphMode, int], int],
        resolution: ModeResolution | None = None,
        kv_cache: KVCacheBacking | None = None,
    ) -> ManagerStats:
        eager = self.eager
        return ManagerStats(
            replays=MappingProxyType(dict(replays)),
            eager_steps=sum(eager.values()),
            uncaptured_steps=eager.get(EagerReason.NOT_CAPTURED, 0),
            padded_tokens=self.padded_tokens,
            eager_reasons=MappingProxyType({r.value: n for r, n in eager.items()}),
            idle_steps=self.idle_steps,
            dummy_steps=self.dummy_steps,
            loop_steps=self.loop_steps,
            host_loop_steps=self.host_loop_steps,
            resolution=resolution,
            kv_cache=kv_cache,
            device_loop_steps=MappingProxyType(dict(self.device_loop_steps)),
        )

    def replayed(self, padded_tokens: int, dummy: bool) -> None:
        """A step ran a key's graph (``dummy``: for an idle rank), ``padded_tokens`` rows of it padding."""
        self.padded_tokens += padded_tokens
        if dummy:
            self.dummy_steps += 1

    def padded(self, padded_tokens: int) -> None:
        """A step ran a key's rows eagerly (no CUDA graphs here), ``padded_tokens`` of them padding."""
        self.padded_tokens += padded_tokens

    def dummy(self) -> None:
        """An idle rank's dummy step ran eagerly along the others' eager step."""
        self.dummy_steps += 1

    def idle(self) -> None:
        """A step of 0 tokens: no model call."""
        self.idle_steps += 1

    def eager_step(self, reason: EagerReason) -> None:
        self.eager[reason] = self.eager.get(reason, 0) + 1

    def looped(
        self,
        steps: int,
        padded_tokens: int,
        *,
        host: bool,
        eager: EagerReason | None,
        by_size: Mapping[int, int],
    ) -> None:
        """``run_loop`` took ``steps`` steps (``host``: on the host; ``eager``: each eagerly, for it),
        ``by_size`` of them on the device by key size."""
        self.loop_steps += steps
        self.padded_tokens += padded_tokens
        if host:
            self.host_loop_steps += steps
        if eager is not None:
            self.eager[eager] = self.eager.get(eager, 0) + steps
        for size, n in by_size.items():
            self.device_loop_steps[size] = self.device_loop_steps.get(size, 0) + n

    def reset(self) -> None:
        self.eager.clear()
        self.device_loop_steps.clear()
        self.padded_tokens = self.idle_steps = self.dummy_steps = self.loop_steps = self.host_loop_steps = 0


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``"0 B"``, ``"1.5 KiB"``, ``"-12.0 MiB"``."""
    size = float(abs(n))
    unit = 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size /= 1024
        unit += 1
    sign = "-" if n < 0 else ""
    return f"{sign}{abs(n)} B" if unit == 0 else f"{sign}{size:.1f} {_UNITS[unit]}"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: frozenset[int] = frozenset()
) -> list[str]:
    """Lines of an aligned text table; columns in ``right`` are right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]
