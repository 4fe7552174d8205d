"""Ring attention on tensors, with autograd: over a torch.distributed process group (one rank per
process; CUDA tensors over an NCCL communicator made from the group, CPU tensors over the group's
CPU backend) or over virtual ranks (every rank a thread of this process, on one device)."""

import collections
import datetime
import hashlib
import operator
import threading
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._library import has_cudnn_kernel, ops
from .layout import CuSeqlens, check_partitioner, cu_seqlens_list, token_indices

MASKS = ("full", "causal", "sliding_window", "causal_window")
SCHEDULES = ("ring", "all_gather", "all_to_all")
#: Block kernels of the device path: the library's own, and cuDNN's fused attention (builds with
#: cuDNN 9 and the cudnn-frontend headers; `has_cudnn_kernel()` says whether this one has it).
KERNELS = ("native", "cudnn")

#: Planned rings kept per communicator (least recently used dropped first).
PLANS_PER_COMMUNICATOR = 32


def _window(mask: str, window: Optional[Sequence[int]]) -> Tuple[int, int]:
    if mask not in MASKS:
        raise ValueError(f"ringattn: unknown mask '{mask}' (one of {', '.join(MASKS)})")
    if window is None:
        return (-1, -1)
    if isinstance(window, int) and not isinstance(window, bool):
        return (int(window), 0 if mask == "causal_window" else int(window))
    try:
        left, right = window
        return (operator.index(left), operator.index(right))
    except (TypeError, ValueError):
        raise ValueError(f"ringattn: window is an int or (left, right) of ints, -1 unbounded "
                         f"(got {window!r})") from None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _device_scope(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _layout_key(q, k, v, cu, partitioner, mask, schedule, kernel, window, softmax_scale):
    dims = (q.size(1), k.size(1), q.size(2), v.size(2))
    # A cuDNN plan's graphs are built for one element type; the native kernels take any.
    element = str(q.dtype).replace("torch.", "") if kernel == "cudnn" else ""
    return (partitioner, mask, schedule, kernel, element, dims, window,
            float(softmax_scale or 0.0), cu)


def _make_plan(endpoint, virtual_ranks, device_index, key):
    partitioner, mask, schedule, kernel, element, dims, window, scale, cu = key
    return ops.plan(endpoint, virtual_ranks, device_index, partitioner, mask, schedule, kernel,
                    element or "bfloat16", list(dims), list(window), scale, list(cu))


class _Communicator:
    """This process's end of a ring's communicator, kept across calls, with its planned rings.
    A failed call drops it (and its rings): the next call plans afresh, on every rank alike."""

    def __init__(self, make_endpoint):
        self._make_endpoint = make_endpoint
        self._endpoint = None
        self._plans = collections.OrderedDict()

    def endpoint(self):
        """This process's end of the communicator, made at the first call (collective)."""
        if self._endpoint is None:
            self._endpoint = self._make_endpoint()
        return self._endpoint

    def plan(self, key, device_index):
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = _make_plan(self.endpoint(), 0, device_index, key)
        self._plans[key] = plan
        while len(self._plans) > PLANS_PER_COMMUNICATOR:
            self._plans.popitem(last=False)
        return plan

    def drop(self):
        self._plans.clear()
        self._endpoint = None


_lock = threading.Lock()
_communicators = {}
_virtual_plans = collections.OrderedDict()


def _group_communicator(group, device: torch.device, timeout: float) -> _Communicator:
    timeout_ms = int(timeout * 1000)
    # The endpoint is remade from the group's name: a kept group would outlive
    # torch.distributed.destroy_process_group.
    name = group.group_name
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()

        def make_endpoint():
            # The NCCL unique id travels through the group itself.
            group = _resolve_group(name)
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            with torch.cuda.device(index):
                box = [ops.nccl_unique_id().tolist() if rank == 0 else None]
                dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
                uid = torch.tensor(box[0], dtype=torch.uint8)
                return ops.nccl_endpoint(uid, size, rank, index, timeout_ms)
    else:
        def make_endpoint():
            return ops.group_endpoint(name, timeout_ms)
    key = (name, str(device), timeout_ms)
    with _lock:
        kept = _communicators.get(key)
        # Group names repeat after destroy_process_group and a new init: a communicator made for
        # a group that is gone (its weak reference dead, or the name now another group's) is
        # dropped and made again.
        if kept is not None and kept[0]() is group:
            return kept[1]
        if kept is not None:
            kept[1].drop()
        comm = _Communicator(make_endpoint)
        _communicators[key] = (weakref.ref(group), comm)
    return comm


class _GroupRunner:
    """One rank of a process group: its shards in, its shards out."""

    def __init__(self, communicator: _Communicator, plan, device: torch.device, dense: bool):
        self.communicator, self.plan, self.device = communicator, plan, device
        # The cuDNN kernel reads dense [tokens, heads, dim] tensors only.
        self.dense = dense

    def _guarded(self, call):
        try:
            with _device_scope(self.device):
                return call()
        except Exception:
            self.communicator.drop()
            raise

    def forward(self, q, k, v, max_logit):
        if self.dense:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        outs, lses, max_logits = self._guarded(lambda: self.plan.forward(
            [q], [k], [v], None, None, _stream(self.device), max_logit))
        return outs[0], lses[0], max_logits[0] if max_logit else _no_max_logit(q)

    def backward(self, q, k, v, out, lse, dout):
        if self.dense:
            q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
        dq, dk, dv = self._guarded(lambda: self.plan.backward(
            [q], [k], [v], [out], [lse], [dout], None, None, None, _stream(self.device)))
        return dq[0], dk[0], dv[0]


class _VirtualRunner:
    """Every rank as a thread of this process: the full packed batch in, sharded by the
    partitioner for the ranks, their outputs put back in the batch's order."""

    def __init__(self, plan, indices, device: torch.device):
        self.plan, self.device = plan, device
        self.indices = [i.to(device) for i in indices]
        self.all = torch.cat(self.indices)

    def _split(self, x, dim=0):
        return [x.index_select(dim, i) for i in self.indices]

    def forward(self, q, k, v, max_logit):
        with _device_scope(self.device):
            outs, lses, max_logits = self.plan.forward(
                self._split(q), self._split(k), self._split(v), None, None,
                _stream(self.device), max_logit)
        out = torch.empty(q.size(0), q.size(1), v.size(2), dtype=q.dtype, device=q.device)
        out.index_copy_(0, self.all, torch.cat(outs))
        lse = torch.empty(q.size(1), q.size(0), dtype=torch.float32, device=q.device)
        lse.index_copy_(1, self.all, torch.cat(lses, 1))
        # Every rank holds the maxima over them all.
        return out, lse, max_logits[0] if max_logit else _no_max_logit(q)

    def backward(self, q, k, v, out, lse, dout):
        with _device_scope(self.device):
            dqs, dks, dvs = self.plan.backward(
                self._split(q), self._split(k), self._split(v), self._split(out),
                [l.contiguous() for l in self._split(lse, 1)], self._split(dout), None, None,
                None, _stream(self.device))
        grads = []
        for parts, like in ((dqs, q), (dks, k), (dvs, v)):
            g = torch.empty_like(like, memory_format=torch.contiguous_format)
            g.index_copy_(0, self.all, torch.cat(parts))
            grads.append(g)
        return tuple(grads)


def _no_max_logit(q: torch.Tensor) -> torch.Tensor:
    """The op's max-logit output where the call does not ask for it."""
    return q.new_empty(0, dtype=torch.float32)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 and (x.size(2) <= 1 or x.stride(2) == 1) else x.contiguous()


def _check_tensors(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ringattn: {name} must be a tensor")
        if t.dim() != 3:
            raise ValueError(f"ringattn: {name} must be [tokens, heads, dim] (got "
                             f"{t.dim()} dimensions)")


def _check_whole_batch(q, k, v, cu):
    """q, k and v hold the whole packed batch of `cu` (a ring of one rank, or every virtual
    rank's shards together), on one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"ringattn: {name} is on {t.device} but q is on {q.device}")
        if t.size(0) != cu[-1]:
            raise ValueError(f"ringattn: {name} has {t.size(0)} tokens but cu_seqlens holds "
                             f"{cu[-1]} (the whole packed batch)")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: CuSeqlens, *,
                   group: Optional[dist.ProcessGroup] = None, partitioner: str = "zigzag",
                   mask: str = "causal", window: Optional[Sequence[int]] = None,
                   softmax_scale: Optional[float] = None, schedule: str = "ring",
                   kernel: str = "native", timeout: float = 60.0,
                   return_max_logit: bool = False):
    """Context-parallel attention of this rank's shards, with autograd.

    q: [local tokens, q_heads, head_dim], k: [local tokens, kv_heads, head_dim],
    v: [local tokens, kv_heads, head_dim_v]: this rank's shard of the packed batch under
    `partitioner` (`shard` makes it). `cu_seqlens`: the *global* packed layout (batch + 1
    offsets, the same on every rank; a list or CPU tensor: a CUDA tensor is read back).
    `group`: the process group of the ring (default: the default group, or a ring of one rank
    where torch.distributed is not initialized). CUDA tensors (fp16, bf16) run the device path
    over an NCCL communicator made from the group, on the current stream; CPU tensors (fp16,
    bf16, fp32) run the host path over the group's CPU backend (gloo). `mask`: full, causal,
    sliding_window, causal_window (with `window` = (left, right), -1 unbounded). `schedule`:
    ring (K/V pass around the ring), all_gather or all_to_all (heads traded for tokens; the group
    size must divide q_heads, and it and kv_heads one another). `kernel`: the device path's block
    kernel, native (the library's own) or cudnn (cuDNN's fused attention, with its atomic dQ
    backward as PyTorch's SDPA; CUDA tensors, builds that have it: `has_cudnn_kernel()`; no
    max logit). Returns out [local tokens, q_heads,
    head_dim_v] and lse [q_heads, local tokens] (fp32, natural log, not differentiable); with
    `return_max_logit`, also max_logit [q_heads] (fp32, not differentiable): each head's largest
    logit softmax_scale * q . k over every query of every rank and the keys it sees (QK-clip),
    the same on every rank (NaN where a NaN or an infinity reached the head's logits).
    Collective: every rank of the group calls it with the same layout. Works under torch.compile
    (one custom op, `torch.ops.ringattn_torch.attention`, with its backward op)."""
    group_name = ""
    if group is not None or (dist.is_available() and dist.is_initialized()):
        group_name = _group_name(group)
    return _call(q, k, v, cu_seqlens, 0, group_name, partitioner, mask, window, softmax_scale,
                 schedule, kernel, timeout, return_max_logit)


def _group_name(group) -> str:
    # Traced by torch.compile as an attribute of the group, guarded on the group.
    return (group if group is not None else dist.group.WORLD).group_name


def _call(q, k, v, cu_seqlens, ranks, group_name, partitioner, mask, window, softmax_scale,
          schedule, kernel, timeout, max_logit):
    """The custom op's call: the arguments in the op's types. What cannot take those types (a
    cu_seqlens that is not integers, a window that is not an int or a pair, a q that is not a
    tensor) travels as `problem`, raised by the op on this rank while the others learn of it in
    the agreement, as for every other refusal."""
    problem = ""
    cu = []
    try:
        cu = list(cu_seqlens_list(cu_seqlens))
        window = list(_window(mask, window))
    except ValueError as e:
        problem, window = str(e), [-1, -1]
    tensors = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            problem = problem or f"ringattn: {name} must be a tensor (got {type(t).__name__})"
            t = torch.empty(0, 0, 0)
        tensors.append(t)
    out, lse, most = torch.ops.ringattn_torch.attention(
        *tensors, cu, ranks, group_name, str(partitioner), str(mask), window,
        None if softmax_scale is None else float(softmax_scale), str(schedule), str(kernel),
        float(timeout), problem, bool(max_logit))
    return (out, lse, most) if max_logit else (out, lse)


def _runner(q, k, v, cu, ranks, group_name, partitioner, mask, window, softmax_scale, schedule,
            kernel, timeout, problem, agree: bool, max_logit: bool = False):
    """The runner of a call: virtual ranks (`ranks` > 0, or a ring of one rank without a group),
    or this rank of `group_name`'s ring, whose ranks first agree on the call where `agree`."""
    device = q.device
    if not group_name:
        if problem:
            raise ValueError(problem)
        key, cu = _checked_call(q, k, v, cu, partitioner, mask, schedule, kernel, window,
                                softmax_scale, max_logit)
        # A ring of one rank, or every virtual rank: q, k, v hold the whole batch.
        _check_whole_batch(q, k, v, cu)
        return _virtual_runner(key, max(ranks, 1), device)
    group = _resolve_group(group_name)
    if agree:
        # Every rank checks its call, then the ranks agree on the verdicts and the layouts
        # before anything else: a rank whose own checks fail still takes part, so that every
        # rank raises.
        verdict, key = None, None
        try:
            if problem:
                raise ValueError(problem)
            key, _ = _checked_call(q, k, v, cu, partitioner, mask, schedule, kernel, window,
                                   softmax_scale, max_logit)
        except (TypeError, ValueError) as e:
            verdict = e
        # Whether the call asks for the max logit is part of what the ranks agree on: it adds a
        # collective of its own. A group of one rank has nobody to agree with.
        if group.size() > 1:
            _agree(group, timeout, verdict, (key, bool(max_logit)), q)
        elif verdict is not None:
            raise verdict
    else:
        key, _ = _checked_call(q, k, v, cu, partitioner, mask, schedule, kernel, window,
                               softmax_scale, max_logit)
    comm = _group_communicator(group, device, timeout)
    index = device.index if device.type == "cuda" and device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    try:
        with _device_scope(device):
            plan = comm.plan(key, index)
    except Exception:
        comm.drop()
        raise
    return _GroupRunner(comm, plan, device, dense=kernel == "cudnn")


def _resolve_group(name: str):
    if name == dist.group.WORLD.group_name:
        return dist.group.WORLD
    return dist.distributed_c10d._resolve_process_group(name)


# The ops are defined by schema, with one implementation for every device
# (CompositeExplicitAutograd), a fake one for tracing and the autograd formula below. Unlike
# torch.library.custom_op this does not make the first call of the process import torch._dynamo
# (a second or more; a training loop's first optimizer step imports it anyway).
_lib = torch.library.Library("ringattn_torch", "DEF")
_lib.define("attention(Tensor q, Tensor k, Tensor v, int[] cu_seqlens, int ranks, str group_name, "
            "str partitioner, str mask, int[] window, float? softmax_scale, str schedule, "
            "str kernel, float timeout, str problem, bool max_logit) -> (Tensor, Tensor, Tensor)")
_lib.define("attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor dout, int[] cu_seqlens, int ranks, str group_name, str partitioner, "
            "str mask, int[] window, float? softmax_scale, str schedule, str kernel, "
            "float timeout) "
            "-> (Tensor, Tensor, Tensor)")


@torch.library.impl(_lib, "attention", "CompositeExplicitAutograd")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: List[int],
                  ranks: int, group_name: str, partitioner: str, mask: str, window: List[int],
                  softmax_scale: Optional[float], schedule: str, kernel: str, timeout: float,
                  problem: str, max_logit: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    runner = _runner(q, k, v, cu_seqlens, ranks, group_name, partitioner, mask, window,
                     softmax_scale, schedule, kernel, timeout, problem, agree=True,
                     max_logit=max_logit)
    return runner.forward(q, k, v, max_logit)


@torch.library.impl(_lib, "attention_backward", "CompositeExplicitAutograd")
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                           cu_seqlens: List[int], ranks: int, group_name: str, partitioner: str,
                           mask: str, window: List[int], softmax_scale: Optional[float],
                           schedule: str, kernel: str,
                           timeout: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The forward's plan, kept by its communicator (its ranks agreed on it then).
    runner = _runner(q, k, v, cu_seqlens, ranks, group_name, partitioner, mask, window,
                     softmax_scale, schedule, kernel, timeout, "", agree=False)
    return runner.backward(q, k, v, out, lse, _unit_last_stride(dout))


@torch.library.register_fake("ringattn_torch::attention", lib=_lib)
def _(q, k, v, cu_seqlens, ranks, group_name, partitioner, mask, window, softmax_scale,
      schedule, kernel, timeout, problem, max_logit):
    if problem:
        raise ValueError(problem)
    _check_tensors(q, k, v)
    out = q.new_empty(q.size(0), q.size(1), v.size(2))
    lse = q.new_empty(q.size(1), q.size(0), dtype=torch.float32)
    most = q.new_empty(q.size(1) if max_logit else 0, dtype=torch.float32)
    return out, lse, most


@torch.library.register_fake("ringattn_torch::attention_backward", lib=_lib)
def _(q, k, v, out, lse, dout, *args):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


#: The op's arguments after q, k, v: those the backward op takes again.
_ARGUMENTS = ("cu_seqlens", "ranks", "group_name", "partitioner", "mask", "window",
              "softmax_scale", "schedule", "kernel", "timeout")


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, most = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.arguments = inputs[3:3 + len(_ARGUMENTS)]
    ctx.mark_non_differentiable(lse, most)


def _backward(ctx, dout, dlse, dmost):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.ringattn_torch.attention_backward(q, k, v, out, lse, dout,
                                                            *ctx.arguments)
    # No gradient for the arguments after q, k, v: those the backward takes, problem, max_logit.
    return (dq, dk, dv) + (None,) * (len(_ARGUMENTS) + 2)


torch.library.register_autograd("ringattn_torch::attention", _backward,
                                setup_context=_setup_context, lib=_lib)


def _checked_call(q, k, v, cu_seqlens, partitioner, mask, schedule, kernel, window,
                  softmax_scale, max_logit):
    """The checks every entry point makes on the calling rank, and the call's layout key."""
    _check_tensors(q, k, v)
    check_partitioner(partitioner)
    if schedule not in SCHEDULES:
        raise ValueError(f"ringattn: unknown schedule '{schedule}' (one of "
                         f"{', '.join(SCHEDULES)})")
    _check_kernel(kernel, q)
    cu = cu_seqlens_list(cu_seqlens)
    key = _layout_key(q, k, v, cu, partitioner, mask, schedule, kernel, _window(mask, window),
                      softmax_scale)
    return key, cu


def _check_kernel(kernel, q):
    if kernel not in KERNELS:
        raise ValueError(f"ringattn: unknown kernel '{kernel}' (one of {', '.join(KERNELS)})")
    if kernel != "cudnn":
        return
    if q.device.type != "cuda":
        raise ValueError(f"ringattn: kernel 'cudnn' runs CUDA tensors (q is on {q.device}); "
                         f"CPU tensors run the host path, kernel 'native'")
    if not has_cudnn_kernel():
        raise ValueError("ringattn: this build of ringattn_torch has no cuDNN kernel (it was "
                         "built without cuDNN 9 or the cudnn-frontend headers: install "
                         "nvidia-cudnn-frontend and reinstall), or use kernel 'native'")


#: Bytes of a call's verdict in the agreement: ok, the layout's fingerprint, the reason.
_VERDICT_BYTES = 256
#: The agreement group per (group name, timeout), as weak references to the group and to its
#: agreement group: holding a group would keep it (and its worker threads) alive past
#: torch.distributed.destroy_process_group, into the interpreter's shutdown.
_agreement_groups = {}


def _agreement_group(group, timeout: float):
    """The group the ranks agree over before each call, on the host: `group` itself where its
    backend takes CPU tensors (gloo), else a gloo group of the same ranks, made once per group
    (names repeat after destroy_process_group and a new init: an entry of a group that is gone
    is made again)."""
    key = (group.group_name, float(timeout))
    with _lock:
        kept = _agreement_groups.get(key)
    if kept is not None and kept[0]() is group:
        made = kept[1]()
        if made is not None:
            return made
    if "gloo" in str(dist.get_backend(group)):
        made = group
    else:
        made = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                              timeout=datetime.timedelta(seconds=timeout),
                              use_local_synchronization=True)
    with _lock:
        _agreement_groups[key] = (weakref.ref(group), weakref.ref(made))
    return made


def _fingerprint(key, q) -> bytes:
    """8 bytes that differ where two ranks' calls differ in what plans the ring: the layout key
    and the device kind (the dtype is the ring's own check, at the call)."""
    text = repr((key, q.device.type))
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _agree(group, timeout: float, problem: Optional[Exception], key, q) -> None:
    """One small all-gather of every rank's verdict on its call (ok, or its reason) and the
    fingerprint of its layout; then the same outcome on every rank: this rank's own error where
    it refused, else a ValueError naming the first rank that refused or whose layout differs
    from rank 0's. Raises before any plan or kernel; nothing is left half done."""
    g = _agreement_group(group, timeout)
    mine = torch.zeros(_VERDICT_BYTES, dtype=torch.uint8)
    if problem is None:
        mine[0] = 1
        mine[1:9] = torch.frombuffer(bytearray(_fingerprint(key, q)), dtype=torch.uint8)
    else:
        text = str(problem)
        if text.startswith("ringattn: "):
            text = text[len("ringattn: "):]
        raw = text.encode()[:_VERDICT_BYTES - 9]
        mine[9:9 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, mine, group=g)
    if problem is not None:
        raise problem
    for r, p in enumerate(parts):
        if int(p[0]) != 1:
            reason = bytes(p[9:].tolist()).rstrip(b"\0").decode(errors="replace")
            raise ValueError(f"ringattn: rank {r} rejected the call: {reason}")
    for r, p in enumerate(parts[1:], start=1):
        if not torch.equal(p[1:9], parts[0][1:9]):
            raise ValueError(f"ringattn: rank {r} calls with another layout than rank 0 (its "
                             f"partitioner, mask, schedule, kernel, window, scale, head counts, "
                             f"widths, cu_seqlens, device kind, dtype under kernel 'cudnn' or "
                             f"return_max_logit differ; every rank of the group calls with the "
                             f"same layout)")


def _virtual_runner(key, ranks: int, device: torch.device) -> _VirtualRunner:
    """The runner of `ranks` virtual ranks for `key` on `device`, made once (its plan and its
    ranks' token indices on the device) and kept with the plans: the forward and the backward of
    every later call reuse it."""
    index = -1
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    full_key = (key, ranks, index)
    with _lock:
        runner = _virtual_plans.get(full_key)
        if runner is not None:
            _virtual_plans.move_to_end(full_key)
            return runner
    partitioner, cu = key[0], key[-1]
    with _device_scope(device):
        plan = _make_plan(None, ranks, index, key)
    indices = [token_indices(cu, partitioner, rank=r, ranks=ranks) for r in range(ranks)]
    runner = _VirtualRunner(plan, indices,
                            torch.device("cuda", index) if index >= 0 else torch.device("cpu"))
    with _lock:
        _virtual_plans[full_key] = runner
        while len(_virtual_plans) > PLANS_PER_COMMUNICATOR:
            _virtual_plans.popitem(last=False)
    return runner


def virtual_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: CuSeqlens, ranks: int, *, partitioner: str = "zigzag",
                           mask: str = "causal", window: Optional[Sequence[int]] = None,
                           softmax_scale: Optional[float] = None, schedule: str = "ring",
                           kernel: str = "native", return_max_logit: bool = False):
    """The whole ring in this process: `ranks` virtual ranks (threads, on q's device) over the
    full packed batch `q`, `k`, `v` ([tokens, heads, dim]), each rank attending to its shard
    under `partitioner` as a ring of `ranks` processes would. Returns out and lse of the whole
    batch in its own order, with autograd (and, with `return_max_logit`, the heads' max logits,
    as `ring_attention` returns them). For testing a layout on one device, and for the host path
    on CPU tensors."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ringattn: ranks must be a positive int (got {ranks!r})")
    return _call(q, k, v, cu_seqlens, ranks, "", partitioner, mask, window, softmax_scale,
                 schedule, kernel, 0.0, return_max_logit)
