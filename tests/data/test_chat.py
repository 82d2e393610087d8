"""SFT loss masks cut from the chat template: the masked spans decode to exactly the assistant
turns (text and end-of-turn token), with the built-in ChatML template and the real Qwen2.5 and
Llama 3.1 templates shipped in the trl wheel; a template that rewrites history is refused."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from reinforge.data.chat import chat_example
from reinforge.errors import ConfigError
from reinforge.models.loading import load_model
from reinforge.models.tiny import builtin_path
from reinforge.train.sft import sft_batch, sft_step
from reinforge.types import Message, Task
from tests.padded_reference import pad_batch, token_logprobs

TRL = importlib.util.find_spec("trl")
CONVERSATION = (
    Message("system", "Answer briefly."),
    Message("user", "What is 2+2?"),
    Message("assistant", "4"),
    Message("user", "And doubled?"),
    Message("assistant", "It is 8."),
)
# the end-of-turn token each template closes an assistant turn with
TEMPLATES = {"builtin": "<|im_end|>", "qwen2_5": "<|im_end|>", "llama3_1": "<|eot_id|>"}


def tokenizer_with(name: str):
    tok = AutoTokenizer.from_pretrained(builtin_path("micro", 0))
    if name == "builtin":
        return tok
    if TRL is None:
        pytest.skip("the chat templates come from the trl wheel (pip install trl)")
    if name.startswith("llama"):
        special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok.add_special_tokens({"additional_special_tokens": special})
        tok.eos_token = "<|eot_id|>"
    chat_templates = Path(TRL.submodule_search_locations[0]) / "chat_templates"
    tok.chat_template = (chat_templates / f"{name}.jinja").read_text()
    return tok


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_masked_spans_decode_to_exactly_the_assistant_turns(name):
    tok = tokenizer_with(name)
    example = chat_example(tok, CONVERSATION, [tok.eos_token_id])

    masked, run = [], []
    for token, is_loss in zip(example.ids, example.loss_mask):
        if is_loss:
            run.append(token)
        elif run:
            masked, run = [*masked, run], []
    masked += [run] if run else []
    eot = TEMPLATES[name]
    assert [tok.decode(span) for span in masked] == [f"4{eot}", f"It is 8.{eot}"]
    # everything else (system, user turns, role headers) is context only
    unmasked = tok.decode([t for t, m in zip(example.ids, example.loss_mask) if not m])
    assert "Answer briefly." in unmasked and "And doubled?" in unmasked
    assert "It is 8." not in unmasked and example.ids[-1] == tok.eos_token_id


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = tokenizer_with("qwen3")  # adds an empty think block to the last assistant turn only
    with pytest.raises(ConfigError, match=r"renders the first 3 messages .* differently"):
        chat_example(tok, CONVERSATION, [tok.eos_token_id])
    # one assistant turn is fine: the prefix is the generation prompt
    single = chat_example(tok, CONVERSATION[:3], [tok.eos_token_id])
    assert tok.decode(single.ids[single.num_prompt_tokens :]).endswith("4<|im_end|>")


def test_sft_loss_is_the_mean_over_assistant_tokens_only():
    """The packed SFT step's loss (one sequence per micro-batch) equals the masked mean NLL of
    the plain padded forward."""
    tok = tokenizer_with("builtin")
    model = load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)
    tasks = [
        Task("a", CONVERSATION[:4], answer="", solution="It is 8."),
        Task("b", (Message("user", "Hi"),), answer="", solution="Hello!"),
    ]
    prompts, responses, masks = sft_batch(tok, tasks)
    assert sum(masks[0]) == len("4") + 1 + len("It is 8.") + 1  # byte tokens + two EOS
    assert 0 in masks[0] and all(masks[1])  # the second user turn is masked out

    batch = pad_batch(prompts, responses, tok.pad_token_id, "cpu")
    with torch.no_grad():
        logprobs_BT, _ = token_logprobs(model, batch)
    weights_BT = torch.zeros_like(batch.mask_BT)
    for b, (p, m) in enumerate(zip(prompts, masks)):
        weights_BT[b, len(p) - 1 : len(p) - 1 + len(m)] = torch.tensor(m, dtype=torch.float32)
    expected = -(logprobs_BT * weights_BT).sum() / weights_BT.sum()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    metrics = sft_step(model, tok, optimizer, scheduler, prompts, responses, 1e9, 100, masks=masks)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5)
