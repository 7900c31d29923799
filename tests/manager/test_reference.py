"""The reference decoder: correct attention over a static KV cache, padding, idempotence.

CPU tests check the model against a naive per-token implementation and check
the properties the graphs rely on (padding rows and reruns leave real
requests alone, the injected attention op is the one that runs, metadata
built outside the forward gives the same step); GPU tests capture it FULL and
PIECEWISE and compare with eager.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
import subprocess
import sys
from typing import Any, Final

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from examples import demo
from examples.config import DecoderConfig
from examples.demo import main as demo_main
from examples.demo import run_graph, schedule
from examples.inputs import make_step_inputs
from examples.reference import INPUT_NAMES, ReferenceDecoder, static_inputs
from examples.reference_attention import breakable_cached_attention, cached_attention, traced_cached_attention
from tests.capture.test_lean_import_capture import run_fresh
from tests.manager.reference_support import GPU_STEPS, StaticStep, pad_step_inputs
from tests.torch_support import rel_err

SMALL: Final = DecoderConfig.small()
_EPS: Final = 1e-5  # the decoder's RMSNorm epsilon
_THETA: Final = 10000.0  # the decoder's RoPE base
_FP32_TOL: Final = 1e-5


def _model(config: DecoderConfig = SMALL, *, seed: int = 0, device: str = "cpu") -> ReferenceDecoder:
    torch.manual_seed(seed)
    return ReferenceDecoder(config, device=device)


def _inputs(
    num_tokens: int, *, uniform: bool, seed: int, config: DecoderConfig = SMALL, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return make_step_inputs(config, num_tokens, uniform_decode=uniform, generator=generator, device=device)


def _requests(inputs: dict[str, torch.Tensor]) -> dict[int, list[int]]:
    """Token rows of each request (by cache row), in order."""
    requests: dict[int, list[int]] = {}
    for token, row in enumerate(inputs["cache_rows"].tolist()):
        requests.setdefault(row, []).append(token)
    return requests


def _select(inputs: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    index = torch.tensor(rows)
    return {name: tensor[index] for name, tensor in inputs.items()}


# -- a naive decoder: per-token loops, no mask, no gather --


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS) * weight


def _rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """Rotary embedding of one token's ``[heads, head_dim]``."""
    half = x.shape[-1] // 2
    angles = position * _THETA ** (-torch.arange(half, dtype=torch.float64) / half)  # [half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _naive_forward(model: ReferenceDecoder, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder computed token by token, writing into ``model``'s caches."""
    config = model.config
    heads, head_dim = config.num_heads, config.head_dim
    ids, positions, cache_rows = (inputs[name].tolist() for name in INPUT_NAMES)
    num_tokens = len(ids)
    body = model.body
    x = body.embed[torch.tensor(ids)]  # [T, hidden]
    for layer, (k_cache, v_cache) in zip(body.layers, model.kv_caches(), strict=True):
        h = _rms_norm(x, layer.input_norm)
        qkv = h @ layer.qkv_weight  # [T, 3 * hidden]
        q, k, v = (part.reshape(num_tokens, heads, head_dim) for part in qkv.chunk(3, dim=-1))
        q = torch.stack([_rope(q[t], positions[t]) for t in range(num_tokens)])
        k = torch.stack([_rope(k[t], positions[t]) for t in range(num_tokens)])
        for t in range(num_tokens):
            k_cache[cache_rows[t], positions[t]] = k[t]
            v_cache[cache_rows[t], positions[t]] = v[t]
        attn = torch.empty(num_tokens, heads, head_dim)
        for t in range(num_tokens):
            keys = k_cache[cache_rows[t], : positions[t] + 1]  # [n, heads, head_dim]
            values = v_cache[cache_rows[t], : positions[t] + 1]
            scores = torch.einsum("hd,nhd->hn", q[t], keys) / math.sqrt(head_dim)
            attn[t] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values)
        x = x + attn.reshape(num_tokens, -1) @ layer.o_weight
        h = _rms_norm(x, layer.post_norm)
        gate, up = (h @ layer.gate_up_weight).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.down_weight
    return _rms_norm(x, body.final_norm)


def _assert_caches_close(a: ReferenceDecoder, b: ReferenceDecoder, *, atol: float = 1e-5) -> None:
    for (ka, va), (kb, vb) in zip(a.kv_caches(), b.kv_caches(), strict=True):
        torch.testing.assert_close(ka, kb, atol=atol, rtol=1e-5)
        torch.testing.assert_close(va, vb, atol=atol, rtol=1e-5)


