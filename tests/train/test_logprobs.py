"""Chunked LM head: equal to the plain [N, V] computation in values and gradients, saving only
its inputs; the HF helpers reproduce the model's own logits."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reinforge.models.tiny import builtin_path
from reinforge.train.packing.hidden import final_hidden_states, lm_head_weight
from reinforge.train.packing.logprobs import chunked_logprobs, vocab_slice_width
from tests.padded_reference import chunked_token_logprobs, pad_batch, token_logprobs

N, H, V = 37, 16, 53


def inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=dtype) / H**0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, targets


def plain(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 5, 8, N, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_plain(chunk_size, temperature):
    gen = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    h1, W1, t = inputs(torch.float32)
    logp, ent = chunked_logprobs(h1, W1, t, temperature, chunk_size)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    h2, W2, _ = inputs(torch.float32)
    logp_ref, ent_ref = plain(h2, W2, t, temperature)
    ((logp_ref * w_logp).sum() + (ent_ref * w_ent).sum()).backward()
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(W1.grad, W2.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, 7])
def test_gradcheck_float64(chunk_size):
    hidden, weight, targets = inputs(torch.float64)
    hidden, weight = hidden[:7].detach().requires_grad_(), weight[:11].detach().requires_grad_()
    targets = targets[:7] % 11
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_logprobs(h, w, targets, 0.9, chunk_size), (hidden, weight)
    )


def test_entropy_is_minus_p_log_p():
    hidden, weight, targets = inputs(torch.float32, seed=2)
    _, ent = chunked_logprobs(hidden, weight, targets, 1.3, chunk_size=6)
    probs = torch.softmax((hidden @ weight.t()) / 1.3, dim=-1)
    torch.testing.assert_close(ent, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=1e-5)


def test_saves_only_its_inputs():
    hidden, weight, targets = inputs(torch.float32)
    logp, _ = chunked_logprobs(hidden, weight, targets, 1.0, chunk_size=4)
    saved = logp.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(N, H), (V, H), (N,)]
    assert saved[0].data_ptr() == hidden.data_ptr() and saved[1].data_ptr() == weight.data_ptr()
    assert all(t.numel() < N * V for t in saved)


def test_frozen_head_gets_no_gradient():
    hidden, weight, targets = inputs(torch.float32)
    weight = weight.detach()
    logp, _ = chunked_logprobs(hidden, weight, targets, 1.0, chunk_size=4)
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_bf16_weights_use_float32_softmax():
    hidden, weight, targets = inputs(torch.float32, seed=3)
    hidden_bf, weight_bf = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight))
    logp, ent = chunked_logprobs(hidden_bf, weight_bf, targets, 0.8, chunk_size=10)
    (logp.sum() + ent.sum()).backward()
    ref_h, ref_w = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight))
    logp_ref, ent_ref = plain(ref_h, ref_w, targets, 0.8)
    (logp_ref.sum() + ent_ref.sum()).backward()
    assert logp.dtype == torch.float32 and hidden_bf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp, logp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden_bf.grad, ref_h.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(weight_bf.grad, ref_w.grad, atol=2e-2, rtol=2e-2)


def micro_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(builtin_path("micro", 0), dtype=torch.float32)


def test_hidden_states_and_head_reproduce_the_models_logits():
    model = micro_model()
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = final_hidden_states(model, ids)
    assert lm_head_weight(model) is model.get_input_embeddings().weight  # tied in the micro model
    torch.testing.assert_close(hidden @ lm_head_weight(model).t(), logits, atol=1e-5, rtol=1e-5)


def test_padded_drop_in_matches_token_logprobs():
    model = micro_model()
    batch = pad_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]], 0, "cpu")
    ref, ref_ent = token_logprobs(model, batch, 0.7, with_entropy=True)
    logp, ent = chunked_token_logprobs(model, batch, 0.7, chunk_size=3)
    mask = batch.mask_BT.bool()
    torch.testing.assert_close(logp[mask], ref[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[mask], ref_ent[mask], atol=1e-5, rtol=1e-5)
    assert (logp[~mask] == 0).all()


def test_fused_chunk_math_equals_the_in_place_path():
    """`chunk_stats` / `chunk_grad_logits` (compiled on CUDA) compute what the in-place CPU
    helpers do, from raw logits, at a temperature, with targets anywhere in the vocabulary."""
    from reinforge.train.packing.logprob_math import (
        _chunk_grad_logits,
        chunk_grad_logits,
        chunk_stats,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen, dtype=torch.float64) * 3
    targets = torch.tensor([0, 49, 3, 3, 17, 25, 1])
    g_lp = torch.randn(7, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(7, generator=gen, dtype=torch.float64)
    t = 0.7
    logp, ent = chunk_stats(logits, targets, t)
    ref = torch.log_softmax(logits / t, -1)
    assert torch.allclose(logp, ref.gather(1, targets[:, None])[:, 0])
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1))
    fused = chunk_grad_logits(logits, targets, g_lp, g_ent, t)
    in_place = _chunk_grad_logits((logits / t).clone(), targets, g_lp, g_ent).div_(t)
    assert fused.dtype == logits.dtype
    assert torch.allclose(fused, in_place)


def test_bf16_head_gradient_over_many_chunks_stays_near_float32():
    """The bf16 head-weight gradient over 512 rows (64 forward chunks; the backward writes it
    with one product over all rows, one bf16 rounding) stays within bf16 rounding of the
    float32 computation's gradient."""
    hidden, weight, targets = inputs(torch.float32, seed=5)
    hidden = torch.randn(512, hidden.shape[1], generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, weight.shape[0], (512,), generator=torch.Generator().manual_seed(2))
    ref_w = weight.detach().bfloat16().float().requires_grad_()
    ref_h = hidden.bfloat16().float()
    logp_ref, _ = plain(ref_h, ref_w, targets, 1.0)
    logp_ref.sum().backward()
    weight_bf = weight.detach().bfloat16().requires_grad_()
    logp, _ = chunked_logprobs(hidden.bfloat16(), weight_bf, targets, 1.0, chunk_size=8)
    logp.sum().backward()
    error = (weight_bf.grad.float() - ref_w.grad).norm() / ref_w.grad.norm()
    assert error < 2e-2, error


