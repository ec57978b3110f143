"""Checkpoints of the demo models, written offline (used by the demo and the tests)."""