# -- CPU tests --


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_returns_final_hidden_states(uniform: bool, dtype: torch.dtype) -> None:
    config = dataclasses.replace(SMALL, dtype=dtype)
    model = _model(config)
    out = model.step(_inputs(11, uniform=uniform, seed=1, config=config))
    assert out.shape == (11, config.hidden_size)
    assert out.dtype == dtype
    assert bool(out.isfinite().all())
    # Final RMSNorm with unit weights: every row has a root mean square of 1.
    rms = out.float().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(11), atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    ("num_tokens", "uniform", "seed"), [(1, True, 0), (9, True, 1), (23, False, 2), (40, False, 3)]
)
def test_matches_naive_per_token_decoder(num_tokens: int, uniform: bool, seed: int) -> None:
    model = _model(seed=seed)
    naive_model = copy.deepcopy(model)
    inputs = _inputs(num_tokens, uniform=uniform, seed=seed)
    out = model.step(inputs)
    expected = _naive_forward(naive_model, inputs)
    assert rel_err(out, expected) < _FP32_TOL
    _assert_caches_close(model, naive_model)


def test_mixed_batch_rows_equal_each_request_run_alone() -> None:
    model = _model(seed=3)
    inputs = _inputs(48, uniform=False, seed=3)
    requests = _requests(inputs)
    assert len(requests) >= 2
    assert max(len(rows) for rows in requests.values()) >= 2  # a prefill chunk is in the batch
    batched = model.step(inputs)
    for rows in requests.values():
        alone = _model(seed=3).step(_select(inputs, rows))  # a fresh copy of the same model
        torch.testing.assert_close(batched[torch.tensor(rows)], alone, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_then_decode_equals_one_longer_chunk() -> None:
    """K/V written by one step are what the next step attends to."""
    row, length = 5, 12
    ids = torch.randint(0, SMALL.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(length + 1)
    cache_rows = torch.full((length + 1,), row)
    two_steps = _model(seed=4)
    two_steps.forward(ids[:length], positions[:length], cache_rows[:length])
    decoded = two_steps.forward(ids[length:], positions[length:], cache_rows[length:])  # [1, hidden]
    one_step = _model(seed=4).forward(ids, positions, cache_rows)  # [length + 1, hidden]
    torch.testing.assert_close(decoded[0], one_step[length], atol=1e-5, rtol=1e-5)
    # No prefill written:
    other = _model(seed=4).forward(ids[length:], positions[length:], cache_rows[length:])
    assert rel_err(other[0], one_step[length]) > 1e-2


def test_mask_hides_later_positions_and_shows_earlier_ones() -> None:
    model = _model(seed=5)
    inputs = _inputs(1, uniform=True, seed=5)
    row, position = int(inputs["cache_rows"][0]), int(inputs["positions"][0])
    if position in (0, SMALL.max_seq_len - 1):  # make room on both sides
        inputs["positions"][0] = position = SMALL.max_seq_len // 2
    reference = copy.deepcopy(model).step(inputs)
    later = copy.deepcopy(model)
    for k_cache, v_cache in later.kv_caches():
        k_cache[row, position + 1 :] = torch.randn_like(k_cache[row, position + 1 :])
        v_cache[row, position + 1 :] = torch.randn_like(v_cache[row, position + 1 :])
    torch.testing.assert_close(later.step(inputs), reference, atol=0, rtol=0)
    earlier = copy.deepcopy(model)
    for _, v_cache in earlier.kv_caches():
        v_cache[row, :position] = torch.randn_like(v_cache[row, :position])
    assert rel_err(earlier.step(inputs), reference) > 1e-2


def test_running_a_step_twice_gives_the_same_outputs_and_caches() -> None:
    model = _model(seed=6)
    before = copy.deepcopy(model)
    inputs = _inputs(30, uniform=False, seed=6)
    first = model.step(inputs)
    after_first = copy.deepcopy(model)
    second = model.step(inputs)
    assert torch.equal(first, second)
    _assert_caches_close(model, after_first, atol=0)
    # The step did write: the first layer's cache changed at exactly its tokens' rows.
    (k_before, _), (k_after, _) = before.kv_caches()[0], model.kv_caches()[0]
    changed = (k_before != k_after).flatten(2).any(-1)  # [rows, positions]
    expected = torch.zeros_like(changed)
    expected[inputs["cache_rows"], inputs["positions"]] = True
    assert torch.equal(changed, expected)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "traced"])
