"""``KVCacheMemory`` and the manager's KV methods on the CPU, over a fake of the driver (issue 48).

Units, not bytes: what is backed is always whole units of what the
reservation backs, ``limit`` on the device says the same, refused calls
change nothing, newly backed units read zeros, and the manager's
``back_kv_cache`` / ``drop_kv_cache`` report through ``stats`` and the
capture report. The device's side (graphs over the reservation, free memory
after the start-up) is ``test_kv_first.py``'s, on a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, KVCacheMemory, ManagerOptions, StaticInput
from tests.fake_vmm import FakeVirtualMemory, use_fake_vmm

GRANULE = 4096
#: A unit of 3 KiB: units and granules do not line up, so a backing ends inside a unit's rest.
UNIT = (3, 256)  # int32


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeVirtualMemory:
    driver = FakeVirtualMemory(granularity=GRANULE, capacity=64 * GRANULE)
    use_fake_vmm(monkeypatch, driver)
    return driver


def _memory(max_units: int = 64, min_units: int = 2) -> KVCacheMemory:
    return KVCacheMemory(UNIT, torch.int32, max_units=max_units, min_units=min_units, device="cpu")


def _consistent(kv: KVCacheMemory, fake: FakeVirtualMemory) -> None:
    backed = kv.memory.backed_bytes
    assert kv.units == min(kv.max_units, backed // kv.unit_bytes)
    assert int(kv.limit) == kv.units
    assert kv.min_units <= kv.units <= kv.max_units
    assert fake.used == backed


def test_min_units_are_backed_and_zero_from_the_start(fake: FakeVirtualMemory) -> None:
    kv = _memory()
    assert kv.unit_bytes == 3 * 256 * 4
    assert kv.tensor.shape == (64, *UNIT)
    assert kv.tensor.dtype == torch.int32
    assert kv.memory.backed_bytes == 2 * GRANULE  # 2 units of 3 KiB, rounded up to 8 KiB
    assert kv.units == 2  # 8 KiB hold 2 whole units
    assert int(kv.limit) == 2
    assert kv.limit.dtype == torch.int64
    assert kv.limit.shape == ()
    assert not kv.tensor[:2].any()
    backing = kv.backing()
    assert (backing.units, backing.max_units, backing.mappings, backing.fallback) == (2, 64, 1, None)
    assert backing.chunk_bytes == GRANULE
    assert backing.reserved_bytes == kv.memory.size
    _consistent(kv, fake)


def test_back_grows_to_at_least_the_units_asked_and_zeroes_them(fake: FakeVirtualMemory) -> None:
    kv = _memory()
    assert kv.back(5) == 5  # 15 KiB -> 16 KiB backed, 5 whole units in it
    assert kv.memory.backed_bytes == 4 * GRANULE
    kv.tensor[:5].fill_(7)
    assert kv.back(11) == 12  # 33 KiB -> 36 KiB: the granule's rest holds a 12th unit, handed out too
    kv.tensor[:12].fill_(7)
    assert kv.drop() == 2
    assert not fake.handles.keys() - {h for _, h in fake.mapped.values()}
    assert kv.back(11) == 12
    assert not kv.tensor[2:12].any(), "what was given back and backed again reads zeros"
    assert (kv.tensor[:2] == 7).all()  # the min units were never given back
    assert kv.backing().changes == 4
    _consistent(kv, fake)


def test_a_shrink_needs_the_units_in_use_and_refuses_one_past_the_end(fake: FakeVirtualMemory) -> None:
    kv = _memory()
    kv.back(40)
    before = (kv.units, kv.memory.mappings)
    with pytest.raises(ValueError, match=r"in_use: shrinking from 40 to 10 units needs the ids"):
        kv.back(10)
    with pytest.raises(
        ValueError, match=r"in_use: unit\(s\) \[12, 30\] in use lie at or past the new end 10"
    ):
        kv.back(10, in_use=[1, 30, 12])
    with pytest.raises(ValueError, match=r"in_use: unit\(s\) \[10\] in use"):
        kv.back(10, in_use=torch.tensor([[3, 10]]))
    with pytest.raises(ValueError, match="in_use: expected unit ids"):
        kv.back(10, in_use=[1.5])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"in_use: expected unit ids .* a torch.float32 tensor"):
        kv.back(10, in_use=torch.ones(2))
    assert (kv.units, kv.memory.mappings) == before
    assert kv.back(10, in_use=torch.arange(10)) >= 10  # the mapping holding the end stays whole
    _consistent(kv, fake)


@pytest.mark.parametrize(
    ("units", "pattern"),
    [(65, r"units: expected an integer <= 64, got 65"), (1, r"units: expected an integer >= 2, got 1")],
)
def test_units_outside_the_reservation_are_refused(fake: FakeVirtualMemory, units: int, pattern: str) -> None:
    kv = _memory()
    with pytest.raises(ValueError, match=pattern):
        kv.back(units)
    _consistent(kv, fake)


def test_backing_more_than_is_free_is_refused_by_name(fake: FakeVirtualMemory) -> None:
    kv = _memory(max_units=200)
    fake.capacity = 30 * GRANULE
    with pytest.raises(ValueError, match=r"units: 100 units need \d+ more bytes of device memory; cpu has"):
        kv.back(100)
    assert kv.units == 2
    _consistent(kv, fake)


def test_back_from_free_leaves_the_margin_to_within_a_chunk(fake: FakeVirtualMemory) -> None:
    kv = _memory(max_units=1000)
    margin = 10 * GRANULE + 123
    units = kv.back_from_free(margin)
    left = fake.capacity - fake.used  # type: ignore[operator]
    assert margin <= left < margin + GRANULE
    assert units == kv.memory.backed_bytes // kv.unit_bytes
    with pytest.raises(
        ValueError, match=r"margin_bytes: the device has \d+ bytes free, less than the margin"
    ):
        kv.back_from_free(left + 1)
    assert kv.back_from_free(0) >= units  # grows by what is left
    _consistent(kv, fake)


def test_back_from_free_stops_at_the_reservation(fake: FakeVirtualMemory) -> None:
    kv = _memory(max_units=5)
    assert kv.back_from_free(0) == 5
    assert kv.memory.backed_bytes == kv.memory.size


def test_close_and_what_it_refuses_afterwards(fake: FakeVirtualMemory) -> None:
    kv = _memory()
    kv.back(20)
    kv.close()
    gc.collect()
    assert kv.units == 0
    assert fake.used == 0
    assert fake.reserved == {}
    for what, call in (
        ("close", kv.close),
        ("back", lambda: kv.back(3)),
        ("drop", kv.drop),
        ("back_from_free", lambda: kv.back_from_free(0)),
        ("tensor", lambda: kv.tensor),
    ):
        with pytest.raises(ValueError, match=f"{what}: this KVCacheMemory is closed"):
            call()


def test_without_virtual_memory_it_is_an_ordinary_allocation_and_says_so() -> None:
    kv = KVCacheMemory(UNIT, torch.int32, max_units=1000, min_units=2, fallback_units=6, device="cpu")
    backing = kv.backing()
    assert backing.fallback == "the device is cpu, not CUDA"
    assert kv.max_units == kv.units == 6
    assert kv.tensor.shape == (6, *UNIT)
    assert kv.back(3, in_use=()) == 3
    assert int(kv.limit) == 3
    assert kv.memory.backed_bytes == 6 * kv.unit_bytes
    assert kv.drop() == 2
    assert kv.back_from_free(0) == 6
    with pytest.raises(ValueError, match="units: expected an integer <= 6, got 7"):
        kv.back(7)
    assert "an ordinary allocation" in str(kv.backing())


# -- the manager --


def _forward(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _manager(kv: KVCacheMemory | None) -> CUDAGraphManager[torch.Tensor]:
    config = DispatchConfig(CUDAGraphMode.FULL, CaptureSizes([1, 2, 4]), max_num_seqs=4)
    return CUDAGraphManager(
        _forward, {"x": StaticInput()}, config, device="cpu", options=ManagerOptions(kv_cache=kv)
    )


def test_the_manager_backs_drops_and_reports_its_kv_cache(fake: FakeVirtualMemory) -> None:
    kv = _memory(max_units=1000)
    manager = _manager(kv)
    report = manager.capture()
    assert report.kv_cache is not None
    assert report.kv_cache.units == 2
    units = manager.back_kv_cache(margin_bytes=4 * GRANULE)
    stats = manager.stats
    assert stats.kv_cache is not None
    assert stats.kv_cache.units == units == kv.units
    assert stats.kv_cache.seconds > 0
    assert stats.kv_cache.changes == 1
    assert f"{units} of 1000 units backed" in str(stats)
    assert manager.back_kv_cache(units=10, in_use=[3]) >= 10
    assert manager.drop_kv_cache() == 2
    assert manager.stats.kv_cache is not None
    assert manager.stats.kv_cache.units == 2


def test_the_managers_kv_calls_check_their_arguments(fake: FakeVirtualMemory) -> None:
    kv = _memory()
    manager = _manager(kv)
    with pytest.raises(ValueError, match="margin_bytes, units: expected one of them"):
        manager.back_kv_cache()
    with pytest.raises(ValueError, match="margin_bytes, units: expected one of them"):
        manager.back_kv_cache(margin_bytes=0, units=3)
    with pytest.raises(ValueError, match=r"in_use: only a shrink \(units=...\) takes the units in use"):
        manager.back_kv_cache(margin_bytes=0, in_use=[1])
    with pytest.raises(ValueError, match="margin_bytes: expected an integer >= 0, got -1"):
        manager.back_kv_cache(margin_bytes=-1)
    assert kv.units == 2
    bare = _manager(None)
    with pytest.raises(
        RuntimeError, match=r"back_kv_cache: this manager was built without ManagerOptions\(kv"
    ):
        bare.back_kv_cache(units=3)
    with pytest.raises(RuntimeError, match="drop_kv_cache: this manager was built without"):
        bare.drop_kv_cache()
    with pytest.raises(ValueError, match=r"options.kv_cache: expected a KVCacheMemory or None, got 'x'"):
        ManagerOptions(kv_cache="x")  # type: ignore[arg-type]


# -- any sequence of grows, shrinks, drops and re-backs --


class KVMachine(RuleBasedStateMachine):
    """Random backs, shrinks, drops and backs from free memory: units, limit and the driver always agree."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeVirtualMemory(granularity=GRANULE, capacity=48 * GRANULE)
        self.patch = pytest.MonkeyPatch()
        use_fake_vmm(self.patch, self.fake)
        self.kv = _memory(max_units=100, min_units=3)
        self.in_use: set[int] = set()

    @rule(units=st.integers(3, 100), keep=st.integers(0, 100))
    def back(self, units: int, keep: int) -> None:
        before = self.kv.units
        in_use = [i for i in self.in_use if i < keep]
        try:
            after = self.kv.back(units, in_use=in_use)
        except ValueError as error:
            assert self.kv.units == before
            text = str(error)
            assert text.startswith(("in_use:", "units:")), text
            return
        assert after >= units
        self.in_use = {i for i in self.in_use if i < after}

    @rule(margin=st.integers(0, 60 * GRANULE))
    def back_from_free(self, margin: int) -> None:
        free = self.fake.capacity - self.fake.used  # type: ignore[operator]
        before = self.kv.units
        if margin > free:
            with pytest.raises(ValueError, match="margin_bytes"):
                self.kv.back_from_free(margin)
            assert self.kv.units == before
            return
        after = self.kv.back_from_free(margin)
        left = self.fake.capacity - self.fake.used  # type: ignore[operator]
        assert after >= before
        assert left >= margin
        assert left < margin + GRANULE or self.kv.memory.backed_bytes == self.kv.memory.size

    @rule()
    def drop(self) -> None:
        assert self.kv.drop() >= 3
        self.in_use = set()

    @rule(data=st.data())
    def hand_out(self, data: st.DataObject) -> None:
        unit = data.draw(st.integers(0, self.kv.units - 1))
        self.in_use.add(unit)
        self.kv.tensor[unit].fill_(unit + 1)

    @invariant()
    def agrees(self) -> None:
        _consistent(self.kv, self.fake)

    @invariant()
    def units_in_use_keep_their_contents(self) -> None:
        for unit in self.in_use:  # through grows, shrinks that keep them and backs from free memory
            assert bool((self.kv.tensor[unit] == unit + 1).all()), unit

    def teardown(self) -> None:
        self.kv.close()
        gc.collect()
        self.patch.undo()


KVMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
TestKVMachine = pytest.mark.usefixtures("frozen_heap")(KVMachine.TestCase)


def test_the_readmes_start_up_in_the_new_order_runs_on_the_cpu_as_an_ordinary_allocation() -> None:
    """The README's block as written, without CUDA: ``fallback_units`` pages, every step eager."""
    from pathlib import Path

    from tests.test_readmes import python_blocks

    readme = Path(__file__).resolve().parents[2] / "packages/manager/README.md"
    (block,) = [b for b in python_blocks(readme) if "back_kv_cache(margin_bytes" in b]
    if torch.cuda.is_available():
        pytest.skip("runs on a GPU in tests/manager/test_kv_first.py")
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(block, "packages/manager/README.md", "exec"), namespace)
    kv = namespace["kv"]
    assert isinstance(kv, KVCacheMemory)
    assert namespace["pages"] == kv.units == 64
    assert kv.backing().fallback == "the device is cpu, not CUDA"
