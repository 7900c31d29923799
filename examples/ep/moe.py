"""The MoE layer of the expert-parallel decoder: router, capacity, dispatch and combine over all-to-all.

Shapes: ``T`` tokens of the step on this rank (the padded key inside a
graph), ``k`` experts per token (``top_k``), ``W`` ranks, ``E`` experts
(``E / W`` on each rank), ``C`` the capacity per peer, ``d`` hidden.

One layer's step, in order (``ExpertParallelMoE.forward``):

1. **route**: logits ``[T, E]``, the top ``k`` per token and their softmax
   weights (``route``);
2. **pack**: the ``T * k`` (token, expert) pairs go to their expert's rank,
   each into the next free slot of that rank's block of a static send buffer
   ``[W, C, d]`` (with the expert's id beside it, ``[W, C]``). A pair past
   ``C`` is dropped: counted in ``dropped`` on the device, never silent;
3. **dispatch**: ``all_to_all_single``: block ``r`` goes to rank ``r``;
4. **experts**: every local expert on the rows it was sent (``[W, C, d]``);
5. **combine**: a second ``all_to_all_single`` sends each row back to the
   slot it came from; each token sums its ``k`` rows times their weights.

Every size is fixed by ``T``: the buffers, the split of the all-to-alls
(``C`` rows per peer) and the kernels, so a graph captured at a key replays
on any step padded to it, provided every rank replays the same key (each
rank's ``C`` must be the one its peers expect: the manager's rank agreement).

**Capacity.** Exact by default: ``C = T * k`` (a rank may send all its pairs
to one peer), so no pair is ever dropped. Its memory: four ``[W, T * k, d]``
buffers (send, receive, expert output, returned) and two ``[W, T * k]``
int64 id tables per layer, and every local expert runs on all ``W * T * k``
received rows. ``capacity_factor=f`` gives ``C = ceil(f * T * k / W)``
(``f = 1``: an even share), at most ``T * k``: ``W / f`` times less, and
pairs past ``C`` dropped (the token keeps its residual for that expert).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import Tensor, nn

from cudagraph_dispatch.lowlevel import check_int

from ..body import model_device
from ..config import MAX_FIELD

#: The bound on a router logit's learned part (see ``MoeWeights``): below half the bias's gap of 1.
ROUTER_BOUND: Final = 0.25


@dataclasses.dataclass(frozen=True, slots=True)
class MoeConfig:
    """The MoE layers' shape: ``num_experts`` SiLU-gated experts of width ``expert_size``, top ``top_k``.

    ``capacity_factor``: ``None`` (exact capacity, nothing dropped) or a
    finite number > 0 (see the module's "Capacity"). Checked when built
    (``ValueError`` naming the field): sizes from 1 to ``MAX_FIELD``.
    """

    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 256
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        check_int("num_experts", self.num_experts, minimum=1, maximum=MAX_FIELD)
        check_int("top_k", self.top_k, minimum=1)
        check_int("expert_size", self.expert_size, minimum=1, maximum=MAX_FIELD)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: at most num_experts={self.num_experts}, got {self.top_k}")
        factor: object = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf
        ):
            raise ValueError(f"capacity_factor: expected None or a finite number > 0, got {factor!r}")

    def capacity(self, num_tokens: int, world_size: int) -> int:
        """Slots per peer ``C`` for a step of ``num_tokens`` (the padded key): exact, or the factor's.

        ``num_tokens >= 0``; ``world_size``, the ranks the experts are shared
        over, divides ``num_experts`` (``ValueError`` naming either).
        """
        self.check_step(num_tokens, world_size)
        exact = num_tokens * self.top_k
        if self.capacity_factor is None:
            return exact
        return max(1, min(exact, math.ceil(self.capacity_factor * exact / world_size)))

    def check_step(self, num_tokens: object, world_size: object) -> None:
        """``ValueError`` naming ``num_tokens`` (< 0) or ``world_size`` (< 1, or not dividing the experts)."""
        check_int("num_tokens", num_tokens, minimum=0)
        world = check_int("world_size", world_size, minimum=1)
        if self.num_experts % world:
            raise ValueError(
                f"world_size: {world} ranks cannot share num_experts={self.num_experts} experts evenly"
            )

    def buffer_bytes(self, num_tokens: int, world_size: int, hidden_size: int, itemsize: int) -> int:
        """The bytes of one layer's exchange buffers at ``num_tokens``: four ``[W, C, d]``, two ``[W, C]``."""
        check_int("hidden_size", hidden_size, minimum=1)
        check_int("itemsize", itemsize, minimum=1)
        slots = world_size * self.capacity(num_tokens, world_size)
        return slots * (4 * hidden_size * itemsize + 2 * 8)


class MoeWeights(nn.Module):
    """Every expert of every MoE layer: the full model, built alike on every rank (the same seed).

    ``router [L, d, E]``; ``route_bias [L, vocab, E]``; ``gate_up [L, E, d,
    2f]``; ``down [L, E, f, d]``. The router's logits are ``h @ router +
    route_bias[token id]``: each bias row is a permutation of ``0 .. E-1``
    (gaps of 1) and each router column has norm ``ROUTER_BOUND / sqrt(d)``,
    so for an RMS-normed ``h`` (norm ``sqrt(d)``) the learned part moves a
    logit by at most ``ROUTER_BOUND``: the top-k set never flips on a
    rounding difference, and a test can compare two implementations token by
    token. The weights of the chosen experts still follow ``h``. An engine's
    router is the same code without the bias. A bad argument raises
    ``ValueError`` naming it, before anything is allocated.
    """

    def __init__(
        self,
        config: MoeConfig,
        *,
        num_layers: int,
        hidden_size: int,
        vocab_size: int,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        given: object = config
        if not isinstance(given, MoeConfig):
            raise ValueError(f"config: expected a MoeConfig, got {config!r:.80}")
        for name, value in (
            ("num_layers", num_layers),
            ("hidden_size", hidden_size),
            ("vocab_size", vocab_size),
        ):
            check_int(name, value, minimum=1, maximum=MAX_FIELD)
        given_dtype: object = dtype
        if not isinstance(given_dtype, torch.dtype) or not given_dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch.dtype, got {dtype!r:.80}")
        device = model_device(device)
        super().__init__()
        layers, e, d, f = num_layers, config.num_experts, hidden_size, config.expert_size
        router = torch.randn(layers, d, e, device=device, dtype=torch.float64)
        router *= ROUTER_BOUND / math.sqrt(d) / router.norm(dim=1, keepdim=True)
        self.router = nn.Parameter(router.to(dtype))
        bias = torch.rand(layers, vocab_size, e, device=device).argsort(dim=-1)  # a permutation per row
        self.route_bias = nn.Parameter(bias.to(dtype))
        self.gate_up = nn.Parameter(
            torch.randn(layers, e, d, 2 * f, device=device, dtype=dtype) / math.sqrt(d)
        )
        self.down = nn.Parameter(torch.randn(layers, e, f, d, device=device, dtype=dtype) / math.sqrt(f))
        self.requires_grad_(False)


def route(h: Tensor, router: Tensor, bias_rows: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` experts ``[T, k]`` (int64, best first) of each row of ``h [T, d]``, and their weights.

    The weights ``[T, k]`` are the softmax of the chosen logits (Mixtral's).
    """
    logits = torch.addmm(bias_rows, h, router)  # [T, E]
    top, experts = logits.topk(top_k, dim=-1)
    return experts, top.softmax(dim=-1)


def expert_mlp(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """One SiLU-gated expert on rows ``x [R, d]``: ``[R, d]``."""
    gate, up = torch.mm(x, gate_up).chunk(2, dim=-1)
    return torch.mm(F.silu(gate) * up, down)


class ExpertParallelMoE(nn.Module):
    """One MoE layer, its experts split over the ranks of ``group``: this rank's ``E / W`` experts.

    ``forward(h [T, d], token_ids [T], valid [T] bool) -> [T, d]``, the
    weighted sum of each token's experts; every rank of the group calls it
    with the same ``T`` (two all-to-alls inside). ``valid`` marks the real
    rows: padding rows are exchanged too (the sizes are static) but never
    counted as dropped. ``dropped`` (int64 ``[1]``, on the device) counts the
    real pairs dropped for capacity since it was built: graph replays add to
    it as eager steps do; read it off the step path.
    """

    dropped: Tensor

    def __init__(
        self, weights: MoeWeights, layer: int, config: MoeConfig, group: dist.ProcessGroup | None
    ) -> None:
        _check_layer(weights, layer, config)
        super().__init__()
        self.group: Final = group
        self.world_size: Final = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if config.num_experts % self.world_size:
            raise ValueError(
                f"config.num_experts={config.num_experts} does not divide over {self.world_size} ranks"
            )
        self.config: Final = config
        self.per_rank: Final = config.num_experts // self.world_size
        self.first: Final = rank * self.per_rank  # this rank's experts: first .. first + per_rank - 1
        self.router = nn.Parameter(weights.router[layer].detach().clone())  # replicated
        self.route_bias = nn.Parameter(weights.route_bias[layer].detach().clone())
        local = slice(self.first, self.first + self.per_rank)  # an engine loads only these
        self.gate_up = nn.Parameter(weights.gate_up[layer, local].detach().clone())
        self.down = nn.Parameter(weights.down[layer, local].detach().clone())
        self.register_buffer("dropped", torch.zeros(1, dtype=torch.int64, device=weights.down.device))
        self.requires_grad_(False)

    def forward(self, h: Tensor, token_ids: Tensor, valid: Tensor) -> Tensor:
        num_tokens, d = h.shape
        k, world = self.config.top_k, self.world_size
        capacity = self.config.capacity(num_tokens, world)
        experts, weights = route(h, self.router, self.route_bias[token_ids], k)  # [T, k] each
        # 2. pack: pair p = (token p // k, its (p % k)-th expert); its slot in its destination's block.
        dest = (experts // self.per_rank).view(-1)  # [T * k]
        slot = (F.one_hot(dest, world).cumsum(0) - 1).gather(1, dest[:, None]).view(-1)  # [T * k]
        kept = slot < capacity
        self.dropped.add_((valid[:, None].expand(num_tokens, k).reshape(-1) & ~kept).sum())
        trash = world * capacity  # one extra row where dropped pairs go, and come back as zeros
        index = torch.where(kept, dest * capacity + slot, trash)  # [T * k]
        send = h.new_zeros(trash + 1, d)
        send[index] = h[:, None].expand(num_tokens, k, d).reshape(-1, d)  # each token once per expert
        send_ids = torch.full((trash + 1,), -1, dtype=torch.int64, device=h.device)
        send_ids[index] = experts.view(-1)
        # 3. dispatch: C rows (and their expert ids) to each peer.
        recv, recv_ids = torch.empty_like(send[:trash]), torch.empty_like(send_ids[:trash])
        dist.all_to_all_single(recv, send[:trash], group=self.group)
        dist.all_to_all_single(recv_ids, send_ids[:trash], group=self.group)
        # 4. experts: each local expert on the rows sent to it (the others, and empty slots, masked out).
        out = torch.zeros_like(recv)
        for j in range(self.per_rank):
            mine = (recv_ids == self.first + j).unsqueeze(-1)  # [W * C, 1]
            out.addcmul_(mine.to(h.dtype), expert_mlp(recv, self.gate_up[j], self.down[j]))
        # 5. combine: every row back to its slot; each token's k rows times their weights.
        back = h.new_zeros(trash + 1, d)
        dist.all_to_all_single(back[:trash], out, group=self.group)
        rows = back[index].view(num_tokens, k, d)  # a dropped pair reads the zero row
        return torch.bmm(weights.unsqueeze(1), rows).squeeze(1)  # [T, d]


def _check_layer(weights: object, layer: object, config: object) -> None:
    """``ExpertParallelMoE``'s arguments: ``ValueError`` naming the first bad one (before any collective)."""
    if not isinstance(weights, MoeWeights):
        raise ValueError(f"weights: expected MoeWeights, got {weights!r:.80}")
    if not isinstance(config, MoeConfig):
        raise ValueError(f"config: expected a MoeConfig, got {config!r:.80}")
    layers, experts = weights.gate_up.shape[0], weights.gate_up.shape[1]
    if experts != config.num_experts:
        raise ValueError(f"config: num_experts={config.num_experts}, but the weights hold {experts} experts")
    check_int("layer", layer, minimum=0, maximum=layers - 1)
