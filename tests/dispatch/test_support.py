"""Attention support levels: the mode resolved against them, and dispatch that never outruns them.

The oracles are written from the level definitions and from vLLM's
``GPUModelRunner._check_and_update_cudagraph_mode`` (docs/design.md,
"Attention support"), not through ``resolve_mode``: a wrong rule there
cannot hide behind itself.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, Dispatch, DispatchConfig
from cudagraph_dispatch._support import ModeNotSupportedError, resolve_mode
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from tests.strategies import active_lora_counts, attention_supports, dispatch_configs, step_count, step_loras

M: Final = CUDAGraphMode
L: Final = GraphSupport
_LEVELS: Final = (L.NEVER, L.UNIFORM_SINGLE_TOKEN_DECODE, L.UNIFORM_BATCH, L.ALWAYS)

# vLLM's policy as a table: (configured mode, level, spec decode (q > 1), attention splits PIECEWISE)
# -> resolved mode. Rows not listed keep their mode (NONE, PIECEWISE where the attention splits,
# and every mode at ALWAYS).
_DOWN: Final[dict[tuple[CUDAGraphMode, GraphSupport, bool, bool], CUDAGraphMode]] = {}
for _split in (False, True):
    _fallback = M.PIECEWISE if _split else M.NONE
    _mixed = M.FULL_AND_PIECEWISE if _split else M.FULL_DECODE_ONLY
    for _spec in (False, True):
        # FULL: mixed batches need ALWAYS; then the decode rules below apply to what is left.
        _DOWN[M.FULL, L.UNIFORM_BATCH, _spec, _split] = _mixed
        _DOWN[M.FULL, L.UNIFORM_SINGLE_TOKEN_DECODE, _spec, _split] = _fallback if _spec else _mixed
        _DOWN[M.FULL, L.NEVER, _spec, _split] = _fallback
        for _mode in (M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
            _DOWN[_mode, L.NEVER, _spec, _split] = _fallback
            if _spec:
                _DOWN[_mode, L.UNIFORM_SINGLE_TOKEN_DECODE, _spec, _split] = _fallback
        if not _split:  # PIECEWISE graphs hold the attention: mixed batches in them need ALWAYS
            for _level in (L.NEVER, L.UNIFORM_SINGLE_TOKEN_DECODE, L.UNIFORM_BATCH):
                _DOWN[M.PIECEWISE, _level, _spec, _split] = M.NONE
            _DOWN[M.FULL_AND_PIECEWISE, L.UNIFORM_BATCH, _spec, _split] = M.FULL_DECODE_ONLY
            _DOWN[M.FULL_AND_PIECEWISE, L.UNIFORM_SINGLE_TOKEN_DECODE, _spec, _split] = (
                M.NONE if _spec else M.FULL_DECODE_ONLY
            )

# How much runs in FULL graphs, then in graphs at all: a downgrade moves left.
_ORDER: Final = (M.NONE, M.PIECEWISE, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE, M.FULL)


def _vllm(mode: CUDAGraphMode, support: AttentionSupport, query_len: int) -> CUDAGraphMode:
    return _DOWN.get((mode, support.level, query_len > 1, support.piecewise), mode)


def _config(mode: CUDAGraphMode, query_len: int = 1) -> DispatchConfig:
    return DispatchConfig(mode, CaptureSizes.default(64), max_num_seqs=16, uniform_decode_query_len=query_len)


@pytest.mark.parametrize("mode", list(M))
@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("query_len", [1, 3])
@pytest.mark.parametrize("piecewise", [False, True])
def test_the_resolution_is_vllms_policy_in_every_case(
    mode: CUDAGraphMode, level: GraphSupport, query_len: int, piecewise: bool
) -> None:
    """(b) Every combination of configured mode, level, q and split, against the table."""
    support = AttentionSupport(level, piecewise=piecewise)
    resolution = resolve_mode(_config(mode, query_len), support)
    assert resolution.mode is _vllm(mode, support, query_len)
    assert resolution.requested is mode
    assert resolution.downgraded is (resolution.mode is not mode)
    assert bool(resolution.reasons) is resolution.downgraded


@given(dispatch_configs, attention_supports)
def test_the_resolution_never_upgrades(config: DispatchConfig, support: AttentionSupport) -> None:
    """(c) The resolved mode is never above the configured one, and no batch kind gains a FULL graph."""
    resolved = resolve_mode(config, support).mode
    assert _ORDER.index(resolved) <= _ORDER.index(config.mode)
    if resolved.decode_mode() is M.FULL:
        assert config.mode.decode_mode() is M.FULL
    if resolved.mixed_mode() is M.FULL:
        assert config.mode.mixed_mode() is M.FULL
    assert resolved is _vllm(config.mode, support, config.uniform_decode_query_len)


def full_routes_it_cannot_serve(
    dispatcher: CUDAGraphDispatcher,
    level: GraphSupport,
    num_tokens: int,
    num_active_loras: int,
    *,
    splits: bool = True,
) -> list[Dispatch]:
    """The FULL decisions for ``num_tokens`` (uniform or not) whose graph the level cannot replay.

    From the level definitions: a mixed (non-uniform) FULL key serves any
    batch, so it needs ALWAYS; a uniform key of q tokens per request needs
    UNIFORM_BATCH for q > 1 and UNIFORM_SINGLE_TOKEN_DECODE for q = 1. A
    PIECEWISE graph holds an attention that does not split (``splits``
    false): its relaxed key serves any batch, so it needs ALWAYS too.
    """
    bad: list[Dispatch] = []
    for uniform in (False, True):
        count = step_count(dispatcher.config, num_tokens, uniform)  # a uniform batch: a multiple of q
        loras = step_loras(dispatcher.config, count, uniform, num_active_loras)  # at most its requests
        decision = dispatcher.dispatch(count, uniform_decode=uniform, num_active_loras=loras)
        if decision.mode is M.PIECEWISE and not splits and level is not L.ALWAYS:
            bad.append(decision)
        if decision.mode is not M.FULL:
            continue
        key = decision.descriptor
        if not key.uniform:
            needed = L.ALWAYS
        else:
            assert key.num_reqs is not None
            query_len = key.num_tokens // key.num_reqs
            needed = L.UNIFORM_BATCH if query_len > 1 else L.UNIFORM_SINGLE_TOKEN_DECODE
        if level < needed:
            bad.append(decision)
    return bad


@given(dispatch_configs, attention_supports, st.data())
def test_no_dispatch_routes_to_a_full_graph_the_level_cannot_serve(
    config: DispatchConfig, support: AttentionSupport, data: st.DataObject
) -> None:
    """(a) Whatever the batch, a FULL route is one the attention's level can replay."""
    dispatcher = CUDAGraphDispatcher(config, attention=support)
    num_tokens = data.draw(
        st.integers(min_value=0, max_value=config.capture_sizes.max + 2), label="num_tokens"
    )
    loras = data.draw(active_lora_counts, label="num_active_loras")
    splits = support.piecewise
    assert full_routes_it_cannot_serve(dispatcher, support.level, num_tokens, loras, splits=splits) == []
    for mode in (M.FULL, M.PIECEWISE):  # and no such graph is even planned
        for key in dispatcher.keys(mode):
            routes = full_routes_it_cannot_serve(
                dispatcher, support.level, key.num_tokens, key.num_active_loras, splits=splits
            )
            assert routes == []


