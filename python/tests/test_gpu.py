"""The device path on CUDA tensors: virtual ranks on one GPU and a rank of an NCCL process group,
forward and backward against the float64 reference on the gathered sequence, streams, outputs
written in place, and refusals."""

import itertools
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import ringattn_torch as ra
from reference import (TOLERANCE, case_seed, check_against_reference, check_max_logit, inputs,
                       random_cu_seqlens, rel, window_of)

pytestmark = pytest.mark.gpu


def _case(seed, dtype, q_heads=8, kv_heads=2, dim=128, dim_v=None, batch=3, longest=300):
    g = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(g, batch=batch, shortest=1, longest=longest)
    return cu, inputs(cu, q_heads, kv_heads, dim, dim_v or dim, dtype, "cuda", g)


@pytest.mark.parametrize("partitioner,mask", list(itertools.product(ra.PARTITIONERS, ra.MASKS)))
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_virtual_ranks_every_partitioner_and_mask(partitioner, mask, ranks, dtype):
    cu, (q, k, v) = _case(case_seed(partitioner, mask, ranks, str(dtype)), dtype)
    window = window_of(mask)
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, partitioner=partitioner,
                                                    mask=mask, window=window)
    check_against_reference(run, q, k, v, cu, mask, window, TOLERANCE[dtype])


@pytest.mark.parametrize("schedule", ra.SCHEDULES)
@pytest.mark.parametrize("mask", ra.MASKS)
def test_virtual_ranks_max_logit(schedule, mask):
    cu, (q, k, v) = _case(23, torch.bfloat16, longest=200)
    window = window_of(mask)
    run = lambda asked: ra.virtual_ring_attention(q, k, v, cu, 4, mask=mask, window=window,
                                                  schedule=schedule, return_max_logit=asked)
    # fp32 logits of bf16 inputs on the tensor cores.
    check_max_logit(run, q, k, cu, mask, window, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("schedule", ra.SCHEDULES)
@pytest.mark.parametrize("dim", [64, 128])
def test_virtual_ranks_fp16_gqa_schedules_widths(heads, schedule, dim):
    cu, (q, k, v) = _case(17, torch.float16, heads[0], heads[1], dim)
    ranks = 4 if schedule == "all_to_all" else 3  # the all-to-all splits the 8 heads
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, partitioner="zigzag",
                                                    mask="causal", schedule=schedule)
    check_against_reference(run, q, k, v, cu, "causal", (-1, -1), TOLERANCE[torch.float16])


def test_separate_widths_192_128():
    cu, (q, k, v) = _case(23, torch.bfloat16, 8, 2, 192, 128)
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, 2, mask="causal")
    check_against_reference(run, q, k, v, cu, "causal", (-1, -1), TOLERANCE[torch.bfloat16])


needs_cudnn = pytest.mark.skipif(not ra.has_cudnn_kernel(),
                                 reason="this build has no cuDNN kernel")


@needs_cudnn
@pytest.mark.parametrize("partitioner,mask", list(itertools.product(ra.PARTITIONERS, ra.MASKS)))
@pytest.mark.parametrize("ranks", [1, 3])
def test_cudnn_kernel_every_partitioner_and_mask(partitioner, mask, ranks):
    cu, (q, k, v) = _case(case_seed("cudnn", partitioner, mask, ranks), torch.bfloat16)
    window = window_of(mask)
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, partitioner=partitioner,
                                                    mask=mask, window=window, kernel="cudnn")
    check_against_reference(run, q, k, v, cu, mask, window, TOLERANCE[torch.bfloat16])


@needs_cudnn
@pytest.mark.parametrize("schedule", ra.SCHEDULES)
def test_cudnn_kernel_fp16_gqa_schedules(schedule):
    cu, (q, k, v) = _case(43, torch.float16, 8, 2, 64)
    ranks = 4 if schedule == "all_to_all" else 3
    run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, mask="causal",
                                                    schedule=schedule, kernel="cudnn")
    check_against_reference(run, q, k, v, cu, "causal", (-1, -1), TOLERANCE[torch.float16])


