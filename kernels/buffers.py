"""Weight versions: PipeDream's stash and PipeDream-2BW's double buffer.

Both hand out weights by version number and count readers, so that a pass
can never read a version other than the one it was scheduled on, and both
copy only what the semantics require:

* :class:`WeightStash` keeps the live weights as the current version and
  copies a version only when the weights are about to be updated while some
  micro-batch still needs them (its backward has not run). Freed copies are
  recycled, so steady state allocates nothing.
* :class:`DoubleBuffer` never copies: the update writes W(t+1) into the
  buffer that held W(t−1), then the roles swap.
* :class:`VersionPool` generalises the double buffer to any number of
  versions for a runtime that knows its readers in advance (the schedule IR
  names the version every pass reads). Versions never move: an update
  writes the next version in place when nobody will read the current one
  again, and into a free buffer otherwise. That matters for autograd: a
  forward's graph keeps pointing at the storage it computed with, so a
  version must stay where it is until its backward has run, which
  :class:`WeightStash` (copy the old version away, update in place) cannot
  promise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipesim.kernels import foreach
from pipesim.kernels._checks import as_tensor_list, check_aligned, group_indices, take
from pipesim.kernels.prediction import _bump, empty_like_all, impl_for


class StashFullError(RuntimeError):
    """Keeping one more version would exceed the stash's capacity."""


class _Readers:
    """Reader counts per held version, shared by both buffers."""

    def __init__(self, version: int):
        self.version = version
        self.readers: dict[int, int] = {version: 0}

    def held(self) -> list[int]:
        return sorted(self.readers)

    def acquire(self, version: int | None = None) -> int:
        v = self.version if version is None else version
        self.check_held(v)
        self.readers[v] += 1
        return v

    def check_held(self, version: int) -> None:
        if version not in self.readers:
            raise KeyError(f"version {version} is not held (held: {self.held()})")

    def release(self, version: int) -> bool:
        """Drop one reader; True when a non-current version has none left."""
        self.check_held(version)
        if self.readers[version] == 0:
            raise ValueError(f"version {version} has no readers to release")
        self.readers[version] -= 1
        if version != self.version and self.readers[version] == 0:
            del self.readers[version]
            return True
        return False


class _VersionHolder:
    """What every version holder answers the same way, from its ``_Readers``."""

    _r: _Readers

    @property
    def version(self) -> int:
        return self._r.version

    @property
    def held(self) -> list[int]:
        """Versions held (current included), oldest first."""
        return self._r.held()

    def readers(self, version: int) -> int:
        self._r.check_held(version)
        return self._r.readers[version]


class WeightStash(_VersionHolder):
    """PipeDream weight stashing: a forward and its backward read the same version.

    ``tensors`` are the live weights, which are version ``version``. A pass
    calls :meth:`acquire` (forward: registers a reader of the current
    version), :meth:`get` (forward and backward: the tensors of a version) and
    :meth:`release` (backward done). Call :meth:`advance` right *before* the
    optimizer writes the live weights: if the current version has readers it
    is copied into a slot, then the version number moves on.

    ``capacity`` bounds the versions held, live one included: N − k for
    stage k of an N-stage PipeDream pipeline. At most ``capacity - 1`` slot
    copies are ever allocated.
    """

    def __init__(self, tensors, capacity: int, *, version: int = 0):
        self._live = as_tensor_list("tensors", tensors)
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._r = _Readers(int(version))
        self._copies: dict[int, list[Tensor]] = {}
        self._free: list[list[Tensor]] = []
        self._allocated = 0

    def __len__(self) -> int:
        return len(self._r.readers)

    @property
    def nbytes(self) -> int:
        """Bytes of slot memory allocated (in use or recycled), not counting the live weights."""
        per = sum(t.numel() * t.element_size() for t in self._live)
        return per * self._allocated

    def acquire(self, version: int | None = None) -> int:
        """A forward starts on the current (or a given held) version; returns it."""
        return self._r.acquire(version)

    def get(self, version: int) -> list[Tensor]:
        """The weights of ``version``: the live tensors if current, else its copy."""
        if version == self._r.version:
            return self._live
        self._r.check_held(version)
        return self._copies[version]

    def release(self, version: int) -> None:
        """A backward on ``version`` is done; a stashed copy without readers is recycled."""
        if self._r.release(version):
            self._free.append(self._copies.pop(version))

    def advance(self) -> int:
        """Call before updating the live weights in place; returns the new version."""
        cur = self._r.version
        if self._r.readers[cur]:
            if len(self._r.readers) >= self.capacity:
                raise StashFullError(
                    f"cannot advance to version {cur + 1}: capacity {self.capacity} reached "
                    f"(held {self.held}, version {cur} still has {self._r.readers[cur]} readers)"
                )
            slot = self._free.pop() if self._free else self._new_slot()
            with torch.no_grad():
                _copy(slot, self._live)
            self._copies[cur] = slot
        else:
            del self._r.readers[cur]
        self._r.version = cur + 1
        self._r.readers[cur + 1] = 0
        return cur + 1

    def _new_slot(self) -> list[Tensor]:
        self._allocated += 1
        return empty_like_all(self._live)