def test_in_place_head_gradient_equals_autograds_on_a_tied_weight():
    """The trainer's path: the head gradient summed straight into the tied parameter's .grad
    (no [V, H] buffer held until the embedding's backward) gives autograd's .grad, accumulated
    over two micro-batches, with the embedding's share added by autograd on top."""
    grads = []
    for in_place in (False, True):
        gen = torch.Generator().manual_seed(4)
        weight = torch.nn.Parameter(torch.randn(V, H, generator=gen, dtype=torch.float64))
        for _micro_batch in range(2):
            ids = torch.randint(0, V, (N,), generator=gen)
            targets = torch.randint(0, V, (N,), generator=gen)
            hidden = torch.nn.functional.embedding(ids, weight).tanh()  # tied: the same weight
            logp, ent = chunked_logprobs(
                hidden, weight, targets, 0.9, chunk_size=8, weight_grad_in_place=in_place
            )
            (logp.sum() + 0.1 * ent.sum()).backward()
        grads.append(weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_in_place_is_off_for_a_weight_that_is_not_a_leaf():
    hidden, weight, targets = inputs()
    scaled = weight * 2.0  # e.g. a gathered or cast weight: autograd must carry its gradient
    logp, _ = chunked_logprobs(hidden, scaled, targets, 1.0, 8, weight_grad_in_place=True)
    logp.sum().backward()
    expected = torch.autograd.grad(plain(hidden, weight * 2.0, targets, 1.0)[0].sum(), weight)[0]
    torch.testing.assert_close(weight.grad, expected.double(), rtol=1e-5, atol=1e-6)


# A trained head's backward walks vocabulary slices over all rows: these shapes give slices
# [0, 128), [128, 256) and [256, 300), the last one partial, with targets in each.
SLICED_N, SLICED_V, SLICED_CHUNK = 40, 300, 10
SLICE_TARGETS = [0, 127, 128, 200, 255, 256, 299]


def sliced_inputs(dtype=torch.float64, seed=0, hidden_size=8):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SLICED_N, hidden_size, generator=gen, dtype=dtype)
    weight = torch.randn(SLICED_V, hidden_size, generator=gen, dtype=dtype) / hidden_size**0.25
    targets = torch.randint(0, SLICED_V, (SLICED_N,), generator=gen)
    targets[: len(SLICE_TARGETS)] = torch.tensor(SLICE_TARGETS)
    w_logp = torch.randn(SLICED_N, generator=gen, dtype=dtype)
    w_ent = torch.randn(SLICED_N, generator=gen, dtype=dtype)
    return hidden, weight, targets, w_logp, w_ent


