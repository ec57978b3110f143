"""Weights: where they may come from, and the verified in-place copy from safetensors."""
