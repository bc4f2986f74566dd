"""The lean forward (specviz/models/lean.py) against transformers' own on packed tiny models: the same logits,
bit for bit, through prefills of different lengths (the prompt merge), ragged feeds, rollback, row selection and
the reduced draft head, with fused projections and without; and it stays off where it would not be exact."""

from __future__ import annotations

import pytest
import torch

from specviz.decoding.drafts import subset_head
from specviz.models import cpu_kernels, lean
from specviz.models.packed import PackedLinear, apply_packed
from specviz.text.source import CausalLMDecoder

from conftest import VOCAB, tiny_qwen
from test_packed import random_packed

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.has_attention() or not cpu_kernels.has_int8_activations(),
    reason="the lean forward runs on the AVX2 build of the CPU kernels")

# one format for every layer (q/k/v and gate/up fuse), or three in turn (nothing fuses)
FORMATS = {"fused": [("q4", 32)], "unfused": [("q4", 32), ("q8", 16), ("q8", 32)]}


def packed_model(formats: list[tuple[str, int]], seed: int = 0):
    model = tiny_qwen(seed, layers=3)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    blocks = {}
    for i, name in enumerate(linears):
        n, k = model.get_submodule(name).weight.shape
        kind, group = formats[i % len(formats)]
        blocks[name] = random_packed(kind, n, k, seed=100 + i, group=group)
    return apply_packed(model, blocks, int8_activations=True)


def decode_steps(model, use_lean: bool, head=None, lengths=(9, 5, 7)) -> list[torch.Tensor]:
    """Logits of a fixed script of decoder calls, with or without the lean forward."""
    lean.attach(model)
    if not use_lean:
        model.lean_forward = None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    decoder = CausalLMDecoder(model, VOCAB, 3, head=head)
    out = []
    with torch.inference_mode():
        decoder.prefill(prompts)  # different lengths: prefilled one by one and merged
        out.append(decoder.forward([[1, 2, 3], [4], []], 3))  # ragged
        decoder.rollback([decoder.fed(0) - 2, decoder.fed(1), decoder.fed(2)])
        out.append(decoder.forward([[5, 6], [7, 8], [9]], 2))
        decoder.select([2, 0])
        out.append(decoder.forward([[10], [11, 12, 13, 14]], 4))
    return out


@pytest.mark.parametrize("formats", FORMATS.values(), ids=FORMATS.keys())
def test_the_lean_forward_gives_transformers_bits(formats):
    model = packed_model(formats)
    assert lean.supports(model)
    fused = lean.LeanForward(model).layers[0]
    assert (fused.qkv is not None and fused.gate_up is not None) == (len(formats) == 1)
    expected = decode_steps(model, use_lean=False)
    got = decode_steps(model, use_lean=True)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e.shape == g.shape and torch.equal(e, g), f"call {i}: max |Δ| {float((e - g).abs().max())}"


def test_a_prompt_read_in_pieces_gives_the_bits_of_one_forward(monkeypatch):
    """Prefill in pieces (for its progress) computes what one forward over the prompt does: the same keys and
    values, so the same logits at every later call; and it reports every piece, ending at the whole."""
    model = packed_model(FORMATS["fused"])
    for lengths in ((9, 5, 7), (8, 8, 8)):  # read one by one and merged; read as one batch
        whole = decode_steps(model, use_lean=True, lengths=lengths)
        with monkeypatch.context() as patch:
            patch.setattr(CausalLMDecoder, "PREFILL_PIECE", 3)
            pieces = decode_steps(model, use_lean=True, lengths=lengths)
        for i, (e, g) in enumerate(zip(whole, pieces)):
            assert torch.equal(e, g), f"{lengths}, call {i}: max |Δ| {float((e - g).abs().max())}"
    monkeypatch.setattr(CausalLMDecoder, "PREFILL_PIECE", 3)
    decoder = CausalLMDecoder(model, VOCAB, 2)
    assert decoder.reads_in_pieces
    with torch.inference_mode():
        steps = list(decoder.prefill_steps([[5] * 7, [6] * 4]))
    assert steps == [(3, 11), (6, 11), (7, 11), (10, 11), (11, 11)]
    with torch.inference_mode():
        assert list(CausalLMDecoder(model, VOCAB, 2).prefill_steps([[5] * 7, [6] * 7])) == [(6, 14), (12, 14), (14, 14)]


def test_the_reduced_draft_head_reads_the_lean_hidden_states():
    model = packed_model(FORMATS["fused"])
    head = subset_head(model, VOCAB, 40, {VOCAB - 1})
    assert head is not None
    expected = decode_steps(model, use_lean=False, head=head)
    got = decode_steps(model, use_lean=True, head=head)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert torch.isinf(got[0]).any()  # outside the subset: -inf, as the head defines


def test_fused_layers_read_the_same_storage():
    model = packed_model(FORMATS["fused"])
    layer = model.model.layers[0]
    before = layer.self_attn.k_proj.q.clone()
    forward = lean.LeanForward(model)
    k = layer.self_attn.k_proj
    assert torch.equal(k.q, before)
    assert k.q.untyped_storage().data_ptr() == forward.layers[0].qkv.q.untyped_storage().data_ptr()


def test_models_it_would_not_reproduce_keep_transformers_forward():
    dense = tiny_qwen(0)
    assert not lean.supports(dense) and lean.attach(dense).lean_forward is None
    windowed = packed_model(FORMATS["fused"])
    windowed.config.use_sliding_window = True
    assert not lean.supports(windowed)
    assert all(isinstance(m, PackedLinear) for m in (windowed.model.layers[0].mlp.down_proj,))


def test_the_arena_holds_aligned_copies_and_refuses_to_overflow():
    from specviz.models.arena import ALIGN, Arena, footprint

    parts = [torch.randn(7, 3), torch.randint(0, 255, (100,), dtype=torch.uint8), torch.randn(5)]
    arena = Arena(footprint(parts))
    placed = [arena.place(t) for t in parts]
    for t, p in zip(parts, placed):
        assert torch.equal(t, p) and p.is_contiguous() and p.data_ptr() % ALIGN == 0
        assert p.data_ptr() != t.data_ptr()
    with pytest.raises(ValueError, match="full"):
        arena.place(torch.zeros(1))


def test_the_lean_forward_moves_every_packed_weight_into_one_arena():
    from specviz.models.arena import footprint

    model = packed_model(FORMATS["unfused"])
    tensors = lambda: [t for m in model.modules() if isinstance(m, PackedLinear)
                       for t in (m.q, m.scale, m.minv, m.bias) if t is not None]
    size = footprint(tensors())
    forward = lean.LeanForward(model)
    starts = [t.data_ptr() for t in tensors()]
    assert max(starts) - min(starts) < size  # side by side in one block of exactly their size
    assert forward.layers[0].qkv is None  # q/k/v in different formats: not fused, moved as they are