class DoubleBuffer(_VersionHolder):
    """PipeDream-2BW: the current weights and a shadow holding the previous version.

    ``tensors`` become the current buffer (no copy); the shadow is allocated
    once. :meth:`update` hands the shadow to a function that writes the next
    weights into it (e.g. W(t+1) = W(t) − ν∇f(W(t−1)) via :meth:`update_sgd`)
    and swaps: the old current becomes the shadow, version t, still readable
    by in-flight micro-batches. The buffer that is overwritten held version
    t−1, so its readers must all be done; that is 2BW's invariant, and
    :meth:`update` raises ``RuntimeError`` if it is violated instead of
    silently handing a micro-batch the wrong weights.
    """

    def __init__(self, tensors, *, version: int = 0):
        cur = as_tensor_list("tensors", tensors)
        self._bufs = [cur, empty_like_all(cur)]
        self._cur = 0
        self._r = _Readers(int(version))

    @property
    def current(self) -> list[Tensor]:
        return self._bufs[self._cur]

    @property
    def shadow(self) -> list[Tensor]:
        """The other buffer: version − 1 once an update happened, scratch before."""
        return self._bufs[1 - self._cur]

    @property
    def shadow_version(self) -> int | None:
        prev = self._r.version - 1
        return prev if prev in self._r.readers else None

    def acquire(self, version: int | None = None) -> int:
        """Register a reader of the current version, or of the shadow's (2BW reads t−1)."""
        return self._r.acquire(version)

    def get(self, version: int) -> list[Tensor]:
        if version == self._r.version:
            return self.current
        self._r.check_held(version)
        return self.shadow

    def release(self, version: int) -> None:
        """A reader is done. The shadow stays readable until the next update overwrites it."""
        self._r.check_held(version)
        if self._r.readers[version] == 0:
            raise ValueError(f"version {version} has no readers to release")
        self._r.readers[version] -= 1

    def update(self, write) -> int:
        """``write(dst, src)`` fills ``dst`` (the shadow) from ``src`` (current); then swap."""
        prev = self._r.version - 1
        if self._r.readers.get(prev):
            raise RuntimeError(
                f"cannot update: version {prev} in the shadow buffer still has {self._r.readers[prev]} readers"
            )
        self._r.readers.pop(prev, None)
        with torch.no_grad():
            write(self.shadow, self.current)
        cur = self._r.version
        self._cur = 1 - self._cur
        self._r.version = cur + 1
        self._r.readers[cur + 1] = 0
        return cur + 1

    def update_sgd(self, grads, lr: float, *, backend: str | None = None) -> int:
        """W(t+1) = W(t) − lr·g in one pass, written straight into the shadow."""
        grads = as_tensor_list("grads", grads)
        check_aligned("current", self.current, "grads", grads, state=True)

        def write(dst, src):
            for idx in group_indices(src, grads):
                lists = [take(dst, idx), take(src, idx), take(grads, idx)]
                impl_for(lists, backend).axpy(lists[0], lists[1], lists[2], -float(lr))
            _bump(dst)

        return self.update(write)


class VersionPool(_VersionHolder):
    """Weight versions in buffers that never move, for readers announced ahead.

    ``tensors`` are version ``version`` (no copy). A runtime driven by a
    schedule calls :meth:`expect` for every pass that will read a version
    (before the update that would otherwise overwrite it), :meth:`get` to
    read, and :meth:`release` when the pass is done. :meth:`update` then
    decides: no reader left on the current version → the optimizer writes
    in place (flush schedules, vanilla asynchronous pipelining: one buffer);
    readers left → the next version goes into a recycled buffer (PipeDream
    stashing: N − k buffers; 2BW: exactly two, like :class:`DoubleBuffer`).

    ``capacity`` bounds the buffers, live one included; exceeding it raises
    :class:`StashFullError` rather than silently growing memory.
    """

    def __init__(self, tensors, capacity: int | None = None, *, version: int = 0):
        live = as_tensor_list("tensors", tensors)
        if capacity is not None and int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = None if capacity is None else int(capacity)
        self._r = _Readers(int(version))
        self._bufs: dict[int, list[Tensor]] = {int(version): live}
        self._free: list[list[Tensor]] = []
        self._allocated = 1

    @property
    def buffers(self) -> int:
        """Buffers allocated (held or free), the live one included."""
        return self._allocated

    @property
    def nbytes(self) -> int:
        per = sum(t.numel() * t.element_size() for t in self._bufs[self.version])
        return per * self._allocated

    def expect(self, version: int | None = None, count: int = 1) -> int:
        """Announce ``count`` future reads of ``version`` (default: current)."""
        v = self._r.version if version is None else version
        self._r.check_held(v)
        self._r.readers[v] += int(count)
        return v

    def get(self, version: int) -> list[Tensor]:
        self._r.check_held(version)
        return self._bufs[version]

    def release(self, version: int) -> None:
        """One announced read of ``version`` is done; an old version with none left frees its buffer."""
        if self._r.release(version):
            self._free.append(self._bufs.pop(version))

    def update(self, write) -> int:
        """``write(dst, src)`` produces the next version from the current one; returns its number.

        ``dst is src`` when the update may happen in place.
        """
        cur = self._r.version
        src = self._bufs[cur]
        if self._r.readers[cur]:
            if self._free:
                dst = self._free.pop()
            else:
                if self.capacity is not None and self._allocated >= self.capacity:
                    raise StashFullError(
                        f"cannot produce version {cur + 1}: capacity {self.capacity} reached "
                        f"(held {self.held}, version {cur} still has {self._r.readers[cur]} readers)"
                    )
                dst = empty_like_all(src)
                self._allocated += 1
        else:
            dst = src
            del self._r.readers[cur]
            del self._bufs[cur]
        with torch.no_grad():
            write(dst, src)
        self._r.version = cur + 1
        self._r.readers[cur + 1] = 0
        self._bufs[cur + 1] = dst
        return cur + 1


def _copy(dst: list[Tensor], src: list[Tensor]) -> None:
    for idx in group_indices(src):
        foreach.copy(take(dst, idx), take(src, idx))
