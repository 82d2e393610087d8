"""The model over the training ranks (torchrun; `reinforge.distributed` knows the ranks): FSDP2
sharding or whole replicas, gradients averaged, full weights gathered for the engines, a step's
micro-batches accumulated, global gradient norms. Every function is the identity in one process.

- Replicated training (`distributed.strategy`, "auto" where it fits): `shard_model(...,
  replicate=True)` keeps the whole model on every rank (rank 0's weights, broadcast); each
  trains on its share as one process would, with no collective until the step's micro-batches
  are done, when `accumulation` averages the gradients over the ranks (`all_reduce_gradients`:
  float32, in buckets). No per-layer hooks, no DTensors: the fused optimizer and the engines
  read plain tensors.
- Sharded training: `shard_model` applies FSDP2 (`fully_shard`) to each decoder layer and to the
  whole model, with bf16 parameters and float32 gradient reduction on CUDA
  (`MixedPrecisionPolicy`); float32 everywhere on a CPU. The trainer's packed forward is
  registered as an FSDP forward method (`PACKED_FORWARD`), so the root's parameters (embeddings,
  final norm, LM head) are gathered for it and their gradients reduced after it. Under FSDP
  every rank runs the same number of micro-batches (`in_lockstep`): each forward is a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType

import torch

from reinforge.distributed import is_distributed, train_group, world_size

# The trainer's packed forward, registered on FSDP-sharded models (see `train.packing.forward`).
PACKED_FORWARD = "reinforge_packed_forward"
# Marks a model replicated over the training ranks (`shard_model(..., replicate=True)`).
REPLICATED = "reinforge_replicated"
# Gradients of a replicated model are averaged through float32 buckets of at most this size.
REDUCE_BUCKET_BYTES = 256 << 20


def shard_model(
    model: torch.nn.Module,
    trainable: bool = True,
    replicate: bool = False,
    packed_forward: Callable | None = None,
) -> torch.nn.Module:
    """FSDP2 over all ranks: each decoder layer is one unit (gathered for its forward and
    backward, then freed), the rest (embeddings, final norm, LM head) the root unit. In place;
    returns `model` (now an FSDP module whose parameters are DTensor shards). `trainable=False`
    for a frozen KL reference. `replicate`: no sharding; every rank keeps rank 0's whole model
    (see `all_reduce_gradients`). Identity outside a distributed run."""
    if not is_distributed():
        return model
    if replicate:
        broadcast_from_rank0(model)
        setattr(model, REPLICATED, True)
        return model
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    device = next(model.parameters()).device
    if train_group() is None:
        mesh = init_device_mesh(device.type, (world_size(),))
    else:  # the training processes of a disaggregated run
        mesh = DeviceMesh.from_group(train_group(), device.type)
    broadcast_from_rank0(model)
    policy = MixedPrecisionPolicy()  # a CPU computes in float32, exact against one process
    if device.type == "cuda" and trainable:
        # The weights' own dtype (bf16 on a GPU) for compute, float32 for reducing gradients.
        # LoRA adapters (float32, the only trainable tensors) keep their dtype: param_dtype None.
        dtypes = {p.dtype for p in model.parameters()}
        param_dtype = torch.bfloat16 if dtypes == {torch.bfloat16} else None
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if packed_forward is not None:  # the trainer's forward, run as FSDP's (gathers the layers)
        setattr(model, PACKED_FORWARD, MethodType(packed_forward, model))
        register_fsdp_forward_method(model, PACKED_FORWARD)
    return model


@torch.no_grad()
def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Rank 0's weights on every rank: FSDP keeps each rank's slice of its own copy, so the
    copies must be equal, whatever a random initialisation (a fresh LoRA adapter, a shape
    model) did on each."""
    group = train_group()
    source = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        torch.distributed.broadcast(tensor.data, src=source, group=group)


