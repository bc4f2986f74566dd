// Batch-invariant attention for the CPU: out[b, i, h] = softmax_j(scale · q[b, h, i] · k[b, h', j]) · v[b, h', j]
// over exactly the keys j that the mask lets row i see, in increasing j, whatever else is in the call.
//
// torch's scaled_dot_product_attention blocks queries and keys by the call's lengths, so a position's output
// moved by ~1e-6 between a call over 12 positions and one over 20: harmless for fp32 logits, but enough for
// 8-bit activations (specviz.models.packed) to round a code the other way. Here every (row, head) walks its own
// keys in order: the same operations for a row in a prefill, in a verification call of γ + 1 rows beside other
// sequences, or alone; only the set of keys it may see (the mask) decides. Rows of one sequence are taken up to
// 8 at a time only so that the keys they share are read once for all of them (`attend`).
//
// Layouts (fp32; k and v also fp16, specviz_attention_f16kv): q [B, H, L, D] contiguous; k and v the first S
// positions of [B, Hkv, Sk, D] contiguous buffers
// (Sk = S for plain tensors; H a multiple of Hkv: grouped queries share a key head), mask [B, L, S] uint8 (1: row
// i sees key j), out [B, L, H, D]. D a multiple of 8.
// Built with qmatmul_cpu.cpp into one library (specviz.native).

#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // F16C: fp16 keys and values
#include <immintrin.h>
#define SPECVIZ_ATTENTION_AVX2 1
#include "vector_math.h"
#endif

