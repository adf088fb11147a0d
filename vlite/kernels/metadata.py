"""AttentionMetadata: the per-step layout of the packed batch that every attention backend reads.

It stands in a file of its own so that the backends (``torch_ref``, ``triton_paged_attention``)
and their dispatcher (``attention``) all import it from below, never from each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed batch (built by the model runner).

    slot_mapping:    [T] int64, cache slot of each token (block_id * block_size + offset); -1 = skip.
    query_start_loc: [B + 1] int64, cumulative query lengths; sequence i owns tokens
                     query_start_loc[i]:query_start_loc[i+1].
    seq_lens:        [B] int64, context length of each sequence after this step (tokens).
    block_tables:    [B, max_blocks] int64, physical block ids, padded with 0.
    num_decodes:     the first num_decodes sequences are decodes (one query token each).
    query_lens / seq_lens_list: the same lengths as Python ints (no device syncs in loops).
    plan_cache: what a backend derives from this layout once per step and reuses in every layer
        (e.g. the torch path's decode groups and padding masks).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens: list[int]
    seq_lens_list: list[int]
    block_size: int
    plan_cache: dict = field(default_factory=dict, repr=False, compare=False)
