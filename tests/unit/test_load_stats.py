"""The loader's own stats type (the weights package sits below the runners: test_architecture
checks that it never imports them) and the runners' ReloadResult built from it."""

from __future__ import annotations


def test_a_reload_result_is_built_from_the_loaders_stats() -> None:
    from workers.runners.base import ReloadResult
    from workers.weights.stats import LoadStats

    stats = LoadStats.measured(
        "v1", files=2, tensors=3, nbytes=4_000, started=1.0, copy_started=1.5, finished=3.5
    )
    assert (stats.validate_s, stats.copy_s, stats.duration_s, stats.gbps) == (0.5, 2.0, 2.5, 2e-6)
    result = ReloadResult.of(stats)
    assert type(result) is ReloadResult
    assert result.as_dict() == {
        "version": "v1",
        "files": 2,
        "tensors": 3,
        "bytes": 4_000,
        "validate_s": 0.5,
        "copy_s": 2.0,
        "duration_s": 2.5,
        "gbps": 0.0,
    }
    nothing_copied = LoadStats.measured(
        "v2", files=1, tensors=0, nbytes=0, started=1.0, copy_started=1.0, finished=1.0
    )
    assert nothing_copied.gbps == 0.0
