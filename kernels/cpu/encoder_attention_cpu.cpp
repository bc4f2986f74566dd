// Full (unmasked) attention over bf16 queries, keys and values with fp32 arithmetic: Whisper's encoder under its
// bf16 products (specviz.speech.encoder), 1,500 frames attending to 1,500.
//
//   out[b, i, h] = softmax_j(scale · q[b, h, i] · k[b, h, j]) · v[b, h, j]
//
// Why a kernel: torch's CPU SDPA ran this at ~60 GMAC/s on the 2-core Zen 4 (its fp32 GEMM ~85, its bf16 GEMM ~190), and
// was ~45% of the encoder's time. The queries and keys are already bf16 numbers (autocast's linear layers made
// them), so q · k through AVX-512 BF16's dot product multiplies exactly the numbers fp32 would, each product exact,
// summed in fp32; the softmax and probabilities · values stay fp32 (probabilities rounded to bf16 are where bf16
// attention loses: specviz.speech.encoder). Differs from fp32 SDPA on the same inputs only in summation order.
// Where AMX is (attention_amx), both products run on its tiles, each probability carried in full as three bf16
// numbers (weigh_values_amx): against float64 a quarter of the fp32 loop's error (1.2e-7 against 4.7e-7 at D 64, 8
// heads of 1,500 frames), 0.05% of the outputs rounded to bf16 the other way; a layer 13.6 → 10.2 ms on the 2-vCPU
// Xeon (D 128: 0.45×).
//
// Layouts: q, k, v [B, H, S, D] bf16 (uint16 bits), rows of D contiguous, batch, head and row strided (Heads: a
// projection's [B, S, H·D] output read in place); out [B, S, H, D] (transformers' attention output layout), fp32 or
// bf16. D 32, 64 or 128. Each (sequence, head, block of rows) is one task: a row's output depends only on
// its own query and its sequence's keys and values, never on the other sequences in the call.
// Built with the other kernels into one library (specviz.native).

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <atomic>
#include <type_traits>
#include <vector>
#if defined(__AMX_BF16__) && defined(__linux__)
#include "amx.h"
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPECVIZ_BF16_ATTENTION 1
#include "vector_math.h"
#endif

namespace {

#ifdef SPECVIZ_BF16_ATTENTION
constexpr int64_t ROWS = 12;  // query rows a task scores at once: 24 of the 32 vector registers hold their tile
constexpr int64_t TILE = 32;  // keys per score tile: two vectors of 16

inline __m512bh as_bf16(__m512i x) { return (__m512bh)x; }

// A [B, H, S, D] bf16 tensor whose rows (D elements) are contiguous, the rest strided (in elements): the layout a
// linear layer's [B, S, H·D] output has seen as heads, read in place (no transposed copy).
struct Heads {
    const uint16_t* base;
    int64_t b, h, s;  // strides of the batch, head and row dimensions
    const uint16_t* head(int64_t bh, int64_t H) const { return base + (bh / H) * b + (bh % H) * h; }
};

// An output row's 16 numbers, fp32 or rounded to bf16 (to nearest, ties to even: torch's conversion of the fp32 row)
inline void store16(float* o, __m512 x) { _mm512_storeu_ps(o, x); }
inline void store16(uint16_t* o, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(x)); }

// One head's keys as pairs of dimensions: kp[p * Sp + j] = (k[j, 2p], k[j, 2p + 1]), so one load gives 16 keys'
// pair p, the operand order of the bf16 dot product; keys S..Sp are zero (their scores are never read).
void pack_keys(const uint16_t* k, int64_t stride, int64_t S, int64_t Sp, int64_t D, uint32_t* kp) {
    for (int64_t p = 0; p < D / 2; ++p) {
        uint32_t* row = kp + p * Sp;
        for (int64_t j = 0; j < S; ++j) row[j] = reinterpret_cast<const uint32_t*>(k + j * stride)[p];
        for (int64_t j = S; j < Sp; ++j) row[j] = 0;
    }
}

