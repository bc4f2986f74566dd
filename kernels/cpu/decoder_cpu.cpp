// A whole decoder forward of a Qwen2/Llama-family model over its layers in one call: per layer RMS norm,
// q/k/v projections (the 8-bit-activation kernels of qmatmul_cpu.cpp), rotary, the new keys and values
// written into the KV cache's buffers, the batch-invariant attention (attention_cpu.cpp), the output
// projection, RMS norm, gate/up, SwiGLU, down, and both residuals.
//
// Why: with the matmuls at the memory's speed, a two-core step was still ~30% something else for the
// 0.5B draft (4.1 of its 14 ms: ~30 torch operations per layer, each a dispatch and a pass over memory, and
// ~100 Python calls into the kernels per step; docs/history.md). Here those are a few loops over rows
// that are in cache anyway, and Python pays one call per step.
//
// Batch invariance is the contract, as for the kernels it calls: every row's norm, rotary, SwiGLU and
// residuals are computed by itself with the same operations in the same order whatever the number of
// rows, and the projections and attention are batch-invariant; so a position gets the same bits in a
// prefill, in a verification call beside other rows, or alone. Not the bits of transformers' torch
// operations (their reductions run in another order): equal up to rounding (tests/test_lean.py measures how close).
//
// Layouts (fp32, row r = b·W + w): hidden [B·W, E] in and out; cos, sin [B·W, D] (rotary's tables for each
// row's position); sees [B, W, past + W] uint8 (1: row w of sequence b attends to slot j); each layer's cache
// buffers [B, Hkv, capacity, D], the call's new keys and values written at slots past … past + W - 1.
// Built with the other kernels into one library (specviz.native).

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <chrono>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // as qmatmul_cpu.cpp's 8-bit kernels
#include <immintrin.h>
#define SPECVIZ_DECODER 1
#include "vector_math.h"
#endif

#ifdef SPECVIZ_DECODER
extern "C" {  // the kernels this walks (qmatmul_cpu.cpp, attention_cpu.cpp)
void specviz_q4a8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale,
                         const float* minv, int64_t N, const float* bias, float* y, int nthreads);
void specviz_q8a8_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, int64_t group,
                         int64_t N, const float* bias, float* y, int nthreads);
void specviz_q4a8_half_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* scale,
                              const uint16_t* minv, int64_t N, const float* bias, float* y, int nthreads);
void specviz_q4a8_super_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint8_t* sub,
                               const float* sup, int64_t N, const float* bias, float* y, int nthreads);
void specviz_q8a8_super_matmul(const float* x, int64_t M, int64_t K, const uint8_t* q, const int8_t* sub,
                               const float* sup, int64_t N, const float* bias, float* y, int nthreads);
void specviz_attention(const float* q, const float* k, const float* v, const uint8_t* mask, int64_t B, int64_t H,
                       int64_t Hkv, int64_t L, int64_t S, int64_t Sk, int64_t D, float scale, float* out,
                       int nthreads);
void specviz_attention_f16kv(const float* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask, int64_t B,
                             int64_t H, int64_t Hkv, int64_t L, int64_t S, int64_t Sk, int64_t D, float scale,
                             float* out, int nthreads);
}

// One packed linear layer in the interleaved layout (specviz.models.cpu_kernels.q4_interleave / q8_interleave).
// Mirrored by ctypes in specviz/models/native_forward.py: change both together.
struct Projection {
    const uint8_t* q;
    const void* scale;   // flat scales (fp32, or fp16 where `half`), or null where the two-level ones are given
    const void* minv;    // q4's flat minimums; null for q8
    const void* sub;     // two-level scales (qmatmul_cpu.cpp's SuperQ4 / SuperQ8): uint8 (q4) or int8 (q8), or null
    const float* sup;
    const float* bias;   // [n] or null
    int64_t n;           // output columns
    int64_t group;       // q8's scale group (16 or 32); 32 for q4
    int64_t q4;          // 1: q4, 0: q8
    int64_t half;        // 1: scale and minv are fp16 (q4)
};

struct Layer {
    const float* norm1;  // [E] input_layernorm's weight
    const float* norm2;  // [E] post_attention_layernorm's weight
    double eps1, eps2;
    Projection qkv[3];       // q|k|v fused in qkv[0], or q, k, v
    int64_t qkv_parts;       // 1 or 3
    Projection o;
    Projection gate_up[2];   // gate|up fused in gate_up[0], or gate, up
    int64_t gate_up_parts;   // 1 or 2
    Projection down;
};

