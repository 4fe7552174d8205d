"""The host path over a torch.distributed process group (gloo), one rank per process: sharded
forward and backward against the float64 reference on the gathered sequence, plans kept per
layout, and a refusal on one rank reaching every rank."""

import faulthandler
import gc
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ringattn_torch as ra
from reference import (TOLERANCE, attention, inputs, max_logit, random_cu_seqlens, rel,
                       window_of)


def _worker(rank, ranks, store, body, errors):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A rank still running after 240 s prints where every thread of it is, before the kill.
    faulthandler.dump_traceback_later(240, exit=False)
    try:
        os.environ["RINGATTN_TEST_STORE"] = store  # for a body that makes a second world
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=ranks)
        try:
            body(rank, ranks)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))


def run_ranks(ranks, body):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, ranks, store, body, errors))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                pytest.fail("a rank did not finish within 300 s")
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(f"rank {r}:\n{t}" for r, t in sorted(failures))


def _sharded_case(rank, ranks, partitioner, mask, dtype, schedule="ring"):
    g = torch.Generator().manual_seed(1234)  # the same full batch on every rank
    cu = random_cu_seqlens(g, batch=3, shortest=1, longest=50)
    q, k, v = inputs(cu, 4, 2, 64, 64, dtype, "cpu", g)
    dout = torch.randn(q.shape, generator=g).to(dtype)
    window = window_of(mask)
    mine = [ra.shard(x, cu, partitioner).clone().requires_grad_() for x in (q, k, v)]
    out, lse, most = ra.ring_attention(*mine, cu, partitioner=partitioner, mask=mask,
                                       window=window, schedule=schedule, return_max_logit=True)
    out.backward(ra.shard(dout, cu, partitioner))
    full_out = ra.unshard(out.detach(), cu, partitioner)
    full_lse = ra.unshard(lse, cu, partitioner, dim=1)
    grads = [ra.unshard(t.grad, cu, partitioner) for t in mine]
    r = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention(*r, cu, mask, window)
    ref_out.backward(dout.double())
    bound_out, bound_lse, bound_grad = TOLERANCE[dtype]
    errors = (rel(full_out, ref_out), float((full_lse.double() - ref_lse.detach()).abs().max()),
              *(rel(a, b.grad) for a, b in zip(grads, r)))
    assert errors[0] < bound_out and errors[1] < bound_lse, errors
    assert max(errors[2:]) < bound_grad, errors
    # The max logit over every rank, on every rank: the reference's, and rank 0's bits.
    want = max_logit(q.double(), k.double(), cu, mask, window)
    assert torch.allclose(most.double(), want, rtol=1e-6, atol=0), (most, want)
    everyone = [torch.empty_like(most) for _ in range(ranks)]
    dist.all_gather(everyone, most)
    assert all(torch.equal(x, everyone[0]) for x in everyone)


def _matrix(rank, ranks):
    for partitioner in ra.PARTITIONERS:
        for mask in ra.MASKS:
            _sharded_case(rank, ranks, partitioner, mask, torch.float32)
    _sharded_case(rank, ranks, "zigzag", "causal", torch.bfloat16, schedule="all_gather")
    if ranks == 2:  # the all-to-all splits the 4 heads over 2 ranks, not 3
        _sharded_case(rank, ranks, "round_robin", "causal", torch.float32, schedule="all_to_all")


@pytest.mark.parametrize("ranks", [2, 3])
def test_group_every_partitioner_and_mask(ranks):
    run_ranks(ranks, _matrix)


