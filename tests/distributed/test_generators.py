"""`distributed.generators`: several processes generate in the disaggregated mode. Four gloo
processes under torchrun, one generator and three trainers, then two and two: with
rollout_staleness 0 every step equals the single-process run's (the same samples, loss and
gradient), so the split of the prompts among generators and the routing of their groups to the
trainers change nothing. The routing itself for uneven splits, and the refusals: a count below
1, more than one generator outside the disaggregated mode, and none left to train."""

from __future__ import annotations

import json

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.errors import ConfigError
from tests.conftest import cli
from tests.distributed.test_torchrun import (
    RUN,
    SHAPE,
    TORCHRUN,
    assert_same_steps,
    launch,
    reinforge,
    rl_metrics,
)

# six prompts divide among three trainers and among two; two steps, no checkpoint
COMMON = [
    *(arg for arg in RUN if not arg.startswith(("rollout.prompts_per_step", "checkpoint.every"))),
    "rollout.prompts_per_step=6",
    "checkpoint.every=0",
    "run.max_steps=2",
]
ON_POLICY = ["distributed.mode=disaggregated", "distributed.rollout_staleness=0"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("generators")
    shape = root / "micro_shape.json"
    shape.write_text(json.dumps(SHAPE))
    common = [*COMMON, f"model.path=shape:{shape}"]
    proc = cli(*reinforge(root / "one", *common)[2:], env_extra={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, common, rl_metrics(root / "one")


@pytest.mark.parametrize("generators", [1, 2])
def test_four_processes_on_policy_equal_one_process(one_process, generators):
    root, common, want = one_process
    run_dir = root / f"g{generators}"
    extra = [*ON_POLICY, f"distributed.generators={generators}"]
    torchrun = [*TORCHRUN, "--standalone", "--nproc-per-node", "4"]
    (output,) = launch([*torchrun, *reinforge(run_dir, *common, *extra)])
    trainers = 4 - generators
    first = "rank 3" if generators == 1 else "ranks 2-3"
    assert f"disaggregated: {first} generate (distributed.generators = {generators})" in output
    assert f"ranks 0-{trainers - 1} train" in output
    got = rl_metrics(run_dir)
    assert_same_steps(got, want, steps=(1, 2))
    for step in (1, 2):
        assert got[step]["rollout_weights_step"] == step - 1
        assert abs(got[step]["kl_sampler"]) < 1e-6


def test_groups_reach_the_trainer_whose_share_holds_them():
    from reinforge.distributed import generator_share
    from reinforge.train.loop.disaggregated import trainer_parts

    # 12 prompts, 5 generators (3, 3, 2, 2, 2) and 4 trainers (3 each)
    slices = [generator_share(12, g, 5) for g in range(5)]
    assert [(s.start, s.stop) for s in slices] == [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)]
    received: list[list[int]] = [[] for _ in range(4)]
    for prompts in slices:  # each generator's groups, by global prompt index
        for trainer, part in enumerate(trainer_parts(prompts, 12, 4)):
            received[trainer] += [prompts[i] for i in part]
    assert received == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    # one generator sends everything; a generator whose slice misses a trainer sends it nothing
    assert trainer_parts(range(0, 6), 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert trainer_parts(range(3, 6), 6, 2) == [range(0, 0), range(0, 3)]


def test_bad_counts_are_refused_at_load_with_a_value_that_works():
    with pytest.raises(ConfigError, match=r"generators = 0.*set 1"):
        load_config(
            TrainConfig, None, ["distributed.mode=disaggregated", "distributed.generators=0"]
        )
    with pytest.raises(ConfigError, match=r"generators = 2 needs distributed\.mode"):
        load_config(TrainConfig, None, ["distributed.generators=2"])


def test_no_process_left_to_train_fails_at_start_with_the_message(tmp_path):
    """What each process torchrun starts sees (its WORLD_SIZE): refused before any process group
    starts, so no process waits for another."""
    extra = ["distributed.mode=disaggregated", "distributed.generators=2", "run.max_steps=1"]
    world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    args = reinforge(tmp_path / "refused", "model.path=builtin:micro", *extra)[2:]
    proc = cli(*args, env_extra=world, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "distributed.generators = 2 with 2 processes (WORLD_SIZE) leaves none to train" in output
    assert "set distributed.generators = 1 or fewer" in output
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_the_preflight_counts_the_trainers_left(monkeypatch):
    """Four processes, two of them generators: the batch must divide among the two trainers."""
    from reinforge.preflight import run_preflight
    from tests.conftest import TINY_RUN

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    two = [*TINY_RUN, "distributed.mode=disaggregated", "distributed.generators=2"]
    pf = run_preflight(load_config(TrainConfig, None, [*two, "rollout.prompts_per_step=6"]))
    assert (
        "the last 2 ranks generate (distributed.generators) every rollout, 2 train"
        in dict(pf.rows)["processes"]
    )
    assert not pf.errors
    odd = run_preflight(load_config(TrainConfig, None, [*two, "rollout.prompts_per_step=5"]))
    assert any("does not divide among 2 training processes" in e for e in odd.errors)
