"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel-launch overhead (dozens of kernels per
layer, each a few microseconds of work). As in vLLM, we capture the model's forward for a
pure-decode batch once per *bucket* of batch sizes (1, 2, 4, 8, then every 8 up to
max_num_seqs) and replay it: a batch of n sequences runs in the smallest bucket b >= n, with
the b - n spare rows padded so that they do no harm:

  * slot_mapping -1: ``store_kvcache`` skips the row, so the cache is not touched;
  * seq_len 0: the Triton decode kernel writes a zero output for the row and reads no K/V;
  * input id 0 / position 0: any valid index; the row's hidden state is never read.

A graph replays fixed addresses with fixed launch sizes, so every step copies its inputs into
static buffers, and the decode kernel's partition count is fixed at capture from
max_model_len (``paged_decode``'s ``max_seq_len``), which serves every shorter context.

The bucket and padding logic is plain torch and is tested on CPU, and so is the condition for
capture: no op of a step syncs with the host (``tests/engine/test_capture_safety.py``). Capture
and replay themselves need CUDA and, at the time of writing (2026-12-04), have not run on a GPU
since that condition was met (see docs/kernels.md).
"""

from __future__ import annotations

import bisect
import logging

import torch

from vlite.kernels.attention import AttentionMetadata

logger = logging.getLogger("vlite.engine")


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8, capped by and ending at max_num_seqs.

    >>> decode_buckets(20)
    [1, 2, 4, 8, 16, 20]
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {1, 2, 4, 8, *range(16, max_num_seqs + 1, 8), max_num_seqs}
    return sorted(s for s in sizes if s <= max_num_seqs)


def pick_bucket(buckets: list[int], num_seqs: int) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences, or None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class DecodeGraphRunner:
    """Static input buffers for bucketed decode batches, and one captured graph per bucket.

    Args:
        model: the model; called as ``model(input_ids, positions, kv_caches, meta)`` -> [T, H].
        kv_caches: the model runner's per-layer (K, V) caches.
        block_size: tokens per cache block.
        max_num_seqs, max_model_len: the largest batch and the longest context to serve.

    On CPU (tests) nothing is captured and ``run`` calls the model eagerly on the padded
    buffers: the same inputs a replay would see.
    """

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        n = self.buckets[-1]
        long = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.full((n,), -1, **long)
        self.seq_lens = torch.zeros(n, **long)
        self.block_tables = torch.zeros((n, self.max_blocks), **long)
        self.query_start_loc = torch.arange(n + 1, **long)  # one query per sequence, always
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Metadata over the first ``bucket`` rows of the static buffers. ``seq_lens_list``
        holds max_model_len, an upper bound: it fixes the decode kernel's launch size."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc[:bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket], num_decodes=bucket,
            query_lens=[1] * bucket, seq_lens_list=[self.max_model_len] * bucket, block_size=self.block_size)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a pure-decode step that fits a bucket and the buffers' block-table width."""
        num_seqs = len(meta.query_lens)
        return (meta.num_decodes == num_seqs and num_seqs <= self.buckets[-1]
                and meta.block_tables.shape[1] <= self.max_blocks)

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode step into the static buffers and pad it to its bucket; returns the bucket."""
        n = len(meta.query_lens)
        bucket = pick_bucket(self.buckets, n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past a sequence's last block keep stale ids: the kernels never read them.
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)  # store_kvcache skips these rows
        self.seq_lens[n:bucket].zero_()        # attention reads no K/V for them
        return bucket

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, H] of a decode step (``can_run(meta)`` must hold). The result is a
        view of a graph's output buffer, valid until the next ``run``."""
        n = len(meta.query_lens)
        bucket = self.prepare(input_ids, positions, meta)
        graph = self.graphs.get(bucket)
        if graph is None:  # not captured (CPU tests): the same padded inputs, run eagerly
            return self._forward(bucket)[:n]
        graph.replay()
        return self.outputs[bucket][:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, self.metadata(bucket))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (as vLLM does: the
        smaller graphs reuse the largest one's activation memory). CUDA only.

        Each bucket first runs once eagerly, so Triton compiles its kernels outside capture;
        all rows are padding then (seq_len 0, slot -1), so the cache is left untouched.
        """
        if self.input_ids.device.type != "cuda":
            raise RuntimeError("CUDA graphs need CUDA tensors")
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = None
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(bucket)  # warm-up: compiles and autotunes outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)


def capture_decode_graphs(model, kv_caches, block_size: int, max_num_seqs: int, max_model_len: int,
                          device: torch.device) -> DecodeGraphRunner:
    """Build a ``DecodeGraphRunner`` and capture its graphs (CUDA only)."""
    runner = DecodeGraphRunner(model, kv_caches, block_size, max_num_seqs, max_model_len, device)
    runner.capture()
    return runner
