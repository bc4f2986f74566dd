// Weight-only quantized matrix multiply for the CPU: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), W read in its
// compressed form and never materialized in fp32 beyond one small slice per thread.
//
// Formats (row-major over N, elements in their natural order along K):
//   q4: two elements per byte (element 2i in the low nibble, 2i + 1 in the high one), w = scale[g] * q -
//       min[g] with q in 0..15, groups of 32 (GGUF Q4_K, its two-level scales multiplied out: exact in fp32).
//   q8: int8, w = scale[g] * q, groups of 16 or 32 (GGUF Q6_K, Q5_0, Q8_0 with their offsets folded in).
//
// Unpacking without shuffles: a 32-byte load is eight 32-bit lanes; lane j of a q4 block of 64 holds
// elements 8j .. 8j + 7 in its nibbles, so (lanes >> 4t) & 15 is element 8j + t in lane j, one shift and
// one and per 8 weights (q8: lane j holds elements 4j .. 4j + 3, sign-extended by two shifts). The weights
// come out in a permuted order within each block, and x is permuted the same way once per call, so the
// dot products pair the right elements.
//
// Batch invariance is the contract: every output row is computed by the same sequence of floating-point
// operations whatever M is and whichever other rows share the call or the thread. Rows are blocked only
// to reuse a dequantized slice; each (row, column) keeps one 8-lane accumulator, walks K in the same order
// and is reduced in a fixed order. Threads split N, never K. Any M goes through the same code.
//
// Built once per machine by specviz.native with -march=native and OpenMP (the same libgomp torch
// loads, so the two share one thread pool).

#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // F16C: HalfQ4's fp16 scales
#include <immintrin.h>
#define SPECVIZ_AVX2 1
#endif
#if defined(__AMX_INT8__) && defined(__linux__)
#include <atomic>
#include "amx.h"
#endif

namespace {

constexpr int64_t SLICE = 256;  // elements of K dequantized at a time per column (NB columns: 4 KB, in L1)

// ---- block layouts: position p = t * 8 + j of a block holds element lane_width * j + t --------------

constexpr int64_t Q4_BLOCK = 64, Q4_PER_LANE = 8;  // 32 bytes, 8 nibbles per 32-bit lane
constexpr int64_t Q8_BLOCK = 32, Q8_PER_LANE = 4;  // 32 bytes, 4 bytes per 32-bit lane

// x [M, K] -> xp [M, K] in the blocks' permuted order
void permute_rows(const float* x, int64_t M, int64_t K, int64_t block, int64_t per_lane, float* xp) {
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < K; b += block)
            for (int64_t t = 0; t < per_lane; ++t)
                for (int64_t j = 0; j < 8; ++j) xp[r * K + b + t * 8 + j] = x[r * K + b + per_lane * j + t];
}

// ---- the weight formats: a block of one weight row unpacked part by part, in permuted order ----------
// Part t of a block is 8 weights (lane j: element per_lane * j + t). The register path (M <= 2) uses the
// parts directly; the slice path stores them (dequant) for several rows to share. Both run the same
// operations, so a row's result does not depend on which path ran.

#ifdef SPECVIZ_AVX2
struct Q4Format {
    const uint8_t* q; const float* scale; const float* minv; int64_t K;
    static constexpr int64_t BLOCK = Q4_BLOCK;
    static constexpr int PARTS = 8;
    struct Block { __m256i lanes; __m256 s, m; };
    Block load(int64_t n, int64_t b) const {  // lanes 0-3 are group g, lanes 4-7 group g + 1
        const int64_t g = n * (K / 32) + b / 32;
        return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n * K + b) / 2)),
                _mm256_set_m128(_mm_set1_ps(scale[g + 1]), _mm_set1_ps(scale[g])),
                _mm256_set_m128(_mm_set1_ps(minv[g + 1]), _mm_set1_ps(minv[g]))};
    }
    const char* addr(int64_t n, int64_t b) const { return reinterpret_cast<const char*>(q + (n * K + b) / 2); }
    static __m256 part(const Block& blk, int t) {
        const __m256i v = _mm256_and_si256(_mm256_srli_epi32(blk.lanes, 4 * t), _mm256_set1_epi32(15));
        return _mm256_fmsub_ps(_mm256_cvtepi32_ps(v), blk.s, blk.m);
    }
};

template <int64_t GROUP>
struct Q8Format {
    const int8_t* q; const float* scale; int64_t K;
    static constexpr int64_t BLOCK = Q8_BLOCK;
    static constexpr int PARTS = 4;
    struct Block { __m256i lanes; __m256 s; };
    Block load(int64_t n, int64_t b) const {  // group 16: lanes 0-3 are one group, 4-7 the next
        const float* row = scale + n * (K / GROUP);
        return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * K + b)),
                _mm256_set_m128(_mm_set1_ps(row[(b + 16) / GROUP]), _mm_set1_ps(row[b / GROUP]))};
    }
    const char* addr(int64_t n, int64_t b) const { return reinterpret_cast<const char*>(q + n * K + b); }
    static __m256 part(const Block& blk, int t) {
        const __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(blk.lanes, 24 - 8 * t), 24);
        return _mm256_mul_ps(_mm256_cvtepi32_ps(v), blk.s);
    }
};

// [k0, k0 + len) of weight row n into w
template <typename Format>
inline void dequant(const Format& f, int64_t n, int64_t k0, int64_t len, float* w) {
    for (int64_t b = k0; b < k0 + len; b += Format::BLOCK, w += Format::BLOCK) {
        const typename Format::Block blk = f.load(n, b);
        for (int t = 0; t < Format::PARTS; ++t) _mm256_storeu_ps(w + t * 8, Format::part(blk, t));
    }
}
#else
// The portable build: the same values and order, one element at a time.
struct Q4Format {
    const uint8_t* q; const float* scale; const float* minv; int64_t K;
};

template <int64_t GROUP>
struct Q8Format {
    const int8_t* q; const float* scale; int64_t K;
};

inline void dequant(const Q4Format& f, int64_t n, int64_t k0, int64_t len, float* w) {
    for (int64_t b = k0; b < k0 + len; b += Q4_BLOCK, w += Q4_BLOCK)
        for (int t = 0; t < 8; ++t)
            for (int j = 0; j < 8; ++j) {
                const int64_t e = n * f.K + b + 8 * j + t, g = e / 32;
                const int v = (f.q[e / 2] >> (4 * (e & 1))) & 15;
                w[t * 8 + j] = __builtin_fmaf(static_cast<float>(v), f.scale[g], -f.minv[g]);
            }
}

template <int64_t GROUP>
inline void dequant(const Q8Format<GROUP>& f, int64_t n, int64_t k0, int64_t len, float* w) {
    for (int64_t b = k0; b < k0 + len; b += Q8_BLOCK, w += Q8_BLOCK)
        for (int t = 0; t < 4; ++t)
            for (int j = 0; j < 8; ++j) {
                const int64_t e = n * f.K + b + 4 * j + t;
                w[t * 8 + j] = static_cast<float>(f.q[e]) * f.scale[e / GROUP];
            }
}
#endif

// ---- the tile: acc[m][n] (8 lanes each) += x[m, k0 : k0 + len] · w[n] for MT rows × NB columns -------

// Each (row, column) output accumulates in one vector of 8 lanes. Tile shape MT rows × NB columns: 2 × 4
// keeps its 8 accumulators, 4 weights and an input in registers (gcc spills 3 × 4). Measured on a 2-core
// AMD EPYC (AVX2), variants interleaved in one process, weights streamed from DRAM, M = 1, 2, 4, 8: two
// accumulators per output (2 × 2 or 1 × 4 tiles) gain 10-20% at M = 1 and lose 20-40% at M = 8; 3 × 3
// tiles and 4 columns at a time in the register path gain nothing.
constexpr int NB = 4;  // output columns per tile (their dequantized slices share the x loads)

