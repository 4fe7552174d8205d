"""ShardedDecoder: decode steps over a KV cache sharded across virtual ranks (host and device)
and over a gloo process group, slab, packed and paged caches, against the float64 reference
(PyTorch SDPA on the gathered cache); the same bits on every rank; steps that append their new
tokens to the owners' shards; refusals followed by a step that works."""

import math
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import ringattn_torch as ra
from reference import TOLERANCE, case_seed, rel
from test_group import run_ranks

LAYOUTS = ("packed", "slab", "paged")


def decode_reference(q, k, v, cu_new, cached, scale=None):
    """out [tokens, q_heads, dv] and lse [q_heads, tokens] (float64) of the new tokens over the
    gathered cache: sequence b's cached rows of every rank (`cached[r][b]` = (k rows, v rows)),
    then its new tokens, causal among themselves."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    scale = scale or 1.0 / math.sqrt(q.size(-1))
    group = q.size(1) // k.size(1)
    outs, lses = [], []
    for b in range(len(cu_new) - 1):
        s, e = cu_new[b], cu_new[b + 1]
        if e == s:
            continue
        keys = torch.cat([c[b][0].double().cpu() for c in cached] + [k[s:e]])
        values = torch.cat([c[b][1].double().cpu() for c in cached] + [v[s:e]])
        m = keys.size(0) - (e - s)
        allowed = torch.ones(e - s, keys.size(0), dtype=torch.bool)
        allowed[:, m:] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        qs = q[s:e].transpose(0, 1)
        ks = keys.transpose(0, 1).repeat_interleave(group, 0)
        vs = values.transpose(0, 1).repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed,
                                                   scale=scale).transpose(0, 1))
        scores = (qs @ ks.transpose(1, 2)) * scale
        lses.append(torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1))
    return torch.cat(outs), torch.cat(lses, 1)


class Shard:
    """One rank's cache shard in one of the layouts; rows no sequence owns hold NaN (a step that
    read them would return NaN)."""

    def __init__(self, layout, rows, kv_heads, dim, dtype, device, generator, page_size=16,
                 room=40):
        self.layout, self.page_size = layout, page_size
        self.rows = [[r[0].clone(), r[1].clone()] for r in rows]  # per sequence: k, v
        batch = len(rows)
        if layout == "paged":
            need = [max(1, math.ceil((len(r[0]) + room) / page_size)) for r in rows]
            pages = sum(need) + 3
            order = torch.randperm(pages, generator=generator).tolist()
            self.table = []
            for n in need:
                self.table.append(order[:n])
                order = order[n:]
            width = max(need)
            self.k = torch.full((pages, page_size, kv_heads, dim), float("nan"), dtype=dtype)
            self.v = torch.full_like(self.k, float("nan"))
        else:
            self.capacity = [len(r[0]) + (room if layout == "slab" else 0) for r in rows]
            self.begin = [sum(self.capacity[:b]) for b in range(batch)]
            total = sum(self.capacity) + (5 if layout == "slab" else 0)
            self.k = torch.full((total, kv_heads, dim), float("nan"), dtype=dtype)
            self.v = torch.full_like(self.k, float("nan"))
        self.k, self.v = self.k.to(device), self.v.to(device)
        for b in range(batch):
            self._write(b, 0, *self.rows[b])
        if layout == "paged":
            # Entries past a sequence's pages are never read: -1 there.
            self.page_table = torch.full((batch, width), -1, dtype=torch.int32)
            for b, pages in enumerate(self.table):
                self.page_table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)

    def _write(self, b, at, k, v):
        j = torch.arange(at, at + k.size(0))
        if self.layout == "paged":
            pages = torch.tensor(self.table[b], dtype=torch.long)[j // self.page_size]
            at_rows = pages * self.page_size + j % self.page_size
            k_rows, v_rows = self.k.flatten(0, 1), self.v.flatten(0, 1)  # views of the pools
        else:
            at_rows, k_rows, v_rows = self.begin[b] + j, self.k, self.v
        at_rows = at_rows.to(self.k.device)
        k_rows[at_rows] = k.to(self.k.device)
        v_rows[at_rows] = v.to(self.v.device)

    def append(self, b, k, v):
        """Appends rows to sequence b: into its room, or (packed) by packing the shard anew."""
        if self.layout != "packed":
            self._write(b, len(self.rows[b][0]), k, v)
        self.rows[b][0] = torch.cat([self.rows[b][0], k.to(self.rows[b][0].device)])
        self.rows[b][1] = torch.cat([self.rows[b][1], v.to(self.rows[b][1].device)])
        if self.layout == "packed":
            self.k = torch.cat([r[0] for r in self.rows]).to(self.k.device)
            self.v = torch.cat([r[1] for r in self.rows]).to(self.v.device)

    def lengths(self):
        return [len(r[0]) for r in self.rows]

    def args(self):
        """The step's cache arguments of this rank: k_cache, v_cache, cache_lengths and the
        layout's keyword."""
        extra = {}
        if self.layout == "paged":
            extra["page_table"] = self.page_table
        elif self.layout == "slab":
            extra["cache_begin"] = self.begin
        return self.k, self.v, self.lengths(), extra


