"""Tests of the benchmarks (tools that read results files, no GPU needed)."""
