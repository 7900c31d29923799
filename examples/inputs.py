"""Random step inputs for the example models: imported on purpose, by the runnable examples and the tests.

Not imported by ``examples``: helpers load only where they are used. The
paged backends' float64 oracle is the tests' own (``tests.manager.oracles``).

- ``make_step_inputs``: a random step of ``ReferenceDecoder`` (``cache_rows``).
- ``make_paged_inputs``: a random step of ``PagedDecoder`` on a randomly
  paged cache (``PAGED_INPUT_NAMES``).
- ``request_lengths``: the tokens of each request of a random step.
"""

from __future__ import annotations

import torch

from cudagraph_dispatch.lowlevel import check_bool, check_int

from .body import model_device
from .config import DecoderConfig
from .paged import PagedLayout


def make_step_inputs(
    config: DecoderConfig,
    num_tokens: int,
    *,
    uniform_decode: bool,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random inputs of one step with ``num_tokens`` tokens (``[T]`` int64 each).

    ``uniform_decode``: one token per request, each in its own cache row, at a
    random position. Otherwise a mixed batch: the first request is a prefill
    chunk of at least 2 tokens (when ``num_tokens >= 2``), the others chunks
    or single decode tokens; each request has its own row and consecutive
    positions. Drawn on the CPU with ``generator``, then moved to ``device``.
    """
    device = _check_device_and_generator(device, generator)
    g = generator
    lengths = request_lengths(config, num_tokens, uniform_decode=uniform_decode, generator=g)

    def randint(low: int, high: int) -> int:  # uniform in [low, high]
        return int(torch.randint(low, high + 1, (), generator=g))

    request_rows = torch.randperm(config.max_num_seqs, generator=g)[: len(lengths)]
    positions: list[torch.Tensor] = []
    token_rows: list[torch.Tensor] = []
    for length, row in zip(lengths, request_rows.tolist(), strict=True):
        start = randint(0, config.max_seq_len - length)
        positions.append(torch.arange(start, start + length))
        token_rows.append(torch.full((length,), row, dtype=torch.int64))
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=g)
    return {
        "input_ids": input_ids.to(device),  # [T]
        "positions": torch.cat(positions).to(device),  # [T]
        "cache_rows": torch.cat(token_rows).to(device),  # [T]
    }


def request_lengths(
    config: DecoderConfig,
    num_tokens: int,
    *,
    uniform_decode: bool,
    query_len: int = 1,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens of each request of a random step (``make_step_inputs``): they add up to ``num_tokens``.

    ``uniform_decode``: ``query_len`` each. Otherwise the first request is a
    prefill chunk of at least 2 tokens (when ``num_tokens >= 2``), the others
    chunks or single decode tokens, at most ``max_seq_len`` each. A bad
    argument raises ``ValueError`` naming it.
    """
    given: object = config
    if not isinstance(given, DecoderConfig):
        raise ValueError(f"config: expected a DecoderConfig, got {config!r:.80}")
    check_int("num_tokens", num_tokens, minimum=1)
    check_bool("uniform_decode", uniform_decode)
    check_int("query_len", query_len, minimum=1, maximum=config.max_seq_len)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {generator!r:.80}")
    limit = config.max_num_seqs * (query_len if uniform_decode else config.max_seq_len)
    if num_tokens > limit:
        raise ValueError(f"num_tokens: at most {limit} fit the KV cache here, got {num_tokens!r}")
    if uniform_decode:
        if num_tokens % query_len:
            raise ValueError(
                f"num_tokens: a uniform batch has a multiple of {query_len} tokens, got {num_tokens}"
            )
        return [query_len] * (num_tokens // query_len)

    def randint(low: int, high: int) -> int:  # uniform in [low, high]
        return int(torch.randint(low, high + 1, (), generator=generator))

    lengths: list[int] = []
    remaining = num_tokens
    while remaining:
        # Every length lies in [shortest, longest]: the rest always fits the rows left.
        shortest = -(-remaining // (config.max_num_seqs - len(lengths)))
        longest = min(remaining, config.max_seq_len)
        if not lengths and num_tokens >= 2:  # the prefill chunk that makes the batch mixed
            low = min(max(shortest, 2), longest)
            length = randint(low, min(longest, max(low, num_tokens // 2)))
        elif randint(0, 1):  # a decode token, unless the rows run short
            length = shortest
        else:
            length = randint(shortest, min(longest, max(shortest, num_tokens // 4)))
        lengths.append(length)
        remaining -= length
    return lengths


def make_paged_inputs(
    config: DecoderConfig,
    layout: PagedLayout,
    num_tokens: int,
    *,
    uniform_decode: bool,
    query_len: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    num_pages: int | None = None,
) -> dict[str, torch.Tensor]:
    """Random inputs of one step on a randomly paged cache (``PAGED_INPUT_NAMES``).

    Requests as ``make_step_inputs`` draws them (``query_len`` tokens each
    when ``uniform_decode``), each at a random place in its sequence, its
    pages drawn without replacement from a shuffled pool of pages 1 to
    ``num_pages - 1`` (default: the layout's; a cache over reserved memory:
    its pages backed, ``KVCacheMemory.units``); the block-table entries past
    a request's length hold random pages of that pool, which the attention
    must ignore. Drawn on the CPU with ``generator``, then moved to ``device``.
    """
    given: object = layout
    if not isinstance(given, PagedLayout):
        raise ValueError(f"layout: expected a PagedLayout, got {layout!r:.80}")
    device = _check_device_and_generator(device, generator)
    g = generator
    lengths = request_lengths(
        config, num_tokens, uniform_decode=uniform_decode, query_len=query_len, generator=g
    )
    page_size, width = layout.page_size, layout.pages_per_seq
    limit = min(config.max_seq_len, layout.max_seq_len)
    ends = [int(torch.randint(length, limit + 1, (), generator=g)) for length in lengths]  # seq_lens
    usable = layout.num_pages if num_pages is None else num_pages
    needed = sum(-(-end // page_size) for end in ends)
    if needed > usable - 1:
        raise ValueError(f"num_tokens: this step needs {needed} pages, the cache has {usable - 1}")
    pool = (torch.randperm(usable - 1, generator=g) + 1).tolist()  # every page but scratch
    table = torch.randint(1, usable, (len(lengths), width), generator=g, dtype=torch.int32)
    positions: list[torch.Tensor] = []
    for r, (length, end) in enumerate(zip(lengths, ends, strict=True)):
        used = -(-end // page_size)
        table[r, :used] = torch.tensor(pool[:used], dtype=torch.int32)
        del pool[:used]
        positions.append(torch.arange(end - length, end))
    position = torch.cat(positions)  # [T]
    query_lens = torch.tensor(lengths, dtype=torch.int32)  # [R]
    req_ids = torch.repeat_interleave(torch.arange(len(lengths)), query_lens.long())  # [T]
    pages = table[req_ids, position // page_size].long()  # [T]
    return {
        "input_ids": torch.randint(0, config.vocab_size, (num_tokens,), generator=g).to(device),
        "positions": position.to(device),
        "slot_mapping": (pages * page_size + position % page_size).to(device),
        "query_lens": query_lens.to(device),
        "seq_lens": torch.tensor(ends, dtype=torch.int32).to(device),  # [R]
        "block_table": table.to(device),  # [R, pages_per_seq]
    }


def _check_device_and_generator(
    device: torch.device | str | None, generator: torch.Generator | None
) -> torch.device | None:
    """``device`` resolved (``ValueError`` naming it, or ``generator``, before anything is drawn)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {generator!r:.80}")
    return model_device(device)
