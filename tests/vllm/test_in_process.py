"""The vLLM runner driving a ``vllm.LLM`` in this process (one engine for the module)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from tests.vllm.scenarios import (  # noqa: F401 - the shared tests, collected here
    test_a_checkpoint_rewritten_after_its_check_is_never_what_vllm_loads,
    test_a_failing_vllm_reload_restores_the_old_weights,
    test_describe_names_model_version_dtype_device_and_vllm,
    test_different_manifest_is_rejected_before_vllm_sees_it,
    test_prefix_cache_never_serves_kv_of_the_old_weights,
    test_reload_rollout_through_kafka_matches_fresh_weights,
    test_update_config_errors_are_coded_nacks_and_the_engine_keeps_serving,
    test_vllm_own_config_errors_translate_to_our_codes,
)
from workers.runners.vllm_runner import VllmRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def runner(in_process_runner: VllmRunner) -> VllmRunner:
    return in_process_runner