template <int MT>
inline void tile(const float* x, int64_t ldx, int64_t k0, int64_t len, const float* w, float* acc) {
#ifdef SPECVIZ_AVX2
    __m256 a[MT][NB];
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NB; ++n) a[m][n] = _mm256_loadu_ps(acc + (m * NB + n) * 8);
    for (int64_t i = 0; i < len; i += 8) {
        __m256 wv[NB];
        for (int n = 0; n < NB; ++n) wv[n] = _mm256_loadu_ps(w + n * SLICE + i);
        for (int m = 0; m < MT; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + k0 + i);
            for (int n = 0; n < NB; ++n) a[m][n] = _mm256_fmadd_ps(xv, wv[n], a[m][n]);
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NB; ++n) _mm256_storeu_ps(acc + (m * NB + n) * 8, a[m][n]);
#else
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NB; ++n)
            for (int64_t i = 0; i < len; i += 8)
                for (int l = 0; l < 8; ++l) {
                    float& a = acc[(m * NB + n) * 8 + l];
                    a = __builtin_fmaf(x[m * ldx + k0 + i + l], w[n * SLICE + i + l], a);
                }
#endif
}

// the fixed-order reduction of one output's 8 lanes
inline float reduce(const float* v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

constexpr int64_t MAX_ROWS = 256;  // rows per call held in the per-thread accumulators (callers split beyond)
constexpr int MT_MAX = 2;          // rows per tile

// Columns [n0, n0 + NB) (the last tile may hold fewer real ones) for all M rows.
template <typename Format>
void columns(const float* x, int64_t M, int64_t K, int64_t n0, int64_t N, const Format& f, const float* bias,
             float* y, float* w, float* acc) {
    const int nb = N - n0 < NB ? static_cast<int>(N - n0) : NB;
    memset(acc, 0, sizeof(float) * M * NB * 8);
    if (nb < NB) memset(w, 0, sizeof(float) * NB * SLICE);
    for (int64_t k0 = 0; k0 < K; k0 += SLICE) {
        const int64_t len = K - k0 < SLICE ? K - k0 : SLICE;
        for (int n = 0; n < nb; ++n) dequant(f, n0 + n, k0, len, w + n * SLICE);
        int64_t m = 0;
        for (; m + MT_MAX <= M; m += MT_MAX) tile<MT_MAX>(x + m * K, K, k0, len, w, acc + m * NB * 8);
        if (m < M) tile<1>(x + m * K, K, k0, len, w, acc + m * NB * 8);  // the odd row: the same operations
    }
    for (int64_t m = 0; m < M; ++m)
        for (int n = 0; n < nb; ++n) y[m * N + n0 + n] = reduce(acc + (m * NB + n) * 8) + (bias ? bias[n0 + n] : 0.0f);
}

template <typename Format>
void matmul(const float* x, int64_t M, int64_t K, int64_t N, const float* bias, float* y, int nthreads,
            const Format& f) {
#pragma omp parallel num_threads(nthreads)
    {
        alignas(64) float w[NB * SLICE];
        alignas(64) float acc[MAX_ROWS * NB * 8];
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += NB) columns(x, M, K, n0, N, f, bias, y, w, acc);
    }
}

#ifdef SPECVIZ_AVX2
// ---- small M (<= 2 rows): dequantize in registers, no slice buffer --------------------------------

constexpr int NB_SMALL = 2;  // columns per pass when dequantizing in registers
// Elements ahead to prefetch along a weight row: streaming weights from DRAM at M = 1, 2048 took a q8 step
// from 1.74 to 1.29 ms (8960 × 1536, weights beyond the L3; 512 and 1024 gained less).
constexpr int64_t PREFETCH = 2048;

template <int MT, typename Format>
void small_columns(const float* xp, int64_t K, int64_t n0, int64_t N, const Format& f, const float* bias, float* y) {
    const int nb = N - n0 < NB_SMALL ? static_cast<int>(N - n0) : NB_SMALL;
    __m256 acc[MT][NB_SMALL];
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NB_SMALL; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K; b += Format::BLOCK) {
        typename Format::Block blk[NB_SMALL];
        for (int n = 0; n < nb; ++n) {
            _mm_prefetch(f.addr(n0 + n, b + PREFETCH), _MM_HINT_T0);  // past a row's end: the next rows
            blk[n] = f.load(n0 + n, b);
        }
        for (int t = 0; t < Format::PARTS; ++t)
            for (int n = 0; n < nb; ++n) {
                const __m256 w = Format::part(blk[n], t);
                for (int m = 0; m < MT; ++m)
                    acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + m * K + b + t * 8), w, acc[m][n]);
            }
    }
    alignas(32) float lanes[8];
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < nb; ++n) {
            _mm256_store_ps(lanes, acc[m][n]);
            y[m * N + n0 + n] = reduce(lanes) + (bias ? bias[n0 + n] : 0.0f);
        }
}

template <typename Format>
void small_matmul(const float* xp, int64_t M, int64_t K, int64_t N, const float* bias, float* y, int nthreads,
                  const Format& f) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB_SMALL) {
        if (M == 1) small_columns<1>(xp, K, n0, N, f, bias, y);
        else small_columns<2>(xp, K, n0, N, f, bias, y);
    }
}
#endif

// Either path for one call: registers for up to 2 rows where AVX2 is built, slices otherwise.
template <typename Format>
void run(const float* xp, int64_t M, int64_t K, int64_t N, const float* bias, float* y, int nthreads, const Format& f) {
#ifdef SPECVIZ_AVX2
    if (M <= 2) return small_matmul(xp, M, K, N, bias, y, nthreads, f);
#endif
    matmul(xp, M, K, N, bias, y, nthreads, f);
}

#ifdef SPECVIZ_AVX2
// ---- 8-bit activations: integer dot products, eight output columns per vector ---------------------------------
// Each row of x is quantized on its own, per group of 32 elements along K: d = max|x| / 127, code =
// round(x / d) in -127..127. A row's codes and scales depend on that row alone, so batch invariance holds as
// with fp32 activations. q4's subtracted minimum multiplies the group's exact fp32 sum of x, so only the q·x
// part carries the activation rounding. A NaN or infinity in a group makes its outputs NaN, as fp32 would.
//
// The weights are stored interleaved for these kernels (specviz_q4_interleave / specviz_q8_interleave, once at
// load): eight output columns side by side, 4 bytes of each per 32-byte vector, so one vpdpbusd with four
// activation codes broadcast computes 4 multiply-adds for each of eight columns, and lane l of every vector
// belongs to column l. A group's exact integer sum then needs no reduction across lanes, and the float step
// (convert, scale, accumulate) is paid once per group of 32 for eight columns instead of once per 4 weights
// and column: measured on the 2-core Zen 4, the q4 gate projection (8960 × 1536) at 256 rows 27 → 13 ms, at 8
// rows 0.94 → 0.62 ms, at one row 0.49 → 0.32 ms (the column-major stream prefetches better); docs/history.md.
//   q4: [N8, K/8, 8, 4] bytes (N8 = ceil(N / 8) blocks of 8 columns): in chunk j, byte i of column l holds element
//       8j + i in its low nibble and 8j + 4 + i in its high one; scale and minv [N8, K/32, 8].
//   q8: [N8, K/4, 8, 4] bytes, w + 128 (unsigned, for vpdpbusd: Σ(w + 128)·c = Σ w·c + 128 Σ c, and the
//       codes' integer sums per 16 are kept to take that back off); scale [N8, K/group, 8].
// Every output column is its own fp32 lane: acc = fma(float(integer sum of group g), w_scale · x_scale, acc)
// (q4: then acc -= minv · sum of x), groups in order along K, whatever the tile; the same operations for a
// row whatever M is and whichever rows or columns share its tile.

