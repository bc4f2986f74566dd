// Exact verification's two full-vocabulary passes on the CPU, for specviz/verify/tiled.py (the torch path
// keeps everything else: gathers, the acceptance test, the random numbers), and sampling one token:
//   specviz_row_lse: log Σ exp(scale·z) of every row, reading each logit twice (max, then the sum);
//   specviz_residual_pick: for each batch row, a token drawn from max(0, p - w·q) at one position, as
//     Wagner et al.'s tiled pass does: masses per chunk, a uniform picks a chunk, a scan inside it;
//   specviz_sample_rows: a token from softmax(scale·z) of each row (the same draw with w = 0), for
//     specviz/sampling.py (torch.multinomial draws an exponential per token on the CPU: 3 ms a row);
//   specviz_row_argmax: greedy's token, torch.argmax's choice, at a tenth of its time.
// Why: in torch these passes are ~300 small operations per verification (tiles of a 16,384-wide loop) and
// took 3-7 ms of a 60-130 ms iteration on two cores; here they read the logits once or twice.
//
// Lanes: 16 fp32 lanes, summed in fp64 (GCC vector extensions: AVX-512, two AVX2 registers or SSE, whatever the build
// has), each doing the same IEEE operations in the same order on every build: no contraction into FMAs,
// a polynomial exp of our own, a fixed reduction tree. Every row is computed alone, so a row's result does
// not depend on the batch it is in. specviz_row_lse gives a row holding a NaN NaN, one holding +inf +inf and one
// without a finite value -inf, so that its caller checks the logits from its result, and specviz_sample_rows
// gives such a row the token -1; the other passes take checked inputs (no NaN or +inf; a finite value a row).

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include <vector>

// No multiply-add contraction in this file (FMA exists on some builds, not on others): every build rounds
// each product and each sum on its own. Pragmas for the whole file, so that its functions still inline.
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vh __attribute__((vector_size(32)));   // half of vf's lanes
typedef double vd __attribute__((vector_size(64)));  // 8 doubles
constexpr int L = 16;
constexpr int64_t CHUNK = 4096;  // residual masses per chunk of the vocabulary (a multiple of L)

inline vf splat(float v) { return vf{} + v; }

// exp(x) for x <= 0 (x = scale·z - a row's maximum); -inf and anything below -87 give 0 (under 1e-38 of
// the row's largest term). Cephes' expf: x = n·ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r, then 2^n
// through the exponent bits. About 1 ulp.
inline vf exp_nonpositive(vf x) {
    const vi tiny = x < splat(-87.0f);
    x = tiny ? splat(-87.0f) : x;
    const vf n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);  // round to nearest
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * (r * r) + r + splat(1.0f);
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    const vf two_n = reinterpret_cast<const vf&>(bits);
    return tiny ? splat(0.0f) : y * two_n;
}

// Sums go to float64 lanes (16 of them, as two vectors): a row's 151,936 terms summed in fp32 lanes lost
// 1.3e-5 of the normalizer, 17 times the torch path's error; in fp64 the terms' own rounding is what is left.
struct Acc {
    vd lo = vd{}, hi = vd{};
    void add(vf v) {
        vh a, b;
        memcpy(&a, &v, sizeof a);
        memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
        lo = lo + __builtin_convertvector(a, vd);
        hi = hi + __builtin_convertvector(b, vd);
    }
    double sum() const {  // a fixed tree
        double x[L];
        memcpy(x, &lo, sizeof lo);
        memcpy(x + L / 2, &hi, sizeof hi);
        for (int w = L / 2; w > 0; w /= 2)
            for (int i = 0; i < w; ++i) x[i] = x[i] + x[i + w];
        return x[0];
    }
};

// elements [i, i + L) of row, -inf past V
inline vf load(const float* row, int64_t i, int64_t V) {
    vf v;
    if (i + L <= V) {
        memcpy(&v, row + i, sizeof v);
    } else {
        for (int k = 0; k < L; ++k) v[k] = i + k < V ? row[i + k] : -INFINITY;
    }
    return v;
}

