"""The trainer's fast path against the plain one: packed micro-batches with the chunked LM head
give update_policy the gradient that one padded batch through the model's own logits gives;
SFT's packed step does not depend on the micro-batch budget; AdamW's state dtype."""

import pytest
import torch

from reinforge.algorithms.losses import LossInputs, PolicyLossSettings, ppo_clip_loss
from reinforge.config import TrainConfig, load_config
from reinforge.rollout.sources import rollout_groups
from reinforge.train.loop.advantage_step import assign_advantages, build_step_batch
from reinforge.train.loop.update import update_policy
from reinforge.train.policy.optim import MixedAdamW, build_optimizer
from reinforge.train.sft import sft_step
from tests.padded_reference import pad_batch

from .test_rl_loop import DigitTasks, make_learner, make_policy, micro_step_config

TEMPERATURE = 0.7
ENTROPY_COEF = 0.01


class RecordingSGD(torch.optim.SGD):
    """Records the gradient the step was given, and does not move the weights."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def recording_step(cfg, tmp_path):
    """A learner whose optimizer records the gradient it is given, and a scored step's batch."""
    policy = make_policy(cfg)
    learner = make_learner(cfg, tmp_path, policy)
    learner.optimizer = RecordingSGD(learner.policy.model.parameters(), lr=0.0)
    learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, lambda s: 1.0)
    tasks = DigitTasks(cfg.task)
    groups = rollout_groups(cfg, policy, tasks, [tasks.train_task(i) for i in range(4)], seed=5)
    batch = build_step_batch(groups, cfg.algorithm, policy.device)
    assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
    return learner, batch


