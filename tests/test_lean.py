"""The lean forward (specviz/models/lean.py) against transformers' own on packed tiny models. Its torch path: the
same logits, bit for bit, through prefills of different lengths (the prompt merge), ragged feeds, rollback, row
selection and the reduced draft head, with fused projections and without. Its native path (every layer in one
C++ call): batch-invariant bit for bit, and as close to the fp32-activation model as transformers' 8-bit forward
is. And it stays off where it would not be exact."""

from __future__ import annotations

import pytest
import torch

from specviz.decoding.drafts import subset_head
from specviz.models import cpu_kernels, lean, native_forward
from specviz.models.packed import PackedLinear, apply_packed
from specviz.text.source import CausalLMDecoder

from conftest import VOCAB, tiny_qwen
from test_packed import flat_twin, random_packed, two_level_packed

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.has_attention() or not cpu_kernels.has_int8_activations(),
    reason="the lean forward runs on the AVX2 build of the CPU kernels")

# one format for every layer (q/k/v and gate/up fuse), or three in turn (nothing fuses)
FORMATS = {"fused": [("q4", 32)], "unfused": [("q4", 32), ("q8", 16), ("q8", 32)]}


def packed_model(formats: list[tuple[str, int]], seed: int = 0, int8_activations: bool = True):
    model = tiny_qwen(seed, layers=3)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    blocks = {}
    for i, name in enumerate(linears):
        n, k = model.get_submodule(name).weight.shape
        kind, group = formats[i % len(formats)]
        blocks[name] = random_packed(kind, n, k, seed=100 + i, group=group)
    return apply_packed(model, blocks, int8_activations=int8_activations)


PATHS = ("transformers", "torch", "native")  # transformers' forward; the lean forward's torch or native path