@needs_cudnn
def test_cudnn_kernel_separate_widths_and_empty_sequences():
    g = torch.Generator().manual_seed(47)
    cu = [0, 0, 70, 70, 71, 260, 260]
    q, k, v = inputs(cu, 8, 2, 192, 128, torch.bfloat16, "cuda", g)
    for ranks in (1, 2):
        run = lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, ranks, mask="causal",
                                                        kernel="cudnn")
        check_against_reference(run, q, k, v, cu, "causal", (-1, -1), TOLERANCE[torch.bfloat16])


@needs_cudnn
@pytest.mark.parametrize("schedule", ra.SCHEDULES)
@pytest.mark.parametrize("mask", ra.MASKS)
@pytest.mark.parametrize("ranks", [1, 4])
def test_cudnn_kernel_max_logit(schedule, mask, ranks):
    cu, (q, k, v) = _case(case_seed("cudnn max logit", schedule, mask, ranks), torch.bfloat16,
                          longest=200)
    window = window_of(mask)
    run = lambda asked: ra.virtual_ring_attention(q, k, v, cu, ranks, mask=mask, window=window,
                                                  schedule=schedule, kernel="cudnn",
                                                  return_max_logit=asked)
    # cuDNN's fp32 logits of bf16 inputs.
    check_max_logit(run, q, k, cu, mask, window, rtol=2e-3, atol=2e-3)


@needs_cudnn
def test_cudnn_kernel_refusals_then_runs():
    cu, (q, k, v) = _case(53, torch.bfloat16)
    with pytest.raises(ValueError, match="fp16 or bf16 tensors \\(got fp32\\)"):
        ra.virtual_ring_attention(q.float(), k.float(), v.float(), cu, 2, kernel="cudnn")
    # One plan per element type: bf16, then fp16 of the same layout, then bf16 again.
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        x = [t.to(dtype) for t in (q, k, v)]
        want, want_lse = ra.virtual_ring_attention(*x, cu, 2)
        got, got_lse = ra.virtual_ring_attention(*x, cu, 2, kernel="cudnn")
        assert got.dtype == dtype
        assert rel(got, want) < 1e-2 and float((got_lse - want_lse).abs().max()) < 1e-2


