"""Every bad input of cudagraph_dispatch's public API, in one table (DESIGN.md, "Conventions").

Each row is a call, the exception it must raise, and a pattern that must find
both the argument's name and the bad value in the message: callers are often
untyped engine code, and "expected an integer" without saying which argument
and what was passed sends them hunting. ``bool`` is not an ``int`` here, and a
string is not a ``bool`` (``"no"`` is truthy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pytest

from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    DispatchConfig,
    RankRequest,
    agree_across_ranks,
    check_bool,
    check_int,
    get_forward_context,
    set_forward_context,
)

M: Final = CUDAGraphMode
SIZES: Final = CaptureSizes([1, 8])
DISPATCHER: Final = CUDAGraphDispatcher(DispatchConfig(M.FULL_AND_PIECEWISE, SIZES, 8))
KEY: Final = BatchDescriptor(8)


def call(fn: Callable[..., object], *args: object, **kwargs: object) -> Callable[[], object]:
    """``fn(*args, **kwargs)``, deferred. Typed loosely on purpose: the arguments are the bad inputs."""
    return lambda: fn(*args, **kwargs)


def row(name: str, thunk: Callable[[], object], pattern: str) -> object:
    """One table row: every bad input here raises ValueError (wrong types included, as DESIGN.md allows)."""
    return pytest.param(thunk, ValueError, pattern, id=name)


BAD_INPUTS: Final = [
    # -- CUDAGraphMode --
    row("parse-not-a-string", call(M.parse, 5), r"text.*5"),
    row("parse-unknown-name", call(M.parse, "bogus"), r"text.*'bogus'"),
    row("has_mode-string", call(M.FULL.has_mode, "FULL"), r"mode.*'FULL'"),
    row("has_mode-config-mode", call(M.FULL.has_mode, M.FULL_DECODE_ONLY), r"mode.*FULL_DECODE_ONLY"),
    # -- BatchDescriptor --
    row("descriptor-negative-tokens", call(BatchDescriptor, -5, "x"), r"num_tokens.*-5"),
    row("descriptor-bool-tokens", call(BatchDescriptor, True), r"num_tokens.*True"),
    row("descriptor-float-tokens", call(BatchDescriptor, 2.0), r"num_tokens.*2\.0"),
    row("descriptor-string-reqs", call(BatchDescriptor, 5, "x"), r"num_reqs.*'x'"),
    row("descriptor-zero-reqs", call(BatchDescriptor, 5, 0), r"num_reqs.*0"),
    row("descriptor-string-uniform", call(BatchDescriptor, 5, uniform="yes"), r"uniform.*'yes'"),
    row("descriptor-int-has_lora", call(BatchDescriptor, 5, has_lora=1), r"has_lora.*1"),
    row("descriptor-negative-loras", call(BatchDescriptor, 5, num_active_loras=-1), r"num_active_loras.*-1"),
    # -- CaptureSizes --
    row("sizes-int", call(CaptureSizes, 5), r"capture_sizes.*5"),
    row("sizes-none", call(CaptureSizes, None), r"capture_sizes.*None"),
    row("sizes-string", call(CaptureSizes, "48"), r"capture_sizes.*'48'"),
    row("sizes-empty", call(CaptureSizes, []), r"capture_sizes.*\[\]"),
    row("sizes-zero", call(CaptureSizes, [1, 0]), r"capture_sizes\[1\].*0"),
    row("sizes-bool", call(CaptureSizes, [8, True]), r"capture_sizes\[1\].*True"),
    row("sizes-float", call(CaptureSizes, [2.5]), r"capture_sizes\[0\].*2\.5"),
    row("default-zero", call(CaptureSizes.default, 0), r"max_size.*0"),
    row("default-bool", call(CaptureSizes.default, True), r"max_size.*True"),
    row("default-string", call(CaptureSizes.default, "512"), r"max_size.*'512'"),
    row("pad-bool", call(SIZES.pad, True), r"^n: .*True"),
    row("pad-float", call(SIZES.pad, 2.5), r"^n: .*2\.5"),
    row("pad-string", call(SIZES.pad, "3"), r"^n: .*'3'"),
    row("pad-negative", call(SIZES.pad, -1), r"^n: .*-1"),
    # -- DispatchConfig --
    row("config-mode-string", call(DispatchConfig, "FULL", SIZES, 8), r"mode.*'FULL'"),
    row("config-sizes-list", call(DispatchConfig, M.FULL, [1, 2], 8), r"capture_sizes.*\[1, 2\]"),
    row("config-max_num_seqs-zero", call(DispatchConfig, M.FULL, SIZES, 0), r"max_num_seqs.*0"),
    row("config-max_num_seqs-bool", call(DispatchConfig, M.FULL, SIZES, True), r"max_num_seqs.*True"),
    row("config-max_num_seqs-string", call(DispatchConfig, M.FULL, SIZES, "4"), r"max_num_seqs.*'4'"),
    row("config-query_len-zero", call(DispatchConfig, M.FULL, SIZES, 8, 0), r"uniform_decode_query_len.*0"),
    row("config-lora_counts-int", call(DispatchConfig, M.FULL, SIZES, 8, 1, 3), r"lora_counts.*3"),
    row("config-lora_counts-zero", call(DispatchConfig, M.FULL, SIZES, 8, 1, (0,)), r"lora_counts.*0"),
    row("config-lora_counts-float", call(DispatchConfig, M.FULL, SIZES, 8, 1, (1.5,)), r"lora_counts.*1\.5"),
    # -- CUDAGraphDispatcher --
    row("dispatcher-no-config", call(CUDAGraphDispatcher, None), r"config.*None"),
    row("keys-string", call(DISPATCHER.keys, "FULL"), r"mode.*'FULL'"),
    row("keys-config-mode", call(DISPATCHER.keys, M.FULL_AND_PIECEWISE), r"mode.*FULL_AND_PIECEWISE"),
    row("dispatch-negative", call(DISPATCHER.dispatch, -1), r"num_tokens.*-1"),
    row("dispatch-bool-tokens", call(DISPATCHER.dispatch, True), r"num_tokens.*True"),
    row("dispatch-float-tokens", call(DISPATCHER.dispatch, 2.5), r"num_tokens.*2\.5"),
    row("dispatch-string-tokens", call(DISPATCHER.dispatch, "3"), r"num_tokens.*'3'"),
    row(
        "dispatch-string-uniform", call(DISPATCHER.dispatch, 3, uniform_decode="no"), r"uniform_decode.*'no'"
    ),
    row("dispatch-int-uniform", call(DISPATCHER.dispatch, 3, uniform_decode=1), r"uniform_decode.*1"),
    row("dispatch-none-uniform", call(DISPATCHER.dispatch, 3, uniform_decode=None), r"uniform_decode.*None"),
    row(
        "dispatch-negative-loras", call(DISPATCHER.dispatch, 3, num_active_loras=-1), r"num_active_loras.*-1"
    ),
    row(
        "dispatch-bool-loras", call(DISPATCHER.dispatch, 3, num_active_loras=True), r"num_active_loras.*True"
    ),
    row(
        "dispatch-invalid_modes-set",
        call(DISPATCHER.dispatch, 3, invalid_modes={M.FULL}),
        r"invalid_modes.*\{<CUDAGraphMode\.FULL",
    ),
    row(
        "dispatch-invalid_modes-none-mode",
        call(DISPATCHER.dispatch, 3, invalid_modes=frozenset({M.NONE})),
        r"invalid_modes.*NONE",
    ),
    row(
        "dispatch-invalid_modes-string",
        call(DISPATCHER.dispatch, 3, invalid_modes="FULL"),
        r"invalid_modes.*'FULL'",
    ),
    row("explain-negative", call(DISPATCHER.explain, -1), r"num_tokens.*-1"),
    row("explain-string-uniform", call(DISPATCHER.explain, 3, uniform_decode="no"), r"uniform_decode.*'no'"),
    # -- set_forward_context --
    row("context-mode-string", call(set_forward_context, "FULL", KEY), r"runtime_mode.*'FULL'"),
    row(
        "context-config-mode",
        call(set_forward_context, M.FULL_AND_PIECEWISE, KEY),
        r"runtime_mode.*FULL_AND_PIECEWISE",
    ),
    row("context-graph-without-key", call(set_forward_context, M.FULL, None), r"batch_descriptor.*None"),
    row("context-key-tuple", call(set_forward_context, M.FULL, (8,)), r"batch_descriptor.*\(8,\)"),
    # -- data parallelism --
    row("rank-negative-tokens", call(RankRequest, -1), r"num_tokens.*-1"),
    row("rank-bool-tokens", call(RankRequest, True), r"num_tokens.*True"),
    row("rank-string-uniform", call(RankRequest, 4, uniform_decode="yes"), r"uniform_decode.*'yes'"),
    row("rank-negative-loras", call(RankRequest, 4, num_active_loras=-2), r"num_active_loras.*-2"),
    row("ranks-ints", call(agree_across_ranks, DISPATCHER, [5, 7]), r"requests\[0\].*5"),
    row("ranks-not-a-sequence", call(agree_across_ranks, DISPATCHER, 5), r"requests.*5"),
    row("ranks-none", call(agree_across_ranks, DISPATCHER, []), r"requests.*\[\]"),
    row(
        "ranks-invalid_modes-string",
        call(agree_across_ranks, DISPATCHER, [RankRequest(3)], invalid_modes="FULL"),
        r"invalid_modes.*'FULL'",
    ),
    # -- the shared checks --
    row("check_int-bool", call(check_int, "size", True, minimum=0), r"size.*True"),
    row("check_int-below", call(check_int, "size", -1, minimum=0), r"size.*>= 0.*-1"),
    row("check_int-string", call(check_int, "size", "3", minimum=0), r"size.*'3'"),
    row("check_bool-string", call(check_bool, "flag", "no"), r"flag.*'no'"),
    row("check_bool-int", call(check_bool, "flag", 1), r"flag.*1"),
    row("check_bool-none", call(check_bool, "flag", None), r"flag.*None"),
]


@pytest.mark.parametrize(("thunk", "error", "pattern"), BAD_INPUTS)
def test_bad_input_names_the_argument_and_the_value(
    thunk: Callable[[], object], error: type[Exception], pattern: str
) -> None:
    """The call raises the listed exception, whose message names the argument and shows the value."""
    with pytest.raises(error, match=pattern):
        thunk()
    assert get_forward_context() is None  # a rejected context was never entered
