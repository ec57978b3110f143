"""Reload pause per drain policy, with requests in flight: wait, abort and keep, against an idle reload.

A client keeps N greedy generation requests going (N threads, each sending the same fixed prompt
back to back) while the weights are reloaded v1 -> v2 -> v1 ... on one engine, in rounds. Each
round reloads once with no request in flight (the **baseline**: the idle reload's wall time,
taken in the same run, interleaved with the rest) and once per drain policy under load
(``ReloadWeightsSpec.drain``: ``wait``, ``abort``, ``keep``; docs/wire.md "Drain and cache
policy"). Per policy it reports:

* **paused_s** (p50/p99): the ack's ``result["drain"]["paused_s"]`` (the runner's
  ``ReloadResult``, which the agent puts into the ack as is), as the runner defines it (the
  torch runner: from asking for the gate to releasing it, the drain and the copy; see
  docs/wire.md and docs/vllm.md for vLLM's);
* **gap** (p50/p99): measured by the client, the longest interval with no arrival that overlaps
  the reload (arrivals: the torch model's decode steps, a sidecar's streamed chunks, the
  in-process vLLM engine's steps, its outputs being final-only): how long serving stopped,
  as a user sees it, next to the normal spacing of arrivals under the same load;
* **reload** (p50/p99): the reload's wall time under load;
* **queued** request latency (p50): of the requests that arrived during a reload, against
  that of the others;
* requests **failed** (by cause), **completed**, and **mixed** (a response generated partly
  with each version: its tokens match neither version's greedy output, or vLLM's weight-version
  spans name two versions; only ``keep`` on vLLM may, by design);
* ratios: gap / idle reload, reload / idle reload (p50), queued / other requests.

Engines: the torch runner (``workers/runners/torch_runner.py``, a TinyLM whose decode steps are
timed) in ``.venv``, and vLLM (``workers/runners/vllm_runner.py``: in process, and in full mode a
``vllm serve`` sidecar) in ``.venv-vllm``, on a tiny Llama (``workers/demo/tiny_llama.py``).
Nothing goes through Kafka: the runner's reload is called directly, as the agent would.
The sidecar's load is its own (``--sidecar-clients``, ``--sidecar-new-tokens``; full: 4 clients,
128 tokens, on one kept-alive HTTP client): vLLM generates 16 tokens in ~35 ms, less than a
streamed request's HTTP round trips, so shorter requests are mostly done in vLLM when a reload's
pause lands and the drain policies have little to act on.

    .venv/bin/python -m bench.drain --quick                         # torch, seconds
    .venv/bin/python -m bench.drain                                 # torch, full
    .venv-vllm/bin/python -m bench.drain --engine vllm --quick      # vLLM in process
    .venv-vllm/bin/python -m bench.drain --engine vllm              # in process and sidecar
"""
