"""Models built from a shape: `model.path = "shape:bench/shapes/qwen2.5-0.5b.json"`.

A shape file holds the HF config fields of a public model (`shared/shapes/*.json`). The model is
transformers' own class for that config with seeded random weights, built directly on the
device (no weights are written: a 7B shape would be 15 GB of noise on disk), and a word-level
tokenizer whose ids cover the whole vocabulary (`t0`, `t1`, ...), so any id sequence round-trips
through text. This is how benchmarks and GPU tests run the real trainer and engine on the
shapes of real models without downloading them.

`model_source` resolves the path to a folder holding `config.json`, the tokenizer and a marker
file; `load_model` sees the marker and builds instead of loading.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPE_PREFIX = "shape:"
MARKER = "reinforge_shape.json"
_VERSION = 2  # bump when the folder's contents change, so caches rebuild (2: the manifest)
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def is_shape(path: str) -> bool:
    return path.startswith(SHAPE_PREFIX)


def is_shape_folder(source: str | Path) -> bool:
    return (Path(source) / MARKER).is_file()


def shape_source(path: str, seed: int) -> Path:
    """The folder standing for `shape:FILE` at `seed`, written on first use."""
    from reinforge.errors import ConfigError
    from reinforge.models.cache import cached_entry

    file = Path(path[len(SHAPE_PREFIX) :])
    if not file.is_file():
        raise ConfigError(
            f"model.path = {path!r}: no shape file at {str(file)!r}; e.g. "
            "model.path = 'shape:bench/shapes/qwen2.5-0.5b.json'"
        )
    fields = json.loads(file.read_text())
    if "model_type" not in fields or "vocab_size" not in fields:
        raise ConfigError(
            f"model.path = {path!r}: the shape file needs at least 'model_type' and 'vocab_size' "
            "(HF config fields, as in bench/shapes/qwen2.5-0.5b.json)"
        )
    # one builder per node, published whole (models.cache)
    name = f"shape-{file.stem}-v{_VERSION}-seed{seed}"
    return cached_entry(name, lambda out: write_shape_folder(fields, seed, out))


def write_shape_folder(fields: dict, seed: int, out: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(**fields)
    vocab_size = config.vocab_size
    # The last two ids are EOS and PAD, as in the TRL peer (shared/peers/trl_grpo.py).
    config.eos_token_id, config.pad_token_id = vocab_size - 1, vocab_size - 2
    out.mkdir(parents=True)
    config.save_pretrained(out)
    build_word_tokenizer(vocab_size).save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"seed": seed, "version": _VERSION}))


def build_word_tokenizer(vocab_size: int):
    """One word per id: `t{i}` for i < vocab_size - 3, then UNK, PAD, EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 3)}
    vocab.update({"[UNK]": vocab_size - 3, "[PAD]": vocab_size - 2, "[EOS]": vocab_size - 1})
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_shape_model(source: str | Path, device, dtype):
    """The shape's model with seeded random weights, created on `device` in `dtype`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    seed = json.loads((Path(source) / MARKER).read_text())["seed"]
    config = AutoConfig.from_pretrained(source)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model
