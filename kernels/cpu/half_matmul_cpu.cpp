// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) for fp16 weights and fp32 activations and outputs: Whisper's decoder,
// whose weights are fp16 (read as fp16, they are exactly the model's; widening each to fp32 is exact).
//
// Why: torch's fp32 linear on the CPU picks its blocking by the number of rows, and on the 2-core Zen 4 it costs
// more for 2 rows than for 1 (Whisper base's output head, 51,865 × 512: 9.7 ms at one row, 22.4 at two, 32.4 at
// three), so verifying γ + 1 drafted tokens cost up to twice a step. Here W is read once per call in half the bytes
// of fp32 and shared by every row: a call costs about its weights' bytes at any row count up to ~8.
//
// Batch invariance is the contract: every (row, column) output accumulates x · w in one 8-lane fp32 vector, walking
// K in order, with one fixed-order reduction of its lanes at the end; tiles only decide which outputs share a
// weight load. So a row's outputs are the same bits whatever M is and whichever rows share its tile, and the
// AVX-512, AVX2 and portable builds agree (fmaf rounds as the FMA instruction does).
//
// Layouts: x [M, K] fp32, W [N, K] fp16 (uint16 bits), bias [N] fp32 or null, y [M, N] fp32; K a multiple of 8.
// Built with the other kernels into one library (specviz.native).

#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECVIZ_HALF_AVX2 1
#include "vector_math.h"
#endif

namespace {

constexpr int64_t COLUMNS = 4;  // weight rows (output columns) per tile: their loads are shared by the tile's rows
// Rows per tile: each weight vector is widened once per tile, so more rows convert less; AVX-512's 32 registers
// hold 4 × 4 accumulators besides the 4 weights and an input, AVX2's 16 hold 2 × 4.
#ifdef __AVX512F__
constexpr int ROWS = 4, WIDE_ROWS = 6;  // wide tiles: 6 × 4 accumulators, 4 weights and an input in 32 registers
#else
constexpr int ROWS = 2, WIDE_ROWS = 2;
#endif
constexpr int64_t MANY_ROWS = 64, BLOCK_COLUMNS = 32;  // calls of at least MANY_ROWS rows go by wide_block

#ifdef SPECVIZ_HALF_AVX2
// Weights ahead to prefetch (4 KB: a few rows of a Whisper layer): Whisper base's 49 decoder matrices streamed
// from DRAM at one row 5.7 → 5.1 ms, at 6 rows 8.9 → 7.0 (1,024 gained less, 4,096 the same). Into L2, as the
// 8-bit-activation tiles (qmatmul_cpu.cpp): the 49 matrices and the head at 1 / 2 / 4 / 6 rows 0.71 / 0.79 / 0.84
// / 0.94× the L1 hint's time; a transcription target-only 0.88–0.95× end to end (2-core Zen 4, alternating in one
// process), speculative ones within 1%.
constexpr int64_t PREFETCH = 2048;

using specviz_math::lanes_sum;  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), as the portable path
using specviz_math::lanes_sum8;

// A tile's outputs: each accumulator's lanes summed in lanes_sum's order, eight accumulators at a time where there
// are eight (lanes_sum8: the same bits; one output at a time cost a third of a 1,500-row call), then the bias.
template <int MT, int NT>
inline void store(const __m256 (&acc)[MT][NT], const float* bias, float* y, int64_t N, int64_t m0, int64_t n0) {
    constexpr int C = MT * NT;
    const __m256* flat = &acc[0][0];
    alignas(32) float sums[(C + 7) / 8 * 8];
    int i = 0;
    for (; i + 8 <= C; i += 8) _mm256_store_ps(sums + i, lanes_sum8(flat + i));
    for (; i < C; ++i) sums[i] = lanes_sum(flat[i]);
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) y[(m0 + m) * N + n0 + n] = sums[m * NT + n] + (bias ? bias[n0 + n] : 0.0f);
}

// Where a tile's weight rows come from: W itself (fp16, widened at each load, prefetched ahead), or a block of
// them widened once (wide_block). Both give _mm256_cvtph_ps's values, so the same bits.
struct HalfRows {
    const uint16_t* w;  // row n0 of W
    int64_t K;
    __m256 load(int n, int64_t k) const {
        _mm_prefetch(reinterpret_cast<const char*>(w + n * K + k + PREFETCH), _MM_HINT_T1);  // rows ahead
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k)));
    }
};
struct WideRows {
    const float* wide;  // [NT, K], rows n0 … of W as fp32
    int64_t K;
    __m256 load(int n, int64_t k) const { return _mm256_loadu_ps(wide + n * K + k); }
};

// MT rows from m0 × NT columns from n0, the columns' weights read through `rows`
template <int MT, int NT, typename Rows>
void tile(const float* x, int64_t K, const Rows& rows, int64_t N, const float* bias, float* y, int64_t m0, int64_t n0) {
    __m256 acc[MT][NT];
    for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[NT];
        for (int n = 0; n < NT; ++n) wv[n] = rows.load(n, k);
        for (int m = 0; m < MT; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + m) * K + k);
            for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    store<MT, NT>(acc, bias, y, N, m0, n0);
}

// the last rows (fewer than MT) of columns [n0, n0 + NT) in one tile
template <int MT, int NT>
inline void rest_tile(const float* x, int64_t rest, int64_t K, const HalfRows& rows, int64_t N, const float* bias,
                      float* y, int64_t m, int64_t n0) {
    if constexpr (MT > 1) {
        if (rest == MT - 1) return tile<MT - 1, NT>(x, K, rows, N, bias, y, m, n0);
        rest_tile<MT - 1, NT>(x, rest, K, rows, N, bias, y, m, n0);
    }
}

