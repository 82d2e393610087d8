"""The pieces of distributed training that run in one process: keyed sampling that does not
depend on how prompts are split among ranks, micro-batch counts made equal across ranks, the
preflight's batch arithmetic, the planner's sharded memory, and the single-process identity."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reinforge import distributed, sharding
from reinforge.config import TrainConfig, load_config
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.models.loading import load_model, load_tokenizer, model_source
from reinforge.train.packing import forward
from reinforge.train.planner import ModelShape, PlanInputs, plan_memory

from ..conftest import TINY_RUN


def test_a_prompt_samples_the_same_whatever_share_of_the_batch_generates_it():
    source = model_source("builtin:micro", 0)
    model = load_model(source, torch.device("cpu"), torch.float32)
    engine = PagedEngine(model, load_tokenizer(source), block_size=4)
    prompts = [[5, 6, 7], list(range(20, 31)), [40, 41], list(range(60, 66))]
    params = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=11, ignore_eos=True)
    whole = engine.generate(prompts, SamplingParams(**params))
    first = engine.generate(prompts[:2], SamplingParams(**params))
    second = engine.generate(prompts[2:], SamplingParams(**params, first_prompt_index=2))
    ids = lambda out: [[c.token_ids for c in group] for group in out]  # noqa: E731
    assert ids(first + second) == ids(whole)
    assert len({tuple(c.token_ids) for c in whole[0]}) > 1, "a group's samples differ"
    # without the offset, the second share would draw the first share's noise
    unkeyed = engine.generate(prompts[2:], SamplingParams(**params))
    assert ids(unkeyed) != ids(whole[2:])


def test_micro_batches_are_split_to_the_count_of_the_rank_with_most(monkeypatch):
    lengths = [30, 10, 10, 10, 40, 5]
    monkeypatch.setattr(forward, "max_over_ranks", lambda count: 4)
    batches = forward.equal_micro_batches([[0, 1, 2, 3], [4, 5]], lengths)
    assert len(batches) == 4
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(b == sorted(b) and b for b in batches)
    monkeypatch.setattr(forward, "max_over_ranks", lambda count: count)
    assert forward.equal_micro_batches([[0, 1], [2]], lengths) == [[0, 1], [2]]


def test_preflight_checks_the_global_batch_for_the_number_of_processes(monkeypatch):
    from reinforge.preflight import run_preflight

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = load_config(TrainConfig, None, [*TINY_RUN, "algorithm.dynamic_sampling=true"])
    pf = run_preflight(cfg)
    errors = "\n".join(pf.errors)
    assert "rollout.prompts_per_step = 4 does not divide among 3 training processes" in errors
    assert "set rollout.prompts_per_step = 6 (or 3)" in errors
    assert "algorithm.dynamic_sampling = true is not supported with several processes" in errors
    rows = dict(pf.rows)
    assert rows["processes"].startswith("3 (torchrun; 3 per node)")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    pf = run_preflight(load_config(TrainConfig, None, TINY_RUN))
    assert not pf.errors
    rows = dict(pf.rows)
    assert rows["per training process"].startswith("2 prompts x 4 samples = 8 sequences")
    # a tiny model: a whole replica per process fits as well as a shard ("auto")
    assert "replicated over 2 processes" in rows["sharding"]
    assert "float32, gradients averaged" in rows["plan: gradient all-reduce bucket"]
    assert "/ 2 processes on this node" in rows["memory budget"]
    pf = run_preflight(load_config(TrainConfig, None, [*TINY_RUN, "distributed.strategy=fsdp"]))
    assert "FSDP over 2 processes" in dict(pf.rows)["sharding"]


def test_the_plan_of_a_sharded_run_divides_weights_gradients_and_optimizer_states():
    model = ModelShape(494_032_768, 24, 896, 4864, 14, 2, 64, 151_936)
    work = dict(prompt_len=256, response_len=512, samples_per_prompt=8, prompts_per_step=32)
    one = plan_memory(PlanInputs(free_bytes=70 << 30, model=model, **work))
    four = plan_memory(PlanInputs(free_bytes=70 << 30, model=model, num_shards=4, **work))
    sizes = lambda plan: {item: size for item, size, _ in plan.rows}  # noqa: E731
    for item in ("weights", "gradients", "optimizer states"):
        assert sizes(four)[item] == pytest.approx(sizes(one)[item] / 4, abs=1)
    notes = {item: note for item, _, note in four.rows}
    assert "/ 4 processes (FSDP shard)" in notes["optimizer states"]
    assert sizes(four)["gathered weights, generation"] == model.num_params * 2 * 3 // 4


def test_the_planner_accumulates_unsharded_when_it_fits_and_refuses_a_forced_one_that_does_not():
    from reinforge.errors import ConfigError

    model = ModelShape(494_032_768, 24, 896, 4864, 14, 2, 64, 151_936)
    work = dict(prompt_len=128, response_len=512, samples_per_prompt=8, prompts_per_step=16)
    sharded = dict(model=model, num_shards=2, **work)
    roomy = plan_memory(PlanInputs(free_bytes=70 << 30, **sharded))
    assert roomy.accumulate_unsharded
    rows = {item: (size, note) for item, size, note in roomy.rows}
    # the other half of the weights stays gathered, and a float32 sum per parameter
    gathered_rest = model.num_params * 2 // 2 - rows["gathered weights, training"][0]
    assert rows["unsharded accumulation"][0] == pytest.approx(
        gathered_rest + model.num_params * 4, abs=2
    )
    assert rows["unsharded accumulation"][1].endswith(": on")
    # tight: the same plan without it (micro-batch and KV pool not shrunk for it)
    tight_bytes = 9 << 30
    tight = plan_memory(PlanInputs(free_bytes=tight_bytes, **sharded))
    assert not tight.accumulate_unsharded
    assert (
        "off (would need" in {item: note for item, _, note in tight.rows}["unsharded accumulation"]
    )
    with pytest.raises(ConfigError) as err:
        plan_memory(PlanInputs(free_bytes=tight_bytes, accumulate_unsharded=True, **sharded))
    assert "distributed.accumulate_unsharded = true needs" in str(err.value)
    assert "set distributed.accumulate_unsharded = false" in str(err.value)
    off = plan_memory(PlanInputs(free_bytes=70 << 30, accumulate_unsharded=False, **sharded))
    assert not off.accumulate_unsharded
    assert off.micro_batch_tokens == roomy.micro_batch_tokens
    # one process: nothing to gather or reduce, no choice made
    assert not plan_memory(
        PlanInputs(free_bytes=70 << 30, model=model, **work)
    ).accumulate_unsharded


def test_auto_replicates_a_model_that_fits_whole_and_shards_one_that_does_not():
    from reinforge.errors import ConfigError
    from reinforge.train.planner.memory import plan_strategy

    small = ModelShape(494_032_768, 24, 896, 4864, 14, 2, 64, 151_936)  # qwen2.5-0.5b
    work = dict(prompt_len=256, response_len=1024, samples_per_prompt=8, prompts_per_step=16)
    on_two = PlanInputs(free_bytes=130 << 30, model=small, num_shards=2, **work)
    plan, replicated = plan_strategy(on_two, "auto")
    assert replicated
    rows = {item: (size, note) for item, size, note in plan.rows}
    assert rows["weights"][0] == small.num_params * 2  # whole
    assert "whole, on each of 2 processes" in rows["weights"][1]
    assert rows["gradient all-reduce bucket"][0] == sharding.REDUCE_BUCKET_BYTES
    assert plan_strategy(on_two, "fsdp")[1] is False
    # qwen3-8b, full fine-tune with float32 AdamW states on two 80 GB GPUs: only shards fit
    big = ModelShape(8_190_735_360, 36, 4096, 12288, 32, 8, 128, 151_936)
    on_two_big = PlanInputs(free_bytes=78 << 30, model=big, num_shards=2, **work)
    plan, replicated = plan_strategy(on_two_big, "auto")
    assert not replicated and "(FSDP shard)" in {i: n for i, _, n in plan.rows}["weights"]
    with pytest.raises(ConfigError) as err:
        plan_strategy(on_two_big, "replicate")
    assert 'distributed.strategy = "replicate" holds the whole model' in str(err.value)
    assert 'use distributed.strategy = "fsdp"' in str(err.value)
    # where a replica would need checkpointing that shards avoid: FSDP
    snug = PlanInputs(free_bytes=18 << 30, model=small, num_shards=2, **work)
    sharded = plan_memory(snug)
    whole = plan_memory(replace(snug, num_shards=1, replicas=2))
    assert whole.gradient_checkpointing and not sharded.gradient_checkpointing
    assert plan_strategy(snug, "auto") == (sharded, False)
    # a replica's micro-batch may be smaller than the shards', but not below the good size
    roomier = replace(snug, free_bytes=20 << 30)
    whole = plan_memory(replace(roomier, num_shards=1, replicas=2))
    assert plan_memory(roomier).micro_batch_tokens > whole.micro_batch_tokens >= 8192
    assert plan_strategy(roomier, "auto") == (whole, True)


def test_one_process_starts_no_process_group_and_shares_everything(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    distributed.init_from_env("auto")
    assert not distributed.is_distributed()
    assert distributed.share(6) == range(6)
    assert distributed.loss_scale() == 1.0
    metrics = {"loss": 0.5, "step_s": 1.0}
    assert distributed.reduce_metrics(metrics, summed={"loss"}) is metrics
    model = torch.nn.Linear(2, 2)
    assert sharding.shard_model(model) is model


def test_preflight_of_the_disaggregated_mode_counts_the_trainers(monkeypatch):
    from reinforge.preflight import run_preflight

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = load_config(TrainConfig, None, [*TINY_RUN, "distributed.mode=disaggregated"])
    pf = run_preflight(cfg)
    assert "rollout.prompts_per_step = 4 does not divide among 3 training processes" in "\n".join(
        pf.errors
    )
    assert any("set algorithm.tis_cap = 2.0" in w for w in pf.warnings)
    assert "the last rank generates every rollout, 3 train" in dict(pf.rows)["processes"]


def _average_gradients_on_rank(rank: int, port: int, results) -> None:
    """Two gloo processes: rank 0 has gradients for both layers, rank 1 for the first only; the
    bucket holds 8 floats, so the first layer's 12-element weight gradient spans two buckets."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        sharding.REDUCE_BUCKET_BYTES = 8 * 4
        torch.manual_seed(rank)  # different weights: broadcast_from_rank0 must equalise them
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        model[1].requires_grad_(True)
        sharding.shard_model(model, replicate=True)
        assert sharding.is_replicated(model) and not sharding.in_lockstep(model)
        x = torch.full((1, 3), float(rank + 1))
        out = model(x) if rank == 0 else model[0](x)
        out.sum().backward()
        before = {n: p.grad.tolist() for n, p in model.named_parameters() if p.grad is not None}
        sharding.all_reduce_gradients(model)
        after = {n: p.grad.tolist() for n, p in model.named_parameters()}
        weights = {n: p.detach().tolist() for n, p in model.named_parameters()}
        results.put((rank, before, after, weights))  # plain lists: no shared memory
    finally:
        torch.distributed.destroy_process_group()


def test_a_replica_averages_its_gradients_over_the_ranks_in_buckets():
    import multiprocessing

    from tests.distributed.test_torchrun import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_average_gradients_on_rank, args=(r, port, results)) for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=120) for _ in procs))
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    (before0, after0, weights0), (before1, after1, weights1) = got[0], got[1]
    for name in weights0:
        assert weights0[name] == weights1[name]  # rank 0's weights everywhere
        assert after0[name] == after1[name]  # the same gradient everywhere
        # the mean over ranks; a gradient rank 1 lacks counts as zeros there
        mine, theirs = torch.tensor(before0[name]), before1.get(name)
        want = (mine + (torch.tensor(theirs) if theirs else torch.zeros_like(mine))) / 2
        torch.testing.assert_close(torch.tensor(after0[name]), want)
    assert "1.weight" not in before1
