// Batch-invariant attention for the CPU: out[b, i, h] = softmax_j(scale · q[b, h, i] · k[b, h', j]) · v[b, h', j]
// over exactly the keys j that the mask lets row i see, in increasing j, whatever else is in the call.
//
// torch's scaled_dot_product_attention blocks queries and keys by the call's lengths, so a position's output
// moved by ~1e-6 between a call over 12 positions and one over 20: harmless for fp32 logits, but enough for
// 8-bit activations (specviz.models.packed) to round a code the other way. Here each (sequence, head, row) is one
// task that walks its own keys in order: the same operations for a row in a prefill, in a verification call
// of γ + 1 rows beside other sequences, or alone; only the set of keys it may see (the mask) decides.
//
// Layouts (fp32; k and v also fp16, specviz_attention_f16kv): q [B, H, L, D] contiguous; k and v the first S
// positions of [B, Hkv, Sk, D] contiguous buffers
// (Sk = S for plain tensors; H a multiple of Hkv: grouped queries share a key head), mask [B, L, S] uint8 (1: row
// i sees key j), out [B, L, H, D]. D a multiple of 8.
// Built with qmatmul_cpu.cpp into one library (specviz.native).

#include <stdint.h>
#include <string.h>
#include <omp.h>
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
#ifdef __AVX512F__
constexpr int HEADS_PER_PASS = 3;
#else
constexpr int HEADS_PER_PASS = 1;
#endif

// scores s[h][t] = scale · q[h] · k[keys[t]] for HP heads, t < n (keys 8 at a time: eight independent chains of
// FMAs, their reductions side by side in lanes_sum's pairing; the rest one by one with lanes_sum)
template <int HP, typename KV>
void scores(const float* const* q, const KV* kbase, const int32_t* keys, int64_t n, int64_t D, float scale,
            float* const* s) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 a[HP][8];
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 8; ++c) a[h][c] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
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
    for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
    for (int64_t t = n; t < padded; ++t) s[t] = m;  // padding lanes: exp(0), masked out of the sum below
    __m256 total = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
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

// o[h] = inv[h] · Σ_t s[h][t] · v[keys[t]] for HP heads: eight 8-wide slices of the output at a time, keys in the
// outer loop (eight chains instead of one, each slice summed over the keys in the same order as alone)
template <int HP, typename KV>
void weighted_values(const float* const* s, const float* inv, const KV* vbase, const int32_t* keys, int64_t n,
                     int64_t D, float* const* o) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 acc[HP][8];
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 8; ++c) acc[h][c] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; ++t) {
            __m256 w[HP];
            for (int h = 0; h < HP; ++h) w[h] = _mm256_set1_ps(s[h][t]);
            const KV* vj = vbase + keys[t] * D + d0;
            for (int c = 0; c < 8; ++c) {
                const __m256 vv = load8(vj + 8 * c);
                for (int h = 0; h < HP; ++h) acc[h][c] = _mm256_fmadd_ps(w[h], vv, acc[h][c]);
            }
        }
        for (int h = 0; h < HP; ++h)
            for (int c = 0; c < 8; ++c)
                _mm256_storeu_ps(o[h] + d0 + 8 * c, _mm256_mul_ps(acc[h][c], _mm256_set1_ps(inv[h])));
    }
    for (int64_t d = d0; d < D; d += 8)
        for (int h = 0; h < HP; ++h) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; ++t)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(s[h][t]), load8(vbase + keys[t] * D + d), acc);
            _mm256_storeu_ps(o[h] + d, _mm256_mul_ps(acc, _mm256_set1_ps(inv[h])));
        }
}

// HP heads g0 … of row i, sequence b, whose keys and values are key head kh's
template <int HP, typename KV>
void heads(const float* q, const KV* kbase, const KV* vbase, const int32_t* keys, int64_t n, int64_t b,
           int64_t g0, int64_t h0, int64_t i, int64_t H, int64_t L, int64_t D, float scale, float* out,
           float* scores_buf) {
    const int64_t padded = (n + 7) / 8 * 8;
    const float* qh[HP];
    float* sh[HP];
    float* oh[HP];
    float inv[HP];
    for (int h = 0; h < HP; ++h) {
        qh[h] = q + ((b * H + h0 + g0 + h) * L + i) * D;
        sh[h] = scores_buf + (g0 + h) * padded;
        oh[h] = out + ((b * L + i) * H + h0 + g0 + h) * D;
    }
    scores<HP, KV>(qh, kbase, keys, n, D, scale, sh);
    for (int h = 0; h < HP; ++h) inv[h] = softmax_weights(sh[h], n);
    weighted_values<HP, KV>(sh, inv, vbase, keys, n, D, oh);
}

// One row i of sequence b for the G query heads [h0, h0 + G) that share key head kh. Keys and values are read
// from rows of Sk positions (Sk ≥ S: a KV cache's preallocated buffer, of which the first S are in use).
template <typename KV>
void row(const float* q, const KV* k, const KV* v, const int32_t* keys, int64_t n, int64_t b, int64_t h0,
         int64_t G, int64_t kh, int64_t i, int64_t H, int64_t Hkv, int64_t L, int64_t Sk, int64_t D, float scale,
         float* out, float* scores_buf) {
    const KV* kbase = k + (b * Hkv + kh) * Sk * D;
    const KV* vbase = v + (b * Hkv + kh) * Sk * D;
    int64_t g = 0;
    for (; g + HEADS_PER_PASS <= G; g += HEADS_PER_PASS)
        heads<HEADS_PER_PASS, KV>(q, kbase, vbase, keys, n, b, g, h0, i, H, L, D, scale, out, scores_buf);
    for (; g < G; ++g) heads<1, KV>(q, kbase, vbase, keys, n, b, g, h0, i, H, L, D, scale, out, scores_buf);
}

template <typename KV>
void attention(const float* q, const KV* k, const KV* v, const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv,
               int64_t L, int64_t S, int64_t Sk, int64_t D, float scale, float* out, int nthreads) {
    const int64_t G = H / Hkv;
    // each row's visible keys, in order (shared by its heads)
    std::vector<int32_t> keys(B * L * S);
    std::vector<int64_t> count(B * L);
    for (int64_t r = 0; r < B * L; ++r) {
        int64_t n = 0;
        for (int64_t j = 0; j < S; ++j)
            if (mask[r * S + j]) keys[r * S + n++] = static_cast<int32_t>(j);
        count[r] = n;
    }
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> scores(G * ((S + 7) / 8 * 8));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * Hkv * L; ++task) {
            const int64_t b = task / (Hkv * L), kh = (task / L) % Hkv, i = task % L, r = b * L + i;
            if (count[r] == 0) {  // a row that sees nothing (a padding row): zeros, as it is never read
                for (int64_t g = 0; g < G; ++g) memset(out + ((b * L + i) * H + kh * G + g) * D, 0, sizeof(float) * D);
                continue;
            }
            row<KV>(q, k, v, keys.data() + r * S, count[r], b, kh * G, G, kh, i, H, Hkv, L, Sk, D, scale, out,
                    scores.data());
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
