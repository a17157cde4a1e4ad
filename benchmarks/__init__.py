"""Benchmarks of the SDC checks' cost (see docs/performance.md). Entry point: ``python -m benchmarks``."""