// scores[r, j] = q[row r] · k[j] for ROWS rows (rows past the last repeat it: computed, never written out)
void score_rows(const uint16_t* q, int64_t stride, int64_t first, int64_t L, const uint32_t* kp, int64_t Sp,
                int64_t D, float* scores) {
    const uint32_t* rowq[ROWS];
    for (int64_t r = 0; r < ROWS; ++r)
        rowq[r] = reinterpret_cast<const uint32_t*>(q + (first + r < L ? first + r : L - 1) * stride);
    for (int64_t j0 = 0; j0 < Sp; j0 += TILE) {
        __m512 acc[ROWS][2];
        for (int64_t r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; ++p) {
            const __m512bh k0 = as_bf16(_mm512_loadu_si512(kp + p * Sp + j0));
            const __m512bh k1 = as_bf16(_mm512_loadu_si512(kp + p * Sp + j0 + 16));
            for (int64_t r = 0; r < ROWS; ++r) {
                const __m512bh qp = as_bf16(_mm512_set1_epi32(static_cast<int>(rowq[r][p])));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, k0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, k1);
            }
        }
        for (int64_t r = 0; r < ROWS; ++r) {
            _mm512_storeu_ps(scores + r * Sp + j0, acc[r][0]);
            _mm512_storeu_ps(scores + r * Sp + j0 + 16, acc[r][1]);
        }
    }
}

// A row's scores S..Sp-1 are padding: lanes masked out of the maximum and the sum, probabilities 0.
inline __mmask16 lanes(int64_t j, int64_t S) {
    if (j + 16 <= S) return static_cast<__mmask16>(0xFFFF);
    return j >= S ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << (S - j)) - 1);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#define SPECVIZ_ENCODER_AMX 1
// score_rows on AMX's tiles where the CPU has AMX-BF16 (Intel, Sapphire Rapids on) and Linux grants them: C [AMX_ROWS
// queries, 16 keys] fp32 += A [AMX_ROWS, 32 bf16 of q] · B [16 pairs, 16 keys] per 32 dimensions. Each product of two
// bf16 numbers is exact in fp32 either way, but the tile unit adds a pair's two products in its own order, so the
// scores are not the dot-product instructions' bits: against float64 the same error (1.4e-5 / 5.5e-6 at D 64 / 128,
// 1,500 and 200 keys, against 1.4e-5 / 1.1e-5). A window's output still depends on that window alone; the encoder's
// bf16 products (torch's, on AMX here too) already differ by machine. The 2-vCPU Xeon, 8 heads × 1,500 keys, a layer
// at D 32 / 64 / 128: 0.71 / 0.60 / 0.60× the time.
//
// Every tile the tiles read or write is one contiguous KB (blocked layouts below): a tile of 16 rows 64 bytes apart
// takes 16 cache lines of one or two pages, where rows a whole row of keys apart (6 KB at 1,500 keys) took 16 pages.
// The softmax and the split of its probabilities run in one pass, and the tile unit scores the next task and weighs
// the last one's values while the vector units work through it (attention_amx's pipeline). A layer (8 heads, 1,500
// frames, D 64) on the 2-vCPU Xeon, side by side: 9.7 → 7.9 ms (blocked layouts and one pass 0.91×, the next scores
// meanwhile 0.95×, the 16-lane exp's 2^n by scalef 0.96×, the last values meanwhile 0.95×). The same numbers in the
// same order: the same bits.
constexpr int64_t AMX_ROWS = 16;  // query rows a task takes on tiles: a tile's 16 rows
// Whether attention() takes the tiles where it may; only tests switch it off (specviz_encoder_attention_tiles), so
// that the AVX-512 BF16 path the Zen 4 runs is tested on machines with AMX too. Atomic: sessions call from threads.
std::atomic<bool> use_tiles{true};
constexpr int64_t BLOCK = 16;     // keys a block: a score tile's columns

// One head's keys as B tiles: block kb (keys 16kb … 16kb + 15), pair p: kb[(kb · D/2 + p) · 16 + j] = (k[16kb + j, 2p],
// k[16kb + j, 2p + 1]); the 16 pairs of a 32-dimension chunk of a block are one contiguous tile. Keys S..Sp zero.
void pack_key_blocks(const uint16_t* k, int64_t stride, int64_t S, int64_t Sp, int64_t D, uint32_t* kb) {
    for (int64_t b = 0; b < Sp / BLOCK; ++b)
        for (int64_t p = 0; p < D / 2; ++p) {
            uint32_t* row = kb + (b * (D / 2) + p) * BLOCK;
            for (int64_t j = 0; j < BLOCK; ++j) {
                const int64_t key = b * BLOCK + j;
                row[j] = key < S ? reinterpret_cast<const uint32_t*>(k + key * stride)[p] : 0;
            }
        }
}

