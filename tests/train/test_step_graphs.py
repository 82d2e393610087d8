"""The update replayed from CUDA graphs (`train.cuda_graphs`, train/loop/graphs.py): on a CPU,
the padding it needs (every micro-batch of a step brought to one shape, `train.packing.static`)
and its inputs copied into one fixed set of tensors, run eagerly; on CUDA, the capture itself
(marker `gpu`). Both against the update as it runs without graphs: same gradient, same metrics."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from reinforge.rollout.sources import rollout_groups
from reinforge.train.loop import graphs, update
from reinforge.train.loop.advantage_step import assign_advantages, build_step_batch
from reinforge.train.packing import pack
from reinforge.train.packing.attention import VARLEN, VARLEN_PADDED, VARLEN_REFERENCE
from reinforge.train.packing.static import common_shape, pad_packed

from .test_packing import grouped_sequences, load_micro, random_sequences, traceable_varlen
from .test_rl_loop import DigitTasks, make_learner, make_policy, micro_step_config
from .test_update import RecordingSGD


def logprobs_and_grads(model, batch, real: int):
    """Logprobs of the targets, and the weights' gradient of a loss over the first `real` (a
    padded target has loss mask 0 in the trainer: it takes no part)."""
    from reinforge.train.packing.forward import packed_logprobs

    _, logprobs_K, entropy_K = packed_logprobs(model, batch, 0.7)
    (logprobs_K[:real].sum() + 0.1 * entropy_K[:real].sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return logprobs_K.detach(), grads


@pytest.mark.parametrize("implementation", [VARLEN_REFERENCE, VARLEN_PADDED, VARLEN])
@pytest.mark.parametrize("shared", [False, True])
def test_a_padded_micro_batch_has_the_same_logprobs_and_gradients(
    monkeypatch, implementation, shared
):
    """Pad tokens in segments of their own, empty segments after them, padded targets and rows:
    no real token's logprob or the weights' gradient changes, and nothing is NaN (a position
    outside every segment would be)."""
    import reinforge.engine.varlen as varlen
    from reinforge.train.packing.attention import register_varlen_attention

    monkeypatch.setattr(varlen, "_VARLEN_ATTN", traceable_varlen)
    seqs = grouped_sequences(3, 3, seed=3) if shared else random_sequences(7, seed=3)
    batches = pack(seqs, max_tokens=70)
    assert len(batches) >= 2 and len({b.num_tokens for b in batches}) > 1
    largest = max(b.num_tokens for b in batches)
    # the step's own shape, and one with room (a kept graph's) at twice the tokens: pad tokens
    # and spare keys longer than the longest segment, in several segments each
    shapes = [common_shape(batches), common_shape(batches, 2 * largest, room=1.5)]
    assert shapes[1].tokens - min(b.num_tokens for b in batches) > shapes[1].max_segment
    model = load_micro()
    register_varlen_attention()
    model.set_attn_implementation(implementation)
    for b, shape in [(b, shape) for b in batches for shape in shapes]:
        padded = pad_packed(b, shape)
        assert padded.num_tokens == shape.tokens
        assert padded.cu_segments_G1.numel() == shape.segments + 1
        assert int(padded.cu_segments_G1[-1]) == shape.tokens
        real = int(b.targets_K.numel())
        plain_K, plain_grads = logprobs_and_grads(model, b, real)
        padded_K, padded_grads = logprobs_and_grads(model, padded, real)
        torch.testing.assert_close(padded_K[:real], plain_K, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(padded_K).all()
        torch.testing.assert_close(
            padded.rows(padded_K)[: b.num_seqs, : b.rows_index_ST.shape[1]],
            b.rows(plain_K),
            atol=1e-5,
            rtol=1e-5,
        )
        for plain, padded_grad in zip(plain_grads, padded_grads):
            torch.testing.assert_close(padded_grad, plain, atol=1e-5, rtol=1e-4)


def update_gradient(cfg, tmp_path, batch_seed: int = 5):
    policy = make_policy(cfg)
    learner = make_learner(cfg, tmp_path, policy)
    learner.optimizer = RecordingSGD(learner.policy.model.parameters(), lr=0.0)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    tasks = DigitTasks(cfg.task)
    groups = rollout_groups(
        cfg, policy, tasks, [tasks.train_task(i) for i in range(6)], seed=batch_seed
    )
    batch = build_step_batch(groups, cfg.algorithm, policy.device)
    assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
    metrics = update.update_policy(cfg, learner, batch)
    return learner.optimizer.grads, metrics


@pytest.mark.parametrize("mode", ["step", "run"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_step_through_fixed_padded_inputs_has_the_same_gradient_and_metrics(
    monkeypatch, tmp_path, aggregation, mode
):
    """update_policy with the graph's path forced on a CPU (no capture: each micro-batch padded,
    copied into the first one's tensors and run from there) against the path without it."""
    base = [
        "rollout.temperature=0.7",
        "algorithm.kl_coef=0",
        "algorithm.entropy_coef=0.01",
        f"algorithm.loss_aggregation={aggregation}",
        "optim.max_grad_norm=1e9",
        "train.micro_batch_tokens=48",
    ]
    plain_grads, plain_metrics = update_gradient(micro_step_config(*base), tmp_path / "plain")
    runs = []
    real_run = graphs.UpdateGraph.run

    def counting_run(self, data):
        runs.append(data.packed.num_tokens)
        return real_run(self, data)

    monkeypatch.setattr(update, "graph_blocker", lambda cfg, learner: None)
    monkeypatch.setattr(graphs.UpdateGraph, "run", counting_run)
    cfg = micro_step_config(*base, f"train.cuda_graphs={mode}")
    graph_grads, graph_metrics = update_gradient(cfg, tmp_path / "graph")
    assert len(runs) >= 2 and len(set(runs)) == 1, runs  # one padded shape
    for plain, replayed in zip(plain_grads, graph_grads):
        torch.testing.assert_close(replayed, plain, atol=1e-5, rtol=1e-4)
    for key, value in plain_metrics.items():
        assert graph_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


