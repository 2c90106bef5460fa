"""Benchmarks: seeded workloads, each checked against a reference before it is timed."""
