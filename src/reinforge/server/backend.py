"""One model behind one engine, as the HTTP layer uses it: prompts in, visible outputs out.

`ServedModel.generate` is blocking and serialised by a lock (the engine holds one KV pool and
one model); the app calls it, and every other step of a request (parsing, rendering,
tokenizing), from a worker thread so the event loop keeps answering. It turns
the engine's completions into what a client sees: text pieces per token, OpenAI's stop-string
cut, the terminating stop token dropped, and on request the top alternatives per token.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

import torch

from reinforge.engine.base import Engine, SamplingParams
from reinforge.engine.factory import ENGINES, build_engine
from reinforge.errors import ConfigError
from reinforge.server.detokenize import cut_at_stop, token_pieces
from reinforge.server.limits import check_text_fits, max_token_chars
from reinforge.server.protocol import RequestError
from reinforge.types import Completion

log = logging.getLogger("reinforge.server")


@dataclass
class Generated:
    """One choice as returned: the visible tokens with their text and logprobs."""

    token_ids: list[int]
    pieces: list[str]  # text of each token in token_ids
    logprobs: list[float]  # sampler logprob of each token (temperature-scaled, before top-p)
    top_logprobs: list[list[tuple[int, float]]] | None  # per token, the k most likely ids
    finish_reason: str  # "stop" or "length"
    num_generated_tokens: int  # every sampled token, for usage

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class ServedModel:
    def __init__(self, engine: Engine, model, tokenizer, name: str, max_model_len: int):
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.stop_token_ids = _stop_token_ids(model, tokenizer)
        self.max_token_chars = max_token_chars(tokenizer)
        self._lock = threading.Lock()

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except TemplateError as e:  # templates reject some conversations (role order, ...)
            raise RequestError(f"the chat template rejected the messages: {e}", "messages") from e
        return list(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def check_text(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text that cannot fit the context whatever its tokens."""
        check_text_fits(num_chars, self.max_token_chars, self.max_model_len, param)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise RequestError(f"{param} is empty; give at least one token", param)
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise RequestError(f"{param} holds token ids outside [0, {self.vocab_size})", param)
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt is {len(ids)} tokens and leaves no room in the model's context of "
                f"{self.max_model_len} tokens; shorten {param}",
                param,
            )

    def max_new_tokens(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        """The completion budget: `max_tokens` if the context holds it, else the rest."""
        room = self.max_model_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise RequestError(
                f"the prompt ({len(prompt_ids)} tokens) plus {param} ({max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; set {param} <= {room} "
                "or shorten the prompt",
                param,
            )
        return room if max_tokens is None else max_tokens

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_top_logprobs: int = 0
    ) -> list[list[Generated]]:
        """For each prompt, `params.n` outputs. Blocking; one call at a time."""
        params = replace(params, stop_token_ids=(*params.stop_token_ids, *self.stop_token_ids))
        with self._lock:
            completions = self.engine.generate(prompts, params)
            return [
                [self._visible(prompt, c, params, num_top_logprobs) for c in group]
                for prompt, group in zip(prompts, completions)
            ]

    def _visible(
        self, prompt: list[int], completion: Completion, params: SamplingParams, k: int
    ) -> Generated:
        ids, logprobs = completion.token_ids, completion.logprobs
        if completion.finish_reason == "stop" and ids and ids[-1] in params.stop_token_ids:
            ids, logprobs = ids[:-1], logprobs[:-1]
        pieces = token_pieces(self.tokenizer, ids)
        cut = cut_at_stop(pieces, params.stop_strings)
        if cut is not None:
            pieces, ids, logprobs = cut, ids[: len(cut)], logprobs[: len(cut)]
        top = self._top_logprobs(prompt, ids, k, params.temperature) if k > 0 else None
        return Generated(
            token_ids=ids,
            pieces=pieces,
            logprobs=logprobs,
            top_logprobs=top,
            finish_reason=completion.finish_reason,
            num_generated_tokens=len(completion.token_ids),
        )

    @torch.inference_mode()
    def _top_logprobs(
        self, prompt: list[int], ids: list[int], k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """The k most likely ids at each position, scored by one forward pass over prompt +
        completion, under the same distribution as the sampler's logprob."""
        if not ids:
            return []
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt + ids], device=device)
        logits_TV = self.model(input_ids=input_ids).logits[0, len(prompt) - 1 : -1].float()
        if temperature > 0:
            logits_TV = logits_TV / temperature
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
        logprobs_TV[:, len(self.tokenizer) :] = float("-inf")  # padded embedding rows
        top = logprobs_TV.topk(k, dim=-1)
        return [
            list(zip(row_ids, row_lps))
            for row_ids, row_lps in zip(top.indices.tolist(), top.values.tolist())
        ]


def _stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """End-of-turn ids: the tokenizer's EOS and the generation config's (Llama 3 lists several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    if config_eos is not None:
        ids |= {config_eos} if isinstance(config_eos, int) else set(config_eos)
    return tuple(sorted(ids))


def load_served_model(
    model_path: str,
    engine: str = "auto",
    *,
    device: str = "auto",
    dtype: str = "auto",
    served_model_name: str | None = None,
    max_model_len: int | None = None,
) -> ServedModel:
    """Load `model_path` (a model or checkpoint folder, a run directory, `RUN_DIR/step_N`, a hub
    name or `builtin:NAME`; see `reinforge.models.inference`) behind the chosen engine:
    'paged' (continuous batching, Qwen2/Qwen3/Llama), 'simple' (any causal LM), or 'auto'
    (paged when the architecture has a paged forward, else simple)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine = {engine!r} is unknown; use one of {list(ENGINES)}")
    from reinforge.models.inference import load_inference_model, resolve_model
    from reinforge.models.loading import resolve_device, resolve_dtype

    torch_device = resolve_device(device)
    model, tokenizer = load_inference_model(
        resolve_model(model_path), torch_device, resolve_dtype(dtype, torch_device)
    )
    chosen = build_engine(model, tokenizer, engine, setting="engine")
    context = model.config.max_position_embeddings
    if max_model_len is not None and max_model_len > context:
        raise ConfigError(
            f"max_model_len = {max_model_len} exceeds the model's context of {context} tokens; "
            f"set it to at most {context}"
        )
    return ServedModel(
        chosen, model, tokenizer, served_model_name or model_path, max_model_len or context
    )
