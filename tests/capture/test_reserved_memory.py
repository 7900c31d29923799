"""``ReservedMemory``'s bookkeeping on the CPU, over a fake of the driver's virtual memory (issue 48).

The fake (``tests.fake_vmm``) checks every call as the CUDA driver would
(mappings unmapped whole, access set on mapped ranges, handles released
once unmapped, nothing left when the range is freed) over host memory, so
views can be written and read. What the device does (a graph captured
against unbacked addresses, replayed once backed) is the GPU tests'
(``test_reserved_memory_gpu.py``); these never replace them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cudagraph_capture._reserved import MAX_MAPPING_BYTES, plan_mappings, wrap_pointer
from cudagraph_capture.lowlevel import ReservedMemory
from tests.fake_vmm import FakeVirtualMemory, use_fake_vmm

GRANULE = 4096


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeVirtualMemory:
    driver = FakeVirtualMemory(granularity=GRANULE)
    use_fake_vmm(monkeypatch, driver)
    return driver


# -- the plan of mappings --


@given(st.integers(0, 5000), st.sampled_from([1, 2, 5, 8, 1 << 10]))
def test_a_plan_backs_exactly_in_few_power_of_two_mappings(granules: int, largest_granules: int) -> None:
    largest = largest_granules * GRANULE
    sizes = plan_mappings(granules * GRANULE, GRANULE, largest)
    assert sum(sizes) == granules * GRANULE
    top = GRANULE << ((largest // GRANULE).bit_length() - 1)
    for size in sizes:
        multiple = size // GRANULE
        assert size % GRANULE == 0, size
        assert multiple & (multiple - 1) == 0, size  # a power of two of granules
        assert size <= top
    assert sizes == sorted(sizes, reverse=True)  # largest first: a shrink drops the small ones
    assert len(sizes) <= granules * GRANULE // top + top.bit_length()


def test_ten_gib_is_ten_mappings_and_a_granule_exact_tail_one_more() -> None:
    granule = 2 << 20
    assert plan_mappings(10 << 30, granule) == [MAX_MAPPING_BYTES] * 10
    assert plan_mappings((10 << 30) + 3 * granule, granule) == [MAX_MAPPING_BYTES] * 10 + [
        2 * granule,
        granule,
    ]
    with pytest.raises(ValueError, match="nbytes: 3 is not a multiple"):
        plan_mappings(3, granule)


# -- backing, exactly --


def test_a_reservation_is_addresses_only_until_backed(fake: FakeVirtualMemory) -> None:
    memory = ReservedMemory(10 * GRANULE + 1, device="cpu")
    assert memory.fallback is None
    assert memory.size == 11 * GRANULE  # rounded up to the granularity
    assert memory.granularity == GRANULE
    assert memory.backed_bytes == 0
    assert fake.used == 0
    assert fake.mapped == {}
    assert memory.back(3 * GRANULE + 5) == 4 * GRANULE  # rounded up
    assert list(memory.mappings) == [(0, 4 * GRANULE)]
    assert memory.back(11 * GRANULE) == 11 * GRANULE
    assert list(memory.mappings) == [
        (0, 4 * GRANULE),
        (4 * GRANULE, 4 * GRANULE),
        (8 * GRANULE, 2 * GRANULE),
        (10 * GRANULE, GRANULE),
    ]
    assert fake.used == fake.mapped_bytes == memory.backed_bytes
    assert fake.allowed[-1] == (
        next(iter(fake.reserved)) + 4 * GRANULE,
        7 * GRANULE,
    )  # one call for the new ones


def test_a_shrink_ends_at_the_first_mapping_boundary_at_or_above_the_end_asked(
    fake: FakeVirtualMemory,
) -> None:
    memory = ReservedMemory(16 * GRANULE, device="cpu")
    memory.back(4 * GRANULE)
    memory.back(11 * GRANULE)  # mappings: [0, 4), [4, 8), [8, 10), [10, 11)
    assert memory.back(9 * GRANULE) == 10 * GRANULE  # inside [8, 10): it stays whole
    assert memory.back(8 * GRANULE) == 8 * GRANULE
    assert memory.back(1) == 4 * GRANULE
    assert memory.back(0) == 0
    assert fake.used == 0
    assert fake.mapped == {}


def test_views_are_tensors_over_the_range_without_a_copy(fake: FakeVirtualMemory) -> None:
    memory = ReservedMemory(8 * GRANULE, device="cpu")
    base = next(iter(fake.reserved))
    whole = memory.view(torch.float32, (8 * GRANULE // 4,))
    part = memory.view(torch.int64, (2, 3), offset=GRANULE)
    assert whole.data_ptr() == base
    assert part.data_ptr() == base + GRANULE
    memory.back(2 * GRANULE)
    part.copy_(torch.arange(6).view(2, 3))
    assert whole[GRANULE // 4 : GRANULE // 4 + 4].view(torch.int64).tolist() == [0, 1]
    assert memory.view(torch.uint8, (0,), offset=8 * GRANULE).numel() == 0  # an empty view at the end


_REFUSED: list[tuple[Callable[[ReservedMemory], object], str]] = [
    (lambda m: m.view(torch.float32, (2 * GRANULE + 1,)), r"shape: \[8193\] of torch.float32 .* past"),
    (lambda m: m.view(torch.float32, (1,), offset=2), r"offset: 2 is not a multiple"),
    (lambda m: m.view(torch.float32, (-1,)), r"shape: expected a sequence of integers >= 0"),
    (lambda m: m.view(torch.float32, 4), r"shape: expected a sequence"),  # type: ignore[arg-type]
    (lambda m: m.view("float32", (4,)), r"dtype: expected a torch.dtype, got 'float32'"),  # type: ignore[arg-type]
    (lambda m: m.back(8 * GRANULE + 1), r"nbytes: 32769 is more than the reservation's 32768"),
    (lambda m: m.back(-1), r"nbytes: expected an integer >= 0"),
    (lambda m: m.back(True), r"nbytes: expected an integer >= 0, got True"),
]


@pytest.mark.parametrize(("call", "pattern"), _REFUSED)
def test_a_refused_call_changes_nothing(
    fake: FakeVirtualMemory, call: Callable[[ReservedMemory], object], pattern: str
) -> None:
    memory = ReservedMemory(8 * GRANULE, device="cpu")
    memory.back(3 * GRANULE)
    before = (memory.mappings, dict(fake.handles), dict(fake.mapped))
    with pytest.raises(ValueError, match=pattern):
        call(memory)
    assert (memory.mappings, dict(fake.handles), dict(fake.mapped)) == before


@pytest.mark.parametrize("failing", ["create", "map", "allow"])
def test_a_grow_the_driver_refuses_midway_backs_nothing_new(fake: FakeVirtualMemory, failing: str) -> None:
    memory = ReservedMemory(64 * GRANULE, device="cpu")
    memory.back(GRANULE)
    before = memory.mappings
    calls = len([c for c in fake.calls if c == failing])
    original = getattr(fake, failing)

    def second_fails(*args: object) -> object:  # the grow's first call goes through, its second fails
        if len([c for c in fake.calls if c == failing]) == calls + 1:
            fake.fail(failing)
        return original(*args)

    if failing == "allow":  # one call per grow, after every mapping is made
        fake.fail(failing)
    else:
        setattr(fake, failing, second_fails)
    with pytest.raises(RuntimeError, match=f"cu{failing} failed"):
        memory.back(63 * GRANULE)  # 32 + 16 + 8 + 4 + 1 granules: several mappings
    assert memory.mappings == before
    assert fake.used == fake.mapped_bytes == memory.backed_bytes


def test_out_of_memory_backs_nothing_and_is_torchs_error(fake: FakeVirtualMemory) -> None:
    fake.capacity = 10 * GRANULE
    memory = ReservedMemory(64 * GRANULE, device="cpu")
    memory.back(4 * GRANULE)
    with pytest.raises(torch.OutOfMemoryError):
        memory.back(15 * GRANULE)  # 8 granules fit, then 2 more do not
    assert memory.backed_bytes == 4 * GRANULE
    assert fake.used == 4 * GRANULE


# -- close, lifetimes --


def test_close_gives_the_memory_back_and_the_addresses_with_the_last_view(fake: FakeVirtualMemory) -> None:
    memory = ReservedMemory(4 * GRANULE, device="cpu")
    view = memory.view(torch.uint8, (GRANULE,))
    memory.back(4 * GRANULE)
    memory.close()
    assert memory.closed
    assert memory.backed_bytes == 0
    assert fake.used == 0
    assert fake.mapped == {}
    assert fake.reserved, "a live view keeps the addresses reserved (it must never read another allocation)"
    del view
    gc.collect()
    assert fake.reserved == {}
    for call in (memory.close, lambda: memory.back(0), lambda: memory.view(torch.uint8, (1,))):
        with pytest.raises(ValueError, match="is closed"):
            call()


def test_a_reservation_dropped_without_close_gives_everything_back(fake: FakeVirtualMemory) -> None:
    memory = ReservedMemory(4 * GRANULE, device="cpu")
    view = memory.view(torch.float32, (4,))
    memory.back(3 * GRANULE)
    del memory
    gc.collect()
    assert fake.reserved, "the view keeps it"
    assert fake.used
    del view
    gc.collect()
    assert fake.reserved == {}
    assert fake.handles == {}
    assert fake.mapped == {}


def test_a_wrapped_pointer_keeps_its_owner_until_the_last_tensor_goes() -> None:
    class Owner:
        pass

    owner = Owner()
    gone = weakref.ref(owner)
    host = torch.arange(16, dtype=torch.uint8)
    tensor = wrap_pointer(host.data_ptr(), 16, torch.device("cpu"), owner)
    assert tensor.data_ptr() == host.data_ptr()
    assert tensor.tolist() == list(range(16))
    view = tensor[4:8]
    del owner, tensor
    gc.collect()
    assert gone() is not None
    del view
    gc.collect()
    assert gone() is None


# -- without virtual memory: an ordinary allocation --


def test_on_the_cpu_it_falls_back_to_an_ordinary_allocation_and_says_so() -> None:
    memory = ReservedMemory(1 << 30, device="cpu", fallback_size=1000)
    assert memory.fallback == "the device is cpu, not CUDA"
    assert memory.size == memory.backed_bytes == 1000
    assert memory.mappings == ((0, 1000),)
    assert memory.back(10) == 1000  # nothing to back or give back: all of it stays
    with pytest.raises(ValueError, match="nbytes: 1001 is more than the reservation's 1000 bytes"):
        memory.back(1001)
    memory.view(torch.int32, (250,)).fill_(7)
    memory.close()
    assert memory.backed_bytes == 0
    with pytest.raises(ValueError, match="close: this ReservedMemory is closed"):
        memory.close()


# -- any sequence of grows, shrinks, drops and re-backs --


class BackingMachine(RuleBasedStateMachine):
    """Random backs (grow, shrink, drop to 0, re-back) and writes: the bookkeeping always matches the fake."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeVirtualMemory(granularity=GRANULE, capacity=40 * GRANULE)
        self.patch = pytest.MonkeyPatch()
        use_fake_vmm(self.patch, self.fake)
        self.memory = ReservedMemory(48 * GRANULE, device="cpu")
        self.words = self.memory.view(torch.int64, (48 * GRANULE // 8,))

    @rule(nbytes=st.integers(0, 48 * GRANULE))
    def back(self, nbytes: int) -> None:
        before = self.memory.backed_bytes
        try:
            after = self.memory.back(nbytes)
        except torch.OutOfMemoryError:
            assert -(-nbytes // GRANULE) * GRANULE - before > self.fake.capacity - self.fake.used  # type: ignore[operator]
            assert self.memory.backed_bytes == before
            return
        rounded = -(-nbytes // GRANULE) * GRANULE
        if rounded >= before:
            assert after == rounded
        else:  # a shrink keeps the mapping that holds the end whole
            assert rounded <= after <= before
            ends = [offset + size for offset, size in self.memory.mappings]
            assert after == (ends[-1] if ends else 0)

    @precondition(lambda self: self.memory.backed_bytes >= 8)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        words = self.memory.backed_bytes // 8
        index = data.draw(st.integers(0, words - 1))
        self.words[index] = index  # only backed words are written (the device would fault otherwise)

    @invariant()
    def bookkeeping_matches_the_driver(self) -> None:
        memory = self.memory
        backed = memory.backed_bytes
        assert backed % GRANULE == 0
        assert 0 <= backed <= memory.size
        offsets = [offset for offset, _ in memory.mappings]
        ends = [offset + size for offset, size in memory.mappings]
        assert offsets == [0, *ends[:-1]][: len(offsets)], "the mappings tile a prefix"
        assert (ends[-1] if ends else 0) == backed
        assert self.fake.used == self.fake.mapped_bytes == backed

    def teardown(self) -> None:
        self.memory.close()
        del self.words
        gc.collect()
        assert self.fake.reserved == {}
        assert self.fake.handles == {}
        self.patch.undo()


BackingMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestBacking = pytest.mark.usefixtures("frozen_heap")(BackingMachine.TestCase)
