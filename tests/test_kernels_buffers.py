"""WeightStash and DoubleBuffer under hypothesis stateful testing.

Every version's weights are filled with the version number, so reading the
wrong version is visible in the values. The machines check, after every
step, that each held version still reads back as itself, that no more
versions are held than allowed, and that memory stays within the bound.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from pipesim.kernels import DoubleBuffer, StashFullError, VersionPool, WeightStash

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

SHAPES = [(3, 2), (5,), ()]


def weights(value: float, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.full(s, float(value), dtype=dtype) for s in SHAPES]


def assert_is_version(tensors, version):
    for t in tensors:
        assert torch.all(t == version), f"expected version {version}, read {t.flatten()[:3].tolist()}"


class StashMachine(RuleBasedStateMachine):
    reads = Bundle("reads")

    @initialize(capacity=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
    def setup(self, capacity, dtype):
        self.live = weights(0, dtype)
        self.stash = WeightStash(self.live, capacity)
        self.capacity = capacity
        self.readers: dict[int, int] = {0: 0}
        self.current = 0

    @rule(target=reads)
    def forward(self):
        v = self.stash.acquire()
        assert v == self.current
        self.readers[v] += 1
        assert all(a is b for a, b in zip(self.stash.get(v), self.live))  # live weights, no copy
        return v

    @rule(v=reads)
    def read_again(self, v):
        assert_is_version(self.stash.get(v), v)

    @rule(v=consumes(reads))
    def backward(self, v):
        assert_is_version(self.stash.get(v), v)
        self.stash.release(v)
        self.readers[v] -= 1
        if v != self.current and self.readers[v] == 0:
            del self.readers[v]
            with pytest.raises(KeyError):
                self.stash.get(v)

    @rule()
    def update(self):
        full = self.readers[self.current] > 0 and len(self.readers) >= self.capacity
        if full:
            with pytest.raises(StashFullError):
                self.stash.advance()
            return
        assert self.stash.advance() == self.current + 1
        if self.readers[self.current] == 0:
            del self.readers[self.current]
        self.current += 1
        self.readers[self.current] = 0
        with torch.no_grad():  # the optimizer writes the live weights in place
            for t in self.live:
                t.fill_(self.current)

    @rule(v=st.integers(-2, 12))
    def release_unread_version_fails(self, v):
        if self.readers.get(v, 0) == 0:
            with pytest.raises((KeyError, ValueError)):
                self.stash.release(v)

    @invariant()
    def versions_consistent(self):
        assert self.stash.version == self.current
        assert self.stash.held == sorted(self.readers)
        assert len(self.stash) <= self.capacity
        for v in self.readers:
            assert self.stash.readers(v) == self.readers[v]
            assert_is_version(self.stash.get(v), v)
        per_copy = sum(t.numel() * t.element_size() for t in self.live)
        assert self.stash.nbytes <= (self.capacity - 1) * per_copy


class DoubleBufferMachine(RuleBasedStateMachine):
    reads = Bundle("reads")

    @initialize(dtype=st.sampled_from([torch.float32, torch.bfloat16]))
    def setup(self, dtype):
        self.initial = weights(0, dtype)
        self.db = DoubleBuffer(self.initial)
        assert all(a is b for a, b in zip(self.db.current, self.initial))  # adopted, not copied
        self.readers: dict[int, int] = {0: 0}
        self.version = 0

    @rule(target=reads, shadow=st.booleans())
    def forward(self, shadow):
        v = self.version - 1 if shadow else self.version
        if v not in self.readers:
            with pytest.raises(KeyError):
                self.db.acquire(v)
            v = self.version
            self.db.acquire()
        else:
            assert self.db.acquire(v if shadow else None) == v
        self.readers[v] += 1
        return v

    @rule(v=consumes(reads))
    def backward(self, v):
        assert_is_version(self.db.get(v), v)
        self.db.release(v)
        self.readers[v] -= 1

    @rule(sgd=st.booleans())
    def update(self, sgd):
        prev = self.version - 1
        before = [t.data_ptr() for t in self.db.current]
        if self.readers.get(prev, 0):
            with pytest.raises(RuntimeError, match="still has"):
                self.db.update(lambda dst, src: None)
            return
        if sgd:  # W - lr*g with g = -1, lr = 1: version + 1, exact in bf16 for small versions
            grads = [torch.full(s, -1.0) for s in SHAPES]
            assert self.db.update_sgd(grads, 1.0) == self.version + 1
        else:

            def write(dst, src):
                for d, s in zip(dst, src):
                    d.copy_(s).add_(1)

            assert self.db.update(write) == self.version + 1
        assert [t.data_ptr() for t in self.db.shadow] == before  # swapped, not copied
        self.readers.pop(prev, None)
        self.version += 1
        self.readers[self.version] = 0

    @invariant()
    def versions_consistent(self):
        assert self.db.version == self.version
        assert self.db.held == sorted(self.readers)
        assert len(self.readers) <= 2
        for v in self.readers:
            assert self.db.readers(v) == self.readers[v]
            assert_is_version(self.db.get(v), v)
        assert self.db.shadow_version == (self.version - 1 if self.version > 0 else None)


TestStash = StashMachine.TestCase
TestStash.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestDoubleBuffer = DoubleBufferMachine.TestCase
TestDoubleBuffer.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_stash_recycles_slots():
    live = weights(0)
    stash = WeightStash(live, capacity=3)
    v0 = stash.acquire()
    stash.advance()
    slot = stash.get(v0)[0].data_ptr()
    stash.release(v0)
    v1 = stash.acquire()
    stash.advance()
    assert stash.get(v1)[0].data_ptr() == slot  # the freed slot's storage is reused
    assert stash.nbytes == sum(t.numel() * 4 for t in live)


def test_stash_errors():
    with pytest.raises(ValueError, match="capacity"):
        WeightStash(weights(0), 0)
    stash = WeightStash(weights(0), 1)
    stash.advance()  # no reader: nothing to keep
    stash.acquire()
    with pytest.raises(StashFullError, match="capacity 1"):
        stash.advance()
    with pytest.raises(KeyError, match="not held"):
        stash.get(0)
    with pytest.raises(ValueError, match="no readers"):
        WeightStash(weights(0), 2).release(0)


class VersionPoolMachine(RuleBasedStateMachine):
    """Readers announced ahead, as the runtime does from the schedule: every
    held version must keep its values *and its storage* until released."""

    def __init__(self):
        super().__init__()
        self.pool = VersionPool(weights(0))
        self.pending: list[int] = []  # announced reads not yet released
        self.ptrs: dict[int, list[int]] = {0: [t.data_ptr() for t in self.pool.get(0)]}

    @rule(count=st.integers(1, 3))
    def expect_current(self, count):
        v = self.pool.expect(count=count)
        self.pending += [v] * count

    @rule(data=st.data())
    def release_one(self, data):
        if self.pending:
            v = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            self.pool.release(v)

    @rule()
    def update(self):
        cur = self.pool.version
        had_readers = self.pool.readers(cur) > 0

        def write(dst, src):
            for d, s in zip(dst, src):
                d.copy_(s + 1)

        new = self.pool.update(write)
        assert new == cur + 1
        ptrs = [t.data_ptr() for t in self.pool.get(new)]
        if not had_readers:  # in place: same storage, old version gone
            assert ptrs == self.ptrs.pop(cur)
        self.ptrs[new] = ptrs

    @invariant()
    def versions_stay_put(self):
        for v in self.pool.held:
            assert_is_version(self.pool.get(v), v)
            if v in self.ptrs:
                assert [t.data_ptr() for t in self.pool.get(v)] == self.ptrs[v]
        assert set(self.pool.held) == set(self.pending) | {self.pool.version}
        # buffers in use never exceed versions held; free ones are recycled first
        assert self.pool.buffers <= max(len(self.pool.held), 1) + len(self.pool._free)


TestVersionPool = VersionPoolMachine.TestCase
TestVersionPool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_version_pool_double_buffers_2bw():
    """2BW's pattern (forwards keep reading the previous version) needs two buffers, never three."""
    pool = VersionPool(weights(0), capacity=2)
    for _ in range(6):
        pool.expect(count=2)  # next iteration's passes read the current version
        pool.update(lambda d, s: [x.copy_(y + 1) for x, y in zip(d, s)])
        for v in pool.held[:-1]:
            if pool.readers(v):
                pool.release(v)
                pool.release(v)
    assert pool.buffers == 2
    assert_is_version(pool.get(pool.version), 6)


def test_version_pool_capacity_and_errors():
    pool = VersionPool(weights(0), capacity=1)
    pool.update(lambda d, s: [x.add_(1) for x in d])  # no readers: in place, fits
    pool.expect()
    with pytest.raises(StashFullError, match="capacity 1"):
        pool.update(lambda d, s: None)
    with pytest.raises(KeyError):
        pool.get(0)
    with pytest.raises(ValueError):
        VersionPool(weights(0), capacity=0)