// A task's scores on tiles, blocked: scores[(kb · AMX_ROWS + r) · 16 + j] = q[row r] · k[16kb + j] (rows past the last
// repeat it, as score_rows). `begin` loads the task's query rows into A tiles (tmm4 …), then `step(j0)` scores keys
// j0 … j0 + 31 for every j0 a multiple of TILE below Sp, in any order, interleaved with other work that uses no tiles.
template <int DV>
struct TileScores {
    static constexpr int64_t D = 16 * DV;
    const uint32_t* kb = nullptr;
    float* scores = nullptr;
    alignas(64) uint32_t rows[AMX_ROWS * (D / 2)];  // the task's query rows, the last repeated past L (as score_rows)

    void begin(const uint16_t* q, int64_t stride, int64_t first, int64_t L, const uint32_t* keys, float* out) {
        kb = keys;
        scores = out;
        for (int64_t r = 0; r < AMX_ROWS; ++r)
            memcpy(rows + r * (D / 2), q + (first + r < L ? first + r : L - 1) * stride, D * 2);
        // tile numbers are immediates (gcc pastes them into the assembly): A's 32-dimension chunks in tmm4 …, keys'
        // B tiles in tmm2 / tmm3, the two 16-key blocks of a TILE's scores in tmm0 / tmm1
        _tile_loadd(4, rows, D * 2);
        if constexpr (DV >= 4) _tile_loadd(5, rows + 16, D * 2);
        if constexpr (DV >= 8) {
            _tile_loadd(6, rows + 32, D * 2);
            _tile_loadd(7, rows + 48, D * 2);
        }
    }

    void step(int64_t j0) const {
#define SPECVIZ_KEYS_CHUNK(a_tile, c)                                          \
    _tile_loadd(2, kb + ((j0 / BLOCK) * (D / 2) + 16 * (c)) * BLOCK, 64);      \
    _tile_loadd(3, kb + ((j0 / BLOCK + 1) * (D / 2) + 16 * (c)) * BLOCK, 64);  \
    _tile_dpbf16ps(0, a_tile, 2);                                              \
    _tile_dpbf16ps(1, a_tile, 3);
        _tile_zero(0);
        _tile_zero(1);
        SPECVIZ_KEYS_CHUNK(4, 0)
        if constexpr (DV >= 4) { SPECVIZ_KEYS_CHUNK(5, 1) }
        if constexpr (DV >= 8) { SPECVIZ_KEYS_CHUNK(6, 2) SPECVIZ_KEYS_CHUNK(7, 3) }
        _tile_stored(0, scores + (j0 / BLOCK) * AMX_ROWS * BLOCK, 64);
        _tile_stored(1, scores + (j0 / BLOCK + 1) * AMX_ROWS * BLOCK, 64);
#undef SPECVIZ_KEYS_CHUNK
    }
};

// Each of AMX_ROWS rows' maximum scale · score, from blocked scores (padding lanes left out)
void row_shifts(const float* scores, int64_t S, int64_t Sp, float scale, float* shift) {
    __m512 m[AMX_ROWS];
    for (int64_t r = 0; r < AMX_ROWS; ++r) m[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < Sp / BLOCK; ++b)
        for (int64_t r = 0; r < AMX_ROWS; ++r)
            m[r] = _mm512_mask_max_ps(m[r], lanes(b * BLOCK, S), m[r], _mm512_loadu_ps(scores + (b * AMX_ROWS + r) * BLOCK));
    for (int64_t r = 0; r < AMX_ROWS; ++r) shift[r] = _mm512_reduce_max_ps(m[r]) * scale;
}

