"""The update from the engine's records (`train.packing.records`, `train.engine_records`; the
micro model, CPU float32): logprobs, entropies and every gradient equal the checkpointed plain
path's, with and without shared prompts, for the mask and varlen attention implementations,
padded to a graph's shape too, with the LM head's forward taken from the engine's statistics
(no logits) or computed; records that do not serve (other ids, stale, missing) leave the
micro-batch to the plain path, statistics at another temperature leave the head's forward to
the trainer; an RL step from records equals one without them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reinforge.checkpoint import TrainerState
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.models.loading import load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.train.loop import rl
from reinforge.train.packing import PackSequence, pack_one
from reinforge.train.packing.attention import select_packed_attention
from reinforge.train.packing.forward import packed_logprobs
from reinforge.train.packing.static import common_shape, pad_packed
from reinforge.train.planner.memory import MemoryChoice
from tests.train.test_packing import load_micro
from tests.train.test_rl_loop import (
    DigitTasks,
    NullLogger,
    make_learner,
    make_policy,
    micro_step_config,
    step_with_grads,
)

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8], [4, 4, 6, 1, 9, 12, 30]]


def generated(model, n: int = 3, max_new_tokens: int = 7) -> list[PackSequence]:
    """The engine's completions of PROMPTS (n each) as sequences carrying their records."""
    tokenizer = load_tokenizer(builtin_path("micro", 0))
    engine = PagedEngine(model, tokenizer, block_size=4)
    engine.runner.record_hidden(1 << 30).trainer_temperature = 1.0
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, n=n, seed=4)
    out = engine.generate(PROMPTS, params)
    out[0][0].hidden.store.wait()
    return [
        PackSequence(prompt, c.token_ids, hidden=c.hidden)
        for prompt, group in zip(PROMPTS, out)
        for c in group
    ]


def checkpointed(attention: str):
    model = load_micro()
    if attention != "sdpa":
        select_packed_attention(model, attention)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def plain(batch):
    """`batch` without the engine's records and statistics."""
    return replace(batch, record_rows_L=None, record_stats_K2=None)


def run(model, batch):
    """Logprobs, entropies and every gradient of one weighted loss over the packed row."""
    model.zero_grad(set_to_none=True)
    _, logprobs_K, entropy_K = packed_logprobs(model, batch)
    weights = torch.linspace(-1.0, 2.0, logprobs_K.numel())
    ((logprobs_K * weights).sum() + 0.1 * entropy_K.sum()).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return logprobs_K.detach(), entropy_K.detach(), grads


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(a[1], b[1], atol=2e-5, rtol=2e-5)
    for plain, recorded in zip(a[2], b[2]):
        torch.testing.assert_close(plain, recorded, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "reference", "padded"])