def plain_loss(hidden, weight, targets, temperature, w_logp, w_ent):
    """The loss through full logits, in the inputs' dtype (float64 here)."""
    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return (logp.gather(1, targets[:, None])[:, 0] * w_logp).sum() + (entropy * w_ent).sum()


def chunked_loss(hidden, weight, targets, temperature, w_logp, w_ent, **kwargs):
    logp, entropy = chunked_logprobs(hidden, weight, targets, temperature, SLICED_CHUNK, **kwargs)
    return (logp * w_logp).sum() + (entropy * w_ent).sum()


def test_vocabulary_slices_are_bounded_like_one_row_chunk():
    assert vocab_slice_width(SLICED_N, SLICED_V, SLICED_CHUNK) == 128  # 3 slices, last partial
    # G1's shape: about 12k rows of a 151,936 vocabulary give 25 slices of 6,272 columns
    width = vocab_slice_width(12_288, 151_936, 512)
    assert width % 128 == 0 and 12_288 * width <= 512 * 151_936 and -(-151_936 // width) == 25
    assert vocab_slice_width(100, 53, 512) == 53  # at most the vocabulary
    assert vocab_slice_width(10**6, 1000, 1) == 128  # at least 128 columns


@pytest.mark.parametrize("hidden_needs_grad", [True, False])
def test_trained_head_gradients_over_vocabulary_slices_equal_full_logits(hidden_needs_grad):
    """Several vocabulary slices (the last partial), targets in the first, middle and last,
    temperature 0.7, an entropy term: hidden and weight gradients equal autograd through the
    full [N, V] log_softmax in float64."""
    hidden, weight, targets, w_logp, w_ent = sliced_inputs()
    h1 = hidden.clone().requires_grad_(hidden_needs_grad)
    W1 = weight.clone().requires_grad_()
    chunked_loss(h1, W1, targets, 0.7, w_logp, w_ent).backward()
    h2, W2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    plain_loss(h2, W2, targets, 0.7, w_logp, w_ent).backward()
    torch.testing.assert_close(W1.grad, W2.grad, rtol=1e-10, atol=1e-12)
    if hidden_needs_grad:
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    else:
        assert h1.grad is None


def test_gradcheck_over_vocabulary_slices():
    hidden, weight, targets, _, _ = sliced_inputs(hidden_size=3)
    hidden, targets = hidden[:7], targets[:7]  # 7 rows: slices of 128 (chunk 1 row: 300 // 7)
    assert vocab_slice_width(7, SLICED_V, 1) == 128
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_logprobs(h, w, targets, 0.8, 1),
        (hidden.requires_grad_(), weight.requires_grad_()),
    )


