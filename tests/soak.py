"""Soak: many random decoder steps through ``CUDAGraphManager``, checked against eager.

``python -m tests.soak`` (what ``make soak`` runs; not a pytest module, and not
part of ``make test``). One process, one reference decoder, three managers
over it, one per mode: ``FULL``, ``PIECEWISE`` and ``FULL_AND_PIECEWISE``,
each capturing every graph of its plan into the one shared pool of the
device. Then ``--steps`` steps (default 100,000), each drawn at random from a
seeded stream:

- the manager (so the modes interleave and replay from the same pool);
- the batch: a uniform decode step (one token per request) or a mixed one
  (a prefill chunk and more), of a size that is a capture size, one that
  pads, or one above the largest capture size (runs eagerly); 1 % are idle
  steps of 0 tokens;
- ``num_active_loras`` in 0..5 with LoRA keys captured for 1 and 4 adapters
  (``lora_counts=(1, 4)``): 2 and 3 route to the 4-adapter graphs, 5 runs
  eagerly. The reference decoder ignores LoRA; the routing is what is checked;
- ``invalid_modes``: a random subset of ``{PIECEWISE, FULL}``.

What is checked:

- Routing, every step: the dispatcher's decision equals the one the contract
  (docs/design.md, "Dispatch") prescribes for the mode, size, LoRA count and invalid
  modes, written out independently here (``expected_dispatch``); at the end
  each manager's ``stats`` (replays per mode and size, eager steps per
  reason, idle steps, padded tokens) equal the tally of those decisions, so
  the manager did run each step the way its dispatcher decided.
- Outputs, every step: the shape, dtype and device (host metadata), and two
  reductions taken on the device without a sync: a float64 checksum (the sum
  of the output: finite iff no element is NaN or infinite, whatever its
  magnitude) and the smallest and largest row norm. The decoder ends with an
  RMSNorm of unit weight, so every real row has ``||row||^2 / hidden = 1``
  up to rounding: a row left zero, filled with padding garbage or overflowed
  fails the bound ``|norm^2 / hidden - 1| <= tolerance``. These reductions
  are read back once per chunk of steps, not per step.
- Outputs against eager, on a fixed seeded sample of ``--sample`` of the
  steps (default 5 %, drawn among the non-idle steps, so at least that
  share of all steps is compared): the graph's output is cloned, then the
  model runs eagerly on the same unpadded inputs (writing K/V is
  idempotent: both see the same cache, as in the demo), and the relative
  error ``||graph - eager|| / ||eager||`` and the checksum difference
  ``|sum(graph) - sum(eager)| / sum(|eager|)`` must both be within the
  tolerance of the dtype (bf16: 3e-2, the tests' and the demo's).

Why a sample, and what the checksum is for: an eager step costs several
graph steps, so eager for all 100,000 would dominate the run, while a
seeded sample spread over the whole run still meets every kind of step
(mode, size, LoRA case, invalid modes) many times, early and late. The
steps outside the sample are still validated, by what needs no reference:
shape, finiteness (the checksum) and the row norms. The relative error is
the real comparison: the checksum of a normalized output is a weak
fingerprint (a fault that replayed stale token ids gave relative errors of
1.4 but checksum differences of 1e-3 to 1e-2, under the tolerance); it is
compared too, and kept for finiteness. Not caught by design: a graph that
writes into another request's KV cache rows, since the eager reference
reads the same cache.

- Memory: after capture, ``prime`` runs the model eagerly once at every
  batch size of both kinds (cuBLAS picks, and CUDA lazily loads, kernels
  per new shape: without it the resident set grew by about 70-150 MiB over
  the first few thousand steps on an H100, then stayed flat to the byte),
  then ``--warmup`` steps (default a tenth of the run, up to 1,000) run
  before the baseline. ``torch.cuda.memory_allocated`` at the end must lie
  within 1 MiB of the baseline, and the process's resident set
  (``VmRSS``) within 50 MiB. Both are also sampled after every 1,000
  steps (``memory.series`` in the JSON).

Model: on CUDA a bf16 reference decoder of 2 layers, d=512 (8 heads of 64,
ffn 1408, vocab 4096, KV cache for 160 requests of 128 positions), capture
sizes ``CaptureSizes.default(128)`` (19 sizes), 3 LoRA cases (0, 1, 4
adapters): 57 graphs for FULL, 57 for PIECEWISE, 114 for
FULL_AND_PIECEWISE (its uniform decode keys besides), 228 in all; decode
batches of up to 160 requests and mixed batches of up to 192 tokens, so
some run above the largest capture size. On an H100 100,000 steps with the
eager references take about 3 minutes (under 2 ms a step: the host side of
drawing inputs, dispatching and checking dominates), capture a few
seconds. On the CPU (``--device cpu``, or no CUDA) a float32 model of 2
layers, d=128, and sizes up to 32: the managers capture nothing (their
reports say why) and run every step eagerly on their padded static
buffers, through the same checks.

It prints one line per manager's capture, then a one-line summary, writes
the details as JSON (``--out``, default ``.benchmarks/soak.json``) and exits
1 on any mismatch (routing, outputs, accounting), a memory or RSS limit
breached, or a crash.

Without CUDA nothing replays, so there is no soak: it says so first and in
its summary ("soak REPLAYED NOTHING"; in the JSON ``"ok": false``,
``"status": "nothing replayed"`` with its ``"why"``, ``"replays": 0``, and
``"eager_path_ok"`` for the checks that did run), runs
500 steps by default (seconds, not minutes) through the same checks of the
eager path, and exits 3 where the default device had no CUDA (``make soak``
on a machine without a GPU); ``--device cpu``, asked for by name, exits 0
when those checks pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import random
import resource
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NamedTuple

import torch

from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
    EagerReason,
)
from cudagraph_manager import CaptureReport, CUDAGraphManager
from examples.config import DecoderConfig
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs

_NONE: Final = CUDAGraphMode.NONE
_FULL: Final = CUDAGraphMode.FULL
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
#: One manager per mode, over the same model and pool; steps pick one at random.
MODES: Final = (_FULL, _PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
#: Steps of a soak on CUDA, and where nothing replays (no CUDA: a quick check of the harness only).
STEPS_CUDA: Final = 100_000
STEPS_WITHOUT_CUDA: Final = 500
#: The exit status of a soak that replayed nothing because the default device had no CUDA.
NOTHING_REPLAYED: Final = 3
#: Active-adapter counts captured besides 0; a step draws 0..5 (5: above them, eager).
LORA_COUNTS: Final = (1, 4)
_LORA_CHOICES: Final = (0, 1, 2, 3, 4, 5)
_LORA_WEIGHTS: Final = (40, 20, 15, 10, 10, 5)
_INVALID_CHOICES: Final = (
    frozenset[CUDAGraphMode](),
    frozenset({_FULL}),
    frozenset({_PIECEWISE}),
    frozenset({_FULL, _PIECEWISE}),
)
_INVALID_WEIGHTS: Final = (70, 15, 10, 5)
_IDLE_SHARE: Final = 0.01  # steps of 0 tokens
_UNIFORM_SHARE: Final = 0.5  # uniform decode steps among the others
_EXACT_SHARE: Final = 0.2  # sizes drawn from the capture sizes (no padding)
_ABOVE_SHARE: Final = 0.1  # sizes above the largest capture size (eager)
# As in the demo and the tests: a real bug (a stale input, a padding row
# leaking into a request) gives errors of order 1, rounding far less.
_TOLERANCE: Final[dict[torch.dtype, float]] = {
    torch.bfloat16: 3e-2,
    torch.float16: 1e-2,
    torch.float32: 1e-4,
}
MEMORY_LIMIT: Final = 1 << 20  # bytes of memory_allocated drift allowed after warm-up
RSS_LIMIT: Final = 50 << 20  # bytes of resident set growth allowed after warm-up
_CHECK_EVERY: Final = 1000  # steps between reading the device-side checks back
_PROGRESS_EVERY: Final = 10_000
_MAX_FAILURES_KEPT: Final = 20


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    """The model and the batch sizes of a soak on one kind of device."""

    decoder: DecoderConfig
    capture_sizes: CaptureSizes
    max_mixed_tokens: int  # mixed batches up to this many tokens; decode up to max_num_seqs requests
    tolerance: float

    def describe(self) -> str:
        d = self.decoder
        return (
            f"{d.num_layers} layers, d={d.hidden_size}, {d.num_heads} heads, ffn {d.intermediate_size}, "
            f"vocab {d.vocab_size}, {str(d.dtype).removeprefix('torch.')}, KV cache {d.max_num_seqs}+1 x "
            f"{d.max_seq_len}; capture sizes up to {self.capture_sizes.max} ({len(self.capture_sizes.sizes)})"
        )


def setup_for(device: torch.device) -> Setup:
    """The soak's model: bf16 2 layers d=512 on CUDA, float32 2 layers d=128 elsewhere."""
    if device.type == "cuda":
        decoder = DecoderConfig(
            num_layers=2,
            hidden_size=512,
            num_heads=8,
            intermediate_size=1408,
            vocab_size=4096,
            max_num_seqs=160,
            max_seq_len=128,
            dtype=torch.bfloat16,
        )
        sizes, max_mixed = CaptureSizes.default(128), 192
    else:
        decoder = dataclasses.replace(DecoderConfig.small(), max_num_seqs=40, max_seq_len=64)
        sizes, max_mixed = CaptureSizes.default(32), 48
    # Decode batches above the largest capture size need more requests than it.
    assert sizes.max < decoder.max_num_seqs
    return Setup(decoder, sizes, max_mixed, _TOLERANCE[decoder.dtype])