def padded_rows(model, batch):
    """Logprobs and entropy of every completion token from one padded batch through the model's
    own logits (the path packing replaced), as completion rows."""
    padded = pad_batch(batch.prompts, batch.completions, 0, "cpu")
    logits = model(input_ids=padded.input_ids_BL, attention_mask=padded.attention_mask_BL).logits
    logprobs_BTV = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, dim=-1)
    chosen_BT = logprobs_BTV.gather(-1, padded.targets_BT[..., None])[..., 0]
    entropy_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    width = batch.mask_BT.shape[1]
    index_BT = torch.tensor([len(p) - 1 for p in batch.prompts])[:, None] + torch.arange(width)
    index_BT = index_BT.clamp(max=chosen_BT.shape[1] - 1)
    mask_BT = batch.mask_BT
    return chosen_BT.gather(1, index_BT) * mask_BT, entropy_BT.gather(1, index_BT) * mask_BT


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_packed_update_has_the_padded_gradient(aggregation, tmp_path):
    cfg = micro_step_config(
        f"rollout.temperature={TEMPERATURE}",
        "algorithm.kl_coef=0",
        f"algorithm.entropy_coef={ENTROPY_COEF}",
        f"algorithm.loss_aggregation={aggregation}",
        "optim.max_grad_norm=1e9",  # no clipping: compare raw gradients
        "train.micro_batch_tokens=64",  # several packed micro-batches
    )
    learner, batch = recording_step(cfg, tmp_path)
    assert len({t.advantage for t in batch.trajs}) > 2
    from reinforge.train.packing.forward import micro_batches

    assert len(micro_batches(batch.prompts, batch.completions, 64)) >= 3

    update_policy(cfg, learner, batch)
    packed_grads = learner.optimizer.grads

    model = make_policy(cfg).model  # the same initial weights, the plain path
    logprobs_BT, entropy_BT = padded_rows(model, batch)
    loss, _ = ppo_clip_loss(
        LossInputs(
            logprobs_BT=logprobs_BT,
            old_logprobs_BT=logprobs_BT.detach(),
            advantages_B=batch.advantages,
            mask_BT=batch.mask_BT,
            num_tokens_total=batch.num_tokens,
            num_seqs_total=batch.num_seqs,
            entropy_BT=entropy_BT,
        ),
        PolicyLossSettings(aggregation=aggregation, kl_coef=0.0, entropy_coef=ENTROPY_COEF),
    )
    loss.backward()
    for (name, param), packed in zip(model.named_parameters(), packed_grads):
        torch.testing.assert_close(packed, param.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_sft_step_gradient_does_not_depend_on_the_micro_batch_budget():
    cfg = load_config(TrainConfig, None, ["model.path=builtin:micro"])
    grads = []
    for budget in (None, 24):
        policy = make_policy(cfg)
        optimizer = RecordingSGD(policy.model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]
        responses = [[20, 21, 22], [23], [24, 25, 26, 27], [28, 29]]
        metrics = sft_step(
            policy.model, None, optimizer, scheduler, prompts, responses, 1e9, budget
        )
        grads.append((metrics["loss"], optimizer.grads))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for whole, split in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(whole, split, atol=1e-6, rtol=1e-5)


def test_a_batch_without_signal_leaves_the_weights_alone(tmp_path):
    """All advantages 0 (every group scored alike): no gradient, so no step, although AdamW's
    momentum from the step before would still move the weights."""
    cfg = load_config(
        TrainConfig,
        None,
        [
            "model.path=builtin:micro",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=6",
            "algorithm.kl_coef=0",
            "optim.lr=1e-3",
            "train.micro_batch_tokens=1024",
        ],
    )
    policy = make_policy(cfg)
    learner = make_learner(cfg, tmp_path, policy)
    tasks = DigitTasks(cfg.task)
    groups = rollout_groups(cfg, policy, tasks, [tasks.train_task(i) for i in range(2)], seed=5)
    batch = build_step_batch(groups, cfg.algorithm, policy.device)
    assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
    assert update_policy(cfg, learner, batch)["grad_norm"] > 0  # momentum from a real step
    before = [p.detach().clone() for p in policy.model.parameters()]
    batch.advantages.zero_()
    metrics = update_policy(cfg, learner, batch)
    assert metrics["grad_norm"] == 0.0 and metrics["nonfinite_skipped"] == 0.0
    for old, new in zip(before, policy.model.parameters()):
        assert torch.equal(old, new)


def test_mixed_adamw_matches_torch_and_keeps_float32_states():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(8, 4, generator=gen)
    grads = [torch.randn(8, 4, generator=gen) for _ in range(3)]
    ours = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    mixed = MixedAdamW(
        [{"params": [ours], "weight_decay": 0.1}], 1e-2, (0.9, 0.99), 1e-8, torch.float32
    )
    plain = torch.optim.AdamW(
        [theirs], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False
    )
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mixed.step()
        plain.step()
    torch.testing.assert_close(ours.data, theirs.data, atol=1e-7, rtol=1e-6)

    weights = torch.nn.Linear(4, 8, bias=False).to(torch.bfloat16)
    optimizer, _ = build_optimizer(weights, 1e-2, (0.9, 0.99), 1e-8, 0.0, 0, 10, "constant", 1.0)
    assert isinstance(optimizer, MixedAdamW)  # bfloat16 weights, float32 states by default
    reference = torch.nn.Parameter(weights.weight.detach().float())
    reference_opt = torch.optim.AdamW(
        [reference], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, foreach=False
    )
    weights.weight.grad = grads[0].to(torch.bfloat16)
    reference.grad = weights.weight.grad.float()
    optimizer.step()
    reference_opt.step()
    state = optimizer.state[weights.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(weights.weight.data, reference.data.to(torch.bfloat16))
    # resume keeps the float32 moments (torch's load_state_dict would cast them to bfloat16)
    again, _ = build_optimizer(weights, 1e-2, (0.9, 0.99), 1e-8, 0.0, 0, 10, "constant", 1.0)
    again.load_state_dict(optimizer.state_dict())
    moved = again.state[weights.weight]["exp_avg"]
    assert moved.dtype == torch.float32 and torch.equal(moved, state["exp_avg"])

    halved, _ = build_optimizer(
        weights, 1e-2, (0.9, 0.99), 1e-8, 0.0, 0, 10, "constant", 1.0, state_dtype=torch.bfloat16
    )
    assert isinstance(halved, torch.optim.AdamW)  # state dtype = weight dtype: torch's own


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_same_logprobs_and_gradients():
    """`train.compile`: the packed forward and backward through compiled layers (CPU inductor)."""
    from reinforge.train.packing.forward import completion_rows
    from reinforge.train.policy.model import compile_layers

    cfg = load_config(TrainConfig, None, ["model.path=builtin:micro"])
    prompts, completions = [[5, 6, 7, 8], [9, 10, 11]], [[20, 21, 22], [23, 24]]
    results = []
    for is_compiled in (False, True):
        model = make_policy(cfg).model
        if is_compiled:
            compile_layers(model)
        rows = completion_rows(model, prompts, completions, TEMPERATURE)
        rows.logprobs_ST.sum().backward()
        results.append((rows.logprobs_ST.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for compiled, plain in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(compiled, plain, atol=1e-5, rtol=1e-4)


def test_while_busy_runs_once_with_every_gradient_in_and_before_the_optimizer_step(tmp_path):
    """`update_policy`'s `while_busy` (the RL step's garbage collection) runs after the last
    micro-batch's backward and before the optimizer step: on a GPU the device is still running
    the queued micro-batches then, so the host's work there costs the step nothing."""
    cfg = micro_step_config("algorithm.kl_coef=0", "train.micro_batch_tokens=64")
    learner, batch = recording_step(cfg, tmp_path)
    seen = []

    def while_busy():
        grads = [p.grad for p in learner.policy.model.parameters()]
        seen.append((all(g is not None for g in grads), hasattr(learner.optimizer, "grads")))
        if all(g is not None for g in grads):
            seen.append(sum(float(g.abs().sum()) for g in grads))

    update_policy(cfg, learner, batch, while_busy)
    assert seen[0] == (True, False), "every gradient in, the optimizer not yet stepped"
    assert len(seen) == 2 and seen[1] > 0.0
    # the same gradient the optimizer then took (nothing changed it in between)
    assert sum(float(g.abs().sum()) for g in learner.optimizer.grads) == pytest.approx(seen[1])


@pytest.mark.parametrize("case", ["finite", "zero", "not finite"])
def test_a_step_skipped_on_the_device_decides_as_the_host_does(tmp_path, case):
    """With torch's fused AdamW the skip (a gradient not finite, or all zero) is a flag the
    kernel reads on the device, the norm read back after the step is queued: the same weights,
    optimizer state and metrics as the host's decision (the CPU has the fused kernel too)."""
    from reinforge.train.loop.optimizer_step import optimizer_step, skips_on_device

    cfg = micro_step_config("algorithm.kl_coef=0", "train.micro_batch_tokens=64")
    results = []
    for fused in (False, True):
        learner = make_learner(cfg, tmp_path / str(fused))
        optimizer = learner.optimizer
        if fused:
            for group in optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
            optimizer.defaults["fused"] = True
        assert skips_on_device(optimizer) == fused
        params = [p for p in learner.policy.model.parameters() if p.requires_grad]
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):  # a first step, then the case
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator) * 1e-2
            first = optimizer_step(cfg, learner)
        assert first["nonfinite_skipped"] == 0.0 and first["grad_norm"] > 0.0
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-2
            if case == "zero":
                p.grad.zero_()
        if case == "not finite":
            params[3].grad[0, 0] = float("nan")
        metrics = optimizer_step(cfg, learner)
        moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, params))
        assert moved == (case == "finite")
        assert metrics["nonfinite_skipped"] == (1.0 if case == "not finite" else 0.0)
        steps = {float(optimizer.state[p]["step"]) for p in params}
        assert steps == {3.0 if case == "finite" else 2.0}, steps  # a skip does not count
        results.append((metrics, [p.detach().clone() for p in params]))
    (host, host_params), (device, device_params) = results
    assert host.keys() == device.keys()
    if case == "not finite":
        assert host["grad_norm"] != host["grad_norm"] and device["grad_norm"] != device["grad_norm"]
    else:
        assert device["grad_norm"] == pytest.approx(host["grad_norm"], rel=1e-5)
    for a, b in zip(host_params, device_params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
