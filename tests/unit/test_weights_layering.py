"""The weights package sits below the runners: it never imports the runner interface."""

from __future__ import annotations

from tests.unit.test_architecture import MODULES, _imports, _project, _within


def test_weights_imports_nothing_of_the_runners() -> None:
    broken = [
        f"{name}:{line} imports {target}"
        for name, path in MODULES.items()
        if _within(name, "workers.weights")
        for imported, line, _ in _imports(name, path)
        if (target := _project(imported)) is not None and _within(target, "workers.runners")
    ]
    assert not broken, "\n".join(broken)


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