// The blocked scores of AMX_ROWS rows -> each row's e^(scale · s - shift) as three bf16 parts, p = hi + mid + lo (hi =
// bf16(p), mid = bf16(p - hi), lo = bf16 of the rest: 24 bits, all of p's), written as A tiles: part[(c · AMX_ROWS +
// r) · 32 + j] for keys 32c + j. sums[r] = the row's sum. Row by row the operations of a softmax over a row and a
// split of its fp32 probabilities, on the same vectors in the same order (the same bits), without the probabilities
// written and read again. After each block b of keys, `between(b)`: tile work (attention_amx's pipeline), which the
// tile unit works through while these vector instructions run.
template <typename Between>
void softmax_parts(const float* scores, int64_t S, int64_t Sp, float scale, const float* shift, uint16_t* hi,
                   uint16_t* mid, uint16_t* lo, float* sums, const Between& between) {
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 sum[AMX_ROWS];
    for (int64_t r = 0; r < AMX_ROWS; ++r) sum[r] = _mm512_setzero_ps();
    uint16_t* parts[3] = {hi, mid, lo};
    for (int64_t b = 0; b < Sp / BLOCK; ++b) {
        const __mmask16 keep = lanes(b * BLOCK, S);
        const bool whole = keep == static_cast<__mmask16>(0xFFFF);  // every block but the last one or two
        const int64_t at = (b / 2) * AMX_ROWS * TILE + (b % 2) * BLOCK;  // this block's 16 keys in a row of an A tile
        for (int64_t r = 0; r < AMX_ROWS; ++r) {
            const __m512 x = _mm512_loadu_ps(scores + (b * AMX_ROWS + r) * BLOCK);
            __m512 p = specviz_math::exp_nonpositive(_mm512_fmsub_ps(x, factor, _mm512_set1_ps(shift[r])));
            if (!whole) p = _mm512_maskz_mov_ps(keep, p);
            sum[r] = _mm512_add_ps(sum[r], p);
            for (uint16_t* part : parts) {  // each part the bf16 rounding of what the parts before it left
                const __m256bh top = _mm512_cvtneps_pbh(p);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(part + at + r * TILE), (__m256i)top);
                p = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)top), 16)));
            }
        }
        between(b);
    }
    for (int64_t r = 0; r < AMX_ROWS; ++r) sums[r] = _mm512_reduce_add_ps(sum[r]);
}

// Probabilities · values on tiles, for AMX_ROWS rows: C [16 rows, 16 outputs] fp32 += A [16 rows, 32 keys] · B [16
// key pairs, 16 outputs] per 32 keys, A the three bf16 parts of the probabilities (softmax_parts), B read in place
// from the values packed as key pairs (pack_value_pairs). All three parts go through the tiles, each product with a
// bf16 value exact in fp32 (one bf16 probability, 8 bits, is where bf16 attention loses: specviz.speech.encoder).
// Three times one bf16 pass's tile work (two parts measured 6% faster a layer, but 16 bits missed fp32's
// accuracy). Output columns in groups of 4 tiles (64): the tile registers hold 4 results, a chunk's three
// probability parts and its values. `step(i)` for i in [0, steps()) in order, interleaved with work that uses no
// tiles; the task's output rows are written at its last step.
template <int DV, typename Out>
struct TileValues {
    static constexpr int64_t D = 16 * DV, GROUPS = (DV + 3) / 4, IN_GROUP = DV < 4 ? DV : 4;
    const uint16_t *hi, *mid, *lo, *vp;
    int64_t Sp;
    const float* sums;
    Out* out;  // the task's first output row, head h: row r at out + r · H · D
    int64_t rows, H;
    alignas(64) float result[AMX_ROWS * D];

    int64_t steps() const { return GROUPS * (Sp / TILE); }

    void step(int64_t i) {
        const int64_t per_group = Sp / TILE, g = i / per_group, j0 = (i % per_group) * TILE;
        const int64_t b_stride = D * 4;  // bytes a key pair's 2D values
// tile numbers are immediates pasted into the assembly: result tile c, its values in tile 7
#define SPECVIZ_VALUES_TILE(c)                                                               \
    if constexpr (c < IN_GROUP) {                                                            \
        _tile_loadd(7, vp + (j0 / 2) * 2 * D + 2 * 16 * (g * 4 + (c)), b_stride);            \
        _tile_dpbf16ps(c, 4, 7);                                                             \
        _tile_dpbf16ps(c, 5, 7);                                                             \
        _tile_dpbf16ps(c, 6, 7);                                                             \
    }
#define SPECVIZ_STORE_TILE(c) \
    if constexpr (c < IN_GROUP) _tile_stored(c, result + 16 * (g * 4 + (c)), D * 4);
        if (j0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        const int64_t at = (j0 / TILE) * AMX_ROWS * TILE;  // the A tile of keys j0 … j0 + 31: 1 KB
        _tile_loadd(4, hi + at, TILE * 2);
        _tile_loadd(5, mid + at, TILE * 2);
        _tile_loadd(6, lo + at, TILE * 2);
        SPECVIZ_VALUES_TILE(0) SPECVIZ_VALUES_TILE(1) SPECVIZ_VALUES_TILE(2) SPECVIZ_VALUES_TILE(3)
        if (j0 + TILE == Sp) {
            SPECVIZ_STORE_TILE(0) SPECVIZ_STORE_TILE(1) SPECVIZ_STORE_TILE(2) SPECVIZ_STORE_TILE(3)
        }
#undef SPECVIZ_VALUES_TILE
#undef SPECVIZ_STORE_TILE
        if (i + 1 == steps())
            for (int64_t r = 0; r < rows; ++r) {
                const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
                Out* o = out + r * H * D;
                for (int c = 0; c < DV; ++c) store16(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(result + r * D + 16 * c), inv));
            }
    }
};

