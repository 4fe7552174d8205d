"""ringattn_torch: context-parallel (ring) attention from PyTorch.

    import ringattn_torch as ra
    q, k, v = (ra.shard(x, cu_seqlens, "zigzag") for x in (q_full, k_full, v_full))
    out, lse = ra.ring_attention(q, k, v, cu_seqlens, partitioner="zigzag", mask="causal")

`ring_attention` runs this rank's shards over a torch.distributed group (CUDA tensors over NCCL,
CPU tensors over gloo) with autograd; `virtual_ring_attention` runs every rank of a ring as
threads of this process; `shard`, `unshard`, `token_indices` and `position_ids` lay a packed
batch out over the ranks. `ShardedDecoder` decodes over a KV cache sharded across the ranks
(slab or paged), `owned_new_rows` says which new tokens a rank appends to its shard.
"""

from ._library import has_cudnn_kernel, has_device_path
from .attention import KERNELS, MASKS, SCHEDULES, ring_attention, virtual_ring_attention
from .decode import ShardedDecoder, owned_new_rows
from .layout import PARTITIONERS, position_ids, shard, token_indices, unshard

__all__ = [
    "KERNELS", "MASKS", "PARTITIONERS", "SCHEDULES", "ShardedDecoder", "has_cudnn_kernel",
    "has_device_path", "owned_new_rows", "position_ids", "ring_attention", "shard",
    "token_indices", "unshard", "virtual_ring_attention",
]
__version__ = "0.1.0"
