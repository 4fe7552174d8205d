"""Where the tokens of a packed batch live: each rank's token indices and positions under a
partitioner, and sharding a full packed tensor into a rank's shard and back."""

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._library import ops

PARTITIONERS = ("contiguous", "round_robin", "zigzag")

CuSeqlens = Union[torch.Tensor, Sequence[int]]


def cu_seqlens_list(cu_seqlens: CuSeqlens) -> Tuple[int, ...]:
    """`cu_seqlens` as a tuple of ints (a CUDA tensor is copied to the host, which waits for it)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError("ringattn: cu_seqlens must be 1-D (batch + 1 offsets)")
        return tuple(int(x) for x in cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def check_partitioner(partitioner: str) -> str:
    if partitioner not in PARTITIONERS:
        raise ValueError(f"ringattn: unknown partitioner '{partitioner}' "
                         f"(one of {', '.join(PARTITIONERS)})")
    return partitioner


def rank_and_size(group: Optional[dist.ProcessGroup] = None, rank: Optional[int] = None,
                  ranks: Optional[int] = None) -> Tuple[int, int]:
    """(rank, ranks): given, or of `group` (the default group when torch.distributed is
    initialized), or (0, 1)."""
    if (rank is None) != (ranks is None):
        raise ValueError("ringattn: give both rank and ranks, or neither")
    if rank is not None:
        if group is not None:
            raise ValueError("ringattn: give a group, or rank and ranks, not both")
        return int(rank), int(ranks)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def token_indices(cu_seqlens: CuSeqlens, partitioner: str = "zigzag", *,
                  group: Optional[dist.ProcessGroup] = None, rank: Optional[int] = None,
                  ranks: Optional[int] = None) -> torch.Tensor:
    """Indices into the full packed batch of the tokens of a rank's shard, in the shard's order
    (int64, on the CPU). The rank is `group`'s own, or `rank` of `ranks`."""
    r, n = rank_and_size(group, rank, ranks)
    return ops.token_indices(check_partitioner(partitioner), list(cu_seqlens_list(cu_seqlens)),
                             n, r)


def position_ids(cu_seqlens: CuSeqlens, partitioner: str = "zigzag", *,
                 group: Optional[dist.ProcessGroup] = None, rank: Optional[int] = None,
                 ranks: Optional[int] = None) -> torch.Tensor:
    """Position within its sequence of every token of a rank's shard (int64, on the CPU), for
    rotary embeddings."""
    r, n = rank_and_size(group, rank, ranks)
    return ops.position_ids(check_partitioner(partitioner), list(cu_seqlens_list(cu_seqlens)),
                            n, r)


def shard(x: torch.Tensor, cu_seqlens: CuSeqlens, partitioner: str = "zigzag", *,
          group: Optional[dist.ProcessGroup] = None, rank: Optional[int] = None,
          ranks: Optional[int] = None, dim: int = 0) -> torch.Tensor:
    """A rank's shard of `x`, a tensor over the full packed batch along `dim`."""
    idx = token_indices(cu_seqlens, partitioner, group=group, rank=rank, ranks=ranks)
    total = cu_seqlens_list(cu_seqlens)[-1]
    if x.size(dim) != total:
        raise ValueError(f"ringattn: x has {x.size(dim)} tokens along dim {dim} but cu_seqlens "
                         f"holds {total}")
    return x.index_select(dim, idx.to(x.device))


def unshard(x: torch.Tensor, cu_seqlens: CuSeqlens, partitioner: str = "zigzag", *,
            group: Optional[dist.ProcessGroup] = None, dim: int = 0) -> torch.Tensor:
    """The full packed batch from every rank's shard `x` (along `dim`), on every rank: an
    all-gather over `group` (collective), then each token back in its place."""
    cu = cu_seqlens_list(cu_seqlens)
    rank, ranks = rank_and_size(group)
    indices = [token_indices(cu, partitioner, rank=r, ranks=ranks) for r in range(ranks)]
    if x.size(dim) != indices[rank].numel():
        raise ValueError(f"ringattn: this rank's shard holds {indices[rank].numel()} tokens, "
                         f"x has {x.size(dim)} along dim {dim}")
    if ranks == 1:
        parts = [x]
    else:
        longest = max(i.numel() for i in indices)
        padded_shape = list(x.shape)
        padded_shape[dim] = longest
        padded = x.new_zeros(padded_shape)
        padded.narrow(dim, 0, x.size(dim)).copy_(x)
        gathered = [torch.empty_like(padded) for _ in range(ranks)]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        parts = [g.narrow(dim, 0, i.numel()) for g, i in zip(gathered, indices)]
    shape = list(x.shape)
    shape[dim] = cu[-1]
    full = x.new_empty(shape)
    full.index_copy_(dim, torch.cat(indices).to(x.device), torch.cat(parts, dim))
    return full
