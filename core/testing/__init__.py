"""Conformance suites any backend plugin can run against the torch_native references."""
