"""HF causal LMs without their logits: what the chunked LM head (`packing.logprobs`) reads.

`final_hidden_states(model, ...)` runs a HF causal LM's decoder (`model.get_decoder()`, which
includes any PEFT adapter layers) and stops before its LM head, so the model never builds logits;
`lm_head_weight(model)` is the output embedding (the tied input embedding when tied). Together
they give the packed trainer's logprobs (`train.packing.forward`); tests check them against full
logits on padded batches (`tests/padded_reference.py`).
"""

from __future__ import annotations

import torch


def lm_head_weight(model) -> torch.Tensor:
    """The LM head weight [V, H] (the input embedding when the model ties them)."""
    head = model.get_output_embeddings()
    assert getattr(head, "bias", None) is None, "LM heads with a bias are not supported"
    assert getattr(model.config, "final_logit_softcapping", None) is None, "no logit softcapping"
    return head.weight


def final_hidden_states(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm), [B, T, H]. `kwargs` reach the
    attention functions (e.g. `cu_seq_lens_q` for packed rows)."""
    decoder = model.get_decoder()
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    return out.last_hidden_state
