"""The batch-invariant CPU attention (kernels/cpu/attention_cpu.cpp via specviz.models.cpu_attention).

- Against torch's SDPA on random queries, keys and values with grouped heads, a causal mask with left
  padding, and a verification-shaped call (a few rows over a long cache): equal up to fp32 rounding.
- Bit for bit, a row's output does not depend on the call: the same row alone, among others, in a longer
  call (more keys masked off), or in a bigger batch gives the same bits.
- In a model (packed, fp32 and 8-bit activations): a prefix's logits in a call over more positions, and
  step-by-step decoding from a cache, equal the logits of one full call, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from specviz.models import cpu_attention, cpu_kernels

from conftest import tiny_qwen
from test_packed import ACTIVATIONS, packed_twin

pytestmark = pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.has_attention(),
                                reason="the batch-invariant attention needs the AVX2 build of the CPU kernels")


def causal_with_padding(B: int, L: int, S: int, pads: list[int]) -> torch.Tensor:
    """[B, L, S] bool: row i (the last L of S positions) sees keys up to its own position, minus the first
    pads[b] keys of sequence b (left padding)."""
    sees = torch.ones(L, S, dtype=torch.bool).tril(S - L).expand(B, L, S).clone()
    for b, pad in enumerate(pads):
        sees[b, :, :pad] = False
    return sees


def sdpa(q, k, v, sees, scale):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=sees[:, None], scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("B,H,Hkv,L,S,D", [(3, 6, 2, 9, 40, 16), (2, 4, 4, 1, 33, 8), (1, 12, 2, 70, 70, 128)],
                         ids=["verify-rows", "one-row", "prefill"])
def test_attention_equals_sdpa(B, H, Hkv, L, S, D):
    g = torch.Generator().manual_seed(B * 100 + L)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    sees = causal_with_padding(B, L, S, [b * 3 for b in range(B)])
    got = cpu_kernels.attention(q, k, v, sees.to(torch.uint8).contiguous(), D ** -0.5)
    torch.testing.assert_close(got, sdpa(q, k, v, sees, D ** -0.5), rtol=2e-5, atol=2e-5)


def test_a_cache_with_holes_reads_as_sdpa():
    """A speculative run's cache keeps rejected drafts' slots, masked: a row's keys are runs with holes between them
    (and, past 64 keys, runs the reading ahead takes in pieces). Over a long cache (400 keys of 512 bytes, read ahead
    16 rows) the output is SDPA's up to fp32 rounding and a row's bits are its own alone."""
    g = torch.Generator().manual_seed(7)
    B, H, Hkv, L, S, D = 3, 6, 2, 2, 400, 128
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    sees = causal_with_padding(B, L, S, [0, 7, 30])
    sees[:, :, 100:102] = False  # two rejected drafts
    sees[1, :, 250:253] = False
    sees[2, :, 120:380:9] = False  # a hole every 9 keys: runs shorter than the reading ahead
    got = cpu_kernels.attention(q, k, v, sees.to(torch.uint8).contiguous(), D ** -0.5)
    torch.testing.assert_close(got, sdpa(q, k, v, sees, D ** -0.5), rtol=2e-5, atol=2e-5)
    for b in range(B):
        alone = cpu_kernels.attention(q[b:b + 1].contiguous(), k[b:b + 1].contiguous(), v[b:b + 1].contiguous(),
                                      sees[b:b + 1].to(torch.uint8).contiguous(), D ** -0.5)
        assert torch.equal(alone[0], got[b]), b


@pytest.mark.parametrize("is_causal", [True, False])
def test_without_a_mask_the_module_says_whether_rows_see_every_key(is_causal):
    """transformers passes no mask to cross-attention (Whisper's decoder reading the encoder): a module that is
    not causal sees every key; a causal one sees keys up to its own position."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 4, 30, 16, generator=g), torch.randn(2, 4, 30, 16, generator=g)
    module = torch.nn.Module()
    module.is_causal = is_causal
    got, _ = cpu_attention._attention(module, q, k, v, None, scaling=0.25)
    sees = torch.ones(2, 3, 30, dtype=torch.bool) if not is_causal else causal_with_padding(2, 3, 30, [0, 0])
    torch.testing.assert_close(got, sdpa(q, k, v, sees, 0.25), rtol=2e-5, atol=2e-5)


def test_fp16_keys_and_values_give_their_fp32_copies_bits():
    """specviz_attention_f16kv reads fp16 keys and values and widens them exactly: the bits of the fp32 kernel on
    the widened copies, for every tile shape (8 keys at a time and the rest, 3 heads a pass and 1), in a buffer."""
    g = torch.Generator().manual_seed(11)
    for B, H, Hkv, L, S, D in ((2, 6, 2, 3, 45, 16), (1, 8, 8, 5, 1500, 64), (3, 4, 1, 1, 9, 8)):
        q = torch.randn(B, H, L, D, generator=g)
        k, v = (torch.randn(B, Hkv, S + 4, D, generator=g).half() for _ in range(2))  # a buffer, S in use
        sees = causal_with_padding(B, L, S, [b for b in range(B)]).to(torch.uint8).contiguous()
        half = cpu_kernels.attention(q, k[:, :, :S], v[:, :, :S], sees, D ** -0.5)
        full = cpu_kernels.attention(q, k[:, :, :S].float(), v[:, :, :S].float(), sees, D ** -0.5)
        assert torch.equal(half, full), (B, H, Hkv, L, S, D)
    with pytest.raises(ValueError, match="both be fp32 or both fp16"):
        cpu_kernels.attention(q, k.float(), v, sees, 1.0)


def test_a_rows_output_is_the_same_bits_in_any_call():
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, S = 8, 2, 32, 50
    q, k, v = torch.randn(4, H, 12, D, generator=g), torch.randn(4, Hkv, S, D, generator=g), torch.randn(4, Hkv, S, D, generator=g)
    sees = causal_with_padding(4, 12, S, [0, 5, 2, 9]).to(torch.uint8)
    full = cpu_kernels.attention(q, k, v, sees.contiguous(), 0.2)
    for b in range(4):
        for i in (0, 5, 11):
            alone = cpu_kernels.attention(q[b:b + 1, :, i:i + 1].contiguous(), k[b:b + 1].contiguous(),
                                          v[b:b + 1].contiguous(), sees[b:b + 1, i:i + 1].contiguous(), 0.2)
            assert torch.equal(alone[0, 0], full[b, i]), (b, i)
            # the same row with 20 more keys it cannot see (a longer cache, e.g. another sequence's)
            wider = torch.zeros(1, 1, S + 20, dtype=torch.uint8)
            wider[..., :S] = sees[b:b + 1, i:i + 1]
            pad = torch.randn(1, Hkv, 20, D, generator=g)
            longer = cpu_kernels.attention(q[b:b + 1, :, i:i + 1].contiguous(), torch.cat([k[b:b + 1], pad], 2),
                                           torch.cat([v[b:b + 1], pad], 2), wider, 0.2)
            assert torch.equal(longer[0, 0], full[b, i]), (b, i, "more masked keys")


def test_rows_taken_together_give_each_rows_bits_alone():
    """Rows of one sequence are taken up to 8 at a time so that the keys they share are read once; a row's keys
    after the shared ones go on alone. Whatever the rows share (a causal block's prefix, nothing under a random
    mask, a row that sees nothing), each row must get the bits it gets alone (fp32 and fp16 keys, 7 heads a key
    head, 11 rows: a block of 8 and one of 3)."""
    g = torch.Generator().manual_seed(13)
    H, Hkv, D, S, L = 14, 2, 64, 75, 11
    q = torch.randn(2, H, L, D, generator=g)
    for kv_dtype in (torch.float32, torch.float16):
        k, v = (torch.randn(2, Hkv, S, D, generator=g).to(kv_dtype) for _ in range(2))
        for sees in (causal_with_padding(2, L, S, [0, 4]).to(torch.uint8),
                     (torch.rand(2, L, S, generator=g) < 0.6).to(torch.uint8)):
            sees[1, 2] = 0  # a padding row: zeros
            sees = sees.contiguous()
            full = cpu_kernels.attention(q, k, v, sees, 0.125)
            assert not full[1, 2].any()
            for b in range(2):
                for i in range(L):
                    alone = cpu_kernels.attention(q[b:b + 1, :, i:i + 1].contiguous(), k[b:b + 1], v[b:b + 1],
                                                  sees[b:b + 1, i:i + 1].contiguous(), 0.125)
                    assert torch.equal(alone[0, 0], full[b, i]), (kv_dtype, b, i)


@pytest.mark.parametrize("int8_activations", ACTIVATIONS, ids=["fp32-activations", "int8-activations"])
def test_a_packed_models_logits_do_not_depend_on_the_call(int8_activations):
    _, model, _ = packed_twin(tiny_qwen(0), seed=10, int8_activations=int8_activations)
    assert model.config._attn_implementation == cpu_attention.NAME
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(ids).logits[0]
        prefix = model(ids[:, :12]).logits[0]
        out = model(ids[:, :12], use_cache=True)
        cache, steps = out.past_key_values, []
        for i in range(12, 20):
            out = model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1])
    assert torch.equal(prefix, full[:12])
    assert torch.equal(torch.stack(steps[:-1]), full[12:19])


