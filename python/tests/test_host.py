"""The host path on CPU tensors, every rank a thread of this process (virtual ranks): forward and
backward against the float64 reference, layout helpers, and refusals."""

import itertools

import pytest
import torch

import ringattn_torch as ra
from reference import (TOLERANCE, case_seed, check_against_reference, check_max_logit, inputs,
                       random_cu_seqlens, window_of)


@pytest.mark.parametrize("partitioner,mask", list(itertools.product(ra.PARTITIONERS, ra.MASKS)))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_virtual_ring_fp32_every_partitioner_and_mask(partitioner, mask, ranks):
    g = torch.Generator().manual_seed(case_seed(partitioner, mask, ranks))
    cu = random_cu_seqlens(g, batch=3, shortest=1, longest=40)
    q, k, v = inputs(cu, 4, 2, 64, 64, torch.float32, "cpu", g)  # GQA 2:1
    window = window_of(mask)
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, partitioner=partitioner,
                                                    mask=mask, window=window)
    check_against_reference(run, q, k, v, cu, mask, window, TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("schedule", ra.SCHEDULES)
def test_virtual_ring_half_precision_gqa_and_schedules(dtype, heads, schedule):
    g = torch.Generator().manual_seed(7)
    cu = [0, 33, 34, 90]
    q, k, v = inputs(cu, heads[0], heads[1], 64, 64, dtype, "cpu", g)
    ranks = 2 if schedule == "all_to_all" else 3  # the all-to-all splits the 4 heads
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, partitioner="zigzag",
                                                    mask="causal", schedule=schedule)
    check_against_reference(run, q, k, v, cu, "causal", (-1, -1), TOLERANCE[dtype])


@pytest.mark.parametrize("partitioner", ra.PARTITIONERS)
@pytest.mark.parametrize("mask", ra.MASKS)
def test_virtual_all_to_all_every_partitioner_and_mask(partitioner, mask):
    g = torch.Generator().manual_seed(11)
    cu = [0, 29, 30, 77]
    q, k, v = inputs(cu, 8, 2, 64, 64, torch.float32, "cpu", g)  # 4 ranks: kv heads replicated
    window = window_of(mask)
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, 4, partitioner=partitioner,
                                                    mask=mask, window=window,
                                                    schedule="all_to_all")
    check_against_reference(run, q, k, v, cu, mask, window, TOLERANCE[torch.float32])


@pytest.mark.parametrize("schedule", ra.SCHEDULES)
@pytest.mark.parametrize("mask", ra.MASKS)
def test_max_logit_every_schedule_and_mask(schedule, mask):
    g = torch.Generator().manual_seed(5)
    cu = [0, 21, 21, 22, 70]  # an empty and a one-token sequence
    q, k, v = inputs(cu, 8, 2, 64, 64, torch.float32, "cpu", g)
    q = q * 3  # logits well above 1
    window = window_of(mask)
    run = lambda asked: ra.virtual_ring_attention(q, k, v, cu, 4, mask=mask, window=window,
                                                  schedule=schedule, return_max_logit=asked)
    check_max_logit(run, q, k, cu, mask, window, rtol=1e-6, atol=0)  # fp64 logits, fp32 out
    # It takes no gradient, and the backward runs as without it.
    qg = q.clone().requires_grad_()
    o, _, m = ra.virtual_ring_attention(qg, k, v, cu, 4, mask=mask, window=window,
                                        schedule=schedule, return_max_logit=True)
    assert not m.requires_grad
    o.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_max_logit_nan_reaches_its_head_alone():
    g = torch.Generator().manual_seed(6)
    cu = [0, 30, 61]
    q, k, v = inputs(cu, 4, 2, 64, 64, torch.float32, "cpu", g)
    q[40, 1, 3] = float("nan")  # query head 1 of a token of the second sequence
    _, _, most = ra.virtual_ring_attention(q, k, v, cu, 3, return_max_logit=True)
    assert torch.isnan(most[1]) and torch.isfinite(most[[0, 2, 3]]).all()
    k[5, 1, 0] = float("nan")  # kv head 1 (query heads 2 and 3) of the first sequence
    _, _, most = ra.virtual_ring_attention(q, k, v, cu, 3, return_max_logit=True)
    assert torch.isnan(most[1:]).all() and torch.isfinite(most[0])


