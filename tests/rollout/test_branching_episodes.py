"""Episodes without a barrier per turn, and entropy-adaptive branching, on the micro model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.envs.base import EnvState, StepResult
from reinforge.models.loading import load_model
from reinforge.models.tiny import builtin_path
from reinforge.rollout.branching import Branching
from reinforge.rollout.continuous import LoopStats, run_continuous
from reinforge.rollout.episodes import EpisodeLimits, run_episodes
from reinforge.types import Message, Task

from ..engine.conftest import scramble

TRIGGER = "~"  # its embedding is zeroed: the next token's distribution is uniform


class ScriptedReplies:
    """Replies `replies[k]` to the k-th assistant turn, then ends the episode (reward 1)."""

    name = "scripted"

    def __init__(self, replies: list[str]):
        self.replies = replies

    def reset(self, task: Task) -> EnvState:
        return EnvState(task=task, messages=list(task.messages))

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        state.messages.append(assistant)
        state.turn += 1
        if state.turn > len(self.replies):
            return StepResult([], True, rewards={"reward": 1.0})
        reply = Message("tool", self.replies[state.turn - 1])
        state.messages.append(reply)
        return StepResult([reply], False, metrics={"tool_calls": 1.0})


@pytest.fixture(autouse=True)
def one_thread():
    """Two OpenMP threads beside other processes wait on each other (10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(builtin_path("micro", 0))


def micro(seed=0):
    return load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)


TASKS = [Task(f"q{i}", (Message("user", f"question {i}: go"),), "") for i in range(3)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_continuous_episodes_give_the_barrier_loops_ids_greedy(tok, device):
    """On CUDA: decode graphs, Triton attention, forks' page copies on the device."""
    model = scramble(micro(), seed=1).to(device)
    engine = PagedEngine(model, tok, block_size=4, num_blocks=None if device == "cpu" else 512)
    env = ScriptedReplies(["result one", "result two"])
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=6, max_context=200)
    barrier = run_episodes(engine, tok, env, TASKS, 2, params, limits, env_workers=4)
    stats = LoopStats()
    continuous = run_continuous(engine, tok, env, TASKS, 2, params, limits, stats=stats)
    for a_group, b_group in zip(barrier, continuous, strict=True):
        for a, b in zip(a_group, b_group, strict=True):
            assert a.prompt_ids + a.completion_ids == b.prompt_ids + b.completion_ids
            assert a.loss_mask == b.loss_mask and a.finish_reason == b.finish_reason
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert a.num_turns == b.num_turns == 3
    # history stays in the pool: a later turn prefills its env reply (and the turn's last
    # sampled id, never written), not the conversation again; a group's prompt once
    prompts = sum(len(g[0].prompt_ids) for g in continuous)
    replies = sum(e.loss_mask.count(0) + 2 for g in continuous for e in g)  # 2 replies each
    assert prompts < stats.num_prefill_tokens <= prompts + replies
    assert 0.0 <= stats.idle_share < 1.0


def entropy_model():
    """Attention and MLP outputs zeroed: the logits at a position depend on its token alone,
    sharply peaked for every token (greedy repeats it, entropy ~0) but `TRIGGER`, whose zero
    embedding gives every id the logit 0 (entropy ln 320)."""
    model = micro()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.mul_(40.0)
        (trigger,) = AutoTokenizer.from_pretrained(builtin_path("micro", 0)).encode(TRIGGER)
        embed[trigger] = 0.0
    return model


@pytest.fixture(scope="module")
def tool_last_tok():
    """A template that leaves a tool reply open: the next turn samples right after its text."""
    tok = AutoTokenizer.from_pretrained(builtin_path("micro", 0))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}"
        "{% if m['role'] != 'tool' %}<|im_end|>{% endif %}{% endfor %}"
    )
    return tok


@pytest.mark.parametrize("replies,branch_turn", [(["plain", "odd" + TRIGGER], 2), (["a", "b"], 0)])
def test_branching_where_entropy_rises_and_nowhere_else(tool_last_tok, replies, branch_turn):
    engine = PagedEngine(entropy_model(), tool_last_tok, block_size=4)
    env = ScriptedReplies(replies)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    limits = EpisodeLimits(max_turns=4, max_tokens_per_turn=3, max_context=200)
    b = Branching(initial_samples=2, branch_size=2, entropy_window=2)
    stats = LoopStats()
    groups = run_continuous(
        engine, tool_last_tok, env, TASKS[:1], 6, params, limits, branching=b, stats=stats
    )
    (episodes,) = groups
    assert len(episodes) == 6  # the budget, spent by branches or filled
    branches = [e for e in episodes if e.lineage[0] is not None]
    if branch_turn:
        # each initial episode branched once after the trigger reply (budget 6 = 2 + 2 x 2)
        assert len(branches) == 4 and stats.num_filled == 0
        for e in branches:
            parent = episodes[e.lineage[0]]
            at = e.lineage[1]
            assert parent.completion_ids[:at] == e.completion_ids[:at]
            assert tool_last_tok.decode(e.completion_ids[:at]).endswith(TRIGGER)
            assert e.metrics["branch_episodes"] == 1 and e.num_turns == 3
    else:
        assert not branches and stats.num_filled == 4
    assert all(e.finish_reason == "done" for e in episodes)