KEPT_BASE = [
    "rollout.temperature=0.7",
    "algorithm.kl_coef=0",
    "algorithm.loss_aggregation=token_mean",
    "optim.max_grad_norm=1e9",
    "train.micro_batch_tokens=48",
]


def kept_steps(cfg, path, steps, before_step=None):
    """`steps` updates of one learner, (seed, tasks) each; `before_step(i, learner)` first. Per
    step: the gradient, the metrics, the token count and the learner's kept graph after it."""
    policy = make_policy(cfg)
    learner = make_learner(cfg, path, policy)
    learner.optimizer = RecordingSGD(learner.policy.model.parameters(), lr=0.0)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    tasks = DigitTasks(cfg.task)
    out = []
    for i, (seed, n) in enumerate(steps):
        if before_step is not None:
            before_step(i, learner)
        chosen = [tasks.train_task(t) for t in range(n)]
        groups = rollout_groups(cfg, policy, tasks, chosen, seed=seed)
        batch = build_step_batch(groups, cfg.algorithm, "cpu")
        assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
        metrics = update.update_policy(cfg, learner, batch)
        out.append((learner.optimizer.grads, metrics, batch.num_tokens, learner.update_graph))
    return out


def assert_same_steps(plain, graphed):
    for (grads, metrics, _, _), (graph_grads, graph_metrics, _, _) in zip(plain, graphed):
        for a, b in zip(grads, graph_grads):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
        for key, value in metrics.items():
            assert graph_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_kept_graph_serves_the_next_step_with_that_steps_counts(monkeypatch, tmp_path):
    """Mode "run" on a CPU (no capture): the graph built in the first step serves the second
    (its shape has room; no new one), whose token and sequence counts differ and reach the loss
    through the graph's inputs: both steps' gradients and metrics equal the launched ones."""
    steps = [(5, 6), (6, 5)]
    plain = kept_steps(micro_step_config(*KEPT_BASE), tmp_path / "plain", steps)
    monkeypatch.setattr(update, "graph_blocker", lambda cfg, learner: None)
    cfg = micro_step_config(*KEPT_BASE, "train.cuda_graphs=run")
    kept = kept_steps(cfg, tmp_path / "run", steps)
    assert plain[0][2] != plain[1][2]  # the steps' token counts differ
    assert kept[0][3] is not None and kept[1][3] is kept[0][3]  # one graph for both steps
    assert_same_steps(plain, kept)