// One head's values as pairs of keys, the B operand's layout: vp[(j / 2) · 2D + 2d + j % 2] = v[j, d]; keys S..Sp-1
// zero (their probabilities are 0 too)
void pack_value_pairs(const uint16_t* v, int64_t stride, int64_t S, int64_t Sp, int64_t D, uint16_t* vp) {
    uint32_t* pairs = reinterpret_cast<uint32_t*>(vp);  // [Sp / 2, D]
    for (int64_t j = 0; j < Sp; j += 2)
        for (int64_t d = 0; d < D; ++d) {
            const uint32_t even = j < S ? v[j * stride + d] : 0, odd = j + 1 < S ? v[(j + 1) * stride + d] : 0;
            pairs[(j / 2) * D + d] = even | (odd << 16);
        }
}

inline specviz_amx::TileConfig tiles_16_by_64() {  // every tile 16 rows of 64 bytes: scores' and values' shapes
    specviz_amx::TileConfig config;
    for (int t = 0; t < 8; ++t) config.set(t, static_cast<int>(AMX_ROWS), 64);
    return config;
}
#endif

// scores -> e^(scale · (s - max)) in place; returns their sum (lanes summed in one fixed order)
float softmax_numerators(float* s, int64_t S, int64_t Sp, float scale) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Sp; j += 16) m = _mm512_mask_max_ps(m, lanes(j, S), m, _mm512_loadu_ps(s + j));
    const float top = _mm512_reduce_max_ps(m);
    const __m512 shift = _mm512_set1_ps(top * scale), factor = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < Sp; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(lanes(j, S),
                                             specviz_math::exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), factor, shift)));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

// out rows += probabilities · values, RP rows at a time (RP · DV = 24 accumulators, each value vector loaded
// once for RP rows), then scaled by 1 / sum
template <int DV, typename Out>
void weigh_values(const float* probs, int64_t Sp, const float* vf, int64_t S, const float* sums, int64_t first,
                  int64_t L, int64_t H, int64_t h, Out* out) {
    constexpr int64_t D = 16 * DV, RP = 24 / DV;
    for (int64_t r0 = 0; r0 < ROWS && first + r0 < L; r0 += RP) {
        __m512 acc[RP][DV];
        for (int64_t r = 0; r < RP; ++r)
            for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < S; ++j) {
            __m512 value[DV];
            for (int c = 0; c < DV; ++c) value[c] = _mm512_loadu_ps(vf + j * D + 16 * c);
            for (int64_t r = 0; r < RP; ++r) {
                const __m512 pr = _mm512_set1_ps(probs[(r0 + r) * Sp + j]);
                for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, value[c], acc[r][c]);
            }
        }
        for (int64_t r = 0; r < RP && first + r0 + r < L; ++r) {
            const __m512 inv = _mm512_set1_ps(1.0f / sums[r0 + r]);
            Out* o = out + ((first + r0 + r) * H + h) * D;
            for (int c = 0; c < DV; ++c) store16(o + 16 * c, _mm512_mul_ps(acc[r][c], inv));
        }
    }
}

