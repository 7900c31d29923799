"""The paged decoder's decode loop (``examples.paged.loop``) against a host loop written apart from it.

The reference (``host_reference``) decodes with plain Python: each step's
inputs rebuilt from lists, the step run by ``model.step`` (its metadata built
afresh) or by ``manager.run``, the greedy token taken on the host, requests
stopped at the end token or the length limit. The advance under test writes
the next step in place, the backend's metadata included.

CPU: the advance looped eagerly over padded static buffers with the metadata
built once (as a loop on the device runs it), for every backend; the
argument checks; ``decode_batch``. GPU (``gpu``): the manager's device loop
for every mode with FULL decode graphs and every backend, during a
background capture too.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final

import pytest
import torch

from cudagraph_capture import LoopKind, LoopPolicy
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions
from cudagraph_manager._values._loop import LoopResult
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, metadata_extra
from examples import DecoderConfig
from examples.demo_loop import show_decode_loops
from examples.paged import (
    PAGED_INPUT_NAMES,
    FlexPagedAttention,
    PagedBackend,
    PagedDecoder,
    PagedLayout,
    paged_static_inputs,
)
from examples.paged.loop import (
    NO_TOKEN,
    PagedAdvance,
    decode_batch,
    greedy,
    greedy_advance,
)
from examples.paged.model import make_backend
from examples.paged.varlen import VarlenPagedAttention
from tests.manager.helpers import assert_unchanged, snapshot

CPU_CONFIG: Final = DecoderConfig.small()
#: (backend, page size) on the CPU: flex runs eagerly (any page size), varlen's gathered path.
CPU_CASES: Final = (("flex", 16), ("gather", 16), ("varlen", 16), ("split_decode", 16))

#: A step: the decoder's inputs by name -> final hidden states ``[R, hidden]`` of the real rows.
StepFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Eager FlexAttention warns that it is unfused (the CPU path); downgrades warn once (GPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*downgrad.*", category=UserWarning)
        yield


def fresh_state(num_reqs: int, num_real: int, max_steps: int, device: torch.device) -> LoopState:
    """A loop's state as ``run_loop`` starts it: the real rows active, stop clear."""
    active = torch.zeros(num_reqs, dtype=torch.bool, device=device)
    active[:num_real] = True
    return LoopState(
        torch.zeros((), dtype=torch.int64, device=device),
        torch.zeros((), dtype=torch.bool, device=device),
        active,
        torch.full((max_steps, num_reqs), NO_TOKEN, dtype=torch.int64, device=device),
    )


def host_reference(
    step: StepFn,
    embed: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    *,
    page_size: int,
    eos_id: int | None,
    max_len: int,
    max_steps: int,
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Decoding driven from the host: ``[steps, R]`` int64 tokens (``NO_TOKEN`` once finished).

    ``pick`` chooses the tokens from the float32 logits ``[R, vocab]``.
    Each step's inputs are rebuilt from Python lists; a finished request
    keeps its last inputs (as the device loop keeps them); the loop ends when
    none is active or after ``max_steps``.
    """
    ids = batch["input_ids"].tolist()
    lens = batch["seq_lens"].tolist()
    table = batch["block_table"].tolist()
    active = [True] * len(ids)
    rows: list[list[int]] = []
    weights = embed.float()
    for _ in range(max_steps):
        inputs = _inputs_of(batch, ids, lens, table, page_size)
        hidden = step(inputs)  # [R, hidden]
        sampled = pick(hidden.float() @ weights.T).tolist()  # the logits in float32, as the advance
        rows.append([token if live else NO_TOKEN for token, live in zip(sampled, active, strict=True)])
        for r, token in enumerate(sampled):
            if active[r] and (token == eos_id or lens[r] + 1 >= max_len):
                active[r] = False
            elif active[r]:
                ids[r], lens[r] = token, lens[r] + 1
        if not any(active):
            break
    return torch.tensor(rows, dtype=torch.int64)


def _inputs_of(
    batch: Mapping[str, torch.Tensor],
    ids: Sequence[int],
    lens: Sequence[int],
    table: Sequence[Sequence[int]],
    page_size: int,
) -> dict[str, torch.Tensor]:
    """A step's inputs from the host's lists: each request's token at position ``len - 1``."""
    device = batch["input_ids"].device
    positions = [length - 1 for length in lens]
    slots = [row[p // page_size] * page_size + p % page_size for row, p in zip(table, positions, strict=True)]
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64, device=device),
        "positions": torch.tensor(positions, dtype=torch.int64, device=device),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64, device=device),
        "query_lens": batch["query_lens"].clone(),
        "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "block_table": batch["block_table"].clone(),
    }