def test_runs_on_the_current_stream():
    cu, (q, k, v) = _case(29, torch.bfloat16)
    want, want_lse = ra.virtual_ring_attention(q, k, v, cu, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got, got_lse = ra.virtual_ring_attention(q, k, v, cu, 2)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_outputs_written_in_place_are_all_written():
    cu, (q, k, v) = _case(31, torch.bfloat16)
    plan = ra._library.ops.plan(None, 2, torch.cuda.current_device(), "zigzag", "causal",
                                "ring", "native", "bfloat16", [8, 2, 128, 128], [-1, -1], 0.0,
                                cu)
    idx = [ra.token_indices(cu, "zigzag", rank=r, ranks=2).cuda() for r in range(2)]
    shards = lambda x: [x[i] for i in idx]
    out = [torch.full((i.numel(), 8, 128), float("nan"), dtype=q.dtype, device="cuda")
           for i in idx]
    lse = [torch.full((8, i.numel()), float("nan"), device="cuda") for i in idx]
    plan.forward(shards(q), shards(k), shards(v), out, lse,
                    torch.cuda.current_stream().cuda_stream, False)
    assert not any(torch.isnan(t).any() for t in out + lse)
    full, full_lse = ra.virtual_ring_attention(q, k, v, cu, 2)
    for r, i in enumerate(idx):
        assert torch.equal(out[r], full[i]) and torch.equal(lse[r], full_lse[:, i])


def test_device_refusals():
    cu, (q, k, v) = _case(37, torch.bfloat16)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ra.virtual_ring_attention(q.float(), k.float(), v.float(), cu, 2)
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        ra.virtual_ring_attention(q, k.cpu(), v, cu, 2)
    out, _ = ra.virtual_ring_attention(q, k, v, cu, 2)
    assert torch.isfinite(out).all()


@pytest.fixture
def nccl_group_of_one():
    with tempfile.TemporaryDirectory() as d:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 's')}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_nccl_group_of_one_rank(nccl_group_of_one):
    for partitioner, mask in [("zigzag", "causal"), ("contiguous", "full"),
                              ("round_robin", "sliding_window")]:
        cu, (q, k, v) = _case(41, torch.bfloat16)
        window = window_of(mask)
        run = lambda q, k, v: ra.ring_attention(q, k, v, cu, group=nccl_group_of_one,
                                                partitioner=partitioner, mask=mask, window=window)
        check_against_reference(run, q, k, v, cu, mask, window, TOLERANCE[torch.bfloat16])
    # Refused calls (fp32 on the device path; a tensor on another device), each followed by the
    # ring again, over a new NCCL communicator.
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ra.ring_attention(q.float(), k.float(), v.float(), cu, group=nccl_group_of_one)
    with pytest.raises(ValueError, match="k is on cpu but this ring runs on cuda:0"):
        ra.ring_attention(q, k.cpu(), v, cu, group=nccl_group_of_one)
    out, _ = ra.ring_attention(q, k, v, cu, group=nccl_group_of_one)
    want, _ = ra.virtual_ring_attention(q, k, v, cu, 1)
    assert torch.equal(out, want)
    if ra.has_cudnn_kernel():
        # The cuDNN kernel over the NCCL ring: against the oracle, then on q, k, v that are views
        # into one qkv tensor (not dense: the runner hands cuDNN dense copies).
        run = lambda q, k, v: ra.ring_attention(q, k, v, cu, group=nccl_group_of_one,
                                                kernel="cudnn")
        check_against_reference(run, q, k, v, cu, "causal", (-1, -1), TOLERANCE[torch.bfloat16])
        qkv = torch.cat([q, k, v], 1).detach().requires_grad_()
        views = (qkv[:, :8], qkv[:, 8:10], qkv[:, 10:])
        assert not views[0].is_contiguous()
        dense = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        outs = [run(*views)[0], run(*dense)[0]]
        assert torch.equal(outs[0], outs[1])
        dout = torch.randn_like(outs[0])
        for o in outs:
            o.backward(dout)
        for got, want in zip(qkv.grad.split([8, 2, 2], 1), (t.grad for t in dense)):
            assert rel(got, want) < 1e-3  # cuDNN's atomic dQ is not bitwise repeatable


@pytest.mark.parametrize("kernel", [
    "native", pytest.param("cudnn", marks=pytest.mark.skipif(
        not ra.has_cudnn_kernel(), reason="this build has no cuDNN kernel"))])
def test_training_example_follows_single_gpu_sdpa(kernel):
    """examples/06_torch_training under torchrun with one rank, with each block kernel: the
    ring's loss curve against the same model's with single-GPU SDPA (--check: within 1e-2
    relative at every step)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                          str(root / "examples/06_torch_training/train.py"), "--steps", "20",
                          "--check", "--kernel", kernel],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "largest relative gap between the loss curves" in run.stdout


def test_nccl_group_of_one_decodes(nccl_group_of_one):
    from test_decode import check_step, make_case
    cu, (q, k, v), shards = make_case(31, 1, "paged", torch.bfloat16, "cuda", longest=2000,
                                      q_heads=32, kv_heads=8, dim=128)
    dec = ra.ShardedDecoder(32, 8, 128, group=nccl_group_of_one)
    kc, vc, lengths, extra = shards[0].args()
    out, lse = dec.step(q, k, v, kc, vc, cu, lengths, **extra)
    check_step([out], [lse], q, k, v, cu, shards, torch.bfloat16)
    # A refused step, then the decoder again (over a new NCCL communicator): the same bits.
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        dec.step(q.float(), k.float(), v.float(), kc.float(), vc.float(), cu, lengths, **extra)
    again, _ = dec.step(q, k, v, kc, vc, cu, lengths, **extra)
    assert torch.equal(again, out)