struct Act {                    // one call's activations, quantized
    std::vector<int8_t> q;      // [M, K] codes, in natural order
    std::vector<float> d;       // [M, K/32] the groups' scales
    std::vector<float> sum;     // [M, K/32] the groups' fp32 sums of x (q4's minimum term)
    std::vector<int32_t> csum;  // [M, K/16] the codes' integer sums per 16 (q8's unsigned offset)
};

// One group of 32: its scale, its fp32 sum (a fixed tree: four 8-lane partial sums, added pairwise, then the
// lanes pairwise; the same for every row whatever the call), its codes and their sums per 16.
inline void quantize_group(const float* v, float* d_out, float* sum_out, int8_t* codes, int32_t* halves) {
    const __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8), x2 = _mm256_loadu_ps(v + 16),
                 x3 = _mm256_loadu_ps(v + 24);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
    __m256 t = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    t4 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    t4 = _mm_add_ss(t4, _mm_movehdup_ps(t4));
    const float amax = _mm_cvtss_f32(m4), s = _mm_cvtss_f32(t4);
    const bool finite = __builtin_isfinite(s) && __builtin_isfinite(amax);
    const float d = finite ? amax / 127.0f : __builtin_nanf("");
    const float inv = finite && d > 0.0f ? 1.0f / d : 0.0f;
    *d_out = d;
    *sum_out = finite ? s : __builtin_nanf("");
    const __m256 scale = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    auto code = [&](__m256 x) {  // round half to even, then clamp (a group with a NaN or an infinity: zeros, below)
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    };
    __m256i c0 = code(x0), c1 = code(x1), c2 = code(x2), c3 = code(x3);
    if (!finite) c0 = c1 = c2 = c3 = _mm256_setzero_si256();
    const __m256i w01 = _mm256_packs_epi32(c0, c1), w23 = _mm256_packs_epi32(c2, c3);  // int16, lanes interleaved
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), b);
    auto hsum = [](__m256i v) {
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4e));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1));
        return _mm_cvtsi128_si32(q);
    };
    halves[0] = hsum(_mm256_add_epi32(c0, c1));
    halves[1] = hsum(_mm256_add_epi32(c2, c3));
}

void quantize(const float* x, int64_t M, int64_t K, int nthreads, Act& a) {
    const int64_t G = K / 32;
    a.q.resize(M * K);
    a.d.resize(M * G);
    a.sum.resize(M * G);
    a.csum.resize(M * (K / 16));
    // ~20 ns a group on one thread (2-core Zen 4; the scalar loop before took ~80): a call under 512 groups
    // (a step's rows, ~10 µs) stays on the calling thread, larger ones are split
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * G >= 512)
    for (int64_t i = 0; i < M * G; ++i)
        quantize_group(x + i * 32, &a.d[i], &a.sum[i], &a.q[i * 32], &a.csum[2 * i]);
}

// Integer dot products of unsigned 8-bit weights with signed 8-bit codes, four products summed per 32-bit
// lane. With VNNI one vpdpbusd does it; without, vpmaddubsw sums pairs into int16 and vpmaddwd with ones sums
// those. Both give the exact integer sums, so a build with VNNI computes the same bits as one without.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECVIZ_VNNI 1
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define SPECVIZ_VNNI 1
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
// a pair of products inside int16: q4 |15 · 127| · 2, q8 (sign moved to the codes) |128 · 127| · 2 = 32,512
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// q8's stored w + 128 times the codes. With VNNI: vpdpbusd on the stored bytes (the 128 Σ c comes off per
// group, `q8_offset`). Without: (w + 128) · c could overflow vpmaddubsw's int16 pairs (159 · 127 · 2), so the
// sign moves to the codes instead (|w| ≤ 128, |c| ≤ 127: a pair ≤ 32,512) and nothing comes off.
inline __m256i q8_dot_add(__m256i acc, __m256i stored, __m256i codes) {
#ifdef SPECVIZ_VNNI
    return dot4_add(acc, stored, codes);
#else
    const __m256i w = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
    return dot4_add(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(codes, w));
#endif
}

inline int32_t q8_offset(int32_t code_sum) {
#ifdef SPECVIZ_VNNI
    return 128 * code_sum;
#else
    (void)code_sum;
    return 0;
#endif
}

inline __m256i broadcast4(const int8_t* p) {  // four codes into every lane
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

struct A8Out {  // where a tile's results go
    float* y; int64_t N; const float* bias;
    void store(int64_t row, int64_t block, __m256 acc) const {  // columns 8·block … of row, those < N
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc);
        for (int l = 0; l < 8 && block * 8 + l < N; ++l)
            y[row * N + block * 8 + l] = lanes[l] + (bias ? bias[block * 8 + l] : 0.0f);
    }
};

// A group's scales for the eight columns of a block, one fp32 lane each. Two layouts, the same numbers:
//   Flat: fp32 per group, scale / minv [N8, G, 8] (any q4 or q8 weight); Half: the same in fp16 where fp16
//   holds every scale exactly (q4; the 4-bit draft's, rounded so when it is quantized): 5 bits a weight.
//   Super: the GGUF k-quants' own two levels, an integer per group times an fp32 per 256 elements: q4 (Q4_K)
//   sub [N8, G, 2, 8] uint8 (scale, minimum) and sup [N8, G/8, 2, 8] fp32 (d, dmin); q8 (Q6_K, groups of 16)
//   sub [N8, G, 8] int8 and sup [N8, G/16, 8]. float(integer) · fp32 is the flat scale exactly (at most 17 and
//   19 significant bits; checked when packing), so both give the same bits; Super reads 3 bytes of scales per 32
//   weights instead of 8 (q4: 4.75 bits a weight instead of 6), 2.5 instead of 8 for Q6_K (8.6 bits instead of 10).
struct FlatQ4 {
    const float* scale; const float* minv; int64_t G;
    __m256 s(int64_t blk, int64_t g) const { return _mm256_loadu_ps(scale + (blk * G + g) * 8); }
    __m256 m(int64_t blk, int64_t g) const { return _mm256_loadu_ps(minv + (blk * G + g) * 8); }
};
struct HalfQ4 {  // as FlatQ4, the scales and minimums stored as fp16 (where fp16 holds them exactly: the 4-bit draft)
    const uint16_t* scale; const uint16_t* minv; int64_t G;
    __m256 s(int64_t blk, int64_t g) const { return half8(scale + (blk * G + g) * 8); }
    __m256 m(int64_t blk, int64_t g) const { return half8(minv + (blk * G + g) * 8); }
    static __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
struct SuperQ4 {
    const uint8_t* sub; const float* sup; int64_t G;
    __m256 part(int64_t blk, int64_t g, int which) const {
        const __m128i ints = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + ((blk * G + g) * 2 + which) * 8));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ints)),
                             _mm256_loadu_ps(sup + ((blk * (G / 8) + g / 8) * 2 + which) * 8));
    }
    __m256 s(int64_t blk, int64_t g) const { return part(blk, g, 0); }
    __m256 m(int64_t blk, int64_t g) const { return part(blk, g, 1); }
};
struct FlatQ8 {
    const float* scale; int64_t G;
    __m256 s(int64_t blk, int64_t g) const { return _mm256_loadu_ps(scale + (blk * G + g) * 8); }
};
struct SuperQ8 {  // groups of 16 (Q6_K)
    const int8_t* sub; const float* sup; int64_t G;
    __m256 s(int64_t blk, int64_t g) const {
        const __m128i ints = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + (blk * G + g) * 8));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ints)),
                             _mm256_loadu_ps(sup + (blk * (G / 16) + g / 16) * 8));
    }
};

