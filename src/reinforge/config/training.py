"""The RL step's sections: `[rollout]` (sampling and the engine), `[optim]` (AdamW and its
schedule) and `[train]` (micro-batches, compilation, CUDA graphs, the engine's records, non-finite
steps). Imported from `reinforge.config`, as every section is."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reinforge.config.base import Section
from reinforge.config.branching import BranchingSection


class RolloutSection(Section):
    prompts_per_step: int = Field(32, ge=1, le=65536)
    """Distinct prompts sampled per RL step: the global batch, over all processes under torchrun
    (each generates for an equal share; the preflight checks the number divides)."""
    samples_per_prompt: int = Field(8, ge=1, le=1024)
    """Completions per prompt (the group size of group-relative methods)."""
    max_new_tokens: int = Field(16, ge=1, le=1_000_000)
    """Most tokens generated per completion."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature (0 = greedy). Trainer logprobs use the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0 = off)."""
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    """Drop tokens whose probability is below min_p times the top token's (0 = off)."""
    stop_strings: list[str] = []
    """Extra strings that end a completion (the tokenizer's EOS always does)."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every completion, past EOS and stop strings (benchmarks: every
    step does the same work)."""
    env_workers: int = Field(32, ge=1, le=1024)
    """Threads that run a turn's env steps at once (tool calls, sandboxed code, game moves, a
    user env's step): a tool that waits 50 ms costs one wait per turn, not one per episode. 1 runs
    them one by one (for an env whose step is not safe to call from several threads)."""
    max_concurrent_agents: int = Field(64, ge=1, le=4096)
    """Agent tasks (`[task] name = "agent"`): agent calls running at once; their requests are
    batched into engine calls together (docs/agents.md)."""
    engine: Literal["auto", "paged", "simple"] = "auto"
    """Generation engine for rollouts and validation: "paged" (continuous batching over a paged KV
    cache, one prefill per group's prompt, CUDA graphs on a GPU; Qwen2/2.5, Qwen3 and Llama models,
    LoRA included), "simple" (the model's own forward; any causal LM), or "auto" (paged where the
    architecture is supported, else simple with a warning). Both read the trainer's weights in
    place."""
    kv_cache_bytes: int | None = Field(None, ge=1)
    """Size of the paged engine's KV page pool in bytes. Unset: the memory planner chooses it
    (room for the whole step's rollout when it fits beside training; `--dry-run` shows it). Set:
    the planner plans around it, and refuses a value that does not fit."""
    lora_generation: Literal["auto", "merged", "adapters"] = "auto"
    """How the paged engine decodes a LoRA model. "merged": from a copy of the adapted weights
    with the adapter merged in (W + scaling * B @ A, in the model's dtype; plain linear layers,
    the speed of the base model), rebuilt after each optimizer step; it costs those weights'
    bytes again during generation (freed for the update). "adapters": base + scaling * B(A(x))
    at every decode step, no copy. "auto": merged when the copy fits beside the KV pool the
    memory planner chose (the pool is never shrunk for it), else adapters; the run prints the
    choice and `--dry-run` shows its bytes. See docs/lora.md."""
    continuous_episodes: bool = True
    """Multi-turn env tasks on the paged engine: each episode goes back to generation as soon as
    its env step returns, while others still run theirs (no barrier per turn), and its reply is
    appended to its sequence in the KV pool instead of the whole history prefilled again (E3 on
    one H200: 2.2x the turn-by-turn loop's tokens/s on a 0.5b shape, 2.7x on a 7b). Greedy: the
    same ids as turn by turn; sampled: other draws (noise keyed per episode). false: the
    turn-by-turn loop (a barrier per turn). Single-turn tasks and the simple engine always run
    turn by turn."""
    branching: BranchingSection = BranchingSection()
    """Entropy-adaptive branching (ARPO): see [rollout.branching]."""

    @model_validator(mode="after")
    def _branching_fits_the_budget(self) -> RolloutSection:
        b = self.branching
        if b.enabled and b.initial_samples > self.samples_per_prompt:
            raise ValueError(
                f"rollout.branching.initial_samples={b.initial_samples} exceeds the budget "
                f"rollout.samples_per_prompt={self.samples_per_prompt}; set initial_samples to "
                f"at most {self.samples_per_prompt} (ARPO's toy run: 2 of 4)"
            )
        return self


class OptimSection(Section):
    lr: float = Field(5e-5, gt=0.0, le=1.0)
    """Peak learning rate (AdamW). The default is the learning suite's (bench/learning.py, session
    14, builtin:small, 3 seeds): at 1e-4 RL lowered word_sorting's held-out pass@1 by 7.3 points
    where it had nothing to lift; at 5e-5 by 0.3, with graph_color still +16.5."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final learning rate as a fraction of `lr` for cosine and linear schedules."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of AdamW's two moment estimates. float32 (8 bytes per parameter) also with bfloat16
    weights, which are updated from the float32 step; bfloat16 halves that memory at the cost of
    precision. LoRA adapters are float32 and keep float32 states either way."""


