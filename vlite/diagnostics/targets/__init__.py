"""Black-box targets: any OpenAI-compatible server, read from its ``/metrics`` page (one adapter
per server kind), its process tree's memory, and its logs. See docs/leak-check.md."""