def test_unbreakable_model_matches_the_breakable_one(compiled: bool) -> None:
    """``breakable=False`` (the custom op for tracers) computes and writes what the break does."""
    config = SMALL
    model = _model(config, seed=8)
    torch.manual_seed(8)
    unbreakable = ReferenceDecoder(config, breakable=False)
    _assert_caches_close(model, unbreakable, atol=0)  # same seed: same weights and caches
    inputs = _inputs(19, uniform=False, seed=8)
    expected = model.step(inputs)
    # aot_eager traces through AOTAutograd (functionalization included), no C++ compiler needed.
    forward = torch.compile(unbreakable, backend="aot_eager", fullgraph=True) if compiled else unbreakable
    actual = forward(**inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    _assert_caches_close(unbreakable, model, atol=1e-6)


def test_traced_attention_declares_its_in_place_writes() -> None:
    # What inductor relies on to leave the cache in place: the schema's write annotations.
    schema = torch.ops.cudagraph_manager.cached_attention.default._schema
    written = {arg.name for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == {"kv_cache", "out"}


def test_breakable_picks_the_default_attention() -> None:
    assert _model().attention is breakable_cached_attention
    assert ReferenceDecoder(SMALL, breakable=False).attention is traced_cached_attention


class _Recorder:
    """An attention op that records which cache each call writes, then runs ``cached_attention``."""

    def __init__(self) -> None:
        self.caches: list[torch.Tensor] = []

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        cache_rows: torch.Tensor,
        key_index: torch.Tensor,
        value_index: torch.Tensor,
        mask: torch.Tensor,
        out: torch.Tensor,
        /,
    ) -> None:
        self.caches.append(kv_cache)
        cached_attention(q, k, v, kv_cache, cache_rows, key_index, value_index, mask, out)


def _no_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    key_index: torch.Tensor,
    value_index: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    /,
) -> None:
    """Attention that attends to nothing: zeros out, writes no cache."""
    out.zero_()


@pytest.mark.parametrize("inject", ["constructor", "with_attention"])
def test_injected_attention_is_what_every_layer_runs(inject: str) -> None:
    recorder = _Recorder()
    if inject == "constructor":
        torch.manual_seed(9)
        model = ReferenceDecoder(SMALL, attention=recorder)
    else:
        model = _model(seed=9).with_attention(recorder)
    default = _model(seed=9)  # the same weights and caches, the default attention
    inputs = _inputs(17, uniform=False, seed=9)
    out = model.step(inputs)
    assert [cache.data_ptr() for cache in recorder.caches] == [cache.data_ptr() for cache in model.caches]
    torch.testing.assert_close(out, default.step(inputs), atol=0, rtol=0)
    _assert_caches_close(model, default, atol=0)
    # An op that attends to nothing changes the output and leaves the caches alone.
    before = copy.deepcopy(model)
    silent = model.with_attention(_no_attention)
    assert rel_err(silent.step(inputs), out) > 1e-2
    _assert_caches_close(model, before, atol=0)
    assert model.attention is recorder  # the twin's op is its own


def test_with_attention_shares_weights_and_caches() -> None:
    model = _model(seed=10)
    twin = model.with_attention(cached_attention)
    assert twin is not model
    assert twin.attention is cached_attention
    assert model.attention is breakable_cached_attention
    assert dict(twin.named_parameters()).keys() == dict(model.named_parameters()).keys()
    for (name, mine), (_, theirs) in zip(twin.named_parameters(), model.named_parameters(), strict=True):
        assert mine is theirs, name
    assert twin.body is model.body
    for cache, twin_cache in zip(model.caches, twin.caches, strict=True):
        assert twin_cache is cache
    before = copy.deepcopy(model)
    inputs = _inputs(6, uniform=True, seed=10)
    out = twin.step(inputs)  # writes the step's K/V into the shared caches
    torch.testing.assert_close(out, before.step(inputs), atol=0, rtol=0)
    _assert_caches_close(model, before, atol=0)


