"""The expert-parallel decoder's oracle: one process, every expert, no exchange, token by token.

``oracle_step`` computes what ``ExpertParallelDecoder`` returns on one rank
for that rank's rows, from the full weights alone: the same attention (the
shared ``ReferenceDecoder``), and each MoE layer as the per-token sum of its
chosen experts. Capacity is applied as its definition reads, pair by pair in
order: a pair whose destination rank already holds ``C`` of this rank's
pairs is dropped. ``C`` depends on the step's padded size (``step_tokens``):
the key a graph replayed, or the largest count over the ranks in an eager step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import Tensor

from ..body import rms_norm
from ..reference import ReferenceDecoder
from .moe import MoeConfig, MoeWeights, expert_mlp, route


def oracle_moe(
    h: Tensor,
    token_ids: Tensor,
    weights: MoeWeights,
    layer: int,
    config: MoeConfig,
    capacity: int,
    world_size: int,
) -> tuple[Tensor, int]:
    """One MoE layer on ``h [T, d]`` with every expert here: ``[T, d]``, and the pairs dropped."""
    experts, gates = route(h, weights.router[layer], weights.route_bias[layer][token_ids], config.top_k)
    per_rank = config.num_experts // world_size
    kept = torch.ones_like(experts, dtype=torch.bool)
    used = [0] * world_size
    for t, row in enumerate(experts.tolist()):
        for j, expert in enumerate(row):
            peer = expert // per_rank
            if used[peer] < capacity:
                used[peer] += 1
            else:
                kept[t, j] = False
    out = torch.zeros_like(h)
    for expert in range(config.num_experts):
        rows, cols = torch.nonzero((experts == expert) & kept, as_tuple=True)
        if rows.numel():
            y = expert_mlp(h[rows], weights.gate_up[layer, expert], weights.down[layer, expert])
            out.index_add_(0, rows, gates[rows, cols, None] * y)
    return out, int((~kept).sum())


@torch.no_grad()
def oracle_step(
    full: ReferenceDecoder,
    weights: MoeWeights,
    config: MoeConfig,
    inputs: dict[str, Tensor],
    *,
    step_tokens: int,
    world_size: int,
) -> tuple[Tensor, int]:
    """The decoder's output ``[T, hidden]`` for this rank's ``inputs``, and the pairs it drops."""
    input_ids = inputs["input_ids"]
    meta = full.metadata(inputs["positions"], inputs["cache_rows"])
    capacity = config.capacity(step_tokens, world_size)
    body, dropped = full.body, 0
    x = F.embedding(input_ids, body.embed)
    for index, layer in enumerate(body.layers):
        q, k, v = layer.project(x, meta.cos, meta.sin)
        attn = torch.empty_like(q)
        cache = full.caches[index]
        full.attention(q, k, v, cache, meta.cache_rows, meta.key_index, meta.value_index, meta.mask, attn)
        x = x + torch.mm(attn.view(x.shape), layer.o_weight)
        y, lost = oracle_moe(
            rms_norm(x, layer.post_norm), input_ids, weights, index, config, capacity, world_size
        )
        x, dropped = x + y, dropped + lost
    return body.final(x), dropped