def test_all_to_all_refuses_heads_that_do_not_split():
    # Repeated: the ranks are threads, and a race shows only now and then.
    q = torch.randn(40, 4, 64)
    for _ in range(20):
        with pytest.raises(ValueError, match="4 q heads do not split over 3 ranks"):
            ra.virtual_ring_attention(q, q, q, [0, 40], 3, schedule="all_to_all")
    out, _ = ra.virtual_ring_attention(q, q, q, [0, 40], 4, schedule="all_to_all")
    ref, _ = ra.virtual_ring_attention(q, q, q, [0, 40], 4)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_refusals_on_virtual_ranks_repeat_cleanly():
    # Every refusal of the bindings and the ring, 20 times over: an exception each time, never a
    # crash, and the ring runs after them.
    cu = [0, 10, 21]
    q = torch.randn(21, 2, 64)
    for _ in range(20):
        with pytest.raises(ValueError, match="dtype"):
            x = q.double()
            ra.virtual_ring_attention(x, x, x, cu, 3)
        with pytest.raises(ValueError, match="tokens"):
            ra.virtual_ring_attention(q[:-1], q[:-1], q[:-1], cu, 3)
        with pytest.raises(ValueError, match="head_dim 48 is not supported"):
            x = torch.randn(21, 2, 48)
            ra.virtual_ring_attention(x, x, x, cu, 3)
        with pytest.raises(ValueError, match="must hold integers"):
            ra.virtual_ring_attention(q, q, q, [0, 10.5, 21], 3)
    out, _ = ra.virtual_ring_attention(q, q, q, cu, 3)
    assert torch.isfinite(out).all()


def test_separate_widths_and_scale():
    g = torch.Generator().manual_seed(3)
    cu = [0, 17, 50]
    q, k, v = inputs(cu, 4, 2, 192, 128, torch.float32, "cpu", g)
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, 2, mask="full")
    check_against_reference(run, q, k, v, cu, "full", (-1, -1), TOLERANCE[torch.float32])


def test_one_rank_without_a_process_group():
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    q, k, v = inputs(cu.tolist(), 2, 2, 64, 64, torch.float32, "cpu", g)
    run = lambda q, k, v: ra.ring_attention(q, k, v, cu, mask="causal")
    check_against_reference(run, q, k, v, cu.tolist(), "causal", (-1, -1),
                            TOLERANCE[torch.float32])


@pytest.mark.parametrize("partitioner", ra.PARTITIONERS)
def test_token_indices_and_positions(partitioner):
    cu = [0, 7, 7, 30, 31]
    for ranks in (1, 2, 3, 5):
        seen = torch.cat([ra.token_indices(cu, partitioner, rank=r, ranks=ranks)
                          for r in range(ranks)])
        assert sorted(seen.tolist()) == list(range(cu[-1]))
        for r in range(ranks):
            idx = ra.token_indices(cu, partitioner, rank=r, ranks=ranks)
            pos = ra.position_ids(cu, partitioner, rank=r, ranks=ranks)
            starts = torch.tensor(cu)[torch.searchsorted(torch.tensor(cu), idx, right=True) - 1]
            assert torch.equal(pos, idx - starts)
            x = torch.arange(cu[-1] * 2).view(cu[-1], 2)
            assert torch.equal(ra.shard(x, cu, partitioner, rank=r, ranks=ranks), x[idx])


def test_zigzag_layout_by_hand():
    # Two ranks, one sequence of 8: zigzag gives rank 0 chunks 0 and 3, rank 1 chunks 1 and 2.
    assert ra.token_indices([0, 8], "zigzag", rank=0, ranks=2).tolist() == [0, 1, 6, 7]
    assert ra.token_indices([0, 8], "zigzag", rank=1, ranks=2).tolist() == [2, 3, 4, 5]
    assert ra.token_indices([0, 5], "round_robin", rank=1, ranks=2).tolist() == [1, 3]


def test_outputs_are_written_in_place_where_given():
    g = torch.Generator().manual_seed(11)
    cu = [0, 40]
    q, k, v = inputs(cu, 2, 2, 64, 64, torch.float32, "cpu", g)
    plan = ra._library.ops.plan(None, 2, -1, "contiguous", "causal", "ring", "native",
                                "float32", [2, 2, 64, 64], [-1, -1], 0.0, cu)
    idx = [ra.token_indices(cu, "contiguous", rank=r, ranks=2) for r in range(2)]
    shards = lambda x: [x[i] for i in idx]
    out = [torch.full((20, 2, 64), float("nan")) for _ in range(2)]
    lse = [torch.full((2, 20), float("nan")) for _ in range(2)]
    got_out, got_lse = plan.forward(shards(q), shards(k), shards(v), out, lse, 0,
                                    False)[:2]
    assert all(a is b for a, b in zip(got_out, out)) or all(
        a.data_ptr() == b.data_ptr() for a, b in zip(got_out, out))
    assert not any(torch.isnan(t).any() for t in out + lse)
    full, full_lse = ra.virtual_ring_attention(q, k, v, cu, 2, partitioner="contiguous")
    assert torch.equal(torch.cat(out), full) and torch.equal(torch.cat(lse, 1), full_lse)


