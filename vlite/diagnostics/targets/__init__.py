"""Where the leak checker runs a workload and reads the engine, behind one interface
(``base.LeakCheckTarget``): in process (``inprocess``), against ``vlite serve`` over HTTP
(``http``), against any OpenAI-compatible server as a black box (``blackbox``: its ``/metrics``
page through one adapter per server kind, its process tree's memory), watching a server without
sending a request (``watch``), judging a range Prometheus holds (``prometheus_range``), or after
the fact from a server's stats log (``from_log``). See docs/leak-check/README.md."""
