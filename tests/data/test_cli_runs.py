"""Users' files, trained on through the real command line: a verl-schema parquet (`reinforge
train`, then `reinforge eval` and `reinforge export` on the run), a TRL conversational JSONL
(`reinforge sft`), a CSV (`reinforge train` with an SFT stage), bad rows refused before any
model loads, and a LoRA run exported merged and as an adapter, with a broken merge caught."""

import json
import math
from collections import defaultdict

import pytest
import torch

from reinforge.errors import ExitCode
from reinforge.models.tiny import builtin_path

from ..conftest import cli
from .conftest import verl_rows, write_csv, write_jsonl

COMMON = ["model.path=builtin:micro", "run.num_threads=1", "log.tensorboard=false"]
COMMON += ["log.plot=false", "train.micro_batch_tokens=256"]
RL = [*COMMON, "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2"]
RL += ["rollout.max_new_tokens=4", "sft.batch_size=4"]
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def conversation(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"What is {i} + 1?"},
            {"role": "assistant", "content": str(i + 1)},
            {"role": "user", "content": "And doubled?"},
            {"role": "assistant", "content": str(2 * i + 2)},
        ]
    }


@torch.no_grad()
def next_token_logits(folder, messages=PROMPT) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    if (folder / "adapter_config.json").exists():
        base = AutoModelForCausalLM.from_pretrained(builtin_path("micro", 0))
        model = PeftModel.from_pretrained(base, folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    return model.eval()(input_ids=ids).logits[0, -1]


def by_hand_pass_at_k(samples: list[dict], k: int) -> float:
    """1 - C(n - c, k) / C(n, k) per task, averaged: the unbiased estimator, from binomials."""
    rewards = defaultdict(list)
    for s in samples:
        rewards[s["task_id"]].append(s["reward"])
    per_task = []
    for values in rewards.values():
        n, c = len(values), sum(r >= 1.0 for r in values)
        per_task.append(1 - math.comb(n - c, k) / math.comb(n, k))
    return sum(per_task) / len(per_task)


def test_verl_parquet_trains_then_eval_and_export_read_the_run(tmp_path):
    data = write_parquet(tmp_path / "gsm8k.parquet", verl_rows(16))
    run = tmp_path / "verl"
    out = cli(
        "train",
        *RL,
        f"run.output_dir={tmp_path}",
        "run.name=verl",
        "task.name=dataset",
        f"task.path={data}",
        "task.eval_fraction=0.25",
        "run.max_steps=2",
        "eval.samples_per_task=2",
        "eval.temperature=1.0",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "(parquet, split 'train', schema verl): 16 rows read, 16 tasks, 0 bad rows" in out.stdout
    assert "12 training tasks, 4 held-out; rewards by data_source: openai/gsm8k: math" in out.stdout
    rows = metrics(run)
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval_pass@2" in r] == [0, 2]  # validated before and after

    # reinforge eval on the run: its task and held-out split, with a reward that passes some
    (tmp_path / "parity.py").write_text(
        "def even(completion, task):\n    return float(len(completion) % 2 == 0)\n"
    )
    reward = f"task.reward={tmp_path / 'parity.py'}:even"
    ev = cli("eval", str(run), reward, "eval.samples_per_task=4", "eval.max_new_tokens=6")
    assert ev.returncode == ExitCode.OK, ev.stdout + ev.stderr
    assert "pass@4" in ev.stdout and "mean@4" in ev.stdout  # the table
    doc = json.loads((run / "eval" / "step_000002_gsm8k.json").read_text())
    assert doc["num_tasks"] == 4 and len(doc["samples"]) == 16
    for k in (1, 2, 4):
        assert doc["metrics"][f"pass@{k}"] == pytest.approx(by_hand_pass_at_k(doc["samples"], k))
    assert doc["metrics"]["mean@4"] == pytest.approx(sum(s["reward"] for s in doc["samples"]) / 16)
    # a checkpoint with the training TOML it was trained with (train-only sections ignored)
    out = tmp_path / "with_train_toml.json"
    ev = cli(
        "eval",
        str(run / "checkpoints" / "step_000002"),
        str(run / "config.toml"),
        reward,
        "eval.samples_per_task=4",
        "eval.max_new_tokens=6",
        "-o",
        str(out),
    )
    assert ev.returncode == ExitCode.OK, ev.stdout + ev.stderr
    assert "a training config; evaluating with its [task] and [eval] sampling" in ev.stdout
    assert json.loads(out.read_text())["num_tasks"] == 4

    # reinforge export of the run's latest checkpoint: its logits, reloaded by transformers
    exp = cli("export", str(run), str(tmp_path / "exported"))
    assert exp.returncode == ExitCode.OK, exp.stdout + exp.stderr
    assert "max KL to the trainer's model" in exp.stdout
    torch.testing.assert_close(
        next_token_logits(tmp_path / "exported"),
        next_token_logits(run / "checkpoints" / "step_000002"),
    )


def test_sft_on_trl_conversational_jsonl_validates_and_reports_bad_rows(tmp_path):
    rows = [conversation(i) for i in range(12)]
    rows += [{"messages": [{"role": "user", "content": "no reply"}]}, {"messages": "oops"}]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    out = cli(
        "sft",
        *COMMON,
        f"run.output_dir={tmp_path}",
        "run.name=chat",
        "task.name=dataset",
        f"task.path={data}",
        "task.eval_fraction=0.2",
        "sft.steps=3",
        "sft.batch_size=4",
        "eval.every=2",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "schema trl-conversational): 14 rows read, 12 tasks, 2 bad rows" in out.stdout
    assert "missing solution: 1 at lines 13" in out.stdout
    assert "prompt has wrong type: 1 at lines 14" in out.stdout
    assert "only the SFT validation loss is measured" in out.stderr  # no answers to score
    logged = metrics(tmp_path / "chat")
    assert [r["step"] for r in logged if "eval_loss" in r] == [0, 2, 3]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3]
    assert "validation loss:" in out.stdout and " after" in out.stdout
    assert (tmp_path / "chat" / "checkpoints" / "sft_final" / "model.safetensors").exists()


def test_csv_trains_with_an_sft_stage_then_rl(tmp_path):
    body = [[f"Say {i}.", str(i), str(i)] for i in range(10)] + [["", "3", "3"]]
    data = write_csv(tmp_path / "quiz.csv", ["question", "answer", "solution"], body)
    out = cli(
        "train",
        *RL,
        f"run.output_dir={tmp_path}",
        "run.name=csv",
        "task.name=dataset",
        f"task.path={data}",
        "task.reward=exact_match",
        "task.eval_fraction=0.2",
        "sft.steps=2",
        "run.max_steps=1",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "empty prompt: 1 at rows 10" in out.stdout
    logged = metrics(tmp_path / "csv")
    assert [r["step"] for r in logged if r["phase"] == "sft" and "loss" in r] == [1, 2]
    assert [r["step"] for r in logged if r["phase"] == "rl" and "reward_mean" in r] == [1]


def test_bad_rows_with_on_bad_row_error_fail_before_any_model_loads(tmp_path):
    good = {"prompt": PROMPT, "answer": "7"}
    data = write_jsonl(tmp_path / "d.jsonl", [good, good, {"prompt": PROMPT}, {"answer": "1"}])
    out = cli(
        "train",
        *RL,
        f"run.output_dir={tmp_path}",
        "task.name=dataset",
        f"task.path={data}",
        "task.reward=exact_match",
        "task.on_bad_row=error",
    )
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stdout + out.stderr
    assert "missing answer: 1 at lines 3" in out.stderr
    assert "missing prompt: 1 at lines 4" in out.stderr
    assert "task.on_bad_row = 'skip'" in out.stderr
    assert not (tmp_path / "run").exists()


def test_lora_run_exports_merged_and_adapter_and_a_broken_merge_is_caught(tmp_path, monkeypatch):
    from peft.tuners.lora import LoraModel

    from reinforge.cli import main

    data = write_parquet(tmp_path / "gsm8k.parquet", verl_rows(8))
    run = tmp_path / "lora"
    out = cli(
        "train",
        *RL,
        f"run.output_dir={tmp_path}",
        "run.name=lora",
        "task.name=dataset",
        f"task.path={data}",
        "run.max_steps=2",
        "model.lora.rank=4",
        "optim.lr=0.01",
        "algorithm.entropy_coef=0.01",  # a gradient even when every reward is 0
        "eval.before_train=false",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    step = run / "step_000002"  # RUN_DIR/step: a checkpoint of the run by name

    assert main(["export", str(step), str(tmp_path / "merged")]) == ExitCode.OK
    assert main(["export", str(run), str(tmp_path / "adapter"), "--mode", "adapter"]) == 0
    merged = next_token_logits(tmp_path / "merged")
    torch.testing.assert_close(merged, next_token_logits(tmp_path / "adapter"))
    base = next_token_logits(builtin_path("micro", 0))
    assert (merged - base).abs().max() > 1e-3  # the trained adapter is in the export

    monkeypatch.setattr(LoraModel, "merge_and_unload", lambda self, **kw: self.unload())
    assert main(["export", str(run), str(tmp_path / "broken")]) == ExitCode.RUNTIME_FAILURE
    assert not (tmp_path / "broken").exists()
