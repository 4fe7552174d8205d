"""Where the tokens of a packed batch live: each rank's token indices and positions under a
partitioner, and sharding a full packed tensor into a rank's shard and back."""

import operator
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._library import ops

PARTITIONERS = ("contiguous", "round_robin", "zigzag", "balanced")

CuSeqlens = Union[torch.Tensor, Sequence[int]]


def cu_seqlens_list(cu_seqlens: CuSeqlens) -> Tuple[int, ...]:
    """`cu_seqlens` as a tuple of ints (a CUDA tensor is copied to the host, which waits for it),
    checked: integers (an integer tensor, or ints; never a float such as 36.5 or 36.0), at least
    one offset, starting at 0, never decreasing, below 2^31. Raises ValueError naming the first
    fault."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError("ringattn: cu_seqlens must be 1-D (batch + 1 offsets)")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or \
                cu_seqlens.dtype == torch.bool:
            raise ValueError(f"ringattn: cu_seqlens must hold integers (got a tensor of "
                             f"{cu_seqlens.dtype})")
        values = cu_seqlens.tolist()
    else:
        values = list(cu_seqlens)
    offsets = []
    for i, x in enumerate(values):
        if isinstance(x, bool) or isinstance(x, float):
            raise ValueError(f"ringattn: cu_seqlens must hold integers (entry {i} is {x!r})")
        try:
            offsets.append(operator.index(x))
        except TypeError:
            raise ValueError(f"ringattn: cu_seqlens must hold integers (entry {i} is "
                             f"{x!r})") from None
    if not offsets:
        raise ValueError("ringattn: cu_seqlens must hold batch + 1 offsets (got none)")
    if offsets[0] != 0:
        raise ValueError(f"ringattn: cu_seqlens must start at 0 (got {offsets[0]})")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"ringattn: cu_seqlens must not decrease (entry {i}: "
                             f"{offsets[i - 1]} then {offsets[i]})")
    if offsets[-1] >= 2 ** 31:
        raise ValueError(f"ringattn: cu_seqlens holds {offsets[-1]} tokens, beyond the int32 "
                         f"offsets of the library (at most 2^31 - 1)")
    return tuple(offsets)


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
