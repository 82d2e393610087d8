"""The built-in tiny model: transformers' own Qwen2 class at a few million parameters, with a
byte-level tokenizer built offline by the `tokenizers` library and a ChatML chat template.

It is written to disk in the HF layout (config, safetensors weights, tokenizer) and read back with
`from_pretrained`, the same path a user's Qwen checkpoint takes, so the whole pipeline runs
offline on a laptop. Entries live in reinforge's cache (`models.cache`): built once per node,
whatever the number of processes asking, and published whole.
"""

from __future__ import annotations

import json
from pathlib import Path

from reinforge.models.cache import cached_entry

BUILTIN_PREFIX = "builtin:"
SPECS = {
    # ~3.3M parameters: big enough to learn the built-in tasks on a CPU in minutes.
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # ~25M parameters (head dim 64, as tiny's): for GPUs, where tiny leaves the device idle; the
    # same tokenizer and chat template, and room for longer prompts (reasoning-gym's questions).
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    # ~0.2M parameters: for fast unit tests.
    "micro": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Bump when the builder's output changes, so caches rebuild. 2: weights written whatever the
# process group (see build_builtin), and the cache's manifest.
_VERSION = 2


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def builtin_path(name: str, seed: int) -> Path:
    """Folder of the built-in model `name` initialised with `seed`, building it on first use."""
    if name not in SPECS:
        from reinforge.errors import ConfigError

        raise ConfigError(
            f"model.path = 'builtin:{name}' is not a built-in model; choose one of "
            f"{[BUILTIN_PREFIX + k for k in SPECS]}"
        )
    return cached_entry(
        f"builtin-{name}-v{_VERSION}-seed{seed}", lambda out: build_builtin(name, seed, out)
    )


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    # No merges: one token per byte, so every digit is its own token and any text round-trips.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_builtin(name: str, seed: int, out: Path) -> None:
    """The HF folder of the built-in model `name` at `seed`. Every file is written by this
    process, also under torchrun: `save_pretrained` would skip config and weights on ranks other
    than global 0 (transformers asks the process group), leaving a tokenizer-only folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = build_tokenizer()
    vocab_size = (len(tok) + 63) // 64 * 64
    config = Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SPECS[name],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # the tied LM head is the embedding: stored once, as save_pretrained does
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(out)
    (out / "reinforge_builtin.json").write_text(
        json.dumps({"name": name, "seed": seed, "version": _VERSION})
    )
