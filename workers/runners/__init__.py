"""Model runners: the interface, torch, torch_xla, vLLM (in-process and sidecar), fake."""
