"""What the step's peaks add for CUDA graphs' pools (`graphs.held_bytes`, `pool_metrics`): a
replay allocates nothing, so the allocator's peak misses the memory a graph's pool holds. The
arithmetic on a made-up allocator snapshot (no CUDA needed): the right pools, their free bytes,
the KV pool counted once, a capturing update's pool not counted twice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from reinforge.train.loop import graphs

GiB = 2**30
MEMPOOL, DECODE, PRIVATE, OTHER = (0, 7), (3, 0), (4, 0), (0, 0)


def segment(pool, total, allocated):
    return {"segment_pool_id": pool, "total_size": total, "allocated_size": allocated}


SNAPSHOT = [
    segment(MEMPOOL, 2 * GiB, 0),  # the shared mempool: KV pool released, the update's free
    segment(MEMPOOL, 2**21, 2**10),  # its small blocks: the graph's outputs allocated
    segment(DECODE, 24 * 2**20, 4 * 2**20),
    segment(PRIVATE, GiB, 0),
    segment(OTHER, 8 * GiB, 3 * GiB),  # the default pool: never added
]


def learner(mempool=True, kept_private=False, decode=True, kv_bytes=GiB + GiB // 2):
    runner = SimpleNamespace(
        graphs=SimpleNamespace(pool=DECODE) if decode else None,
        kv_bytes_in_mempool=kv_bytes if mempool else 0,
    )
    kept = None
    if kept_private:
        kept = graphs.UpdateGraph(compute=None, shape=None)
        kept.graph = SimpleNamespace(pool=lambda: PRIVATE)
    return SimpleNamespace(
        policy=SimpleNamespace(engine=SimpleNamespace(runner=runner)),
        mempool=SimpleNamespace(id=MEMPOOL) if mempool else None,
        update_graph=kept,
    )


@pytest.fixture(autouse=True)
def snapshot(monkeypatch):
    monkeypatch.setattr(graphs.torch.cuda, "memory_snapshot", lambda: SNAPSHOT)


def test_the_update_phase_adds_the_free_bytes_of_the_shared_mempool_and_the_decode_pool():
    free_mempool = 2 * GiB + 2**21 - 2**10
    assert graphs.held_bytes(learner(), "train") == free_mempool + 20 * 2**20


def test_the_update_phase_counts_gradients_in_the_mempool_once():
    """The step's gradient buffer, allocated in the shared mempool (`flat_grads`), was counted
    as allocated at the update's peak and is free in the mempool by the step's end."""
    pooled = learner()
    pooled.grad_bytes_in_mempool = GiB // 2
    free_mempool = 2 * GiB + 2**21 - 2**10
    assert graphs.held_bytes(pooled, "train") == free_mempool - GiB // 2 + 20 * 2**20
    assert graphs.held_bytes(pooled, "generate") == graphs.held_bytes(learner(), "generate")


def test_generation_counts_the_kv_pool_once():
    """The KV pool was allocated (and counted) while generating; released since, it is free in
    the mempool now: the generate phase adds the mempool's free bytes less the KV pool."""
    free_mempool = 2 * GiB + 2**21 - 2**10
    held = graphs.held_bytes(learner(), "generate")
    assert held == free_mempool - (GiB + GiB // 2) + 20 * 2**20


def test_a_capturing_update_adds_only_the_decode_pool():
    assert graphs.held_bytes(learner(), "train", captured=True) == 20 * 2**20


def test_a_kept_graph_in_its_own_pool_is_counted_without_a_shared_mempool():
    kept = learner(mempool=False, kept_private=True)
    assert graphs.held_bytes(kept, "train") == GiB + 20 * 2**20
    assert graphs.held_bytes(kept, "generate") == GiB + 20 * 2**20  # held while generating
    bare = learner(mempool=False, decode=False)
    assert graphs.held_bytes(bare, "train") == 0 and graphs.pool_metrics(bare) == {}


def test_pool_metrics_name_each_pool_and_the_kv_pool():
    metrics = graphs.pool_metrics(learner())
    assert metrics["gpu_pool_update_gib"] == pytest.approx(2 + 2**21 / GiB)
    assert metrics["gpu_pool_decode_gib"] == pytest.approx(24 / 1024)
    assert metrics["gpu_kv_gib"] == pytest.approx(1.5)