def decode_steps(model, path: str, head=None, lengths=(9, 5, 7), keep_table: bool = True,
                 kv_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Logits of a fixed script of decoder calls through `path` (PATHS); keep_table=False: the native path
    without its rotary table; kv_dtype: what the native layers keep keys and values as."""
    assert path in PATHS
    lean.attach(model)
    if not keep_table:
        model.lean_forward.rotary_table = None
    if path == "transformers":
        model.lean_forward = None
    elif path == "torch":
        model.lean_forward.native = None
    else:
        assert model.lean_forward.native is not None, "the native layers should apply to this model"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    decoder = CausalLMDecoder(model, VOCAB, 3, head=head, kv_dtype=kv_dtype)
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
    expected = decode_steps(model, "transformers")
    got = decode_steps(model, "torch")
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e.shape == g.shape and torch.equal(e, g), f"call {i}: max |Δ| {float((e - g).abs().max())}"


def _rows(calls: list[torch.Tensor]) -> torch.Tensor:  # every position's logits [n, V], padding included
    return torch.cat([c.reshape(-1, c.shape[-1]) for c in calls])


def _scored(*rows: torch.Tensor) -> torch.Tensor:
    """Where every one of `rows` holds a scored position (finite, not a padding row of zeros): one mask for all,
    so that the same positions are compared."""
    return torch.stack([torch.isfinite(r).all(-1) & (r.abs().sum(-1) > 0) for r in rows]).all(0)


@pytest.mark.parametrize("formats", FORMATS.values(), ids=FORMATS.keys())
def test_the_native_layers_are_as_close_to_fp32_activations_as_transformers_8_bit_forward(formats):
    """The native path's norms and SiLU round differently from torch's, and an 8-bit code can flip on such a
    difference, so its logits are not transformers' bits. What it must be is the same model: measured against the
    fp32-activation model on the same blocks (three random models, 69 scored positions), its mean error is
    transformers' own 8-bit forward's (measured: equal to 3%), where a mistake in a norm, rotary or the cache's
    layout costs ~100% of the logits."""
    errors = {"transformers": [], "native": []}
    agree = {"transformers": [], "native": []}
    for seed in range(3):
        reference = _rows(decode_steps(packed_model(formats, seed, int8_activations=False), "transformers"))
        model = packed_model(formats, seed)
        got = {path: _rows(decode_steps(model, path)) for path in errors}
        scored = _scored(reference, *got.values())
        for path in errors:
            e, r = got[path][scored], reference[scored]
            errors[path].append((e - r).norm(dim=-1) / r.norm(dim=-1))
            agree[path].append(e.argmax(-1) == r.argmax(-1))
    e_torch, e_native = torch.cat(errors["transformers"]), torch.cat(errors["native"])
    assert len(e_native) >= 60 and float(e_torch.mean()) < 0.2
    assert float(e_native.mean()) <= 1.25 * float(e_torch.mean()) + 0.005, (e_native.mean(), e_torch.mean())
    assert torch.cat(agree["native"]).float().mean() >= torch.cat(agree["transformers"]).float().mean() - 0.1


KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}  # the target's keys and values; a draft's


@pytest.mark.parametrize("kv", KV_DTYPES.values(), ids=KV_DTYPES.keys())
@pytest.mark.parametrize("formats", FORMATS.values(), ids=FORMATS.keys())
def test_the_native_layers_give_a_row_the_same_bits_alone_or_in_a_ragged_batch(formats, kv):
    """decode_steps' row 1 (its prompt of 5, then [4], then [7, 8] after a rollback) and row 0 (then [11 … 14]
    after the select), decoded alone: the same logits at every position they scored in the batch, with keys and
    values kept in fp32 or in fp16 (each element rounded by itself as it is written)."""
    model = packed_model(formats)
    batch = decode_steps(model, "native", kv_dtype=kv)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (9, 5, 7)]
    with torch.inference_mode():
        alone = CausalLMDecoder(model, VOCAB, 1, kv_dtype=kv)
        alone.prefill([prompts[1]])
        first = alone.forward([[4]], 1)
        alone.rollback([alone.fed(0)])
        second = alone.forward([[7, 8]], 2)
        row0 = CausalLMDecoder(model, VOCAB, 1, kv_dtype=kv)
        row0.prefill([prompts[0]])
        row0.forward([[1, 2, 3]], 3)
        row0.rollback([row0.fed(0) - 2])
        row0.forward([[5, 6]], 2)
        third = row0.forward([[11, 12, 13, 14]], 4)
    assert torch.equal(first[0, -1], batch[0][1, -1])  # fed one token beside rows of 3 and 0
    assert torch.equal(second[0], batch[1][1])
    assert torch.equal(third[0], batch[2][1])  # after the select, beside a row of one
    assert all(layer.keys.dtype == kv and layer.values.dtype == kv for layer in row0.cache.layers)


@pytest.mark.parametrize("formats", FORMATS.values(), ids=FORMATS.keys())
def test_fp16_keys_and_values_stay_close_to_fp32_ones(formats):
    """A draft's keys and values in fp16 (half the bytes its attention reads) change its logits by rounding only,
    which the 8-bit activations then amplify where a code flips: over three random models' scored positions (69),
    against the same native layers with fp32 keys and values, the mean relative error stays below what the 8-bit
    activations themselves cost against fp32 activations (measured: 2.2% against 5.5% fused, 3.1% against 3.9%
    unfused) and the argmax agrees at 90% or more of positions; a slot written in the wrong place or format costs
    ~100%. (On the embedded pair, α at T = 0.8 moved by at most 0.004 on four documents: tests/test_real_pair.py.)"""
    errors, agree, activations = [], [], []
    for seed in range(3):
        model = packed_model(formats, seed)
        full = _rows(decode_steps(model, "native"))
        half = _rows(decode_steps(model, "native", kv_dtype=torch.float16))
        reference = _rows(decode_steps(packed_model(formats, seed, int8_activations=False), "transformers"))
        scored = _scored(full, half, reference)
        e, r = half[scored], full[scored]
        errors.append((e - r).norm(dim=-1) / r.norm(dim=-1))
        agree.append(e.argmax(-1) == r.argmax(-1))
        activations.append((r - reference[scored]).norm(dim=-1) / reference[scored].norm(dim=-1))
    errors, agree, activations = torch.cat(errors), torch.cat(agree), torch.cat(activations)
    assert len(errors) >= 60 and 0 < float(errors.mean()) < min(0.05, float(activations.mean())), float(errors.mean())
    assert float(agree.float().mean()) >= 0.9


def test_a_draft_on_the_native_layers_keeps_fp16_keys_and_values():
    from specviz.text.source import draft_kv_dtype

    model = lean.attach(packed_model(FORMATS["fused"]))
    assert draft_kv_dtype(model) == torch.float16
    model.lean_forward.native = None  # the lean forward's torch path writes what its projections give
    assert draft_kv_dtype(model) == torch.float32
    assert draft_kv_dtype(tiny_qwen(0, layers=1)) == torch.float32  # transformers' forward


@pytest.mark.parametrize("formats", [["q4"], ["q4", "q8"]], ids=["fused", "unfused"])
def test_two_level_scales_give_both_paths_the_flat_scales_bits(formats):
    """A model whose every layer holds the k-quants' two levels (Q4_K, Q6_K; hidden sizes a multiple of 256)
    against its twin on the flat scales: the same logits, bit for bit, through the torch path and the native one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def model(flat: bool):
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=True, eos_token_id=VOCAB - 1)
        m = Qwen2ForCausalLM(config).float().eval()
        linears = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
        blocks = {}
        for i, name in enumerate(linears):
            n, k = m.get_submodule(name).weight.shape
            p = two_level_packed(formats[i % len(formats)], n, k, seed=200 + i)
            blocks[name] = flat_twin(p) if flat else p
        return apply_packed(m, blocks, int8_activations=True)

    two, flat = model(False), model(True)
    assert any(l.sub is not None for l in two.modules() if isinstance(l, PackedLinear))
    for path in ("torch", "native"):
        for a, b in zip(decode_steps(two, path), decode_steps(flat, path)):
            assert torch.equal(a, b), path


