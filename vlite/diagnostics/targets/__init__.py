"""Where the leak checker runs a workload and reads the engine: in process (``inprocess``),
against ``vlite serve`` over HTTP (``http``), against any OpenAI-compatible server as a black
box (``blackbox``: its ``/metrics`` page through one adapter per server kind, its process
tree's memory), or after the fact from a server's stats log (``from_log``). See docs/leak-check.md."""
