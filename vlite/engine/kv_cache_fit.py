"""Does the KV cache the options ask for fit in memory? Checked before anything is allocated.

A ``--kv-cache-memory-bytes`` or ``--num-blocks`` larger than the memory there is would fail
deep inside ``torch.zeros`` (a 50-line traceback ending in "can't allocate memory"). Here the
asked-for size is compared with the memory there is, and a size that cannot fit is one
``ValueError`` line naming the option and the largest value that fits:

- CPU: the machine's available memory (``psutil.virtual_memory().available``);
- CUDA: the GPU's free memory (``torch.cuda.mem_get_info``).

``check_kv_cache_fits`` runs twice: before the model loads (from config.json or the GGUF's
metadata: the weights still to load are estimated from the shapes and subtracted), and again in
``LLMEngine`` right before the KV cache is allocated (the weights are in memory by then). The KV
cache may take at most ``KV_FRACTION_OF_AVAILABLE`` of what is left: activations, the sampler and
the allocator need the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_FRACTION_OF_AVAILABLE = 0.9
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryAvailable:
    """Bytes the KV cache may be carved from, and where the figure comes from (for the message)."""

    bytes: int
    source: str  # e.g. "available memory (psutil)"


def available_memory(device_type: str) -> MemoryAvailable:
    """The memory a new allocation on ``device_type`` ("cpu" | "cuda") can take now, bytes."""
    if device_type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return MemoryAvailable(int(free), "free GPU memory (torch.cuda.mem_get_info)")
    import psutil

    return MemoryAvailable(int(psutil.virtual_memory().available), "available memory (psutil)")


def kv_bytes_per_block(hf_config, block_size: int, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes one block of ``block_size`` tokens takes in K and V of all layers, over all ranks
    (KV heads are replicated when there are more ranks than KV heads), from the model's config."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads_all_ranks = max(kv_heads, tensor_parallel_size)
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads_all_ranks * head_dim * _ITEMSIZE[dtype]


def estimate_weight_bytes(hf_config, dtype: str) -> int:
    """Bytes of a Llama-family model's weights in ``dtype``, from its config's shapes (embeddings,
    attention, MLP, norms; the LM head unless tied to the embeddings)."""
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    vocab, inter = hf_config.vocab_size, hf_config.intermediate_size
    per_layer = h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * inter + 2 * h
    embeddings = vocab * h * (1 if getattr(hf_config, "tie_word_embeddings", False) else 2)
    return (embeddings + hf_config.num_hidden_layers * per_layer + h) * _ITEMSIZE[dtype]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_kv_cache_fits(*, num_blocks: int | None, kv_cache_memory_bytes: int | None, bytes_per_block: int,
                        block_size: int, device_type: str, weights_to_load: int = 0,
                        available: MemoryAvailable | None = None) -> None:
    """Raise if the KV cache the options ask for cannot fit.

    Args:
        num_blocks: ``--num-blocks`` (None: sized from the byte budget).
        kv_cache_memory_bytes: ``--kv-cache-memory-bytes`` (CPU; None: the 1 GiB default, which is
            not checked: it is sized for the default model on any machine that runs it).
        bytes_per_block: bytes one block takes over all layers and ranks.
        weights_to_load: bytes of weights not yet in memory (before the model loads), subtracted.
        available: the memory figure (default: ``available_memory(device_type)``, read now).

    Raises:
        ValueError: one line naming the option, the bytes it needs, the memory there is, and the
            largest value of that option that fits.
    """
    if num_blocks is None and (kv_cache_memory_bytes is None or device_type == "cuda"):
        return  # sized by the engine from a budget it derives itself (default bytes, or a profile on CUDA)
    avail = available or available_memory(device_type)
    room = int(max(0, avail.bytes - weights_to_load) * KV_FRACTION_OF_AVAILABLE)
    weights = f", less about {_gib(weights_to_load)} for the weights still to load" if weights_to_load else ""
    where = (f"{avail.source} is {_gib(avail.bytes)}{weights}; the KV cache may take "
             f"{KV_FRACTION_OF_AVAILABLE:.0%} of the rest")
    if num_blocks is not None:
        need = num_blocks * bytes_per_block
        if need > room:
            largest = room // bytes_per_block
            hint = (f"the largest --num-blocks that fits is {largest}" if largest else
                    f"not even one block of {bytes_per_block} bytes fits")
            raise ValueError(f"--num-blocks {num_blocks} does not fit: {num_blocks} blocks x {bytes_per_block} bytes "
                             f"({block_size} tokens each) = {_gib(need)}, but {where}; {hint}")
        return
    if kv_cache_memory_bytes > room:
        largest = room // bytes_per_block * bytes_per_block
        hint = (f"the largest --kv-cache-memory-bytes that fits is {largest} ({_gib(largest)}, "
                f"{largest // bytes_per_block} blocks)" if largest else
                f"not even one block of {bytes_per_block} bytes fits")
        raise ValueError(f"--kv-cache-memory-bytes {kv_cache_memory_bytes} ({_gib(kv_cache_memory_bytes)}) does not "
                         f"fit: {where}; {hint}")