def test_the_rotary_table_gives_what_rotary_computes_per_call(monkeypatch):
    """The native path reads rotary's cos/sin from a table made once; per call (a context past the table, or no
    table) it computes them. Both: the same logits, bit for bit; and past the table's end it falls back."""
    model = packed_model(FORMATS["fused"])
    with_table = decode_steps(model, "native")
    assert model.lean_forward.rotary_table is not None
    model.lean_forward.rotary_table = None
    for a, b in zip(with_table, decode_steps(model, "native", keep_table=False)):
        assert torch.equal(a, b)
    monkeypatch.setattr(lean.LeanForward, "ROTARY_TABLE_POSITIONS", 8)  # shorter than the script's contexts
    for a, b in zip(with_table, decode_steps(model, "native")):
        assert torch.equal(a, b)


def test_a_native_call_that_does_not_fit_says_so_and_takes_no_cache_slot():
    from specviz.models.kv_cache import BufferedCache

    model = packed_model(FORMATS["fused"])
    native = lean.LeanForward(model).native
    hidden_size, heads, kv_heads, head_dim, _ = native.shape
    cache = BufferedCache()
    tables = torch.zeros(1, 2, head_dim), torch.zeros(1, 2, head_dim)
    sees = torch.ones(1, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit a model of hidden size"):
        native.run(torch.zeros(1, 2, hidden_size + 8), cache, 0, *tables, sees)
    with pytest.raises(ValueError, match="does not fit"):
        native.run(torch.zeros(1, 2, hidden_size), cache, 0, *tables, torch.ones(1, 2, 3, dtype=torch.uint8))
    assert cache.get_seq_length() == 0  # nothing claimed by a refused call
    native.run(torch.zeros(1, 2, hidden_size), cache, 0, *tables, sees)  # the same call, fitting
    assert cache.get_seq_length() == 2
    # keys and values in a format the kernels do not write, or a cache holding the other one: refused, said so
    with pytest.raises(ValueError, match="fp32, or fp16"):
        native.run(torch.zeros(1, 2, hidden_size), BufferedCache(kv_dtype=torch.bfloat16), 0, *tables, sees)
    cache.kv_dtype = torch.float16  # its buffers were made fp32 by the call above
    more = torch.ones(1, 2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="holds torch.float32 keys"):
        native.run(torch.zeros(1, 2, hidden_size), cache, 2, *tables, more)
    assert cache.get_seq_length() == 2  # refused before any slot was claimed


def test_the_native_stage_timers_add_up_this_threads_calls_only():
    import threading

    model = packed_model(FORMATS["fused"])
    with native_forward.stage_seconds() as seconds:
        decode_steps(model, "native")
        other = threading.Thread(target=decode_steps, args=(packed_model(FORMATS["fused"], seed=1), "native"))
        with pytest.raises(RuntimeError, match="already open"):
            with native_forward.stage_seconds():
                pass
    assert set(seconds) == set(native_forward.STAGES) and all(v > 0 for v in seconds.values())
    with native_forward.stage_seconds() as idle:
        other.start()
        other.join()
    assert all(v == 0 for v in idle.values())  # the other thread's calls were not timed


@pytest.mark.parametrize("path", ("torch", "native"))
def test_a_prompt_read_in_pieces_gives_the_bits_of_one_forward(monkeypatch, path):
    """Prefill in pieces (for its progress) computes what one forward over the prompt does: the same keys and
    values, so the same logits at every later call; and it reports every piece, ending at the whole. (A
    whole batched prompt is over 16 rows, the native layers' threaded row loops; a piece under 16, their
    serial ones.)"""
    model = packed_model(FORMATS["fused"])
    for lengths in ((9, 5, 7), (8, 8, 8)):  # read one by one and merged; read as one batch
        whole = decode_steps(model, path, lengths=lengths)
        with monkeypatch.context() as patch:
            patch.setattr(CausalLMDecoder, "PREFILL_PIECE", 3)
            pieces = decode_steps(model, path, lengths=lengths)
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
    expected = decode_steps(model, "transformers", head=head)
    got = decode_steps(model, "torch", head=head)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    native = decode_steps(model, "native", head=head)
    assert all(torch.isinf(n).equal(torch.isinf(g)) for n, g in zip(native, got))  # the same subset
    full = decode_steps(model, "native")
    for n, f in zip(native, full):  # inside the subset, the full head's own numbers
        assert torch.equal(n[torch.isfinite(n)], f[torch.isfinite(n)])
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
                       for t in (getattr(m, name) for name in PackedLinear.BUFFERS) if t is not None]
    size = footprint(tensors())
    forward = lean.LeanForward(model)
    starts = [t.data_ptr() for t in tensors()]
    assert max(starts) - min(starts) < size  # side by side in one block of exactly their size
    assert forward.layers[0].qkv is None  # q/k/v in different formats: not fused, moved as they are