class StepPlan(NamedTuple):
    """One step of the soak, drawn before the run."""

    manager: int  # index into MODES
    num_tokens: int
    uniform: bool
    num_active_loras: int
    invalid_modes: frozenset[CUDAGraphMode]


def draw_plans(setup: Setup, steps: int, sample: float, seed: int) -> tuple[list[StepPlan], bytearray]:
    """``steps`` plans from a stream seeded with ``seed``, and the mask of the sampled steps.

    The sample is ``ceil(sample * steps)`` steps (or every non-idle step when
    fewer), drawn among the non-idle steps from a stream of its own.
    """
    rng = random.Random(seed)
    sizes, max_decode = setup.capture_sizes, setup.decoder.max_num_seqs
    plans: list[StepPlan] = []
    for _ in range(steps):
        manager = rng.randrange(len(MODES))
        loras = rng.choices(_LORA_CHOICES, _LORA_WEIGHTS)[0]
        invalid = rng.choices(_INVALID_CHOICES, _INVALID_WEIGHTS)[0]
        if rng.random() < _IDLE_SHARE:  # no request, so no adapter
            plans.append(StepPlan(manager, 0, False, 0, invalid))
            continue
        uniform = rng.random() < _UNIFORM_SHARE
        limit = max_decode if uniform else setup.max_mixed_tokens
        draw = rng.random()
        if draw < _EXACT_SHARE:
            num_tokens = rng.choice(sizes.sizes)
        elif draw < 1.0 - _ABOVE_SHARE:
            num_tokens = rng.randint(1, sizes.max)
        else:
            num_tokens = rng.randint(sizes.max + 1, limit)
        # A request runs one adapter and has a token: no more adapters than tokens (the dispatcher refuses).
        plans.append(StepPlan(manager, num_tokens, uniform, min(loras, num_tokens), invalid))
    busy = [i for i, plan in enumerate(plans) if plan.num_tokens]
    chosen = random.Random(seed + 1).sample(busy, min(len(busy), math.ceil(sample * steps)))
    mask = bytearray(steps)
    for i in chosen:
        mask[i] = 1
    return plans, mask


