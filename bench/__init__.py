"""Benchmarks: fan-out, status aggregation and reload bandwidth, each against its floor."""
