"""The float64 reference: attention of a packed batch sequence by sequence, through PyTorch's
scaled_dot_product_attention on the gathered sequence, with the lse computed alongside."""

import math
import os
import random
import zlib

import torch
import torch.nn.functional as F

#: The run's seed: RINGATTN_TEST_SEED where set, else a fresh one, put into the environment so
#: that processes the tests start use it too. pytest's header prints it; setting it runs the same
#: random cases again.
RUN_SEED = int(os.environ.setdefault("RINGATTN_TEST_SEED",
                                     str(random.SystemRandom().getrandbits(31))))


def case_seed(*params):
    """A case's seed: its parameters (hashed the same in every process) mixed with the run's."""
    return (zlib.crc32(repr(params).encode()) ^ RUN_SEED) % 2**31


def visible(length, mask, window, device):
    """[length, length] bool: which keys (columns) each query (row) of a sequence sees."""
    p = torch.arange(length, device=device)
    qp, kp = p[:, None], p[None, :]
    left, right = window
    if mask == "full":
        return torch.ones(length, length, dtype=torch.bool, device=device)
    if mask == "causal":
        return kp <= qp
    ok = torch.ones(length, length, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= kp >= qp - left
    if mask == "causal_window":
        return ok & (kp <= qp)
    if right >= 0:
        ok &= kp <= qp + right
    return ok


def attention(q, k, v, cu_seqlens, mask="causal", window=(-1, -1), softmax_scale=None):
    """out [tokens, q_heads, dv] and lse [q_heads, tokens] of the packed batch, in q's dtype
    (call it on float64 tensors), differentiable through SDPA."""
    scale = softmax_scale or 1.0 / math.sqrt(q.size(-1))
    group = q.size(1) // k.size(1)
    outs, lses = [], []
    cu = [int(x) for x in cu_seqlens]
    for b, e in zip(cu[:-1], cu[1:]):
        if e == b:
            continue
        qs = q[b:e].transpose(0, 1)  # [H, n, d]
        ks = k[b:e].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[b:e].transpose(0, 1).repeat_interleave(group, 0)
        allowed = visible(e - b, mask, window, q.device)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed,
                                                   scale=scale).transpose(0, 1))
        scores = (qs @ ks.transpose(1, 2)) * scale
        lses.append(torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1))
    return torch.cat(outs), torch.cat(lses, 1)


def max_logit(q, k, cu_seqlens, mask="causal", window=(-1, -1), softmax_scale=None):
    """[q_heads]: each head's largest logit scale * q . k over the keys its queries see (float64
    in, float64 out; -inf for a head no query of which sees a key)."""
    scale = softmax_scale or 1.0 / math.sqrt(q.size(-1))
    group = q.size(1) // k.size(1)
    most = torch.full((q.size(1),), float("-inf"), dtype=q.dtype, device=q.device)
    cu = [int(x) for x in cu_seqlens]
    for b, e in zip(cu[:-1], cu[1:]):
        if e == b:
            continue
        qs = q[b:e].transpose(0, 1)
        ks = k[b:e].transpose(0, 1).repeat_interleave(group, 0)
        scores = ((qs @ ks.transpose(1, 2)) * scale).masked_fill(
            ~visible(e - b, mask, window, q.device), float("-inf"))
        most = torch.maximum(most, scores.flatten(1).max(1).values)
    return most


def check_max_logit(run, q, k, cu_seqlens, mask, window, rtol, atol):
    """`run(return_max_logit)` calls the ring on q, k (and its v) and returns what it returns:
    its max logit against the reference's within rtol / atol, and the call's out and lse the
    same bits as a call without it. Returns the max logit."""
    want = max_logit(q.double(), k.double(), cu_seqlens, mask, window)
    out, lse = run(False)
    out2, lse2, most = run(True)
    assert most.shape == (q.size(1),) and most.dtype == torch.float32
    assert torch.allclose(most.double().cpu(), want.cpu(), rtol=rtol, atol=atol), (most, want)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    return most


def rel(a, b):
    """Relative L2 error of a against b (float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_cu_seqlens(generator, batch=3, shortest=1, longest=60):
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=generator)
    return [0] + torch.cumsum(lengths, 0).tolist()


def inputs(cu, q_heads, kv_heads, dim, dim_v, dtype, device, generator):
    tokens = cu[-1]
    make = lambda h, d: torch.randn(tokens, h, d, generator=generator).to(dtype).to(device)
    return make(q_heads, dim), make(kv_heads, dim), make(kv_heads, dim_v)


def window_of(mask):
    return {"sliding_window": (7, 3), "causal_window": (9, 0)}.get(mask, (-1, -1))


def check_against_reference(run, q, k, v, cu, mask, window, tolerance):
    """Runs `run(q, k, v)` (returns out, lse over the whole batch) forward and backward against
    the float64 reference; `tolerance` = (out, lse, grads) relative L2 / absolute lse bounds.
    Returns the errors measured."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = run(q, k, v)
    dout = torch.randn_like(out.float()).to(out.dtype)
    out.backward(dout)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention(*r, cu, mask, window)
    ref_out.backward(dout.double())
    errors = {
        "out": rel(out, ref_out), "lse": float((lse.detach().double() - ref_lse.detach()).abs().max()),
        "dq": rel(q.grad, r[0].grad), "dk": rel(k.grad, r[1].grad), "dv": rel(v.grad, r[2].grad),
    }
    bound_out, bound_lse, bound_grad = tolerance
    assert errors["out"] < bound_out, errors
    assert errors["lse"] < bound_lse, errors
    for g in ("dq", "dk", "dv"):
        assert errors[g] < bound_grad, errors
    return errors


#: Tolerances (out relative L2, lse absolute, gradients relative L2) per dtype, against float64.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3, 5e-3),
    torch.bfloat16: (1e-2, 1e-2, 2e-2),
}