// One Whisper decoder layer (pre-norm; LayerNorm with a bias; q scaled after its projection; GELU), for
// specviz_whisper_layers. Mirrored by ctypes in specviz/speech/native_whisper.py: change both together.
struct WhisperLayer {
    const float* norm_weight[3];  // self_attn_layer_norm, encoder_attn_layer_norm, final_layer_norm
    const float* norm_bias[3];
    double eps;
    Projection q, k, v, o;        // self-attention
    Projection cross_q, cross_o;  // cross-attention (its keys and values are the window's, computed once)
    Projection fc1, fc2;
};

namespace {

enum Stage { NORM, QKV, ROTARY_CACHE, ATTENTION, OUTPUT, GATE_UP, SWIGLU, DOWN, RESIDUAL, STAGES };

struct Clock {  // adds each stage's wall time to seconds[stage] where seconds is given
    double* seconds;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void lap(Stage s) {
        if (!seconds) return;
        const auto now = std::chrono::steady_clock::now();
        seconds[s] += std::chrono::duration<double>(now - last).count();
        last = now;
    }
};

void project(const Projection& p, const float* x, int64_t M, int64_t K, float* y, int nthreads) {  // y [M, p.n]
    if (p.sub && p.q4) specviz_q4a8_super_matmul(x, M, K, p.q, static_cast<const uint8_t*>(p.sub), p.sup, p.n, p.bias, y,
                                                 nthreads);
    else if (p.sub) specviz_q8a8_super_matmul(x, M, K, p.q, static_cast<const int8_t*>(p.sub), p.sup, p.n, p.bias, y,
                                              nthreads);
    else if (p.q4 && p.half) specviz_q4a8_half_matmul(x, M, K, p.q, static_cast<const uint16_t*>(p.scale),
                                                      static_cast<const uint16_t*>(p.minv), p.n, p.bias, y, nthreads);
    else if (p.q4) specviz_q4a8_matmul(x, M, K, p.q, static_cast<const float*>(p.scale),
                                       static_cast<const float*>(p.minv), p.n, p.bias, y, nthreads);
    else specviz_q8a8_matmul(x, M, K, p.q, static_cast<const float*>(p.scale), p.group, p.n, p.bias, y, nthreads);
}

// out = weight · x / sqrt(mean(x²) + eps), one row
void rms_norm_row(const float* x, const float* weight, float eps, int64_t E, float* out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= E; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float squares = specviz_math::lanes_sum(acc);
    for (; i < E; ++i) squares += x[i] * x[i];
    const float inv = 1.0f / sqrtf(squares / static_cast<float>(E) + eps);
    for (i = 0; i < E; ++i) out[i] = weight[i] * (x[i] * inv);
}

// out = silu(gate) · up = gate · σ(gate) · up, with σ from e^-|g| (never overflows)
void swiglu_row(const float* gate, const float* up, int64_t I, float* out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = specviz_math::exp_nonpositive(_mm256_or_ps(g, sign));  // e^-|g|
        const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sigma = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  // g < 0: e / (1 + e)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigma), _mm256_loadu_ps(up + i)));
    }
    for (; i < I; ++i) {
        const float e = expf(-fabsf(gate[i])), inv = 1.0f / (1.0f + e);
        out[i] = gate[i] * (gate[i] < 0.0f ? e * inv : inv) * up[i];
    }
}

// rotary on one head's D values: x·cos + rotate_half(x)·sin, rotate_half(x) = (-x[D/2:], x[:D/2])
inline void rotate_head(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] - x[d + half] * sin[d];
    for (int64_t d = half; d < D; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// D values (a multiple of 8) rounded to fp16, to nearest even: each element by itself, so a slot's bits do not
// depend on what else the call writes
inline void store_half(const float* x, int64_t D, uint16_t* out) {
    for (int64_t d = 0; d < D; d += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// out = (x - mean) / sqrt(var + eps) · weight + bias, one row (LayerNorm; two passes, the same order every row)
void layer_norm_row(const float* x, const float* weight, const float* bias, float eps, int64_t E, float* out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= E; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + i));
    float total = specviz_math::lanes_sum(acc);
    for (; i < E; ++i) total += x[i];
    const float mean = total / static_cast<float>(E);
    const __m256 m = _mm256_set1_ps(mean);
    acc = _mm256_setzero_ps();
    for (i = 0; i + 8 <= E; i += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), m);
        acc = _mm256_fmadd_ps(d, d, acc);
    }
    float squares = specviz_math::lanes_sum(acc);
    for (; i < E; ++i) squares += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / sqrtf(squares / static_cast<float>(E) + eps);
    for (i = 0; i < E; ++i) out[i] = (x[i] - mean) * inv * weight[i] + bias[i];
}