def _plans_and_refusals(rank, ranks):
    from ringattn_torch import attention as impl
    cu = [0, 30, 61]
    g = torch.Generator().manual_seed(5)
    q, k, v = (ra.shard(x, cu) for x in inputs(cu, 2, 2, 64, 64, torch.float32, "cpu", g))
    first, _ = ra.ring_attention(q, k, v, cu)
    again, _ = ra.ring_attention(q, k, v, cu)
    assert torch.equal(first, again)  # deterministic, and the plan was kept
    ((_, comm),) = impl._communicators.values()
    assert len(comm._plans) == 1
    # Rank 1 passes float64 tensors: refused there, and every other rank's call fails naming it.
    bad = q.double() if rank == 1 else q
    with pytest.raises(ValueError) as e:
        ra.ring_attention(bad, k if rank != 1 else k.double(), v if rank != 1 else v.double(), cu)
    if rank == 1:
        assert "dtype" in str(e.value)
    else:
        assert "rank 1 rejected" in str(e.value) and "dtype" in str(e.value)
    # Rank 1 alone asks for the max logit: every rank refuses, before any work.
    with pytest.raises(ValueError, match="rank 1 calls with another layout than rank 0"):
        ra.ring_attention(q, k, v, cu, return_max_logit=rank == 1)
    # Shards that do not match cu_seqlens, on every rank: the ring's own sentence.
    with pytest.raises(ValueError, match=r"q is \[.*\] but rank .*'s shard is"):
        ra.ring_attention(q[:-1], k[:-1], v[:-1], cu)
    # And the ring runs again afterwards, with the same result.
    after, _ = ra.ring_attention(q, k, v, cu)
    assert torch.equal(after, first)


def test_group_plans_kept_and_refusals_reach_every_rank():
    run_ranks(3, _plans_and_refusals)


def _refusals_everywhere(rank, ranks):
    """Each refusal on one rank (a different rank each round), 20 rounds: every rank raises,
    the refusing rank its own error and the others one naming it; nobody waits, and the next
    valid call gives the first call's result."""
    cu = [0, 30, 61]
    g = torch.Generator().manual_seed(5)
    q, k, v = (ra.shard(x, cu) for x in inputs(cu, 4, 2, 64, 64, torch.float32, "cpu", g))
    first, _ = ra.ring_attention(q, k, v, cu)
    # (what the refusing rank passes, what it is told, what the others are told)
    cases = [
        (dict(q=q[0]), "must be [tokens, heads, dim]", "rejected the call"),
        (dict(mask="diagonal"), "unknown mask 'diagonal'", "rejected the call"),
        (dict(partitioner="striped"), "unknown partitioner 'striped'", "rejected the call"),
        (dict(schedule="tree"), "unknown schedule 'tree'", "rejected the call"),
        (dict(kernel="fused"), "unknown kernel 'fused'", "rejected the call"),
        (dict(kernel="cudnn"), "kernel 'cudnn' runs CUDA tensors", "rejected the call"),
        (dict(mask="sliding_window", window=(1, 2, 3)), "window is an int or (left, right)",
         "rejected the call"),
        (dict(cu=[0, 30.5, 61]), "must hold integers", "rejected the call"),
        (dict(cu=[0, 31, 61]), "another layout than rank 0", "another layout than rank 0"),
        (dict(mask="full"), "another layout than rank 0", "another layout than rank 0"),
        (dict(q=q.double(), k=k.double(), v=v.double()), "dtype", "rejected call"),
        (dict(q=q[:-1], k=k[:-1], v=v[:-1]), "but rank", "rejected call"),
    ]
    for round in range(20):
        for i, (bad, own, others) in enumerate(cases):
            refusing = (round + i) % ranks
            mine = bad if rank == refusing else {}
            args = dict(q=q, k=k, v=v, cu=cu)
            args.update({n: mine[n] for n in ("q", "k", "v", "cu") if n in mine})
            options = {n: x for n, x in mine.items() if n not in ("q", "k", "v", "cu")}
            with pytest.raises((ValueError, TypeError)) as e:
                ra.ring_attention(args["q"], args["k"], args["v"], args["cu"], **options)
            text = str(e.value)
            if "another layout" in others:
                assert others in text, (round, i, text)
            elif rank == refusing:
                assert own in text, (round, i, text)
            else:
                assert f"rank {refusing} " in text and others in text, (round, i, text)
        after, _ = ra.ring_attention(q, k, v, cu)
        assert torch.equal(after, first), round


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_refusals_on_one_rank_reach_every_rank_every_time(ranks):
    run_ranks(ranks, _refusals_everywhere)


