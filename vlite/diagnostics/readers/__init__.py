"""Readers: what a server or a process exposes, as typed facts for the checks. The one ``/metrics``
reader (``metrics_text``), the servers' metric names (``adapters``), the samplers of the free list
and of process memory (``samplers``, ``process``), and the host and CUDA allocation tracers
(``alloc_trace``, ``gpu_alloc_trace``). Readers send no request of their own: targets drive the
server, readers read it.
"""