@pytest.mark.parametrize("shared", [False, True])
def test_the_update_from_records_equals_the_checkpointed_one(attention, shared):
    model = checkpointed(attention)
    seqs = generated(model)
    batch = pack_one(seqs, range(len(seqs)), share_prompts=shared)
    assert batch.record_rows_L is not None and (batch.key_index_J is not None) == shared
    assert batch.record_rows_L.shape == (batch.num_tokens,)
    assert batch.record_stats_K2.shape == (batch.targets_K.numel(), 2)
    assert torch.isfinite(batch.record_stats_K2).all()  # every target was sampled
    plain = run(model, replace(batch, record_rows_L=None, record_stats_K2=None))
    recorded = run(model, batch)
    assert_same(plain, recorded)
    # the records with the head's own forward (its logits computed), or the statistics alone
    assert_same(plain, run(model, replace(batch, record_stats_K2=None)))
    assert_same(plain, run(model, replace(batch, record_rows_L=None)))
    # padded to a larger graph shape: the pad tokens read the zero row, the real ones as before
    shape = common_shape([batch], tokens=batch.num_tokens + 9, room=1.2)
    padded = pad_packed(batch, shape)
    assert shape.records is not None and padded.record_rows_L.shape == (shape.tokens,)
    assert not padded.record_rows_L[batch.num_tokens :].any()
    assert shape.record_stats and padded.record_stats_K2.shape == (shape.targets, 2)
    logprobs_K, _, grads = run(model, padded)
    real = logprobs_K[: plain[0].numel()]
    torch.testing.assert_close(real, plain[0], atol=2e-5, rtol=2e-5)
    for a, b in zip(plain[2], grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_records_must_fit_the_ids_be_fresh_and_complete():
    model = checkpointed("sdpa")
    seqs = generated(model, n=2)
    assert pack_one(seqs, range(len(seqs))).record_rows_L is not None
    # the trainer's ids differ from what the engine computed: that micro-batch runs plain
    other = list(seqs)
    other[1] = PackSequence(
        seqs[1].prompt_ids, [*seqs[1].completion_ids[:-2], 99, 98], hidden=seqs[1].hidden
    )
    assert pack_one(other, range(len(other))).record_rows_L is None
    # a completion cut short (a prefix of what the engine computed) still reads its rows
    cut = [PackSequence(s.prompt_ids, s.completion_ids[:3], hidden=s.hidden) for s in seqs]
    cut_batch = pack_one(cut, range(len(cut)))
    assert cut_batch.record_rows_L is not None
    assert_same(run(model, plain(cut_batch)), run(model, cut_batch))
    # a sequence without records
    missing = [*seqs[:-1], PackSequence(seqs[-1].prompt_ids, seqs[-1].completion_ids)]
    assert pack_one(missing, range(len(missing))).record_rows_L is None
    # the weights changed (an optimizer step) or a new rollout began: stale
    store = seqs[0].hidden.store
    # statistics at a temperature the trainer does not take: the head computes its logits
    store.trainer_temperature = 0.5
    at_other = pack_one(seqs, range(len(seqs)))
    assert at_other.record_rows_L is not None and at_other.record_stats_K2 is None
    store.trainer_temperature = 1.0
    store.invalidate()
    assert pack_one(seqs, range(len(seqs))).record_rows_L is None
    # and until the next rollout begins, generations record nothing (an evaluation's)
    rows = store.num_rows
    tokenizer = load_tokenizer(builtin_path("micro", 0))
    engine = PagedEngine(model, tokenizer, block_size=4)
    engine.runner.records = store
    out = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))
    assert out[0][0].hidden is None and store.num_rows == rows


