"""Hypothesis strategies shared by every test package (one module, by design).

``st.builds`` by default; ``@st.composite`` only where one draw depends on
another (token counts that depend on the dispatcher's largest size). Every
strategy here is cheap to draw from: a dispatcher's tables grow with the
number of its sizes, not the largest one, so explicit size lists reach
``2**20``; text is drawn from a short alphabet, as the full unicode one costs
Hypothesis most of a second to set up on first use.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Final

from hypothesis import strategies as st

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    DispatchConfig,
    RankRequest,
)
from cudagraph_dispatch._sizes import DENSE_PAD_LIMIT  # where padding switches from a table to bisection
from cudagraph_dispatch.budgets import TokenBudgets
from cudagraph_dispatch.support import AttentionSupport, GraphSupport

#: The largest capture size any strategy here produces.
MAX_CAPTURE_SIZE: Final = 2**20
#: The largest ``max_size`` given to ``CaptureSizes.default``: past DENSE_PAD_LIMIT,
#: with a few hundred sizes (one every 16 tokens), so that default lists stay short.
MAX_DEFAULT_SIZE: Final = DENSE_PAD_LIMIT + 1000
#: The largest LoRA count any strategy here produces.
MAX_LORA_COUNT: Final = 8

RUNTIME_MODE_LIST: Final = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)
GRAPH_MODE_LIST: Final = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

# -- modes --

#: Any mode, configuration modes included.
modes: Final = st.sampled_from(CUDAGraphMode)
#: NONE, PIECEWISE or FULL: what one forward runs as.
runtime_modes: Final = st.sampled_from(RUNTIME_MODE_LIST)
#: The modes a caller may turn off per step (e.g. FULL under cascade attention).
invalid_mode_sets: Final = st.frozensets(st.sampled_from(GRAPH_MODE_LIST))


@st.composite
def mixed_case_names(draw: st.DrawFn, mode: CUDAGraphMode | None = None) -> tuple[CUDAGraphMode, str]:
    """A mode and its name with each letter's case drawn independently."""
    chosen = draw(modes) if mode is None else mode
    upper = draw(st.lists(st.booleans(), min_size=len(chosen.name), max_size=len(chosen.name)))
    text = "".join(c.upper() if u else c.lower() for c, u in zip(chosen.name, upper, strict=True))
    return chosen, text


# -- sizes and configs --

#: One size: small ones (where uniform decode graphs live), ones around
#: DENSE_PAD_LIMIT, and any up to MAX_CAPTURE_SIZE.
size_values: Final = st.one_of(
    st.integers(min_value=1, max_value=64),
    st.integers(min_value=DENSE_PAD_LIMIT - 2, max_value=DENSE_PAD_LIMIT + 2),
    st.integers(min_value=1, max_value=MAX_CAPTURE_SIZE),
)
#: Raw size lists as a caller might pass them: unsorted, with duplicates.
size_lists: Final = st.lists(size_values, min_size=1, max_size=24)
#: ``max_size`` for ``CaptureSizes.default``, on both sides of 256 (where the step changes)
#: and of DENSE_PAD_LIMIT.
default_max_sizes: Final = st.integers(min_value=1, max_value=MAX_DEFAULT_SIZE)
capture_sizes: Final = st.one_of(
    st.builds(CaptureSizes, size_lists),
    st.builds(CaptureSizes.default, default_max_sizes),
)


@st.composite
def configs_with(draw: st.DrawFn, mode: st.SearchStrategy[CUDAGraphMode]) -> DispatchConfig:
    """Valid configs whose mode is drawn from ``mode`` (the LoRA counts depend on ``max_num_seqs``)."""
    # Often below the sizes, so that num_reqs = min(size, max_num_seqs) and the
    # uniform range [q, q * max_num_seqs] really cut.
    max_num_seqs = draw(st.integers(min_value=1, max_value=16) | st.integers(min_value=1, max_value=300))
    # Active-adapter counts to capture besides 0, unsorted as a caller might give them: at most
    # max_num_seqs (a request runs one adapter).
    largest_lora_count = min(MAX_LORA_COUNT, max_num_seqs)
    lora_counts = draw(
        st.lists(st.integers(min_value=1, max_value=largest_lora_count), max_size=2, unique=True)
    )
    return DispatchConfig(
        mode=draw(mode),
        capture_sizes=draw(capture_sizes),
        max_num_seqs=max_num_seqs,
        uniform_decode_query_len=draw(st.integers(min_value=1, max_value=4)),
        lora_counts=tuple(lora_counts),
    )