// The tiles' vectors. Lanes8: one block of eight columns per 256-bit vector. Lanes16 (AVX-512 with VNNI, BW and
// DQ): two neighbouring blocks, sixteen columns, per 512-bit vector. Every lane runs the same operations either
// way (exact integer sums, then the same float steps), so the two give the same bits; the wide one issues half
// the instructions for the same lanes: measured on the 2-core Zen 4, the fused gate and up projection
// (17920 × 1536, q4 two-level) at 8 rows 1.00 → 0.84 ms, at 16 rows 2.12 → 1.72 ms (docs/benchmarks.md). A
// vector's blocks lie `stride` bytes apart.
struct Lanes8 {
    using I = __m256i;
    using F = __m256;
    static constexpr int BLOCKS = 1;
    static I zero() { return _mm256_setzero_si256(); }
    static F zerof() { return _mm256_setzero_ps(); }
    static I load(const uint8_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    // The next tile's weights into L2, not L1: L2 keeps more misses in flight while the core computes, and its
    // latency hides under a tile's work. The target's step on the 2-core Zen 4 (kernel_ab, 24–30 rounds each, four
    // runs) at 1 / 4 / 8 tokens: 0.83–0.91 / 0.93–0.96 / 0.96–0.98× the L1 hint's; two tiles ahead lost at 8.
    static void prefetch(const uint8_t* p, int64_t) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
    static I nibbles() { return _mm256_set1_epi8(15); }
    static I low(I v, I mask) { return _mm256_and_si256(v, mask); }
    static I high(I v, I mask) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), mask); }
    static I codes4(const int8_t* p) { return broadcast4(p); }
    static I set1(int32_t v) { return _mm256_set1_epi32(v); }
    static I dot(I acc, I u, I s) { return dot4_add(acc, u, s); }
    static I q8dot(I acc, I stored, I codes) { return q8_dot_add(acc, stored, codes); }
    static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
    static F set1f(float v) { return _mm256_set1_ps(v); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    template <typename Get> static F per_block(Get get, int64_t blk) { return get(blk); }
    static void store(const A8Out& out, int64_t row, int64_t blk, F v) { out.store(row, blk, v); }
};

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SPECVIZ_LANES16 1
struct Lanes16 {
    using I = __m512i;
    using F = __m512;
    static constexpr int BLOCKS = 2;
    static I zero() { return _mm512_setzero_si512(); }
    static F zerof() { return _mm512_setzero_ps(); }
    static I load(const uint8_t* p, int64_t stride) {
        return _mm512_inserti64x4(_mm512_castsi256_si512(Lanes8::load(p, 0)), Lanes8::load(p + stride, 0), 1);
    }
    static void prefetch(const uint8_t* p, int64_t stride) {
        Lanes8::prefetch(p, 0);
        Lanes8::prefetch(p + stride, 0);
    }
    static I nibbles() { return _mm512_set1_epi8(15); }
    static I low(I v, I mask) { return _mm512_and_si512(v, mask); }
    static I high(I v, I mask) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), mask); }
    static I codes4(const int8_t* p) {
        int32_t v;
        memcpy(&v, p, 4);
        return _mm512_set1_epi32(v);
    }
    static I set1(int32_t v) { return _mm512_set1_epi32(v); }
    static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
    static I q8dot(I acc, I stored, I codes) { return _mm512_dpbusd_epi32(acc, stored, codes); }  // VNNI: as q8_dot_add
    static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
    static F set1f(float v) { return _mm512_set1_ps(v); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    template <typename Get> static F per_block(Get get, int64_t blk) {
        return _mm512_insertf32x8(_mm512_castps256_ps512(get(blk)), get(blk + 1), 1);
    }
    static void store(const A8Out& out, int64_t row, int64_t blk, F v) {
        out.store(row, blk, _mm512_castps512_ps256(v));
        out.store(row, blk + 1, _mm512_extractf32x8_ps(v, 1));
    }
};
#endif

// MT rows × NT vectors of V::BLOCKS blocks of eight columns, rows m0 …, blocks b0 …
template <int MT, int NT, typename V, typename Scales>
void q4a8_tile(const uint8_t* q, const Scales& scales, int64_t K, const Act& a, int64_t m0, int64_t b0,
               const A8Out& out) {
    using I = typename V::I;
    using F = typename V::F;
    const int64_t G = K / 32, stride = K * 4, span = V::BLOCKS * stride;  // a block's bytes; a vector's blocks'
    const I nibble = V::nibbles();
    F acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) acc[m][n] = V::zerof();
    const uint8_t* w = q + b0 * stride;  // the tile's blocks lie one after another
    const int8_t* x = a.q.data() + m0 * K;
    for (int64_t g = 0; g < G; ++g) {
        I sums[MT][NT];
        for (int m = 0; m < MT; ++m)
            for (int n = 0; n < NT; ++n) sums[m][n] = V::zero();
        for (int64_t j = 4 * g; j < 4 * g + 4; ++j) {  // chunks of 8 elements
            I lo[NT], hi[NT];
            for (int n = 0; n < NT; ++n) {
                const uint8_t* at = w + n * span + j * 32;
                V::prefetch(at + NT * span, stride);  // the next tile's
                const I v = V::load(at, stride);
                lo[n] = V::low(v, nibble);
                hi[n] = V::high(v, nibble);
            }
            for (int m = 0; m < MT; ++m) {
                const I xl = V::codes4(x + m * K + 8 * j), xh = V::codes4(x + m * K + 8 * j + 4);
                for (int n = 0; n < NT; ++n) sums[m][n] = V::dot(V::dot(sums[m][n], lo[n], xl), hi[n], xh);
            }
        }
        F sw[NT], mw[NT];
        for (int n = 0; n < NT; ++n) {
            const int64_t blk = b0 + n * V::BLOCKS;
            sw[n] = V::per_block([&](int64_t b) { return scales.s(b, g); }, blk);
            mw[n] = V::per_block([&](int64_t b) { return scales.m(b, g); }, blk);
        }
        for (int m = 0; m < MT; ++m) {
            const F sx = V::set1f(a.d[(m0 + m) * G + g]), xs = V::set1f(a.sum[(m0 + m) * G + g]);
            for (int n = 0; n < NT; ++n) {
                acc[m][n] = V::fmadd(V::cvt(sums[m][n]), V::mul(sw[n], sx), acc[m][n]);
                acc[m][n] = V::fnmadd(mw[n], xs, acc[m][n]);
            }
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) V::store(out, m0 + m, b0 + n * V::BLOCKS, acc[m][n]);
}