def make_case(seed, ranks, layout, dtype, device, batch=3, new=(1, 2, 1), longest=60,
              q_heads=4, kv_heads=2, dim=64, empty_rank_sequence=True):
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in new[:batch]:
        cu.append(cu[-1] + n)
    make = lambda n, h: torch.randn(n, h, dim, generator=g).to(dtype)
    q, k, v = make(cu[-1], q_heads), make(cu[-1], kv_heads), make(cu[-1], kv_heads)
    shards = []
    for r in range(ranks):
        lengths = torch.randint(0, longest + 1, (batch,), generator=g).tolist()
        if empty_rank_sequence and r == ranks - 1:
            lengths[0] = 0  # a sequence with no cached token on this rank
        rows = [(make(n, kv_heads), make(n, kv_heads)) for n in lengths]
        shards.append(Shard(layout, rows, kv_heads, dim, dtype, device, g))
    return cu, (q.to(device), k.to(device), v.to(device)), shards


def step_all(dec, q, k, v, cu, shards, every_rank=True):
    parts = [s.args() for s in shards]
    extra = {}
    for key in ("page_table", "cache_begin"):
        if key in parts[0][3]:
            extra[key] = [p[3][key] for p in parts]
    return dec.step(q, k, v, [p[0] for p in parts], [p[1] for p in parts], cu,
                    [p[2] for p in parts], every_rank=every_rank, **extra)


def check_step(outs, lses, q, k, v, cu, shards, dtype):
    want_out, want_lse = decode_reference(q, k, v, cu, [s.rows for s in shards])
    bound_out, bound_lse, _ = TOLERANCE[dtype]
    for out, lse in zip(outs, lses):
        assert torch.equal(out, outs[0]) and torch.equal(lse, lses[0])  # every rank, same bits
    assert rel(outs[0].cpu(), want_out) < bound_out
    assert float((lses[0].double().cpu() - want_lse).abs().max()) < bound_lse


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_virtual_ranks_on_the_host(layout, ranks, dtype):
    cu, (q, k, v), shards = make_case(case_seed(layout, ranks, str(dtype)), ranks, layout, dtype,
                                      "cpu")
    dec = ra.ShardedDecoder(4, 2, 64, ranks=ranks)
    outs, lses = step_all(dec, q, k, v, cu, shards)
    assert outs[0].shape == (cu[-1], 4, 64) and outs[0].dtype == dtype
    assert lses[0].shape == (4, cu[-1]) and lses[0].dtype == torch.float32
    check_step(outs, lses, q, k, v, cu, shards, dtype)