def test_refusals_name_the_problem():
    cu = [0, 10]
    q = torch.randn(10, 2, 64)
    with pytest.raises(ValueError, match="unknown mask 'diagonal'"):
        ra.virtual_ring_attention(q, q, q, cu, 2, mask="diagonal")
    with pytest.raises(ValueError, match="unknown partitioner 'striped'"):
        ra.virtual_ring_attention(q, q, q, cu, 2, partitioner="striped")
    with pytest.raises(ValueError, match="unknown schedule"):
        ra.virtual_ring_attention(q, q, q, cu, 2, schedule="tree")
    with pytest.raises(ValueError, match="unknown kernel 'fused' \\(one of native, cudnn\\)"):
        ra.virtual_ring_attention(q, q, q, cu, 2, kernel="fused")
    with pytest.raises(ValueError, match="kernel 'cudnn' runs CUDA tensors \\(q is on cpu\\)"):
        ra.virtual_ring_attention(q, q, q, cu, 2, kernel="cudnn")
    # The op's own plan refuses it too, for a caller that reaches it directly.
    with pytest.raises(ValueError, match="kernel 'cudnn' runs CUDA tensors"):
        ra._library.ops.plan(None, 2, -1, "zigzag", "causal", "ring", "cudnn", "bfloat16",
                             [2, 2, 64, 64], [-1, -1], 0.0, cu)
    with pytest.raises(ValueError, match="unknown element type 'float64'"):
        ra._library.ops.plan(None, 2, -1, "zigzag", "causal", "ring", "native", "float64",
                             [2, 2, 64, 64], [-1, -1], 0.0, cu)
    assert isinstance(ra.has_cudnn_kernel(), bool)
    if not ra.has_device_path():
        assert not ra.has_cudnn_kernel()
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        x = torch.randn(10, 2, 48)
        ra.virtual_ring_attention(x, x, x, cu, 2)
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        ra.virtual_ring_attention(torch.randn(10, 3, 64), q, q, cu, 2)
    with pytest.raises(ValueError, match="dtype"):
        x = q.double()
        ra.virtual_ring_attention(x, x, x, cu, 2)
    with pytest.raises(ValueError, match="tokens"):  # the shards do not match cu_seqlens
        ra.virtual_ring_attention(q, q, q, [0, 12], 2)
    # The ring still runs after every refusal above.
    out, _ = ra.virtual_ring_attention(q, q, q, cu, 2)
    assert torch.isfinite(out).all()


def test_shards_and_cu_seqlens_are_checked_without_a_process_group():
    # One rank without a group: its shard is the whole batch, so the tensors' tokens must be
    # cu_seqlens' total; cu_seqlens must be integers that start at 0 and never decrease.
    q = torch.randn(301, 2, 64)
    with pytest.raises(ValueError, match="q has 301 tokens but cu_seqlens holds 10"):
        ra.ring_attention(q, q, q, [0, 10])
    with pytest.raises(ValueError, match="must hold integers"):
        ra.ring_attention(q, q, q, [0, 36.5, 301])
    with pytest.raises(ValueError, match="must hold integers"):
        ra.ring_attention(q, q, q, [0, 301.0])
    with pytest.raises(ValueError, match="must hold integers"):
        ra.ring_attention(q, q, q, torch.tensor([0.0, 301.0]))
    with pytest.raises(ValueError, match="must hold integers"):
        ra.virtual_ring_attention(q, q, q, [0, 36.5, 301], 2)
    with pytest.raises(ValueError, match="must not decrease"):
        ra.ring_attention(q, q, q, [0, 200, 100, 301])
    with pytest.raises(ValueError, match="must start at 0"):
        ra.ring_attention(q, q, q, [1, 301])
    with pytest.raises(ValueError, match="must hold integers"):
        ra.token_indices([0, 2.5], ranks=2, rank=0)
    # Integer tensors and numpy-style integers are fine, and the answer is the whole batch's.
    out, lse = ra.ring_attention(q, q, q, torch.tensor([0, 100, 301], dtype=torch.int64))
    assert out.shape == (301, 2, 64) and torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref, ref_lse = ra.virtual_ring_attention(q, q, q, [0, 100, 301], 1)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_cuda_tensors_without_the_device_path_are_refused():
    if ra.has_device_path():
        pytest.skip("this build has the device path")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device to make CUDA tensors on")
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="host path only"):
        ra.virtual_ring_attention(q, q, q, [0, 10], 2)