namespace {

#ifdef SPECVIZ_ATTENTION_AVX2
using specviz_math::lanes_sum;
using specviz_math::lanes_sum8;

// Eight keys' or values' elements as fp32: fp32 as they are, fp16 widened (exactly: the same numbers as the fp32
// copy of an fp16 tensor, so the same bits downstream). fp16 halves what a pass reads where a caller keeps its
// keys and values so (Whisper's layer draft, over 1,500 encoder frames a layer).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Query heads taken together per pass over their key head's keys and values: each key and value vector loaded
// once serves HP heads (grouped-query attention: the target's 12 heads read 2 key heads). Only the schedule
// changes: every (head, key) score is the same chain of FMAs over d and the same reduction, every output slice
// the same sum over keys in order, so the same bits for any HP. Measured on the 2-core Zen 4, the target's 28
// layers (12 heads over 2 key heads, D = 128, ~600 keys), one head / two / three a pass: one row 2.41 / 2.20 /
// 2.10 ms, 3 rows 4.74 / 3.89 / 3.80, 8 rows 12.3 / 9.5 / 9.1 (docs/history.md). Three heads need 24
// accumulators, which AVX-512's 32 registers hold;
// AVX2's 16 would spill, so one head at a time there.
#if defined(__AVX512F__) && defined(__AVX512DQ__)  // the 512-bit passes below (DQ: 256-bit halves in and out)
#define SPECVIZ_ATTENTION_512 1
#endif
#ifdef __AVX512F__
constexpr int HEADS_PER_PASS = 3;
#else
constexpr int HEADS_PER_PASS = 1;
#endif
// The scores' 512-bit pass keeps 4 vectors a head (two keys each): six heads' 24 accumulators fit; so does the
// values' pass over heads of at most 64 elements (4 vectors a head: the draft's). The draft's 7 heads a key head
// took 43 GMAC/s at 4 rows (scores 6 + 1, values 3 + 3 + 1 heads a pass over L1-resident keys).
#ifdef SPECVIZ_ATTENTION_512
constexpr int SCORE_HEADS_PER_PASS = 6;
constexpr int NARROW_VALUE_HEADS_PER_PASS = 6;
#else
constexpr int SCORE_HEADS_PER_PASS = HEADS_PER_PASS;
constexpr int NARROW_VALUE_HEADS_PER_PASS = HEADS_PER_PASS;
#endif

// Reading ahead. A pass over keys (or values) that come from memory stalled on it: the target's 28 layers over 835
// keys read 48 MB at ~11 GB/s where one core streams ~30. A pass asks for the rows of the keys ~8 KB ahead of the
// one it reads, a few lines at a time spread over its work, following its own list of keys: one run of rows
// (causal masks, left padding) or runs with holes between them (a speculative run's cache keeps the slots of
// rejected drafts, masked: asking only for runs left the target's attention 26% slower in every step after a
// batch's first rejection, 13.4 against 10.6 ms a 4-row step on the Xeon). A pass over keys another pass just
// read (in L1) asks for nothing.
struct Ahead {
    const char* next = nullptr;     // the next line to ask for
    const char* end = nullptr;      // past the run of rows it lies in
    const char* base = nullptr;
    const int32_t* keys = nullptr;  // the keys after that run
    const int32_t* last = nullptr;  // past the pass's keys
    int64_t row = 0;                // bytes a row
    void lines(int count) {
        for (int u = 0; u < count; ++u, next += 64) {
            if (__builtin_expect(next >= end, 0) && !next_run()) return;
            _mm_prefetch(next, _MM_HINT_T0);
        }
    }
    // the next run of consecutive keys, at most 64 of them (a pass over one chunk asks for a few rows; its
    // successors find the rest), or false after the last
    __attribute__((noinline)) bool next_run() {
        if (keys >= last) return false;
        const int32_t* stop = last - keys > 64 ? keys + 64 : last;
        const int32_t* k = stop - 1;  // keys are increasing: the piece is one run where its ends say so
        if (*k - keys[0] != k - keys)
            for (k = keys; k + 1 < stop && k[1] == k[0] + 1;) ++k;
        next = base + static_cast<int64_t>(keys[0]) * row;
        end = base + (static_cast<int64_t>(k[0]) + 1) * row;
        keys = k + 1;
        return true;
    }
};

// for a pass over keys[0, n) of rows of D elements from base
template <typename KV>
inline Ahead ahead_for(const KV* base, const int32_t* keys, int64_t n, int64_t D) {
    const int64_t row = D * static_cast<int64_t>(sizeof(KV)), rows_ahead = row >= 8192 ? 1 : 8192 / row;
    if (n <= rows_ahead) return Ahead{};
    return Ahead{nullptr, nullptr, reinterpret_cast<const char*>(base), keys + rows_ahead, keys + n, row};
}

// scores s[h][t] = scale · q[h] · k[keys[t]] for HP heads, t < n (keys 8 at a time: eight independent chains of
// FMAs, their reductions side by side in lanes_sum's pairing; the rest one by one with lanes_sum)
#ifdef SPECVIZ_ATTENTION_512
// Two rows' 8 elements in one 512-bit vector (keys t and u, or 16 elements of one row for the values): the lanes
// hold the same numbers as two 256-bit loads.
inline __m512 load8x2(const float* lo, const float* hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(hi), 1);
}
inline __m512 load8x2(const uint16_t* lo, const uint16_t* hi) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