def expected_dispatch(mode: CUDAGraphMode, plan: StepPlan, setup: Setup) -> Dispatch:
    """The decision docs/design.md ("Dispatch") prescribes for ``plan`` under ``mode``, on its own.

    Keys: FULL has exact mixed keys ``(s, num_reqs=min(s, max_num_seqs))``
    for every batch; PIECEWISE relaxed keys ``(s)``; FULL_AND_PIECEWISE
    uniform keys ``(s, num_reqs=s, uniform)`` for decode batches and relaxed
    PIECEWISE keys for the rest (and for decode batches when FULL is
    invalid). ``s`` is the smallest capture size >= num_tokens (every
    capture size is a decode size here: all are <= max_num_seqs); LoRA the
    smallest captured count >= the active one. Anything else: NONE, unpadded.
    """
    num_tokens, loras, invalid = plan.num_tokens, plan.num_active_loras, plan.invalid_modes
    eager = Dispatch(_NONE, BatchDescriptor(num_tokens))
    padded = setup.capture_sizes.pad(num_tokens) if num_tokens else None
    lora_case = next((n for n in (0, *LORA_COUNTS) if n >= loras), None)
    if padded is None or lora_case is None:
        return eager
    has_lora = lora_case > 0
    candidates: list[Dispatch] = []
    if mode is CUDAGraphMode.FULL_AND_PIECEWISE and plan.uniform:
        candidates.append(Dispatch(_FULL, BatchDescriptor(padded, padded, True, has_lora, lora_case)))
    if mode is _FULL:
        num_reqs = min(padded, setup.decoder.max_num_seqs)
        candidates.append(Dispatch(_FULL, BatchDescriptor(padded, num_reqs, False, has_lora, lora_case)))
    else:
        candidates.append(Dispatch(_PIECEWISE, BatchDescriptor(padded, None, False, has_lora, lora_case)))
    return next((d for d in candidates if d.mode not in invalid), eager)


