"""The torch and XLA runners on real checkpoints: reloads, refusals, corruption, config.

Every test runs on each runner: torch on the CPU, XLA through PJRT on the CPU (marked ``xla``),
and torch on CUDA where a GPU is (marked ``gpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import TINY, MakeCheckpoint, MakeRunner
from workers.demo.checkpoints import (
    BrokenKind,
    model_tensors,
    sha256_manifest,
    write_broken,
    write_safetensors,
)
from workers.runners.base import Runner
from workers.runners.tiny_lm import tiny_lm
from workers.runners.torch_runner import TorchRunner
from workers.weights.digest import SAMPLE_ELEMENTS, sample, weights_digest
from workers.weights.loaders import open_checkpoint

IDS = [72, 101, 108, 108, 111, 44, 32, 119]  # "Hello, w"


def spec(path: Path, version: str, **kw: Any) -> ReloadWeightsSpec:
    return ReloadWeightsSpec(path=str(path), version=version, **kw)


def reference(seed: int, model_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """Logits of a fresh CPU model built with ``seed``: what a reload must reproduce."""
    model = tiny_lm(**{**TINY, **(model_kwargs or {})}, seed=seed)
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([IDS]))[0]
    return out


def assert_same_model(runner: TorchRunner, seed: int, **kw: Any) -> None:
    got = runner.forward_logits(IDS)
    want = reference(seed, **kw)
    if runner.name == "torch" and runner.options.device == "cpu":
        assert torch.equal(got, want)
    else:  # a different backend: same weights, float rounding may differ
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_reload_equals_a_fresh_model_from_the_new_seed(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    runner = make_runner()
    assert isinstance(runner, Runner)
    assert_same_model(runner, 0)
    assert not torch.equal(reference(0), reference(1))
    path = make_checkpoint(1)
    result = runner.reload_weights(spec(path, "v1"), path)
    assert_same_model(runner, 1)
    described = runner.describe()
    assert (described.weights_version, described.degraded) == ("v1", None)
    assert result.version == "v1" and result.files == 1
    assert result.tensors == len(model_tensors(model_kwargs=TINY))
    assert result.bytes == sum(
        t.numel() * t.element_size() for t in model_tensors(model_kwargs=TINY).values()
    )
    assert described.extra["last_reload"] == result.as_dict()


def test_sharded_checkpoint_by_index_and_by_directory(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    runner = make_runner()
    index = make_checkpoint(2, shards=3)
    assert index.name == "model.safetensors.index.json"
    result = runner.reload_weights(spec(index, "v2"), index)
    assert result.files == 3
    assert_same_model(runner, 2)
    other = make_checkpoint(3, shards=2)
    runner.reload_weights(spec(other.parent, "v3"), other.parent)
    assert_same_model(runner, 3)


def test_sha256_manifest_ok_and_mismatch(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    runner = make_runner()
    index = make_checkpoint(4, shards=2)
    manifest = sha256_manifest(index)
    assert len(manifest) == 2
    runner.reload_weights(spec(index, "v4", sha256=manifest), index)
    assert_same_model(runner, 4)
    tampered = dict(manifest)
    first = sorted(tampered)[0]
    tampered[first] = "f" * 64
    other = make_checkpoint(5, shards=2)
    before = runner.forward_logits(IDS)
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec(other, "v5", sha256=tampered), other)
    assert info.value.code is WireCode.CHECKSUM_MISMATCH
    assert torch.equal(runner.forward_logits(IDS), before)
    assert runner.describe().weights_version == "v4"


@pytest.mark.parametrize("kind", list(BrokenKind), ids=[k.value for k in BrokenKind])
def test_broken_checkpoints_are_refused_and_change_nothing(
    make_runner: MakeRunner, tmp_path: Path, kind: BrokenKind
) -> None:
    runner = make_runner()
    before = runner.forward_logits(IDS)
    broken = write_broken(kind, tmp_path / kind.value, model_kwargs=TINY, seed=9)
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec(broken.path, "bad", sha256=broken.sha256), broken.path)
    assert not isinstance(info.value, WeightsCorrupted)
    assert info.value.code is broken.code
    assert info.value.is_rejection
    assert torch.equal(runner.forward_logits(IDS), before)  # bit for bit
    described = runner.describe()
    assert (described.weights_version, described.degraded) == ("init", None)


def test_non_strict_partial_reload(make_runner: MakeRunner, tmp_path: Path) -> None:
    runner = make_runner()
    head = {
        k: v
        for k, v in model_tensors(model_kwargs=TINY, seed=6).items()
        if k.startswith(("lm_head", "ln_f"))
    }
    path = tmp_path / "head.safetensors"
    write_safetensors(path, head)
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec(path, "head"), path)
    assert info.value.code is WireCode.WEIGHTS_MISSING
    result = runner.reload_weights(spec(path, "head", strict=False), path)
    assert result.tensors == len(head) == 3
    want = tiny_lm(**TINY, seed=0)
    want.load_state_dict(head, strict=False)
    with torch.no_grad():
        expected = want(torch.tensor([IDS]))[0]
    got = runner.forward_logits(IDS)
    if runner.name == "torch":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_tied_model_reloads_through_the_alias(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    runner = make_runner(model_kwargs={"tied": True})
    assert runner.describe().extra["tensors"] == len(
        model_tensors(model_kwargs={**TINY, "tied": True})
    )
    path = make_checkpoint(7, model_kwargs={"tied": True})
    runner.reload_weights(spec(path, "v7"), path)
    assert_same_model(runner, 7, model_kwargs={"tied": True})


def test_update_config_is_all_or_nothing_and_observable(make_runner: MakeRunner) -> None:
    runner = make_runner(config={"max_new_tokens": 2})
    assert len(runner.generate("Hi")) == 2
    digest = runner.describe().config_digest
    described = runner.update_config({"max_new_tokens": 3})
    assert described.config["max_new_tokens"] == 3 and described.config_digest != digest
    assert len(runner.generate("Hi")) == 3
    assert described.accepts == {
        "max_new_tokens": "integer",
        "temperature": "number",
        "top_k": "integer",
        "sampling_seed": "integer",
    }
    for bad, code in [
        ({"max_new_tokens": 5, "max_tokens": 5}, WireCode.CONFIG_KEY_REJECTED),
        ({"max_new_tokens": 5, "temperature": -1.0}, WireCode.CONFIG_VALUE_INVALID),
        ({"max_new_tokens": True}, WireCode.CONFIG_VALUE_INVALID),
        ({"max_new_tokens": 0}, WireCode.CONFIG_VALUE_INVALID),
    ]:
        with pytest.raises(RunnerError) as info:
            runner.update_config(bad)
        assert info.value.code is code
    assert len(runner.generate("Hi")) == 3
    assert runner.describe().config_digest == described.config_digest


def test_sampling_config_changes_output(make_runner: MakeRunner) -> None:
    runner = make_runner(config={"max_new_tokens": 4})
    greedy = runner.generate(IDS)
    assert greedy == runner.generate(IDS)  # deterministic
    runner.update_config({"temperature": 5.0, "sampling_seed": 1})
    sampled = runner.generate(IDS)
    assert sampled == runner.generate(IDS)  # seeded
    assert sampled != greedy


def test_model_not_loaded(make_runner: MakeRunner, make_checkpoint: MakeCheckpoint) -> None:
    runner = make_runner(load=False)
    described = runner.describe()
    assert not described.model_loaded and described.weights_version is None
    path = make_checkpoint(1)
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec(path, "v1"), path)
    assert info.value.code is WireCode.MODEL_NOT_LOADED and info.value.is_rejection
    runner.load()
    assert runner.describe().weights_version == "init"
    runner.close()
    with pytest.raises(RunnerError) as info:
        runner.reload_weights(spec(path, "v1"), path)
    assert info.value.code is WireCode.MODEL_NOT_LOADED
    runner.close()  # idempotent


def test_initial_checkpoint_option(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    path = make_checkpoint(8)
    runner = make_runner(initial_checkpoint=str(path), initial_version="boot-8")
    assert runner.describe().weights_version == "boot-8"
    assert_same_model(runner, 8)


def test_describe_reports_device(make_runner: MakeRunner, runner_kind: str) -> None:
    described = make_runner().describe()
    assert described.runner in ("torch", "xla") and described.model_loaded
    if described.runner == "xla":
        assert described.device.startswith("xla:") and "(CPU)" in described.device
    elif runner_kind == "cuda":
        assert described.device.startswith("cuda")
    else:
        assert described.device == "cpu"
    assert described.extra["phase"] == "idle"


def test_truncated_during_a_slow_reload_degrades_then_recovers(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    runner = make_runner(slow_copy_s=0.02)
    path = make_checkpoint(11)
    with open_checkpoint(path) as ckpt:  # cut right after the first tensor's bytes
        cut = min(e.offset + e.nbytes for e in ckpt.entries.values())
    errors: list[BaseException] = []

    def reload() -> None:
        try:
            runner.reload_weights(spec(path, "v11"), path)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reload)
    thread.start()
    deadline = time.monotonic() + 30
    while runner.describe().extra["progress"][0] < 1:  # describe never waits for the reload
        assert time.monotonic() < deadline and thread.is_alive(), "copying never began"
        time.sleep(0.005)
    os.truncate(path, cut)
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], WeightsCorrupted), errors
    error = errors[0]
    assert (error.from_version, error.to_version) == ("init", "v11")
    assert not error.is_rejection
    described = runner.describe()
    assert described.degraded is not None and described.degraded.code == "WEIGHTS_CORRUPTED"
    assert (described.degraded.from_version, described.degraded.to_version) == ("init", "v11")
    assert described.weights_version == "init"  # never advanced by a failure
    assert described.extra["weights_digest"] is None  # a mix of two versions has no digest
    with pytest.raises(RunnerError) as info:
        runner.generate(IDS)  # a half-written model does not serve
    assert info.value.code is WireCode.WEIGHTS_CORRUPTED
    with pytest.raises(RunnerError) as info:
        runner.probe("Hi", 2)  # nor probes
    assert info.value.code is WireCode.WEIGHTS_CORRUPTED

    good = make_checkpoint(12)
    recovered = runner.reload_weights(spec(good, "v12"), good)
    described = runner.describe()
    assert (described.weights_version, described.degraded) == ("v12", None)
    assert described.extra["weights_digest"] == recovered.weights_digest is not None
    assert_same_model(runner, 12)
    assert len(runner.generate(IDS)) == described.config["max_new_tokens"]


def buffer_pointers(runner: TorchRunner) -> dict[str, int]:
    """Where each XLA parameter's device buffer lives (the host address on PJRT's CPU)."""
    from torch_xla import _XLAC  # type: ignore[attr-defined]

    return {
        name: _XLAC._unsafe_buffer_pointer(tensor)
        for name, tensor in runner._targets.items()
        if tensor.numel()
    }


@pytest.mark.parametrize("host_alias", [True, False], ids=["host-alias", "device-copy"])
def test_reload_with_and_without_host_alias(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint, host_alias: bool
) -> None:
    runner = make_runner(host_alias=host_alias, read_threads=2)
    runner.generate(IDS)  # on XLA: compiles the graph that must then read the new weights
    copy_targets = runner._copy_targets(runner._targets)
    if runner.name == "xla" and host_alias:
        assert all(t.device.type == "cpu" for t in copy_targets.values() if t.numel())
        pointers = buffer_pointers(runner)
    else:
        assert all(copy_targets[k] is t for k, t in runner._targets.items())
    del copy_targets

    path = make_checkpoint(5)
    runner.reload_weights(spec(path, "v5"), path)
    assert_same_model(runner, 5)
    out = runner.generate(IDS)
    assert len(out) == runner.describe().config["max_new_tokens"]
    fresh = make_runner(seed=5, host_alias=host_alias)
    assert out == fresh.generate(IDS)  # the same backend, the same weights: the same tokens
    if runner.name == "xla" and host_alias:
        assert buffer_pointers(runner) == pointers, "read in place into the device buffers"

    # A second reload through the same aliases.
    path = make_checkpoint(6)
    runner.reload_weights(spec(path, "v6"), path)
    assert_same_model(runner, 6)
    assert runner.generate(IDS) == make_runner(seed=6, host_alias=host_alias).generate(IDS)


# --------------------------------------------------------------------------- probe

PROMPT = "Hello"


def test_probe_is_greedy_with_the_log_probabilities_of_its_tokens(
    make_runner: MakeRunner,
) -> None:
    """The tokens are greedy decoding's; the mean is that of each chosen token's log-softmax,
    read back from one forward pass over prompt and tokens (teacher forcing)."""
    runner = make_runner(config={"temperature": 5.0, "sampling_seed": 3})  # ignored by a probe
    result = runner.probe(PROMPT, 6)
    assert result is not None and len(result.tokens) == 6
    model = tiny_lm(**TINY, seed=0)
    prompt = list(PROMPT.encode())
    assert list(result.tokens) == model.generate(prompt, 6)
    ids = prompt + list(result.tokens)
    assert len(ids) <= TINY["max_seq"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)
    chosen = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(result.tokens)]
    assert result.mean_logprob == pytest.approx(sum(chosen) / len(chosen), abs=1e-4)
    assert result.mean_logprob < 0
    assert result.as_dict() == {
        "tokens": list(result.tokens),
        "mean_logprob": round(result.mean_logprob, 6),
    }


def test_probe_agrees_across_runners_and_follows_the_weights(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    one, two = make_runner(), make_runner()
    first = one.probe(PROMPT, 12)  # runs past max_seq: the window slides
    assert first is not None and len(first.tokens) == 12
    assert one.probe(PROMPT, 12) == first  # deterministic
    assert two.probe(PROMPT, 12) == first  # another runner, the same weights
    path = make_checkpoint(1)
    two.reload_weights(spec(path, "v1"), path)
    other = two.probe(PROMPT, 12)
    assert other is not None
    assert other.tokens != first.tokens or other.mean_logprob != first.mean_logprob
    back = make_checkpoint(0)
    two.reload_weights(spec(back, "v0"), back)
    assert two.probe(PROMPT, 12) == first


def test_probe_refusals(make_runner: MakeRunner) -> None:
    runner = make_runner(load=False)
    with pytest.raises(RunnerError) as info:
        runner.probe(PROMPT, 1)
    assert info.value.code is WireCode.MODEL_NOT_LOADED
    small = make_runner(model_kwargs={"vocab_size": 128})
    assert small.probe("plain ascii", 1) is not None
    with pytest.raises(RunnerError) as info:
        small.probe("caf\u00e9", 1)  # a UTF-8 byte above the vocabulary
    assert info.value.code is WireCode.RUNNER_FAILED


_PROBE_IN_ANOTHER_PROCESS = """
import json, sys, torch
torch.set_num_threads(1)
from workers.runners.torch_runner import TorchRunner
runner = TorchRunner(json.loads(sys.argv[1]))
runner.load()
print(json.dumps({**runner.probe(sys.argv[2], 10).as_dict(),
                  "digest": runner.describe().extra["weights_digest"]}))
