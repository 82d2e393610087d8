"""torchrun: one process per device, the same config on one GPU or many (the model's sharding,
replication and gradient averaging: `reinforge.sharding`).

Contract:
- `init_from_env` reads what torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
  the rendezvous) and, with WORLD_SIZE > 1, starts the process group: NCCL for CUDA tensors plus
  gloo for host ones on a GPU, gloo on a CPU; each process takes the GPU LOCAL_RANK names.
  Without torchrun, or with WORLD_SIZE = 1, nothing starts and every helper here is the identity:
  the single-process path has no process group, no wrapping and no extra work.
- Data-parallel rollout: each rank generates for its own share of a step's prompts (`share`),
  with its own engine over the full weights (`full_weights`). A prompt's n samples always stay
  on one rank, so group advantages need no communication; the sampler keys each sequence's noise
  by (seed, global prompt index, sample index), so which rank generates a prompt changes no
  sample (`SamplingParams.first_prompt_index`).
- The model over the training ranks (FSDP2 shards or whole replicas, gradient averaging, full
  weights for the engines): `reinforge.sharding`.
- Gradients: FSDP (or `all_reduce_gradients`) averages them over ranks. Each rank's loss is divided by the *global* token and
  sequence counts (`sum_over_ranks`), and backpropagated times the world size
  (`loss_scale`), so the averaged gradient is exactly the single-process gradient of the same
  global batch. Under FSDP every rank runs the same number of micro-batches
  (`equal_micro_batches`, `in_lockstep`): each forward is a collective.
- Metrics: `reduce_metrics` combines each rank's step metrics (mean, sum or max per key); rank 0
  alone writes files and prints.
- Disaggregated (`distributed.mode = "disaggregated"`, `train.loop.disaggregated`): the last
  `distributed.generators` ranks only generate and the others train; "rank", "world size" and
  every reduction here then mean the training processes' (`train_group`); the main process is
  rank 0, a trainer. A generator's `share` is its slice of a step's prompts among the generators
  (`generator_share`), so the sampler's per-prompt keys are those of one generator.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from reinforge.errors import ConfigError

# ------------------------------------------------------------------------------ the world

# The ranks that train together (None: all of them), the ranks that only generate, and whether
# this process is one of them: set by `init_from_env` for the disaggregated mode
# (`train.loop.disaggregated`).
_TRAIN_GROUP = None
_GENERATORS: list[int] = []
_IS_GENERATOR = False
_LINK_GROUP = None  # rank 0 (the first trainer) and the generators: weights go through it


def env_world_size() -> int:
    """Processes torchrun started for this job (1 outside torchrun); readable before any init."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_world_size() -> int:
    """Processes torchrun started on this node (they share its RAM and GPUs)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def env_train_size(cfg) -> int:
    """Processes that will train `cfg` (all of torchrun's, less the generators when
    disaggregated); readable before any init."""
    return max(env_world_size() - env_generators(cfg), 1)


def env_generators(cfg) -> int:
    """Processes that will only generate for `cfg` (0 unless disaggregated)."""
    section = getattr(cfg, "distributed", None)
    if getattr(section, "mode", "colocated") != "disaggregated":
        return 0
    return section.generators


def is_launched() -> bool:
    """Started by torchrun with more than one process (a process group exists)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_generator() -> bool:
    """This process only generates, for the others to train (the disaggregated mode)."""
    return _IS_GENERATOR


def world_size() -> int:
    """Processes that train together (data parallel, FSDP): 1 in a single process and for a
    disaggregated run's generator."""
    if not is_launched() or _IS_GENERATOR:
        return 1
    return torch.distributed.get_world_size(_TRAIN_GROUP)


def rank() -> int:
    """This process's rank among those that train together."""
    if not is_launched() or _IS_GENERATOR:
        return 0
    return torch.distributed.get_rank(_TRAIN_GROUP)


def is_distributed() -> bool:
    """More than one process trains: sharded weights, reductions, sharded checkpoints."""
    return world_size() > 1


def is_main() -> bool:
    """The first training process: it writes the run's files and prints."""
    return rank() == 0 and not _IS_GENERATOR


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def train_group():
    """The process group of the processes that train together (None: the default group)."""
    return _TRAIN_GROUP


def link_group():
    """Rank 0 (the first trainer) and the generators of a disaggregated run."""
    return _LINK_GROUP


def generator_ranks() -> list[int]:
    """The global ranks that only generate (the last ones; none outside the disaggregated
    mode)."""
    return list(_GENERATORS)


def generator_share(count: int, index: int, num_generators: int) -> range:
    """Generator `index`'s slice of a step's `count` prompts: consecutive, as equal as they can
    be (the first `count % num_generators` take one more), so any count splits."""
    per, extra = divmod(count, num_generators)
    start = index * per + min(index, extra)
    return range(start, start + per + (index < extra))


def init_from_env(
    device_setting: str,
    disaggregated: bool = False,
    timeout_s: float | None = None,
    generators: int = 1,
) -> None:
    """Start the process group when torchrun launched more than one process (idempotent).
    `disaggregated`: the last `generators` ranks only generate, the other ranks train (rank 0 is
    then a trainer, and the main process, as in every mode: transformers writes a checkpoint's
    weights from global rank 0 only). `timeout_s`: how long a collective waits for the others
    (`distributed.collective_timeout_s`; None: torch's default)."""
    world = env_world_size()
    if world <= 1 or is_launched():
        return
    if disaggregated and generators >= world:
        raise ConfigError(
            f"distributed.generators = {generators} with {world} processes (WORLD_SIZE) leaves "
            f"none to train; set distributed.generators = {world - 1} or fewer, or start more "
            "processes"
        )
    uses_cuda = device_setting != "cpu" and torch.cuda.is_available()
    if device_setting not in ("auto", "cuda", "cpu"):
        raise ConfigError(
            f"run.device = {device_setting!r} under torchrun: each process takes the GPU its "
            "LOCAL_RANK names; use run.device = 'auto' (or 'cuda', or 'cpu') and choose GPUs "
            "with CUDA_VISIBLE_DEVICES"
        )
    if uses_cuda:
        if local_rank() >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank()} but only {torch.cuda.device_count()} GPUs are visible "
                "on this node; start at most that many processes per node (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank())
    backend = "cuda:nccl,cpu:gloo" if uses_cuda else "gloo"
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    torch.distributed.init_process_group(backend=backend, timeout=timeout)
    if disaggregated:
        _split_roles(world, generators, timeout)
    if not is_main():  # one console: the main process prints, the others only on failure
        from reinforge.metrics import console

        console.quiet = True