def expected_eager_reason(plan: StepPlan, setup: Setup) -> EagerReason:
    """Why a step the contract runs without a graph does so (the order ``stats`` uses)."""
    if plan.num_tokens > setup.capture_sizes.max:
        return EagerReason.ABOVE_LARGEST_SIZE
    if plan.num_active_loras > max(LORA_COUNTS):
        return EagerReason.LORA_COUNT
    return EagerReason.INVALID_MODES  # every other step of these modes has a key, unless turned off


@dataclasses.dataclass
class Tally:
    """What one manager's ``stats`` should say at the end, from the expected decisions."""

    replays: Counter[tuple[str, int]] = dataclasses.field(default_factory=Counter)
    eager_reasons: Counter[str] = dataclasses.field(default_factory=Counter)
    idle_steps: int = 0
    padded_tokens: int = 0
    steps: int = 0

    def as_json(self) -> dict[str, object]:
        return {
            "replays": {f"{mode}:{size}": n for (mode, size), n in sorted(self.replays.items())},
            "eager_reasons": dict(sorted(self.eager_reasons.items())),
            "idle_steps": self.idle_steps,
            "padded_tokens": self.padded_tokens,
        }


def stats_as_json(manager: CUDAGraphManager[torch.Tensor]) -> dict[str, object]:
    """A manager's ``stats`` in ``Tally.as_json``'s form."""
    stats = manager.stats
    return {
        "replays": {
            f"{mode.name}:{size}": n
            for (mode, size), n in sorted(stats.replays.items(), key=lambda kv: (kv[0][0].name, kv[0][1]))
            if n
        },
        "eager_reasons": {reason: n for reason, n in sorted(stats.eager_reasons.items()) if n},
        "idle_steps": stats.idle_steps,
        "padded_tokens": stats.padded_tokens,
    }


