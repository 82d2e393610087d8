"""Routing replay, the trainer's side (tiny random Qwen3-MoE, CPU float32): the packed forward
sends every token to the experts the engine recorded for it, through shared prompts, packing and
micro-batches; the gate weights come from the current router, so it keeps its gradient;
`routing_replay_changed` counts the pairs whose own top-k moved; a GSPO run with
`algorithm.routing_replay = true` logs it, and a dense model is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from reinforge.engine import moe
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.envs.base import EnvState, StepResult
from reinforge.errors import ConfigError, ExitCode
from reinforge.models.tiny import build_builtin
from reinforge.rollout.continuous import run_continuous
from reinforge.rollout.episodes import EpisodeLimits, run_episodes
from reinforge.rollout.trajectories import _episode_completion
from reinforge.train.packing import PackedBatch, PackSequence, pack_one
from reinforge.train.packing.forward import completion_rows, micro_batches
from reinforge.train.policy.moe import (
    begin_micro_batch,
    check_routing_replay,
    install_grouped_moe,
    replay_metrics,
    routing_replay_ratio,
)
from reinforge.types import Message, Task

from ..conftest import TINY_RUN, cli
from ..engine.test_moe import FAMILIES, PROMPTS, tiny_moe
from ..engine.test_routing_replay import hf_routes
from .test_moe_train import save_tiny_moe


def position_rows(batch: PackedBatch, j: int, seq: PackSequence) -> list[int]:
    """Row of each position 0 .. num_tokens - 2 of sequence j of `batch`, from its targets (the
    row predicting completion token i holds position num_prompt - 1 + i; the prompt is
    contiguous)."""
    start = sum(batch.num_completion_tokens[:j])
    targets = batch.target_positions_K[start : start + len(seq.completion_ids)].tolist()
    first = targets[0] - (len(seq.prompt_ids) - 1)
    return [*range(first, first + len(seq.prompt_ids)), *targets[1:]]


def assert_aligned(batch: PackedBatch, chosen: list[PackSequence], routes_TNK) -> None:
    """Every position's routes sit on its token's row; rows of no recorded route hold -1."""
    covered = set()
    for j, seq in enumerate(chosen):
        rows = position_rows(batch, j, seq)
        tokens = [*seq.prompt_ids, *seq.completion_ids]
        assert batch.input_ids_L[rows].tolist() == tokens[: len(rows)]
        if seq.routes is not None:
            got = routes_TNK[rows].numpy()
            np.testing.assert_array_equal(got, seq.routes.astype(np.int64))
            covered |= set(rows)
    others = [r for r in range(batch.num_tokens) if r not in covered]
    assert (routes_TNK[others] == -1).all()


def test_packing_keeps_routes_with_their_tokens():
    """Two groups sharing prompts, a prompt alone, a sequence without routes, split into several
    micro-batches: each sequence's rows carry its routes."""
    rng = np.random.default_rng(0)
    seqs = []
    for group, (num_prompt, size) in enumerate([(5, 3), (7, 3), (4, 1)]):
        prompt = list(range(10 * group + 1, 10 * group + 1 + num_prompt))
        prompt_routes = rng.integers(0, 8, (num_prompt, 2, 2), dtype=np.uint8)
        for k in range(size):
            completion = [100 + group * 10 + k + i for i in range(3 + k)]
            own = rng.integers(0, 8, (len(completion) - 1, 2, 2), dtype=np.uint8)
            routes = np.concatenate([prompt_routes, own])
            seqs.append(PackSequence(prompt, completion, routes=None if k == 2 else routes))
    plan = micro_batches([s.prompt_ids for s in seqs], [s.completion_ids for s in seqs], 24)
    assert len(plan) > 1 and any(len(idx) > 1 for idx in plan)
    shared = 0
    for idx in plan:
        batch = pack_one(seqs, idx)
        shared += batch.key_index_J is not None
        assert batch.routes_TNK is not None and batch.routes_TNK.dtype == torch.int16
        assert_aligned(batch, [seqs[i] for i in idx], batch.routes_TNK)
    assert shared  # a micro-batch held a shared prompt
    assert pack_one([PackSequence([1, 2], [3, 4])], [0]).routes_TNK is None


@pytest.fixture(scope="module")
def micro_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro") / "model"
    build_builtin("micro", 0, path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=FAMILIES)
