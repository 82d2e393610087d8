"""`[task] name = "verifiers"`: an environment of the `verifiers` library played by reinforge.

reinforge drives the environment's own turn loop, one step per assistant turn, the way its
`MultiTurnEnv.rollout` does but with reinforge's engine sampling the turns (so the trainer gets the
exact ids): `init_state` and `setup_state` at reset; at each step the assistant message enters the
environment's trajectory (`add_model_response`), its stop conditions run (`is_completed`), and if
it goes on, `get_prompt_messages` (its `env_response`) gives the next messages. A finished episode
is scored by the environment's rubric (`score_rollout`): its weighted `reward` is the "env"
component and each rubric function's value a further component.

What works: `SingleTurnEnv`, `MultiTurnEnv` subclasses whose `env_response` returns messages
(games, feedback loops), and `ToolEnv` / `StatefulToolEnv` (the model's tool calls, read with
`task.parser`, become the turn's tool calls). What does not: environments that override `rollout`
itself (their loop never reaches reinforge), group rubrics (`score_group`), and multimodal
content. The library's coroutines run on one event loop thread owned here; its
`Environment.__init__` installs SIGINT/SIGTERM handlers, which are put back after loading.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
import uuid
from typing import Any

from reinforge.envs.base import EnvState, StepResult
from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer, env_tasks_of
from reinforge.envs.parsers import ToolCall, get_parser
from reinforge.errors import ConfigError
from reinforge.types import Message, Task

VERSION_TESTED = "0.3.1"
_INSTALL = f'pip install "reinforge[verifiers]" (verifiers=={VERSION_TESTED})'


class EventLoopThread:
    """One asyncio loop on a daemon thread; `run(coro)` blocks the caller's thread until done."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="verifiers").start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


class VerifiersEnv:
    """A verifiers `MultiTurnEnv` (v0, `verifiers.legacy`) speaking reinforge's Env protocol."""

    name = "verifiers"

    def __init__(self, vf_env, parser: str = "hermes"):
        import verifiers as vf

        self.vf, self.vf_env, self.parse = vf, vf_env, get_parser(parser)
        self.loop = EventLoopThread()
        self.client = _no_client()
        self.reward_components = tuple(dict.fromkeys(vf_env.rubric._get_reward_func_names()))
        tools = vf_env.tool_defs or []
        self.tool_schemas = [_openai_schema(t) for t in tools] if tools else None

    def reset(self, task: Task) -> EnvState:
        vf_state = self.loop.run(self._start(task.info["vf_input"]))
        prompt = vf_state["vf_prompt"]
        return EnvState(task=task, messages=[_message(m) for m in prompt], info={"vf": vf_state})

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        state.messages.append(assistant)
        state.turn += 1
        vf_state = state.info["vf"]
        done, new = self.loop.run(self._turn(vf_state, self._response(assistant.content)))
        if not done:
            return StepResult(messages=[_message(m) for m in new], done=False)
        return StepResult(messages=[], done=True, rewards=self._rewards(vf_state))

    async def _start(self, vf_input: dict):
        env = self.vf_env
        vf_state = await env.init_state(vf_input, self.client, "reinforge")
        vf_state = (await env.setup_state(vf_state)) or vf_state
        vf_state["vf_prompt"] = await env.get_prompt_messages(vf_state)
        return vf_state

    async def _turn(self, vf_state, response) -> tuple[bool, list]:
        """Whether the episode is over after this response, and the environment's new messages."""
        env = self.vf_env
        prompt = vf_state["vf_prompt"]
        await env.add_model_response(vf_state, prompt, response)
        if not await env.is_completed(vf_state):
            try:
                following = await env.get_prompt_messages(vf_state)
            except self.vf.Error as e:  # the library's own rollout records it and stops
                vf_state["error"] = e
            else:
                vf_state["vf_prompt"] = following
                if not await env.is_completed(vf_state):  # a final env response ends it
                    return False, following[len(prompt) + 1 :]
        await env.is_completed(vf_state)  # renders the stop fields (an error)
        await env.cleanup(vf_state)
        await env.rubric.score_rollout(vf_state)
        await env.rubric.cleanup(vf_state)
        return True, []

    def _response(self, text: str):
        """The sampled turn as the library's Response: its text, and its tool calls when the
        environment has tools (read with task.parser; unreadable calls stay text)."""
        from verifiers.types import Response, ResponseMessage
        from verifiers.types import ToolCall as VfToolCall

        calls = None
        if self.tool_schemas is not None:
            parsed = self.parse(text)
            found = [c for c in parsed.items if isinstance(c, ToolCall)]
            if found:
                text = parsed.content
                calls = [
                    VfToolCall(
                        id=f"call_{uuid.uuid4().hex[:12]}",
                        name=c.name,
                        arguments=json.dumps(c.arguments),
                    )
                    for c in found
                ]
        message = ResponseMessage(
            content=text,
            tool_calls=calls,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
        )
        return Response(
            id=uuid.uuid4().hex, created=int(time.time()), model="reinforge", message=message
        )

    def _rewards(self, vf_state) -> dict[str, float]:
        metrics = vf_state.get("metrics") or {}
        rewards = {name: float(metrics.get(name, 0.0)) for name in self.reward_components}
        return {**rewards, "reward": float(vf_state.get("reward") or 0.0)}


