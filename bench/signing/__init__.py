"""A signed command's check on the worker: the cost of verifying one command, against decoding it.

For commands of three sizes (a label selector; pinned to 1,000 workers, a JSON array; pinned to
10,000, packed), in memory, best of several interleaved passes, per command:

* **decode** (the baseline, paid by every command today): ``decode_command`` of the record;
* **verify**: what a worker with a trust store adds (``TrustGate.admit``: the record's JSON
  object, its RFC 8785 canonical bytes, the Ed25519 verification, the scope), and its parts;
* **sign**: what a producer pays (``Signer.sign``).

Prints each as microseconds and as a ratio to decode. Target: verify < 1 ms per command.

    .venv/bin/python -m bench.signing --quick
"""