"""


def test_probe_and_weights_digest_are_the_same_in_another_process(
    make_runner: MakeRunner, runner_kind: str, tmp_path: Path
) -> None:
    if runner_kind != "torch":
        pytest.skip("one backend is enough to show it")
    runner = make_runner(seed=5)
    result = runner.probe(PROMPT, 10)
    assert result is not None
    options = json.dumps({"model_kwargs": TINY, "seed": 5})
    out = subprocess.run(
        [sys.executable, "-c", _PROBE_IN_ANOTHER_PROCESS, options, PROMPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    theirs = json.loads(out.stdout)
    assert theirs["tokens"] == list(result.tokens)
    assert theirs["mean_logprob"] == pytest.approx(result.as_dict()["mean_logprob"], abs=1e-5)
    assert theirs["digest"] == runner.describe().extra["weights_digest"]


def test_weights_digest_agrees_on_equal_weights_and_differs_on_others(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    one, two, fresh = make_runner(), make_runner(), make_runner(seed=1)
    path = make_checkpoint(1)
    result = one.reload_weights(spec(path, "v1"), path)
    first = result.as_dict()["weights_digest"]
    assert isinstance(first, str) and len(first) == 64 and first == first.lower()
    int(first, 16)
    assert two.reload_weights(spec(path, "v1"), path).weights_digest == first
    assert one.describe().extra["weights_digest"] == first
    assert one.describe().extra["last_reload"] == result.as_dict()
    # Read from the model, not the file: a model built from seed 1 holds the same weights.
    assert fresh.describe().extra["weights_digest"] == first
    other = make_checkpoint(2)
    assert two.reload_weights(spec(other, "v2"), other).weights_digest != first
    back = make_checkpoint(1)
    assert two.reload_weights(spec(back, "again"), back).weights_digest == first


def test_a_failed_reload_keeps_the_previous_digest(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint, tmp_path: Path
) -> None:
    runner = make_runner()
    path = make_checkpoint(3)
    good = runner.reload_weights(spec(path, "v3"), path)
    broken = write_broken(BrokenKind.TRUNCATED, tmp_path / "broken", model_kwargs=TINY, seed=9)
    with pytest.raises(RunnerError):
        runner.reload_weights(spec(broken.path, "bad", sha256=broken.sha256), broken.path)
    described = runner.describe()
    assert described.extra["weights_digest"] == good.weights_digest is not None
    assert described.extra["last_reload"] == good.as_dict()


def test_weights_digest_reads_a_bounded_sample_of_each_tensor(
    make_runner: MakeRunner, make_checkpoint: MakeCheckpoint
) -> None:
    """Its cost does not grow with a tensor's size: at most 3 x 16 elements leave the device."""
    runner = make_runner()
    seen: list[int] = []
    to_host = runner._to_host

    def counting(samples: Any) -> list[torch.Tensor]:
        seen.extend(s.numel() for s in samples)
        return to_host(samples)

    runner._to_host = counting  # type: ignore[method-assign]
    path = make_checkpoint(4)
    runner.reload_weights(spec(path, "v4"), path)
    assert len(seen) == len(runner._targets)
    assert max(seen) <= 3 * SAMPLE_ELEMENTS
    assert max(t.numel() for t in runner._targets.values()) > 3 * SAMPLE_ELEMENTS