def _split_roles(world: int, generators: int, timeout: timedelta | None) -> None:
    """The disaggregated mode's groups: the first ranks train, the last `generators` generate."""
    global _TRAIN_GROUP, _GENERATORS, _IS_GENERATOR, _LINK_GROUP
    num_trainers = world - generators
    _GENERATORS = list(range(num_trainers, world))
    _TRAIN_GROUP = torch.distributed.new_group(list(range(num_trainers)), timeout=timeout)
    _LINK_GROUP = torch.distributed.new_group([0, *_GENERATORS], timeout=timeout)
    _IS_GENERATOR = torch.distributed.get_rank() in _GENERATORS
    if torch.distributed.get_rank() == 0:
        from reinforge.metrics import console

        console.print(
            f"disaggregated: {_ranks(num_trainers, world - 1)} generate (distributed.generators "
            f"= {generators}), {_ranks(0, num_trainers - 1)} train"
        )


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def shutdown() -> None:
    global _TRAIN_GROUP, _GENERATORS, _IS_GENERATOR, _LINK_GROUP
    if is_launched():
        torch.distributed.destroy_process_group()
    _TRAIN_GROUP, _GENERATORS, _IS_GENERATOR, _LINK_GROUP = None, [], False, None


def barrier() -> None:
    """Wait for the processes that train together."""
    if is_distributed():
        torch.distributed.barrier(group=_TRAIN_GROUP)


def barrier_all() -> None:
    """Wait for every process of the job (the generator of a disaggregated run too)."""
    if is_launched():
        torch.distributed.barrier()


def share(count: int) -> range:
    """This rank's slice of `count` items of a step (preflight checks that the ranks divide it);
    a generator's: its slice among the generators (`generator_share`)."""
    if _IS_GENERATOR:
        index = _GENERATORS.index(torch.distributed.get_rank())
        return generator_share(count, index, len(_GENERATORS))
    size = world_size()
    assert count % size == 0, f"{count} items do not divide among {size} ranks"
    per_rank = count // size
    return range(rank() * per_rank, (rank() + 1) * per_rank)


def loss_scale() -> float:
    """What each rank multiplies its loss by before backward: FSDP (or `all_reduce_gradients`)
    averages gradients over the ranks, and the losses are already divided by global counts, so the average must become a
    sum."""
    return float(world_size())


# ------------------------------------------------------------------------------ reductions


def sum_over_ranks(value: float) -> float:
    if not is_distributed():
        return value
    total = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(total, group=_TRAIN_GROUP)
    return float(total.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (a stop signal reaches ranks at different
    moments; they must agree on the step they stop at)."""
    return sum_over_ranks(1.0 if flag else 0.0) > 0


def max_over_ranks(value: int) -> int:
    if not is_distributed():
        return value
    top = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=_TRAIN_GROUP)
    return int(top.item())


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's `rows` [R, ...] (the same shape on each), concatenated in rank order."""
    if not is_distributed():
        return rows
    parts = [torch.empty_like(rows) for _ in range(world_size())]
    torch.distributed.all_gather(parts, rows.contiguous(), group=_TRAIN_GROUP)
    return torch.cat(parts)


def gather_objects(obj) -> list:
    """Every training rank's `obj` (picklable, any size), in rank order."""
    if not is_distributed():
        return [obj]
    parts: list = [None] * world_size()
    torch.distributed.all_gather_object(parts, obj, group=_TRAIN_GROUP)
    return parts


def reduce_metrics(
    metrics: dict[str, float],
    summed: set[str] = frozenset(),
    maxed: set[str] = frozenset(),
    minned: set[str] = frozenset(),
) -> dict[str, float]:
    """One dict for the step from every rank's: keys in `summed` add up (counts, and the loss
    terms already divided by global counts), keys in `maxed` take the largest (wall times, peak
    memory), keys in `minned` the smallest, the rest are means (the ranks hold equal numbers of groups, so a mean of per-rank
    means is the mean over all trajectories). A key some ranks lack is reduced over the others."""
    if not is_distributed():
        return metrics
    gathered: list[dict[str, float]] = [{} for _ in range(world_size())]
    torch.distributed.all_gather_object(gathered, metrics, group=_TRAIN_GROUP)
    return combine_metrics(gathered, summed, maxed, minned)


def combine_metrics(
    parts: list[dict[str, float]],
    summed: set[str] = frozenset(),
    maxed: set[str] = frozenset(),
    minned: set[str] = frozenset(),
) -> dict[str, float]:
    """One dict from several (`reduce_metrics`' rule): sums, maxima, minima, the rest means; a
    key some parts lack is combined over the others."""
    keys = dict.fromkeys(k for part in parts for k in part)  # the first part's order first
    out = {}
    for key in keys:
        values = [float(part[key]) for part in parts if key in part]
        if key in summed:
            out[key] = sum(values)
        elif key in maxed:
            out[key] = max(values)
        elif key in minned:
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out
