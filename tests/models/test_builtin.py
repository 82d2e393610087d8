"""The built-in models: `builtin:small` beside `builtin:tiny`, the same offline tokenizer, and the
shipped configs accept it."""

from __future__ import annotations

import json
import math

from safetensors import safe_open

from reinforge.models.tiny import builtin_path

from ..conftest import cli


def test_shipped_config_runs_on_small_a_larger_model_with_tinys_tokenizer():
    result = cli("train", "configs/quickstart.toml", "model.path=builtin:small", "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    small, tiny = builtin_path("small", 0), builtin_path("tiny", 0)  # the dry run built small
    config = json.loads((small / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # the kernels' head dim
    with safe_open(small / "model.safetensors", "pt") as f:
        num_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert 20e6 < num_params < 40e6, num_params
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (small / name).read_text() == (tiny / name).read_text()
