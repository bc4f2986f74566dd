"""The preallocated KV cache (specviz/models/kv_cache.py) against transformers' DynamicCache on tiny models:
the same logits, bit for bit, through prefill, ragged feeds, rollback, crop, row selection and the prompt
merge, and appends that write in place instead of reallocating."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, WhisperConfig, WhisperForConditionalGeneration

from specviz.decoding.engine import _rows_after_leaving
from specviz.models import cpu_attention, cpu_kernels
from specviz.models.kv_cache import BufferedCache, BufferedLayer
from specviz.models.prompt_cache import PromptCache
from specviz.speech.asr import WhisperDecoder
from specviz.text.source import CausalLMDecoder

from conftest import VOCAB, tiny_qwen


class DynamicDecoder(CausalLMDecoder):
    """What CausalLMDecoder ran before issue 29: transformers' DynamicCache, grown by concatenation."""

    def _new_cache(self) -> DynamicCache:
        return DynamicCache()


ATTENTION = ["sdpa", "eager"] + (["specviz_cpu"] if cpu_kernels.available() and cpu_kernels.has_attention() else [])


@pytest.fixture(scope="module", params=ATTENTION)
def model(request):
    m = tiny_qwen(5)
    if request.param == "specviz_cpu":
        cpu_attention.use(m)
    else:
        m.set_attn_implementation(request.param)
    return m


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:  # a, b: any shape
    assert a.shape == b.shape and torch.equal(a, b), (a - b).abs().max()


def _same_cache(new: CausalLMDecoder, old: CausalLMDecoder) -> None:
    _same(new.valid, old.valid)
    assert new.slots == old.slots
    assert new.cache.get_seq_length() == old.cache.get_seq_length() == new.valid.shape[1]
    for a, b in zip(new.cache.layers, old.cache.layers, strict=True):
        _same(a.keys, b.keys)
        _same(a.values, b.values)


@torch.inference_mode()
def _drive(new: CausalLMDecoder, old: CausalLMDecoder, prompts: list[list[int]], seed: int, steps: int = 10) -> int:
    """The same prefill, ragged feeds, rollbacks and row selections on both; every logit must match.
    Returns how many cache entries are holes at the end."""
    g = torch.Generator().manual_seed(seed)
    new.prefill(prompts)
    old.prefill(prompts)
    _same_cache(new, old)
    for step in range(steps):
        feeds = [_tokens(g, int(torch.randint(0, 6, (1,), generator=g))) for _ in range(new.batch)]
        if not any(feeds):
            feeds[0] = [5]
        keep = max(len(f) for f in feeds)
        _same(new.forward(feeds, keep), old.forward(feeds, keep))
        # drop a random tail of this step's tokens per row: holes in the middle, a cropped tail at the end
        fed = [new.fed(r) - int(torch.randint(0, len(f) + 1, (1,), generator=g)) for r, f in enumerate(feeds)]
        new.rollback(fed)
        old.rollback(fed)
        _same_cache(new, old)
        if step == 2 and new.batch > 2:  # a middle row leaves: the rows after it move down in place
            rows = [0] + list(range(2, new.batch))
            new.select(rows)
            old.select(rows)
            _same_cache(new, old)
        if step == 4 and new.batch > 1:  # the first row leaves, the last one is copied (a shared prefill's way)
            rows = list(range(1, new.batch)) + [new.batch - 1]
            new.select(rows)
            old.select(rows)
            _same_cache(new, old)
        if step == 6 and new.batch > 2:  # the first row leaves as the engine orders it: the last takes its place
            rows = _rows_after_leaving([False] + [True] * (new.batch - 1))
            assert rows == [new.batch - 1] + list(range(1, new.batch - 1))
            before = new.cache.layers[0]._keys.data_ptr()
            new.select(rows)
            old.select(rows)
            _same_cache(new, old)
            assert new.cache.layers[0]._keys.data_ptr() == before  # in place: one row copied, nothing reallocated
    slots, holes = new.cache_use()
    assert (slots, holes) == old.cache_use()
    return holes


def test_one_row_matches_dynamic_cache(model):
    g = torch.Generator().manual_seed(1)
    _drive(CausalLMDecoder(model, VOCAB, 1), DynamicDecoder(model, VOCAB, 1), [_tokens(g, 17)], seed=2)


def test_ragged_batch_and_prompt_merge_match_dynamic_cache(model):
    """Prompts of different lengths are prefilled one by one and merged left-padded (place_rows against the
    concatenation DynamicCache needs), then ragged feeds, rollbacks and a row leaving."""
    g = torch.Generator().manual_seed(3)
    prompts = [_tokens(g, n) for n in (12, 5, 21)]
    assert _drive(CausalLMDecoder(model, VOCAB, 3), DynamicDecoder(model, VOCAB, 3), prompts, seed=4) > 0


