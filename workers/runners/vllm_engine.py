"""The in-process vLLM engine (a ``vllm.LLM`` in this process) and the vLLM runner's options.

vllm is imported only when an engine starts; this module imports without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from controlplane.wire.errors import RunnerError
from workers.runners.vllm_config import CONFIG_SECTIONS
from workers.runners.vllm_sidecar import Generation, SidecarEngine, is_loopback_url

#: Set (unless already set) before an in-process engine imports vllm.
IN_PROCESS_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}


class VllmRunnerOptions(BaseModel):
    """How to reach the engine; fixed for the runner's life (from CLI flags or env JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["in_process", "sidecar"] = "in_process"
    model: str = Field(min_length=1, description="Checkpoint directory the engine starts from.")
    initial_version: str = Field(default="init", min_length=1, max_length=128)
    engine_args: dict[str, JsonValue] = Field(
        default_factory=dict, description="in_process: keyword arguments of vllm.LLM."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="in_process: environment set before vllm is imported."
    )
    base_url: str = Field(default="http://127.0.0.1:8000", pattern=r"^https?://")
    served_model_name: str | None = None
    api_key: str | None = None
    allow_remote: bool = Field(
        default=False, description="Allow a non-loopback base_url (its dev endpoints are open)."
    )
    pause_mode: Literal["wait", "abort", "keep"] | None = Field(
        default=None,
        description="Deprecated: the reload command's drain policy decides; when set, it is "
        "the drain mode of reloads whose command names none.",
    )
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=60.0, gt=0)
    reload_timeout_s: float = Field(default=600.0, gt=0)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    snapshot_dir: str | None = Field(
        default=None,
        description="Directory this runner owns for the private, verified copies of the "
        "checkpoints vLLM loads (default: a new private directory under the system temp dir). "
        "A sidecar must be able to read it at the same path.",
    )

    @model_validator(mode="after")
    def _loopback(self) -> VllmRunnerOptions:
        if self.mode == "sidecar" and not self.allow_remote and not is_loopback_url(self.base_url):
            raise ValueError(
                f"base_url {self.base_url!r} is not loopback: vLLM's dev endpoints are "
                "unauthenticated; bind vllm serve to 127.0.0.1 (or set allow_remote)"
            )
        return self


class InProcessEngine:
    """A ``vllm.LLM`` in this process; the runner's lock serializes generation and reloads."""

    def __init__(self, options: VllmRunnerOptions) -> None:
        self.options = options
        self.vllm_version = "unknown"
        self.device = "unknown"
        self.dtype = "unknown"
        self._llm: Any = None
        self._ids = itertools.count(1)

    def start(self) -> bool:
        for key, value in IN_PROCESS_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.update(self.options.env)
        import vllm
        from vllm.platforms import current_platform

        self._llm = vllm.LLM(model=self.options.model, **self.options.engine_args)
        self.vllm_version = str(vllm.__version__)
        self.device = str(current_platform.device_type)
        self.dtype = str(self._vllm_config().model_config.dtype).removeprefix("torch.")
        return False

    def _vllm_config(self) -> Any:
        return self._llm.llm_engine.vllm_config

    def config_fields(self) -> dict[str, dict[str, Any]]:
        config = self._vllm_config()
        out: dict[str, dict[str, Any]] = {}
        for section in CONFIG_SECTIONS:
            current = getattr(config, section)
            out[section] = {
                f.name: getattr(current, f.name, None) for f in dataclasses.fields(current)
            }
        return out

    def dry_run_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        """vLLM's own (pure) override function on the live configs: raises what the worker would."""
        from vllm.config.utils import update_config

        config = self._vllm_config()
        for section, values in overrides.items():
            update_config(getattr(config, section), values)

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        self._llm.collective_rpc("update_config", args=(overrides,))

    def reload(self, weights_dir: str) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})

    def reset_prefix_cache(self) -> bool:
        # reset_running_requests: a request kept across the reload (drain mode keep) is preempted
        # and recomputed with the new weights instead of decoding on KV of the old ones.
        return bool(self._llm.reset_prefix_cache(reset_running_requests=True))

    def set_weight_version(self, version: str) -> None:
        self._llm.llm_engine.set_weight_version(version)

    def get_weight_version(self) -> str:
        return str(self._llm.llm_engine.get_weight_version())

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        between_steps: Callable[[], bool] | None = None,
    ) -> Generation:
        """Greedy generation stepped here, one engine step at a time. ``between_steps`` runs
        before each step (the runner drains there): it may block (drain mode keep), or return
        True to abort the request through vLLM's own ``abort_request`` (finish reason
        ``abort``, no tokens: outputs are final-only)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        engine = self._llm.llm_engine
        request_id = f"fleet-{next(self._ids)}"  # outputs and aborts use this (external) id
        engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, params)
        try:
            while True:
                if between_steps is not None and between_steps():
                    engine.abort_request([request_id])
                    return Generation([], None, "abort")
                if not engine.has_unfinished_requests():
                    raise RunnerError(f"vLLM dropped request {request_id} without an output")
                for output in engine.step():
                    if output.request_id == request_id and output.finished:
                        done = output.outputs[0]
                        spans = [(s.version, s.start, s.end) for s in done.weight_versions or []]
                        return Generation(
                            [int(t) for t in done.token_ids], spans, done.finish_reason
                        )
        except BaseException:
            with contextlib.suppress(Exception):
                engine.abort_request([request_id])
            raise

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm


Engine = InProcessEngine | SidecarEngine  # one interface: start, reload, reset_prefix_cache, ...