def test_an_rl_step_from_records_equals_one_without(tmp_path):
    """One GRPO step (KL reference, several micro-batches) from the same seed: the same loss,
    gradient norm and gradients with `train.engine_records` on (every micro-batch from records)
    as off; the records go stale after the step's optimizer step."""
    results = {}
    for records in (True, False):
        torch.manual_seed(0)
        cfg = micro_step_config(
            "optim.lr=3e-3",
            "train.micro_batch_tokens=120",
            "algorithm.kl_coef=0.05",
            f"train.engine_records={str(records).lower()}",
        )
        policy = make_policy(cfg)
        policy.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        memory = MemoryChoice(cfg.train.micro_batch_tokens, True, None, "set by the test")
        policy.setup = policy.setup.__class__(
            policy.setup.source, policy.setup.device, policy.setup.dtype, memory
        )
        learner = make_learner(cfg, tmp_path / str(records), policy)
        m, grads = step_with_grads(cfg, learner)
        results[records] = (m, grads)
        store = learner.policy.engine.runner.records
        if records:
            assert store is not None and store.num_rows > 1
            assert m["records_micro_batches"] >= 2, m.get("records_micro_batches")
            assert m["records_missed_micro_batches"] == 0
            assert m["records_head_micro_batches"] == m["records_micro_batches"]
            assert store.generation >= 2  # reset for the rollout, then stale after the step
        else:
            assert store is None and "records_micro_batches" not in m
    (on, on_w), (off, off_w) = results[True], results[False]
    for key in ("loss", "grad_norm", "kl_ref", "reward_mean"):
        assert abs(on[key] - off[key]) <= 1e-5 + 1e-4 * abs(off[key]), key
    for a, b in zip(on_w, off_w):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_the_captured_update_from_records_has_the_plain_ones_gradient_on_cuda(
    tmp_path, capsys, compiled
):
    """On the GPU (bf16, the paged engine's Triton forward and decode graphs recording, varlen
    attention, checkpointing, a kept update graph, compiled layers or not): two RL steps at
    learning rate 0 with `train.engine_records` on and off sample the same tokens, and the
    update replayed from records (and the engine's LM-head statistics) has the plain update's
    gradients and metrics."""
    from reinforge.train.loop.session import Policy, policy_engine

    from .test_step_graphs import cuda_policy
    from .test_update import RecordingSGD

    base = [
        "rollout.temperature=0.7",
        "algorithm.kl_coef=0",
        "optim.max_grad_norm=1e9",
        "train.micro_batch_tokens=48",
        "train.cuda_graphs=run",
    ]
    results = []
    for records in ("false", "true"):
        cfg = micro_step_config(*base, f"train.engine_records={records}")
        torch.manual_seed(0)
        trainer = cuda_policy(cfg, compiled)
        engine = policy_engine(cfg, trainer.model, trainer.tokenizer, 1 << 28)
        policy = Policy(trainer.model, trainer.tokenizer, engine, trainer.source, trainer.setup)
        learner = make_learner(cfg, tmp_path / records, policy)
        learner.optimizer = RecordingSGD(learner.policy.model.parameters(), lr=0.0)
        learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
        steps = []
        for step in (1, 2):
            m = rl.rl_step(
                cfg, learner, DigitTasks(cfg.task), TrainerState("rl", 0, 0), step, NullLogger()
            )
            steps.append((learner.optimizer.grads, m))
        results.append(steps)
    out = capsys.readouterr().out
    assert "capturing the update failed" not in out, out
    for (plain_grads, plain), (recorded_grads, recorded) in zip(*results):
        assert "records_micro_batches" not in plain
        assert recorded["records_micro_batches"] >= 2 and recorded.get("graph_replay", 0) >= 1
        # the head's forward from the decode graphs' sampler statistics (at temperature 0.7)
        assert recorded["records_head_micro_batches"] == recorded["records_micro_batches"]
        assert recorded["reward_mean"] == plain["reward_mean"]  # the same samples
        for a, b in zip(plain_grads, recorded_grads):
            torch.testing.assert_close(b.float(), a.float(), atol=1e-3, rtol=2e-2)
        for key in ("loss", "kl_sampler", "entropy"):
            if key in plain:
                assert recorded[key] == pytest.approx(plain[key], rel=2e-2, abs=1e-4), key


def test_records_stay_off_where_a_rollouts_rows_would_not_fit_the_host(tmp_path, monkeypatch):
    """A rollout whose records would pass the host's share (a 7B model's 256 x 1024 tokens are
    ~50 GiB) is not recorded at all: no pinned memory, no copies; true says why."""
    from reinforge.train.loop import engine_records

    cfg = micro_step_config("train.engine_records=true")
    policy = make_policy(cfg)
    memory = MemoryChoice(cfg.train.micro_batch_tokens, True, None, "set by the test")
    policy.setup = policy.setup.__class__(
        policy.setup.source, policy.setup.device, policy.setup.dtype, memory
    )
    need = engine_records.rollout_record_bytes(cfg, policy.model)
    config = policy.model.config  # prompts x samples x tokens x layers x hidden x 4 B (float32)
    assert need == 4 * 4 * 6 * config.num_hidden_layers * config.hidden_size * 4
    monkeypatch.setattr(engine_records, "host_bytes", lambda: 2 * need)  # 40% of it: too little
    learner = make_learner(cfg, tmp_path, policy)
    assert learner.policy.engine.runner.records is None
    assert "host memory" in engine_records.records_blocker(cfg, learner)


