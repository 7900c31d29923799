"""Options shared by both engines."""

from __future__ import annotations

import dataclasses
from typing import Final

import torch

from cudagraph_dispatch.lowlevel import check_bool, check_int

from ._pool import GraphPool, check_pool, check_stream

#: The most eager runs ``CaptureOptions.warmup_runs`` asks for before each capture.
MAX_WARMUP_RUNS: Final = 100


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CaptureOptions:
    """How an engine captures.

    Args:
        weak_ref_output: keep captured outputs as non-owning aliases, so the
            shared pool can hand their memory to the next (smaller) capture.
            The outputs then stay valid until the next replay of any graph in
            the pool.
        gc_disable: the garbage-collection policy of captures: no
            ``gc.collect()``/``empty_cache()`` per capture, and the collector
            paused over a loop of captures.
        check_input_addresses: debug check that every replay through a call
            (the forward-context path) gets its tensor arguments at the
            addresses seen at capture (a graph reads fixed addresses).
        pool: the graph memory pool, a handle torch made in this process
            (``torch.cuda.graph_pool_handle()``); ``None`` is the device's
            shared pool, which stays usable for the life of the process. A
            pool of your own is usable only while some graph captured into
            it is alive (torch frees an empty pool, and the next capture into
            its handle fails), and not at all after a capture into it was
            invalidated: keep one graph in it (an anchor, as the shared pool
            has) if a failed first capture must be retried.
        stream: the capture stream; ``None`` is one side stream per device.
        warmup_runs: eager runs on the capture stream before each capture,
            under a NONE forward context, so that lazy initialization (cuBLAS
            handles and workspaces, compiled kernels) happens outside the
            capture. Set 0 when the caller has already warmed up this shape;
            at most 100 (a larger count is a typo, not a warm-up).

    Raises:
        ValueError: a bad field, naming it (a made-up pool handle too).
    """

    weak_ref_output: bool = True
    gc_disable: bool = True
    check_input_addresses: bool = False
    pool: GraphPool | None = None
    stream: torch.cuda.Stream | None = None
    warmup_runs: int = 1

    def __post_init__(self) -> None:
        check_bool("weak_ref_output", self.weak_ref_output)
        check_bool("gc_disable", self.gc_disable)
        check_bool("check_input_addresses", self.check_input_addresses)
        check_int("warmup_runs", self.warmup_runs, minimum=0, maximum=MAX_WARMUP_RUNS)
        check_pool("pool", self.pool)
        check_stream("stream", self.stream)

    @staticmethod
    def given(options: object) -> CaptureOptions:
        """``options`` as an engine or a manager takes it.

        Args:
            options: a caller's ``options`` argument.

        Returns:
            ``options``, or the defaults for ``None``.

        Raises:
            ValueError: anything else than ``CaptureOptions`` or ``None``,
                naming ``options``.
        """
        if options is None:
            return _DEFAULTS
        if not isinstance(options, CaptureOptions):
            raise ValueError(f"options: expected CaptureOptions or None, got {options!r}")
        return options


_DEFAULTS: Final = CaptureOptions()