dispatch_configs: Final = configs_with(modes)
dispatchers: Final = st.builds(CUDAGraphDispatcher, dispatch_configs)
#: Dispatchers with a uniform decode routine of their own (FULL_DECODE_ONLY, FULL_AND_PIECEWISE).
separate_routine_dispatchers: Final = st.builds(
    CUDAGraphDispatcher,
    configs_with(st.sampled_from((CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE))),
)

#: LoRA counts to ask for: 0, captured ones, and some above every captured one.
active_lora_counts: Final = st.integers(min_value=0, max_value=MAX_LORA_COUNT + 2)


@st.composite
def token_counts(draw: st.DrawFn, dispatcher: CUDAGraphDispatcher) -> int:
    """A token count around ``dispatcher``'s sizes.

    Mostly in range; also a size or one of its neighbours (padding is tightest
    there), a count either side of DENSE_PAD_LIMIT, and sometimes 0 or above
    the largest size.
    """
    sizes = dispatcher.config.capture_sizes.sizes
    return draw(
        st.one_of(
            st.integers(min_value=1, max_value=sizes[-1]),
            st.builds(operator.add, st.sampled_from(sizes), st.integers(min_value=-1, max_value=1)),
            st.integers(min_value=DENSE_PAD_LIMIT - 1, max_value=DENSE_PAD_LIMIT + 1),
            st.integers(min_value=0, max_value=sizes[-1] + 64),
        )
    )