float row_lse(const float* row, int64_t V, float scale) {
    vf top = splat(-INFINITY);
    vi nan = vi{};
    for (int64_t i = 0; i < V; i += L) {
        const vf v = load(row, i, V);
        top = v > top ? v : top;
        nan |= v != v;
    }
    float zmax = -INFINITY;
    for (int k = 0; k < L; ++k) {
        if (nan[k]) return NAN;  // a bad row says so by its result: the caller need not read the logits again
        zmax = top[k] > zmax ? top[k] : zmax;
    }
    if (zmax == INFINITY || zmax == -INFINITY) return zmax;
    const float m = zmax * scale;  // = max(scale·z): multiplying by scale > 0 keeps the order
    Acc acc;
    for (int64_t i = 0; i < V; i += L) acc.add(exp_nonpositive(load(row, i, V) * splat(scale) - splat(m)));
    return m + static_cast<float>(log(acc.sum()));
}

// max(0, exp(scale·zp - lp) - w·exp(scale·zq - lq)) for elements [i, i + L)
inline vf residual(const float* zp, const float* zq, int64_t i, int64_t V, float scale, float lp, float lq,
                          float w) {
    const vf p = exp_nonpositive(load(zp, i, V) * splat(scale) - splat(lp));
    if (w == 0.0f) return p;  // max(0, p - 0·q) = p, without reading q
    const vf q = exp_nonpositive(load(zq, i, V) * splat(scale) - splat(lq));
    const vf r = p - splat(w) * q;
    return r > splat(0.0f) ? r : splat(0.0f);
}

// torch.argmax's choice for one row: the first index of its largest value, or of its first NaN (torch counts NaN
// as the largest). One pass keeps each lane's largest value and the first index it was seen at (a strictly larger
// value replaces it); the row's answer is the smallest such index among the lanes holding the row's maximum.
int64_t row_argmax(const float* row, int64_t V) {
    vf top = splat(-INFINITY);
    vi at = vi{}, nan = vi{};
    vi lane;
    for (int k = 0; k < L; ++k) lane[k] = k;
    for (int64_t i = 0; i < V; i += L) {
        const vf v = load(row, i, V);
        const vi larger = v > top;
        nan = nan | (v != v);
        top = larger ? v : top;
        at = larger ? lane + static_cast<int32_t>(i) : at;
    }
    bool any_nan = false;
    float zmax = -INFINITY;
    for (int k = 0; k < L; ++k) {
        any_nan = any_nan || nan[k];
        zmax = top[k] > zmax ? top[k] : zmax;
    }
    if (any_nan) {
        for (int64_t i = 0; i < V; ++i)
            if (row[i] != row[i]) return i;
    }
    int64_t first = 0;  // a row of -inf only: index 0, as torch
    bool seen = false;
    for (int k = 0; k < L; ++k)
        if (top[k] == zmax && (!seen || at[k] < first)) first = at[k], seen = true;
    return first;
}

// The token at u of max(0, p - w·q): -1 when the residual has no mass (the caller's rounding case).
int64_t pick(const float* zp, const float* zq, int64_t V, float scale, float lp, float lq, float w, float u,
                    double* masses) {
    const int64_t chunks = (V + CHUNK - 1) / CHUNK;
    double total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
        Acc acc;
        const int64_t end = c * CHUNK + CHUNK < V ? c * CHUNK + CHUNK : V;
        for (int64_t i = c * CHUNK; i < end; i += L) acc.add(residual(zp, zq, i, V, scale, lp, lq, w));
        masses[c] = acc.sum();
        total = total + masses[c];
    }
    if (!(total > 0.0)) return -1;
    const double goal = static_cast<double>(u) * total;
    // the chunk whose cumulative interval holds the goal, never an empty one (the last non-empty one when
    // rounding puts the goal at the very top)
    int64_t chosen = -1, last = -1;
    double before = 0.0, cum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
        if (masses[c] > 0.0) last = c;
        const double next = cum + masses[c];
        if (chosen < 0 && next > goal && masses[c] > 0.0) {
            chosen = c;
            before = cum;
        }
        cum = next;
    }
    if (chosen < 0) {
        chosen = last;
        before = cum - masses[last];
    }
    // inside it, element by element in order (the same values as the chunk's sum, summed sequentially)
    const double local_goal = goal - before;
    double local = 0.0;
    int64_t last_positive = -1;
    const int64_t end = chosen * CHUNK + CHUNK < V ? chosen * CHUNK + CHUNK : V;
    for (int64_t i = chosen * CHUNK; i < end; i += L) {
        const vf r = residual(zp, zq, i, V, scale, lp, lq, w);
        for (int k = 0; k < L && i + k < end; ++k) {
            if (!(r[k] > 0.0f)) continue;
            last_positive = i + k;
            local = local + static_cast<double>(r[k]);
            if (local > local_goal) return i + k;
        }
    }
    return last_positive;
}

}  // namespace