def _no_client():
    """The model client a verifiers state must hold. reinforge samples the turns itself, so a
    call to it (an environment asking for a response on its own) is refused."""
    from verifiers.clients import Client

    class SampledByReinforge(Client):
        def setup_client(self, config):
            return None

        async def _refuse(self, *args, **kwargs):
            raise RuntimeError(  # a refusal by design: the episode fails, counted (env_errors)
                "this verifiers environment asks its client for a response inside a turn; "
                "reinforge samples the turns itself, so it cannot be played (docs/libraries.md)"
            )

        to_native_tool = to_native_prompt = get_native_response = _refuse
        raise_from_native_response = from_native_response = _refuse

        async def close(self):
            return None

    return SampledByReinforge(None)


def _message(m) -> Message:
    """A verifiers message (pydantic, or a dict in a dataset row) as reinforge's Message."""
    get = m.get if isinstance(m, dict) else lambda key, default=None: getattr(m, key, default)
    content = get("content")
    if isinstance(content, list):  # content parts: text only
        kinds = {
            p.get("type") if isinstance(p, dict) else getattr(p, "type", None) for p in content
        }
        if kinds - {"text"}:
            raise ValueError(f"a {sorted(kinds - {'text'})} content part: text only, please")
        content = "".join(p["text"] if isinstance(p, dict) else p.text for p in content)
    return Message(str(get("role")), content or "", tool_call_id=get("tool_call_id"))


def _openai_schema(tool) -> dict:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


class VerifiersTasks:
    """The environment's dataset rows as tasks: `num_eval` held out (its eval dataset, or rows
    of its dataset never trained on), the rest in a fresh seeded order each epoch."""

    name = "verifiers"

    def __init__(self, vf_env, cfg):
        train = [dict(row) for row in vf_env.get_dataset()] if vf_env.dataset_source else []
        has_eval = vf_env.eval_dataset_source is not None or vf_env.eval_dataset is not None
        if has_eval:
            held_out = [dict(row) for row in vf_env.get_eval_dataset(seed=cfg.seed)]
        else:
            random.Random(cfg.seed).shuffle(train)
            held_out, train = train[: cfg.num_eval], train[cfg.num_eval :]
        if not train:
            raise ConfigError(
                f"task.env = {cfg.env!r} has {len(held_out)} rows, all held out "
                f"(task.num_eval = {cfg.num_eval}); lower task.num_eval"
            )
        self.cfg, self.train_rows, self.source = cfg, train, cfg.env
        self._eval = [
            self._task(row, f"eval-{i}") for i, row in enumerate(held_out[: cfg.num_eval])
        ]

    def _task(self, row: dict, task_id: str) -> Task:
        messages = tuple(_message(m) for m in row["prompt"])
        info = {"vf_input": row, "data_source": str(row.get("task") or self.source)}
        return Task(id=task_id, messages=messages, answer=str(row.get("answer", "")), info=info)

    def train_task(self, index: int) -> Task:
        epoch, position = divmod(index, len(self.train_rows))
        order = list(range(len(self.train_rows)))
        random.Random(f"{self.cfg.seed}/{epoch}").shuffle(order)
        return self._task(self.train_rows[order[position]], f"train-{index}")

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def reward(self, completion: str, task: Task) -> float:
        raise AssertionError("a verifiers environment scores its own episodes")


def load_verifiers_env(ref: str, env_args: dict[str, Any]):
    """The environment `task.env` names, with the process's signal handlers left as they were."""
    try:
        import verifiers as vf
    except ImportError:
        raise ConfigError(
            f'task.name = "verifiers" needs the verifiers library: {_INSTALL}'
        ) from None
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ":" in ref or ref.endswith(".py"):
            from reinforge.rewards.mix import load_callable

            target = ref if ":" in ref else f"{ref}:load_environment"
            env = load_callable(target, setting="task.env")(**env_args)
        else:
            env = vf.load_environment(ref, **env_args)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"task.env = {ref!r}: {e}") from None
    finally:
        for sig, handler in handlers.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler)
    if not isinstance(env, vf.MultiTurnEnv):
        raise ConfigError(
            f"task.env = {ref!r} gave a {type(env).__name__}, not a verifiers MultiTurnEnv "
            "(SingleTurnEnv, ToolEnv and MultiTurnEnv subclasses are played)"
        )
    if env.rubric.has_group_rewards:
        raise ConfigError(
            f"task.env = {ref!r}: its rubric scores groups (score_group), which reinforge does "
            "not run; use per-rollout reward functions"
        )
    return env


def build_verifiers(cfg) -> EnvTasks:
    vf_env = load_verifiers_env(cfg.env, cfg.env_args)
    env = VerifiersEnv(vf_env, cfg.parser)
    source = VerifiersTasks(vf_env, cfg)
    env.reset(source.train_task(0))  # a row the environment cannot start fails here
    scorer = EpisodeScorer(cfg.rewards, env.reward_components)
    max_turns = vf_env.max_turns if vf_env.max_turns > 0 else cfg.max_turns
    return EnvTasks(
        cfg.name,
        source,
        env,
        scorer,
        (),
        **env_tasks_of(cfg, max_turns=min(max_turns, cfg.max_turns)),
    )
