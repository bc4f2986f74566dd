// Vector math shared by the CPU kernels (attention_cpu.cpp, decoder_cpu.cpp, half_matmul_cpu.cpp,
// encoder_attention_cpu.cpp); AVX2 + FMA builds only, the 16-lane exp on AVX-512 builds.
#pragma once
#include <immintrin.h>

namespace specviz_math {

inline float lanes_sum(__m256 v) {  // a fixed-order reduction of 8 lanes
    alignas(32) float l[8];
    _mm256_store_ps(l, v);
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// lanes_sum of eight vectors at once, as one vector [sum(v[0]), ..., sum(v[7])]: the same additions in the
// same pairing, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), so each the same bits as lanes_sum.
inline __m256 lanes_sum8(const __m256* v) {
    __m256 h[4];  // h[p]: lanes 0-3 = v[2p]'s l_k + l_k+4, lanes 4-7 = v[2p + 1]'s
    for (int p = 0; p < 4; ++p)
        h[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
    __m256 u[2];  // u[p], per 128-bit half: [x(l0+l4 + l2+l6), x(l1+l5 + l3+l7), y(...), y(...)]
    for (int p = 0; p < 2; ++p)
        u[p] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * p], h[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(h[2 * p], h[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // low half: sums of v0, v2, v4, v6; high half: v1, v3, v5, v7
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// e^x for x <= 0 (scores minus their maximum), Cephes' single-precision method: x = n ln2 + r, e^r by a
// degree-6 polynomial, 2^n in the exponent bits. Plain arithmetic, so the same bits on every call.
inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
// The same method on 16 lanes (encoder_attention_cpu.cpp).
inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    // p · 2^n in one instruction: the 8-lane path's exponent bits and multiply give the same product, exact either
    // way, since x ≥ -87 keeps n ≥ -125 and so 2^n and p · 2^n normal (4% of the encoder's attention layer)
    return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace specviz_math