template <int MT, int NT, int GROUP, typename V, typename Scales>
void q8a8_tile(const uint8_t* q, const Scales& scales, int64_t K, const Act& a, int64_t m0, int64_t b0,
               const A8Out& out) {
    using I = typename V::I;
    using F = typename V::F;
    const int64_t G = K / GROUP, G32 = K / 32, stride = K * 8, span = V::BLOCKS * stride;
    F acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) acc[m][n] = V::zerof();
    const uint8_t* w = q + b0 * stride;
    const int8_t* x = a.q.data() + m0 * K;
    for (int64_t g = 0; g < G; ++g) {
        // a row's integer sums start at minus its unsigned offset (modular int32 sums: the same integers as
        // subtracting it after, one instruction fewer per row and vector of columns)
        I sums[MT][NT];
        for (int m = 0; m < MT; ++m) {
            const int32_t* halves = a.csum.data() + (m0 + m) * (K / 16) + g * (GROUP / 16);
            const I start = V::set1(-q8_offset(GROUP == 16 ? halves[0] : halves[0] + halves[1]));
            for (int n = 0; n < NT; ++n) sums[m][n] = start;
        }
        for (int64_t j = g * (GROUP / 4); j < (g + 1) * (GROUP / 4); ++j) {  // chunks of 4 elements
            I v[NT];
            for (int n = 0; n < NT; ++n) {
                const uint8_t* at = w + n * span + j * 32;
                V::prefetch(at + NT * span, stride);
                v[n] = V::load(at, stride);
            }
            for (int m = 0; m < MT; ++m) {
                const I xv = V::codes4(x + m * K + 4 * j);
                for (int n = 0; n < NT; ++n) sums[m][n] = V::q8dot(sums[m][n], v[n], xv);
            }
        }
        F sw[NT];
        for (int n = 0; n < NT; ++n) sw[n] = V::per_block([&](int64_t b) { return scales.s(b, g); }, b0 + n * V::BLOCKS);
        for (int m = 0; m < MT; ++m) {
            const F sx = V::set1f(a.d[(m0 + m) * G32 + g * GROUP / 32]);
            for (int n = 0; n < NT; ++n) acc[m][n] = V::fmadd(V::cvt(sums[m][n]), V::mul(sw[n], sx), acc[m][n]);
        }
    }
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) V::store(out, m0 + m, b0 + n * V::BLOCKS, acc[m][n]);
}

// A tile of NT blocks: with Lanes16 two blocks are one wide vector, else NT vectors of one block.
template <int MT, int NT, typename Run>
inline void by_width(const Run& run) {
#ifdef SPECVIZ_LANES16
    if constexpr (NT == 2) run(std::integral_constant<int, MT>{}, std::integral_constant<int, 1>{}, Lanes16{});
    else run(std::integral_constant<int, MT>{}, std::integral_constant<int, NT>{}, Lanes8{});
#else
    run(std::integral_constant<int, MT>{}, std::integral_constant<int, NT>{}, Lanes8{});
#endif
}

// Tile shapes by the call's rows, measured on the 2-core Zen 4 (docs/history.md); a tile of 2 blocks is one
// Lanes16 vector where the build has them. With AVX-512's 32 registers: up to 4 rows, q4 reads one block of
// columns at a time (one stream per thread prefetches best: 24 gate and up projections streamed from DRAM at one
// row 13.4 → 15.8 ms with two blocks), q8 two; more rows go 8 at a time over two blocks (streamed, 8 rows:
// q4 27.6 → 25.4 ms, q8 24.3 → 19.5 ms against 8 × 1 and 6 × 2 narrow; q8 at 64 rows 5.5
// → 5.2 ms against 6 × 2). With AVX2's 16 (the -march=haswell build on the same machine): 4 rows over one
// block throughout (8 rows 0.82 ms, against 1.01 for 2 × 2 and 0.86 for 3 × 1).
struct TileShape { int rows, blocks; };
constexpr int A8_FEW_ROWS = 4;  // calls with at most this many rows use the _FEW shapes
#if defined(SPECVIZ_LANES16) && defined(__AMX_TILE__)
// Intel's server cores (AMX marks them; two 512-bit FMA units where Zen 4 splits a 512-bit operation in two): q4
// over two blocks at any rows. The target's step on the 2-core Xeon (kernel_ab, 16 rounds) at 1 / 2 / 3 / 4 tokens:
// 1.01 / 0.95 / 0.96 / 0.93× one block's; on the Zen 4, 0.98 / 1.06 / 1.02× at 1 / 2 / 4 (docs/benchmarks.md).
constexpr TileShape Q4_FEW{4, 2}, Q8_FEW{4, 2}, A8_MANY{8, 2};
#elif defined(SPECVIZ_LANES16)
constexpr TileShape Q4_FEW{4, 1}, Q8_FEW{4, 2}, A8_MANY{8, 2};
#elif defined(__AVX512F__)  // 32 registers, 256-bit tiles (AVX-512 without VNNI): the shapes measured before Lanes16
constexpr TileShape Q4_FEW{4, 1}, Q8_FEW{4, 2}, A8_MANY{6, 2};
#else
constexpr TileShape Q4_FEW{4, 1}, Q8_FEW{4, 1}, A8_MANY{4, 1};
#endif

// Threads split the blocks of columns; within a tile of blocks, rows go S.rows at a time and the rest in one
// smaller tile (the same operations for a row either way). `tile` takes the shape as std::integral_constants
// so that the accumulators stay in registers.
template <int MT, int NT, typename Tile>
inline void a8_rest(const Tile& tile, int rest, int64_t m, int64_t b, int nb) {
    using std::integral_constant;
    if constexpr (MT > 1) {
        if (rest == MT - 1) {
            if (nb == NT) return tile(integral_constant<int, MT - 1>{}, integral_constant<int, NT>{}, m, b);
            return tile(integral_constant<int, MT - 1>{}, integral_constant<int, 1>{}, m, b);
        }
        a8_rest<MT - 1, NT>(tile, rest, m, b, nb);
    }
}

template <int MT, int NT, typename Tile>
void a8_matmul(int64_t M, int64_t N8, int nthreads, const Tile& tile) {
    using std::integral_constant;
    static_assert(NT <= 2, "a tile of blocks is NT blocks or, at the end, one");
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < N8; b += NT) {
        const int nb = N8 - b < NT ? 1 : NT;
        int64_t m = 0;
        for (; m + MT <= M; m += MT) {
            if (nb == NT) tile(integral_constant<int, MT>{}, integral_constant<int, NT>{}, m, b);
            else tile(integral_constant<int, MT>{}, integral_constant<int, 1>{}, m, b);
        }
        if (m < M) a8_rest<MT, NT>(tile, static_cast<int>(M - m), m, b, nb);
    }
}

#if defined(SPECVIZ_LANES16) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#define SPECVIZ_AMX 1
// ---- AMX: a group's integer sums for 16 rows × 16 columns in one instruction ---------------------------------
// Intel's tile unit (AMX-INT8, Sapphire Rapids and later) computes C[16, 16] int32 += A[16, 32] int8 · B[32, 16]
// uint8 in one TDPBSUD: a group of 32 for 16 rows and 16 columns, where the VNNI tiles above issue 64 vpdpbusd.
// The sums are the same exact integers and the float step after them is the VNNI tiles' sequence for every
// (row, column) (Lanes16's: fmadd(float(sum), w_scale · x_scale, acc), then q4's minimum), so the two paths give the
// same bits and a call may take either: batch invariance holds across them. What is left per group is that float
// step and B's rows of 16 columns (q4: its nibbles spread into bytes; q8: two blocks' chunks side by side), staged
// once per column tile for all its rows (amx_columns).

using specviz_amx::TileConfig;

constexpr int64_t AMX_ROWS = 16;

// A and C tiles hold a call's rows, up to 16 (a tile op's and a store's time grow with its rows)
inline int64_t amx_tile_rows(int64_t M) { return M < AMX_ROWS ? M : AMX_ROWS; }

// q4 calls from 16 rows take AMX, q8 calls from 32: measured on the 2-core Xeon (an 8960 × 1536 matrix, the two
// paths alternating), AMX over VNNI at 1 / 8 / 12 / 16 / 24 / 64 / 256 rows: q4 1.34 / 1.12 / 0.93 / 0.85 / 0.86 /
// 0.73 / 0.72×, q8 (groups of 32) 1.45 / 1.36 / 1.06 / 1.00 / 1.03 / 0.78 / 0.73×, q8 (groups of 16, two float steps
// a group of 32) 1.29 / 0.98 / 1.07 / 0.97 / 0.92× at 8 / 16 / 24 / 32 / 64. Below that its tile ops (a product
// ~3 ns, a store ~5, whatever the rows) cost more than the vpdpbusd they replace (docs/benchmarks.md).
constexpr int64_t AMX_MIN_ROWS = 16;