def test_weights_digest_covers_names_dtypes_shapes_and_sampled_elements() -> None:
    n = 1000
    flat = torch.arange(n, dtype=torch.float32)
    stride = n // SAMPLE_ELEMENTS
    want = [*range(16), *range(n - 16, n), *range(stride // 2, n, stride)][: 3 * 16]
    assert sample(flat).tolist() == want
    assert sample(torch.arange(5)).tolist() == [0, 1, 2, 3, 4] * 3  # short: every element, thrice
    base = {"a": flat.reshape(10, 100), "b": torch.ones(3, dtype=torch.bfloat16)}
    digest = weights_digest(base)
    assert weights_digest(dict(reversed(base.items()))) == digest  # name order, not dict order
    changed = [
        {"a2": base["a"], "b": base["b"]},
        {**base, "a": flat.reshape(100, 10)},
        {**base, "b": base["b"].half()},
        {**base, "a": flat.clone().index_fill_(0, torch.tensor([want[40]]), -1.0).reshape(10, 100)},
    ]
    assert all(weights_digest(c) != digest for c in changed)
    unsampled = next(i for i in range(n) if i not in want)
    blind = flat.clone().index_fill_(0, torch.tensor([unsampled]), -1.0).reshape(10, 100)
    assert weights_digest({**base, "a": blind}) == digest  # what it does not cover