// x = GELU(x) = x/2 · (1 + erf(x/√2)) in place, erf by Abramowitz and Stegun 7.1.26 (|error| ≤ 1.5e-7, fp32's
// own scale; a draft's approximation, which moves acceptance, never the output)
void gelu_row(float* x, int64_t I) {
    const __m256 p = _mm256_set1_ps(0.3275911f), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    const __m256 a1 = _mm256_set1_ps(0.254829592f), a2 = _mm256_set1_ps(-0.284496736f),
                 a3 = _mm256_set1_ps(1.421413741f), a4 = _mm256_set1_ps(-1.453152027f),
                 a5 = _mm256_set1_ps(1.061405429f), root_half = _mm256_set1_ps(0.70710678118654752f),
                 sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(sign, v), root_half);  // |x| / √2
        const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(p, z, one));
        __m256 poly = _mm256_fmadd_ps(a5, t, a4);
        poly = _mm256_fmadd_ps(poly, t, a3);
        poly = _mm256_fmadd_ps(poly, t, a2);
        poly = _mm256_fmadd_ps(poly, t, a1);
        poly = _mm256_mul_ps(poly, t);
        const __m256 e = specviz_math::exp_nonpositive(_mm256_xor_ps(_mm256_mul_ps(z, z), sign));  // e^-z²
        const __m256 erf_abs = _mm256_fnmadd_ps(poly, e, one);
        const __m256 erf = _mm256_or_ps(erf_abs, _mm256_and_ps(sign, v));  // erf is odd
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, erf)));
    }
    for (; i < I; ++i) x[i] = 0.5f * x[i] * (1.0f + erff(x[i] * 0.70710678118654752f));
}

constexpr int64_t MAX_HEAD_DIM = 512;  // a rotated key's room on the stack before it is rounded to fp16

}  // namespace
#endif

