"""A replay chosen on the device (``SwitchReplay``): of the graphs of one class, the smallest holding a count.

The host picks a graph by its batch's size; where the size is on the device
(a loop's live requests, a count a kernel wrote), reading it back is the
synchronization a decode loop exists to avoid. ``SwitchReplay`` clones a
runner's captured FULL graphs (``graph_engine(FULL)``'s entries, which keep
their CUDA graph) into one graph: a one-thread kernel reads the count and a
SWITCH node replays the smallest graph that holds it (an IF node per graph
where the driver or the bindings have no SWITCH), built by ``_conditional``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import torch

from cudagraph_dispatch import BatchDescriptor

from ._conditional import (
    Choice,
    ConditionalLoops,
    LoopUnavailableError,
    RecordedGraph,
    ReplayPlan,
    WhileGraph,
    load_conditional,
)
from ._errors import CaptureError
from ._recorder import Entry

_COUNT_DTYPES: Final = (torch.int32, torch.int64)


class SwitchReplay:
    """One launch that replays, of the captured graphs of one class, the smallest whose size holds ``live``.

    Built by ``SwitchReplay.of(entries, live)``. ``sizes``: the graphs'
    ``num_tokens``, ascending. ``launch()`` queues one graph on the current
    stream, no host synchronization: it replays the graph of the smallest
    size ``>= live`` (none where ``live`` is above the largest), whose
    outputs (its entry's) it rewrites. ``chosen``: ``[]`` int64 on the
    device, the index into ``sizes`` the last launch replayed (-1: none).
    ``choice``: ``"switch"``, or ``"if_chain"`` where the driver has no SWITCH
    node. The graphs must outlive it (it replays their nodes, on their memory).
    """

    __slots__ = ("_graph", "_keep", "chosen", "sizes")

    def __init__(
        self, graph: WhileGraph, sizes: tuple[int, ...], chosen: torch.Tensor, keep: tuple[object, ...]
    ) -> None:
        self._graph: Final = graph
        self._keep: Final = keep  # the entries and the count: their addresses are baked in
        self.sizes: Final = sizes
        self.chosen: Final = chosen

    @classmethod
    def of(cls, entries: Mapping[BatchDescriptor, object], live: torch.Tensor) -> SwitchReplay:
        """The replay of ``entries`` chosen by ``live``; ``entries`` stay the caller's.

        Args:
            entries: one class's captured FULL graphs by key (keys that
                differ in ``num_tokens`` and ``num_reqs`` only): the entries
                of ``graph_engine(FULL)`` (a manager's FULL graphs).
            live: a one-element int32 or int64 CUDA tensor, the count a
                graph must hold (compared with the keys' ``num_tokens``),
                written before each launch, by the host or a kernel.

        Returns:
            The replay; ``launch()`` queues it.

        Raises:
            ValueError: a bad argument, naming it.
            CaptureError: neither a SWITCH node nor IF nodes can be built (no
                cuda-bindings, an old driver, a refusal), saying why: replay
                the host-chosen entry instead.
        """
        count = _checked_count(live)
        graphs = _graphs_of(entries)
        if not count.is_cuda:
            raise ValueError(f"live: expected a CUDA tensor, got one on {count.device}")
        return build_switch_replay(graphs, count, load_conditional)

    @property
    def choice(self) -> Choice | None:
        return self._graph.choice

    def launch(self) -> None:
        """Queue the replay on the current stream; the device picks the graph."""
        self._graph.launch()


def build_switch_replay(
    graphs: Mapping[int, RecordedGraph], live: torch.Tensor, conditional: Callable[[int], ConditionalLoops]
) -> SwitchReplay:
    """The replay of ``graphs`` (by size) chosen by ``live``, built by ``conditional(device)`` ."""
    device = live.device
    sizes = tuple(sorted(graphs))
    chosen = torch.full((), -1, dtype=torch.int64, device=device)
    table = torch.tensor(sizes, dtype=torch.int64, device=device)
    plan = ReplayPlan(tuple(graphs[size] for size in sizes), table, live.view(()), chosen)
    try:
        graph = conditional(device.index or 0).build_replay(plan)
    except LoopUnavailableError as error:
        raise CaptureError(
            f"SwitchReplay: neither a SWITCH node nor IF nodes can be built here ({error}); replay the "
            "graph the host chose (entry.replay())"
        ) from None
    return SwitchReplay(graph, sizes, chosen, (plan, dict(graphs)))


def _graphs_of(entries: object) -> dict[int, RecordedGraph]:
    """The CUDA graphs of ``entries`` by ``num_tokens``; ``ValueError`` naming a bad one (keys first)."""
    if not isinstance(entries, Mapping) or not entries:
        raise ValueError(f"entries: expected a mapping of keys to captured graphs, got {entries!r:.80}")
    keys = list(entries)
    for key in keys:
        if not isinstance(key, BatchDescriptor):
            raise ValueError(f"entries: expected BatchDescriptor keys, got {key!r:.80}")
    first: BatchDescriptor = keys[0]
    sizes: set[int] = set()
    for key in keys:
        if (key.uniform, key.has_lora, key.num_active_loras) != (
            first.uniform,
            first.has_lora,
            first.num_active_loras,
        ):
            raise ValueError(
                f"entries: {key} is not of the class of {first} "
                "(uniform, has_lora and num_active_loras alike)"
            )
        if key.num_tokens in sizes:
            raise ValueError(f"entries: two graphs of {key.num_tokens} tokens")
        sizes.add(key.num_tokens)
    return {key.num_tokens: _graph_of(key, entries[key]) for key in keys}


def _graph_of(key: BatchDescriptor, entry: object) -> RecordedGraph:
    """The CUDA graph ``entry`` replays; ``ValueError`` where it has none to clone."""
    owner = entry.owner if isinstance(entry, Entry) else None
    if not isinstance(owner, torch.cuda.CUDAGraph):
        raise ValueError(
            f"entries[{key}]: expected an entry of graph_engine(FULL) (one CUDA graph), got "
            f"{type(owner if owner is not None else entry).__name__}: a PIECEWISE capture's segments and "
            "eager breaks cannot be a branch"
        )
    return owner


def _checked_count(live: object) -> torch.Tensor:
    """``live`` if it is a one-element int32 or int64 tensor, else ``ValueError`` naming it."""
    if not isinstance(live, torch.Tensor) or live.numel() != 1 or live.dtype not in _COUNT_DTYPES:
        raise ValueError(f"live: expected a one-element int32 or int64 tensor, got {live!r:.80}")
    return live