// q4 calls of at least this many rows take AMX, q8 calls of twice as many; 0: none. Atomic because the page's
// sessions call the kernels from several threads; written only by tests and benchmarks (specviz_amx_min_rows) to
// compare the two paths.
std::atomic<int64_t> amx_min_rows{AMX_MIN_ROWS};

inline bool use_amx(int64_t M, bool q4) {
    const int64_t least = amx_min_rows.load(std::memory_order_relaxed);
    return least > 0 && M >= (q4 ? least : 2 * least) && specviz_amx::permitted();  // else the VNNI tiles
}

// One group's float step for a row tile: acc[m] for rows m0 + m < m0 + rows, from C's sums [16 rows, 16 int32].
// q8: `start` [rows] is each row's unsigned offset (the VNNI tiles' start), added to the sums first.
template <bool Q4>
inline void amx_float_step(__m512* acc, const int32_t* sums, const int32_t* start, int rows, int64_t m0,
                           int64_t d_index, int64_t sum_index, int64_t G32, const Act& a, __m512 sw, __m512 mw) {
#pragma GCC unroll 16
    for (int m = 0; m < AMX_ROWS; ++m) {
        if (m >= rows) break;
        __m512i s = _mm512_load_si512(sums + 16 * m);
        if (!Q4) s = _mm512_add_epi32(_mm512_set1_epi32(start[m]), s);
        const int64_t r = m0 + m;
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sw, _mm512_set1_ps(a.d[r * G32 + d_index])), acc[m]);
        if (Q4) acc[m] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(a.sum[r * G32 + sum_index]), acc[m]);
    }
}

// Measured on one core of the 2-core Xeon (a microbenchmark, operands in L1): a TDPBSUD takes ~3 ns at up to 8 rows
// and ~5 at 16, a tile store ~5 ns at any rows; in a profile, a tile load of bytes that vector stores had just
// written stalled. Tile registers are not renamed, so one group's load → product → store → float step would be a
// chain. Hence: B's rows are staged (unpacked or copied into rows of 16 columns) two batches of groups ahead of
// their products; groups go 4 at a time into 4 result tiles; and the next batch's products are issued before this
// batch's float steps, which read its sums from memory while the tile unit works on.

// This thread's staging buffer for B's rows (64-aligned, at least `bytes`), kept between calls: a fresh 140 KB per
// call would be fresh pages. thread_local, read on the thread that runs the column tile.
inline uint8_t* amx_staging(int64_t bytes) {
    thread_local std::vector<uint8_t> buffer;
    if (buffer.size() < static_cast<size_t>(bytes + 64)) buffer.resize(bytes + 64);
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~static_cast<uintptr_t>(63));
}

// Tile numbers are immediates in the instructions (gcc's intrinsics paste them into the assembly), hence a macro.
#define SPECVIZ_AMX_PRODUCT(c, a_tile, b_tile, g)                         \
    do {                                                                  \
        _tile_loadd(b_tile, staged + (g) * B_BYTES, 64);                  \
        _tile_loadd(a_tile, codes + (g) * GROUP, K);                      \
        _tile_zero(c);                                                    \
        _tile_dpbsud(c, a_tile, b_tile);                                  \
    } while (0)

// Columns 8·b … 8·b + 15 (blocks b and b + 1) for all M rows: q4 (GROUP 32) or q8 (GROUP 16 or 32). Tiles
// (amx_config): C tmm0-3 [R rows, 16 int32], A tmm4-5 [R rows, GROUP codes], B tmm6-7 [GROUP / 4 rows, 16 columns
// × 4 elements]; R = amx_tile_rows(M), the codes padded to a multiple of R rows with zeros.
template <bool Q4, int GROUP, typename Scales>
void amx_columns(const uint8_t* q, const Scales& scales, int64_t K, const Act& a, int64_t M, int64_t b,
                 const A8Out& out) {
    constexpr int BATCH = 4;
    constexpr int64_t B_BYTES = GROUP * 16;  // a group's B: GROUP / 4 rows of 64 bytes
    const int64_t G = K / GROUP, G32 = K / 32, stride = Q4 ? K * 4 : K * 8;  // stride: a block's bytes
    const uint8_t* w = q + b * stride;
    uint8_t* staged = amx_staging(G * B_BYTES);
    // groups [g0, g1)'s B rows: q4 chunk j (8 elements of 8 columns a block) gives row 2j (its low nibbles) and 2j + 1
    // (its high ones), q8 chunk j (4 elements) row j; the next column tile's weights are asked for into L2 meanwhile
    auto stage = [&](int64_t g0, int64_t g1) {
        const int64_t per_group = Q4 ? 4 : GROUP / 4;  // chunks of 32 bytes a block
        for (int64_t j = g0 * per_group; j < g1 * per_group; ++j) {
            if (j % 2 == 0) Lanes16::prefetch(w + 2 * stride + j * 32, stride);
            const __m512i v = Lanes16::load(w + j * 32, stride);
            if (Q4) {
                const __m512i nibble = Lanes16::nibbles();
                _mm512_store_si512(staged + j * 128, Lanes16::low(v, nibble));
                _mm512_store_si512(staged + j * 128 + 64, Lanes16::high(v, nibble));
            } else {
                _mm512_store_si512(staged + j * 64, v);
            }
        }
    };
    alignas(64) int32_t sums[2][BATCH][AMX_ROWS * 16];  // two batches' C: one read while the next is computed
    int32_t start[AMX_ROWS] = {};
    const int64_t R = amx_tile_rows(M);
    for (int64_t m0 = 0; m0 < M; m0 += R) {  // B is staged by the first row tile for all
        const int rows = static_cast<int>(M - m0 < R ? M - m0 : R);
        const int8_t* codes = a.q.data() + m0 * K;
        __m512 acc[AMX_ROWS];
        for (int m = 0; m < AMX_ROWS; ++m) acc[m] = _mm512_setzero_ps();
        auto products = [&](int64_t g0, int32_t (*to)[AMX_ROWS * 16]) {  // groups g0 … (up to 4) into `to`
            const int64_t n = G - g0 < BATCH ? G - g0 : BATCH;
            SPECVIZ_AMX_PRODUCT(0, 4, 6, g0);
            if (n > 1) SPECVIZ_AMX_PRODUCT(1, 5, 7, g0 + 1);
            if (n > 2) SPECVIZ_AMX_PRODUCT(2, 4, 6, g0 + 2);
            if (n > 3) SPECVIZ_AMX_PRODUCT(3, 5, 7, g0 + 3);
            _tile_stored(0, to[0], 64);
            if (n > 1) _tile_stored(1, to[1], 64);
            if (n > 2) _tile_stored(2, to[2], 64);
            if (n > 3) _tile_stored(3, to[3], 64);
        };
        if (m0 == 0) stage(0, G < 2 * BATCH ? G : 2 * BATCH);
        products(0, sums[0]);
        for (int64_t g0 = 0, k = 0; g0 < G; g0 += BATCH, ++k) {
            if (m0 == 0 && g0 + 2 * BATCH < G) stage(g0 + 2 * BATCH, G < g0 + 3 * BATCH ? G : g0 + 3 * BATCH);
            if (g0 + BATCH < G) products(g0 + BATCH, sums[(k + 1) % 2]);
            for (int64_t g = g0; g < g0 + BATCH && g < G; ++g) {
                if (!Q4)
                    for (int m = 0; m < rows; ++m) {  // the unsigned offset: the VNNI tiles' start
                        const int32_t* halves = a.csum.data() + (m0 + m) * (K / 16) + g * (GROUP / 16);
                        start[m] = -q8_offset(GROUP == 16 ? halves[0] : halves[0] + halves[1]);
                    }
                const __m512 sw = Lanes16::per_block([&](int64_t blk) { return scales.s(blk, g); }, b);
                __m512 mw = sw;
                if constexpr (Q4) mw = Lanes16::per_block([&](int64_t blk) { return scales.m(blk, g); }, b);
                amx_float_step<Q4>(acc, sums[k % 2][g - g0], start, rows, m0, g * GROUP / 32, g, G32, a, sw, mw);
            }
        }
        // constant indices only (unrolled, guarded), so that acc stays in registers across the tile instructions (whose
        // asm clobbers memory: an array indexed at run time would be stored and reloaded around each of them)
#pragma GCC unroll 16
        for (int m = 0; m < AMX_ROWS; ++m)
            if (m < rows) Lanes16::store(out, m0 + m, b, acc[m]);
    }
}
#undef SPECVIZ_AMX_PRODUCT

