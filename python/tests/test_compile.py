"""torch.compile with fullgraph=True: a model whose attention is the ring (virtual ranks on CPU
threads, ranks of a gloo process group, virtual ranks on the GPU) compiles without a graph break,
and its outputs and gradients equal eager's and the float64 reference's."""

import pytest
import torch
import torch.distributed as dist

import ringattn_torch as ra
from reference import attention, max_logit, rel
from test_group import run_ranks


class Block(torch.nn.Module):
    """A fused q/k/v projection, the ring's attention over its strided slices, an output
    projection."""

    def __init__(self, attend, width=64, heads=2, dim=64):
        super().__init__()
        self.heads, self.dim, self.attend = heads, dim, attend
        self.qkv = torch.nn.Linear(width, 3 * heads * dim)
        self.proj = torch.nn.Linear(heads * dim, width)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.size(0), 3, self.heads, self.dim).unbind(1)
        out, lse = self.attend(q, k, v)
        return self.proj(out.reshape(x.size(0), -1)), lse


def _step(model, x, dy):
    model.zero_grad()
    y, lse = model(x)
    y.backward(dy)
    return y.detach(), lse, [p.grad.clone() for p in model.parameters()]


def _compare(model, x, dy, bound):
    """Eager and compiled (fullgraph: a graph break fails) from the same weights; their outputs,
    lse and weight gradients agree within `bound` (relative)."""
    eager = _step(model, x, dy)
    torch._dynamo.reset()
    compiled = _step(torch.compile(model, fullgraph=True), x, dy)
    assert rel(compiled[0], eager[0]) < bound, rel(compiled[0], eager[0])
    assert rel(compiled[1], eager[1]) < bound
    for a, b in zip(compiled[2], eager[2]):
        assert rel(a, b) < bound, rel(a, b)
    assert not eager[1].requires_grad and not compiled[1].requires_grad  # lse: no gradient
    return eager


def _reference_out(model, x, cu, mask, window=(-1, -1)):
    with torch.no_grad():
        q, k, v = model.qkv(x).double().view(x.size(0), 3, model.heads, model.dim).unbind(1)
        out, _ = attention(q, k, v, cu, mask, window)
        return out.reshape(x.size(0), -1) @ model.proj.weight.double().t() + \
            model.proj.bias.double()


@pytest.mark.parametrize("schedule", ["ring", "all_to_all"])
def test_compiled_virtual_ranks_equal_eager(schedule):
    cu, mask = [0, 30, 61, 100], "causal"
    torch.manual_seed(0)
    model = Block(lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, 2, mask=mask,
                                                            schedule=schedule))
    x, dy = torch.randn(100, 64), torch.randn(100, 64)
    eager = _compare(model, x, dy, 1e-5)
    assert rel(eager[0], _reference_out(model, x, cu, mask)) < 1e-5


def test_compiled_with_a_window_and_a_scale_equal_eager():
    cu = [0, 47, 120]
    torch.manual_seed(1)
    model = Block(lambda q, k, v: ra.virtual_ring_attention(
        q, k, v, cu, 3, partitioner="round_robin", mask="sliding_window", window=(5, 7),
        softmax_scale=0.1))
    _compare(model, torch.randn(120, 64), torch.randn(120, 64), 1e-5)


def test_compiled_max_logit_equals_eager():
    # The max logit as QK-clip reads it: an output of the compiled graph beside the loss.
    cu = [0, 40, 41, 90]
    torch.manual_seed(2)

    def attend(q, k, v):
        out, lse, most = ra.virtual_ring_attention(q, k, v, cu, 2, return_max_logit=True)
        return out, most

    model = Block(attend)
    x, dy = torch.randn(90, 64), torch.randn(90, 64)
    eager = _compare(model, x, dy, 1e-5)
    with torch.no_grad():
        q, k, _ = model.qkv(x).double().view(90, 3, model.heads, model.dim).unbind(1)
    assert torch.allclose(eager[1].double(), max_logit(q, k, cu), rtol=1e-6, atol=0)


def test_compiled_refusals_are_the_eager_ones():
    # The op's checks run when the compiled graph runs, with eager's sentences.
    cu = [0, 30, 61]
    q = torch.randn(61, 2, 64)
    f = torch.compile(lambda q: ra.virtual_ring_attention(q, q, q, cu, 3, schedule="all_to_all"),
                      fullgraph=True)
    with pytest.raises(ValueError, match="2 q heads do not split over 3 ranks"):
        f(q)
    g = torch.compile(lambda q: ra.virtual_ring_attention(q, q, q, [0, 30, 60], 2),
                      fullgraph=True)
    with pytest.raises(ValueError, match="q has 61 tokens but cu_seqlens holds 60"):
        g(q)


def _compiled_group(rank, ranks):
    cu, mask = [0, 30, 61, 100], "causal"
    torch.manual_seed(0)  # the same weights and batch on every rank
    group = dist.new_group(list(range(ranks)))  # not the default group: the op takes its name
    model = Block(lambda q, k, v: ra.ring_attention(q, k, v, cu, group=group, partitioner="zigzag",
                                                    mask=mask))
    x, dy = torch.randn(100, 64), torch.randn(100, 64)
    mine_x, mine_dy = ra.shard(x, cu, "zigzag"), ra.shard(dy, cu, "zigzag")
    eager = _step(model, mine_x, mine_dy)
    torch._dynamo.reset()
    compiled = _step(torch.compile(model, fullgraph=True, backend="aot_eager"), mine_x, mine_dy)
    assert rel(compiled[0], eager[0]) < 1e-6
    assert rel(compiled[1], eager[1]) < 1e-6
    for a, b in zip(compiled[2], eager[2]):
        assert rel(a, b) < 1e-6
    full = ra.unshard(compiled[0], cu, "zigzag")
    assert rel(full, _reference_out(model, x, cu, mask)) < 1e-5


def test_compiled_ranks_of_a_process_group_equal_eager():
    run_ranks(2, _compiled_group)


@pytest.mark.gpu
def test_compiled_virtual_ranks_on_the_gpu_equal_eager():
    cu, mask = [0, 300, 611, 1000], "causal"
    torch.manual_seed(0)
    model = Block(lambda q, k, v: ra.virtual_ring_attention(q, k, v, cu, 4, mask=mask),
                  width=256, heads=4, dim=128).cuda().bfloat16()
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    eager = _compare(model, x, dy, 2e-2)
    assert rel(eager[0].float(), _reference_out(model, x, cu, mask).float()) < 2e-2