def eager_loop(
    model: PagedDecoder,
    advance: PagedAdvance,
    batch: Mapping[str, torch.Tensor],
    num_padded: int,
    max_steps: int,
) -> torch.Tensor:
    """The advance looped eagerly as a device loop runs it: padded static buffers, metadata built once.

    Returns ``[steps, R]`` tokens of the real requests.
    """
    num_real = batch["input_ids"].shape[0]
    device = batch["input_ids"].device
    static = _padded(model, batch, num_padded)
    shape = BatchShape(num_padded, num_padded, 1, CUDAGraphMode.NONE)
    metadata = model.backend.build(StepBatch(num_real, num_real, dict(batch)), shape)
    state = fresh_state(num_padded, num_real, max_steps, device)
    key = BatchDescriptor(num_padded, num_padded, True)
    steps = 0
    extra = metadata_extra(model.backend, metadata)
    with torch.no_grad():
        for step in range(max_steps):
            state.step.fill_(step)
            # Each forward under a context of its own, as the manager runs them (an attention keys
            # its per-forward plan on it).
            with set_forward_context(CUDAGraphMode.NONE, key, **extra):
                hidden = model(*(static[name] for name in PAGED_INPUT_NAMES))
                advance(hidden, static, state)
            steps += 1
            if bool(state.stop):
                break
    return state.tokens[:steps, :num_real].clone()


