"""Tooling on top of hal: the CLI, the conformance kit, benchmarks, the pytest plugin, test helpers."""