// all M rows of columns [n0, n0 + NT): ROWS at a time, then the rest in one smaller tile (the same operations per
// row either way; taken one by one, each of the last rows read and widened the columns' weights again: Whisper's
// decoder matrices and head at 5 / 6 / 7 / 10 rows 0.93 / 0.88 / 0.77 / 0.91× the time, 4 and 8 unchanged)
template <int NT>
void columns(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y, int64_t n0) {
    int64_t m = 0;
    const HalfRows rows{w + n0 * K, K};
#ifdef __AVX512F__
    // 8 rows at a time over 2 columns (16 accumulators in AVX-512's 32 registers): each weight widened once for
    // 8 rows, where two 4 × 4 tiles widen it twice. Whisper's decoder matrices and head at 8 / 9 / 10 / 16 rows
    // 0.89–0.91 / 0.93 / 0.91–0.92 / 0.92–0.95× the time (two runs, alternating in one process); 4 and 6 rows ±1%.
    if constexpr (NT == 4) {
        for (; m + 8 <= M; m += 8) {
            tile<8, 2>(x, K, rows, N, bias, y, m, n0);
            tile<8, 2>(x, K, HalfRows{w + (n0 + 2) * K, K}, N, bias, y, m, n0 + 2);
        }
    }
#endif
    for (; m + ROWS <= M; m += ROWS) tile<ROWS, NT>(x, K, rows, N, bias, y, m, n0);
    if (m < M) rest_tile<ROWS, NT>(x, M - m, K, rows, N, bias, y, m, n0);
}

// Many rows (Whisper's cross-attention keys and values: 1,500 encoder frames): a block of BLOCK_COLUMNS weight rows
// is widened once into `wide`, then every tile of WIDE_ROWS input rows walks the whole block while those rows are
// in L1, so x is read once per block rather than once per 4 columns. At 1,500 rows × 512 × 512 on the 2-core
// Zen 4, with lanes_sum8 in `store`: 6.1 → 5.1 ms (torch's fp32 GEMM, not batch-invariant: 4.3).
template <int NT>
void wide_block(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                int64_t n0, int64_t columns, float* wide) {
    for (int64_t n = 0; n < columns; ++n)
        for (int64_t k = 0; k < K; k += 8)
            _mm256_storeu_ps(wide + n * K + k,
                             _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + n) * K + k))));
    int64_t m = 0;
    for (; m + WIDE_ROWS <= M; m += WIDE_ROWS) {
        int64_t n = 0;
        for (; n + NT <= columns; n += NT) tile<WIDE_ROWS, NT>(x, K, WideRows{wide + n * K, K}, N, bias, y, m, n0 + n);
        for (; n < columns; ++n) tile<WIDE_ROWS, 1>(x, K, WideRows{wide + n * K, K}, N, bias, y, m, n0 + n);
    }
    for (; m < M; ++m) {
        int64_t n = 0;
        for (; n + NT <= columns; n += NT) tile<1, NT>(x, K, WideRows{wide + n * K, K}, N, bias, y, m, n0 + n);
        for (; n < columns; ++n) tile<1, 1>(x, K, WideRows{wide + n * K, K}, N, bias, y, m, n0 + n);
    }
}
#else
inline float half_to_float(uint16_t h) {  // IEEE binary16 -> binary32, exact
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 31) bits = sign | 0x7f800000 | (mant << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) bits = sign;
    else {  // subnormal: normalize
        int e = -1;
        uint32_t m = mant;
        do { m <<= 1; ++e; } while (!(m & 1024));
        bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// one column for all rows, eight lanes as the vector path keeps them
void column(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y, int64_t n) {
    for (int64_t m = 0; m < M; ++m) {
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = 0; k < K; k += 8)
            for (int j = 0; j < 8; ++j) l[j] = __builtin_fmaf(x[m * K + k + j], half_to_float(w[n * K + k + j]), l[j]);
        y[m * N + n] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])) + (bias ? bias[n] : 0.0f);
    }
}
#endif

}  // namespace

extern "C" {

void specviz_f16_matmul(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias, float* y,
                        int nthreads) {
#ifdef SPECVIZ_HALF_AVX2
    if (M >= MANY_ROWS) {
#pragma omp parallel num_threads(nthreads)
        {
            std::vector<float> wide(BLOCK_COLUMNS * K);
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += BLOCK_COLUMNS)
                wide_block<COLUMNS>(x, M, K, w, N, bias, y, n0, N - n0 < BLOCK_COLUMNS ? N - n0 : BLOCK_COLUMNS,
                                    wide.data());
        }
        return;
    }
#endif
    // threads split the columns in contiguous ranges: each streams its own part of W once
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += COLUMNS) {
#ifdef SPECVIZ_HALF_AVX2
        if (N - n0 >= COLUMNS) columns<COLUMNS>(x, M, K, w, N, bias, y, n0);
        else
            for (int64_t n = n0; n < N; ++n) columns<1>(x, M, K, w, N, bias, y, n);
#else
        for (int64_t n = n0; n < N && n < n0 + COLUMNS; ++n) column(x, M, K, w, N, bias, y, n);
#endif
    }
}

}  // extern "C"