#ifdef SPECVIZ_ENCODER_AMX
// attention() on tiles: scores and probabilities · values, AMX_ROWS query rows a task
template <int DV, typename Out>
void attention_amx(Heads q, Heads k, Heads v, int64_t B, int64_t H, int64_t S, float scale, Out* out, int nthreads) {
    constexpr int64_t D = 16 * DV;
    const int64_t Sp = (S + TILE - 1) / TILE * TILE, heads = B * H, blocks = (S + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t tasks = heads * blocks;
    std::vector<uint32_t> kb(heads * (D / 2) * Sp);  // every head's keys and values packed, once
    std::vector<uint16_t> vp(heads * Sp * D);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < heads; ++bh) {
            pack_key_blocks(k.head(bh, H), k.s, S, Sp, D, kb.data() + bh * (D / 2) * Sp);
            pack_value_pairs(v.head(bh, H), v.s, S, Sp, D, vp.data() + bh * Sp * D);
        }
        // This thread's tasks, in order (as schedule(static)), as a pipeline: while task t goes through its softmax
        // on the vector units, the tile unit scores task t + 1 and then weighs task t - 1's values. Buffers by
        // task parity: scores (t + 1 written while t is read) and probabilities' parts and sums (t written while
        // t - 1 is read).
        const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = tasks * id / team, t1 = tasks * (id + 1) / team;
        std::vector<float> scores(2 * AMX_ROWS * Sp);
        std::vector<uint16_t> parts(2 * 3 * AMX_ROWS * Sp);  // by parity: hi, mid, lo, each [Sp / 32][AMX_ROWS][32]
        alignas(64) float shift[AMX_ROWS], sums[2][AMX_ROWS];
        auto part = [&](int64_t task, int which) { return parts.data() + ((task % 2) * 3 + which) * AMX_ROWS * Sp; };
        TileScores<DV> next;
        auto start = [&](int64_t task) {  // the task's query rows into the tiles, its scores into its buffer
            const int64_t bh = task / blocks;
            next.begin(q.head(bh, H), q.s, (task % blocks) * AMX_ROWS, S, kb.data() + bh * (D / 2) * Sp,
                       scores.data() + (task % 2) * AMX_ROWS * Sp);
        };
        auto values = [&](int64_t task) {
            const int64_t bh = task / blocks, first = (task % blocks) * AMX_ROWS, b = bh / H, h = bh % H;
            return TileValues<DV, Out>{part(task, 0), part(task, 1), part(task, 2), vp.data() + bh * Sp * D, Sp,
                                  sums[task % 2], out + ((b * S + first) * H + h) * D,
                                  first + AMX_ROWS < S ? AMX_ROWS : S - first, H, {}};
        };
        const specviz_amx::TileConfig config = tiles_16_by_64();
        _tile_loadconfig(&config);
        if (t0 < t1) {
            start(t0);
            for (int64_t j0 = 0; j0 < Sp; j0 += TILE) next.step(j0);
        }
        for (int64_t task = t0; task < t1; ++task) {
            row_shifts(scores.data() + (task % 2) * AMX_ROWS * Sp, S, Sp, scale, shift);
            const bool scoring = task + 1 < t1, weighing = task > t0;
            if (scoring) start(task + 1);
            TileValues<DV, Out> previous = weighing ? values(task - 1) : TileValues<DV, Out>{};
            // the tile steps, spread evenly over the softmax's blocks: the next task's scores, then the last one's values
            const int64_t n_scores = scoring ? Sp / TILE : 0, n_steps = n_scores + (weighing ? previous.steps() : 0);
            const int64_t n_blocks = Sp / BLOCK;
            int64_t done = 0;
            softmax_parts(scores.data() + (task % 2) * AMX_ROWS * Sp, S, Sp, scale, shift, part(task, 0),
                          part(task, 1), part(task, 2), sums[task % 2], [&](int64_t b) {
                              for (const int64_t due = n_steps * (b + 1) / n_blocks; done < due; ++done) {
                                  if (done < n_scores)
                                      next.step(done * TILE);
                                  else
                                      previous.step(done - n_scores);
                              }
                          });
        }
        if (t0 < t1) {
            TileValues<DV, Out> last = values(t1 - 1);
            for (int64_t i = 0; i < last.steps(); ++i) last.step(i);
        }
        _tile_release();
    }
}
#endif