template <int HP, typename KV>
void scores(const float* const* q, const KV* kbase, const int32_t* keys, int64_t n, int64_t D, float scale,
            float* const* s, Ahead ahead) {
    int64_t t = 0;
#ifdef SPECVIZ_ATTENTION_512
    // 512-bit: keys 2p and 2p + 1 of a block side by side, each half the 256-bit path's chain of FMAs over d (the
    // same bits), half the instructions; on cores with two 512-bit FMA units, twice the multiply-adds a cycle
    for (; t + 8 <= n; t += 8) {
        __m512 a[HP][4];
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 4; ++c) a[h][c] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            ahead.lines(sizeof(KV));
            __m512 x[HP];
            for (int h = 0; h < HP; ++h) x[h] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[h] + d));
            for (int c = 0; c < 4; ++c) {
                const __m512 kv = load8x2(kbase + keys[t + 2 * c] * D + d, kbase + keys[t + 2 * c + 1] * D + d);
                for (int h = 0; h < HP; ++h) a[h][c] = _mm512_fmadd_ps(x[h], kv, a[h][c]);
            }
        }
        for (int h = 0; h < HP; ++h) {
            __m256 v[8];
            for (int c = 0; c < 4; ++c) {
                v[2 * c] = _mm512_castps512_ps256(a[h][c]);
                v[2 * c + 1] = _mm512_extractf32x8_ps(a[h][c], 1);
            }
            _mm256_storeu_ps(s[h] + t, _mm256_mul_ps(lanes_sum8(v), _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; t + 8 <= n; t += 8) {
        __m256 a[HP][8];
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 8; ++c) a[h][c] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            ahead.lines(sizeof(KV));  // a block's 8 rows are 8 · D · sizeof(KV) bytes over D / 8 steps
            __m256 x[HP];
            for (int h = 0; h < HP; ++h) x[h] = _mm256_loadu_ps(q[h] + d);
            for (int c = 0; c < 8; ++c) {
                const __m256 kv = load8(kbase + keys[t + c] * D + d);
                for (int h = 0; h < HP; ++h) a[h][c] = _mm256_fmadd_ps(x[h], kv, a[h][c]);
            }
        }
        for (int h = 0; h < HP; ++h) _mm256_storeu_ps(s[h] + t, _mm256_mul_ps(lanes_sum8(a[h]), _mm256_set1_ps(scale)));
    }
    for (; t < n; ++t) {
        const KV* kj = kbase + keys[t] * D;
        for (int h = 0; h < HP; ++h) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + d), load8(kj + d), acc);
            s[h][t] = lanes_sum(acc) * scale;
        }
    }
}

// s[0, n) → e^(s - max), zero in the padding up to a multiple of 8; returns 1 / their sum
float softmax_weights(float* s, int64_t n) {
    const int64_t padded = (n + 7) / 8 * 8;
    float m = s[0];
    int64_t t0 = 1;
#ifdef SPECVIZ_ATTENTION_512
    // 16 at a time: max(x, m) returns m where x is NaN, as the scalar fold below skips a NaN score; the maximum of
    // finite numbers is the same in any order
    if (n >= 32) {
        __m512 mv = _mm512_set1_ps(m);
        for (; t0 + 16 <= n; t0 += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + t0), mv);
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, mv);
        for (int l = 0; l < 16; ++l) m = lanes[l] > m ? lanes[l] : m;
    }
#endif
    for (int64_t t = t0; t < n; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = n; t < padded; ++t) s[t] = m;  // padding lanes: exp(0), masked out of the sum below
    __m256 total = _mm256_setzero_ps();
    int64_t start = 0;
#ifdef SPECVIZ_ATTENTION_512
    // 16 at a time, the two halves added to the 8-lane total in turn: the 8-wide loop's order, so its bits
    for (; start + 16 <= n; start += 16) {
        const __m512 e = specviz_math::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + start), _mm512_set1_ps(m)));
        _mm512_storeu_ps(s + start, e);
        total = _mm256_add_ps(_mm256_add_ps(total, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
    }
#endif
    for (int64_t t = start; t < padded; t += 8) {
        __m256 e = specviz_math::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m)));
        if (t + 8 > n) {
            alignas(32) int32_t keep[8];
            for (int l = 0; l < 8; ++l) keep[l] = t + l < n ? -1 : 0;
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(keep))));
        }
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
    }
    return 1.0f / lanes_sum(total);
}

