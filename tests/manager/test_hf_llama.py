"""A Hugging Face Llama (small config, random weights) compiled, captured and decoded greedily.

The model runs one sequence over a ``StaticCache``: a step is a chunk of
``T`` tokens at positions ``cache_position`` (the prompt, then one token per
decode step), so the manager's token rows are the chunk's positions. Its
step is compiled with ``compile_for_capture`` (inductor, the token count
symbolic) and captured FULL for sizes 1 to 16 by ``CUDAGraphManager``; the
greedy tokens of 32 decode steps must equal those of the same compiled step
run directly, token for token, and the prompt's logits those of the plain model.

Only steps of a captured size run: transformers 5's ``StaticCache`` writes at
its own counter (``cumulative_length``), not at ``cache_position``, so padding
rows would move every later token. That counter also advances during the
capture (a warm-up and a replay per size), hence ``cache.reset()`` before
decoding, and a cache long enough for the capture's writes. Works with
transformers 4.4x (``max_batch_size`` in the constructor, writes at
``cache_position``) and 5.x (lazily allocated layers: ``early_initialization``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Final, Protocol, cast

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, StaticInput, compile_for_capture
from cudagraph_manager._compiled import dynamo_compiles
from tests.torch_support import highest_fp32_matmul_precision, rel_err

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # transformers' import-time deprecation notes are not this test's
    transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    # transformers' and inductor's advice (deprecations, TF32) is not what these tests check.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

VOCAB: Final = 1024
SIZES: Final = CaptureSizes([1, 2, 4, 8, 16])
PROMPT: Final = 16  # a captured size: the prompt runs unpadded
DECODE_STEPS: Final = 32
#: Capturing writes 2 x size tokens per size (warm-up, replay); the decode writes PROMPT + DECODE_STEPS.
MAX_CACHE_LEN: Final = 128
#: As for the reference decoder: one graph for 2+ tokens (symbolic), one for 1 token (specialized).
EXPECTED_COMPILES: Final = 2
INPUTS: Final = {
    "input_ids": StaticInput(dtype=torch.int64),
    "positions": StaticInput(dtype=torch.int64),
}


class _Cache(Protocol):
    def reset(self) -> None: ...


class _Output(Protocol):
    logits: torch.Tensor


class LlamaStep:
    """One step of a single sequence: ``input_ids [T]`` at ``positions [T]`` -> logits ``[T, vocab]``."""

    def __init__(self, model: torch.nn.Module, cache: _Cache) -> None:
        self.model: Final = model
        self.cache: Final = cache

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = cast(
            _Output,
            self.model(
                input_ids=input_ids[None],  # [1, T]
                position_ids=positions[None],  # [1, T]
                cache_position=positions,  # [T]
                past_key_values=self.cache,
                use_cache=True,
            ),
        )
        return out.logits[0]  # [T, vocab]


def _llama(device: torch.device) -> tuple[torch.nn.Module, _Cache]:
    """A 2-layer Llama with random weights (grouped-query attention) and its static cache."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_CACHE_LEN,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = cast(torch.nn.Module, transformers.LlamaForCausalLM(config)).to(device).eval()
    head_dim = config.hidden_size // config.num_attention_heads
    # 4.4x: StaticCache(config, max_batch_size, max_cache_len, device, dtype); 5.x: (config, max_cache_len).
    wanted: dict[str, object] = {
        "config": config,
        "max_cache_len": MAX_CACHE_LEN,
        "max_batch_size": 1,
        "device": device,
        "dtype": torch.float32,
    }
    accepted = inspect.signature(transformers.StaticCache.__init__).parameters
    cache = transformers.StaticCache(**{name: value for name, value in wanted.items() if name in accepted})
    early = getattr(cache, "early_initialization", None)
    if early is not None:  # 5.x allocates its layers on the first write, else
        early(
            batch_size=1,
            num_heads=config.num_key_value_heads,
            head_dim=head_dim,
            dtype=torch.float32,
            device=device,
        )
    return model, cast(_Cache, cache)


def _decode(
    step: Callable[..., torch.Tensor], prompt: torch.Tensor, device: torch.device
) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding: the prompt in one step, then ``DECODE_STEPS`` steps of one token.

    ``step(input_ids=..., positions=...)`` returns the step's logits. Returns
    the generated tokens and the prompt's logits ``[PROMPT, vocab]`` (a copy).
    """
    with torch.no_grad():
        logits = step(input_ids=prompt, positions=torch.arange(PROMPT, device=device))
        prompt_logits = logits.clone()
        token = logits[-1].argmax()
        tokens = [int(token)]
        for i in range(DECODE_STEPS):
            position = torch.tensor([PROMPT + i], device=device)
            logits = step(input_ids=token.reshape(1), positions=position)
            token = logits[-1].argmax()
            tokens.append(int(token))
    return tokens, prompt_logits


def test_compiled_llama_captured_decodes_like_the_compiled_model_run_directly() -> None:
    pytest.importorskip("triton")
    assert 2 * sum(SIZES.sizes) <= MAX_CACHE_LEN
    assert PROMPT + DECODE_STEPS <= MAX_CACHE_LEN
    device = torch.device("cuda", torch.cuda.current_device())
    with highest_fp32_matmul_precision():
        model, cache = _llama(device)
        step = LlamaStep(model, cache)
        compiled = compile_for_capture(step, INPUTS)
        config = DispatchConfig(CUDAGraphMode.FULL, SIZES, max_num_seqs=SIZES.max)
        manager = CUDAGraphManager(compiled, INPUTS, config, device=device, strict=True)
        before = dynamo_compiles() or 0
        report = manager.capture()
        assert report.compiles == EXPECTED_COMPILES
        assert report.num_graphs == len(SIZES)
        assert (dynamo_compiles() or 0) - before == EXPECTED_COMPILES
        prompt = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).to(device)

        cache.reset()  # the capture wrote into the cache (and moved 5.x's counter)
        replayed, replayed_logits = _decode(manager.run, prompt, device)
        stats = manager.stats
        assert stats.replays == {(CUDAGraphMode.FULL, PROMPT): 1, (CUDAGraphMode.FULL, 1): DECODE_STEPS}

        cache.reset()
        direct, direct_logits = _decode(compiled, prompt, device)
        assert (dynamo_compiles() or 0) - before == EXPECTED_COMPILES  # nothing new compiled

        cache.reset()
        _, eager_logits = _decode(step, prompt, device)

    assert replayed == direct, "greedy tokens of the captured model differ from the compiled model's"
    assert rel_err(replayed_logits, direct_logits) < 1e-4
    assert rel_err(replayed_logits, eager_logits) < 1e-4
    assert len(set(replayed)) > 1, "a constant sequence would not show a wrong cache"
    assert int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]) == 0