template <int DV, typename Out>
void attention(Heads q, Heads k, Heads v, int64_t B, int64_t H, int64_t S, float scale, Out* out, int nthreads) {
#ifdef SPECVIZ_ENCODER_AMX
    if (use_tiles.load(std::memory_order_relaxed) && specviz_amx::permitted())
        return attention_amx<DV, Out>(q, k, v, B, H, S, scale, out, nthreads);
#endif
    constexpr int64_t D = 16 * DV;
    const int64_t Sp = (S + TILE - 1) / TILE * TILE, heads = B * H, blocks = (S + ROWS - 1) / ROWS;
    std::vector<uint32_t> kp(heads * (D / 2) * Sp);  // every head's keys packed, then its values in fp32, once
    std::vector<float> vf(heads * S * D);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < heads; ++bh) {
            pack_keys(k.head(bh, H), k.s, S, Sp, D, kp.data() + bh * (D / 2) * Sp);
            const uint16_t* src = v.head(bh, H);
            float* dst = vf.data() + bh * S * D;
            for (int64_t j = 0; j < S; ++j)
                for (int64_t d = 0; d < D; ++d) {  // bf16 -> fp32: the bits, shifted
                    const uint32_t bits = static_cast<uint32_t>(src[j * v.s + d]) << 16;
                    memcpy(dst + j * D + d, &bits, 4);
                }
        }
        std::vector<float> scores(ROWS * Sp);
        float sums[ROWS];
#pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * blocks; ++task) {
            const int64_t bh = task / blocks, first = (task % blocks) * ROWS, b = bh / H, h = bh % H;
            score_rows(q.head(bh, H), q.s, first, S, kp.data() + bh * (D / 2) * Sp, Sp, D, scores.data());
            for (int64_t r = 0; r < ROWS; ++r) sums[r] = softmax_numerators(scores.data() + r * Sp, S, Sp, scale);
            weigh_values<DV, Out>(scores.data(), Sp, vf.data() + bh * S * D, S, sums, first, S, H, h, out + b * S * H * D);
        }
    }
}
#endif

}  // namespace

extern "C" {

int specviz_has_bf16_attention() {
#ifdef SPECVIZ_BF16_ATTENTION
    return 1;
#else
    return 0;
#endif
}

// Whether the bf16 attention takes AMX's tiles: -1 where this build or process has none; else the setting before,
// set to `on` unless it is -1 (tests only: both paths on one machine).
int specviz_encoder_attention_tiles(int on) {
#ifdef SPECVIZ_ENCODER_AMX
    if (!specviz_amx::permitted()) return -1;
    return on >= 0 ? use_tiles.exchange(on != 0) : use_tiles.load();
#else
    (void)on;
    return -1;
#endif
}

// 0 on success; 1 where this build has no such kernel or D is not 32, 64 or 128 (the caller keeps torch's).
// q, k, v [B, H, S, D] bf16 with contiguous rows, strides (in elements) of their batch, head and row dimensions in
// qs, ks, vs [3]; out [B, S, H, D] contiguous, fp32, or bf16 where out_bf16 (each number the fp32 one rounded).
int specviz_bf16_attention(const uint16_t* q, const int64_t* qs, const uint16_t* k, const int64_t* ks,
                           const uint16_t* v, const int64_t* vs, int64_t B, int64_t H, int64_t S, int64_t D,
                           float scale, void* out, int out_bf16, int nthreads) {
#ifdef SPECVIZ_BF16_ATTENTION
    const Heads hq{q, qs[0], qs[1], qs[2]}, hk{k, ks[0], ks[1], ks[2]}, hv{v, vs[0], vs[1], vs[2]};
    auto run = [&](auto* o) {
        using Out = std::remove_pointer_t<decltype(o)>;
        switch (D) {
            case 32: attention<2, Out>(hq, hk, hv, B, H, S, scale, o, nthreads); return 0;
            case 64: attention<4, Out>(hq, hk, hv, B, H, S, scale, o, nthreads); return 0;
            case 128: attention<8, Out>(hq, hk, hv, B, H, S, scale, o, nthreads); return 0;
            default: return 1;
        }
    };
    return out_bf16 ? run(static_cast<uint16_t*>(out)) : run(static_cast<float*>(out));
#else
    (void)q; (void)qs; (void)k; (void)ks; (void)v; (void)vs; (void)B; (void)H; (void)S; (void)D; (void)scale;
    (void)out; (void)out_bf16; (void)nthreads;
    return 1;
#endif
}

}  // extern "C"