def step_count(config: DispatchConfig, num_tokens: int, uniform_decode: bool) -> int:
    """``num_tokens`` as a step of that kind has it: a uniform decode batch's, a multiple of q (rounded up).

    Every request of a uniform decode batch has ``uniform_decode_query_len``
    tokens, and it has at most ``max_num_seqs`` requests: a larger count is
    cut to ``q * max_num_seqs``. The dispatcher refuses any other count.
    """
    query_len = config.uniform_decode_query_len
    if not uniform_decode:
        return num_tokens
    return min(-(-num_tokens // query_len), config.max_num_seqs) * query_len


def step_loras(config: DispatchConfig, num_tokens: int, uniform_decode: bool, num_active_loras: int) -> int:
    """``num_active_loras`` cut to the requests a step of ``num_tokens`` tokens can have (one adapter each).

    A mixed step has at most ``min(num_tokens, max_num_seqs)`` requests, a
    uniform decode one ``num_tokens / q``: the dispatcher refuses more adapters.
    """
    most = num_tokens // config.uniform_decode_query_len if uniform_decode else num_tokens
    return min(num_active_loras, most, config.max_num_seqs)


@st.composite
def dispatchers_with_token_counts(draw: st.DrawFn) -> tuple[CUDAGraphDispatcher, int]:
    """A dispatcher and a token count drawn around its own sizes."""
    dispatcher = draw(dispatchers)
    return dispatcher, draw(token_counts(dispatcher))


@st.composite
def dispatchers_with_step_requests(draw: st.DrawFn) -> tuple[CUDAGraphDispatcher, RankRequest]:
    """A dispatcher and one step's batch for it: any valid ``route`` call, the empty batch included.

    The token count is drawn around the dispatcher's sizes, and 0 (an idle
    step) often; a uniform decode batch's count is a multiple of q.
    """
    dispatcher = draw(dispatchers)
    uniform_decode = draw(st.booleans())
    num_tokens = step_count(dispatcher.config, draw(st.just(0) | token_counts(dispatcher)), uniform_decode)
    return dispatcher, RankRequest(
        num_tokens,
        uniform_decode,
        step_loras(dispatcher.config, num_tokens, uniform_decode, draw(active_lora_counts)),
        draw(invalid_mode_sets),
    )


# -- descriptors and forward contexts --


@st.composite
def _batch_descriptors(draw: st.DrawFn) -> BatchDescriptor:
    """A valid key: a request count, when given, at most the token count (a request has a token).

    A uniform key names its request count, and its tokens split evenly over
    them; active adapters come with ``has_lora`` (a key's adapter count is a
    captured capacity: it may exceed the tokens).
    """
    num_tokens = draw(st.integers(min_value=0, max_value=MAX_CAPTURE_SIZE))
    num_reqs = draw(st.none() | st.integers(min_value=1, max_value=max(num_tokens, 1)))
    num_active_loras = draw(st.integers(min_value=0, max_value=MAX_LORA_COUNT))
    num_tokens += num_reqs is not None and num_tokens == 0  # 1 request needs 1 token
    uniform = num_reqs is not None and draw(st.booleans())
    return BatchDescriptor(
        num_tokens - num_tokens % num_reqs if uniform and num_reqs else num_tokens,  # q tokens each
        num_reqs,
        uniform,
        num_active_loras > 0 or draw(st.booleans()),
        num_active_loras,
    )


batch_descriptors: Final = _batch_descriptors()

#: Valid ``(runtime_mode, batch_descriptor)`` arguments of ``set_forward_context``:
#: NONE may go without a descriptor, a graph mode needs one.
forward_context_args: Final = st.one_of(
    st.tuples(st.just(CUDAGraphMode.NONE), st.none() | batch_descriptors),
    st.tuples(st.sampled_from(GRAPH_MODE_LIST), batch_descriptors),
)
#: Extra forward-context entries, as an engine passes attention metadata.
forward_context_extras: Final = st.dictionaries(
    st.sampled_from(("attn_metadata", "slot_mapping", "step", "positions")),
    st.integers() | st.text(alphabet="abcxyz", max_size=4) | st.none(),
    max_size=3,
)

# -- data parallelism --


@st.composite
def rank_requests_for(draw: st.DrawFn, dispatcher: CUDAGraphDispatcher) -> RankRequest:
    """One rank's request with a token count drawn around ``dispatcher``'s sizes."""
    uniform_decode = draw(st.booleans())
    num_tokens = step_count(dispatcher.config, draw(token_counts(dispatcher)), uniform_decode)
    loras = draw(st.sampled_from((0, *dispatcher.config.lora_counts)) | active_lora_counts)
    return RankRequest(
        num_tokens=num_tokens,
        uniform_decode=uniform_decode,
        num_active_loras=step_loras(dispatcher.config, num_tokens, uniform_decode, loras),
    )


@st.composite
def dispatchers_with_rank_requests(
    draw: st.DrawFn, dispatcher_strategy: st.SearchStrategy[CUDAGraphDispatcher] = dispatchers
) -> tuple[CUDAGraphDispatcher, list[RankRequest]]:
    """A dispatcher and one request per rank (1 to 8 ranks) sized for it."""
    dispatcher = draw(dispatcher_strategy)
    requests = draw(st.lists(rank_requests_for(dispatcher), min_size=1, max_size=8))
    return dispatcher, requests


# -- manager steps --


@st.composite
def manager_step_shapes(draw: st.DrawFn, config: DispatchConfig) -> tuple[int, int, bool]:
    """``(num_tokens, num_reqs, uniform_decode)`` of a valid manager step under ``config``.

    0 tokens (an idle step, 0 requests) up to a few tokens above the largest
    size. A uniform decode batch has ``num_reqs * uniform_decode_query_len``
    tokens; a mixed one 1 to ``min(num_tokens, max_num_seqs)`` requests.
    """
    if draw(st.booleans()):
        num_reqs = draw(st.integers(min_value=0, max_value=config.max_num_seqs))
        return num_reqs * config.uniform_decode_query_len, num_reqs, True
    num_tokens = draw(st.integers(min_value=0, max_value=config.capture_sizes.max + 4))
    if num_tokens == 0:
        return 0, 0, False
    return num_tokens, draw(st.integers(min_value=1, max_value=min(num_tokens, config.max_num_seqs))), False


#: The most keys a mode's plan has, as ``estimate_memory()`` sees them (a plan of 2,048 sizes is large).
MAX_PLAN_LENGTH: Final = 2048


@st.composite
def _plan_sizes(draw: st.DrawFn) -> list[int]:
    """Key sizes from a few runs of gaps, each a pattern of 1 to 3 gaps repeated 1 to 256 times.

    The gaps are at most a drawn ``max_gap`` (so dense plans come often); a
    0 gap is a size that repeats, as LoRA counts make it (pattern ``[g, 0,
    0]``). Runs, not one gap per key: a plan reaches MAX_PLAN_LENGTH keys in a
    few dozen choices, where a list of 2,048 gaps costs Hypothesis tens of
    milliseconds an example. Shrinks to one run of one gap: a single key.
    """
    max_gap = draw(st.integers(min_value=1, max_value=64))
    pattern = st.lists(st.integers(min_value=0, max_value=max_gap), min_size=1, max_size=3)
    runs = draw(st.lists(st.tuples(pattern, st.integers(min_value=1, max_value=256)), min_size=1, max_size=8))
    gaps = itertools.chain.from_iterable(run * repeats for run, repeats in runs)
    return sorted(
        (1 + size for size in itertools.accumulate(itertools.islice(gaps, MAX_PLAN_LENGTH))), reverse=True
    )


#: A mode's key sizes in tokens, largest first: 1 to MAX_PLAN_LENGTH keys, gaps of 0 to 64 tokens.
plan_sizes: Final = _plan_sizes()


# -- attention support --

#: What an attention can graph: any level, splitting PIECEWISE graphs or not.
attention_supports: Final = st.builds(
    AttentionSupport,
    level=st.sampled_from(GraphSupport),
    piecewise=st.booleans(),
    name=st.sampled_from(("flash", "flex", "mla")),
)


# -- attention metadata of a padded batch --


@st.composite
def padded_query_lens(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """Real query lengths, and the request count and token total of the batch a graph pads them to."""
    lens = draw(st.lists(st.integers(min_value=1, max_value=16), max_size=12))
    padded_reqs = len(lens) + draw(st.integers(min_value=0, max_value=4))
    padded_total = sum(lens) + draw(st.integers(min_value=0, max_value=32))
    return lens, padded_reqs, padded_total


@dataclasses.dataclass(frozen=True)
class PagedStepCase:
    """A valid step on a small paged cache, as plain Python, and the shape a graph pads it to.

    Per request: ``query_lens``, ``seq_lens`` (at least its query length)
    and a ``block_table`` row (its used pages distinct and never the scratch
    page 0, the rest of the row anything). ``query_len`` is every request's
    when ``uniform``; ``shape_tokens`` and ``shape_reqs`` are the padded batch's.
    """

    page_size: int
    pages_per_seq: int
    num_pages: int
    query_lens: list[int]
    seq_lens: list[int]
    block_table: list[list[int]]
    uniform: bool
    query_len: int
    shape_tokens: int
    shape_reqs: int


@st.composite
def paged_steps(draw: st.DrawFn) -> PagedStepCase:
    """A ``PagedStepCase``: pages of 1 to 16 slots, 0 to 6 requests, up to 3 padding requests."""
    page_size = draw(st.sampled_from((1, 2, 4, 16)))
    pages_per_seq = draw(st.integers(min_value=1, max_value=4))
    max_seq_len = page_size * pages_per_seq
    uniform = draw(st.booleans())
    num_reqs = draw(st.integers(min_value=0, max_value=6))
    query_len = draw(st.integers(min_value=1, max_value=max_seq_len))
    query_lens = [
        query_len if uniform else draw(st.integers(min_value=1, max_value=max_seq_len))
        for _ in range(num_reqs)
    ]
    seq_lens = [draw(st.integers(min_value=q, max_value=max_seq_len)) for q in query_lens]
    used = [-(-s // page_size) for s in seq_lens]
    num_pages = 2 + sum(used) + draw(st.integers(min_value=0, max_value=3))  # scratch, and one page at least
    pages = draw(st.permutations(range(1, num_pages)))
    rows, start = [], 0
    for count in used:
        unused = pages_per_seq - count
        rest = draw(st.lists(st.integers(0, num_pages - 1), min_size=unused, max_size=unused))
        rows.append([*pages[start : start + count], *rest])
        start += count
    shape_reqs = max(num_reqs + draw(st.integers(min_value=0, max_value=3)), 1)
    extra_tokens = draw(st.integers(min_value=0, max_value=8))
    shape_tokens = shape_reqs * query_len if uniform else max(sum(query_lens) + extra_tokens, shape_reqs)
    return PagedStepCase(
        page_size,
        pages_per_seq,
        num_pages,
        query_lens,
        seq_lens,
        rows,
        uniform,
        query_len,
        shape_tokens,
        shape_reqs,
    )


# -- token budgets (encoders over packed items) --

#: A ladder of budgets as a caller might pass it: unsorted, with duplicates.
budget_lists: Final = st.lists(st.integers(min_value=1, max_value=4096), min_size=1, max_size=10)
#: Budgets with or without a bound on items per pack.
token_budgets: Final = st.one_of(
    st.builds(TokenBudgets, budget_lists, max_items=st.none() | st.integers(min_value=1, max_value=16)),
    st.builds(
        TokenBudgets.default,
        st.integers(min_value=1, max_value=16384),
        max_items=st.none() | st.integers(min_value=1, max_value=16),
    ),
)


@st.composite
def budgets_and_lengths(draw: st.DrawFn) -> tuple[TokenBudgets, list[int]]:
    """Budgets and a batch of item lengths, each at most the largest budget (short ones likelier)."""
    budgets = draw(token_budgets)
    length = st.one_of(
        st.integers(min_value=1, max_value=min(64, budgets.max)),
        st.integers(min_value=1, max_value=budgets.max),
    )
    return budgets, draw(st.lists(length, max_size=24))
