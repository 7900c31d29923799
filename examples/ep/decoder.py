"""The DP-attention + EP-MoE decoder: each rank attends over its own requests, the experts are shared out.

``ExpertParallelDecoder`` takes the attention of a full ``ReferenceDecoder``
(its weights, rotary table and KV caches: data-parallel attention, every rank
holds all the attention weights and only its own requests' cache rows) and
replaces each layer's dense MLP with an ``ExpertParallelMoE`` over the ranks
of ``group``. A layer is: RMSNorm, QKV, RoPE, attention (the reference's
eager break: ``breakable_cached_attention``), the output projection; then
RMSNorm and the MoE, whose two all-to-alls every rank joins.

**Step size.** The all-to-alls need the same ``T`` on every rank. Inside a
graph it is the key the ranks agreed on (``ManagerOptions(ranks=...)``: the
manager pads every rank to the same key, and an idle rank replays it on pad
values). An eager step runs each rank on its own rows (and an idle rank on
one padding row), so ``forward`` first takes the largest count over the
group (``NUM_TOKENS_ACROSS_DP``, which the manager's eager steps carry in
the forward context: no collective; one small all-reduce and a host read
where there is none, in a warm-up) and pads its inputs to it with the static inputs'
pad values. Padding rows attend in the scratch cache row and are never
counted as dropped.

**Where the all-to-all sits.** FULL: in the one graph. PIECEWISE (mixed
batches under FULL_AND_PIECEWISE): in the captured segments, between the
attention breaks. The attention is the only eager break, since it reads the
step's metadata and is local to the rank (no collective); the MoE's sizes are
all fixed by the key, so its all-to-alls are captured like any kernel, and
the ranks' agreement on the key makes every rank's segment meet its peers'.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import Tensor, nn

from cudagraph_dispatch import CUDAGraphMode, get_forward_context
from cudagraph_manager.ranks import NUM_TOKENS_ACROSS_DP

from ..body import rms_norm
from ..reference import ReferenceDecoder
from .moe import ExpertParallelMoE, MoeConfig, MoeWeights


def step_tokens(num_tokens: int, device: torch.device, group: dist.ProcessGroup | None) -> int:
    """The step's ``T`` on every rank: ``num_tokens`` inside a graph (the agreed key), else the group's max.

    Eager: the largest of the counts the manager's agreement exchanged this
    step (``extra[NUM_TOKENS_ACROSS_DP]`` of an eager step's context); else
    (a warm-up, no manager) one all-reduce of the count on ``device`` and a
    host read. Every rank of ``group`` runs an eager step together (the
    agreement sends all ranks to eager at once).
    """
    context = get_forward_context()
    graph = context is not None and context.runtime_mode is not CUDAGraphMode.NONE
    if graph or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return num_tokens
    counts = None if context is None else context.extra.get(NUM_TOKENS_ACROSS_DP)
    if isinstance(counts, tuple) and counts:  # the manager's eager step: the agreed counts, no exchange
        return max(num_tokens, *(int(n) for n in counts))
    count = torch.tensor([num_tokens], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


class ExpertParallelDecoder(nn.Module):
    """``full``'s attention on this rank's requests, and an expert-parallel MoE in every layer.

    ``forward(input_ids, positions, cache_rows) -> [T, hidden]`` as
    ``ReferenceDecoder``'s (the same static inputs, ``static_inputs(config)``),
    a collective of ``group`` (default: the world). ``full`` and ``weights``
    are built alike on every rank (the same seed); ``full``'s modules are
    shared, not copied (its dense MLP weights go unused), and the experts are
    this rank's copies. ``dropped()`` reads the pairs dropped for capacity.
    """

    def __init__(
        self,
        full: ReferenceDecoder,
        weights: MoeWeights,
        config: MoeConfig,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_parts(full, weights)
        super().__init__()
        self.full: Final = full
        self.group: Final = group
        self.scratch_row: Final = full.config.scratch_row
        moes = [ExpertParallelMoE(weights, index, config, group) for index in range(full.config.num_layers)]
        self.moes = nn.ModuleList(moes)
        self.moe_layers: Final = tuple(moes)
        #: The ``T`` of the last forward Python ran (an eager step, a capture; a graph replay runs no Python).
        self.last_step_tokens = 0
        self.requires_grad_(False)

    def forward(self, input_ids: Tensor, positions: Tensor, cache_rows: Tensor) -> Tensor:
        num_tokens = input_ids.shape[0]
        padded = self.last_step_tokens = step_tokens(num_tokens, input_ids.device, self.group)
        body = self.full.body
        if padded == 0:  # every rank at 0 rows (a manager learning its outputs' structure): no exchange
            return input_ids.new_zeros((0, body.config.hidden_size), dtype=body.config.dtype)
        if padded > num_tokens:  # eager: this rank's rows, then pad rows (as the static inputs pad)
            extra = padded - num_tokens
            input_ids = F.pad(input_ids, (0, extra), value=0)
            positions = F.pad(positions, (0, extra), value=0)
            cache_rows = F.pad(cache_rows, (0, extra), value=self.scratch_row)
        meta = self.full.metadata(positions, cache_rows)
        valid = cache_rows != self.scratch_row  # [T]: the real rows
        attention, caches = self.full.attention, self.full.caches
        x = F.embedding(input_ids, body.embed)  # [T, hidden]
        for index, (layer, moe) in enumerate(zip(body.layers, self.moe_layers, strict=True)):
            q, k, v = layer.project(x, meta.cos, meta.sin)
            attn = torch.empty_like(q)
            attention(
                q, k, v, caches[index], meta.cache_rows, meta.key_index, meta.value_index, meta.mask, attn
            )
            x = x + torch.mm(attn.view(x.shape), layer.o_weight)
            x = x + moe(rms_norm(x, layer.post_norm), input_ids, valid)
        return body.final(x)[:num_tokens]

    def dropped(self) -> int:
        """The real (token, expert) pairs dropped for capacity, over every layer, since this was built.

        A host read: call it off the step path (a report, a log line).
        """
        return int(sum(moe.dropped for moe in self.moe_layers).item())  # type: ignore[union-attr]


def _check_parts(full: object, weights: object) -> None:
    """``ValueError`` naming ``full`` or ``weights`` unless the experts' weights fit the decoder's layers."""
    if not isinstance(full, ReferenceDecoder):
        raise ValueError(f"full: expected a ReferenceDecoder, got {full!r:.80}")
    if not isinstance(weights, MoeWeights):
        raise ValueError(f"weights: expected MoeWeights, got {weights!r:.80}")
    config = full.config
    layers, hidden = weights.gate_up.shape[0], weights.gate_up.shape[2]
    if (layers, hidden) != (config.num_layers, config.hidden_size):
        raise ValueError(
            f"weights: {layers} layers of hidden size {hidden}, but the decoder has {config.num_layers} "
            f"of {config.hidden_size}"
        )