def sampled(micro_tokenizer, request):
    """A tiny MoE with the trainer's grouped blocks (Qwen3-MoE renormalises its top-k weights,
    Qwen2-MoE does not), and 2 prompts x 2 samples from the engine with routes recorded."""
    tokenizer = micro_tokenizer
    model = tiny_moe(request.param, tokenizer).train()
    install_grouped_moe(model)
    engine = PagedEngine(model, tokenizer, block_size=4, record_routes=True)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=2, ignore_eos=True)
    outputs = engine.generate(PROMPTS[1:], params)
    prompts = [p for p, group in zip(PROMPTS[1:], outputs) for _ in group]
    completions = [c for group in outputs for c in group]
    return model, prompts, completions


def spy_chosen_ids(monkeypatch) -> list[torch.Tensor]:
    """The ids each sparse block's experts were computed with (the real function runs)."""
    chosen: list[torch.Tensor] = []
    real = moe.experts_forward

    def spy(experts, x_TH, ids_TK, weights_TK):
        chosen.append(ids_TK.detach().clone())
        return real(experts, x_TH, ids_TK, weights_TK)

    monkeypatch.setattr(moe, "experts_forward", spy)
    return chosen


def replayed_forward(model, prompts, completions, routes):
    begin_micro_batch(model, 0.0)
    rows = completion_rows(model, prompts, [c.token_ids for c in completions], 1.0, routes=routes)
    totals = replay_metrics(model)
    routing_replay_ratio(totals)
    return rows, totals


def test_replay_routes_to_the_recorded_experts_and_counts_changes(sampled, monkeypatch):
    model, prompts, completions = sampled
    routes = [c.routes for c in completions]
    rows, totals = replayed_forward(model, prompts, completions, routes)
    assert totals["routing_replay_changed"] == 0.0  # same weights: the same top-k everywhere
    # and the same gate weights (renormalised or not, as the config says): the sampler's logprobs
    sampler = torch.zeros_like(rows.logprobs_ST)
    for b, c in enumerate(completions):
        sampler[b, : len(c.logprobs)] = torch.tensor(c.logprobs)
    torch.testing.assert_close(rows.logprobs_ST.detach(), sampler, atol=1e-4, rtol=0)

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the trainer's router moves after sampling
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.add_(torch.randn(gate.shape, generator=generator) * 2 * gate.std())
    chosen = spy_chosen_ids(monkeypatch)
    rows, totals = replayed_forward(model, prompts, completions, routes)
    assert 0.0 < totals["routing_replay_changed"] < 1.0
    seqs = [PackSequence(p, c.token_ids, routes=c.routes) for p, c in zip(prompts, completions)]
    batch = pack_one(seqs, range(len(seqs)))
    assert len(chosen) == 2 and batch.key_index_J is not None  # 2 sparse layers, shared prompts
    for layer, ids_TK in enumerate(chosen):
        for j, seq in enumerate(seqs):
            position_ids = ids_TK[position_rows(batch, j, seq)].numpy()
            np.testing.assert_array_equal(position_ids, seq.routes[:, layer])

    rows.logprobs_ST.sum().backward()  # the gate weights are the router's: it gets gradients
    grads = [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]
    for grad in grads:
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # activation checkpointing recomputes the blocks in the backward: they replay there too
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows, _ = replayed_forward(model, prompts, completions, routes)
    rows.logprobs_ST.sum().backward()
    model.gradient_checkpointing_disable()
    for layer, grad in zip(model.model.layers, grads):
        torch.testing.assert_close(layer.mlp.gate.weight.grad, grad)
    begin_micro_batch(model, 0.0)
    own = completion_rows(model, prompts, [c.token_ids for c in completions], 1.0)
    assert replay_metrics(model) == {}  # no routes given: it routes itself, counts nothing
    assert not torch.allclose(own.logprobs_ST, rows.logprobs_ST.detach())