@pytest.mark.parametrize(("num_tokens", "uniform", "seed"), [(1, True, 11), (12, True, 12), (29, False, 13)])
def test_forward_with_metadata_built_outside_equals_forward(
    num_tokens: int, uniform: bool, seed: int
) -> None:
    model = _model(seed=seed)
    other = copy.deepcopy(model)
    inputs = _inputs(num_tokens, uniform=uniform, seed=seed)
    meta = model.metadata(inputs["positions"], inputs["cache_rows"])
    out = model.forward_with_metadata(inputs["input_ids"], meta)
    torch.testing.assert_close(out, other.step(inputs), atol=0, rtol=0)
    _assert_caches_close(model, other, atol=0)


def test_static_step_replays_fresh_inputs_like_forward() -> None:
    """Metadata built into static buffers, then rebuilt there for a fresh step, as the benchmarks run it."""
    model = _model(seed=14)
    other = copy.deepcopy(model)
    static = StaticStep(model, _inputs(SMALL.max_num_seqs, uniform=True, seed=14))
    ids, meta = static.rows(5)
    addresses = [ids.data_ptr(), *(tensor.data_ptr() for tensor in meta)]
    for seed in (15, 16):
        fresh = _inputs(5, uniform=seed == 15, seed=seed)
        static.load(fresh)
        for name, tensor in static.step_inputs(5).items():
            assert torch.equal(tensor, fresh[name]), name
        ids, meta = static.rows(5)
        assert [ids.data_ptr(), *(tensor.data_ptr() for tensor in meta)] == addresses
        out = model.forward_with_metadata(ids, meta)
        torch.testing.assert_close(out, other.step(fresh), atol=0, rtol=0)
    _assert_caches_close(model, other, atol=0)


@pytest.mark.parametrize(
    ("num_tokens", "padded_to", "uniform"), [(3, 4, True), (13, 16, True), (21, 32, False)]
)
def test_padding_rows_leave_real_rows_and_caches_alone(
    num_tokens: int, padded_to: int, uniform: bool
) -> None:
    model = _model(seed=7)
    padded_model = copy.deepcopy(model)
    inputs = _inputs(num_tokens, uniform=uniform, seed=7)
    padded = pad_step_inputs(SMALL, inputs, padded_to)
    assert padded["input_ids"].shape == (padded_to,)
    out = model.step(inputs)
    padded_out = padded_model.step(padded)  # [padded_to, hidden]
    torch.testing.assert_close(padded_out[:num_tokens], out, atol=1e-5, rtol=1e-5)
    scratch = SMALL.scratch_row
    for (k, v), (pk, pv) in zip(model.kv_caches(), padded_model.kv_caches(), strict=True):
        torch.testing.assert_close(pk[:scratch], k[:scratch], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pv[:scratch], v[:scratch], atol=1e-6, rtol=1e-6)
    assert not torch.equal(padded_model.kv_caches()[0][0][scratch], model.kv_caches()[0][0][scratch])


def test_pad_step_inputs_rejects_fewer_rows() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        pad_step_inputs(SMALL, _inputs(5, uniform=True, seed=0), 4)


@given(num_tokens=st.integers(1, 300), uniform=st.booleans(), seed=st.integers(0, 2**31))
def test_make_step_inputs_builds_valid_steps(num_tokens: int, uniform: bool, seed: int) -> None:
    config = dataclasses.replace(SMALL, max_num_seqs=16 if not uniform else 300)
    inputs = _inputs(num_tokens, uniform=uniform, seed=seed, config=config)
    assert set(inputs) == set(INPUT_NAMES)
    for tensor in inputs.values():
        assert tensor.shape == (num_tokens,)
        assert tensor.dtype == torch.int64
    assert int(inputs["input_ids"].max()) < config.vocab_size
    if num_tokens >= 8:  # drawn ids, not a constant fill (all equal by chance: p = vocab_size**-7)
        ids = inputs["input_ids"]
        assert bool((ids != ids[0]).any())
    cache_rows = inputs["cache_rows"]
    assert int(cache_rows.min()) >= 0
    assert int(cache_rows.max()) < config.max_num_seqs  # never the scratch row
    requests = _requests(inputs)
    for rows in requests.values():
        assert rows == list(range(rows[0], rows[0] + len(rows)))  # contiguous rows
        pos = inputs["positions"][torch.tensor(rows)]
        assert torch.equal(pos, torch.arange(int(pos[0]), int(pos[0]) + len(rows)))
        assert int(pos[0]) >= 0
        assert int(pos[-1]) < config.max_seq_len
    if uniform:
        assert len(requests) == num_tokens
    elif num_tokens >= 2:
        assert len(requests[int(cache_rows[0])]) >= 2  # the first request is a prefill chunk


