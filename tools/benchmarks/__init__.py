"""Benchmarks: ``python -m tools.benchmarks.<name>`` from the repository root (tools/README.md)."""