def run_steps(dec, ranks, layout, dtype, device, seed, steps=5, **case):
    """Decode `steps` steps, each appending its new tokens to their owners' shards."""
    cu, (q, k, v), shards = make_case(seed, ranks, layout, dtype, device, **case)
    cached = sum(sum(s.lengths()) for s in shards)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        outs, lses = step_all(dec, q, k, v, cu, shards)
        check_step(outs, lses, q, k, v, cu, shards, dtype)
        totals = [sum(s.lengths()[b] for s in shards) for b in range(len(cu) - 1)]
        for r, shard in enumerate(shards):
            mine = ra.owned_new_rows(r, ranks, cu, totals).tolist()
            for b in range(len(cu) - 1):
                rows = [t for t in mine if cu[b] <= t < cu[b + 1]]
                if rows:
                    shard.append(b, k[rows], v[rows])
        # The next step's new tokens.
        q, k, v = (torch.randn(t.shape, generator=g).to(dtype).to(device) for t in (q, k, v))
    # Every new token went to exactly one rank.
    assert sum(sum(s.lengths()) for s in shards) == cached + steps * cu[-1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_steps_append_to_the_owners(layout):
    dec = ra.ShardedDecoder(4, 2, 64, ranks=3)
    run_steps(dec, 3, layout, torch.float32, "cpu", case_seed(layout))


def test_owned_new_rows():
    cu, lengths = [0, 3, 3, 7], [5, 2, 0]
    rows = [ra.owned_new_rows(r, 3, cu, lengths).tolist() for r in range(3)]
    # Sequence 0's new tokens sit at positions 5, 6, 7; sequence 2's at 0..3.
    assert rows == [[1, 3, 6], [2, 4], [0, 5]]
    assert sorted(sum(rows, [])) == list(range(7))
    with pytest.raises(ValueError, match="rank 3 is not one of 3"):
        ra.owned_new_rows(3, 3, cu, lengths)


def test_refusals_then_a_step():
    cu, (q, k, v), shards = make_case(5, 2, "paged", torch.float32, "cpu")
    dec = ra.ShardedDecoder(4, 2, 64, ranks=2)
    kc, vc, lengths, extra = shards[1].args()
    bad = extra["page_table"].clone()
    bad[1, 0] = kc.size(0)  # a page outside the pool
    args = [s.args() for s in shards]
    with pytest.raises(ValueError, match="outside the pool"):
        dec.step(q, k, v, [args[0][0], kc], [args[0][1], vc], cu, [args[0][2], lengths],
                 page_table=[args[0][3]["page_table"], bad])
    with pytest.raises(ValueError, match="one entry per sequence"):
        dec.step(q, k, v, [a[0] for a in args], [a[1] for a in args], cu,
                 [args[0][2], lengths[:-1]], page_table=[a[3]["page_table"] for a in args])
    with pytest.raises(ValueError, match="one entry per rank here"):
        dec.step(q, k, v, args[0][0], args[0][1], cu, args[0][2],
                 page_table=args[0][3]["page_table"])
    with pytest.raises(ValueError, match="has dtype"):
        dec.step(q, k.double(), v, [a[0] for a in args], [a[1] for a in args], cu,
                 [a[2] for a in args], page_table=[a[3]["page_table"] for a in args])
    outs, lses = step_all(dec, q, k, v, cu, shards)
    check_step(outs, lses, q, k, v, cu, shards, torch.float32)


def test_int64_page_tables_hold_anything_past_a_sequences_pages():
    cu, (q, k, v), shards = make_case(17, 2, "paged", torch.float32, "cpu")
    dec = ra.ShardedDecoder(4, 2, 64, ranks=2)
    args = [s.args() for s in shards]
    tables = [a[3]["page_table"].long() for a in args]
    run = lambda t: dec.step(q, k, v, [a[0] for a in args], [a[1] for a in args], cu,
                             [a[2] for a in args], page_table=t)
    want, _ = run([a[3]["page_table"] for a in args])
    padded = [torch.where(t < 0, torch.full_like(t, 2**40), t) for t in tables]
    got, _ = run(padded)
    assert torch.equal(got, want)
    # A page read that is beyond int32 is outside the pool, not wrapped into it.
    bad = padded[0].clone()
    bad[next(b for b, n in enumerate(args[0][2]) if n > 0), 0] = 2**32
    with pytest.raises(ValueError, match="outside the pool"):
        run([bad, padded[1]])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the platform has no fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_virtual_ranks_are_refused_in_a_forked_child_and_work_in_the_parent():
    cu, (q, k, v), shards = make_case(13, 2, "packed", torch.float32, "cpu")
    dec = ra.ShardedDecoder(4, 2, 64, ranks=2)
    out, _ = step_all(dec, q, k, v, cu, shards, every_rank=False)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its decoder's rank threads stayed in the parent
        message = b"the step ran"
        try:
            step_all(dec, q, k, v, cu, shards)
        except ValueError as e:
            message = str(e).encode()
        finally:
            os.write(write, message[:1000])
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's step did not return within 60 s")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as f:
        told = f.read().decode()
    assert "before a fork()" in told, told
    again, _ = step_all(dec, q, k, v, cu, shards, every_rank=False)
    assert torch.equal(again, out)


def _group_steps(rank, ranks):
    cu, (q, k, v), shards = make_case(77, ranks, "paged", torch.float32, "cpu")
    mine = shards[rank]
    dec = ra.ShardedDecoder(4, 2, 64)
    kc, vc, lengths, extra = mine.args()
    out, lse = dec.step(q, k, v, kc, vc, cu, lengths, **extra)
    check_step([out], [lse], q, k, v, cu, shards, torch.float32)
    # One rank's bad page table: every rank raises, naming it; then a step works.
    table = extra["page_table"].clone()
    if rank == 1:
        table[0, 0] = -5
    match = "outside the pool" if rank == 1 else "rank 1 rejected its step"
    with pytest.raises(ValueError, match=match):
        dec.step(q, k, v, kc, vc, cu, lengths, page_table=table)
    again, _ = dec.step(q, k, v, kc, vc, cu, lengths, **extra)
    assert torch.equal(again, out)
    # Rank 2 passes no tensor for q: refused through the decoder, every rank raises.
    match = "q must be a tensor" if rank == 2 else "rank 2 rejected its step"
    with pytest.raises(ValueError, match=match):
        dec.step(None if rank == 2 else q, k, v, kc, vc, cu, lengths, **extra)
    again, _ = dec.step(q, k, v, kc, vc, cu, lengths, **extra)
    assert torch.equal(again, out)


def test_process_group_of_three():
    run_ranks(3, _group_steps)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("new", [(1, 1, 1), (8, 8, 3)])
def test_virtual_ranks_on_the_device(layout, ranks, dtype, new):
    # 32:8 heads at head_dim 128: 1 new token per sequence runs the split-K/V kernel; 8 new
    # tokens x 4 q heads per kv head still do; caches of a few thousand tokens per rank.
    cu, (q, k, v), shards = make_case(case_seed(layout, ranks, str(dtype), new), ranks, layout,
                                      dtype, "cuda", new=new, longest=3000, q_heads=32,
                                      kv_heads=8, dim=128)
    dec = ra.ShardedDecoder(32, 8, 128, ranks=ranks)
    outs, lses = step_all(dec, q, k, v, cu, shards)
    assert outs[0].device.type == "cuda"
    check_step(outs, lses, q, k, v, cu, shards, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("packed", "paged"))
def test_device_steps_append_to_the_owners(layout):
    dec = ra.ShardedDecoder(8, 2, 64, ranks=4)
    run_steps(dec, 4, layout, torch.bfloat16, "cuda", case_seed(layout), steps=4, q_heads=8,
              kv_heads=2, dim=64, longest=500)


@pytest.mark.gpu
def test_device_refusals_then_a_step():
    cu, (q, k, v), shards = make_case(9, 2, "packed", torch.bfloat16, "cuda")
    dec = ra.ShardedDecoder(4, 2, 64, ranks=2)
    args = [s.args() for s in shards]
    caches = lambda i: [a[i] for a in args]
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        dec.step(q.float(), k.float(), v.float(), [c.float() for c in caches(0)],
                 [c.float() for c in caches(1)], cu, caches(2))
    with pytest.raises(ValueError, match="k_cache is on cpu but this decoder runs on cuda"):
        dec.step(q, k, v, [args[0][0], args[1][0].cpu()], caches(1), cu, caches(2))
    outs, lses = step_all(dec, q, k, v, cu, shards)
    check_step(outs, lses, q, k, v, cu, shards, torch.bfloat16)


def test_page_tables_as_lists_and_one_rank_arguments():
    cu, (q, k, v), shards = make_case(13, 1, "paged", torch.bfloat16, "cpu")
    dec = ra.ShardedDecoder(4, 2, 64)  # no process group: one virtual rank
    kc, vc, lengths, extra = shards[0].args()
    out, lse = dec.step(q, k, v, kc, vc, cu, lengths, **extra)
    check_step([out], [lse], q, k, v, cu, shards, torch.bfloat16)
    # The page table as lists of each sequence's pages (uneven rows), lengths as a tensor.
    rows = [pages for pages in shards[0].table]
    again, again_lse = dec.step(q, k, v, kc, vc, cu, torch.tensor(lengths), page_table=rows)
    assert torch.equal(again, out) and torch.equal(again_lse, lse)
    with pytest.raises(ValueError, match="a paged cache takes page tables, not begins"):
        dec.step(q, k, v, kc, vc, cu, lengths, cache_begin=[0] * len(lengths), **extra)