extern "C" {

int specviz_has_decoder() {
#ifdef SPECVIZ_DECODER
    return 1;
#else
    return 0;
#endif
}

#ifdef SPECVIZ_DECODER
// The layers' forward over hidden [B·W, E] in place (see the top of the file). keys / values: per layer its cache
// buffers, fp32, or fp16 where kv_half (a draft's: half the bytes its attention reads over a long context, its
// keys and values rounded as they are written; D ≤ MAX_HEAD_DIM); I: the MLP's width; seconds: null, or [9] to
// which each stage's wall time is added (norm, qkv, rotary + cache write, attention, output projection, gate/up,
// SwiGLU, down, residuals).
void specviz_decoder_layers(float* hidden, const Layer* layers, int64_t n_layers, void* const* keys,
                            void* const* values, int64_t kv_half, int64_t capacity, int64_t past, const float* cos,
                            const float* sin,
                            const uint8_t* sees, int64_t B, int64_t W, int64_t E, int64_t H, int64_t Hkv, int64_t D,
                            int64_t I, float scaling, double* seconds, int nthreads) {
    const int64_t M = B * W, HD = H * D, KD = Hkv * D;
    const bool parallel_rows = M >= 16;  // below, one thread is quicker than waking the other
    std::vector<float> xn(M * E), qkv(M * (HD + 2 * KD)), qrot(M * HD), att(M * HD), proj(M * E);
    std::vector<float> gate_up(M * 2 * I), act(M * I);
    Clock clock{seconds};
    for (int64_t l = 0; l < n_layers; ++l) {
        const Layer& L = layers[l];
        float* kbuf = static_cast<float*>(keys[l]);
        float* vbuf = static_cast<float*>(values[l]);
        uint16_t* khalf = static_cast<uint16_t*>(keys[l]);
        uint16_t* vhalf = static_cast<uint16_t*>(values[l]);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel_rows)
        for (int64_t r = 0; r < M; ++r)
            rms_norm_row(hidden + r * E, L.norm1, static_cast<float>(L.eps1), E, xn.data() + r * E);
        clock.lap(NORM);

        // q, k, v: rows of one [M, HD + 2KD] block (fused) or three blocks one after another
        const float *qs, *ks, *vs;
        int64_t stride;
        if (L.qkv_parts == 1) {
            project(L.qkv[0], xn.data(), M, E, qkv.data(), nthreads);
            qs = qkv.data(), ks = qs + HD, vs = ks + KD, stride = HD + 2 * KD;
        } else {
            project(L.qkv[0], xn.data(), M, E, qkv.data(), nthreads);
            project(L.qkv[1], xn.data(), M, E, qkv.data() + M * HD, nthreads);
            project(L.qkv[2], xn.data(), M, E, qkv.data() + M * (HD + KD), nthreads);
            qs = qkv.data(), ks = qs + M * HD, vs = ks + M * KD, stride = 0;
        }
        clock.lap(QKV);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel_rows)
        for (int64_t r = 0; r < M; ++r) {
            const int64_t b = r / W, w = r % W;
            const float* qr = qs + r * (stride ? stride : HD);
            const float* kr = ks + r * (stride ? stride : KD);
            const float* vr = vs + r * (stride ? stride : KD);
            const float *c = cos + r * D, *s = sin + r * D;
            for (int64_t h = 0; h < H; ++h) rotate_head(qr + h * D, c, s, D, qrot.data() + ((b * H + h) * W + w) * D);
            for (int64_t h = 0; h < Hkv; ++h) {
                const int64_t slot = ((b * Hkv + h) * capacity + past + w) * D;
                if (kv_half) {
                    alignas(32) float rotated[MAX_HEAD_DIM];
                    rotate_head(kr + h * D, c, s, D, rotated);
                    store_half(rotated, D, khalf + slot);
                    store_half(vr + h * D, D, vhalf + slot);
                } else {
                    rotate_head(kr + h * D, c, s, D, kbuf + slot);
                    memcpy(vbuf + slot, vr + h * D, sizeof(float) * D);
                }
            }
        }
        clock.lap(ROTARY_CACHE);
        if (kv_half)
            specviz_attention_f16kv(qrot.data(), khalf, vhalf, sees, B, H, Hkv, W, past + W, capacity, D, scaling,
                                    att.data(), nthreads);
        else
            specviz_attention(qrot.data(), kbuf, vbuf, sees, B, H, Hkv, W, past + W, capacity, D, scaling,
                              att.data(), nthreads);
        clock.lap(ATTENTION);
        project(L.o, att.data(), M, HD, proj.data(), nthreads);
        clock.lap(OUTPUT);
        for (int64_t i = 0; i < M * E; ++i) hidden[i] += proj[i];
        clock.lap(RESIDUAL);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel_rows)
        for (int64_t r = 0; r < M; ++r)
            rms_norm_row(hidden + r * E, L.norm2, static_cast<float>(L.eps2), E, xn.data() + r * E);
        clock.lap(NORM);

        const float *gs, *us;
        if (L.gate_up_parts == 1) {
            project(L.gate_up[0], xn.data(), M, E, gate_up.data(), nthreads);
            gs = gate_up.data(), us = gs + I, stride = 2 * I;
        } else {
            project(L.gate_up[0], xn.data(), M, E, gate_up.data(), nthreads);
            project(L.gate_up[1], xn.data(), M, E, gate_up.data() + M * I, nthreads);
            gs = gate_up.data(), us = gs + M * I, stride = I;
        }
        clock.lap(GATE_UP);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel_rows)
        for (int64_t r = 0; r < M; ++r) swiglu_row(gs + r * stride, us + r * stride, I, act.data() + r * I);
        clock.lap(SWIGLU);
        project(L.down, act.data(), M, I, proj.data(), nthreads);
        clock.lap(DOWN);
        for (int64_t i = 0; i < M * E; ++i) hidden[i] += proj[i];
        clock.lap(RESIDUAL);
    }
}