def test_in_place_weight_gradient_accumulates_over_vocabulary_slices():
    """`weight_grad_in_place`: the first call fills the parameter's empty .grad slice by slice,
    the second adds to it (twice the gradient), as autograd's .grad would."""
    hidden, weight, targets, w_logp, w_ent = sliced_inputs(seed=1)
    ref = weight.clone().requires_grad_()
    plain_loss(hidden, ref, targets, 1.3, w_logp, w_ent).backward()
    param = torch.nn.Parameter(weight.clone())
    h = hidden.clone().requires_grad_()
    chunked_loss(h, param, targets, 1.3, w_logp, w_ent, weight_grad_in_place=True).backward()
    torch.testing.assert_close(param.grad, ref.grad, rtol=1e-10, atol=1e-12)
    first_hidden_grad = h.grad.clone()
    chunked_loss(h, param, targets, 1.3, w_logp, w_ent, weight_grad_in_place=True).backward()
    torch.testing.assert_close(param.grad, 2 * ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.grad, 2 * first_hidden_grad, rtol=1e-12, atol=1e-12)


def test_frozen_head_hidden_gradient_over_row_chunks():
    """A frozen head (LoRA) takes the row-chunked backward: the hidden gradient equals full
    logits' at a temperature, with an entropy term, and the weight gets none."""
    hidden, weight, targets, w_logp, w_ent = sliced_inputs(seed=2)
    h1 = hidden.clone().requires_grad_()
    chunked_loss(h1, weight, targets, 0.7, w_logp, w_ent).backward()
    h2 = hidden.clone().requires_grad_()
    plain_loss(h2, weight, targets, 0.7, w_logp, w_ent).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
    assert weight.grad is None and not weight.requires_grad


