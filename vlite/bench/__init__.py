"""Benchmarks: workloads, runners, serving client and vLLM-compatible metrics (``vlite bench``)."""