def _group_of_one(rank, ranks):
    from ringattn_torch import attention as impl
    g = torch.Generator().manual_seed(9)
    cu = [0, 17, 40]
    q, k, v = inputs(cu, 4, 2, 64, 64, torch.float32, "cpu", g)
    want, want_lse = ra.virtual_ring_attention(q, k, v, cu, 1)
    for _ in range(2):
        out, lse = ra.ring_attention(q, k, v, cu)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        # The call's own checks still refuse, with this rank's own error.
        with pytest.raises(ValueError, match="unknown kernel 'fused'"):
            ra.ring_attention(q, k, v, cu, kernel="fused")
        with pytest.raises(ValueError, match=r"q is \[39, 4, 64\] but rank 0's shard is"):
            ra.ring_attention(q[:-1], k[:-1], v[:-1], cu)
    # Nobody to agree with: no agreement group was made, no all-gather ran.
    assert not impl._agreement_groups


def test_group_of_one_rank_skips_the_agreement():
    run_ranks(1, _group_of_one)


def _tasks():
    """Ids of this process's threads (Linux)."""
    return set(os.listdir("/proc/self/task"))


def _gloo_threads(excluding):
    """Threads of this process that run a gloo process group's work loop, less `excluding` (ids).

    A group's threads exist when it is made but name themselves once they run, so a count by name
    alone can grow later for an older group; ids taken before a group is made tell its threads
    apart from the older groups'."""
    found = set()
    for task in _tasks() - excluding:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == "pt_gloo_runloop":
                    found.add(task)
        except OSError:  # a thread that ended meanwhile
            pass
    return found


def _wait_until(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _group_released(rank, ranks):
    before = _tasks()  # every thread of the default group among them, named or not yet
    sub = dist.new_group(list(range(ranks)), backend="gloo")
    dist.barrier(group=sub)
    assert _wait_until(lambda: _gloo_threads(before)), "no gloo work loop threads to count"
    g = torch.Generator().manual_seed(5)
    cu = [0, 30, 61]
    q, k, v = inputs(cu, 4, 2, 64, 64, torch.float32, "cpu", g)
    qs, ks, vs = (ra.shard(x, cu, group=sub).requires_grad_() for x in (q, k, v))
    out, _ = ra.ring_attention(qs, ks, vs, cu, group=sub)
    out.sum().backward()
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    # The extension keeps no group alive: its work loop threads end with it, now, and not during
    # the interpreter's shutdown (where a late work's Python decref aborts the process). The last
    # reference may be a finished work's, dropped on a work loop thread a moment later.
    released = _wait_until(lambda: not _gloo_threads(before))
    assert released, (f"rank {rank}: a process group outlived destroy_process_group "
                      f"({len(_gloo_threads(before))} of its work loop threads still run)")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("ranks", [1, 2])
def test_destroy_process_group_releases_the_group(ranks):
    run_ranks(ranks, _group_released)


def _world_again(rank, ranks):
    g = torch.Generator().manual_seed(13)
    cu = [0, 30, 61]
    q, k, v = inputs(cu, 4, 2, 64, 64, torch.float32, "cpu", g)
    shards = [ra.shard(x, cu) for x in (q, k, v)]
    sub = dist.new_group(list(range(ranks)), backend="gloo")
    want, want_lse = ra.ring_attention(*shards, cu)
    on_sub, _ = ra.ring_attention(*shards, cu, group=sub)
    assert torch.equal(on_sub, want)
    names = (dist.group.WORLD.group_name, sub.group_name)
    del sub
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RINGATTN_TEST_STORE']}-2",
                            rank=rank, world_size=ranks)
    sub = dist.new_group(list(range(ranks)), backend="gloo")
    # The new world's groups carry the old names: the extension's communicators and agreement
    # groups of the old ones are not used for them, and the first call on each runs.
    assert (dist.group.WORLD.group_name, sub.group_name) == names
    for group in (None, sub):
        out, lse = ra.ring_attention(*shards, cu, group=group)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        with pytest.raises(ValueError, match="another layout than rank 0"):
            ra.ring_attention(*shards, cu, group=group, mask="full" if rank == 1 else "causal")


def test_a_second_world_after_destroy_process_group():
    run_ranks(2, _world_again)
