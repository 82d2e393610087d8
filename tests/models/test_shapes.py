"""`model.path = "shape:FILE"`: a real HF model class from a shape file, random weights built in
place, a word-level tokenizer over the whole vocabulary; the benchmark task on top of it."""

import json

import pytest
import torch

from reinforge.cli import main
from reinforge.models.loading import load_model, load_tokenizer, model_source

SHAPE = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


@pytest.fixture
def shape_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REINFORGE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "micro-shape.json"
    path.write_text(json.dumps(SHAPE))
    return path


def test_shape_model_and_tokenizer_round_trip(shape_file):
    source = model_source(f"shape:{shape_file}", seed=3)
    tok = load_tokenizer(source)
    assert len(tok) == SHAPE["vocab_size"] and tok.eos_token_id == SHAPE["vocab_size"] - 1
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "t5 t17 t296"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert list(ids) == [5, 17, 296]  # one id per word: prompts have exactly the asked length
    assert tok.decode([5, 17]) == "t5 t17"
    a = load_model(source, torch.device("cpu"), torch.float32)
    b = load_model(source, torch.device("cpu"), torch.float32)
    assert type(a).__name__ == "Qwen2ForCausalLM"
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), f"{name}: the seed does not fix the random weights"
    other = load_model(
        model_source(f"shape:{shape_file}", seed=4), torch.device("cpu"), torch.float32
    )
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_missing_shape_file_names_the_setting(tmp_path, capsys):
    rc = main(["train", f"model.path=shape:{tmp_path}/nope.json", "--dry-run"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "nope.json" in err and "bench/shapes" in err


def test_benchmark_task_trains_with_forced_full_length(shape_file, tmp_path):
    rc = main(
        [
            "train",
            f"model.path=shape:{shape_file}",
            "task.name=random_tokens",
            "task.prompt_tokens=12",
            "task.vocab_words=290",
            "task.num_eval=2",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=3",
            "rollout.max_new_tokens=7",
            "rollout.ignore_eos=true",
            "run.max_steps=2",
            f"run.output_dir={tmp_path}",
            "run.name=shape",
            "log.tensorboard=false",
            "log.plot=false",
        ]
    )
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "shape" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") == "rl" and "step_s" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["response_len"] == 7 and r["truncation_rate"] == 1.0  # EOS never stops one
        assert 0.0 <= r["reward_mean"] <= 1.0