def test_rows_leaving_in_the_engines_order_match_dynamic_cache(model):
    """Five rows: a middle one leaves, the first leaves with the last copied, then the first leaves as the engine
    orders it (the last row takes its place, in place)."""
    g = torch.Generator().manual_seed(11)
    prompts = [_tokens(g, n) for n in (6, 13, 9, 4, 11)]
    _drive(CausalLMDecoder(model, VOCAB, 5), DynamicDecoder(model, VOCAB, 5), prompts, seed=12, steps=8)


def test_prompt_cache_and_shared_prefill_match_dynamic_cache(model):
    """Identical prompts share one prefill (select repeats a row); a second decoder takes the prompts from
    the prompt cache the first one filled."""
    g = torch.Generator().manual_seed(5)
    a, b = _tokens(g, 9), _tokens(g, 14)
    new_prompts, old_prompts = PromptCache(), PromptCache()
    for _ in range(2):  # the second round reads both prompts from the caches
        _drive(CausalLMDecoder(model, VOCAB, 3, prompt_cache=new_prompts),
               DynamicDecoder(model, VOCAB, 3, prompt_cache=old_prompts), [a, b, a], seed=6, steps=6)
    assert new_prompts.hits == old_prompts.hits == 2
    # a stored prompt is exactly its keys and values: no spare slots kept alive, contiguous
    for keys, values in new_prompts.get(tuple(a)):
        assert keys.shape[-2] == len(a) and keys.is_contiguous() and values.is_contiguous()


def test_growth_beyond_the_headroom_keeps_every_bit(model):
    """A cache with no headroom grows (doubling) many times over the run; nothing moves in the views."""
    class Tight(CausalLMDecoder):
        def _new_cache(self) -> BufferedCache:
            return BufferedCache(headroom=0, pooled=True)

    g = torch.Generator().manual_seed(7)
    new, old = Tight(model, VOCAB, 2), DynamicDecoder(model, VOCAB, 2)
    _drive(new, old, [_tokens(g, 3), _tokens(g, 8)], seed=8, steps=12)
    assert new.cache.layers[0].capacity >= new.valid.shape[1]