// acc[h] += Σ_t s[h][t] · v[keys[t]] over t in [t0, t1) for HP heads, each acc[h] a [D] fp32 partial sum in memory
// (zero before a head's first keys): eight 8-wide slices of the output at a time, keys in order. Stopping after
// a chunk of keys and going on from the stored sums is the same chain of FMAs as one pass over all of them.
template <int HP, typename KV>
void weighted_values(const float* const* s, const KV* vbase, const int32_t* keys, int64_t t0, int64_t t1,
                     int64_t D, float* const* acc_out, Ahead ahead) {
    const int row_lines = static_cast<int>((D * static_cast<int64_t>(sizeof(KV)) + 63) / 64);
    int64_t d0 = 0;
#ifdef SPECVIZ_ATTENTION_512
    // 512-bit: 16 output elements a vector, each the 256-bit path's chain over t (the same bits); 128 elements a
    // pass, then 64
    auto pass = [&](auto width) {
        constexpr int C = decltype(width)::value;  // vectors of 16
        __m512 acc[HP][C];
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < C; ++c) acc[h][c] = _mm512_loadu_ps(acc_out[h] + d0 + 16 * c);
        for (int64_t t = t0; t < t1; ++t) {
            if (d0 == 0) ahead.lines(row_lines);
            __m512 w[HP];
            for (int h = 0; h < HP; ++h) w[h] = _mm512_set1_ps(s[h][t]);
            const KV* vj = vbase + keys[t] * D + d0;
            for (int c = 0; c < C; ++c) {
                const __m512 vv = load16(vj + 16 * c);
                for (int h = 0; h < HP; ++h) acc[h][c] = _mm512_fmadd_ps(w[h], vv, acc[h][c]);
            }
        }
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_out[h] + d0 + 16 * c, acc[h][c]);
        d0 += 16 * C;
    };
    while (d0 + 128 <= D) pass(std::integral_constant<int, 8>{});
    while (d0 + 64 <= D) pass(std::integral_constant<int, 4>{});
#endif
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[HP][8];
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 8; ++c) acc[h][c] = _mm256_loadu_ps(acc_out[h] + d0 + 8 * c);
        for (int64_t t = t0; t < t1; ++t) {
            if (d0 == 0) ahead.lines(row_lines);
            __m256 w[HP];
            for (int h = 0; h < HP; ++h) w[h] = _mm256_set1_ps(s[h][t]);
            const KV* vj = vbase + keys[t] * D + d0;
            for (int c = 0; c < 8; ++c) {
                const __m256 vv = load8(vj + 8 * c);
                for (int h = 0; h < HP; ++h) acc[h][c] = _mm256_fmadd_ps(w[h], vv, acc[h][c]);
            }
        }
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc_out[h] + d0 + 8 * c, acc[h][c]);
    }
    for (int64_t d = d0; d < D; d += 8)
        for (int h = 0; h < HP; ++h) {
            __m256 acc = _mm256_loadu_ps(acc_out[h] + d);
            for (int64_t t = t0; t < t1; ++t)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(s[h][t]), load8(vbase + keys[t] * D + d), acc);
            _mm256_storeu_ps(acc_out[h] + d, acc);
        }
}

// Keys per chunk when several rows share them: a chunk's keys (or values) are read from memory once and then
// serve every (row, head) of the block from L1 (32 keys × D = 128 fp32: 16 KB). Measured on the 2-core Zen 4,
// the target's 28 layers over 835 keys, with reading ahead, against one row a task that read its keys and
// values again: 1 / 4 / 8 rows 4.4–6.2 / 8.8–10.2 / 14.0–17.1 → 3.0–4.1 / 7.2–7.3 / 12.9–15.7 ms; the target's
// step at 1 / 4 / 8 tokens 0.98 / 0.96 / 0.97× (docs/benchmarks.md, "Attention over a long context").
constexpr int64_t CHUNK = 32;
constexpr int64_t ROWS_PER_TASK = 8;  // rows of one sequence taken together (a verification call's γ + 1)