def test_make_step_inputs_rejects_impossible_steps() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        make_step_inputs(SMALL, 0, uniform_decode=False)
    with pytest.raises(ValueError, match="num_tokens"):
        make_step_inputs(SMALL, SMALL.max_num_seqs + 1, uniform_decode=True)
    with pytest.raises(ValueError, match="num_tokens"):
        make_step_inputs(SMALL, SMALL.max_num_seqs * SMALL.max_seq_len + 1, uniform_decode=False)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("hidden_size", -1), ("num_heads", 3), ("max_seq_len", 2.0), ("dtype", torch.int64)],
)
def test_decoder_config_rejects_bad_values(field: str, value: object) -> None:
    bad: dict[str, Any] = {field: value}  # deliberately ill-typed
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(SMALL, **bad)


def test_default_config_is_the_benchmark_model() -> None:
    config = DecoderConfig()
    assert (config.num_layers, config.hidden_size, config.num_heads, config.head_dim) == (8, 1024, 16, 64)
    assert config.dtype == torch.bfloat16


def test_static_inputs_describe_the_forward_and_pad_into_the_scratch_row() -> None:
    described = static_inputs(SMALL)
    params = list(inspect.signature(ReferenceDecoder.forward).parameters)[1:]
    assert list(described) == params == list(INPUT_NAMES)
    for spec in described.values():
        assert spec.rows == "tokens"
        assert spec.dtype == torch.int64
        assert tuple(spec.shape) == ()
    padded = pad_step_inputs(SMALL, _inputs(3, uniform=True, seed=0), 8)
    for name, spec in described.items():
        assert padded[name][3:].tolist() == [spec.pad_value] * 5
    assert described["cache_rows"].pad_value == SMALL.scratch_row == SMALL.max_num_seqs


def test_schedule_mixes_decode_and_mixed_steps_and_ends_above_the_largest_size() -> None:
    steps = schedule(64, 64, 12)
    assert len(steps) == 12
    assert steps[-1] == (64 + 8, False)
    assert any(uniform for _, uniform in steps)
    assert any(not uniform and n <= 64 for n, uniform in steps)
    assert all(n <= 64 for n, _ in steps[:-1])


