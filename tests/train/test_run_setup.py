"""A run resolves its setup once (model source, device, dtype, memory plan, episode context) and
never writes it back into the config: the loaded config is the same after the setup as before."""

from __future__ import annotations

from reinforge.config import TrainConfig, load_config
from reinforge.envs.env_tasks import EnvTasks
from reinforge.run import RunContext
from reinforge.train.loop.session import load_policy, run_tasks


def test_the_config_is_unchanged_by_the_run_setup(tmp_path):
    cfg = load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "task.name=game",
            "task.prompt_style=compact",
            "task.max_turns=2",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
        ],
    )
    # what the setup resolves is unset in the config: the planner and the model decide
    assert cfg.train.micro_batch_tokens is None and cfg.task.max_context is None
    before = cfg.model_dump()
    ctx = RunContext(tmp_path / "run", resume=False, overwrite=False, config_toml="")
    policy, _, _ = load_policy(cfg, ctx)
    assert cfg.model_dump() == before
    setup = policy.setup
    assert setup.memory.micro_batch_tokens > 0
    assert setup.episode_context == policy.model.config.max_position_embeddings
    assert str(policy.device) == "cpu" and setup.source == policy.source
    tasks = run_tasks(cfg, policy)  # the episodes get the resolved context, the config does not
    assert isinstance(tasks, EnvTasks) and tasks.max_context == setup.episode_context
    assert cfg.model_dump() == before