def fsdp_modules(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_replicated(model: torch.nn.Module) -> bool:
    """`model` is whole on every training rank (`shard_model(..., replicate=True)`)."""
    return is_distributed() and getattr(model, REPLICATED, False)


def in_lockstep(model: torch.nn.Module) -> bool:
    """Every forward of `model` is a collective (FSDP gathers its layers), so the ranks must run
    equally many; a replicated model's ranks meet only once a step."""
    return is_distributed() and not getattr(model, REPLICATED, False)


@torch.no_grad()
def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Average the gradients of a replicated `model` over the training ranks: summed in float32
    buckets of at most `REDUCE_BUCKET_BYTES` and divided by the world size, in place. A
    parameter with a gradient on some ranks only (a layer one rank's data never reached) counts
    zeros for the others; one with no gradient anywhere keeps none, as in one process."""
    if not is_replicated(model):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(has_grad, group=train_group())
    grads = []
    for param, anywhere in zip(params, has_grad.tolist()):
        if anywhere and param.grad is None:
            param.grad = torch.zeros_like(param)
        if anywhere:
            grads.append(param.grad)
    limit = REDUCE_BUCKET_BYTES // 4
    pieces = [piece for g in grads for piece in g.view(-1).split(limit)]  # views into the grads
    while pieces:
        count, size = 0, 0
        while count < len(pieces) and size + pieces[count].numel() <= limit:
            size += pieces[count].numel()
            count += 1
        bucket, pieces = pieces[:count], pieces[count:]
        flat = torch.empty(size, dtype=torch.float32, device=device)
        for piece, part in zip(bucket, flat.split([x.numel() for x in bucket])):
            part.copy_(piece)
        torch.distributed.all_reduce(flat, group=train_group())
        flat.div_(world_size())
        for piece, part in zip(bucket, flat.split([x.numel() for x in bucket])):
            piece.copy_(part)


@contextmanager
def full_weights(model: torch.nn.Module) -> Iterator[None]:
    """Within the block every parameter of a sharded `model` is the full, gathered tensor, in the
    modules themselves: the engines read them in place as on one GPU, and a forward through the
    model's own `forward` (the simple engine) gathers nothing more, so ranks may run different
    numbers of forwards. Identity for an unsharded model."""
    units = fsdp_modules(model) if is_distributed() else []
    if not units:
        yield
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        root = units[0]
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not root, recurse=False)


@contextmanager
def accumulation(model: torch.nn.Module, unsharded: bool) -> Iterator:
    """The micro-batches of one optimizer step. Yields `before(last)`, to call before each
    micro-batch's forward with whether it is the step's last.

    `unsharded` (the plan's `distributed.accumulate_unsharded`): every layer stays gathered from
    its first forward to the step's last backward, and gradients add up unsharded (in float32,
    FSDP's reduce dtype) until the last micro-batch, which reduce-scatters them once. Otherwise
    FSDP gathers each layer for every forward, recomputation and backward, and reduce-scatters
    every micro-batch's gradients: less memory, and per layer and micro-batch a gather, a
    reduction and their host-side work (measured on G1 with FSDP over one H100: 1.1 s of a
    3.5 s update, none of it communication). Identity for an unsharded model; a replicated one
    averages its gradients over the ranks once the step's micro-batches are done."""
    if is_replicated(model):
        yield lambda last: None
        all_reduce_gradients(model)
        return
    units = fsdp_modules(model) if is_distributed() else []
    if not units or not unsharded:
        yield lambda last: None
        return
    root = units[0]

    def before(last: bool) -> None:
        root.set_requires_gradient_sync(last)
        root.set_reshard_after_backward(last)

    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield before
    finally:
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)
        for unit in units:
            unit.set_reshard_after_forward(unit is not root, recurse=False)


def clip_grad_norm(parameters, max_norm: float, as_tensor: bool = False):
    """`torch.nn.utils.clip_grad_norm_` whose result is the global norm, also over DTensor shards
    (the same number on every rank); `as_tensor`: on the device, not read back."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    full_tensor = getattr(norm, "full_tensor", None)
    norm = full_tensor() if full_tensor is not None else norm
    return norm if as_tensor else float(norm)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (element-wise work needs no communication); other tensors as
    they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