def test_a_cache_buffers_view_is_read_in_place_with_the_same_bits():
    """Keys and values as the first S positions of a preallocated cache buffer (models.kv_cache): read in place,
    and the output is the bits of the same keys copied out contiguously."""
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, L, S, capacity, D = 2, 4, 2, 3, 11, 40, 16
    buffers = [torch.randn(B, Hkv, capacity, D, generator=g) for _ in range(2)]
    k, v = (b[:, :, :S] for b in buffers)
    q = torch.randn(B, H, L, D, generator=g)
    sees = (torch.rand(B, L, S, generator=g) > 0.3).to(torch.uint8)
    sees[:, :, 0] = 1
    assert cpu_kernels.buffer_rows(k) == capacity and cpu_kernels.buffer_rows(k.contiguous()) == S
    assert cpu_kernels.buffer_rows(k.transpose(1, 2)) is None  # another layout is copied first
    in_place = cpu_kernels.attention(q, k, v, sees, 0.25)
    copied = cpu_kernels.attention(q, k.contiguous(), v.contiguous(), sees, 0.25)
    assert torch.equal(in_place, copied)


# ---- full attention over bf16 inputs (kernels/cpu/encoder_attention_cpu.cpp: Whisper's encoder under bf16) ----

bf16_kernel = pytest.mark.skipif(not cpu_kernels.has_bf16_attention(), reason="the bf16 attention needs AVX-512 BF16")