def rss_bytes() -> int:
    """The process's resident set now (``VmRSS``); the peak (``ru_maxrss``) where /proc is missing."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):+.2f} MiB"


class Soak:
    """The run: managers, device-side check buffers, tallies and findings."""

    def __init__(
        self, setup: Setup, device: torch.device, plans: list[StepPlan], sampled: bytearray, seed: int
    ) -> None:
        self.setup: Final = setup
        self.device: Final = device
        self.plans: Final = plans
        self.sampled: Final = sampled
        torch.manual_seed(seed)
        self.model: Final = ReferenceDecoder(setup.decoder, device=device)
        self.managers: Final = [
            CUDAGraphManager(
                self.model.forward,
                static_inputs(setup.decoder),
                DispatchConfig(
                    mode,
                    setup.capture_sizes,
                    max_num_seqs=setup.decoder.max_num_seqs,
                    lora_counts=LORA_COUNTS,
                ),
                device=device,
            )
            for mode in MODES
        ]
        self.generator: Final = torch.Generator().manual_seed(seed)
        self.empty_inputs: Final = {
            name: torch.empty(0, dtype=torch.int64, device=device) for name in static_inputs(setup.decoder)
        }
        # Device-side results of every step, read back once per chunk: no sync per step.
        steps = len(plans)
        nan = math.nan
        # One element per step, and a scratch one for ``prime``.
        self.scratch: Final = steps
        steps += 1
        self.checksum: Final = torch.full((steps,), nan, dtype=torch.float64, device=device)
        self.norm_min: Final = torch.full((steps,), nan, dtype=torch.float32, device=device)
        self.norm_max: Final = torch.full((steps,), nan, dtype=torch.float32, device=device)
        self.rel_err: Final = torch.full((steps,), nan, dtype=torch.float64, device=device)
        self.checksum_err: Final = torch.full((steps,), nan, dtype=torch.float64, device=device)
        self.tallies: Final = [Tally() for _ in MODES]
        self.checked_at = 0  # steps before this one were read back and checked
        self.checked = 0  # steps compared with eager
        self.bitwise_equal = 0  # of those, how many matched eager exactly
        self.mismatches = 0  # steps with any problem
        self.failures: list[dict[str, object]] = []  # the first few, with what went wrong
        self.last_failed = -1
        self.worst_rel_err = 0.0
        self.worst_checksum_err = 0.0
        self.worst_norm_dev = 0.0

    # -- capture --

    def capture(self) -> list[CaptureReport]:
        reports = [manager.capture(progress=False) for manager in self.managers]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return reports

    def prime(self, seed: int) -> None:
        """Run the model once eagerly at every batch size and kind, with the output checks.

        Part of the warm-up: the first eager step of a size makes cuBLAS pick
        (and CUDA load, lazily) kernels, which grows host memory for a while;
        going through every size first lets the resident set settle before
        the memory baseline. Its own random stream: the steps stay the same.
        """
        generator = torch.Generator().manual_seed(seed)
        decoder = self.setup.decoder
        for uniform, limit in ((True, decoder.max_num_seqs), (False, self.setup.max_mixed_tokens)):
            for num_tokens in range(1, limit + 1):
                inputs = make_step_inputs(
                    decoder, num_tokens, uniform_decode=uniform, generator=generator, device=self.device
                )
                self._record(self.scratch, self.model.step(inputs), inputs)

    # -- steps --

    def step(self, i: int) -> None:
        """Step ``i``: check its routing, run it, queue its output checks on the device."""
        plan = self.plans[i]
        mode = MODES[plan.manager]
        manager = self.managers[plan.manager]
        decision = manager.dispatcher.dispatch(
            plan.num_tokens,
            uniform_decode=plan.uniform,
            num_active_loras=plan.num_active_loras,
            invalid_modes=plan.invalid_modes,
        )
        expected = expected_dispatch(mode, plan, self.setup)
        if decision != expected:
            self._fail(i, f"dispatched {decision}, expected {expected}")
        self._count(plan, expected)
        if plan.num_tokens == 0:
            inputs = self.empty_inputs
        else:
            inputs = make_step_inputs(
                self.setup.decoder,
                plan.num_tokens,
                uniform_decode=plan.uniform,
                generator=self.generator,
                device=self.device,
            )
        out = manager.run_batch(
            inputs,
            uniform_decode=plan.uniform,
            num_active_loras=plan.num_active_loras,
            invalid_modes=plan.invalid_modes,
        )  # [T, hidden]
        shape = (plan.num_tokens, self.setup.decoder.hidden_size)
        if tuple(out.shape) != shape or out.dtype != self.setup.decoder.dtype or out.device != self.device:
            self._fail(i, f"output {tuple(out.shape)} {out.dtype} on {out.device}, expected {shape}")
            return
        if plan.num_tokens == 0:
            return
        self._record(i, out, inputs if self.sampled[i] else None)

    def _record(self, i: int, out: torch.Tensor, inputs: dict[str, torch.Tensor] | None) -> None:
        """Queue the checks of output ``out [T, hidden]`` at index ``i``; with ``inputs``, vs eager too."""
        # Every step, on the device: the checksum and the row norms' range.
        torch.sum(out, dim=(0, 1), dtype=torch.float64, out=self.checksum[i])
        norms = torch.linalg.vector_norm(out, dim=-1, dtype=torch.float32)  # [T]
        torch.amin(norms, dim=0, out=self.norm_min[i])
        torch.amax(norms, dim=0, out=self.norm_max[i])
        if inputs is not None:
            # The graph first, cloned, then eager on the same inputs (see the docstring).
            graph_out = out.clone().float()  # [T, hidden]
            eager = self.model.step(inputs).float()  # [T, hidden]
            self.rel_err[i] = torch.linalg.vector_norm(graph_out - eager) / torch.linalg.vector_norm(
                eager
            ).clamp_min(1e-30)
            eager_sum = eager.sum(dtype=torch.float64)
            self.checksum_err[i] = (self.checksum[i] - eager_sum).abs() / eager.abs().sum(
                dtype=torch.float64
            ).clamp_min(1e-30)

    def _count(self, plan: StepPlan, expected: Dispatch) -> None:
        """Add the step to its manager's tally, as the contract says the manager will count it."""
        tally = self.tallies[plan.manager]
        tally.steps += 1
        if plan.num_tokens == 0:
            tally.idle_steps += 1
            return
        mode, key = expected
        if mode is _NONE:
            tally.eager_reasons[expected_eager_reason(plan, self.setup).value] += 1
            return
        tally.padded_tokens += key.num_tokens - plan.num_tokens
        if self.device.type == "cuda":
            tally.replays[(mode.name, key.num_tokens)] += 1
        else:  # no graphs: the step runs eagerly on the padded buffers
            tally.eager_reasons[EagerReason.NO_CUDA.value] += 1

    # -- checks --

    def check_pending(self, end: int) -> None:
        """Read back the device-side results of steps ``[checked_at, end)`` and check them (syncs)."""
        start = self.checked_at
        if end <= start:
            return
        checksum = self.checksum[start:end].tolist()
        norm_min = self.norm_min[start:end].tolist()
        norm_max = self.norm_max[start:end].tolist()
        rel_err = self.rel_err[start:end].tolist()
        checksum_err = self.checksum_err[start:end].tolist()
        tol, hidden = self.setup.tolerance, self.setup.decoder.hidden_size
        for j in range(end - start):
            i = start + j
            if self.plans[i].num_tokens == 0:
                continue
            problems: list[str] = []
            if not math.isfinite(checksum[j]):
                problems.append(f"non-finite output (checksum {checksum[j]})")
            deviation = max(abs(norm_min[j] ** 2 / hidden - 1.0), abs(norm_max[j] ** 2 / hidden - 1.0))
            if not deviation <= tol:  # NaN fails too
                problems.append(f"row RMS off 1 by {deviation:.3g}")
            else:
                self.worst_norm_dev = max(self.worst_norm_dev, deviation)
            if self.sampled[i]:
                self.checked += 1
                if not (rel_err[j] <= tol and checksum_err[j] <= tol):
                    problems.append(
                        f"vs eager: relative error {rel_err[j]:.3g}, checksum error {checksum_err[j]:.3g}"
                    )
                else:
                    self.bitwise_equal += rel_err[j] == 0.0
                    self.worst_rel_err = max(self.worst_rel_err, rel_err[j])
                    self.worst_checksum_err = max(self.worst_checksum_err, checksum_err[j])
            if problems:
                self._fail(i, "; ".join(problems))
        self.checked_at = end

    def _fail(self, i: int, what: str) -> None:
        """Record a problem of step ``i`` (a step with several problems counts once)."""
        if self.last_failed == i:
            if self.failures and self.failures[-1]["step"] == i:
                self.failures[-1]["what"] = f"{self.failures[-1]['what']}; {what}"
            return
        self.last_failed = i
        self.mismatches += 1
        if len(self.failures) < _MAX_FAILURES_KEPT:
            plan = self.plans[i]
            self.failures.append(
                {
                    "step": i,
                    "mode": MODES[plan.manager].name,
                    "num_tokens": plan.num_tokens,
                    "uniform": plan.uniform,
                    "num_active_loras": plan.num_active_loras,
                    "invalid_modes": sorted(m.name for m in plan.invalid_modes),
                    "sampled": bool(self.sampled[i]),
                    "what": what,
                }
            )
        elif self.mismatches == _MAX_FAILURES_KEPT + 1:
            print(
                f"soak: more than {_MAX_FAILURES_KEPT} failing steps; the JSON keeps the first",
                file=sys.stderr,
            )

    def accounting(self) -> list[str]:
        """Each manager's ``stats`` against its tally: the differences, in words."""
        problems = []
        for mode, manager, tally in zip(MODES, self.managers, self.tallies, strict=True):
            actual, expected = stats_as_json(manager), tally.as_json()
            for field, value in expected.items():
                if actual[field] != value:
                    problems.append(f"{mode.name} manager: stats.{field} {actual[field]} != expected {value}")
        return problems