def test_a_kept_graphs_gradients_are_one_buffer_freed_after_each_step(monkeypatch, tmp_path):
    """Mode "run": the update's gradients are views of one zeroed buffer (the graph adds into
    its addresses), freed after the optimizer step so generation gets the memory back; and a
    kept graph built over gradients elsewhere (the allocator gave another block) is rebuilt."""
    monkeypatch.setattr(update, "graph_blocker", lambda cfg, learner: None)
    made: list[dict] = []
    real_flat = graphs.flat_grads

    def recording_flat(params, mempool=None):
        assert mempool is None  # (a CPU run has no shared mempool)
        buffers = real_flat(params, mempool)
        for p in params:  # every gradient lies in its dtype's buffer
            base = buffers[p.dtype]
            assert p.grad.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        made.append(buffers)
        return buffers

    monkeypatch.setattr(update, "flat_grads", recording_flat)
    cfg = micro_step_config(*KEPT_BASE, "train.cuda_graphs=run")
    learners = []
    kept = kept_steps(
        cfg, tmp_path / "run", [(5, 6), (6, 5)], lambda i, learner: learners.append(learner)
    )
    learner = learners[0]
    assert len(made) == 2  # one buffer per step
    assert learner.grad_buffers is None
    assert all(p.grad is None for p in learner.policy.model.parameters())
    assert kept[1][3] is kept[0][3]  # on a CPU (no capture) the addresses do not matter

    graph = kept[1][3]
    graph.capture, graph.grad_ptrs = True, (1,)  # as if captured over other gradients
    update.start_grads(cfg, learner)
    packed = update.LazyPacked(cfg, kept_batch(cfg, learner), [[0, 1], [2, 3], [4, 5]])
    rebuilt, _ = graphs.step_graph(learner, "run", packed, graph.compute, False)
    assert rebuilt is not graph and graph.graph is None and graph.static is None
    assert rebuilt.grad_ptrs == graphs.grad_ptrs(learner.grad_buffers)


def kept_batch(cfg, learner):
    tasks = DigitTasks(cfg.task)
    chosen = [tasks.train_task(t) for t in range(3)]
    groups = rollout_groups(cfg, learner.policy, tasks, chosen, seed=8)
    batch = build_step_batch(groups, cfg.algorithm, "cpu")
    assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
    return batch


def test_a_micro_batch_that_outgrows_the_kept_graph_runs_launched_and_the_next_step_rebuilds(
    monkeypatch, tmp_path
):
    """A step whose similar micro-batches no longer fit the kept graph (here: its shape cut to
    one row before the second step) runs them launched, with the same gradient, and marks the
    graph outgrown; the step after builds a new one."""
    steps = [(5, 6), (6, 6), (7, 6)]
    plain = kept_steps(micro_step_config(*KEPT_BASE), tmp_path / "plain", steps)
    monkeypatch.setattr(update, "graph_blocker", lambda cfg, learner: None)
    runs: list[int] = []
    real_run = graphs.UpdateGraph.run

    def counting_run(self, data):
        runs.append(len(runs))
        return real_run(self, data)

    monkeypatch.setattr(graphs.UpdateGraph, "run", counting_run)
    per_step: list[int] = []

    def shrink(i, learner):
        per_step.append(len(runs))
        if i == 1:
            learner.update_graph.shape = replace(learner.update_graph.shape, seqs=1)

    cfg = micro_step_config(*KEPT_BASE, "train.cuda_graphs=run")
    kept = kept_steps(cfg, tmp_path / "run", steps, shrink)
    per_step.append(len(runs))
    replayed = [b - a for a, b in itertools.pairwise(per_step)]
    assert replayed[0] >= 2 and replayed[1] == 0 and replayed[2] >= 2, replayed
    # the step's metrics count its micro-batches by phase (no capture on a CPU: "eager")
    first, outgrown = kept[0][1], kept[1][1]
    assert first["graph_eager"] == replayed[0], first
    assert "graph_eager" not in outgrown and outgrown["graph_launched"] >= 2, outgrown
    assert kept[1][3] is kept[0][3] and kept[1][3].outgrown
    assert kept[2][3] is not kept[1][3] and not kept[2][3].outgrown  # built anew
    assert_same_steps(plain, kept)


