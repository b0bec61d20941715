"""Benchmarks: the engine at real scale (spec_engine) and, later, the load generator."""
