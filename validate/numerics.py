"""Why pipesim's executors agree bit for bit, and the one setting that makes them.

pipesim promises that executing a schedule gives the same bits whichever
executor runs it: the distributed runtime (one process per device) equals the
single-process emulator, and ``PipelineSchedule.step()`` called K times equals
one run K times as long. Floating-point addition is not associative, so this
holds only if both paths perform the *same* operations on the *same* shapes
in the *same* order, with the *same* kernels. The argument, piece by piece:

1. **Same operations in the same order.** Every executor walks the one
   compiled plan of the IR (:func:`pipesim.validate.executor.compiled`), and
   each (replica, stage) is driven by its own
   :class:`~pipesim.validate.stage.PipelineStage` whose passes, gradient
   accumulation and optimizer steps happen in that stage's program order.
   The interleaving *across* devices differs between executors, but no
   arithmetic crosses stages except through a tensor handed over whole
   (activations, input gradients) or a collective.
2. **Collectives are computed by pipesim, in replica order**
   (:func:`~pipesim.validate.executor.reduce_mean`,
   :func:`~pipesim.validate.executor.average_elastic`), never by the
   backend's own reduction, whose order depends on the backend and on how
   many ranks there are.
3. **Same shapes.** A step of ``PipelineSchedule`` runs exactly the
   micro-batches that the corresponding part of a longer run runs, of the
   same size, and a stage's weights sit at the same offsets of a
   :class:`~pipesim.kernels.VersionPool` buffer in every executor, so the
   GEMMs see the same operand shapes and alignments.
4. **The same kernels: one intra-op thread count.** A CPU GEMM splits its
   work (and so its reductions) across threads, and ATen's vectorised
   reductions choose their blocking by thread count and vector width. Two
   runs with different thread counts may therefore differ in the last bits,
   and how often depends on the CPU (on an AVX-512 AMD EPYC a 2-thread run
   differed from a 1-thread run by 1e-11..1e-9 where an Intel Xeon agreed).
   Every executor therefore computes with :data:`EXECUTOR_THREADS` intra-op
   threads: the distributed workers are launched with it, and
   :func:`intra_op_threads` sets it around the emulator and
   ``PipelineSchedule.step()``.
5. **The same machine.** Both paths run on the same CPU with the same
   ``ATEN_CPU_CAPABILITY`` and ``MKL_ENABLE_INSTRUCTIONS`` (spawned workers
   inherit the environment), so ATen and MKL dispatch to the same kernels on
   both sides. Across *machines* or kernel choices no bit-identity is
   promised; CI runs the numerics tests again with ATen's portable and AVX2
   paths and MKL held to SSE4.2 and AVX2, so a result that silently depends
   on one of the points above fails whatever CPU CI has.

On CUDA, kernel selection is cuBLAS's and cuDNN's own; pipesim promises
bit-identity on CPU only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: Intra-op threads every executor computes with (see point 4 above): one
#: per worker process, so that CPU workers on one machine do not
#: oversubscribe its cores, and the same in the single-process executors.
EXECUTOR_THREADS = 1


@contextmanager
def intra_op_threads(n: int | None = EXECUTOR_THREADS) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to ``n``, then
    restore it. ``None`` leaves the current setting alone (for callers that
    want all cores and give up bit-identity with the other executors)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
