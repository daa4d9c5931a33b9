"""The optimizer kernels' bandwidths (validate.profiler.kernel_bandwidths): when passes run between them."""

from __future__ import annotations

import torch

from pipesim.validate import profiler
from pipesim.validate.harness import ValidateConfig, model_of
from pipesim.validate.profiler import AVERAGE_REPLICAS, ProfileSettings, kernel_bandwidths, last_level_cache_bytes
from pipesim.validate.stage import PipelineStage

SETTINGS = ProfileSettings(4, warmup=1, repeats=2)


def _forwards(monkeypatch, multiple: int) -> tuple[int, dict]:
    calls = []
    real = PipelineStage.forward

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(PipelineStage, "forward", counted)
    monkeypatch.setattr(profiler, "CACHE_MULTIPLE", multiple)
    model = model_of(ValidateConfig("1f1b", model="mlp", model_width=32, microbatch_size=4))
    bw = kernel_bandwidths(model, settings=SETTINGS)
    return len(calls), bw


def test_weights_that_fit_the_cache_are_timed_after_a_forward_and_backward(monkeypatch):
    steps = SETTINGS.warmup + max(3 * SETTINGS.repeats, 30)
    forwards, bw = _forwards(monkeypatch, 10**6)
    assert forwards == AVERAGE_REPLICAS * steps
    assert set(bw) == {"update", "predict", "average"} and all(v > 0 for v in bw.values())


def test_weights_far_larger_than_the_cache_run_one_forward_per_replica(monkeypatch):
    forwards, bw = _forwards(monkeypatch, 0)  # every model is "far larger" than no cache
    assert forwards == AVERAGE_REPLICAS
    assert all(v > 0 for v in bw.values())


def test_the_last_level_cache_is_the_largest_the_system_lists():
    size = last_level_cache_bytes(torch.device("cpu"))
    assert size >= 1 << 20  # every CPU pipesim runs on has a last-level cache of a MiB or more