extern "C" {

// z: rows [B, R, V] at element strides (sb, sr) with V contiguous; lse [B, R] out.
void specviz_row_lse(const float* z, int64_t B, int64_t R, int64_t V, int64_t sb, int64_t sr, float scale, float* lse,
                     int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B * R > 1)
    for (int64_t br = 0; br < B * R; ++br) lse[br] = row_lse(z + (br / R) * sb + (br % R) * sr, V, scale);
}

// For each batch row b: a token from max(0, p - w[b]·q) where p = softmax(scale·zp[b, n[b]]) (log-normalizer
// lp [B, γ+1]) and q = softmax(scale·zq[b, min(n[b], γ-1)]) (lq [B, γ]), at the uniform u[b]; where the
// residual has no mass (rounding, with p ≈ q), from p itself. zp [B, γ+1, V] at strides (psb, psr), zq [B, γ, V]
// at (qsb, qsr), V contiguous; token [B] out.
void specviz_residual_pick(const float* zp, int64_t psb, int64_t psr, const float* zq, int64_t qsb, int64_t qsr,
                           int64_t B, int64_t gamma, int64_t V, const int64_t* n, const float* lp, const float* lq,
                           const float* w, const float* u, float scale, int64_t* token, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (B > 1)
    {
        std::vector<double> masses((V + CHUNK - 1) / CHUNK);  // this thread's chunk masses
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t at = n[b], qat = at < gamma ? at : gamma - 1;
            const float* p = zp + b * psb + at * psr;
            const float* q = zq + b * qsb + qat * qsr;
            const float pl = lp[b * (gamma + 1) + at], ql = lq[b * gamma + qat];
            int64_t t = pick(p, q, V, scale, pl, ql, w[b], u[b], masses.data());
            if (t < 0) t = pick(p, q, V, scale, pl, ql, 0.0f, u[b], masses.data());
            token[b] = t;
        }
    }
}

// A token from softmax(scale·z[r]) for each row r at the uniform u[r]: z [rows, V] at row stride `stride`,
// V contiguous; token [rows] out.
void specviz_sample_rows(const float* z, int64_t rows, int64_t V, int64_t stride, float scale, const float* u,
                         int64_t* token, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (rows > 1)
    {
        std::vector<double> masses((V + CHUNK - 1) / CHUNK);  // this thread's chunk masses
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const float* row = z + r * stride;
            const float lse = row_lse(row, V, scale);
            token[r] = isfinite(lse) ? pick(row, row, V, scale, lse, lse, 0.0f, u[r], masses.data()) : -1;
        }
    }
}

// The first index of each row's largest value (torch.argmax over the last dimension, NaN counting as largest):
// z [rows, V] at row stride `stride`, V contiguous; index [rows] out. torch's own CPU argmax walks a row at
// ~0.6 ns a logit, ten times this, and greedy decoding takes one per scored position.
void specviz_row_argmax(const float* z, int64_t rows, int64_t V, int64_t stride, int64_t* index, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) index[r] = row_argmax(z + r * stride, V);
}

}  // extern "C"
