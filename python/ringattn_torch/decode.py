"""Decoding over a KV cache sharded across ranks (the library's `sharded_attention`): every rank
keeps the K/V of the cached tokens it owns and attends with the new tokens' queries to them; the
ranks exchange their partial results and each ends with the same output, bit for bit, equal to
attention over the whole cache (the new tokens causal among themselves after it).

    dec = ra.ShardedDecoder(q_heads=32, kv_heads=8, head_dim=128)  # this rank of the group
    out, lse = dec.step(q, k, v, k_cache, v_cache, cu_new, cache_lengths)
    mine = ra.owned_new_rows(rank, ranks, cu_new, lengths)  # append these rows' k, v

A cache shard is `[rows, kv_heads, head_dim]` with its sequences packed in order (or starting at
`cache_begin`), or a pool of pages `[pages, page_size, kv_heads, head_dim]` read through a page
table per sequence. The page allocator is the caller's.
"""

import operator
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ._library import ops
from .attention import _device_scope, _group_communicator, _stream

Lengths = Union[Sequence[int], torch.Tensor]


def owned_new_rows(rank: int, ranks: int, cu_new: Sequence[int],
                   lengths: Lengths) -> torch.Tensor:
    """The rows of the new tokens (packed by `cu_new`) whose K/V rank `rank` of `ranks` keeps:
    row `cu_new[b] + i` sits at position `lengths[b] + i` of its sequence (`lengths[b]`: the
    sequence's cached tokens over all ranks before the step) and belongs to rank
    `position % ranks`. An int64 tensor of rows in order."""
    cu = _ints(cu_new, "cu_new")
    total = _ints(lengths, "lengths")
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"ringattn: rank {rank} is not one of {ranks}")
    if len(cu) < 1 or len(total) + 1 != len(cu) or cu[0] != 0:
        raise ValueError("ringattn: cu_new holds batch + 1 offsets from 0 and lengths one entry "
                         "per sequence")
    rows = []
    for b, n in enumerate(total):
        if n < 0 or cu[b + 1] < cu[b]:
            raise ValueError(f"ringattn: sequence {b} has a negative length or token count")
        first = (rank - n) % ranks  # the first new token at a position this rank owns
        rows.extend(range(cu[b] + first, cu[b + 1], ranks))
    return torch.tensor(rows, dtype=torch.long)


