"""Benchmarks: each a `moerl bench-*` subcommand that prints a table and writes its results as JSON."""