def test_a_pool_hands_out_disjoint_tensors_and_reuses_a_chunk_only_when_none_of_it_is_left():
    """A decoding cache's buffers (arena.Pool): aligned, never overlapping; a chunk goes back for reuse once its last
    tensor (a view counts) is gone, and not before."""
    import gc

    from specviz.models import arena

    def span(t: torch.Tensor) -> range:
        return range(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())

    pool = arena.Pool()
    parts = [pool.empty((3, 5), torch.float32), pool.empty((1001,), torch.float16), pool.empty((2, 7, 9), torch.uint8),
             pool.empty((4, 2, 33, 8), torch.float32)]
    for i, t in enumerate(parts):
        assert t.data_ptr() % arena.ALIGN == 0 and t.is_contiguous()
        t.fill_(i + 1)
        assert not any(set(span(t)) & set(span(u)) for u in parts[:i])
    assert [int(t.float().mean()) for t in parts] == [1, 2, 3, 4]  # no write reached another tensor
    chunk = parts[0].data_ptr()  # the chunk's first 2 MB boundary
    assert chunk % arena.HUGE_PAGE == 0

    def idle_chunks() -> set[int]:
        return {-(-torch.frombuffer(m, dtype=torch.uint8).data_ptr() // arena.HUGE_PAGE) * arena.HUGE_PAGE
                for m in arena._IDLE._idle}

    kept = parts[1][10:20]  # a view of the chunk outlives the pool and every tensor it gave
    del pool, parts, t
    gc.collect()
    assert chunk not in idle_chunks() and torch.all(kept == 2)
    del kept
    gc.collect()
    assert chunk in idle_chunks()
    big = arena.Pool().empty((arena.Pool.CHUNK // 4 + 1,), torch.float32)  # beyond a chunk: memory of its own
    assert big.numel() == arena.Pool.CHUNK // 4 + 1 and big.data_ptr() % arena.HUGE_PAGE == 0


@torch.inference_mode()
def test_model_calls_crop_select_reset_match_dynamic_cache(model):
    """The Cache API straight from the model's forward: update, crop, batch_select_indices,
    batch_repeat_interleave and reset, against DynamicCache."""
    g = torch.Generator().manual_seed(9)
    new, old = BufferedCache(), DynamicCache()

    def step(ids: torch.Tensor) -> None:  # ids [B, n]
        a = model(input_ids=ids, past_key_values=new, use_cache=True).logits
        b = model(input_ids=ids, past_key_values=old, use_cache=True).logits
        _same(a, b)
        for x, y in zip(new.layers, old.layers, strict=True):
            _same(x.keys, y.keys)
            _same(x.values, y.values)

    step(torch.tensor([_tokens(g, 10), _tokens(g, 10)]))
    step(torch.tensor([_tokens(g, 3), _tokens(g, 3)]))
    new.crop(-2)
    old.crop(-2)
    step(torch.tensor([_tokens(g, 1), _tokens(g, 1)]))
    index = torch.tensor([1, 1, 0])
    new.batch_select_indices(index)
    old.batch_select_indices(index)
    step(torch.tensor([_tokens(g, 2)] * 3))
    new.batch_repeat_interleave(2)
    old.batch_repeat_interleave(2)
    step(torch.tensor([_tokens(g, 1)] * 6))
    buffer = new.layers[0]._keys.data_ptr()
    index = torch.tensor([0, 2, 5])  # rows leaving: moved in place, no new buffers
    new.batch_select_indices(index)
    old.batch_select_indices(index)
    assert new.layers[0]._keys.data_ptr() == buffer and new.layers[0]._keys.shape[0] == 3
    step(torch.tensor([_tokens(g, 2)] * 3))
    new.reset()
    old.reset()
    assert new.get_seq_length() == old.get_seq_length() == 0
    step(torch.tensor([_tokens(g, 4)] * 3))


@torch.inference_mode()
def test_appending_writes_in_place(model):
    """Within capacity a step writes into the same buffers (no reallocation, no copy of the cache): the
    keys, values and attention mask the model sees are views of memory that stays put."""
    decoder = CausalLMDecoder(model, VOCAB, 2)
    decoder.prefill([[1, 2, 3, 4], [5, 6]])
    layers = decoder.cache.layers
    pointers = [(layer._keys.data_ptr(), layer._values.data_ptr()) for layer in layers]
    mask = decoder._valid_buffer.data_ptr()
    for step in range(20):
        decoder.forward([[7, 8, 9], [10]] if step % 2 else [[11], [12]], 1)
        if step % 3 == 0:
            decoder.rollback([decoder.fed(0) - 1, decoder.fed(1)])
        assert [(layer._keys.data_ptr(), layer._values.data_ptr()) for layer in layers] == pointers
        assert all(layer.keys.data_ptr() == layer._keys.data_ptr() for layer in layers)
        assert decoder._valid_buffer.data_ptr() == mask and decoder.valid.data_ptr() == mask
    assert layers[0].capacity > decoder.valid.shape[1]


class DynamicWhisper(WhisperDecoder):
    """WhisperDecoder on transformers' own DynamicCache for self-attention too: what the product's (a BufferedCache
    for self-attention, specviz/speech/asr.py) must match."""

    def _new_cache(self) -> EncoderDecoderCache:
        return EncoderDecoderCache(DynamicCache(), DynamicCache())


def test_whisper_self_attention_on_the_buffered_cache_matches():
    """An encoder-decoder cache with a BufferedCache for self-attention: the same bits as WhisperDecoder's
    DynamicCache through prefill, ragged feeds, rollback and a row leaving (crop and row selection pass
    EncoderDecoderCache's check that both sides are DynamicCaches)."""
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=300, num_mel_bins=80, d_model=64, encoder_layers=1, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
                           decoder_start_token_id=297, pad_token_id=299, eos_token_id=299, bos_token_id=299)
    model = WhisperForConditionalGeneration(config).float().eval()
    encoder_out = torch.randn(3, 30, 64)  # [B, frames, d_model]
    new, old = (cls(model, encoder_out, 2, [1, 2], [4]) for cls in (WhisperDecoder, DynamicWhisper))
    assert isinstance(new.cache.self_attention_cache, BufferedCache)
    assert not isinstance(old.cache.self_attention_cache, BufferedCache)
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        new.prefill([[297, 298]] * 3)
        old.prefill([[297, 298]] * 3)
        for step in range(8):
            feeds = [torch.randint(5, 299, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(new.batch)]
            feeds[0] = feeds[0] or [7]
            keep = max(len(f) for f in feeds)
            _same(new.forward(feeds, keep), old.forward(feeds, keep))
            fed = [new.fed(r) - int(torch.randint(0, len(f) + 1, (1,), generator=g)) for r, f in enumerate(feeds)]
            new.rollback(fed)
            old.rollback(fed)
            _same(new.valid, old.valid)
            if step == 3:
                new.select([0, 2])
                old.select([0, 2])
    assert isinstance(new.cache.self_attention_cache.layers[0], BufferedLayer)
