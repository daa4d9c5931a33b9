"""pipesim's runtime against torch.distributed.pipelining at tiny size: same work, sane figures."""

from __future__ import annotations

import math

import pytest

from pipesim.validate.torchbench import (
    compare_with_torch,
    default_starts,
    format_report,
)


def test_default_starts():
    assert default_starts("mlp", 2, 5) == (0, 3)
    assert default_starts("mlp", 2, 5, default_size=False) == (0, 2)
    assert default_starts("gpt-small", 3, 6, default_size=False) == (0, 2, 4)
    with pytest.raises(ValueError):
        default_starts("mlp", 6, 5, default_size=False)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="schedules"):
        compare_with_torch(schedules=("zb-h1",))
    with pytest.raises(ValueError, match="Schedule1F1B"):
        compare_with_torch(microbatches=1, schedules=("1f1b",))


@pytest.mark.multiprocess
def test_compare_with_torch_tiny():
    m, b, iters, warm = 4, 8, 2, 1
    result = compare_with_torch(
        "mlp", 2, m, b, iters, warm, ("gpipe", "1f1b"), width=32, depth=4, timeout_s=120, starts=(0, 3), repeats=1
    )
    assert set(result["schedules"]) == {"gpipe", "1f1b"}
    for name, r in result["schedules"].items():
        ours, theirs = r["pipesim"], r["torch"]
        assert ours["timed_samples"] == theirs["timed_samples"] == iters * m * b
        assert ours["trained_samples"] == theirs["trained_samples"] == (warm + iters) * m * b
        for side in (ours, theirs):
            thr = side["samples_per_s"]
            assert all(math.isfinite(v) and v > 0 for v in thr["runs"]), (name, thr)
            assert len(side["iteration_losses"]) == warm + iters
        assert math.isfinite(r["ratio_best"]) and r["ratio_best"] > 0
        # same weights, same data: the first iteration's losses agree, micro-batch by micro-batch
        assert ours["first_iteration_losses"] == pytest.approx(theirs["first_iteration_losses"], rel=1e-6, abs=1e-7)
        assert len(ours["first_iteration_losses"]) == m
    gpipe = result["schedules"]["gpipe"]
    assert gpipe["first_loss"]["pipesim"] == pytest.approx(gpipe["first_loss"]["torch"], rel=1e-6)
    assert "pipesim/torch" in format_report(result)