@pytest.mark.parametrize(
    ("mode", "level", "query_len", "splits"),
    [
        (M.FULL, L.UNIFORM_BATCH, 1, True),  # a mixed batch would replay FULL
        (M.FULL_AND_PIECEWISE, L.UNIFORM_SINGLE_TOKEN_DECODE, 3, True),  # spec decode would replay FULL
        (M.FULL_DECODE_ONLY, L.NEVER, 1, True),  # a decode batch would replay FULL
        (M.PIECEWISE, L.UNIFORM_BATCH, 1, False),  # a PIECEWISE graph would hold the attention
    ],
)
def test_the_property_fails_on_a_dispatcher_that_ignores_the_levels(
    mode: CUDAGraphMode, level: GraphSupport, query_len: int, splits: bool
) -> None:
    """The mutation: the dispatcher built from the config alone (the level ignored).

    Property (a)'s check finds a route the level cannot serve on it, so the
    property test can fail; the resolved dispatcher has none.
    """
    config = _config(mode, query_len)
    support = AttentionSupport(level, piecewise=splits)
    ignoring = CUDAGraphDispatcher(config)
    assert any(full_routes_it_cannot_serve(ignoring, level, n, 0, splits=splits) for n in range(1, 65))
    resolved = CUDAGraphDispatcher(config, attention=support)
    assert not any(full_routes_it_cannot_serve(resolved, level, n, 0, splits=splits) for n in range(1, 65))


def test_the_dispatcher_plans_the_keys_of_the_resolved_mode() -> None:
    """FULL under UNIFORM_BATCH: FULL_AND_PIECEWISE's keys, and the config says the mode it follows."""
    config = _config(M.FULL)
    dispatcher = CUDAGraphDispatcher(config, attention=AttentionSupport(L.UNIFORM_BATCH))
    expected = CUDAGraphDispatcher(dataclasses.replace(config, mode=M.FULL_AND_PIECEWISE))
    assert dispatcher.capture_plan() == expected.capture_plan()
    assert dispatcher.config.mode is M.FULL_AND_PIECEWISE
    assert dispatcher.resolution.requested is M.FULL
    assert CUDAGraphDispatcher(config).resolution.mode is M.FULL  # no attention given: ALWAYS