def test_graphs_are_off_where_they_cannot_replay_and_the_run_says_why_once(tmp_path, capsys):
    cfg = micro_step_config("train.cuda_graphs=true", "train.micro_batch_tokens=48")
    policy = make_policy(cfg)
    learner = make_learner(cfg, tmp_path, policy)
    assert graphs.graph_blocker(cfg, learner) == "not on CUDA"
    off = micro_step_config("train.cuda_graphs=false")
    assert graphs.graph_blocker(off, learner) == "train.cuda_graphs = false"
    # "auto" (the default) follows the memory plan: none here (a CPU), so off, and silently
    assert graphs.graph_blocker(micro_step_config(), learner).startswith("auto: the memory plan")
    assert graphs.graph_mode(micro_step_config(), learner.policy.setup.memory) is None
    tasks = DigitTasks(cfg.task)
    for seed in (1, 2):
        groups = rollout_groups(cfg, policy, tasks, [tasks.train_task(i) for i in range(4)], seed)
        batch = build_step_batch(groups, cfg.algorithm, policy.device)
        assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
        update.update_policy(cfg, learner, batch)
    out = capsys.readouterr().out
    assert out.count("train.cuda_graphs = true has no effect here: not on CUDA") == 1, out
    auto = micro_step_config("train.micro_batch_tokens=48")
    update.update_policy(auto, make_learner(auto, tmp_path / "auto", policy), batch)
    assert "cuda_graphs" not in capsys.readouterr().out
    planned = replace(learner.policy.setup.memory, keeps_update_graph=True)
    assert graphs.graph_mode(auto, planned) == "run"