class TrainSection(Section):
    micro_batch_tokens: int | None = Field(None, ge=8, le=10_000_000)
    """Token budget of one packed micro-batch (prompt + completion tokens of the sequences it
    holds, no padding); gradients accumulate over a step's micro-batches. Default: the memory
    planner's choice (`--dry-run` prints it)."""
    micro_batch_size: int | None = Field(None, ge=1, le=65536)
    """Deprecated: micro-batches are packed by tokens. When set (and micro_batch_tokens is not),
    the planner's budget is capped at micro_batch_size x (longest prompt + max_new_tokens), the
    memory bound it gave before; preflight says so. Set micro_batch_tokens instead, or neither."""
    share_prompts: bool = True
    """Sequences of a micro-batch with the same prompt (a GRPO group's samples) run the prompt
    once: each completion attends to that one copy. Same values and gradients as running every
    sequence whole (tested), fewer tokens: 8 samples of a 30-token prompt with 5-token answers
    are 70 tokens instead of 280. false runs every sequence whole (to compare)."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer (dynamic shapes) for the trainer's forward and backward:
    true, false, or "auto" (on CUDA for full fine-tuning; not with LoRA, whose PEFT layers took
    80 s to compile for a 10% faster update on the 0.5B shape; not on a CPU, where compiling
    costs a short run more than it saves). The first step pays the compile time. Measured on
    G1 (0.5B shape, full fine-tune, H100): the training phase 2.98 -> 2.15 s per step."""
    cuda_graphs: bool | Literal["auto", "step", "run"] = "auto"
    """Replay the update's similar-sized micro-batches from one CUDA graph of their forward, loss
    and backward (a much smaller micro-batch runs as before): the update's host work gone, so
    the update takes the same time on a slow host as on a fast one, and small micro-batches cost
    no speed. "run" (or true): one graph kept across steps (only replays after the first step;
    its activations and the step's gradients live in one memory pool with generation's KV pool,
    the decode graphs' logits and the prefills' activations, the two phases taking turns, and
    the engine keeps its decode graphs across the update; the
    planner's micro-batches are then 12,288 tokens, not 16,384: replayed, no slower). "step":
    captured per step and freed after it (each step runs one micro-batch eagerly and captures
    the next). "auto": "run" where the memory plan has room for the graph's memory beside
    generation's KV pool, else off. One process, dense models without a value head; elsewhere
    off. G1, same call: H200 step 2.59 s with "auto" against 2.72 s with false, H100 2.73 s
    against 3.23 s (bench/RESULTS.md, session 21); peak 5.18 GiB with "auto" (session 23)
    against 5.19-5.20 with false (session 22)."""
    engine_records: bool | Literal["auto"] = "auto"
    """Run the update from the engine's own forward: while generating, the engine keeps the
    residual stream after every layer of every token (in host memory, copied beside the
    decode), and a checkpointed update skips its first forward through the layers (each
    layer's output is its record; the backward recomputes each layer from its input, as
    checkpointing does), and its LM head computes no logits in the forward (the engine's
    sampler kept each sampled position's log-sum-exp and entropy at the rollout's temperature;
    each target's own logit is all the head computes; on a GPU the fused sampler's, so with
    temperature > 0 and no top-p, top-k or min-p). One forward less per micro-batch, on the
    weights that generated (one update per rollout); logprobs and gradients equal the plain path's in float32 (tested) and
    differ by the two kernels' bf16 rounding otherwise. "auto": on CUDA with the local paged
    engine, one process, a dense model and gradient checkpointing on (else there is no first
    forward to save); true also on a CPU; false: never. A rollout whose records pass 40% of the
    host's memory, or a sequence whose records are missing or stale, trains as before. With
    records the trainer's logprobs come from the engine's hidden states, so the metric
    `kl_sampler` compares the LM head alone (~1e-10); the policy-change probe (`dKL`) still runs
    the trainer's own forward. The first step pins the rollout's host rows (~1.5 s a GiB, once)."""
    non_finite: Literal["skip", "crash"] = "skip"
    """What a step whose gradient holds NaN or infinity does: "skip" (count it in the metric
    `nonfinite_skipped`, leave parameters and optimizer state untouched, go on; the run fails
    after train.max_consecutive_non_finite such steps in a row) or "crash" (fail at once, exit
    code 1). Either way a non-finite state is never checkpointed."""
    max_consecutive_non_finite: int = Field(3, ge=1, le=10_000)
    """Skipped non-finite steps in a row after which the run fails (train.non_finite = "skip")."""