// The tiles' shapes for a call of M rows (amx_columns)
inline TileConfig amx_config(int64_t M, int group) {
    const int R = static_cast<int>(amx_tile_rows(M));
    TileConfig config;
    for (int c = 0; c < 4; ++c) config.set(c, R, 64);
    return config.set(4, R, group).set(5, R, group).set(6, group / 4, 64).set(7, group / 4, 64);
}

// Threads split the column tiles (pairs of blocks); an odd last block goes through the VNNI tiles (`tile`, as
// a8_matmul's), the same bits. `columns(b)` computes blocks b, b + 1 for every row.
template <int MT, typename Columns, typename Tile>
void amx_matmul(int64_t M, int64_t N8, int nthreads, const TileConfig& config, const Columns& columns, const Tile& tile) {
    using std::integral_constant;
#pragma omp parallel num_threads(nthreads)
    {
        _tile_loadconfig(&config);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < N8 - 1; b += 2) columns(b);
        _tile_release();
        if (N8 % 2) {
#pragma omp single
            {
                int64_t m = 0;
                for (; m + MT <= M; m += MT) tile(integral_constant<int, MT>{}, integral_constant<int, 1>{}, m, N8 - 1);
                if (m < M) a8_rest<MT, 1>(tile, static_cast<int>(M - m), m, N8 - 1, 1);
            }
        }
    }
}
#endif

template <int GROUP, typename Scales>
void q8a8(const float* x, int64_t M, int64_t K, const uint8_t* q, const Scales& scales, int64_t N, const float* bias,
          float* y, int nthreads) {
    Act a;
    quantize(x, M, K, nthreads, a);
    const A8Out out{y, N, bias};
    auto tile = [&](auto mt, auto nt, int64_t m, int64_t b) {
        by_width<decltype(mt)::value, decltype(nt)::value>([&](auto rows, auto vectors, auto lanes) {
            q8a8_tile<rows.value, vectors.value, GROUP, decltype(lanes)>(q, scales, K, a, m, b, out);
        });
    };
#ifdef SPECVIZ_AMX
    if (use_amx(M, false)) {
        const int64_t R = amx_tile_rows(M);
        a.q.resize((M + R - 1) / R * R * K, 0);  // A's rows past M: zero codes
        return amx_matmul<A8_MANY.rows>(M, (N + 7) / 8, nthreads, amx_config(M, GROUP), [&](int64_t b) {
            amx_columns<false, GROUP>(q, scales, K, a, M, b, out);
        }, tile);
    }
#endif
    if (M <= A8_FEW_ROWS) a8_matmul<Q8_FEW.rows, Q8_FEW.blocks>(M, (N + 7) / 8, nthreads, tile);
    else a8_matmul<A8_MANY.rows, A8_MANY.blocks>(M, (N + 7) / 8, nthreads, tile);
}

template <typename Scales>
void q4a8(const float* x, int64_t M, int64_t K, const uint8_t* q, const Scales& scales, int64_t N, const float* bias,
          float* y, int nthreads) {
    Act a;
    quantize(x, M, K, nthreads, a);
    const A8Out out{y, N, bias};
    auto tile = [&](auto mt, auto nt, int64_t m, int64_t b) {
        by_width<decltype(mt)::value, decltype(nt)::value>([&](auto rows, auto vectors, auto lanes) {
            q4a8_tile<rows.value, vectors.value, decltype(lanes)>(q, scales, K, a, m, b, out);
        });
    };
#ifdef SPECVIZ_AMX
    if (use_amx(M, true)) {
        const int64_t R = amx_tile_rows(M);
        a.q.resize((M + R - 1) / R * R * K, 0);
        return amx_matmul<A8_MANY.rows>(M, (N + 7) / 8, nthreads, amx_config(M, 32), [&](int64_t b) {
            amx_columns<true, 32>(q, scales, K, a, M, b, out);
        }, tile);
    }
#endif
    if (M <= A8_FEW_ROWS) a8_matmul<Q4_FEW.rows, Q4_FEW.blocks>(M, (N + 7) / 8, nthreads, tile);
    else a8_matmul<A8_MANY.rows, A8_MANY.blocks>(M, (N + 7) / 8, nthreads, tile);
}
#endif

}  // namespace

extern "C" {

int specviz_max_rows() { return static_cast<int>(MAX_ROWS); }

int specviz_has_avx2() {
#ifdef SPECVIZ_AVX2
    return 1;
#else
    return 0;
#endif
}

// x [M, K] fp32, q [N, K/2] uint8, scale/minv [N, K/32] fp32, bias [N] fp32 or null, y [M, N] fp32.
// K is a multiple of 64; M <= specviz_max_rows() (callers split longer calls).
void specviz_q4_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, const float* minv,
                       int64_t N, const float* bias, float* y, int nthreads) {
    std::vector<float> xp(M * K);
    permute_rows(x, M, K, Q4_BLOCK, Q4_PER_LANE, xp.data());
    run(xp.data(), M, K, N, bias, y, nthreads, Q4Format{q, scale, minv, K});
}

// x [M, K] fp32, q [N, K] int8, scale [N, K/group] fp32 (group 16 or 32), bias [N] or null, y [M, N] fp32.
// K is a multiple of 32; M <= specviz_max_rows().
void specviz_q8_matmul(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t group,
                       int64_t N, const float* bias, float* y, int nthreads) {
    std::vector<float> xp(M * K);
    permute_rows(x, M, K, Q8_BLOCK, Q8_PER_LANE, xp.data());
    if (group == 16) run(xp.data(), M, K, N, bias, y, nthreads, Q8Format<16>{q, scale, K});
    else run(xp.data(), M, K, N, bias, y, nthreads, Q8Format<32>{q, scale, K});
}