@pytest.mark.parametrize("generation", ["adapters", "merged"])
def test_a_lora_models_update_from_records_equals_the_checkpointed_one(generation):
    """A PEFT LoRA model (every linear adapted, B made non-zero): the engine records through
    its adapters or a merged copy, and the update from them has the plain path's logprobs and
    adapter gradients."""
    from reinforge.train.policy.lora import apply_lora

    model, _ = apply_lora(checkpointed("sdpa"), rank=4, alpha=8.0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    tokenizer = load_tokenizer(builtin_path("micro", 0))
    engine = PagedEngine(model, tokenizer, block_size=4, lora_generation=generation)
    engine.runner.record_hidden(1 << 30)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=4)
    out = engine.generate(PROMPTS, params)
    seqs = [
        PackSequence(p, c.token_ids, hidden=c.hidden)
        for p, group in zip(PROMPTS, out)
        for c in group
    ]
    batch = pack_one(seqs, range(len(seqs)))
    assert batch.record_rows_L is not None
    assert batch.record_stats_K2 is None  # (the test set no trainer temperature)
    batch = replace(batch, record_stats_K2=engine_stats_of(batch))
    plain = run(model, replace(batch, record_rows_L=None, record_stats_K2=None))
    recorded = run(model, batch)
    trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    torch.testing.assert_close(recorded[0], plain[0], atol=2e-5, rtol=2e-5)
    for i in trainable:
        torch.testing.assert_close(recorded[2][i], plain[2][i], atol=1e-5, rtol=1e-4)


def test_a_multi_turn_step_from_records_equals_one_without(tmp_path):
    """Tic-tac-toe episodes (several turns, the opponent's boards entering as environment
    tokens, and a final board after the last move the engine never computed): every
    micro-batch runs from records (the session's continued sequences carry their history's rows;
    the trailing environment tokens, masked out of the loss, read the zero row), and the step's
    loss and gradient equal the plain path's."""
    from reinforge.config import TrainConfig, load_config
    from reinforge.train.loop.session import RunSetup, run_tasks

    results = {}
    for records in (True, False):
        torch.manual_seed(0)
        cfg = load_config(
            TrainConfig,
            "configs/tictactoe.toml",
            [
                "model.path=builtin:micro",
                "rollout.prompts_per_step=4",
                "rollout.samples_per_prompt=4",
                "task.max_context=256",
                "train.micro_batch_tokens=400",
                "algorithm.entropy_coef=0.01",  # (an untrained model's games all score alike)
                f"train.engine_records={str(records).lower()}",
            ],
        )
        policy = make_policy(cfg)
        policy.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        memory = MemoryChoice(cfg.train.micro_batch_tokens, True, None, "set by the test")
        policy.setup = RunSetup(
            policy.setup.source, policy.setup.device, policy.setup.dtype, memory
        )
        learner = make_learner(cfg, tmp_path / str(records), policy)
        tasks = rl.single_turn_tasks(run_tasks(cfg, policy), cfg.task.rewards)
        results[records] = step_with_grads(cfg, learner, tasks)
    (on, on_w), (off, off_w) = results[True], results[False]
    assert on["turns_per_episode"] > 1.5  # multi-turn, most episodes
    assert on["records_micro_batches"] >= 4 and on["records_missed_micro_batches"] == 0
    # the environment's tokens have no statistics, and need none
    assert on["records_head_micro_batches"] == on["records_micro_batches"]
    for key in ("loss", "grad_norm", "entropy"):
        assert abs(on[key] - off[key]) <= 1e-6 + 1e-4 * abs(off[key]), key
    for a, b in zip(on_w, off_w):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def engine_stats_of(batch):
    """The engine's statistics at `batch`'s targets, served at temperature 1."""
    from reinforge.train.packing.records import engine_stats

    store = batch.record_store
    store.wait()
    store.trainer_temperature = 1.0
    rows = batch.record_rows_L[batch.target_positions_K].numpy()
    stats = engine_stats(store, rows, batch.mask_K.tolist())
    assert stats is not None
    return torch.from_numpy(stats)
