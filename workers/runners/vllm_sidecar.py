"""HTTP client for a ``vllm serve`` sidecar on loopback: dev-mode endpoints, errors as our codes.

It never imports vllm or torch and never starts a server; the runner (vllm_runner.py) decides
what to call and when. The dev endpoints (/collective_rpc, /pause, ...) are unauthenticated.
"""

from __future__ import annotations

import ipaddress
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from controlplane.wire.errors import RunnerError, WireCode

#: vLLM wraps a worker's exception as "... Worker failed with error '<message>', please check ...".
_WORKER_ERROR = re.compile(r"Worker failed with error '(?P<msg>.*)'(?:, please check|$)", re.S)
#: vLLM's pause modes (``vllm.v1.engine.PauseMode``): what happens to requests in flight.
PauseMode = Literal["wait", "abort", "keep"]


@dataclass(frozen=True)
class Generation:
    """One greedy completion: new token ids, vLLM's weight-version spans ``(version, start,
    end)`` over them (None where the API does not report them), and vLLM's finish reason."""

    token_ids: list[int]
    weight_versions: list[tuple[str, int, int]] | None
    finish_reason: str | None


class SidecarError(RunnerError):
    """A call to the sidecar failed; ``status`` is the HTTP status (None: no response)."""

    def __init__(
        self,
        message: str,
        *,
        code: WireCode,
        status: int | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message, code=code)
        self.status = status
        #: vLLM's own message (the worker's exception text when a collective_rpc failed).
        self.detail = detail