// The queries of one task: `nq` (row, head) pairs over one key head, each with its own visible keys, its first
// `shared` of which are the same keys for all (a causal block's common prefix). Scores and the weighted values
// over the shared keys go chunk by chunk with every query inside a chunk; each query's own keys after them
// go on alone. Every (query, key) score and every output slice is the same chain of operations as one query
// alone over its keys, so the same bits whatever else a task holds.
struct Queries {
    explicit Queries(int64_t most) : q(most), s(most), acc(most), o(most), keys(most), n(most), inv(most) {}
    std::vector<const float*> q;
    std::vector<float*> s;    // scores, then the softmax's weights
    std::vector<float*> acc;  // [D] partial sums of the weighted values
    std::vector<float*> o;
    std::vector<const int32_t*> keys;
    std::vector<int64_t> n;
    std::vector<float> inv;
    int nq = 0;
};

// f(R, first query) for the `left` queries from g on, fewer than R + 1 of them: one pass of as many as there are
template <int R, typename F>
inline void rest(int left, int g, const F& f) {
    if constexpr (R >= 1) {
        if (left == R) return f(std::integral_constant<int, R>{}, g);
        rest<R - 1>(left, g, f);
    }
}

// f(HP, first query) over the queries HP at a time, then the rest in one pass (7 heads: 6 + 1, 14: 6 + 6 + 2)
template <int HP, typename F>
inline void by_groups(int nq, const F& f) {
    int g = 0;
    for (; g + HP <= nq; g += HP) f(std::integral_constant<int, HP>{}, g);
    rest<HP - 1>(nq - g, g, f);
}