@pytest.fixture(params=["tiles", "vectors"])
def bf16_path(request):
    """Each bf16 attention test on both of the kernel's paths where this machine has AMX (its tiles, and the
    AVX-512 BF16 one a Zen 4 runs); where it has none, on the vector path only."""
    before = cpu_kernels.bf16_attention_tiles()
    if before is None:
        if request.param == "tiles":
            pytest.skip("no AMX tiles here")
        yield request.param
        return
    cpu_kernels.bf16_attention_tiles(request.param == "tiles")
    try:
        yield request.param
    finally:
        cpu_kernels.bf16_attention_tiles(before)


def _bf16_qkv(B: int, H: int, S: int, D: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(3)]


@bf16_kernel
@pytest.mark.parametrize("B, H, S, D", [(1, 8, 1500, 64), (2, 3, 37, 64), (1, 2, 5, 32), (2, 2, 50, 128),
                                        (1, 1, 1, 64)])
def test_bf16_attention_is_fp32_attention_on_the_same_numbers(B, H, S, D, bf16_path):
    """Tails of the 12-row and 32-key tiles included (37, 5, 50, 1): against float64 on the bf16 numbers."""
    q, k, v = _bf16_qkv(B, H, S, D, seed=S + D)
    out = cpu_kernels.bf16_attention(q, k, v, 0.3)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3).transpose(1, 2)
    assert out.shape == (B, S, H, D) and out.dtype == torch.float32
    fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3).transpose(1, 2)
    worst = (fp32.double() - ref).abs().max().item()  # torch's fp32 SDPA: measured ≤ 3e-6 here
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=max(2e-5, 8 * worst))


@bf16_kernel
def test_bf16_attention_gives_a_sequence_the_same_bits_in_any_batch(bf16_path):
    q, k, v = _bf16_qkv(3, 4, 301, 64, seed=5)
    together = cpu_kernels.bf16_attention(q, k, v, 1.0)
    for b in range(3):
        alone = cpu_kernels.bf16_attention(q[b:b + 1].clone(), k[b:b + 1].clone(), v[b:b + 1].clone(), 1.0)
        assert torch.equal(together[b:b + 1], alone)


@bf16_kernel
def test_bf16_attention_refuses_what_it_is_not_built_for():
    q, k, v = _bf16_qkv(1, 2, 8, 64, seed=6)
    with pytest.raises(ValueError, match="must be bf16"):
        cpu_kernels.bf16_attention(q.float(), k, v, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        cpu_kernels.bf16_attention(q, k[:, :, :4].contiguous(), v, 1.0)
    with pytest.raises(ValueError, match="width"):
        cpu_kernels.bf16_attention(*(x[..., :48].contiguous() for x in (q, k, v)), 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_kernels.bf16_attention(q.transpose(2, 3), k.transpose(2, 3), v.transpose(2, 3), 1.0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        cpu_kernels.bf16_attention(q, k, v, 1.0, out_dtype=torch.float16)


@bf16_kernel
@pytest.mark.parametrize("B, H, S, D", [(2, 8, 300, 64), (1, 2, 37, 128), (2, 3, 5, 32)])
def test_bf16_attention_reads_heads_in_place_and_rounds_its_output_as_torch(B, H, S, D, bf16_path):
    """A linear layer's [B, S, H·D] output seen as [B, H, S, D] heads (strided) gives the bits of its contiguous copy,
    and a bf16 output is the fp32 output rounded as .to(torch.bfloat16) rounds it."""
    g = torch.Generator().manual_seed(S)
    rows = [torch.randn(B, S, H * D, generator=g).bfloat16() for _ in range(3)]
    heads = [x.view(B, S, H, D).transpose(1, 2) for x in rows]  # strides (S·H·D, D, H·D, 1)
    assert not heads[0].is_contiguous()
    contiguous = cpu_kernels.bf16_attention(*(x.contiguous() for x in heads), 0.125)
    assert torch.equal(cpu_kernels.bf16_attention(*heads, 0.125), contiguous)
    rounded = cpu_kernels.bf16_attention(*heads, 0.125, out_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, contiguous.to(torch.bfloat16))
