"""Groups of any size: every outcome-reward estimator and DAPO's filter on groups of 3, 1, 2 and
2 samples, against values worked out by hand (written below, not from reinforge's code), and a
step batch built from those groups.

The step: group 0 = [1, 0, 0], group 1 = [2] (alone), group 2 = [0.5, 1.5], group 3 = [4, 4].
"""

import math

import pytest
import torch

from reinforge.algorithms.advantages import (
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from reinforge.algorithms.dapo import filter_zero_variance_groups, zero_variance_fraction
from reinforge.algorithms.presets import ADVANTAGES
from reinforge.algorithms.table import SCALES
from reinforge.config import TrainConfig, load_config
from reinforge.train.loop.advantage_step import Algorithm, assign_advantages, build_step_batch
from reinforge.types import Completion, Group, Task, Trajectory

SIZES = [3, 1, 2, 2]
REWARDS = [1.0, 0.0, 0.0, 2.0, 0.5, 1.5, 4.0, 4.0]
R = torch.tensor(REWARDS, dtype=torch.float64)
S3 = math.sqrt(3.0)  # group 0: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3
S2 = math.sqrt(0.5)  # group 2: mean 1, unbiased var (0.25 + 0.25) / 1
# the whole batch: mean 13/8, squared deviations sum to 18.375, unbiased var 18.375 / 7
BATCH_STD = math.sqrt(18.375 / 7)
# group-centred: [2/3, -1/3, -1/3, 0, -1/2, 1/2, 0, 0], mean 0, unbiased var (2/3 + 1/2) / 7
CENTRED_STD = math.sqrt((2 / 3 + 1 / 2) / 7)

HAND = {
    ("grpo", "group"): [2 / 3 * S3, -1 / 3 * S3, -1 / 3 * S3, 0, -0.5 / S2, 0.5 / S2, 0, 0],
    ("grpo", "none"): [2 / 3, -1 / 3, -1 / 3, 0, -0.5, 0.5, 0, 0],  # Dr. GRPO
    ("grpo", "batch"): [x / BATCH_STD for x in (2 / 3, -1 / 3, -1 / 3, 0, -0.5, 0.5, 0, 0)],
    # leave one out: 1 - (0 + 0) / 2, 0 - (1 + 0) / 2, ...; 0.5 - 1.5; alone: no baseline, 0
    ("rloo", "none"): [1.0, -0.5, -0.5, 0, -1.0, 1.0, 0, 0],
    ("rloo", "group"): [S3, -0.5 * S3, -0.5 * S3, 0, -1 / S2, 1 / S2, 0, 0],
    ("rloo", "batch"): [x / BATCH_STD for x in (1.0, -0.5, -0.5, 0, -1.0, 1.0, 0, 0)],
    ("reinforce_pp", "batch"): [(r - 13 / 8) / BATCH_STD for r in REWARDS],
    ("reinforce_pp", "none"): [r - 13 / 8 for r in REWARDS],
    ("reinforce_pp_baseline", "batch"): [
        x / CENTRED_STD for x in (2 / 3, -1 / 3, -1 / 3, 0, -0.5, 0.5, 0, 0)
    ],
    ("reinforce_pp_baseline", "none"): [2 / 3, -1 / 3, -1 / 3, 0, -0.5, 0.5, 0, 0],
}


def test_every_estimator_and_scale_has_a_hand_value():
    assert set(HAND) == {(name, scale) for name in ADVANTAGES for scale in SCALES[name]}


@pytest.mark.parametrize("name,scale", sorted(HAND))
def test_uneven_groups_hand_computed(name, scale):
    got = ADVANTAGES[name](R, scale, 1e-9, group_sizes=SIZES)
    assert got.shape == (8,)
    assert torch.allclose(got, torch.tensor(HAND[name, scale], dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages, reinforce_pp_baseline_advantages])
def test_a_group_of_one_gets_zero_alone_or_in_a_batch(fn):
    assert fn(torch.tensor([3.0]), "none", 1e-6, group_sizes=[1]).tolist() == [0.0]
    alone = fn(torch.tensor([3.0, 1.0, 2.0]), "none", 1e-6, group_sizes=[1, 1, 1])
    assert alone.tolist() == [0.0, 0.0, 0.0]


def test_flat_even_groups_give_the_grid_values():
    grid = torch.rand(4, 5, generator=torch.Generator().manual_seed(3))
    for name in ADVANTAGES:
        for scale in SCALES[name]:
            want = ADVANTAGES[name](grid, scale, 1e-6).flatten()
            got = ADVANTAGES[name](grid.flatten(), scale, 1e-6, group_sizes=[5] * 4)
            assert torch.allclose(got, want, atol=1e-6), (name, scale)


def test_reinforce_pp_ignores_the_grouping():
    assert torch.allclose(
        reinforce_pp_advantages(R, "batch", 1e-9, group_sizes=SIZES),
        reinforce_pp_advantages(R, "batch", 1e-9, group_sizes=[8]),
    )


def test_bad_group_sizes_are_refused():
    with pytest.raises(ValueError, match="1 or more"):
        grpo_advantages(torch.tensor([1.0, 2.0]), "group", 1e-6, group_sizes=[2, 0])


def test_dapo_filter_on_uneven_groups():
    keep = filter_zero_variance_groups(R, group_sizes=SIZES)
    assert keep.tolist() == [True, False, True, False]  # the lone sample and the tie drop
    assert zero_variance_fraction(R, group_sizes=SIZES) == pytest.approx(0.5)
    assert filter_zero_variance_groups(R, atol=0.99, group_sizes=SIZES).tolist() == [
        True,
        False,
        True,
        False,
    ]
    assert filter_zero_variance_groups(R, atol=1.0, group_sizes=SIZES).tolist() == [False] * 4


def groups_of(sizes: list[int], rewards: list[float]) -> list[Group]:
    """Scored groups of trajectories with 2 + (index mod 3) completion tokens each."""
    groups, index = [], 0
    for g, size in enumerate(sizes):
        task = Task(f"t-{g}", (), "")
        trajs = []
        for _ in range(size):
            num = 2 + index % 3
            completion = Completion(list(range(num)), [-0.5] * num, "stop")
            trajs.append(Trajectory(task, [1, 2], completion, reward=rewards[index]))
            index += 1
        groups.append(Group(task, trajs))
    return groups


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["algorithm.name=grpo"], ("grpo", "group")),
        (["algorithm.name=dr_grpo"], ("grpo", "none")),
        (["algorithm.name=rloo"], ("rloo", "none")),
        (["algorithm.name=reinforce_pp"], ("reinforce_pp_baseline", "batch")),
        (["algorithm.name=grpo", "algorithm.advantage=reinforce_pp"], ("reinforce_pp", "batch")),
    ],
)
def test_step_batch_of_uneven_groups(overrides, key):
    a = load_config(TrainConfig, None, [*overrides, "algorithm.kl_coef=0"]).algorithm
    batch = build_step_batch(groups_of(SIZES, REWARDS), a, "cpu")
    assert batch.group_sizes == SIZES
    assert batch.mask_BT.shape == (8, 4) and batch.num_seqs == 8.0
    assert batch.num_tokens == float(sum(2 + i % 3 for i in range(8)))
    assign_advantages(batch, Algorithm(a), max_new_tokens=8)
    want = torch.tensor(HAND[key], dtype=torch.float32)
    assert torch.allclose(batch.advantages, want, atol=1e-5)
    assert [t.advantage for t in batch.trajs] == pytest.approx(want.tolist(), abs=1e-5)


