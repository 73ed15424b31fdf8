"""Benchmarks: speed and memory measured side by side in one run (decode, prefill, batching,
sessions, weight formats, grammars, the store), each printing ratios, not timed tests."""