template <typename KV>
void attend(Queries& Q, int64_t shared, const KV* kbase, const KV* vbase, int64_t D, float scale) {
    // scores: the shared keys chunk by chunk for every query, then each query's own
    for (int64_t c0 = 0; c0 < shared; c0 += CHUNK) {
        const int64_t len = shared - c0 < CHUNK ? shared - c0 : CHUNK;
        by_groups<SCORE_HEADS_PER_PASS>(Q.nq, [&](auto hp, int g) {
            constexpr int HP = decltype(hp)::value;
            float* sp[HP];
            for (int h = 0; h < HP; ++h) sp[h] = Q.s[g + h] + c0;
            // the chunk's first pass reads it from memory and the next chunk ahead; the others find it in L1
            scores<HP, KV>(Q.q.data() + g, kbase, Q.keys[g] + c0, len, D, scale, sp,
                           g == 0 ? ahead_for(kbase, Q.keys[g] + c0, shared - c0, D) : Ahead{});
        });
    }
    for (int i = 0; i < Q.nq; ++i) {
        if (Q.n[i] > shared) {
            float* sp[1] = {Q.s[i] + shared};
            scores<1, KV>(Q.q.data() + i, kbase, Q.keys[i] + shared, Q.n[i] - shared, D, scale, sp,
                          ahead_for(kbase, Q.keys[i] + shared, Q.n[i] - shared, D));
        }
        Q.inv[i] = softmax_weights(Q.s[i], Q.n[i]);
        memset(Q.acc[i], 0, sizeof(float) * D);
    }
    for (int64_t c0 = 0; c0 < shared; c0 += CHUNK) {
        const int64_t c1 = shared - c0 < CHUNK ? shared : c0 + CHUNK;
        auto pass = [&](auto hp, int g) {
            constexpr int HP = decltype(hp)::value;
            weighted_values<HP, KV>(Q.s.data() + g, vbase, Q.keys[g], c0, c1, D, Q.acc.data() + g,
                                    g == 0 ? ahead_for(vbase, Q.keys[g] + c0, shared - c0, D) : Ahead{});
        };
        if (D <= 64)
            by_groups<NARROW_VALUE_HEADS_PER_PASS>(Q.nq, pass);
        else
            by_groups<HEADS_PER_PASS>(Q.nq, pass);
    }
    for (int i = 0; i < Q.nq; ++i) {
        if (Q.n[i] > shared)
            weighted_values<1, KV>(Q.s.data() + i, vbase, Q.keys[i], shared, Q.n[i], D, Q.acc.data() + i,
                                   ahead_for(vbase, Q.keys[i] + shared, Q.n[i] - shared, D));
        const __m256 r = _mm256_set1_ps(Q.inv[i]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(Q.o[i] + d, _mm256_mul_ps(_mm256_loadu_ps(Q.acc[i] + d), r));
    }
}

template <typename KV>
void attention(const float* q, const KV* k, const KV* v, const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv,
               int64_t L, int64_t S, int64_t Sk, int64_t D, float scale, float* out, int nthreads) {
    const int64_t G = H / Hkv, blocks = (L + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const int64_t task_rows = L < ROWS_PER_TASK ? L : ROWS_PER_TASK;
    // each row's visible keys, in order (shared by its heads)
    std::vector<int32_t> keys(B * L * S);
    std::vector<int64_t> count(B * L);
    for (int64_t r = 0; r < B * L; ++r) {
        int64_t n = 0;
        for (int64_t j = 0; j < S; ++j)
            if (mask[r * S + j]) keys[r * S + n++] = static_cast<int32_t>(j);
        count[r] = n;
    }
    const int64_t padded = (S + 7) / 8 * 8;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> scores_buf(task_rows * G * padded), acc_buf(task_rows * G * D);
        Queries Q(task_rows * G);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * Hkv * blocks; ++task) {
            const int64_t b = task / (Hkv * blocks), kh = (task / blocks) % Hkv, i0 = (task % blocks) * ROWS_PER_TASK;
            const int64_t i1 = i0 + ROWS_PER_TASK < L ? i0 + ROWS_PER_TASK : L;
            Q.nq = 0;
            int64_t shared = -1;
            const int32_t* first = nullptr;
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t r = b * L + i, n = count[r];
                if (n == 0) {  // a row that sees nothing (a padding row): zeros, as it is never read
                    for (int64_t g = 0; g < G; ++g) memset(out + ((b * L + i) * H + kh * G + g) * D, 0, sizeof(float) * D);
                    continue;
                }
                const int32_t* ks = keys.data() + r * S;
                if (first == nullptr) {
                    first = ks;
                    shared = n;
                } else {
                    int64_t p = 0;
                    const int64_t lim = shared < n ? shared : n;
                    while (p < lim && ks[p] == first[p]) ++p;
                    shared = p;
                }
                for (int64_t g = 0; g < G; ++g) {
                    const int j = Q.nq++;
                    Q.q[j] = q + ((b * H + kh * G + g) * L + i) * D;
                    Q.s[j] = scores_buf.data() + j * padded;
                    Q.acc[j] = acc_buf.data() + j * D;
                    Q.o[j] = out + ((b * L + i) * H + kh * G + g) * D;
                    Q.keys[j] = ks;
                    Q.n[j] = n;
                }
            }
            if (Q.nq)
                attend<KV>(Q, shared, k + (b * Hkv + kh) * Sk * D, v + (b * Hkv + kh) * Sk * D, D, scale);
        }
    }
}
#endif

}  // namespace

extern "C" {

int specviz_has_attention() {
#ifdef SPECVIZ_ATTENTION_AVX2
    return 1;
#else
    return 0;
#endif
}

#ifdef SPECVIZ_ATTENTION_AVX2
void specviz_attention(const float* q, const float* k, const float* v, const uint8_t* mask, int64_t B, int64_t H,
                       int64_t Hkv, int64_t L, int64_t S, int64_t Sk, int64_t D, float scale, float* out,
                       int nthreads) {
    attention<float>(q, k, v, mask, B, H, Hkv, L, S, Sk, D, scale, out, nthreads);
}

// The same with fp16 keys and values (uint16 bits): the bits of specviz_attention on their fp32 copies.
void specviz_attention_f16kv(const float* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, int64_t B,
                             int64_t H, int64_t Hkv, int64_t L, int64_t S, int64_t Sk, int64_t D, float scale,
                             float* out, int nthreads) {
    attention<uint16_t>(q, k, v, mask, B, H, Hkv, L, S, Sk, D, scale, out, nthreads);
}
#endif

}  // extern "C"