def _estimate_on_rank(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo processes: its share of the step's groups (rank 0: groups 0, 1 and 2, six
    sequences; rank 1: group 3, two), grpo with the batch std, which needs every rank's rewards."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    a = load_config(TrainConfig, None, ["algorithm.scale_rewards=batch"]).algorithm
    mine = groups_of(SIZES, REWARDS)[3 * rank : 3 + rank]
    batch = build_step_batch(mine, a, "cpu")
    assign_advantages(batch, Algorithm(a), max_new_tokens=8)
    torch.save(batch.advantages, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_uneven_shares_across_ranks_use_the_global_batch(tmp_path):
    """Ranks holding different numbers of sequences (6 and 2) gather the step's rewards and
    group sizes, and each keeps its own rows."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_estimate_on_rank, args=(port, str(tmp_path)), nprocs=2)
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)])
    want = torch.tensor(HAND["grpo", "batch"], dtype=torch.float32)
    assert torch.allclose(got, want, atol=1e-5)


def test_an_agent_episode_split_into_segments_is_one_sample_of_its_group():
    """Episode A (reward 1) in three segments and B (reward 0) in one, in one group: GRPO sees
    two samples, [1, 0] (mean 1/2, unbiased std 1/sqrt(2)), so A's three segments each get
    +1/sqrt(2) and B gets -1/sqrt(2); counting segments as samples would give [1, 1, 1, 0]."""
    task = Task("t", (), "")
    completion = Completion([1, 2], [-0.5, -0.5], "stop")
    trajs = [
        Trajectory(task, [1], completion, reward=r, segment=s)
        for r, s in [(1.0, 0), (1.0, 1), (1.0, 2), (0.0, 0)]
    ]
    a = load_config(TrainConfig, None, ["algorithm.name=grpo", "algorithm.kl_coef=0"]).algorithm
    batch = build_step_batch([Group(task, trajs)], a, "cpu")
    assign_advantages(batch, Algorithm(a), max_new_tokens=8)
    half = 1 / math.sqrt(2)
    assert batch.advantages.tolist() == pytest.approx([half, half, half, -half], abs=1e-4)
