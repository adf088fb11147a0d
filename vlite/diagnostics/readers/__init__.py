"""Readers of what a server exposes (its ``/metrics`` page), as typed facts for the checks."""
