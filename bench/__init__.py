"""Benchmarks (``hybridflow bench NAME``): measurements written to bench/results/ and docs/benchmarks.md."""