#ifdef SPECVIZ_AVX2
// The int8 peak of the dot-product sequence the kernels use (vpdpbusd, or vpmaddubsw + vpmaddwd + add),
// operands in registers, 8 independent accumulators per thread: what no matmul here can exceed. Returns the
// multiply-adds done (time the call to get a rate).
double specviz_int8_peak(int64_t iters, int nthreads) {
    int64_t sink = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : sink)
    {
        // eight named accumulators and operands (an array would live on the stack)
        const __m256i x = _mm256_set1_epi8(3);
        const char t = static_cast<char>(omp_get_thread_num());
        __m256i u0 = _mm256_set1_epi8(t + 1), u1 = _mm256_set1_epi8(t + 2), u2 = _mm256_set1_epi8(t + 3),
                u3 = _mm256_set1_epi8(t + 4), u4 = _mm256_set1_epi8(t + 5), u5 = _mm256_set1_epi8(t + 6),
                u6 = _mm256_set1_epi8(t + 7), u7 = _mm256_set1_epi8(t + 8);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t i = 0; i < iters; ++i) {
            // the operands "change": the products can be neither hoisted out of the loop nor shared
            asm volatile("" : "+x"(u0), "+x"(u1), "+x"(u2), "+x"(u3), "+x"(u4), "+x"(u5), "+x"(u6), "+x"(u7));
            a0 = dot4_add(a0, u0, x);
            a1 = dot4_add(a1, u1, x);
            a2 = dot4_add(a2, u2, x);
            a3 = dot4_add(a3, u3, x);
            a4 = dot4_add(a4, u4, x);
            a5 = dot4_add(a5, u5, x);
            a6 = dot4_add(a6, u6, x);
            a7 = dot4_add(a7, u7, x);
        }
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                                               _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
        sink += _mm256_extract_epi32(total, 0);
    }
    static volatile int64_t keep;
    keep = sink;
    return static_cast<double>(iters) * 8 * 32 * nthreads;
}
#endif

// The instructions the 8-bit-activation kernels were built with (they compute the same bits either way).
const char* specviz_isa() {
#if defined(SPECVIZ_AMX)
    if (specviz_amx::permitted()) return "avx512-vnni+amx";
#endif
#if defined(SPECVIZ_VNNI) && defined(__AVX512F__)
    return "avx512-vnni";
#elif defined(SPECVIZ_VNNI)
    return "avx-vnni";
#elif defined(SPECVIZ_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

// The fewest rows a q4 call needs to take AMX (q8: twice as many; where built and permitted; 0: never): sets it where
// `rows` >= 0 and returns the value before, or -1 where this build or process has no AMX. For tests and benchmarks.
int64_t specviz_amx_min_rows(int64_t rows) {
#ifdef SPECVIZ_AMX
    if (!specviz_amx::permitted()) return -1;
    return rows >= 0 ? amx_min_rows.exchange(rows) : amx_min_rows.load();
#else
    (void)rows;
    return -1;
#endif
}

int specviz_has_a8() {
#ifdef SPECVIZ_AVX2
    return 1;
#else
    return 0;
#endif
}

#ifdef SPECVIZ_AVX2
// 8-bit activations: x [M, K] fp32 quantized per row and group of 32 inside the call; q, scale, minv in the
// interleaved layout of specviz_q4_interleave / specviz_q8_interleave (N8 = ceil(N / 8) blocks of 8
// columns), bias [N] or null, y [M, N]. K a multiple of 64 (q4) or 32 (q8); any M. Only where specviz_has_a8().
void specviz_q4a8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale,
                         const float* minv, int64_t N, const float* bias, float* y, int nthreads) {
    q4a8(x, M, K, q, FlatQ4{scale, minv, K / 32}, N, bias, y, nthreads);
}

void specviz_q8a8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, int64_t group,
                         int64_t N, const float* bias, float* y, int nthreads) {
    if (group == 16) q8a8<16>(x, M, K, q, FlatQ8{scale, K / 16}, N, bias, y, nthreads);
    else q8a8<32>(x, M, K, q, FlatQ8{scale, K / 32}, N, bias, y, nthreads);
}

// The same with fp16 scale / minv [N8, K/32, 8] (HalfQ4 above).
void specviz_q4a8_half_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* scale,
                              const uint16_t* minv, int64_t N, const float* bias, float* y, int nthreads) {
    q4a8(x, M, K, q, HalfQ4{scale, minv, K / 32}, N, bias, y, nthreads);
}

// The same, on the k-quants' two-level scales (SuperQ4 / SuperQ8 above; specviz.models.cpu_kernels.
// super_interleave): the same bits as the flat ones. K a multiple of 256.
void specviz_q4a8_super_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint8_t* sub,
                               const float* sup, int64_t N, const float* bias, float* y, int nthreads) {
    q4a8(x, M, K, q, SuperQ4{sub, sup, K / 32}, N, bias, y, nthreads);
}

void specviz_q8a8_super_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const int8_t* sub,
                               const float* sup, int64_t N, const float* bias, float* y, int nthreads) {
    q8a8<16>(x, M, K, q, SuperQ8{sub, sup, K / 16}, N, bias, y, nthreads);
}
#endif

// The interleaved layouts of the 8-bit-activation kernels, from the row-major ones (the q4 / q8 formats at
// the top). Columns past N (up to a multiple of 8) get zero weights and scales.
// q [N, K/2], scale / minv [N, K/32] -> qi [N8, K/8, 8, 4], si / mi [N8, K/32, 8]
void specviz_q4_interleave(const uint8_t* q, const float* scale, const float* minv, int64_t N, int64_t K,
                           uint8_t* qi, float* si, float* mi) {
    const int64_t N8 = (N + 7) / 8, G = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N8; ++b)
        for (int l = 0; l < 8; ++l) {
            const int64_t n = b * 8 + l;
            for (int64_t j = 0; j < K / 8; ++j)
                for (int i = 0; i < 4; ++i) {
                    uint8_t v = 0;
                    if (n < N) {
                        const uint8_t* row = q + n * (K / 2);
                        const int64_t e0 = 8 * j + i, e1 = 8 * j + 4 + i;
                        v = static_cast<uint8_t>(((row[e0 / 2] >> (4 * (e0 & 1))) & 15) |
                                                 (((row[e1 / 2] >> (4 * (e1 & 1))) & 15) << 4));
                    }
                    qi[((b * (K / 8) + j) * 8 + l) * 4 + i] = v;
                }
            for (int64_t g = 0; g < G; ++g) {
                si[(b * G + g) * 8 + l] = n < N ? scale[n * G + g] : 0.0f;
                mi[(b * G + g) * 8 + l] = n < N ? minv[n * G + g] : 0.0f;
            }
        }
}

// q [N, K] int8, scale [N, K/group] -> qi [N8, K/4, 8, 4] (w + 128), si [N8, K/group, 8]
void specviz_q8_interleave(const int8_t* q, const float* scale, int64_t group, int64_t N, int64_t K, uint8_t* qi,
                           float* si) {
    const int64_t N8 = (N + 7) / 8, G = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N8; ++b)
        for (int l = 0; l < 8; ++l) {
            const int64_t n = b * 8 + l;
            for (int64_t j = 0; j < K / 4; ++j)
                for (int i = 0; i < 4; ++i)
                    qi[((b * (K / 4) + j) * 8 + l) * 4 + i] =
                        static_cast<uint8_t>((n < N ? q[n * K + 4 * j + i] : 0) + 128);
            for (int64_t g = 0; g < G; ++g) si[(b * G + g) * 8 + l] = n < N ? scale[n * G + g] : 0.0f;
        }
}

// The dense fp32 weight out [N, K] in natural order (to check the packing; BLAS never needs it).
void specviz_q4_dequant(const uint8_t* q, const float* scale, const float* minv, int64_t N, int64_t K, float* out) {
    for (int64_t r = 0; r < N; ++r)
        for (int64_t k = 0; k < K; ++k) {
            const int v = (q[(r * K + k) / 2] >> (4 * (k & 1))) & 15;
            out[r * K + k] = __builtin_fmaf(static_cast<float>(v), scale[r * (K / 32) + k / 32], -minv[r * (K / 32) + k / 32]);
        }
}

void specviz_q8_dequant(const int8_t* q, const float* scale, int64_t group, int64_t N, int64_t K, float* out) {
    for (int64_t r = 0; r < N; ++r)
        for (int64_t k = 0; k < K; ++k) out[r * K + k] = static_cast<float>(q[r * K + k]) * scale[r * (K / group) + k / group];
}

}  // extern "C"