def test_gspo_with_routing_replay_logs_the_changed_share(tmp_path):
    source = save_tiny_moe(tmp_path / "models")
    out = cli(
        "train",
        *TINY_RUN,
        f"model.path={source}",
        "algorithm.name=gspo",
        "algorithm.routing_replay=true",
        "algorithm.entropy_coef=0.01",
        "rollout.prompts_per_step=2",
        "task.num_eval=4",
        "eval.before_train=false",
        "run.max_steps=2",
        f"run.output_dir={tmp_path / 'runs'}",
        "run.name=replay",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    rows = (tmp_path / "runs" / "replay" / "metrics.jsonl").read_text().splitlines()
    changed = [
        r["routing_replay_changed"] for r in map(json.loads, rows) if "routing_replay_changed" in r
    ]
    assert len(changed) == 2 and all(0.0 <= c <= 1.0 for c in changed), changed


def test_routing_replay_on_a_dense_model_is_refused(tmp_path, micro_tokenizer):
    out = cli(
        "train",
        *TINY_RUN,
        "algorithm.routing_replay=true",
        "run.max_steps=1",
        f"run.output_dir={tmp_path}",
    )
    assert out.returncode != ExitCode.OK
    assert (
        "algorithm.routing_replay = true, but the model ('qwen2') is dense"
        in out.stderr + out.stdout
    )
    with pytest.raises(
        ConfigError, match=r"rollout.engine = 'simple' records none; set rollout.engine = 'auto'"
    ):
        check_routing_replay(tiny_moe("qwen3_moe", micro_tokenizer), True, "simple")
    assert check_routing_replay(tiny_moe("qwen3_moe", micro_tokenizer), True, "auto")
    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=320, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(ConfigError, match=r"routing_replay = true, but the model \('qwen2'\)"):
        check_routing_replay(dense, True, "auto")  # the loaded model is checked too


class TwoTurns:
    """Answers the first assistant turn with a user message, ends after the second."""

    name = "two_turns"

    def reset(self, task: Task) -> EnvState:
        return EnvState(task, list(task.messages))

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        state.messages.append(assistant)
        state.turn += 1
        if state.turn >= 2:
            return StepResult([], done=True, rewards={"reward": 1.0})
        reply = [Message("user", "and again?")]
        state.messages.extend(reply)
        return StepResult(reply, done=False)


@pytest.mark.parametrize("continuous", [False, True])
def test_multi_turn_trajectories_carry_their_whole_historys_routes(micro_tokenizer, continuous):
    """Turn by turn (the history prefilled again) or continuous (a session extends the sequence):
    the trajectory's routes are the router's top-k over its prompt and completion."""
    tokenizer = micro_tokenizer
    model = tiny_moe("qwen3_moe", tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4, record_routes=True)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    tasks = [Task("t", (Message("user", "say something"),), answer="")]
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=6, max_context=200)
    run = run_continuous if continuous else run_episodes
    (episodes,) = run(engine, tokenizer, TwoTurns(), tasks, 2, params, limits, render_tools=False)
    for e in episodes:
        assert e.num_turns == 2
        completion = _episode_completion(tokenizer, e)
        ids = e.prompt_ids + completion.token_ids
        routes = completion.routes
        assert routes.shape[0] == len(ids) - 1  # the last turn ends the episode
        np.testing.assert_array_equal(np.sort(routes, -1), hf_routes(model, ids)[:-1])


@pytest.mark.gpu
def test_replay_under_compiled_layers_matches_eager(micro_tokenizer):
    """train.compile (on by default for full fine-tuning on CUDA) compiles each decoder layer,
    the sparse block and its replay inside: the same logprobs, router gradients and metric."""
    from reinforge.train.policy.model import compile_layers

    model = tiny_moe("qwen3_moe", micro_tokenizer).to("cuda", torch.bfloat16).train()
    install_grouped_moe(model)
    engine = PagedEngine(model, micro_tokenizer, block_size=4, num_blocks=64, record_routes=True)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=2, ignore_eos=True)
    outputs = engine.generate(PROMPTS[1:], params)
    prompts = [p for p, group in zip(PROMPTS[1:], outputs) for _ in group]
    completions = [c for group in outputs for c in group]
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.add_(torch.randn_like(gate) * 2 * gate.std())
    results = []
    for compiled in (False, True):
        if compiled:
            compile_layers(model)
        model.zero_grad()
        rows, totals = replayed_forward(
            model, prompts, completions, [c.routes for c in completions]
        )
        rows.logprobs_ST.sum().backward()
        grads = [layer.mlp.gate.weight.grad.float() for layer in model.model.layers]
        results.append((rows.logprobs_ST.detach(), totals["routing_replay_changed"], grads))
    (eager, eager_changed, eager_grads), (got, got_changed, got_grads) = results
    assert eager_changed > 0 and abs(got_changed - eager_changed) < 0.05  # bfloat16 near-ties
    torch.testing.assert_close(got, eager, atol=5e-2, rtol=5e-2)
    # bfloat16 sums over tokens in another order compiled: elementwise, a few router-gradient
    # entries near zero differ by up to 0.2 (H200, session 12: 15 of 512); the gradient as a whole
    # must agree (a wrong expert or a missing gate term moves it by far more than 5%)
    for a, b in zip(got_grads, eager_grads):
        assert b.norm() > 0
        assert (a - b).norm() / b.norm() < 0.05, ((a - b).norm() / b.norm()).item()
