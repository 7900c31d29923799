"""The capture of one planned key, shared by ``capture()`` and the background capture.

A key's capture is two acts. The warm-up runs the model eagerly on the key's
static views, filled with pad values first (never the last real batch: a
warm-up really runs, KV-cache writes included). The recording captures the
graph without running anything on the device (``GraphEngine.record``), so it
writes no memory a serving step may use: not the pool, whose free blocks may
hold the outputs of the last ``run()`` that a caller still reads, not the
static buffers, not the model's own buffers. The entry is checked (its
outputs must be cuttable), then stored on the key: the key is captured.
"""

from __future__ import annotations

import time

import torch

from cudagraph_capture import CaptureDisabledError, GraphEngine, capture_enabled

from ._buffers import StaticBuffers
from ._outputs import LayoutCell
from ._planned import PlannedKey
from ._protocols import OutputT
from ._report import CapturedGraph


def warm_up(key: PlannedKey[OutputT], engine: GraphEngine[OutputT], buffers: StaticBuffers) -> None:
    """Fill the key's views with pad values and run the model eagerly on them (on the current stream)."""
    buffers.fill_padding(key.num_tokens, key.num_reqs)
    engine.warm_up(key.descriptor, key.inputs)


def capture_key(
    key: PlannedKey[OutputT],
    engine: GraphEngine[OutputT],
    buffers: StaticBuffers,
    layout: LayoutCell,
    device: torch.device,
    *,
    warm: bool,
) -> CapturedGraph:
    """Warm the key up (``warm``), record its graph, check its outputs, store the entry on the key.

    ``CaptureError`` from the engine, or ``ValueError`` naming an output that
    cannot be cut, leaves the key uncaptured. ``pool_bytes`` is the growth of
    reserved memory over the recording alone (a warm-up's eager blocks are not
    the pool's).
    """
    start = time.perf_counter()
    if not capture_enabled():  # before the warm-up: a disabled capture runs nothing
        raise CaptureDisabledError("capture is disabled (set_capture_enabled(False))", key.descriptor)
    if warm:
        warm_up(key, engine, buffers)
    before = reserved_bytes(device)
    entry = engine.record(key.descriptor, key.inputs)
    pool_bytes = reserved_bytes(device) - before
    layout.of(entry.output).check(entry.output, key.num_tokens, key.num_reqs)
    key.last_cut = None
    key.entry = entry  # last: the serving thread replays the key from its next step
    return CapturedGraph(key.mode, key.descriptor, time.perf_counter() - start, pool_bytes)


def reserved_bytes(device: torch.device) -> int:
    """The device's reserved memory (0 off CUDA): its growth is what a capture cost."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