// Whisper's decoder layers over hidden [B·W, E] in place, for a speech draft (its projections on the
// 8-bit-activation kernels): per layer LayerNorm, q (times scaling), k, v, the new keys and values into the
// self-attention cache's buffers (fp32, or fp16 where kv_half), self-attention, out_proj and the residual;
// LayerNorm, cross q (times scaling), attention over the window's keys and values cross_keys / cross_values
// [B, H, frames, D] (fp16 where cross_half, else fp32), cross out_proj and the residual; LayerNorm, fc1, GELU,
// fc2 and the residual. sees [B, W, past + W] as for specviz_decoder_layers; every head is its own key head.
// Batch-invariant as the rest of this file: each row by itself, the same operations whatever the call.
void specviz_whisper_layers(float* hidden, const WhisperLayer* layers, int64_t n_layers, void* const* keys,
                            void* const* values, int64_t kv_half, int64_t capacity, int64_t past,
                            const uint8_t* sees, const void* const* cross_keys, const void* const* cross_values,
                            int64_t cross_half, int64_t frames, int64_t B, int64_t W, int64_t E, int64_t H,
                            int64_t D, int64_t I, float scaling, int nthreads) {
    const int64_t M = B * W;
    const bool parallel_rows = M >= 16;  // below, one thread is quicker than waking the other
    std::vector<float> xn(M * E), q(M * E), k(M * E), v(M * E), qh(M * E), att(M * E), proj(M * E), mlp(M * I);
    const std::vector<uint8_t> sees_all(M * frames, 1);
    // rows' q times scaling, [M, E] -> [B, H, W, D] as the attention kernel takes them
    auto heads_first = [&](const float* x) {
        for (int64_t r = 0; r < M; ++r) {
            const int64_t b = r / W, w = r % W;
            for (int64_t h = 0; h < H; ++h)
                for (int64_t d = 0; d < D; ++d) qh[((b * H + h) * W + w) * D + d] = x[r * E + h * D + d] * scaling;
        }
    };
    auto norm = [&](const WhisperLayer& L, int which) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel_rows)
        for (int64_t r = 0; r < M; ++r)
            layer_norm_row(hidden + r * E, L.norm_weight[which], L.norm_bias[which], static_cast<float>(L.eps), E,
                           xn.data() + r * E);
    };
    auto add = [&](const Projection& p, const float* x, int64_t K) {  // hidden += p(x)
        project(p, x, M, K, proj.data(), nthreads);
        for (int64_t i = 0; i < M * E; ++i) hidden[i] += proj[i];
    };
    for (int64_t l = 0; l < n_layers; ++l) {
        const WhisperLayer& L = layers[l];
        norm(L, 0);
        project(L.q, xn.data(), M, E, q.data(), nthreads);
        project(L.k, xn.data(), M, E, k.data(), nthreads);
        project(L.v, xn.data(), M, E, v.data(), nthreads);
        heads_first(q.data());
        for (int64_t r = 0; r < M; ++r) {
            const int64_t b = r / W, w = r % W;
            for (int64_t h = 0; h < H; ++h) {
                const int64_t slot = ((b * H + h) * capacity + past + w) * D;
                if (kv_half) {
                    store_half(k.data() + r * E + h * D, D, static_cast<uint16_t*>(keys[l]) + slot);
                    store_half(v.data() + r * E + h * D, D, static_cast<uint16_t*>(values[l]) + slot);
                } else {
                    memcpy(static_cast<float*>(keys[l]) + slot, k.data() + r * E + h * D, sizeof(float) * D);
                    memcpy(static_cast<float*>(values[l]) + slot, v.data() + r * E + h * D, sizeof(float) * D);
                }
            }
        }
        if (kv_half)
            specviz_attention_f16kv(qh.data(), static_cast<const uint16_t*>(keys[l]),
                                    static_cast<const uint16_t*>(values[l]), sees, B, H, H, W, past + W, capacity, D,
                                    1.0f, att.data(), nthreads);
        else
            specviz_attention(qh.data(), static_cast<const float*>(keys[l]), static_cast<const float*>(values[l]),
                              sees, B, H, H, W, past + W, capacity, D, 1.0f, att.data(), nthreads);
        add(L.o, att.data(), E);

        norm(L, 1);
        project(L.cross_q, xn.data(), M, E, q.data(), nthreads);
        heads_first(q.data());
        if (cross_half)
            specviz_attention_f16kv(qh.data(), static_cast<const uint16_t*>(cross_keys[l]),
                                    static_cast<const uint16_t*>(cross_values[l]), sees_all.data(), B, H, H, W, frames,
                                    frames, D, 1.0f, att.data(), nthreads);
        else
            specviz_attention(qh.data(), static_cast<const float*>(cross_keys[l]),
                              static_cast<const float*>(cross_values[l]), sees_all.data(), B, H, H, W, frames, frames,
                              D, 1.0f, att.data(), nthreads);
        add(L.cross_o, att.data(), E);

        norm(L, 2);
        project(L.fc1, xn.data(), M, E, mlp.data(), nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel_rows)
        for (int64_t r = 0; r < M; ++r) gelu_row(mlp.data() + r * I, I);
        add(L.fc2, mlp.data(), I);
    }
}

// The final norm: out [rows, E] = each row of x [rows, E] RMS-normalized and scaled by weight [E] (as the layers'
// own norms: a row's result is its own, whatever else is in the call).
void specviz_rms_norm_rows(const float* x, const float* weight, float eps, int64_t rows, int64_t E, float* out) {
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * E, weight, eps, E, out + r * E);
}
#endif

}  // extern "C"