class Memory(NamedTuple):
    allocated: int | None  # torch.cuda.memory_allocated (None off CUDA)
    rss: int


def measure(device: torch.device) -> Memory:
    """Device memory in use and the resident set, with no step's temporaries alive (syncs)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return Memory(torch.cuda.memory_allocated(device), rss_bytes())
    return Memory(None, rss_bytes())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak",
        description="Soak the manager: random reference-decoder steps in every mode, checked against eager.",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps (default {STEPS_CUDA} on CUDA; {STEPS_WITHOUT_CUDA} elsewhere, where nothing replays)",
    )
    parser.add_argument(
        "--sample", type=float, default=0.05, help="share of steps compared with eager (default 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the plans, inputs and weights")
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--out", default=".benchmarks/soak.json", help="the JSON report's path")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps before the memory baseline (default min(1000, steps/10))",
    )
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if not 0.0 <= args.sample <= 1.0:
        parser.error("--sample must lie in [0, 1]")
    if args.warmup is not None and args.steps is not None and not 0 <= args.warmup < args.steps:
        parser.error("--warmup must lie in [0, steps)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; 0 when every check passed, 1 otherwise."""
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        device = resolve_device(args.device)  # None: the current CUDA device, else the CPU
    except ValueError as error:
        print(f"soak: {error}", file=sys.stderr)
        return 2
    graphs = device.type == "cuda"  # elsewhere the managers capture nothing: every step runs eagerly
    if args.steps is None:
        args.steps = STEPS_CUDA if graphs else STEPS_WITHOUT_CUDA
    if args.warmup is not None and not args.warmup < args.steps:
        print(f"soak: --warmup must lie in [0, steps={args.steps})", file=sys.stderr)
        return 2
    if not graphs:
        print(
            f"soak: no CUDA device ({device}): NOTHING WILL BE REPLAYED. The managers capture no graph and "
            f"run every step eagerly; this checks the harness, the routing and the eager path only, "
            f"{args.steps} steps. Run it on a GPU for the soak itself.",
            file=sys.stderr,
        )
    setup = setup_for(device)
    warmup = min(1000, args.steps // 10) if args.warmup is None else args.warmup
    plans, sampled = draw_plans(setup, args.steps, args.sample, args.seed)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"soak: {args.steps} steps on {device} ({where}), torch {torch.__version__}; "
        f"model: {setup.describe()}"
    )

    soak = Soak(setup, device, plans, sampled, args.seed)
    reports = soak.capture()
    capture_seconds = time.perf_counter() - started
    for mode, report in zip(MODES, reports, strict=True):
        line = str(report).splitlines()[0]
        print(f"soak: {mode.name} manager: {line}")
    problems: list[str] = []
    if device.type == "cuda":
        for mode, manager in zip(MODES, soak.managers, strict=True):
            planned = sum(len(keys) for _, keys in manager.dispatcher.capture_plan())
            if manager.num_captured != planned:
                problems.append(f"{mode.name} manager captured {manager.num_captured} of {planned} graphs")

    after_capture = measure(device)
    prime_started = time.perf_counter()
    with torch.no_grad():
        soak.prime(args.seed + 2)
    prime_seconds = time.perf_counter() - prime_started
    baseline = after_capture
    peak_drift = 0
    peak_rss_drift = 0
    series: list[list[int | None]] = []  # [step, memory_allocated, RSS] after every chunk of steps
    crash: str | None = None
    run_started = time.perf_counter()
    i = 0
    try:
        with torch.no_grad():
            for i in range(args.steps):
                if i == warmup:
                    soak.check_pending(i)
                    baseline = measure(device)
                soak.step(i)
                if (i + 1) % _CHECK_EVERY == 0:
                    soak.check_pending(i + 1)
                    now = measure(device)
                    series.append([i + 1, now.allocated, now.rss])
                    if i >= warmup:
                        if now.allocated is not None and baseline.allocated is not None:
                            peak_drift = max(peak_drift, abs(now.allocated - baseline.allocated))
                        peak_rss_drift = max(peak_rss_drift, now.rss - baseline.rss)
                if (i + 1) % _PROGRESS_EVERY == 0:
                    print(
                        f"soak: {i + 1} steps, {soak.mismatches} mismatches, "
                        f"{time.perf_counter() - run_started:.1f} s",
                        file=sys.stderr,
                    )
            soak.check_pending(args.steps)
    except Exception as error:  # a crash is a finding: report it with everything counted so far
        crash = f"step {i}: {type(error).__name__}: {error}"
        problems.append(f"crashed at {crash}")
    run_seconds = time.perf_counter() - run_started
    end = measure(device) if crash is None else Memory(None, rss_bytes())

    memory_delta = (
        None if end.allocated is None or baseline.allocated is None else end.allocated - baseline.allocated
    )
    rss_delta = end.rss - baseline.rss
    if memory_delta is not None and abs(memory_delta) > MEMORY_LIMIT:
        problems.append(f"memory_allocated moved {_mib(memory_delta)} after warm-up (limit 1 MiB)")
    if rss_delta > RSS_LIMIT:
        problems.append(f"RSS grew {_mib(rss_delta)} after warm-up (limit 50 MiB)")
    if crash is None:
        problems.extend(soak.accounting())
    if soak.mismatches:
        problems.append(f"{soak.mismatches} steps failed their checks (first: {soak.failures[0]})")
    wall = time.perf_counter() - started

    per_mode = Counter(MODES[p.manager].name for p in plans)
    runtime: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for manager in soak.managers:
        stats = manager.stats
        runtime["FULL"] += stats.replays_of(_FULL)
        runtime["PIECEWISE"] += stats.replays_of(_PIECEWISE)
        runtime["eager"] += stats.eager_steps
        runtime["idle"] += stats.idle_steps
        reasons.update(stats.eager_reasons)
    ok = not problems
    replays = runtime["FULL"] + runtime["PIECEWISE"]
    summary: dict[str, object] = {
        # A soak that replayed no graph is no soak: "ok" only when graphs replayed and every check
        # passed; "status" says which, and "eager_path_ok" what the checks of the eager path found.
        "ok": ok and graphs,
        "status": _status(ok, graphs),
        "why": None if graphs else "no CUDA graphs were captured on this device: nothing was replayed",
        "eager_path_ok": ok,
        "replays": replays,
        "graphs": graphs,
        "problems": problems,
        "steps": args.steps,
        "steps_run": i if crash is not None else args.steps,
        "seed": args.seed,
        "sample": args.sample,
        "warmup_steps": warmup,
        "device": str(device),
        "device_name": where,
        "torch": torch.__version__,
        "model": {
            **{
                f.name: getattr(setup.decoder, f.name)
                for f in dataclasses.fields(setup.decoder)
                if f.name != "dtype"
            },
            "dtype": str(setup.decoder.dtype).removeprefix("torch."),
        },
        "capture_sizes": list(setup.capture_sizes.sizes),
        "max_mixed_tokens": setup.max_mixed_tokens,
        "lora_counts": list(LORA_COUNTS),
        "tolerance": setup.tolerance,
        "capture": [
            {
                "mode": mode.name,
                "graphs": r.num_graphs,
                "seconds": r.seconds,
                "pool_bytes": r.pool_bytes,
                "reserved_bytes": r.reserved_bytes,
                "no_graphs": r.no_graphs,
            }
            for mode, r in zip(MODES, reports, strict=True)
        ],
        "checks": {
            "checked_vs_eager": soak.checked,
            "mismatches": soak.mismatches,
            "bitwise_equal_vs_eager": soak.bitwise_equal,
            "worst_rel_err": soak.worst_rel_err,
            "worst_checksum_err": soak.worst_checksum_err,
            "worst_row_rms_deviation": soak.worst_norm_dev,
            "failures": soak.failures,
            "crash": crash,
        },
        "memory": {
            "allocated_after_capture": after_capture.allocated,
            "allocated_after_warmup": baseline.allocated,
            "allocated_end": end.allocated,
            "allocated_delta": memory_delta,
            "allocated_peak_drift": peak_drift if device.type == "cuda" else None,
            "allocated_limit": MEMORY_LIMIT,
            "rss_after_capture": after_capture.rss,
            "rss_after_warmup": baseline.rss,
            "rss_end": end.rss,
            "rss_delta": rss_delta,
            "rss_peak_drift": peak_rss_drift,
            "rss_limit": RSS_LIMIT,
            "series": series,
        },
        "seconds": {
            "wall": wall,
            "setup_and_capture": capture_seconds,
            "prime": prime_seconds,
            "steps": run_seconds,
        },
        "steps_per_mode": dict(sorted(per_mode.items())),
        "runs": dict(sorted(runtime.items())),
        "eager_reasons": dict(sorted(reasons.items())),
        "managers": {
            mode.name: {"stats": stats_as_json(manager), "expected": tally.as_json(), "steps": tally.steps}
            for mode, manager, tally in zip(MODES, soak.managers, soak.tallies, strict=True)
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    modes = " ".join(f"{name}={n}" for name, n in sorted(per_mode.items()))
    runs = " ".join(f"{name}={n}" for name, n in sorted(runtime.items()))
    why = " ".join(f"{name}={n}" for name, n in sorted(reasons.items()))
    verdict = (
        ("OK" if ok else "FAILED")
        if graphs
        else f"REPLAYED NOTHING (no CUDA; eager path {'ok' if ok else 'FAILED'})"
    )
    print(
        f"soak {verdict}: {args.steps} steps, {replays} replays, {soak.checked} checked vs eager, "
        f"{soak.mismatches} mismatches, worst rel err {soak.worst_rel_err:.2e} (tol {setup.tolerance:.0e}, "
        f"{soak.bitwise_equal} bitwise equal), "
        f"memory delta {_mib(memory_delta)}, RSS delta {_mib(rss_delta)}, {wall:.1f} s; "
        f"managers {modes}; runs {runs}; eager reasons {why}; "
        f"model {setup.decoder.num_layers}L d={setup.decoder.hidden_size} "
        f"{str(setup.decoder.dtype).removeprefix('torch.')}; json {out}"
    )
    for problem in problems:
        print(f"soak: FAILED: {problem}", file=sys.stderr)
    if not ok:
        return 1
    # Without CUDA the soak did not happen: only a --device asked for by name (checking the harness)
    # passes; `make soak` on a machine without a GPU fails plainly instead of saying OK.
    return 0 if graphs or args.device is not None else NOTHING_REPLAYED


def _status(ok: bool, graphs: bool) -> str:
    """The soak's verdict in the JSON: ``"ok"``, ``"failed"``, or ``"nothing replayed"`` (no graphs)."""
    if not ok:
        return "failed"
    return "ok" if graphs else "nothing replayed"


if __name__ == "__main__":
    sys.exit(main())