def cuda_policy(cfg, compiled: bool):
    """The micro model as the trainer runs it on a GPU: bf16 (the varlen kernel), gradient
    checkpointing, compiled layers or not. No engine: the rollout comes from a CPU policy."""
    from reinforge.models.loading import load_model, load_tokenizer, model_source
    from reinforge.train.loop.session import Policy, RunSetup
    from reinforge.train.packing.attention import select_packed_attention
    from reinforge.train.planner.memory import MemoryChoice
    from reinforge.train.policy.model import compile_layers

    source = model_source(cfg.model.path, cfg.run.seed)
    model = load_model(source, torch.device("cuda"), torch.bfloat16)
    assert select_packed_attention(model, "auto") == VARLEN
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if compiled:
        compile_layers(model)
    memory = MemoryChoice(cfg.train.micro_batch_tokens, True, None, "set by the test")
    setup = RunSetup(source, model.device, model.dtype, memory)
    return Policy(model, load_tokenizer(source), None, source, setup)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["step", "run"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_captured_step_has_the_launched_steps_gradient_on_cuda(
    monkeypatch, tmp_path, capsys, compiled, mode
):
    """Captured and replayed on the GPU (bf16, varlen attention, checkpointing, the chunked LM
    head, compiled layers or not) against the same step launched as usual, two steps each (a
    graph per step, or one kept for both): the replays happened, nothing fell back, the
    gradients and metrics agree."""
    base = [
        "rollout.temperature=0.7",
        "algorithm.kl_coef=0",
        "optim.max_grad_norm=1e9",
        "train.micro_batch_tokens=48",
    ]
    cpu_cfg = micro_step_config(*base)
    cpu = make_policy(cpu_cfg)
    tasks = DigitTasks(cpu_cfg.task)
    rollouts = [
        rollout_groups(cpu_cfg, cpu, tasks, [tasks.train_task(i) for i in range(6)], seed=seed)
        for seed in (5, 6)
    ]
    phases: list[list[str]] = []
    real_run = graphs.UpdateGraph._run

    def recording_run(self, data):
        phase, out = real_run(self, data)
        phases[-1].append(phase)
        return phase, out

    monkeypatch.setattr(graphs.UpdateGraph, "_run", recording_run)
    results = []
    for cuda_graphs in ("false", mode):
        cfg = micro_step_config(*base, f"train.cuda_graphs={cuda_graphs}")
        torch.manual_seed(0)
        learner = make_learner(cfg, tmp_path / cuda_graphs, cuda_policy(cfg, compiled))
        if cuda_graphs == "run":  # captured in a shared mempool, as beside a paged engine
            learner.mempool = torch.cuda.MemPool()
        learner.optimizer = RecordingSGD(learner.policy.model.parameters(), lr=0.0)
        learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
        steps = []
        for groups in rollouts:
            phases.append([])
            batch = build_step_batch(groups, cfg.algorithm, learner.policy.device)
            assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
            metrics = update.update_policy(cfg, learner, batch)
            steps.append((learner.optimizer.grads, metrics))
        results.append(steps)
    out = capsys.readouterr().out
    assert "capturing the update failed" not in out, out
    launched, graphed = phases[:2], phases[2:]
    assert launched == [[], []], launched
    assert all("replay" in step for step in graphed), graphed  # replayed in both steps
    if mode == "run":  # the second step only replays the first one's graph
        assert set(graphed[1]) == {"replay"}, graphed
        second = results[1][1][1]  # and its metrics say so
        assert second["graph_replay"] == len(graphed[1]) and "graph_capture" not in second
    else:
        assert graphed[1][:2] == ["eager", "capture"], graphed
    for (plain_grads, plain_metrics), (graph_grads, graph_metrics) in zip(*results):
        for plain, replayed in zip(plain_grads, graph_grads):
            torch.testing.assert_close(replayed.float(), plain.float(), atol=1e-3, rtol=2e-2)
        for key in ("loss", "kl_sampler", "entropy", "clip_low_frac"):
            if key in plain_metrics:
                assert graph_metrics[key] == pytest.approx(plain_metrics[key], rel=2e-2, abs=1e-4)


def test_a_capture_that_fails_says_so_once_and_the_step_goes_on_launched(
    monkeypatch, tmp_path, capsys
):
    """On this CPU the capture itself raises (no CUDA): the fallback every failure takes. The
    step finishes without graphs with the same gradient, and the message comes once (the rest
    of the step does not try again; the learner is marked, so `graph_blocker` refuses later
    steps)."""
    cfg = micro_step_config(
        "rollout.temperature=0.7",
        "algorithm.kl_coef=0",
        "optim.max_grad_norm=1e9",
        "train.micro_batch_tokens=48",
    )
    plain_grads, _ = update_gradient(cfg, tmp_path / "plain")
    monkeypatch.setattr(update, "graph_blocker", lambda cfg, learner: None)
    real_step_graph = graphs.step_graph

    def capturing(learner, mode, packed, compute, capture):
        return real_step_graph(learner, mode, packed, compute, True)  # capture on a CPU

    monkeypatch.setattr(update, "step_graph", capturing)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"cuda_graphs": "step"})})
    graph_grads, _ = update_gradient(cfg, tmp_path / "graph")
    for plain, launched in zip(plain_grads, graph_grads):
        torch.testing.assert_close(launched, plain, atol=1e-5, rtol=1e-4)
    out = capsys.readouterr().out
    assert out.count("train.cuda_graphs: capturing the update failed") == 1, out
    assert "the run goes on without graphs" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gradients_in_the_shared_mempool_take_the_released_kv_pools_memory_each_step():
    """`flat_grads` with the shared mempool: the step's gradient buffer is carved out of the
    memory the released KV pool left (the mempool does not grow), lands at the same address
    every step (so a kept graph is not rebuilt), and the KV pool, allocated again after the
    gradients are freed, is back at its address too."""
    from reinforge.engine.cuda_graphs import capture_stream

    mempool = torch.cuda.MemPool()
    # (above the allocator's 1 MiB small-block bound: blocks of the large pools, like G1's)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (300_000, 5, 700_000)]

    def kv_pool():
        with torch.cuda.stream(capture_stream()), torch.cuda.use_mem_pool(mempool):
            return torch.empty(4 * 2**20, device="cuda")  # 16 MiB, more than the gradients

    def reserved() -> int:
        return sum(
            s["total_size"]
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", ())) == tuple(mempool.id)
        )

    kv = kv_pool()
    kv_address, size = kv.data_ptr(), reserved()
    addresses = set()
    for _ in range(3):
        del kv  # released for the update
        buffers = graphs.flat_grads(params, mempool)
        addresses.add(graphs.grad_ptrs(buffers))
        assert all(p.grad.abs().sum().item() == 0 for p in params)  # zeroed
        assert buffers[torch.float32].data_ptr() == kv_address
        for p in params:
            p.grad = None
        del buffers
        kv = kv_pool()
        assert kv.data_ptr() == kv_address
    assert len(addresses) == 1 and reserved() == size
