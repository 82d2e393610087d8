"""Which attention backend a device gets: the SDPA reference (`attention`) on a CPU, the Triton
one (`triton_attention`) on CUDA, imported the first time a CUDA model asks, so CPU-only installs
never import Triton. Both backend modules sit below this one."""

from __future__ import annotations

import warnings

import torch

from reinforge.engine.attention import SDPA_BACKEND, AttentionBackend

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {"cpu": SDPA_BACKEND}


def select_attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda" and "cuda" not in ATTENTION_BACKENDS:
        try:
            from reinforge.engine.triton_attention import TRITON_BACKEND
        except ImportError as error:
            warnings.warn(
                f"the Triton attention backend is unavailable ({error}); using the SDPA "
                "reference backend on CUDA (correct, much slower). Install triton.",
                stacklevel=2,
            )
            TRITON_BACKEND = SDPA_BACKEND
        ATTENTION_BACKENDS["cuda"] = TRITON_BACKEND
    return ATTENTION_BACKENDS.get(device.type, SDPA_BACKEND)
