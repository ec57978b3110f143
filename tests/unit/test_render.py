"""Human output: a rollout known only from its acks (its command did not decode) renders."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from rich.console import Console

from controlplane.cli.render import target, workers_table
from controlplane.rollout.registry import WorkerView


def test_the_target_of_a_rollout_whose_command_no_worker_could_read() -> None:
    status = cast(
        Any, SimpleNamespace(target_version=None, overrides=None, kind=None, dry_run=False)
    )
    assert target(status) == "unreadable command"


def test_a_dry_run_says_so_wherever_its_target_is_shown() -> None:
    from tests.factories import alive, command, full, status

    events = [command(workers=["w1"]).model_copy(update={"dry_run": True})]
    judged = status(*events, *alive("w1", sent=1), *full("w1", 1, 2), now=3)
    assert judged.dry_run and target(judged) == "weights v2 (dry run)"
    assert "weights v2 (dry run)" in _rendered_rollouts([judged])


def _worker(**fields: Any) -> WorkerView:
    from datetime import UTC, datetime

    from tests.factories import fake_heartbeat

    at = datetime(2026, 12, 1, 6, 30, tzinfo=UTC)
    return WorkerView.of(fake_heartbeat("w1", at, interval_s=3.0, **fields), at)


def _rendered_rollouts(statuses: list[Any]) -> str:
    from controlplane.cli.render import rollouts_table

    out = Console(width=300, record=True, color_system=None)
    out.print(rollouts_table(statuses))
    return out.export_text()


def _rendered(worker: WorkerView) -> str:
    out = Console(width=300, record=True, color_system=None)
    out.print(workers_table([worker], []))
    return out.export_text()


def test_a_worker_that_cannot_publish_says_so_in_the_workers_table() -> None:
    from datetime import UTC, datetime

    since = datetime(2026, 12, 1, 6, 29, 50, tzinfo=UTC)
    blocked = _worker(acks_unpublished=2, publish_failing_since=since, lease_s=30.0)
    assert blocked.lease_s == 30.0
    assert "cannot publish since 06:29:50: 2 ack(s) waiting" in _rendered(blocked)
    fine = _worker()
    assert fine.lease_s == 9.0  # no lease: three periods
    assert "cannot publish" not in _rendered(fine)


# --------------------------------------------------------------------------- a rollout's table


def _table_text(renderable: Any) -> str:
    out = Console(width=120, record=True, color_system=None)
    out.print(renderable)
    return out.export_text()


def _forty_rejected() -> Any:
    from tests.factories import Event, F, X, ack, alive, command, status

    workers = [f"w{i:02d}" for i in range(40)]
    events: list[Event] = [command(workers=workers), *alive(*workers, sent=1)]
    events += [ack(w, X, 2, code="PATH_NOT_ALLOWED") for w in workers[:38]]
    events += [ack(w, F, 2, code="RUNNER_FAILED") for w in workers[38:]]
    return status(*events, now=3)


def test_errors_with_different_messages_stay_apart_and_wide_shows_each() -> None:
    """Collapsed by code AND message: the factory's messages name their worker ("w00
    broke"), so no two rows are the same here; ``wide`` is a row a worker either way."""
    from controlplane.cli.render import rollout_table

    judged = _forty_rejected()
    text = _table_text(rollout_table(judged))
    assert text.count("PATH_NOT_ALLOWED") == 38 and text.count("RUNNER_FAILED") == 2
    assert text.index("PATH_NOT_ALLOWED") < text.index("RUNNER_FAILED")
    wide = _table_text(rollout_table(judged, wide=True))
    assert wide.count("PATH_NOT_ALLOWED") == 38 and wide.count("RUNNER_FAILED") == 2


def test_rows_that_differ_only_by_worker_are_collapsed_bad_first() -> None:
    from controlplane.cli.render import rollout_table
    from tests.factories import Event, X, ack, alive, command, full, status

    workers = [f"w{i:02d}" for i in range(12)]
    events: list[Event] = [command(workers=workers), *alive(*workers, sent=1)]
    for w in workers[:10]:
        nack = ack(w, X, 2, code="PATH_NOT_ALLOWED")
        assert nack.error is not None
        events.append(
            nack.model_copy(
                update={"error": nack.error.model_copy(update={"message": "outside the roots"})}
            )
        )
    for w in workers[10:]:
        events += full(w, 1, 2)
    text = _table_text(rollout_table(status(*events, now=3)))
    lines = [line for line in text.splitlines() if line.startswith("│")]
    assert len(lines) == 2, text
    assert "10: w00, w01, w02 and 7 more" in lines[0] and "PATH_NOT_ALLOWED" in lines[0], text
    assert "2: w10, w11" in lines[1] and "succeeded" in lines[1], text


def test_data_output_is_json_or_yaml_of_the_same_fields() -> None:
    import json

    import yaml

    from controlplane.cli.render import Output, dumped, few

    judged = _forty_rejected()
    as_json = json.loads(dumped(judged, Output.JSON))
    assert as_json == yaml.safe_load(dumped(judged, Output.YAML))
    assert as_json["counts"]["rejected"] == 38
    assert few(["a", "b"]) == "a, b" and few(list("abcdef")) == "a, b, c and 3 more"


# --------------------------------------------------------------------------- data is never markup

#: Text rich would read as a closing tag (``MarkupError``: exit 5 instead of the result).
MARKUP = "[/x] [bold]"


def _rendered_everywhere(renderable: Any) -> list[str]:
    """``renderable`` as a default rich console prints it, and as the CLI's own does."""
    from controlplane.cli.render import console

    texts = [_table_text(renderable)]
    cli_out = console()
    with cli_out.capture() as captured:
        cli_out.print(renderable)
    texts.append(captured.get())
    return texts


def test_markup_in_an_error_a_label_a_config_value_and_a_line_is_shown_as_it_is() -> None:
    from controlplane.cli.render import console, rollout_table, rollouts_table
    from tests.factories import Event, X, ack, alive, command, status

    events: list[Event] = [command(workers=["w1"]), *alive("w1", sent=1)]
    nack = ack("w1", X, 2, code="PATH_NOT_ALLOWED")
    assert nack.error is not None
    error = nack.error.model_copy(update={"message": f"bad {MARKUP}"})
    events.append(nack.model_copy(update={"error": error}))
    judged = status(*events, now=3).model_copy(
        update={"target_version": None, "overrides": {"stop": "[/INST]"}}
    )
    for text in _rendered_everywhere(rollout_table(judged)):
        assert f"bad {MARKUP}" in text and "config stop=[/INST]" in text, text
    for text in _rendered_everywhere(rollouts_table([judged])):
        assert "config stop=[/INST]" in text, text
    worker = _worker(labels={"disk": "[/dev/nvme0]"})
    for text in _rendered_everywhere(workers_table([worker], [])):
        assert "disk=[/dev/nvme0]" in text, text
    out = console()
    with out.capture() as captured:
        out.print(f"config {MARKUP}")
    assert captured.get().strip() == f"config {MARKUP}"