def _padded(model: PagedDecoder, batch: Mapping[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Static-buffer-like copies of ``batch`` padded to ``rows`` with each input's pad value."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in paged_static_inputs(model.layout).items():
        real = batch[name]
        buffer = torch.full((rows, *spec.shape), spec.pad_value, dtype=spec.dtype, device=real.device)
        buffer[: real.shape[0]] = real
        out[name] = buffer
    return out


def _cpu_model(backend: str, page_size: int, seed: int = 0) -> PagedDecoder:
    torch.manual_seed(seed)
    layout = PagedLayout.for_config(CPU_CONFIG, page_size=page_size)
    rows = CPU_CONFIG.max_num_seqs
    chosen: PagedBackend[object]
    if backend == "flex":  # eager FlexAttention: any page size
        chosen = FlexPagedAttention(layout, max_tokens=rows, max_reqs=rows, compile=False)
    elif backend == "varlen":  # the gathered path: the key map the advance rebuilds
        chosen = VarlenPagedAttention(layout, max_tokens=rows, max_reqs=rows, paged=False)
    else:
        chosen = make_backend(backend, layout, CPU_CONFIG.dtype, max_tokens=rows, max_reqs=rows)
    return PagedDecoder(CPU_CONFIG, layout=layout, backend=chosen)


def runner_up(logits: torch.Tensor) -> torch.Tensor:
    """The second most likely token: ``[R, vocab]`` -> ``[R]`` int64.

    With random tied embeddings the argmax is the input token itself (the
    hidden state is mostly its embedding), whatever the attention read; the
    runner-up is decided by what the layers added, so a stale input or
    metadata changes the tokens.
    """
    return logits.topk(2, dim=-1).indices[:, 1]


def pick_eos(tokens: torch.Tensor, *, spare: int) -> int | None:
    """A token that stops exactly one request at a step in [2, 6]: emitted there first by anyone.

    ``tokens [steps, R]`` from a run without an end token; request ``spare``
    (the one that must reach the loop's limit) never emits it. ``None`` if
    no token qualifies (the lengths still stop requests at different steps).
    """
    for step in range(2, min(7, tokens.shape[0])):
        for request in range(tokens.shape[1]):
            token = int(tokens[step, request])
            earlier = tokens[:step].flatten().tolist() + tokens[step, :request].tolist()
            if token != NO_TOKEN and token not in earlier and token not in tokens[:, spare].tolist():
                return token
    return None


def _cpu_case(backend: str, page_size: int) -> tuple[PagedDecoder, dict[str, torch.Tensor], int]:
    """A model, a batch of 5 requests and its max_len: one stops after a token, one after 10, three run on."""
    model = _cpu_model(backend, page_size)
    max_len = 40
    lens = [max_len - 1, 10, 14, 30, 12]  # all but the first cross a page boundary (pages of 16)
    batch = decode_batch(model, lens, max_len=max_len, generator=torch.Generator().manual_seed(1))
    return model, batch, max_len


def finish_steps(tokens: torch.Tensor) -> list[int]:
    """Each request's tokens before its first ``NO_TOKEN`` (the steps it ran), from ``[steps, R]``."""
    ran = tokens != NO_TOKEN  # [steps, R]
    return ran.int().sum(0).tolist()


CPU_MAX_STEPS: Final = 12


@pytest.mark.parametrize("pick", [greedy, runner_up], ids=["greedy", "runner_up"])
@pytest.mark.parametrize(("backend", "page_size"), CPU_CASES)
def test_the_advance_looped_on_static_buffers_equals_the_host_loop(
    backend: str, page_size: int, pick: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    model, batch, max_len = _cpu_case(backend, page_size)

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return model.step(inputs, uniform_decode=True)

    def reference(eos_id: int | None) -> torch.Tensor:
        return host_reference(
            step,
            model.body.embed,
            batch,
            page_size=page_size,
            eos_id=eos_id,
            max_len=max_len,
            max_steps=CPU_MAX_STEPS,
            pick=pick,
        )

    eos_id = pick_eos(reference(None), spare=1)
    expected = reference(eos_id)
    advance = PagedAdvance(model, eos_id, max_len, sample=pick)
    actual = eager_loop(model, advance, batch, num_padded=8, max_steps=CPU_MAX_STEPS)
    assert torch.equal(actual, expected)
    ran = finish_steps(expected)
    assert ran[0] == 1, ran  # one token: at the length limit
    assert ran[1] == CPU_MAX_STEPS == expected.shape[0], ran  # the loop's limit
    assert len(set(ran)) >= 3, ran
    if pick is runner_up:  # a token that depends on the layers, so a stale input would show
        assert eos_id is not None, ran
        assert min(ran[2:]) < 7, (eos_id, ran)


def test_a_finished_request_and_the_padding_keep_their_inputs() -> None:
    model, batch, max_len = _cpu_case("gather", 16)
    static = _padded(model, batch, 8)
    before = {name: tensor.clone() for name, tensor in static.items()}
    shape = BatchShape(8, 8, 1, CUDAGraphMode.NONE)
    metadata = model.backend.build(StepBatch(5, 5, dict(batch)), shape)
    state = fresh_state(8, 5, 4, torch.device("cpu"))
    advance = greedy_advance(model, eos_id=None, max_len=max_len)
    key = BatchDescriptor(8, 8, True)
    with (
        torch.no_grad(),
        set_forward_context(CUDAGraphMode.NONE, key, **metadata_extra(model.backend, metadata)),
    ):
        for step in range(3):
            state.step.fill_(step)
            advance(model(*(static[name] for name in PAGED_INPUT_NAMES)), static, state)
    assert state.active.tolist() == [False, True, True, True, True, False, False, False]
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        kept = [0, 5, 6, 7]  # the request stopped at step 1, the padding rows
        assert torch.equal(static[name][kept], before[name][kept]), name
    assert torch.equal(static["positions"][1:5], before["positions"][1:5] + 3)
    assert torch.equal(static["seq_lens"][1:5], before["seq_lens"][1:5] + 3)
    paged = metadata.paged  # type: ignore[attr-defined]
    assert torch.equal(paged.seq_lens, static["seq_lens"])  # the metadata advanced with the inputs
    assert torch.equal(paged.positions, static["positions"])
    assert state.tokens[3:].eq(NO_TOKEN).all()  # rows of steps not run
    assert state.tokens[1:3, 0].eq(NO_TOKEN).all()  # the finished request's


def test_the_advance_checks_its_arguments() -> None:
    model = _cpu_model("gather", 16)
    reach = min(model.layout.max_seq_len, CPU_CONFIG.max_seq_len)
    bad: list[tuple[str, Callable[[], object]]] = [
        ("model", lambda: greedy_advance("model", eos_id=None, max_len=8)),  # type: ignore[arg-type]
        ("eos_id", lambda: greedy_advance(model, eos_id=CPU_CONFIG.vocab_size, max_len=8)),
        ("eos_id", lambda: greedy_advance(model, eos_id=True, max_len=8)),
        ("max_len", lambda: greedy_advance(model, eos_id=None, max_len=1)),
        ("max_len", lambda: greedy_advance(model, eos_id=None, max_len=reach + 1)),
        ("sample", lambda: PagedAdvance(model, None, 8, sample="argmax")),  # type: ignore[arg-type]
    ]
    for name, make in bad:
        with pytest.raises(ValueError, match=rf"^{name}:"):
            make()
    advance = greedy_advance(model, eos_id=None, max_len=reach)
    assert advance.embed.dtype == torch.float32
    assert advance.embed.data_ptr() == model.body.embed.data_ptr()  # float32 already: not copied
    state = fresh_state(4, 4, 2, torch.device("cpu"))
    static = _padded(model, decode_batch(model, [3, 4, 5, 6], max_len=8), 4)
    with pytest.raises(ValueError, match=r"^outputs:"):
        advance.step_inputs(torch.zeros(8, CPU_CONFIG.hidden_size), static, state)


def test_decode_batch_gives_each_request_its_own_pages_up_to_max_len() -> None:
    model = _cpu_model("gather", 16)
    batch = decode_batch(model, [1, 16, 17, 30], max_len=40, generator=torch.Generator().manual_seed(3))
    table = batch["block_table"]
    used = table[:, :3]  # 40 keys: 3 pages of 16
    assert len(set(used.flatten().tolist())) == used.numel()
    assert (used != PagedLayout.scratch_page).all()
    assert (table[:, 3:] == PagedLayout.scratch_page).all()
    assert batch["positions"].tolist() == [0, 15, 16, 29]
    with torch.no_grad():  # the paged batch's own checks (slots against the block table)
        model.step(batch, uniform_decode=True)
    with pytest.raises(ValueError, match=r"^seq_lens:"):
        decode_batch(model, [41], max_len=40)
    with pytest.raises(ValueError, match=r"^seq_lens:"):
        decode_batch(model, [], max_len=40)
    with pytest.raises(ValueError, match=r"^seq_lens:"):
        decode_batch(model, [2] * (model.layout.num_pages // 3 + 1), max_len=40)
    with pytest.raises(ValueError, match=r"^max_len:"):
        decode_batch(model, [2], max_len=CPU_CONFIG.max_seq_len + 1)


# ---------------------------------------------------------------------------
# Through the manager: run_loop
# ---------------------------------------------------------------------------


def loop_manager(
    model: PagedDecoder,
    advance: PagedAdvance,
    mode: CUDAGraphMode,
    *,
    sizes: Sequence[int],
    max_steps: int,
    kind: LoopKind | None = None,
) -> CUDAGraphManager[torch.Tensor]:
    """A manager of ``model`` whose ``run_loop`` loops ``advance``."""
    dispatch = DispatchConfig(mode, CaptureSizes(list(sizes)), max_num_seqs=model.config.max_num_seqs)
    return CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        device=model.body.device,
        options=ManagerOptions(
            decode_loop=DecodeLoop(advance, max_steps=max_steps, policy=LoopPolicy(kind)),
            attention=AttentionOptions(metadata_builder=model.backend),
        ),
    )


def run_loop_and_reference(
    manager: CUDAGraphManager[torch.Tensor],
    advance: PagedAdvance,
    batch: Mapping[str, torch.Tensor],
    *,
    max_steps: int,
) -> tuple[LoopResult, torch.Tensor]:
    """``run_loop`` on ``batch``, and the host loop of the same rule over ``manager.run`` steps."""
    with torch.no_grad():
        result = manager.run_loop(max_steps=max_steps, **batch)
        tokens = result.tokens.clone()  # a view, valid until the next run
        expected = host_reference(
            lambda inputs: manager.run_batch(inputs, uniform_decode=True),
            advance.model.body.embed,
            batch,
            page_size=advance.model.layout.page_size,
            eos_id=advance.eos_id,
            max_len=advance.max_len,
            max_steps=max_steps,
            pick=advance.sample,
        )
    return dataclasses.replace(result, tokens=tokens), expected


def eos_from_eager_steps(
    model: PagedDecoder, batch: Mapping[str, torch.Tensor], *, max_len: int, max_steps: int
) -> int | None:
    """An end token that stops one request mid-loop (``pick_eos``), from eager ``runner_up`` steps."""

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return model.step(inputs, uniform_decode=True)

    page_size = model.layout.page_size
    tokens = host_reference(
        step,
        model.body.embed,
        batch,
        page_size=page_size,
        eos_id=None,
        max_len=max_len,
        max_steps=max_steps,
        pick=runner_up,
    )
    return pick_eos(tokens, spare=1)


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.NONE], ids=["FULL", "NONE"])
@pytest.mark.parametrize(("backend", "page_size"), CPU_CASES)
def test_run_loop_on_the_cpu_equals_the_host_loop(backend: str, page_size: int, mode: CUDAGraphMode) -> None:
    model, batch, max_len = _cpu_case(backend, page_size)
    eos_id = eos_from_eager_steps(model, batch, max_len=max_len, max_steps=CPU_MAX_STEPS)
    advance = PagedAdvance(model, eos_id, max_len, sample=runner_up)
    manager = loop_manager(model, advance, mode, sizes=(1, 4, 8), max_steps=CPU_MAX_STEPS)
    manager.capture()  # without CUDA: nothing; every step runs eagerly on the static buffers
    result, expected = run_loop_and_reference(manager, advance, batch, max_steps=CPU_MAX_STEPS)
    assert result.kind is None
    assert result.steps == expected.shape[0]
    assert torch.equal(result.tokens, expected)
    short, expected = run_loop_and_reference(manager, advance, batch, max_steps=2)  # the limit first
    assert short.steps == 2
    assert torch.equal(short.tokens, expected)


def test_run_loop_checks_the_batch_before_touching_a_buffer() -> None:
    model, batch, max_len = _cpu_case("gather", 16)
    advance = greedy_advance(model, eos_id=None, max_len=max_len)
    manager = loop_manager(model, advance, CUDAGraphMode.FULL, sizes=(1, 4, 8), max_steps=4)
    wrong = dict(batch, slot_mapping=batch["slot_mapping"] + 1)
    before = snapshot(manager.static_buffers)
    caches = [cache.clone() for cache in model.kv_caches()]
    with pytest.raises(ValueError, match=r"^slot_mapping:"):
        manager.run_loop(max_steps=4, **wrong)
    with pytest.raises(ValueError, match=r"^run_loop: max_steps:"):
        manager.run_loop(max_steps=5, **batch)
    assert_unchanged(before, manager.static_buffers)  # refused before a buffer was written
    assert all(torch.equal(c, kept) for c, kept in zip(model.kv_caches(), caches, strict=True))
    result = manager.run_loop(max_steps=1, **batch)  # still serves
    assert result.steps == 1
    assert result.tokens.shape == (1, 5)


def test_the_demos_section_runs_both_loops_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    model = _cpu_model("gather", 16)
    assert show_decode_loops(model, CUDAGraphMode.FULL, cpu=True, seed=0, iters=1)
    lines = capsys.readouterr().out.splitlines()
    assert any("a GPU feature" in line for line in lines)
    rows = [line.split() for line in lines if line.startswith("host ")]
    assert [int(row[1]) for row in rows] == [1, 8]  # requests per batch, the run_loop's host path
    # Issue 39: two host loops have no speedup over each other: none printed, and the section says why.
    assert not any("speedup" in line for line in lines if line.startswith("loop kind"))
    assert all(len(row) == 6 and not row[-1].endswith("x") for row in rows), rows
    assert any("no speedup to show" in line for line in lines)
    assert show_decode_loops(object(), CUDAGraphMode.FULL, cpu=True, seed=0, iters=1)  # not paged: skipped


# ---------------------------------------------------------------------------
# GPU: the device loop against the host loop
# ---------------------------------------------------------------------------

GPU_CONFIG: Final = DecoderConfig(num_layers=2, max_num_seqs=32, max_seq_len=256)
GPU_MAX_LEN: Final = 96
GPU_MAX_STEPS: Final = 24
GPU_SIZES: Final = (1, 4, 8, 16)
#: Real requests per batch: 1, 3 (padded to 4), 13 (padded to 16).
GPU_BATCHES: Final = (1, 3, 13)
#: The modes with FULL decode graphs.
FULL_DECODE_MODES: Final = (
    CUDAGraphMode.FULL,
    CUDAGraphMode.FULL_DECODE_ONLY,
    CUDAGraphMode.FULL_AND_PIECEWISE,
)
#: Every backend of the seam: flex with pages of 64 (its kernel's key block), the others of 16.
GPU_CASES: Final = (("flex", 64), ("gather", 16), ("varlen", 16), ("split_decode", 16))


def _gpu_model(backend: str, page_size: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> PagedDecoder:
    torch.manual_seed(seed)
    config = dataclasses.replace(GPU_CONFIG, dtype=dtype)
    layout = PagedLayout.for_config(config, page_size=page_size)
    return PagedDecoder(config, layout=layout, backend=backend, device="cuda")


def _gpu_batch(model: PagedDecoder, num_reqs: int, seed: int) -> dict[str, torch.Tensor]:
    """Random prompts: the first stops after one token (at max_len), the rest anywhere below it."""
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, GPU_MAX_LEN - 1, (num_reqs,), generator=generator).tolist()
    lens[0] = GPU_MAX_LEN - 1
    if num_reqs > 2:
        lens[2] = GPU_MAX_LEN - GPU_MAX_STEPS // 2  # stops by length mid-loop
    return decode_batch(model, lens, max_len=GPU_MAX_LEN, generator=generator, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FULL_DECODE_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(("backend", "page_size"), GPU_CASES)
def test_gpu_the_device_loop_gives_the_host_loops_tokens(
    backend: str, page_size: int, mode: CUDAGraphMode
) -> None:
    seed = GPU_CASES.index((backend, page_size)) * 10 + FULL_DECODE_MODES.index(mode)
    model = _gpu_model(backend, page_size, seed)
    probe = _gpu_batch(model, max(GPU_BATCHES), seed + max(GPU_BATCHES))  # the largest batch below
    eos_id = eos_from_eager_steps(model, probe, max_len=GPU_MAX_LEN, max_steps=GPU_MAX_STEPS)
    advance = PagedAdvance(model, eos_id, GPU_MAX_LEN, sample=runner_up)
    manager = loop_manager(model, advance, mode, sizes=GPU_SIZES, max_steps=GPU_MAX_STEPS)
    with torch.no_grad():
        manager.capture(progress=False)
    for num_reqs in GPU_BATCHES:
        batch = _gpu_batch(model, num_reqs, seed + num_reqs)
        result, expected = run_loop_and_reference(manager, advance, batch, max_steps=GPU_MAX_STEPS)
        assert result.kind is LoopKind.WHILE  # cuda-bindings and a recent driver on the test machines
        assert result.steps == expected.shape[0]
        assert torch.equal(result.tokens.cpu(), expected), (num_reqs, result.tokens, expected)
        ran = finish_steps(expected)
        assert ran[0] == 1, ran  # at max_len after one token
        if num_reqs > 2:
            assert len(set(ran)) >= 2, ran
        short, expected = run_loop_and_reference(manager, advance, batch, max_steps=2)
        assert short.steps == len(expected) == (1 if num_reqs == 1 else 2)  # the limit (or all done)
        assert torch.equal(short.tokens.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [LoopKind.UNROLLED, LoopKind.HOST_LOOP])
def test_gpu_the_fallback_loops_give_the_same_tokens(kind: LoopKind) -> None:
    model = _gpu_model("gather", 16, seed=7)
    advance = PagedAdvance(model, None, GPU_MAX_LEN, sample=runner_up)
    manager = loop_manager(
        model, advance, CUDAGraphMode.FULL, sizes=GPU_SIZES, max_steps=GPU_MAX_STEPS, kind=kind
    )
    with torch.no_grad():
        manager.capture(progress=False)
    batch = _gpu_batch(model, 13, seed=8)
    result, expected = run_loop_and_reference(manager, advance, batch, max_steps=GPU_MAX_STEPS)
    assert result.kind is kind
    assert torch.equal(result.tokens.cpu(), expected)


#: (backend, page size, dtype, pick) of the background test: it compares with steps that may run
#: eagerly or replay while the capture goes on, so the runner-up (which depends on rounding)
#: is taken in float32 only; FlashAttention computes in bf16, where the test takes the argmax.
BACKGROUND_CASES: Final = (
    ("gather", 16, torch.float32, runner_up),
    ("split_decode", 16, torch.float32, runner_up),
    ("flex", 64, torch.bfloat16, greedy),
    ("varlen", 16, torch.bfloat16, greedy),
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "page_size", "dtype", "pick"), BACKGROUND_CASES, ids=[case[0] for case in BACKGROUND_CASES]
)
def test_gpu_during_a_background_capture_run_loop_loops_on_the_host(
    backend: str, page_size: int, dtype: torch.dtype, pick: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    model = _gpu_model(backend, page_size, seed=11, dtype=dtype)
    advance = PagedAdvance(model, None, GPU_MAX_LEN, sample=pick)
    manager = loop_manager(
        model, advance, CUDAGraphMode.FULL_AND_PIECEWISE, sizes=GPU_SIZES, max_steps=GPU_MAX_STEPS
    )
    session = manager.start_capture()
    kinds: set[LoopKind | None] = set()
    try:
        for num_reqs in (*GPU_BATCHES, *GPU_BATCHES):
            batch = _gpu_batch(model, num_reqs, seed=num_reqs)
            result, expected = run_loop_and_reference(manager, advance, batch, max_steps=GPU_MAX_STEPS)
            kinds.add(result.kind)
            assert torch.equal(result.tokens.cpu(), expected), (num_reqs, result.tokens, expected)
    finally:
        session.wait()
    assert kinds == {None}  # a background capture captures one-step graphs, no loops
    with torch.no_grad():
        manager.capture(progress=False)  # the loops now
    batch = _gpu_batch(model, 13, seed=13)
    result, expected = run_loop_and_reference(manager, advance, batch, max_steps=GPU_MAX_STEPS)
    assert result.kind is LoopKind.WHILE
    assert torch.equal(result.tokens.cpu(), expected)