def is_loopback_url(url: str) -> bool:
    """True when ``url``'s host is localhost or a loopback address."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def worker_message(text: str) -> str:
    """The worker's own exception text inside vLLM's collective_rpc wrapper, else ``text``."""
    match = _WORKER_ERROR.search(text)
    return match.group("msg") if match else text


@dataclass(frozen=True)
class RequestCounts:
    """vLLM's request metrics at one moment: its scheduler's gauges (as of its last step) and
    its counter of finished requests by finish reason (``abort`` included), since it started."""

    running: int
    waiting: int
    finished: dict[str, int]

    @classmethod
    def parse(cls, text: str) -> RequestCounts:
        """From Prometheus text: each metric summed over its labels (engines, models)."""
        running = waiting = 0.0
        finished: dict[str, int] = {}
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_running"):
                running += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:num_requests_waiting{") or line.startswith(
                "vllm:num_requests_waiting "
            ):
                waiting += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:request_success_total"):
                found = _FINISHED_REASON.search(line)
                reason = found.group(1) if found else "unknown"
                count = int(float(line.rsplit(" ", 1)[1]))
                finished[reason] = finished.get(reason, 0) + count
        return cls(int(running), int(waiting), finished)

    def drained(self, after: RequestCounts, mode: PauseMode) -> tuple[int, int]:
        """(in flight, aborted) of a ``/pause`` that ran between ``self`` and ``after``.

        A pause queues new requests (none is admitted), so the requests finished in between
        were in flight when the drain was asked for: waited for (``wait``), or aborted by it
        (``abort``: the ``abort`` finish reason; a request finishing on its own just before
        the pause landed is in flight, not aborted). ``keep`` finishes nothing: the requests it
        froze are vLLM's running and waiting gauges after it (its scheduler's last step).
        Not from the running gauge before the pause: a gauge as of vLLM's last step, stale by
        the time the pause lands."""
        done = {r: n - self.finished.get(r, 0) for r, n in after.finished.items()}
        finished = sum(max(n, 0) for n in done.values())
        if mode == "keep":
            return finished + after.running + after.waiting, 0
        aborted = max(done.get("abort", 0), 0) if mode == "abort" else 0
        return finished, aborted


_FINISHED_REASON = re.compile(r'finished_reason="([^"]*)"')


class SidecarClient:
    """Synchronous calls to one vLLM OpenAI-compatible server started with VLLM_SERVER_DEV_MODE=1."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        # A fresh connection per call: after a 500 the server drops the connection, and a
        # pooled one would fail the next call with "connection reset" (cheap on loopback).
        headers = {"Connection": "close"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            trust_env=False,  # never send loopback traffic through an HTTP proxy from the env
        )

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ endpoints

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Poll GET /health until it answers 200 or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                response = self._http.get("/health", timeout=min(10.0, timeout_s))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise SidecarError(
                    f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f}s ({last})",
                    code=WireCode.MODEL_NOT_LOADED,
                )
            time.sleep(poll_s)

    def version(self) -> str:
        return str(self._call("GET", "/version").get("version", "unknown"))

    def models(self) -> list[dict[str, Any]]:
        data = self._call("GET", "/v1/models").get("data", [])
        return [m for m in data if isinstance(m, dict)]

    def server_info(self) -> dict[str, Any]:
        """The engine's config as JSON (dev mode); ``{}`` parts when vLLM omits them."""
        info = self._call("GET", "/server_info", params={"config_format": "json"})
        config = info.get("vllm_config")
        return config if isinstance(config, dict) else {}

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").get("is_paused"))

    def pause(self, mode: PauseMode, timeout_s: float) -> None:
        """``/pause?mode=``; the caches are reset after the reload, not here (clear_cache off)."""
        params = {"mode": mode, "clear_cache": "false"}
        self._call("POST", "/pause", params=params, timeout=timeout_s)

    def resume(self) -> None:
        self._call("POST", "/resume")

    def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache; requests held by a ``keep`` pause are preempted and
        recomputed (``reset_running_requests``), so none decodes on KV of the old weights."""
        params = {"reset_running_requests": "true"}
        return bool(self._call("POST", "/reset_prefix_cache", params=params).get("success"))

    def running_requests(self) -> int:
        """vLLM's ``vllm:num_requests_running`` gauge (Prometheus ``/metrics``); 0 if absent."""
        counts = self.request_counts()
        return 0 if counts is None else counts.running

    def request_counts(self) -> RequestCounts | None:
        """vLLM's request gauges and finished-request counters (``/metrics``); None if absent."""
        try:
            response = self._http.get("/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return RequestCounts.parse(response.text)

    def set_weight_version(self, version: str) -> None:
        """vLLM's weight-version label (``/update_weight_version``, the RL dev endpoints)."""
        self._call("POST", "/update_weight_version", json={"new_version": version})

    def get_weight_version(self) -> str:
        return str(self._call("GET", "/weight_info").get("weight_version"))

    def collective_rpc(
        self,
        method: str,
        *,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call a worker method; ``timeout_s`` bounds our wait (vLLM itself is not told)."""
        body: dict[str, Any] = {"method": method, "args": args or [], "kwargs": kwargs or {}}
        results = self._call("POST", "/collective_rpc", json=body, timeout=timeout_s)
        found = results.get("results", [])
        return found if isinstance(found, list) else [found]

    def complete(self, model: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy completion of ``prompt_ids``; the new token ids."""
        return self.completion(model, prompt_ids, max_tokens).token_ids

    def completion(self, model: str, prompt_ids: list[int], max_tokens: int) -> Generation:
        """Greedy ``/v1/completions`` of ``prompt_ids`` (no weight-version spans there)."""
        body = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        choices = self._call("POST", "/v1/completions", json=body).get("choices") or [{}]
        ids = choices[0].get("token_ids")
        if not isinstance(ids, list):
            raise SidecarError(
                "vLLM returned no token_ids (a server older than return_token_ids?)",
                code=WireCode.RUNNER_FAILED,
            )
        reason = choices[0].get("finish_reason")
        return Generation([int(t) for t in ids], None, None if reason is None else str(reason))

    # ------------------------------------------------------------------ plumbing

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        where = f"{method} {self.base_url}{path}"
        extra: dict[str, Any] = {}
        if timeout is not None:
            extra["timeout"] = httpx.Timeout(timeout, connect=self._http.timeout.connect)
        try:
            response = self._http.request(method, path, json=json, params=params, **extra)
        except httpx.TimeoutException as exc:
            raise SidecarError(
                f"{where} timed out ({type(exc).__name__})", code=WireCode.COMMAND_TIMEOUT
            ) from None
        except httpx.TransportError as exc:
            raise SidecarError(
                f"{where}: no vLLM server answers ({type(exc).__name__}: {exc})",
                code=WireCode.MODEL_NOT_LOADED,
            ) from None
        if response.status_code >= 400:
            raise _http_error(where, path, response)
        if not response.content:
            return {}
        try:
            body = response.json()
        except ValueError:
            raise SidecarError(
                f"{where}: answer is not JSON: {response.text[:200]!r}",
                code=WireCode.RUNNER_FAILED,
                status=response.status_code,
            ) from None
        return body if isinstance(body, dict) else {"results": body}


def _http_error(where: str, path: str, response: httpx.Response) -> SidecarError:
    status = response.status_code
    detail = _error_text(response)
    if status == 404 and not path.startswith("/v1/"):
        message = (
            f"{where}: HTTP 404: vLLM's dev endpoints exist only when vllm serve runs with "
            "VLLM_SERVER_DEV_MODE=1"
        )
    elif status in (401, 403):
        message = f"{where}: HTTP {status}, check the runner's api_key: {detail}"
    else:
        message = f"{where}: HTTP {status}: {worker_message(detail)}"
    return SidecarError(message, code=WireCode.RUNNER_FAILED, status=status, detail=detail)


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            return str(error.get("message", error))[:4000]
        return str(error)[:4000]
    return str(body)[:4000]


class SidecarEngine:
    """The runner's engine interface over a sidecar's HTTP endpoints (see vllm_engine.Engine)."""

    def __init__(
        self,
        client: SidecarClient,
        *,
        model: str,
        served_model_name: str | None,
        startup_timeout_s: float,
        reload_timeout_s: float,
    ) -> None:
        self.client = client
        self.model = model
        self.served_model_name = served_model_name
        self.startup_timeout_s = startup_timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.vllm_version = "unknown"
        self.device = "unknown"
        self.dtype = "unknown"
        self._fields: dict[str, dict[str, Any]] = {}
        #: Why /server_info gave nothing (None: it answered, or it was not asked yet).
        self.server_info_error: str | None = None

    def start(self) -> bool:
        """Wait for the server, check it serves ``model`` in dev mode; True if found paused."""
        self.client.wait_healthy(self.startup_timeout_s)
        self.vllm_version = self.client.version()
        models = self.client.models()
        wanted = [m for m in models if self.served_model_name in (None, m.get("id"))]
        if not wanted:
            served = [m.get("id") for m in models]
            raise SidecarError(
                f"{self.client.base_url} serves {served}, not {self.served_model_name!r}",
                code=WireCode.RUNNER_FAILED,
            )
        root = str(wanted[0].get("root") or wanted[0].get("id"))
        if os.path.realpath(root) != os.path.realpath(self.model):
            raise SidecarError(
                f"{self.client.base_url} was started from {root!r}, this runner's model is "
                f"{self.model!r}: the manifest check would compare against the wrong checkpoint",
                code=WireCode.RUNNER_FAILED,
            )
        self.served_model_name = str(wanted[0].get("id"))
        paused = self.client.is_paused()  # also proves dev mode (404 otherwise)
        self._describe_from_server_info()
        return paused

    def _describe_from_server_info(self) -> None:
        """Config fields, dtype and device from /server_info, if it answers; nothing needs them.

        vLLM's /server_info also runs its ``collect_env``, which shells out (``pip list``, or
        ``uv pip list`` in a uv-made environment without pip, found through the server's PATH)
        and answers HTTP 500 when that command is missing. So it is asked once, at start, and a
        failure only leaves the fields unknown: vLLM then judges override names itself.
        """
        try:
            info = self.client.server_info()
        except SidecarError as exc:
            if exc.status is None:
                raise  # no answer at all: the server went away after /health
            self.server_info_error = exc.message
            return
        self.server_info_error = None
        self._fields = {
            s: dict(info[s])
            for s in ("model_config", "load_config")
            if isinstance(info.get(s), dict)
        }
        model_config = self._fields.get("model_config", {})
        self.dtype = str(model_config.get("dtype", "unknown")).removeprefix("torch.")
        device = info.get("device_config") or {}
        if isinstance(device, dict):
            self.device = str(device.get("device_type") or device.get("device") or "unknown")

    def config_fields(self) -> dict[str, dict[str, Any]]:
        return {s: dict(v) for s, v in self._fields.items()}

    def dry_run_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        pass  # nothing to run it on: the runner's own checks stand in

    def update_config(self, overrides: dict[str, dict[str, Any]]) -> None:
        self.client.collective_rpc("update_config", args=[overrides])

    def pause(self, mode: PauseMode, timeout_s: float) -> tuple[int, int]:
        """vLLM's ``/pause``; returns (requests in flight, requests aborted), from vLLM's own
        counts read before and after it (see :meth:`RequestCounts.drained`; 0, 0 without them)."""
        before = self.client.request_counts()
        self.client.pause(mode, timeout_s=timeout_s)
        after = self.client.request_counts()
        if before is None or after is None:
            return 0, 0
        return before.drained(after, mode)

    def abort_held(self, timeout_s: float) -> int:
        """Paused: vLLM's ``/pause?mode=abort`` ends every request it holds (those a ``keep``
        pause froze, those queued since), each with finish reason ``abort``; vLLM stays paused
        until :meth:`resume`. After a reload that left weights of no version: nothing it held
        goes on on them. Returns how many vLLM counted aborted (0 without its metrics)."""
        return self.pause("abort", timeout_s)[1]

    def resume(self) -> None:
        self.client.resume()

    def reload(self, weights_dir: str) -> None:
        self.client.collective_rpc(
            "reload_weights", kwargs={"weights_path": weights_dir}, timeout_s=self.reload_timeout_s
        )

    def reset_prefix_cache(self) -> bool:
        return self.client.reset_prefix_cache()

    def set_weight_version(self, version: str) -> None:
        self.client.set_weight_version(version)

    def running_requests(self) -> int:
        return self.client.running_requests()

    def get_weight_version(self) -> str:
        return self.client.get_weight_version()

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        """One completion over HTTP; vLLM's own /pause drains it."""
        model = self.served_model_name or self.model
        return self.client.completion(model, prompt_ids, max_tokens)

    def close(self) -> None:
        self.client.close()
