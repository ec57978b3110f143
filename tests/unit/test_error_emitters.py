"""Codes whose emitters had no test of their own (see test_error_codes.py): KAFKA_ERROR from
the bus's translation of aiokafka's errors, BROKER_START_TIMEOUT from the local broker.

No Kafka here: ``translate`` is a pure mapping from aiokafka's exception classes to our codes,
and the broker's readiness wait is given a process that never listens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka.errors import (
    InvalidTopicError,
    KafkaConnectionError,
    NotLeaderForPartitionError,
    UnknownTopicOrPartitionError,
)

from controlplane.kafka.broker import BrokerConfig, LocalBroker
from controlplane.kafka.bus import translate
from controlplane.wire.errors import BrokerError, BusError, LocalCode
from tests.factories import free_port


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidTopicError(), LocalCode.KAFKA_ERROR),
        (UnknownTopicOrPartitionError(), LocalCode.BROKER_UNAVAILABLE),  # retriable in aiokafka
        (NotLeaderForPartitionError(), LocalCode.BROKER_UNAVAILABLE),
        (KafkaConnectionError("refused"), LocalCode.BROKER_UNAVAILABLE),
        (TimeoutError(), LocalCode.BROKER_UNAVAILABLE),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_kafka_errors_are_translated_to_codes(error: Exception, code: LocalCode) -> None:
    with pytest.raises(BusError) as caught, translate("publishing"):
        raise error
    assert caught.value.code is code
    assert caught.value.message.startswith("publishing: ")
    assert caught.value.retryable  # both codes: Kafka may answer differently later


def test_a_non_retriable_kafka_error_is_kafka_error() -> None:
    with pytest.raises(BusError) as caught, translate("creating topics"):
        raise InvalidTopicError()
    assert str(caught.value).startswith("KAFKA_ERROR: creating topics: ")


def test_a_broker_that_never_answers_is_broker_start_timeout(tmp_path: Path) -> None:
    broker = LocalBroker(BrokerConfig(port=free_port(), data_dir=tmp_path / "broker"))
    broker.data_dir.mkdir(parents=True)
    broker.log_file.write_text("starting...\nstill starting...\n")
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        broker._proc = silent
        broker.pid_file.write_text(str(silent.pid))
        with pytest.raises(BrokerError) as caught:
            broker._wait_ready(0.3)
    finally:
        if silent.poll() is None:
            silent.kill()
        silent.wait()
    err = caught.value
    assert err.code is LocalCode.BROKER_START_TIMEOUT
    assert err.retryable
    assert "did not answer a metadata request" in err.message
    assert "still starting..." in err.message  # the log's tail, to see why
    assert not broker.pid_file.exists()  # stopped: nothing left half-started