def test_each_downgrade_is_logged_once_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    support = AttentionSupport(L.UNIFORM_SINGLE_TOKEN_DECODE, name="flashinfer")
    with caplog.at_level(logging.WARNING, logger="cudagraph_dispatch"):
        resolution = resolve_mode(_config(M.FULL, 2), support)
    assert resolution.mode is M.PIECEWISE
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 == len(resolution.reasons)
    assert "FULL -> FULL_AND_PIECEWISE" in messages[0]
    assert "flashinfer" in messages[0]
    assert "FULL_AND_PIECEWISE -> PIECEWISE" in messages[1]
    assert "2 tokens per request" in messages[1]
    assert "FULL -> PIECEWISE" in str(resolution)
    assert "UNIFORM_SINGLE_TOKEN_DECODE" in str(resolution)


def test_strict_raises_instead_of_downgrading(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(ModeNotSupportedError, match=r"mode: FULL needs"):
        CUDAGraphDispatcher(_config(M.FULL), attention=AttentionSupport(L.NEVER), strict_attention=True)
    assert not caplog.records
    resolve_mode(_config(M.FULL), AttentionSupport(L.ALWAYS), strict=True)  # nothing to refuse


def test_the_weakest_backend_decides_and_any_non_splitting_one_rules_out_piecewise() -> None:
    flash = AttentionSupport(L.ALWAYS, name="flash")
    mla = AttentionSupport(L.UNIFORM_BATCH, name="mla")
    mamba = AttentionSupport(L.UNIFORM_BATCH, piecewise=False, name="mamba")
    assert AttentionSupport.weakest([flash, mla]) == mla
    assert AttentionSupport.weakest([flash, mla, mamba]) == dataclasses.replace(mla, piecewise=False)
    assert AttentionSupport.weakest([]).level is L.ALWAYS


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AttentionSupport(2), r"level: expected a GraphSupport"),  # type: ignore[arg-type]
        (lambda: AttentionSupport(piecewise="yes"), r"piecewise"),  # type: ignore[arg-type]
        (lambda: AttentionSupport(name=""), r"name: expected a non-empty string"),
        (lambda: AttentionSupport.weakest([L.ALWAYS]), r"supports\[0\]: expected an AttentionSupport"),  # type: ignore[list-item]
        (lambda: CUDAGraphDispatcher(_config(M.FULL), attention=L.ALWAYS), r"attention: expected"),  # type: ignore[arg-type]
        (lambda: resolve_mode(_config(M.FULL), None), r"support: expected"),  # type: ignore[arg-type]
    ],
)
def test_bad_support_arguments_are_named(make: object, match: str) -> None:
    assert callable(make)
    with pytest.raises(ValueError, match=match):
        make()


def test_a_config_that_plans_no_uniform_decode_graph_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A new trial's case: q = 16 above every size gave uniform decode batches no FULL graph, silently."""
    config = DispatchConfig(M.FULL_AND_PIECEWISE, CaptureSizes([1, 2, 4, 8]), 8, uniform_decode_query_len=16)
    with caplog.at_level(logging.WARNING, logger="cudagraph_dispatch"):
        dispatcher = CUDAGraphDispatcher(config)
    assert dispatcher.capture_plan()  # the mixed batches' graphs
    assert "FULL_AND_PIECEWISE plans no FULL graph for uniform decode batches" in caplog.text
    assert "uniform_decode_query_len=16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cudagraph_dispatch"):
        CUDAGraphDispatcher(dataclasses.replace(config, uniform_decode_query_len=2))  # 2, 4, 8: decode graphs
        CUDAGraphDispatcher(dataclasses.replace(config, mode=M.PIECEWISE))  # asks for no decode graph
    assert not caplog.records


def test_a_config_that_plans_no_graph_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """The newcomer's 10: FULL_DECODE_ONLY, sizes up to 8, q = 3 plans nothing, silently before."""
    sizes = CaptureSizes.default(8)  # 1, 2, 4, 8: no multiple of 3
    config = DispatchConfig(M.FULL_DECODE_ONLY, sizes, max_num_seqs=4, uniform_decode_query_len=3)
    with caplog.at_level(logging.WARNING, logger="cudagraph_dispatch"):
        dispatcher = CUDAGraphDispatcher(config)
    assert dispatcher.capture_plan() == []
    assert "FULL_DECODE_ONLY plans no graph" in caplog.text
    assert "uniform_decode_query_len=3" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cudagraph_dispatch"):
        CUDAGraphDispatcher(dataclasses.replace(config, capture_sizes=CaptureSizes([3, 6])))
        CUDAGraphDispatcher(dataclasses.replace(config, mode=M.NONE))  # asks for nothing: nothing to say
    assert not caplog.records