def _ints(x, name) -> List[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.is_floating_point() or x.is_complex():
            raise ValueError(f"ringattn: {name} must be a 1-D integer tensor or a list of ints")
        return [int(i) for i in x.tolist()]
    try:
        return [operator.index(i) for i in x]
    except TypeError:
        raise ValueError(f"ringattn: {name} must be a list of ints") from None


def _table(t) -> torch.Tensor:
    """A page table as an integer CPU tensor [batch, pages per sequence]."""
    if not isinstance(t, torch.Tensor):
        rows = [list(r) for r in t]
        width = max((len(r) for r in rows), default=0)
        t = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        return t.reshape(len(rows), width)
    if t.is_floating_point() or t.is_complex() or t.dim() != 2:
        raise ValueError("ringattn: a page table is an integer tensor [batch, pages per sequence]")
    return t.cpu()


class ShardedDecoder:
    """The steps of a decode over a sharded KV cache, for this process's rank of a
    torch.distributed group (CUDA tensors over NCCL, CPU tensors over the group's CPU backend) or
    for `ranks` virtual ranks, every one a thread of this process on the tensors' device.

    Each `step` plans the step from the caches' description and runs it (collective: every rank
    of the group calls it with the same `cu_new`). A bad argument on any rank makes every rank
    raise ValueError before anything runs, and the next step works as before."""

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int,
                 head_dim_v: Optional[int] = None, *, softmax_scale: Optional[float] = None,
                 ranks: Optional[int] = None, group=None, timeout: float = 600.0):
        if ranks is not None and group is not None:
            raise ValueError("ringattn: a decoder runs virtual ranks or a group's rank, not both")
        if ranks is None and group is None:
            if dist.is_available() and dist.is_initialized():
                group = dist.group.WORLD
            else:
                ranks = 1
        if ranks is not None and (isinstance(ranks, bool) or operator.index(ranks) < 1):
            raise ValueError(f"ringattn: ranks must be at least 1 (got {ranks})")
        self._dims = [int(q_heads), int(kv_heads), int(head_dim),
                      int(head_dim_v if head_dim_v is not None else head_dim)]
        self._scale = float(softmax_scale or 0.0)
        self._virtual = ranks
        self._group = group
        self._timeout = float(timeout)
        self._impl = None
        self._device = None
        self._communicator = None

    @property
    def ranks(self) -> int:
        """Ranks of the decode (the group's size, or the virtual ranks)."""
        return self._virtual if self._virtual is not None else dist.get_world_size(self._group)

    def _decoder(self, device: torch.device):
        if self._impl is not None and self._device == device:
            return self._impl
        self._impl = None
        index = -1
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        with _device_scope(device):
            if self._virtual is not None:
                impl = ops.decoder(None, self._virtual, index, self._dims, self._scale)
            else:
                self._communicator = _group_communicator(self._group, device, self._timeout)
                try:
                    impl = ops.decoder(self._communicator.endpoint(), 0, index, self._dims,
                                       self._scale)
                except Exception:
                    self._communicator.drop()
                    raise
        self._impl, self._device = impl, device
        return impl

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache,
             cu_new: Sequence[int], cache_lengths, *, cache_begin=None, page_table=None,
             every_rank: bool = False):
        """One step. `q`, `k`, `v`: the new tokens `[tokens, heads, dim]` packed by `cu_new`
        (batch + 1 offsets), the same on every rank. `k_cache`, `v_cache`: this rank's cache
        shard, `[rows, kv_heads, dim]` or, with `page_table`, a pool
        `[pages, page_size, kv_heads, dim]`. `cache_lengths`: this rank's cached tokens per
        sequence; `cache_begin`: the row each sequence starts at (default: packed in order);
        `page_table`: `[batch, pages per sequence]` integers (sequence b's token j lives in page
        `page_table[b][j // page_size]`). With virtual ranks each cache argument is a list with
        one entry per rank.

        Returns `out` `[tokens, q_heads, head_dim_v]` in q's dtype and `lse` `[q_heads, tokens]`
        (float32, natural log): rank 0's (every rank has the same bits), or every rank's here as
        lists where `every_rank`."""
        if not isinstance(q, torch.Tensor):
            if self._impl is None:
                raise TypeError("ringattn: q must be a tensor")
            # Refused through the decoder of the last step, so that the peers raise too.
            problem = f"ringattn: q must be a tensor (got {type(q).__name__})"
            q = torch.empty(0, 0, 0, device=self._device)
            return self._run(self._impl, q, q, q, ([], []), [], [], [], [], problem,
                             every_rank)
        impl = self._decoder(q.device)
        here = impl.ranks_here()
        problem = ""
        caches = ([], [])
        lengths, begins, tables = [], [], []
        cu = []
        try:
            cu = _ints(cu_new, "cu_new")
            per_rank = self._per_rank
            caches = (per_rank(k_cache, here, "k_cache", -1),
                      per_rank(v_cache, here, "v_cache", -1))
            batch = len(cu) - 1
            for name, given, into in (("cache_lengths", cache_lengths, lengths),
                                      ("cache_begin", cache_begin, begins)):
                for part in [] if given is None else per_rank(given, here, name, 1):
                    part = _ints(part, name)
                    if len(part) != batch:
                        raise ValueError(f"ringattn: {name} holds one entry per sequence of "
                                         f"cu_new ({batch}), got {len(part)}")
                    into.extend(part)
            if page_table is not None:
                tables = [_table(t) for t in per_rank(page_table, here, "page_table", 2)]
            for name, t in (("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"ringattn: {name} must be a tensor")
            for name, ts in (("k_cache", caches[0]), ("v_cache", caches[1])):
                if any(not isinstance(t, torch.Tensor) for t in ts):
                    raise ValueError(f"ringattn: {name} must be a tensor per rank")
        except (TypeError, ValueError) as e:
            problem = str(e)
            caches, lengths, begins, tables, cu = ([], []), [], [], [], []
        if problem:
            # The peers learn of it in the plan; every rank raises.
            empty = torch.empty(0, 0, 0, device=q.device, dtype=q.dtype)
            k = k if isinstance(k, torch.Tensor) else empty
            v = v if isinstance(v, torch.Tensor) else empty
        return self._run(impl, q, k, v, caches, cu, lengths, begins, tables, problem, every_rank)

    def _run(self, impl, q, k, v, caches, cu, lengths, begins, tables, problem, every_rank):
        try:
            with _device_scope(q.device):
                outs, lses = impl.step(q, k, v, caches[0], caches[1], cu, lengths, begins,
                                       tables, _stream(q.device), problem)
        except Exception:
            if self._virtual is None:
                # A failed step over a group may leave its communicator unusable (NCCL aborts
                # it): every rank failed with it, and every rank makes both again next step.
                self._impl = None
                self._communicator.drop()
            raise
        return (outs, lses) if every_rank else (outs[0], lses[0])

    @staticmethod
    def _per_rank(x, here: int, name: str, depth: int) -> list:
        """One entry per rank here: `x` itself where it is one entry (a tensor, or a list
        nested `depth` deep), else its items."""
        if isinstance(x, torch.Tensor) or _nesting(x) == depth:
            if here == 1:
                return [x]
        elif isinstance(x, (list, tuple)) and len(x) == here:
            return list(x)
        raise ValueError(f"ringattn: {name} takes one entry per rank here ({here})")


def _nesting(x) -> int:
    """How deep lists nest in `x` (0: not a list), along the first items."""
    n = 0
    while isinstance(x, (list, tuple)):
        n += 1
        if not x:
            break
        x = x[0]
    return n