def test_demo_cpu_path_prints_what_each_step_would_replay(capsys: pytest.CaptureFixture[str]) -> None:
    status = demo_main(["--cpu", "--steps", "6", "--max-size", "32", "--iters", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert lines[0].startswith("CPU path (--cpu given)")
    rows = [line for line in lines if line[:4].strip().isdigit()]
    assert len(rows) == 6
    modes = [row.split()[4] for row in rows]
    assert "FULL" in modes
    assert "PIECEWISE" in modes
    assert modes[-1] == "NONE"  # the last step is above the largest capture size
    assert lines[-1].startswith("OK: all 6")


def test_demo_honours_dtype_on_the_cpu_path(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39: ``--dtype`` was ignored on the CPU without a word; it is the model's dtype on both paths."""
    status = demo_main(["--cpu", "--dtype", "bfloat16", "--steps", "3", "--max-size", "16", "--iters", "1"])
    out = capsys.readouterr().out
    assert status == 0
    assert "bfloat16" in out.split("decode loop")[0]  # the setup names the model's dtype
    assert out.splitlines()[-1].startswith("OK: all 3")
    assert "<= 3e-02" in out.splitlines()[-1]  # bfloat16's tolerance


def test_demo_shows_a_backend_that_declares_less_downgraded(capsys: pytest.CaptureFixture[str]) -> None:
    """``--mode FULL`` with the split-KV decode kernel: FULL for decodes, PIECEWISE for mixed batches."""
    args = ["--cpu", "--steps", "6", "--max-size", "32", "--iters", "1"]
    status = demo_main([*args, "--mode", "FULL", "--attention", "split_decode"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert any(line.startswith("graphs: FULL -> FULL_AND_PIECEWISE (split_decode supports") for line in lines)
    rows = [line.split() for line in lines if line[:4].strip().isdigit()]
    assert {row[3]: row[4] for row in rows[:-1]} == {"decode": "FULL", "mixed": "PIECEWISE"}
    assert lines[-1].startswith("OK: all 6")


def test_demo_fails_loudly_above_tolerance(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every step measured 10x off: the demo must report each one and exit 1.
    monkeypatch.setattr(demo, "_relative_error", lambda actual, expected: 1.0)
    status = demo_main(["--cpu", "--steps", "3", "--max-size", "16", "--iters", "1", "--tolerance", "0.1"])
    out = capsys.readouterr().out
    assert status == 1
    assert out.count("FAILED: step") == 3


def test_importing_the_examples_does_not_initialize_cuda() -> None:
    code = (
        "import torch, examples.reference, examples.demo\n"
        "assert not torch.cuda.is_initialized(), 'importing initialized CUDA'\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


# -- GPU tests: capture the decoder, compare with eager --

_GPU_CONFIG: Final = dataclasses.replace(SMALL, max_num_seqs=16)


@pytest.mark.gpu
def test_hand_written_full_graph_of_the_decoder_matches_eager() -> None:
    model = _model(_GPU_CONFIG, device="cuda")
    static = _inputs(8, uniform=False, seed=10, config=_GPU_CONFIG, device="cuda")
    model.step(static)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.step(static)  # attention captured inline
    for seed in (11, 12):
        fresh = _inputs(8, uniform=False, seed=seed, config=_GPU_CONFIG, device="cuda")
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        graph.replay()
        replayed = out.clone()
        assert rel_err(replayed, model.step(fresh)) < 1e-4


@pytest.mark.gpu
def test_breakable_capture_breaks_once_per_layer_and_replays_like_eager() -> None:
    from cudagraph_capture import BreakableCUDAGraphCapture

    model = _model(_GPU_CONFIG, device="cuda")
    static = _inputs(8, uniform=True, seed=20, config=_GPU_CONFIG, device="cuda")
    model.step(static)  # warm-up
    capture = BreakableCUDAGraphCapture()
    with capture:
        out = model.step(static)
    assert capture.num_eager_breaks == _GPU_CONFIG.num_layers
    assert capture.num_graphs == _GPU_CONFIG.num_layers + 1
    for seed in (21, 22):
        fresh = _inputs(8, uniform=True, seed=seed, config=_GPU_CONFIG, device="cuda")
        for name, tensor in fresh.items():
            static[name].copy_(tensor)
        capture.replay()
        replayed = out.clone()
        assert rel_err(replayed, model.step(fresh)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode", [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE]
)
def test_manager_replay_of_the_decoder_matches_eager(mode: CUDAGraphMode) -> None:
    from cudagraph_manager import CUDAGraphManager

    model = _model(_GPU_CONFIG, device="cuda")
    config = DispatchConfig(mode, CaptureSizes([1, 2, 4, 8, 16]), max_num_seqs=_GPU_CONFIG.max_num_seqs)
    manager = CUDAGraphManager(model.forward, static_inputs(_GPU_CONFIG), config, device=torch.device("cuda"))
    manager.capture()
    for i, (num_tokens, uniform) in enumerate(GPU_STEPS):
        inputs = _inputs(num_tokens, uniform=uniform, seed=30 + i, config=_GPU_CONFIG, device="cuda")
        graph_out = run_graph(manager, uniform, inputs)
        assert graph_out.shape == (num_tokens, _GPU_CONFIG.hidden_size)
        replayed = graph_out.clone()
        assert rel_err(replayed, model.step(inputs)) < 1e-4, (mode, num_tokens, uniform)


@pytest.mark.gpu
def test_demo_gpu_path_captures_replays_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--layers", "2", "--hidden", "128", "--heads", "4", "--max-seq-len", "64", "--dtype", "float32"]
    status = demo_main([*small, "--steps", "8", "--max-size", "16", "--iters", "2", "--warmup", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0, "\n".join(lines)
    assert lines[0].startswith("CUDA device: ")
    assert any(line.startswith("Captured ") for line in lines)  # the capture report
    rows = [line for line in lines if line[:4].strip().isdigit()]
    assert len(rows) == 8
    assert {row.split()[4] for row in rows} == {"FULL", "PIECEWISE", "NONE"}
    assert lines[-1].startswith("OK: all 8 graph steps match eager")


def test_make_demo_runs_as_written() -> None:
    """``make demo``'s command, ``python -m examples.demo`` with no arguments, in a fresh process.

    On the CPU it takes the CPU path; on a GPU it captures and replays. Either
    way it must end with its OK line.
    """
    stdout = run_fresh("-m", "examples.demo")
    assert stdout.splitlines()[-1].startswith("OK: all ")
