"""The in-process vLLM engine (a ``vllm.LLM`` in this process) and the vLLM runner's options.

vllm is imported only when an engine starts; this module imports without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.messages import IDENTIFIER
from workers.runners.vllm_config import CONFIG_SECTIONS
from workers.runners.vllm_sidecar import Generation, PauseMode, SidecarEngine, is_loopback_url

_log = logging.getLogger(__name__)

#: Set (unless already set) before an in-process engine imports vllm.
IN_PROCESS_ENV: dict[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}


class VllmRunnerOptions(BaseModel):
    """How to reach the engine; fixed for the runner's life (from CLI flags or env JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["in_process", "sidecar"] = "in_process"
    model: str = Field(min_length=1, description="Checkpoint directory the engine starts from.")
    initial_version: str = Field(default="init", pattern=rf"^{IDENTIFIER}$")
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


@dataclasses.dataclass
class _Request:
    """One in-process request: what to generate, and its outcome once finished."""

    prompt_ids: list[int]
    max_tokens: int
    added: bool = False  # given to vLLM (by the stepping loop)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Generation | None = None
    error: BaseException | None = None


class InProcessEngine:
    """A ``vllm.LLM`` in this process, served by one stepping loop (a thread): every
    :meth:`generate` call adds its request to vLLM and waits; each engine step serves all of them
    together (vLLM batches them). Every other call on vLLM runs between two steps (the loop holds
    off), and :meth:`pause` / :meth:`resume` drain it for a reload with vLLM's pause modes."""

    def __init__(self, options: VllmRunnerOptions) -> None:
        self.options = options
        self.vllm_version = "unknown"
        self.device = "unknown"
        self.dtype = "unknown"
        self._llm: Any = None
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._requests: dict[str, _Request] = {}  # admitted, not finished (external ids)
        self._draining = False  # pause() began: new requests wait to be admitted
        self._paused = False  # no step until resume()
        self._holders = 0  # calls on vLLM running between two steps
        self._stepping = False  # the loop is in vLLM (adding, stepping), outside the lock
        self._closed = False
        self._stopped: tuple[str, datetime] | None = None  # the loop died: why, and when
        self._loop: threading.Thread | None = None

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
        self._loop = threading.Thread(target=self._serve, name="vllm-steps", daemon=True)
        self._loop.start()
        return False

    def _vllm_config(self) -> Any:
        return self._llm.llm_engine.vllm_config

    @contextlib.contextmanager
    def _held(self) -> Iterator[Any]:
        """vLLM's engine between two steps, for the body (requests in flight stay in it)."""
        with self._cond:
            self._holders += 1
            self._cond.wait_for(lambda: not self._stepping)
        try:
            yield self._llm
        finally:
            with self._cond:
                self._holders -= 1
                self._cond.notify_all()

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
        with self._held() as llm:
            llm.collective_rpc("update_config", args=(overrides,))

    def reload(self, weights_dir: str) -> None:
        with self._held() as llm:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})

    def reset_prefix_cache(self) -> bool:
        # reset_running_requests: a request kept across the reload (drain mode keep) is preempted
        # and recomputed with the new weights instead of decoding on KV of the old ones.
        with self._held() as llm:
            return bool(llm.reset_prefix_cache(reset_running_requests=True))

    def set_weight_version(self, version: str) -> None:
        with self._held() as llm:
            llm.llm_engine.set_weight_version(version)

    def get_weight_version(self) -> str:
        with self._held() as llm:
            return str(llm.llm_engine.get_weight_version())

    # ------------------------------------------------------------------ serving

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        """Greedy generation (EOS ignored) served with every other request in flight; waits
        while a reload drains. Finish reason ``abort`` and no tokens when a drain (mode abort)
        ended it (outputs are final-only)."""
        request = _Request(list(prompt_ids), max_tokens)
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self._stopped is not None or not self._draining
            )
            if self._closed:
                raise RunnerError("no vLLM engine is loaded", code=WireCode.MODEL_NOT_LOADED)
            if self._stopped is not None:
                raise self._refusal(self._stopped[0])
            self._requests[f"fleet-{next(self._ids)}"] = request
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def running_requests(self) -> int:
        with self._cond:
            return len(self._requests)

    def pause(self, mode: PauseMode, timeout_s: float) -> tuple[int, int]:
        """Drain for a reload; returns (requests in flight, requests aborted). New requests
        wait; ``wait``: the ones in flight finish (past ``timeout_s``: COMMAND_TIMEOUT and
        serving goes on); ``abort``: each ends now through vLLM's ``abort_request``;
        ``keep``: they stay in vLLM, frozen between two steps, and go on after :meth:`resume`.
        The stepping loop is stopped after it."""
        with self._cond:
            self._draining = True
            in_flight = len(self._requests)
            if mode == "wait" and not self._cond.wait_for(lambda: not self._requests, timeout_s):
                running = len(self._requests)
                self._draining = False
                self._cond.notify_all()
                raise RunnerError(
                    f"{running} request(s) still running after {timeout_s:g}s",
                    code=WireCode.COMMAND_TIMEOUT,
                )
            self._paused = True
            self._cond.wait_for(lambda: not self._stepping)
            aborted = 0
            if mode == "abort":
                aborted = self._abort_all()
            return in_flight, aborted

    def abort_held(self, timeout_s: float) -> int:
        """Drained (between :meth:`pause` and :meth:`resume`): end every request the engine
        still holds as drain mode abort ends them (finish reason ``abort``, vLLM lets go of
        them), so that none goes on after :meth:`resume`: after a reload that left weights of
        no version, a request kept frozen (drain mode keep) must not generate on them. Returns
        how many. ``timeout_s``: unused in process (nothing to wait for)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._stepping)
            return self._abort_all()

    def _abort_all(self) -> int:
        """Every request admitted ends now, finish reason ``abort`` (lock held, not stepping)."""
        self._release([rid for rid, r in self._requests.items() if r.added])
        aborted = list(self._requests)
        for rid in aborted:
            self._finish(rid, result=Generation([], None, "abort"))
        return len(aborted)

    def resume(self) -> None:
        with self._cond:
            self._paused = self._draining = False
            self._cond.notify_all()

    def _finish(
        self, rid: str, *, result: Generation | None = None, error: BaseException | None = None
    ) -> None:
        """``rid``'s outcome, to its caller (lock held); unknown ids (aborted) are ignored."""
        request = self._requests.pop(rid, None)
        if request is not None:
            request.result, request.error = result, error
            request.done.set()

    def stopped_serving(self) -> tuple[str, datetime] | None:
        """Why and since when nothing is served (the stepping loop died); None while it runs."""
        with self._cond:
            return self._stopped

    def _serve(self) -> None:
        """The stepping loop's thread. Should the loop itself fail (outside a step, which fails
        only the requests in it), nothing would step again and every caller would wait for
        ever: instead each request pending fails, and every later one is refused, with
        RUNNER_FAILED (:meth:`_stop_serving`)."""
        try:
            self._serve_steps()
        except BaseException as exc:  # the thread's end: nothing above it would see it
            _log.exception("the vLLM stepping loop died; the engine serves no request now")
            self._stop_serving(f"{type(exc).__name__}: {exc}")

    def _stop_serving(self, why: str) -> None:
        """The loop is gone: fail every request pending (vLLM lets go of them), refuse later
        ones. Touches no method the loop may have died in (``_finish``)."""
        with self._cond:
            self._stopped = (why, datetime.now(UTC))
            self._stepping = False  # nothing steps any more: calls between steps may run
            pending, self._requests = self._requests, {}
            self._release([rid for rid, r in pending.items() if r.added])
            for request in pending.values():
                request.error = self._refusal(why)
                request.done.set()
            self._cond.notify_all()

    @staticmethod
    def _refusal(why: str) -> RunnerError:
        return RunnerError(
            f"vLLM's stepping loop died ({why}); this engine serves no request: restart the worker",
            code=WireCode.RUNNER_FAILED,
        )

    def _serve_steps(self) -> None:
        """The stepping loop: adds the requests admitted, steps vLLM, hands out what finished."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        def params(max_tokens: int) -> Any:
            out = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            out.output_kind = RequestOutputKind.FINAL_ONLY
            return out

        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or (not self._paused and not self._holders and bool(self._requests))
                    )
                )
                if self._closed:
                    return
                new = [(rid, r) for rid, r in self._requests.items() if not r.added]
                for _, r in new:
                    r.added = True
                self._stepping = True
            refused: list[tuple[str, BaseException]] = []
            finished: list[tuple[str, Generation]] = []
            failed: BaseException | None = None
            engine = self._llm.llm_engine
            try:
                for rid, r in new:
                    try:
                        engine.add_request(
                            rid, {"prompt_token_ids": r.prompt_ids}, params(r.max_tokens)
                        )
                    except Exception as exc:  # this request's own fault (too long, ...)
                        refused.append((rid, exc))
                if engine.has_unfinished_requests():
                    finished = [(o.request_id, _generation(o)) for o in self._step() if o.finished]
            except Exception as exc:
                failed = exc
            with self._cond:
                self._stepping = False
                for rid, cause in refused:
                    self._finish(rid, error=RunnerError(f"vLLM refused the request: {cause}"))
                for rid, generation in finished:
                    self._finish(rid, result=generation)
                if failed is not None or not engine.has_unfinished_requests():
                    why = f"vLLM failed a step: {failed}" if failed else "vLLM dropped it"
                    lost = [rid for rid, r in self._requests.items() if r.added]
                    self._release(lost)
                    for rid in lost:
                        self._finish(rid, error=RunnerError(f"request {rid} lost: {why}"))
                self._cond.notify_all()

    def _release(self, rids: list[str]) -> None:
        """vLLM lets go of ``rids`` (``abort_request``), requests failed or ended on our side:
        left in vLLM's scheduler, each would hold a batch slot and its KV blocks and go on
        generating for no caller. Best effort (a broken vLLM may refuse it too). Runs between
        two steps (lock held)."""
        if rids:
            with contextlib.suppress(Exception):
                self._llm.llm_engine.abort_request(rids)

    def _step(self) -> list[Any]:
        """One vLLM engine step (the loop's; tests hold it here)."""
        return list(self._llm.llm_engine.step())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for rid in list(self._requests):
                self._finish(
                    rid,
                    error=RunnerError("the vLLM engine was closed", code=WireCode.MODEL_NOT_LOADED),
                )
            self._cond.notify_all()
        if self._loop is not None:
            self._loop.join(timeout=60)
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm


def _generation(output: Any) -> Generation:
    """A finished vLLM ``RequestOutput``: its tokens, weight-version spans, finish reason."""
    done = output.outputs[0]
    spans = [(v.version, v.start, v.end) for v in done.weight_versions or []]
    return Generation([int(t) for t in done.token_ids], spans, done.finish_reason)


Engine = InProcessEngine | SidecarEngine  # one interface: start, reload, reset_prefix_cache, ...