def check_grad_logits_on_vocabulary_slices(device: str, dtype=torch.float32) -> None:
    """`logprob_kernels.grad_logits` on vocabulary slices of each row (`col_offset`), in place,
    with the full rows' logsumexp and entropy, against the matching columns of
    `chunk_grad_logits` on the full logits in float64; targets in the first, a middle and the
    last (partial) slice. Run on CUDA by the GPU test, on the CPU in Triton's interpreter."""
    from reinforge.train.packing import logprob_kernels
    from reinforge.train.packing.logprob_math import chunk_grad_logits

    if device == "cpu":  # Triton's interpreter (TRITON_INTERPRET=1, set before triton loads)
        _patch_triton_interpreter()
    gen = torch.Generator().manual_seed(0)
    rows, vocab, t = 9, 5000, 0.7
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device=device, dtype=dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[:5] = torch.tensor([0, 1023, 1024, 4095, vocab - 1])
    targets = targets.to(device)
    g_lp = torch.randn(rows, generator=gen).to(device)
    g_ent = torch.randn(rows, generator=gen).to(device)
    _, ent, lse = logprob_kernels.row_stats(logits, targets, t)
    ref = chunk_grad_logits(logits.double(), targets, g_lp.double(), g_ent.double(), t)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for v0, v1 in [(0, 1024), (1024, 4096), (4096, vocab)]:
        logits_slice = logits[:, v0:v1].contiguous()
        got = logprob_kernels.grad_logits(
            logits_slice, targets, lse, ent, g_lp, g_ent, t, out=logits_slice, col_offset=v0
        )
        want = ref[:, v0:v1]
        assert got.data_ptr() == logits_slice.data_ptr() and got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=tol * scale, rtol=tol)


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns 1-element arrays into ints with int(array), which numpy 2
    refuses (as in tests/engine/test_triton_kernels.py)."""
    import triton.runtime.interpreter as interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "patched_for_index", False):
        return

    def with_index(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    with_index.patched_for_index = True
    interpreter._patch_lang_tensor = with_index


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_grad_logits_of_vocabulary_slices_in_the_interpreter():
    """The slice kernel on the CPU in Triton's interpreter, in a child process: Triton reads
    TRITON_INTERPRET when it is first imported, which torch may have done already here."""
    repo = Path(__file__).resolve().parents[2]
    code = (
        "from tests.train.test_logprobs import check_grad_logits_on_vocabulary_slices as check; "
        "check('cpu')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_grad_logits_of_vocabulary_slices(dtype):
    check_grad_logits_on_vocabulary_slices("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_reductions_equal_the_reference_math(dtype):
    """`logprob_kernels.row_stats` / `grad_logits` against `chunk_stats` / `chunk_grad_logits`
    in float64, on a vocabulary that is not a multiple of the kernels' block, at a
    temperature, with targets at both ends; the in-place gradient equals the out-of-place one;
    and a whole chunked forward and backward (the trainer's path) equals full logits."""
    from reinforge.train.packing import logprob_kernels
    from reinforge.train.packing.logprob_math import chunk_grad_logits, chunk_stats

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab, t = 37, 10_000, 0.7
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[0], targets[1] = 0, vocab - 1
    g_lp = torch.randn(rows, device="cuda", generator=gen)
    g_ent = torch.randn(rows, device="cuda", generator=gen)
    logp, ent, lse = logprob_kernels.row_stats(logits, targets, t)
    ref_logp, ref_ent = chunk_stats(logits.double(), targets, t)
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(
        lse.double(), torch.logsumexp(logits.double() / t, -1), atol=2e-4, rtol=1e-5
    )
    grad = logprob_kernels.grad_logits(logits, targets, lse, ent, g_lp, g_ent, t)
    ref = chunk_grad_logits(logits.double(), targets, g_lp.double(), g_ent.double(), t)
    assert grad.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    in_place = logits.clone()
    logprob_kernels.grad_logits(in_place, targets, lse, ent, g_lp, g_ent, t, out=in_place)
    assert torch.equal(in_place, grad)
    # rows the loss does not read (both upstream gradients 0) get none, whatever their saved
    # statistics hold (the engine's placeholders: an infinite log-sum-exp)
    unread = g_lp.clone()
    unread[:5] = 0.0
    g_ent_unread = g_ent.clone()
    g_ent_unread[:5] = 0.0
    lse_inf = lse.clone()
    lse_inf[:5] = float("inf")
    grad_unread = logprob_kernels.grad_logits(
        logits, targets, lse_inf, ent, unread, g_ent_unread, t
    )
    assert torch.equal(grad_unread[:5], torch.zeros_like(grad_unread[:5]))
    assert torch.equal(grad_unread[5:], grad[5:])
    # each row's own target logit: the head's product at that column, rounded alike
    hid = torch.randn(rows, 96, device="cuda", generator=gen).to(dtype)
    w = torch.randn(vocab, 96, device="cuda", generator=gen).to(dtype)
    z = logprob_kernels.target_logits(hid, w, targets)
    assert z.dtype == dtype
    want = (hid.float() @ w.float().t()).to(dtype).gather(1, targets[:, None])[:, 0]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(z, want, atol=10 * tol, rtol=tol)

    # the autograd function on CUDA (Triton path) against full float32 logits
    hidden = torch.randn(50, 64, device="cuda", generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, 64, device="cuda", generator=gen, dtype=dtype)
    weight = (weight * 0.1).requires_grad_()
    tg = torch.randint(0, vocab, (50,), device="cuda", generator=gen)
    lp, en = chunked_logprobs(hidden, weight, tg, t, chunk_size=16)
    (lp.sum() + 0.1 * en.sum()).backward()
    h2 = hidden.detach().float().requires_grad_()
    w2 = weight.detach().float().requires_grad_()
    full = torch.log_softmax((h2 @ w2.t()) / t, -1)
    lp2 = full.gather(1, tg[:, None])[:, 0]
    en2 = -(full.exp() * full).sum(-1)
    (lp2.sum() + 0.1 * en2.sum()).backward()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(lp.float(), lp2, atol=tol, rtol=tol)
    torch.testing.assert_close(en.float(), en2, atol=tol, rtol=tol)
    for got, want in ((hidden.grad, h2.grad), (weight.grad, w2.grad)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, atol=tol * scale, rtol=tol * 4)
