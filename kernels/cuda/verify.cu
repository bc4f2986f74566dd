// Speculative-sampling verification on the GPU: Wagner et al. (2024) §3.2.1 ("exact") and §3.2.2
// ("sigmoid"), deciding exactly as the torch path in specviz/verify/tiled.py does.
//
// Inputs: target logits zp [B, γ+1, V], draft logits zq [B, γ, V] (fp32, fp16 or bf16; last dimension
// contiguous, batch and row strides free, so expand()ed tensors need no copy), drafted tokens [B, γ]
// int64, uniforms u [B, γ] and u_res [B] fp32 drawn by the caller. Outputs are small: per row the number
// of accepted drafts, the next token and error codes (int64), per drafted position min(1, ratio), p(x)
// and q(x) (fp32). No full-vocabulary tensor is ever written.
//
// exact, two launches:
//   1. sv_exact_stats_*    grid (K1, 2γ+1, B) (sv_exact_stats_topk_* with top-k, sv_exact_stats_topp_*
//      with top-p, alone or after top-k: each variant compiles only what it needs, for registers):
//      block (c, r, b) reduces chunk c of row r (target rows
//      0..γ, then draft rows 0..γ-1) to (max, Σ exp(z - max)) with z = scale·logit, one read of each
//      logit, and writes the pair to partials[b, r, c]. A chunk holding NaN / +inf stores NaN / +inf as
//      its max: the error flag. With top-k (topk > 0) the block also lists its chunk's k largest values
//      (radix select over the order-preserving bits of scale·x, four 8-bit histogram passes over the
//      chunk, which L2 still holds; no sort) into cand[b, r, c, 0..k) and the count of further ties.
//      With top-k or top-p the last block of row (b, r) (ticket per row) then finds the row's
//      threshold and the normalizer of the values kept, rowstat[b, r] = (threshold, L): see "Top-k and
//      top-p" below.
//   2. sv_exact_resample_* grid (K2, B): every block merges the partials into log-normalizers
//      L = m + log(s) (redundantly, they are a few KB), computes p(x_j), q(x_j), the ratios and n
//      (identically in every block; filtered rows take (threshold, L) from rowstat), then the residual
//      mass of its chunk of row n, max(0, p - w·q) with
//      w = l for a rejection and w = 0 for the bonus, plus the plain p mass (the fallback when the
//      residual has no mass). The last block of batch b to finish (threadfence + atomic ticket; it
//      resets the counter for the next call) scans the chunk masses, then the chosen chunk, and writes
//      next_token.
// sigmoid, one launch (two with top-k or top-p: sv_exact_stats_topk_* / _topp_* first, for the rows'
// thresholds, then sv_sigmoid_filtered_*, which masks with them):
//   sv_sigmoid_*           grid (K2, 2γ+1, B): p̂ = σ((scale·z - α)/(β - α)) needs no normalizer. Block
//      (c, r, b) validates chunk c of row r (atomicOr of error bits into a per-row word); the blocks with
//      r == n also form the residual mass of chunk c. The last block of batch b finishes as above.
//
// Sampling (tiled.py's _scan_pick, twice): goal = u_res·total; the chunk is the first whose cumulative
// mass exceeds goal (searchsorted right=True), clamped to the last chunk with positive mass; inside it,
// the first token whose cumulative residual exceeds goal - (mass before the chunk), clamped likewise.
// Only entries with positive mass are ever picked.
//
// State: counters [B] (ticket per batch row) and error words [B, 2γ+1] (sigmoid: error bits per row;
// sv_exact_stats_topk_* / _topp_*: tickets per stacked row, the same words, free again before the
// sigmoid launch that follows it on the stream) must be zero before a launch; the last block of each
// batch row (or stacked row) sets its entries back to zero, so one zeroed buffer serves every later call
// on the same stream. Workspace (partials, masses) needs no initialization.
//
// Top-k and top-p (`specviz.sampling.standardize`: temperature, then top-k, then top-p), both modes. A
// value z = scale·x below its row's threshold is masked to -inf before exp or the sigmoid, as
// `standardize` masks; the wrapper passes scale = fp32(1) / fp32(T), the factor torch on CUDA multiplies
// by for `z / T`. Thresholds, found by the last block of each row in launch 1:
//   top-k: kth = the k-th largest z, by radix select over the K1 chunk lists; values equal to kth are
//      kept, as `z < kth` keeps them. L = m + log Σ_{z >= kth} exp(z - m).
//   top-p: a token is dropped when the mass of the values strictly larger than its own (after top-k)
//      reaches top_p (compared as fp32(top_p), as torch compares a float32 tensor with a Python float);
//      the largest value always stays. The threshold is the smallest kept value, found by a radix select
//      weighted by mass instead of count (sv_mass_select): 8-bit digits from the most significant, each
//      pass a 256-bin histogram of Σ exp(z - m) over the keys that match the digits chosen so far. Masses
//      are fixed point (sv_mass), so every sum is exact and independent of the order of the atomics:
//      the result is deterministic and a digit's mass equals the sum of its sub-digits at the next pass.
//      Without top-k the passes read the row itself (one block, from L2): two passes for fp16 / bf16,
//      whose 16-bit values order the row as z does, four for fp32 (keys of z); with top-k they read the
//      K1·k candidates instead, no pass over the vocabulary. L = m + log of the kept mass.
//   Ties: every token equal to a threshold stays. For top-k that is standardize's rule; for top-p it is
//      a choice: torch's sort orders exactly tied values arbitrarily and drops those after the first
//      one whose exclusive mass reaches top_p, so where tied values straddle the boundary the kernels
//      keep the whole tie (all of them, or none when the mass before the tie already reaches top_p).
//   The exclusive masses are exact sums of fp32 probabilities here and fp32 cumsums in torch: a token
//   whose exclusive mass lies within float32 noise of top_p can fall either way.
//
// Arithmetic that decides outcomes repeats torch's fp32 operations on CUDA, unfused (__fmul_rn etc.):
// scale·z, z - L, exp, l·q, p / (l·q), p - w·q, and for sigmoid (z - α)·(fp32(1) / fp32(β - α)) (torch on
// CUDA divides a float tensor by a Python scalar as a multiplication by that fp32 reciprocal) and
// 1 / (1 + exp(-t)). Given the same normalizer L, a per-element probability is then the same fp32
// expression as torch's; that it is the same bits also assumes torch's CUDA exp is the same expf as
// NVRTC's (both the precise libdevice one unless fast math is on), which no test here checks (the CPU
// emulator runs the host's expf). L itself, and every sum, runs in a different order than torch's, so
// near-ties can fall differently. SPECVIZ_EMULATE is defined only by the CPU emulator in the tests.
//
// Rules kept throughout: every __syncthreads / __syncthreads_or is reached by all threads of the block
// (the only early exit is the block-uniform "not the last block" return); warp shuffles run with all 32
// lanes; reductions handle any count (no power-of-two assumption); chunk sizes need not divide V; all
// offsets into logits are 64-bit. No headers are included, so NVRTC compiles this file as it is.

typedef long long sv_i64;

#define SV_THREADS 256
#define SV_WARPS (SV_THREADS / 32)
#define SV_MAX_GAMMA 256
#define SV_MAX_ROWS (2 * SV_MAX_GAMMA + 1)
#define SV_UNROLL 4
#define SV_FULL 0xffffffffu
#define SV_INT_MAX 0x7fffffff

// Error bits per logit row.
#define SV_NAN 1
#define SV_POSINF 2
#define SV_ONLY_NEGINF 4
#define SV_FINITE 8  // seen a finite value (sigmoid pass only; exact reads it off the row max)

__device__ __forceinline__ float sv_neg_inf() { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ float sv_pos_inf() { return __uint_as_float(0x7f800000u); }
__device__ __forceinline__ float sv_nan() { return __uint_as_float(0x7fffffffu); }
__device__ __forceinline__ sv_i64 sv_min64(sv_i64 a, sv_i64 b) { return a < b ? a : b; }

// ------------------------------------------------------------------------------------------------
// Order-preserving keys (radix selects)
// ------------------------------------------------------------------------------------------------

// Unsigned key with the order of the floats (-inf lowest; NaN above +inf, only in rows that raise).
// -0 is keyed as +0: they are one value for the masking comparison z < threshold.
__device__ __forceinline__ unsigned int sv_key(float f) {
  if (f == 0.0f) f = 0.0f;
  const unsigned int u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float sv_unkey(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The same for the bits of an fp16 or bf16 value (both are sign-magnitude), in the low 16 bits.
__device__ __forceinline__ unsigned int sv_key16(unsigned short h) {
  unsigned int u = h;
  if ((u & 0x7fffu) == 0u) u = 0u;  // -0 keyed as +0
  return (u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u);
}
__device__ __forceinline__ unsigned short sv_unkey16(unsigned int k) {
  return (unsigned short)((k & 0x8000u) ? (k & 0x7fffu) : (~k & 0xffffu));
}

// ------------------------------------------------------------------------------------------------
// Logit storage types
// ------------------------------------------------------------------------------------------------

// value: the logit as fp32. topp_key / topp_threshold / TOPP_PASSES: the key by which top-p ranks a
// row read straight from the logits (sv_row_items), the threshold on z = scale·x that a key stands for,
// and how many 8-bit digits the key has. fp32 keys z itself: two logits may round to one z, and such
// ties must share a key. fp16 / bf16 key the stored bits: scale·x is strictly increasing on them
// (neighbouring 16-bit values lie at least 2^-11 apart relative to their size, fp32 rounds at 2^-24), so
// they order the row exactly as z does, with half the digits.
struct sv_f32 {
  typedef float T;
  enum { TOPP_PASSES = 4 };
  static __device__ __forceinline__ float value(float v) { return v; }
  static __device__ __forceinline__ float load(const float* p, sv_i64 i) { return p[i]; }
  static __device__ __forceinline__ unsigned int topp_key(float v, float scale) {
    return sv_key(__fmul_rn(v, scale));
  }
  static __device__ __forceinline__ float topp_threshold(unsigned int key, float) { return sv_unkey(key); }
};

struct sv_f16 {
  typedef unsigned short T;
  enum { TOPP_PASSES = 2 };
  static __device__ __forceinline__ float value(unsigned short h) {
#ifdef SPECVIZ_EMULATE
    return sv_emu_half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
  }
  static __device__ __forceinline__ float load(const unsigned short* p, sv_i64 i) { return value(p[i]); }
  static __device__ __forceinline__ unsigned int topp_key(unsigned short h, float) { return sv_key16(h) << 16; }
  static __device__ __forceinline__ float topp_threshold(unsigned int key, float scale) {
    return __fmul_rn(value(sv_unkey16(key >> 16)), scale);
  }
};

struct sv_bf16 {
  typedef unsigned short T;
  enum { TOPP_PASSES = 2 };
  static __device__ __forceinline__ float value(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
  static __device__ __forceinline__ float load(const unsigned short* p, sv_i64 i) { return value(p[i]); }
  static __device__ __forceinline__ unsigned int topp_key(unsigned short h, float) { return sv_key16(h) << 16; }
  static __device__ __forceinline__ float topp_threshold(unsigned int key, float scale) {
    return __fmul_rn(value(sv_unkey16(key >> 16)), scale);
  }
};

// One thread's share of a pass over row[.. end): v[k] = row[i + k·SV_THREADS] as fp32, -inf past end
// (neither NaN, +inf nor finite, and no mass).
template <class D>
__device__ __forceinline__ void sv_load_unrolled(const typename D::T* row, sv_i64 i, sv_i64 end,
                                                 float (&v)[SV_UNROLL]) {
#pragma unroll
  for (int k = 0; k < SV_UNROLL; ++k) {
    const sv_i64 col = i + (sv_i64)k * SV_THREADS;
    v[k] = col < end ? D::load(row, col) : sv_neg_inf();
  }
}

// ------------------------------------------------------------------------------------------------
// Probabilities, exactly as torch computes them (tiled.py `_Probs.__call__`)
// ------------------------------------------------------------------------------------------------

// exact: exp(scale·x - L); sigmoid: 1 / (1 + exp(-((scale·x - α) / (β - α)))). torch on CUDA divides a
// float tensor by a Python scalar as a multiplication by 1.0f / float(scalar), so the wrapper passes
// inv_den = fp32(1) / fp32(β - α) and this multiplies. thr: the row's top-k / top-p threshold (-inf:
// none); a value below it is masked to -inf first, as `standardize` does, which gives probability 0 in
// both modes.
template <bool SIG>
__device__ __forceinline__ float sv_prob(float x, float scale, float L, float alpha, float inv_den, float thr) {
  float z = __fmul_rn(x, scale);
  if (z < thr) z = sv_neg_inf();
  if (SIG) {
    const float t = __fmul_rn(__fsub_rn(z, alpha), inv_den);
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-t)));
  }
  return expf(__fsub_rn(z, L));
}

// ------------------------------------------------------------------------------------------------
// Online (max, Σ exp(z - max)) pairs
// ------------------------------------------------------------------------------------------------

// Merge (m2, s2) into (m, s). Empty pairs are (-inf, 0); exp(-inf - (-inf)) is never evaluated.
__device__ __forceinline__ void sv_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == sv_neg_inf()) {
    m = M;
    s = 0.0f;
    return;
  }
  // A side at -inf contributes s·exp(-inf) = 0. Unfused, so that merge(a, b) == merge(b, a) bitwise.
  s = __fadd_rn(__fmul_rn(s, expf(m - M)), __fmul_rn(s2, expf(m2 - M)));
  m = M;
}

// Every lane of the warp ends with the merge of all 32 pairs, bitwise the same on every lane (the merge
// is symmetric in its two arguments).
__device__ __forceinline__ void sv_warp_merge(float& m, float& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(SV_FULL, m, off);
    const float s2 = __shfl_xor_sync(SV_FULL, s, off);
    sv_merge(m, s, m2, s2);
  }
}

__device__ __forceinline__ int sv_warp_or(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v |= __shfl_xor_sync(SV_FULL, v, off);
  return v;
}

__device__ __forceinline__ float sv_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(SV_FULL, v, off);
  return v;
}

// Inclusive prefix sum of v over the lanes of the warp, in lane order (float or sv_u64). Call from all 32 lanes.
template <class T>
__device__ __forceinline__ T sv_warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const T t = __shfl_up_sync(SV_FULL, v, off);
    if (lane >= off) v += t;
  }
  return v;
}

// Sums a and c over the block; every thread gets the totals. Call from all threads. sh: 2·SV_WARPS.
__device__ __forceinline__ void sv_block_sum2(float& a, float& c, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  a = sv_warp_sum(a);
  c = sv_warp_sum(c);
  if (lane == 0) {
    sh[warp] = a;
    sh[SV_WARPS + warp] = c;
  }
  __syncthreads();
  a = 0.0f;
  c = 0.0f;
  for (int w = 0; w < SV_WARPS; ++w) {
    a += sh[w];
    c += sh[SV_WARPS + w];
  }
  __syncthreads();  // sh may be reused right after
}

// Exclusive prefix sum of v over the threads of the block, in thread order. Call from all threads.
__device__ __forceinline__ float sv_block_exclusive_scan(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float incl = sv_warp_inclusive_scan(v);
  float excl = __shfl_up_sync(SV_FULL, incl, 1);
  if (lane == 0) excl = 0.0f;
  if (lane == 31) sh[warp] = incl;
  __syncthreads();
  float base = 0.0f;
  for (int w = 0; w < warp; ++w) base += sh[w];
  __syncthreads();
  return base + excl;
}

// ------------------------------------------------------------------------------------------------
// Top-k: radix select on order-preserving keys (no sort)
// ------------------------------------------------------------------------------------------------

// Keys of scale·x for the columns of one logit row segment (launch 1) ...
template <class D>
struct sv_logit_keys {
  const typename D::T* row;
  float scale;
  __device__ __forceinline__ unsigned int operator()(sv_i64 i) const { return sv_key(__fmul_rn(D::load(row, i), scale)); }
};
// ... and of candidate values already scaled (the row merge at the end of launch 1).
struct sv_value_keys {
  const float* v;
  __device__ __forceinline__ unsigned int operator()(sv_i64 i) const {
    return sv_key(((const volatile float*)v)[i]);  // written by other blocks of the launch
  }
};

// The key of the k-th largest of get(0..n-1), 1 <= k <= n: four passes of an 8-bit histogram from the most
// significant digit down. Every thread returns the same key, *gt the number of larger keys and *eq the
// number of keys equal to it. hist: 256 shared words; misc: 3 shared ints. Call from all threads.
template <class G>
__device__ __forceinline__ unsigned int sv_select(const G& get, sv_i64 n, int k, unsigned int* hist, int* misc,
                                                  int* gt, int* eq) {
  unsigned int prefix = 0u, mask = 0u;
  int rank = k, above_all = 0, equal = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += SV_THREADS) hist[i] = 0u;
    __syncthreads();
    for (sv_i64 i = threadIdx.x; i < n; i += SV_THREADS) {
      const unsigned int key = get(i);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0, d = 255;
      for (; d > 0; --d) {  // the highest digit whose keys reach the rank still wanted
        const int h = (int)hist[d];
        if (above + h >= rank) break;
        above += h;
      }
      misc[0] = d;
      misc[1] = above;
      misc[2] = (int)hist[d];
    }
    __syncthreads();
    prefix |= (unsigned int)misc[0] << shift;
    mask |= 255u << shift;
    rank -= misc[1];
    above_all += misc[1];
    equal = misc[2];
    __syncthreads();  // misc and hist are rewritten by the next pass
  }
  *gt = above_all;
  *eq = equal;
  return prefix;
}

// ------------------------------------------------------------------------------------------------
// Top-p: radix select weighted by probability mass (no sort)
// ------------------------------------------------------------------------------------------------

typedef unsigned long long sv_u64;

// Probability mass in fixed point: exp(z - m) (<= 1, m the row max) times 2^F, truncated, with
// F = 62 - floor(log2 V), so that the masses of a row's V tokens sum below 2^63. Integer sums are exact,
// so the histograms' shared-memory atomics give the same bits in any order (float atomics would not:
// the threshold and the normalizer would change from run to run), and every pass recomputes bitwise the
// same masses. What truncation drops is below 2^-F per token, V·2^-F in all: under 2^-26 of the row
// max's mass for V < 2^18.
__device__ __forceinline__ int sv_mass_bits(sv_i64 V) { return 62 - (63 - __clzll(V)); }
__device__ __forceinline__ float sv_pow2(int e) { return __uint_as_float((unsigned int)(127 + e) << 23); }
__device__ __forceinline__ sv_u64 sv_mass(float z, float m, float one) {
  return (sv_u64)__fmul_rn(expf(__fsub_rn(z, m)), one);  // one = 2^F; exp(-inf) = 0
}

// ceil(top_p · total), at most total: a value is kept while the mass of the larger values is below it.
// At least 1 (top_p > 0, total > 0), so the largest value, with nothing above it, always stays.
__device__ __forceinline__ sv_u64 sv_topp_goal(float top_p, sv_u64 total) {
  const double g = (double)top_p * (double)total;
  sv_u64 goal = (sv_u64)g;
  if ((double)goal < g) ++goal;
  return goal < total ? goal : total;
}

// Inclusive prefix sum of v over the threads of the block, in thread order; *total: the block's sum.
// Integer, so exact. Call from all threads. sh: SV_WARPS words.
__device__ __forceinline__ sv_u64 sv_block_inclusive_scan_u64(sv_u64 v, sv_u64* sh, sv_u64* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const sv_u64 incl = sv_warp_inclusive_scan(v);
  if (lane == 31) sh[warp] = incl;
  __syncthreads();
  sv_u64 base = 0ull, all = 0ull;
  for (int w = 0; w < SV_WARPS; ++w) {
    if (w < warp) base += sh[w];
    all += sh[w];
  }
  __syncthreads();  // sh may be reused right after
  *total = all;
  return base + incl;
}

static_assert(SV_THREADS == 256, "sv_mass_select gives each thread one of the 256 digits");

// Aggregation stops at the first group (the lowest pending lane and the lanes sharing its digit) smaller
// than this; every lane still pending then adds its own mass (digits spread out: few lanes share a word).
#define SV_AGGREGATE_MIN 2

// hist[digit] += mass on the lanes where live; call from all 32 lanes of the warp. sm_90 has no 64-bit
// shared-memory add: atomicAdd compiles to a compare-and-swap loop that retries once per lane writing the
// same word. A logit row puts most of its values in a few digits (pass 0's digit is the sign and the
// exponent's top bits), so a warp first sums in registers the masses of each digit that two or more lanes
// share and one lane adds the sum: one atomic per digit and warp instead of one per lane. Measured on an
// H100 at V = 151,936, B = 1, gamma = 5, fp32, top-p 0.9: 2.36 ms of GPU time per call before this, 1.70-1.73 after.
// Integer sums: the histogram has the same bits in any order.
__device__ __forceinline__ void sv_hist_add(sv_u64* hist, unsigned int digit, sv_u64 mass, bool live) {
  const int lane = threadIdx.x & 31;
  unsigned int pending = __ballot_sync(SV_FULL, live);
  while (pending) {  // warp-uniform
    const int leader = __ffs(pending) - 1;
    const unsigned int shared_digit = __shfl_sync(SV_FULL, digit, leader);
    const bool mine = live && digit == shared_digit;
    const unsigned int group = __ballot_sync(SV_FULL, mine);
    if (__popc(group) < SV_AGGREGATE_MIN) break;  // warp-uniform; the live lanes left add one by one
    sv_u64 sum = mine ? mass : 0ull;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(SV_FULL, sum, off);
    if (lane == leader) atomicAdd(&hist[shared_digit], sum);
    live = live && !mine;
    pending &= ~group;
  }
  if (live) atomicAdd(&hist[digit], mass);
}

// Top-p threshold of items(0..n-1): the largest key K whose inclusive mass (the mass of the keys >= K)
// reaches goal = sv_topp_goal(top_p, total mass); the keys above K then hold less than the goal, and
// every key >= K is kept (ties with K included). *kept: the mass of the keys >= K. `passes` 8-bit digits
// from bit 31 down (the keys' remaining bits must be zero). items.get(i, mask, prefix, &key, &mass):
// false when entry i's key does not match prefix under mask, else its key and fixed-point mass.
//
// Invariant, pass by pass: above (the mass of keys whose digits so far exceed the prefix) < goal <=
// above + the mass matching the prefix. Thread t owns digit 255 - t, so an inclusive scan over the
// threads is the mass from the top digit down to its own; exactly one thread sees its scan cross the
// goal, and that digit extends the prefix. Integer masses keep the invariant exact: a digit's mass is
// the total of the next pass. Every thread returns the same key. Call from all threads.
template <class G>
__device__ __forceinline__ unsigned int sv_mass_select(const G& items, sv_i64 n, int passes, float top_p,
                                                       sv_u64* kept) {
  __shared__ sv_u64 s_hist[256];
  __shared__ sv_u64 s_scan[SV_WARPS];
  __shared__ sv_u64 s_cross[2];
  __shared__ int s_digit;
  unsigned int prefix = 0u, mask = 0u;
  sv_u64 above = 0ull, goal = 0ull, inside = 0ull;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 24 - 8 * pass;
    s_hist[threadIdx.x] = 0ull;
    __syncthreads();
    // The same trip count in every thread (sv_hist_add's warp primitives need all 32 lanes).
    for (sv_i64 i = 0; i < n; i += (sv_i64)SV_THREADS * SV_UNROLL) {
#pragma unroll
      for (int u = 0; u < SV_UNROLL; ++u) {
        const sv_i64 j = i + threadIdx.x + (sv_i64)u * SV_THREADS;
        unsigned int key = 0u;
        sv_u64 mass = 0ull;
        const bool live = j < n && items.get(j, mask, prefix, key, mass) && mass != 0ull;
        sv_hist_add(s_hist, (key >> shift) & 255u, mass, live);
      }
    }
    __syncthreads();
    const int digit = 255 - (int)threadIdx.x;
    const sv_u64 h = s_hist[digit];
    sv_u64 total;
    const sv_u64 incl = sv_block_inclusive_scan_u64(h, s_scan, &total);
    if (pass == 0) goal = sv_topp_goal(top_p, total);
    const int crosses = above + (incl - h) < goal && above + incl >= goal;
    if (crosses) {
      s_digit = digit;
      s_cross[0] = above + (incl - h);
      s_cross[1] = above + incl;
    }
    if (__syncthreads_or(crosses)) {
      prefix |= (unsigned int)s_digit << shift;
      above = s_cross[0];
      inside = s_cross[1];
    } else {  // only if the invariant broke (it cannot): keep the whole prefix range
      inside = above + total;
      above = inside - s_hist[0];
    }
    mask |= 255u << shift;
    __syncthreads();  // s_hist, s_digit and s_cross are rewritten by the next pass
  }
  *kept = inside;
  return prefix;
}

// Top-p items read straight from one logit row (no top-k): key and mass of z = scale·x.
template <class D>
struct sv_row_items {
  const typename D::T* row;
  float scale, m, one;
  __device__ __forceinline__ bool get(sv_i64 i, unsigned int mask, unsigned int prefix, unsigned int& key,
                                      sv_u64& mass) const {
    const typename D::T v = row[i];
    key = D::topp_key(v, scale);
    if ((key & mask) != prefix) return false;
    mass = sv_mass(__fmul_rn(D::value(v), scale), m, one);
    return true;
  }
};

// Top-p items after top-k: the K1 chunk lists of launch 1 (written by other blocks: read through
// volatile), entries < kth weighing nothing, then one entry per chunk for its unlisted ties with its
// k-th value t_c, weighing their count where t_c == kth (as sv_topk_normalizer counts them).
struct sv_cand_items {
  const float* list;  // [K1·k]
  const int* extra;   // [K1]
  sv_i64 listed;      // K1·k
  int k;
  float kth, m, one;
  __device__ __forceinline__ bool get(sv_i64 i, unsigned int mask, unsigned int prefix, unsigned int& key,
                                      sv_u64& mass) const {
    const volatile float* vl = list;
    float v;
    sv_u64 weight = 1ull;
    if (i < listed) {
      v = vl[i];
    } else {
      const sv_i64 c = i - listed;
      v = vl[c * k + k - 1];
      const int e = ((const volatile int*)extra)[c];
      weight = e > 0 ? (sv_u64)e : 0ull;
    }
    key = sv_key(v);
    if ((key & mask) != prefix) return false;
    mass = v >= kth && weight != 0ull ? weight * sv_mass(v, m, one) : 0ull;
    return true;
  }
};

// ------------------------------------------------------------------------------------------------
// Shared context
// ------------------------------------------------------------------------------------------------

template <class D>
struct sv_ctx {
  typedef typename D::T T;
  const T* zp;
  sv_i64 p_sb, p_sr;  // target strides (elements): batch, row
  const T* zq;
  sv_i64 q_sb, q_sr;  // draft strides
  const sv_i64* tokens;  // [B, γ] contiguous
  const float* u;        // [B, γ] contiguous
  const float* u_res;    // [B]
  int B, gamma;
  sv_i64 V;
  float scale, lenience, alpha, inv_den;
  sv_i64* out_i64;  // [n_accepted (B) | next_token (B) | errors (5·B)]
  float* out_f32;   // [accept_prob | p_draft | q_draft | uniforms], B·γ each

  __device__ __forceinline__ const T* prow(int b, int r) const {
    return zp + (sv_i64)b * p_sb + (sv_i64)r * p_sr;
  }
  __device__ __forceinline__ const T* qrow(int b, int j) const {
    return zq + (sv_i64)b * q_sb + (sv_i64)j * q_sr;
  }
  // Row r of the stacked [target rows 0..γ, draft rows 0..γ-1] numbering.
  __device__ __forceinline__ const T* row(int b, int r) const {
    return r <= gamma ? prow(b, r) : qrow(b, r - gamma - 1);
  }
};

// max(0, p - w·q) at column i, as torch's `torch.clamp(probs(zp) - w * probs(zq), min=0)`. With w == 0
// the draft row is not read: p - 0·q == p exactly for every finite q.
template <class D, bool SIG>
__device__ __forceinline__ float sv_residual_at(const sv_ctx<D>& x, const typename D::T* prow,
                                                const typename D::T* qrow, sv_i64 i, float Lp, float Lq,
                                                float Tp, float Tq, float w) {
  const float p = sv_prob<SIG>(D::load(prow, i), x.scale, Lp, x.alpha, x.inv_den, Tp);
  float wq = 0.0f;
  if (w != 0.0f) wq = __fmul_rn(w, sv_prob<SIG>(D::load(qrow, i), x.scale, Lq, x.alpha, x.inv_den, Tq));
  return fmaxf(__fsub_rn(p, wq), 0.0f);
}

// Ratios at the drafted tokens and the number accepted, n = index of the first rejection (γ if none),
// left in *s_first; the first out-of-range drafted token in *s_badtok. Identical in every block (the same
// operations on the same values). `write`: this block stores accept_prob, p_draft, q_draft and a copy of u.
// L: shared log-normalizers of the stacked rows (exact); unused for sigmoid. T: shared top-k / top-p
// thresholds of the stacked rows, or null (neither). Call from all threads;
// *s_first and *s_badtok must hold γ and a barrier must separate that from this call.
template <class D, bool SIG>
__device__ __forceinline__ void sv_accept(const sv_ctx<D>& x, int b, const float* L, const float* T,
                                          bool write, int* s_first, int* s_badtok) {
  for (int j = threadIdx.x; j < x.gamma; j += SV_THREADS) {
    sv_i64 tok = x.tokens[(sv_i64)b * x.gamma + j];
    const bool ok = tok >= 0 && tok < x.V;
    if (!ok) {
      atomicMin(s_badtok, j);
      tok = 0;  // keep the reads in bounds; the wrapper raises
    }
    const float lp = SIG ? 0.0f : L[j];
    const float lq = SIG ? 0.0f : L[x.gamma + 1 + j];
    const float tp = T ? T[j] : sv_neg_inf();
    const float tq = T ? T[x.gamma + 1 + j] : sv_neg_inf();
    const float px = sv_prob<SIG>(D::load(x.prow(b, j), tok), x.scale, lp, x.alpha, x.inv_den, tp);
    const float qx = sv_prob<SIG>(D::load(x.qrow(b, j), tok), x.scale, lq, x.alpha, x.inv_den, tq);
    const float ratio = __fdiv_rn(px, __fmul_rn(x.lenience, qx));
    const sv_i64 o = (sv_i64)b * x.gamma + j;
    const bool accepted = ok && x.u[o] <= ratio;  // NaN (0/0) compares false: rejected
    if (!accepted) atomicMin(s_first, j);
    if (write) {
      const sv_i64 bg = (sv_i64)x.B * x.gamma;
      x.out_f32[o] = ratio != ratio ? 0.0f : fminf(ratio, 1.0f);  // +inf -> 1, like nan_to_num + clamp
      x.out_f32[bg + o] = px;
      x.out_f32[2 * bg + o] = qx;
      x.out_f32[3 * bg + o] = x.u[o];
    }
  }
}

// Residual mass (and plain p mass) of columns [start, end) of target row n against draft row qn,
// coalesced. Per-thread partial sums; the caller reduces them over the block.
template <class D, bool SIG>
__device__ __forceinline__ void sv_chunk_mass(const sv_ctx<D>& x, const typename D::T* prow,
                                              const typename D::T* qrow, sv_i64 start, sv_i64 end,
                                              float Lp, float Lq, float Tp, float Tq, float w, float& rsum,
                                              float& psum) {
  for (sv_i64 i = start + threadIdx.x; i < end; i += (sv_i64)SV_THREADS * SV_UNROLL) {
    float zp[SV_UNROLL], zq[SV_UNROLL];
#pragma unroll
    for (int k = 0; k < SV_UNROLL; ++k) {
      const sv_i64 col = i + (sv_i64)k * SV_THREADS;
      zp[k] = col < end ? D::load(prow, col) : 0.0f;
      zq[k] = (w != 0.0f && col < end) ? D::load(qrow, col) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < SV_UNROLL; ++k) {
      const sv_i64 col = i + (sv_i64)k * SV_THREADS;
      if (col < end) {
        const float p = sv_prob<SIG>(zp[k], x.scale, Lp, x.alpha, x.inv_den, Tp);
        float wq = 0.0f;
        if (w != 0.0f) wq = __fmul_rn(w, sv_prob<SIG>(zq[k], x.scale, Lq, x.alpha, x.inv_den, Tq));
        rsum += fmaxf(__fsub_rn(p, wq), 0.0f);
        psum += p;
      }
    }
  }
}

// The last block of batch b: error report, chunk scan, scan inside the chosen chunk, outputs.
// s_flag: shared error bits per stacked row (R = 2γ+1 entries). masses: [K2] pairs (residual, p) of
// batch b, written by other blocks: read through volatile after the caller's __threadfence.
// Call from all threads of the block.
template <class D, bool SIG>
__device__ __forceinline__ void sv_finish(const sv_ctx<D>& x, int b, int n, float Lp, float Lq, float Tp, float Tq,
                                          const int* s_flag, const float* masses, int K2, sv_i64 chunk2,
                                          int badtok, float* s_red) {
  __shared__ int s_bad_draft, s_bad_target, s_k, s_sel, s_jmin, s_jmax;
  __shared__ float s_goal2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = 2 * x.gamma + 1;
  if (threadIdx.x == 0) {
    s_bad_draft = R;
    s_bad_target = R;
    s_jmin = SV_INT_MAX;
    s_jmax = -1;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += SV_THREADS) {
    if (s_flag[r]) atomicMin(r <= x.gamma ? &s_bad_target : &s_bad_draft, r);
  }

  // Chunk level (warp 0): total, fallback to plain p when the residual has no mass, goal, scan.
  if (warp == 0) {
    const volatile float* vm = masses;
    float total = 0.0f;
    for (int c = lane; c < K2; c += 32) total += vm[2 * c];
    total = sv_warp_sum(total);  // the same value on every lane
    int sel = 0;
    if (total <= 0.0f) {  // tiled.py: `if (total <= 0)`: sample p instead (w = 0)
      sel = 1;
      total = 0.0f;
      for (int c = lane; c < K2; c += 32) total += vm[2 * c + 1];
      total = sv_warp_sum(total);
    }
    const float goal = __fmul_rn(x.u_res[b], total);
    float carry = 0.0f;  // cumulative mass of the chunks before this group of 32
    int found = -1, lastpos = -1;
    float found_before = 0.0f, lastpos_before = 0.0f;
    for (int base = 0; base < K2; base += 32) {  // the same trip count on every lane
      const int c = base + lane;
      const float v = c < K2 ? vm[2 * c + sel] : 0.0f;
      const float incl = sv_warp_inclusive_scan(v) + carry;
      float excl = __shfl_up_sync(SV_FULL, incl, 1);  // cumulative mass before chunk c
      if (lane == 0) excl = carry;
      const unsigned above = __ballot_sync(SV_FULL, c < K2 && v > 0.0f && incl > goal);
      const unsigned positive = __ballot_sync(SV_FULL, c < K2 && v > 0.0f);
      if (found < 0 && above != 0u) {  // warp-uniform
        const int l = __ffs(above) - 1;
        found = base + l;
        found_before = __shfl_sync(SV_FULL, excl, l);
      }
      if (positive != 0u) {  // warp-uniform
        const int l = 31 - __clz(positive);
        lastpos = base + l;
        lastpos_before = __shfl_sync(SV_FULL, excl, l);
      }
      carry = __shfl_sync(SV_FULL, incl, 31);
    }
    // searchsorted(right=True) gives `found` (K2 when no cumulative mass exceeds goal); never past the
    // last chunk with positive mass (chunk 0 when there is none).
    const int idx = found >= 0 ? found : K2;
    const int lp = lastpos >= 0 ? lastpos : 0;
    int k;
    float before;
    if (idx <= lp) {
      k = idx;
      before = found_before;
    } else {
      k = lp;
      before = lastpos >= 0 ? lastpos_before : 0.0f;
    }
    if (lane == 0) {
      s_k = k;
      s_sel = sel;
      s_goal2 = __fsub_rn(goal, before);
    }
  }
  __syncthreads();

  // Inside chunk k: each thread scans a contiguous run of columns, in column order.
  const int k = s_k;
  const float w = s_sel ? 0.0f : (n < x.gamma ? x.lenience : 0.0f);
  const float goal2 = s_goal2;
  const int qn = n < x.gamma ? n : x.gamma - 1;
  const typename D::T* prow = x.prow(b, n);
  const typename D::T* qrow = x.qrow(b, qn);
  const sv_i64 cstart = (sv_i64)k * chunk2;
  const sv_i64 count = sv_min64(chunk2, x.V - cstart);
  const sv_i64 per = (count + SV_THREADS - 1) / SV_THREADS;
  const sv_i64 lo = sv_min64((sv_i64)threadIdx.x * per, count);
  const sv_i64 hi = sv_min64(lo + per, count);
  float run = 0.0f;
  for (sv_i64 i = lo; i < hi; ++i) run += sv_residual_at<D, SIG>(x, prow, qrow, cstart + i, Lp, Lq, Tp, Tq, w);
  float cum = sv_block_exclusive_scan(run, s_red);
  int first = SV_INT_MAX, lastp = -1;
  for (sv_i64 i = lo; i < hi; ++i) {
    const float r = sv_residual_at<D, SIG>(x, prow, qrow, cstart + i, Lp, Lq, Tp, Tq, w);
    cum += r;
    if (r > 0.0f) {
      if (first == SV_INT_MAX && cum > goal2) first = (int)i;
      lastp = (int)i;
    }
  }
  if (first != SV_INT_MAX) atomicMin(&s_jmin, first);
  if (lastp >= 0) atomicMax(&s_jmax, lastp);
  __syncthreads();

  if (threadIdx.x == 0) {
    const int lpos = s_jmax >= 0 ? s_jmax : 0;
    const int j = s_jmin < lpos ? s_jmin : lpos;
    x.out_i64[b] = n;
    x.out_i64[x.B + b] = cstart + j;
    sv_i64* e = x.out_i64 + 2 * (sv_i64)x.B + 5 * (sv_i64)b;
    const int d = s_bad_draft, t = s_bad_target;
    e[0] = d < R ? d - x.gamma - 1 : -1;  // first bad draft row (position j)
    e[1] = d < R ? s_flag[d] : 0;
    e[2] = t < R ? t : -1;  // first bad target row
    e[3] = t < R ? s_flag[t] : 0;
    e[4] = badtok < x.gamma ? badtok : -1;  // first drafted token outside [0, V)
  }
}

// ------------------------------------------------------------------------------------------------
// exact, launch 1: per-chunk (max, sum) of every row
// ------------------------------------------------------------------------------------------------

// Top-k candidates of one chunk (n columns from start): the chunk's k largest values of scale·x, in column
// order of the larger ones, then copies of the chunk's k-th largest t_c; *extra = how many more columns
// equal t_c than were listed. A chunk of n <= k columns lists them all and pads with -inf (extra 0).
// The row's k-th largest is then the k-th largest of the union of its chunks' lists, and every column
// >= it is either listed or one of the extras of a chunk whose t_c equals it. Call from all threads.
template <class D>
__device__ __forceinline__ void sv_chunk_topk(const typename D::T* row, float scale, sv_i64 start, sv_i64 n,
                                              int k, float* list, int* extra) {
  __shared__ unsigned int s_hist[256];
  __shared__ int s_misc[3];
  __shared__ float s_scan[SV_WARPS];
  sv_logit_keys<D> keys;
  keys.row = row + start;
  keys.scale = scale;
  const bool all = n <= (sv_i64)k;  // block-uniform
  unsigned int tkey = 0u;
  int gt = (int)n, eq = 0;
  if (!all) tkey = sv_select(keys, n, k, s_hist, s_misc, &gt, &eq);
  // Deterministic compaction: thread t lists the qualifying columns of its contiguous run, in order,
  // after those of threads < t (an exclusive scan of the counts), so every run writes the same list.
  const sv_i64 per = (n + SV_THREADS - 1) / SV_THREADS;
  const sv_i64 lo = sv_min64((sv_i64)threadIdx.x * per, n);
  const sv_i64 hi = sv_min64(lo + per, n);
  int count = 0;
  for (sv_i64 i = lo; i < hi; ++i) count += (all || keys(i) > tkey) ? 1 : 0;
  int at = (int)sv_block_exclusive_scan((float)count, s_scan);  // counts < 2^24: exact in fp32
  for (sv_i64 i = lo; i < hi; ++i) {
    const unsigned int key = keys(i);
    if (all || key > tkey) list[at++] = sv_unkey(key);
  }
  const float fill = all ? sv_neg_inf() : sv_unkey(tkey);
  for (int i = gt + threadIdx.x; i < k; i += SV_THREADS) list[i] = fill;
  if (threadIdx.x == 0) *extra = all ? 0 : eq - (k - gt);
}

// Block-wide max (NaN ignored, as fmaxf does); every thread gets it. sh: SV_WARPS floats.
__device__ __forceinline__ float sv_block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(SV_FULL, v, off));
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < SV_WARPS; ++w) v = fmaxf(v, sh[w]);
  __syncthreads();
  return v;
}

// The max of row (b, r) from launch 1's partials ([K1] (max, sum) pairs, written by other blocks: read
// through volatile after the caller's fence), and whether the row raises: a NaN / +inf chunk, or no
// finite value (launch 2 and the sigmoid launch flag such rows; they get no thresholds). Every thread
// gets both. sh: SV_WARPS floats. Call from all threads.
__device__ __forceinline__ float sv_row_max(const float* partials, int K1, int* bad, float* sh) {
  const volatile float* pr = partials;
  float m = sv_neg_inf();
  int flag = 0;
  for (int c = threadIdx.x; c < K1; c += SV_THREADS) {
    const float mc = pr[2 * c];
    flag |= mc != mc || mc == sv_pos_inf();  // a chunk's NaN / +inf flag
    m = fmaxf(m, mc);  // skips NaN; a +inf comes with the flag
  }
  const int any = __syncthreads_or(flag);
  m = sv_block_max(m, sh);
  *bad = any || m == sv_neg_inf();
  return m;
}

// Top-k threshold of a row: the k-th largest of its K1 chunk lists (list [K1·k], volatile reads), which is
// the row's k-th largest value. Every thread gets it. Call from all threads.
__device__ __forceinline__ float sv_topk_threshold(const float* list, int K1, int k) {
  __shared__ unsigned int s_hist[256];
  __shared__ int s_misc[3];
  sv_value_keys keys;
  keys.v = list;
  int gt, eq;
  return sv_unkey(sv_select(keys, (sv_i64)K1 * k, k, s_hist, s_misc, &gt, &eq));
}

// Log-normalizer m + log Σ exp(z - m) of a top-k row's kept columns (value >= kth, ties included, as
// torch's `z < kth` mask keeps them): the listed ones and each chunk's unlisted ties with its k-th value
// where that equals kth (list [K1·k], extra [K1], volatile reads). m: the row max. Call from all threads.
__device__ __forceinline__ float sv_topk_normalizer(const float* list_, const int* extra_, int K1, int k,
                                                    float kth, float m) {
  __shared__ float s_red[2 * SV_WARPS];
  const volatile float* list = list_;
  const volatile int* extra = extra_;
  const sv_i64 n = (sv_i64)K1 * k;
  float sum = 0.0f, unused = 0.0f;
  for (sv_i64 i = threadIdx.x; i < n; i += SV_THREADS) {
    const float v = list[i];
    if (v >= kth) sum += expf(v - m);
  }
  for (int ch = threadIdx.x; ch < K1; ch += SV_THREADS) {
    const int e = extra[ch];
    if (e > 0 && list[(sv_i64)ch * k + k - 1] == kth) sum += (float)e * expf(kth - m);
  }
  sv_block_sum2(sum, unused, s_red);
  return m + logf(sum);
}

// The last block of row (b, r) in launch 1: rowstat = (threshold, L), the smallest value the row keeps
// and the log-normalizer of the kept values, for top-k (topk > 0) and / or top-p (top_p < 1; see the
// header). With top-k, top-p ranks the K1·k candidates (4 passes over them, none over the row); without,
// it reads the row itself (D::TOPP_PASSES passes). row: the logits [V]; partials [K1] pairs; list
// [K1·topk] and extra [K1]: the chunk lists (top-k only). TOPP: compile the top-p code in (it needs ~20
// more registers, which would cost the top-k-only launch occupancy). Call from all threads.
template <class D, bool TOPP>
__device__ __forceinline__ void sv_row_thresholds(const typename D::T* row, sv_i64 V, float scale,
                                                  const float* partials, int K1, int topk, float top_p,
                                                  const float* list, const int* extra, float* rowstat) {
  __shared__ float s_max[SV_WARPS];
  int bad;
  const float m = sv_row_max(partials, K1, &bad, s_max);
  if (bad) {  // block-uniform
    if (threadIdx.x == 0) {
      rowstat[0] = sv_neg_inf();
      rowstat[1] = sv_neg_inf();
    }
    return;
  }
  const float kth = topk > 0 ? sv_topk_threshold(list, K1, topk) : sv_neg_inf();
  float thr = kth, L;
  if (TOPP && top_p < 1.0f) {  // block-uniform, as is topk
    const int F = sv_mass_bits(V);
    sv_u64 kept;
    if (topk > 0) {
      const sv_cand_items items{list, extra, (sv_i64)K1 * topk, topk, kth, m, sv_pow2(F)};
      thr = sv_unkey(sv_mass_select(items, (sv_i64)K1 * topk + K1, 4, top_p, &kept));
    } else {
      const sv_row_items<D> items{row, scale, m, sv_pow2(F)};
      thr = D::topp_threshold(sv_mass_select(items, V, D::TOPP_PASSES, top_p, &kept), scale);
    }
    L = m + logf(__fmul_rn((float)kept, sv_pow2(-F)));
  } else {
    L = sv_topk_normalizer(list, extra, K1, topk, kth, m);
  }
  if (threadIdx.x == 0) {
    rowstat[0] = thr;
    rowstat[1] = L;
  }
}

__device__ __forceinline__ void sv_online(float xv, float scale, float& m, float& s, int& bad) {
  if (xv != xv) {
    bad |= SV_NAN;
    return;
  }
  if (xv == sv_pos_inf()) {
    bad |= SV_POSINF;
    return;
  }
  const float z = __fmul_rn(xv, scale);
  if (z > m) {
    s = s * expf(m - z) + 1.0f;  // m == -inf: exp(-inf) = 0
    m = z;
  } else if (z != sv_neg_inf()) {
    s += expf(z - m);  // here m >= z > -inf
  }
}

// FILTER: which entry point. SV_PLAIN (sv_exact_stats_*): statistics only; SV_TOPK
// (sv_exact_stats_topk_*): and top-k (the wrapper passes top_p = 1); SV_TOPP (sv_exact_stats_topp_*): and
// top-p, with or without top-k. Each leaves out the code it does not need, so that its registers (and the
// occupancy of this bandwidth-bound pass) stay low: 24, 39 and 62 for sm_90.
#define SV_PLAIN 0
#define SV_TOPK 1
#define SV_TOPP 2
template <class D, int FILTER>
__device__ __forceinline__ void sv_exact_stats(const typename D::T* zp, sv_i64 p_sb, sv_i64 p_sr,
                                               const typename D::T* zq, sv_i64 q_sb, sv_i64 q_sr,
                                               int gamma, sv_i64 V, float scale, sv_i64 chunk1,
                                               float* partials, int topk, float top_p, float* cand,
                                               int* cextra, float* rowstat, unsigned int* tickets) {
  __shared__ float sh_m[SV_WARPS], sh_s[SV_WARPS];
  __shared__ int s_last;
  const int c = blockIdx.x, r = blockIdx.y, b = blockIdx.z;
  const int K1 = gridDim.x, R = gridDim.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const typename D::T* row = r <= gamma ? zp + (sv_i64)b * p_sb + (sv_i64)r * p_sr
                                        : zq + (sv_i64)b * q_sb + (sv_i64)(r - gamma - 1) * q_sr;
  const sv_i64 start = (sv_i64)c * chunk1;
  const sv_i64 end = sv_min64(start + chunk1, V);
  float m = sv_neg_inf(), s = 0.0f;
  int bad = 0;
  for (sv_i64 i = start + threadIdx.x; i < end; i += (sv_i64)SV_THREADS * SV_UNROLL) {
    float v[SV_UNROLL];
    sv_load_unrolled<D>(row, i, end, v);  // -inf pads are skipped
#pragma unroll
    for (int k = 0; k < SV_UNROLL; ++k) sv_online(v[k], scale, m, s, bad);
  }
  sv_warp_merge(m, s);
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
  }
  const int any_nan = __syncthreads_or(bad & SV_NAN);
  const int any_inf = __syncthreads_or(bad & SV_POSINF);
  if (warp == 0) {
    float mm = lane < SV_WARPS ? sh_m[lane] : sv_neg_inf();
    float ss = lane < SV_WARPS ? sh_s[lane] : 0.0f;
    sv_warp_merge(mm, ss);
    if (lane == 0) {
      float* out = partials + (((sv_i64)b * R + r) * K1 + c) * 2;
      out[0] = any_nan ? sv_nan() : (any_inf ? sv_pos_inf() : mm);
      out[1] = ss;
    }
  }
  if (FILTER == SV_PLAIN || (topk <= 0 && !(top_p < 1.0f))) return;  // block-uniform (same in every block)
  const sv_i64 br = (sv_i64)b * R + r;
  if (topk > 0) {
    sv_chunk_topk<D>(row, scale, start, end - start, topk, cand + (br * K1 + c) * topk, cextra + br * K1 + c);
  }
  __threadfence();  // this thread's writes (list entries, partials) are visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int ticket = atomicAdd(&tickets[br], 1u);
    s_last = ticket == (unsigned int)K1 - 1u;
  }
  __syncthreads();
  if (!s_last) return;  // block-uniform: the last block of row (b, r) finds its thresholds
  if (threadIdx.x == 0) tickets[br] = 0u;  // every block of the row has taken its ticket: reset
  __threadfence();
  sv_row_thresholds<D, FILTER == SV_TOPP>(row, V, scale, partials + br * K1 * 2, K1, topk, top_p,
                                          cand + br * K1 * topk, cextra + br * K1, rowstat + br * 2);
}

// ------------------------------------------------------------------------------------------------
// exact, launch 2: normalizers, n, residual chunk masses, and the last block samples
// ------------------------------------------------------------------------------------------------

template <class D>
__device__ __forceinline__ void sv_exact_resample(const sv_ctx<D>& x, sv_i64 chunk2, int K1,
                                                  const float* partials, float* masses,
                                                  unsigned int* counters, int filtered, const float* rowstat) {
  __shared__ float s_L[SV_MAX_ROWS], s_T[SV_MAX_ROWS];
  __shared__ int s_flag[SV_MAX_ROWS];
  __shared__ float s_red[2 * SV_WARPS];
  __shared__ int s_first, s_badtok, s_last;
  const int c = blockIdx.x, b = blockIdx.y;
  const int K2 = gridDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gamma = x.gamma, R = 2 * gamma + 1;
  if (threadIdx.x == 0) {
    s_first = gamma;
    s_badtok = gamma;
  }
  // Log-normalizer of every row: tiled.py's online_logsumexp, m + log(s).
  for (int r = warp; r < R; r += SV_WARPS) {  // warp-uniform loop
    const float* pr = partials + ((sv_i64)b * R + r) * K1 * 2;
    float m = sv_neg_inf(), s = 0.0f;
    int bits = 0;
    for (int k = lane; k < K1; k += 32) {
      const float mk = pr[2 * k], sk = pr[2 * k + 1];
      if (mk != mk) {
        bits |= SV_NAN;
      } else if (mk == sv_pos_inf()) {
        bits |= SV_POSINF;
      } else {
        sv_merge(m, s, mk, sk);
      }
    }
    sv_warp_merge(m, s);
    bits = sv_warp_or(bits);
    if (lane == 0) {
      if (bits == 0 && m == sv_neg_inf()) bits = SV_ONLY_NEGINF;
      s_L[r] = m + logf(s);  // filtered rows: replaced below by launch 1's normalizer of the kept values
      s_T[r] = sv_neg_inf();
      s_flag[r] = bits;
    }
  }
  __syncthreads();
  if (filtered) {  // thresholds and normalizers of the top-k / top-p rows, from launch 1
    for (int r = threadIdx.x; r < R; r += SV_THREADS) {
      const float* rs = rowstat + ((sv_i64)b * R + r) * 2;
      s_T[r] = rs[0];
      if (s_flag[r] == 0) s_L[r] = rs[1];
    }
    __syncthreads();
  }

  sv_accept<D, false>(x, b, s_L, filtered ? s_T : (const float*)0, c == 0, &s_first, &s_badtok);
  __syncthreads();
  const int n = s_first;
  const int qn = n < gamma ? n : gamma - 1;
  const float w = n < gamma ? x.lenience : 0.0f;
  const float Lp = s_L[n], Lq = s_L[gamma + 1 + qn];
  const float Tp = s_T[n], Tq = s_T[gamma + 1 + qn];

  float rsum = 0.0f, psum = 0.0f;
  const sv_i64 start = (sv_i64)c * chunk2;
  sv_chunk_mass<D, false>(x, x.prow(b, n), x.qrow(b, qn), start, sv_min64(start + chunk2, x.V), Lp, Lq,
                          Tp, Tq, w, rsum, psum);
  sv_block_sum2(rsum, psum, s_red);

  float* mb = masses + (sv_i64)b * K2 * 2;
  if (threadIdx.x == 0) {
    mb[2 * c] = rsum;
    mb[2 * c + 1] = psum;
    __threadfence();  // the masses are visible device-wide before the ticket is taken
    const unsigned int ticket = atomicAdd(&counters[b], 1u);
    s_last = ticket == (unsigned int)K2 - 1u;
  }
  __syncthreads();
  if (!s_last) return;  // block-uniform: the whole block leaves, or none of it
  if (threadIdx.x == 0) counters[b] = 0u;  // every block of batch b has taken its ticket: reset
  __threadfence();
  sv_finish<D, false>(x, b, n, Lp, Lq, Tp, Tq, s_flag, mb, K2, chunk2, s_badtok, s_red);
}

// ------------------------------------------------------------------------------------------------
// sigmoid: one launch (after launch 1 of exact when filtered)
// ------------------------------------------------------------------------------------------------

// FILTER: the entry point sv_sigmoid_filtered_*, whose rows have top-k / top-p thresholds in rowstat (from
// sv_exact_stats_topk_* / _topp_*); the plain one keeps the registers of the unfiltered pass.
template <class D, bool FILTER>
__device__ __forceinline__ void sv_sigmoid(const sv_ctx<D>& x, sv_i64 chunk2, float* masses,
                                           int* rowflags, unsigned int* counters, const float* rowstat) {
  __shared__ int s_flag[SV_MAX_ROWS];
  __shared__ float s_T[SV_MAX_ROWS];
  __shared__ float s_red[2 * SV_WARPS];
  __shared__ int s_first, s_badtok, s_last;
  const int c = blockIdx.x, r = blockIdx.y, b = blockIdx.z;
  const int K2 = gridDim.x, R = gridDim.y;
  const int gamma = x.gamma;
  if (threadIdx.x == 0) {
    s_first = gamma;
    s_badtok = gamma;
  }
  // top-k / top-p thresholds of the stacked rows, from the sv_exact_stats_* launch before this one
  if (FILTER) {
    for (int rr = threadIdx.x; rr < R; rr += SV_THREADS) s_T[rr] = rowstat[((sv_i64)b * R + rr) * 2];
  }
  __syncthreads();
  sv_accept<D, true>(x, b, (const float*)0, FILTER ? s_T : (const float*)0, c == 0 && r == 0, &s_first,
                     &s_badtok);
  __syncthreads();
  const int n = s_first;
  const int qn = n < gamma ? n : gamma - 1;
  const float w = n < gamma ? x.lenience : 0.0f;
  const float Tp = FILTER ? s_T[n] : sv_neg_inf(), Tq = FILTER ? s_T[gamma + 1 + qn] : sv_neg_inf();
  const bool role = r == n;  // block-uniform: this block also forms the residual mass of chunk c

  // Validate chunk c of row r; when r is target row n, form the residual from the same reads.
  const typename D::T* row = x.row(b, r);
  const typename D::T* qrow = x.qrow(b, qn);
  const sv_i64 start = (sv_i64)c * chunk2;
  const sv_i64 end = sv_min64(start + chunk2, x.V);
  float rsum = 0.0f, psum = 0.0f;
  int bad = 0;
  for (sv_i64 i = start + threadIdx.x; i < end; i += (sv_i64)SV_THREADS * SV_UNROLL) {
    float v[SV_UNROLL];
    sv_load_unrolled<D>(row, i, end, v);
#pragma unroll
    for (int k = 0; k < SV_UNROLL; ++k) {
      const float xv = v[k];
      if (xv != xv) {
        bad |= SV_NAN;
      } else if (xv == sv_pos_inf()) {
        bad |= SV_POSINF;
      } else if (xv != sv_neg_inf()) {
        bad |= SV_FINITE;
      }
      const sv_i64 col = i + (sv_i64)k * SV_THREADS;
      if (role && col < end) {
        const float p = sv_prob<true>(xv, x.scale, 0.0f, x.alpha, x.inv_den, Tp);
        float wq = 0.0f;
        if (w != 0.0f) wq = __fmul_rn(w, sv_prob<true>(D::load(qrow, col), x.scale, 0.0f, x.alpha, x.inv_den, Tq));
        rsum += fmaxf(__fsub_rn(p, wq), 0.0f);
        psum += p;
      }
    }
  }
  const int any_nan = __syncthreads_or(bad & SV_NAN);
  const int any_inf = __syncthreads_or(bad & SV_POSINF);
  const int any_fin = __syncthreads_or(bad & SV_FINITE);
  sv_block_sum2(rsum, psum, s_red);

  int* fb = rowflags + (sv_i64)b * R;
  float* mb = masses + (sv_i64)b * K2 * 2;
  if (threadIdx.x == 0) {
    const int bits = (any_nan ? SV_NAN : 0) | (any_inf ? SV_POSINF : 0) | (any_fin ? SV_FINITE : 0);
    if (bits) atomicOr(&fb[r], bits);
    if (role) {
      mb[2 * c] = rsum;
      mb[2 * c + 1] = psum;
    }
    __threadfence();
    const unsigned int ticket = atomicAdd(&counters[b], 1u);
    s_last = ticket == (unsigned int)K2 * (unsigned int)R - 1u;
  }
  __syncthreads();
  if (!s_last) return;  // block-uniform
  if (threadIdx.x == 0) counters[b] = 0u;
  __threadfence();
  for (int rr = threadIdx.x; rr < R; rr += SV_THREADS) {
    volatile int* f = fb + rr;
    const int bits = *f;
    *f = 0;  // zero again for the next call
    int flag = bits & (SV_NAN | SV_POSINF);
    if (flag == 0 && !(bits & SV_FINITE)) flag = SV_ONLY_NEGINF;
    s_flag[rr] = flag;
  }
  __syncthreads();
  sv_finish<D, true>(x, b, n, 0.0f, 0.0f, Tp, Tq, s_flag, mb, K2, chunk2, s_badtok, s_red);
}

// ------------------------------------------------------------------------------------------------
// Entry points (extern "C": plain names for CuPy's RawModule.get_function)
// ------------------------------------------------------------------------------------------------

#define SV_CTX_PARAMS                                                                              \
  const TT *zp, sv_i64 p_sb, sv_i64 p_sr, const TT *zq, sv_i64 q_sb, sv_i64 q_sr,                  \
      const sv_i64 *tokens, const float *u, const float *u_res, int B, int gamma, sv_i64 V,        \
      float scale, float lenience, float alpha, float inv_den, sv_i64 *out_i64, float *out_f32

#define SV_FILL_CTX(DT)                                                                            \
  sv_ctx<DT> x;                                                                                    \
  x.zp = zp;                                                                                       \
  x.p_sb = p_sb;                                                                                   \
  x.p_sr = p_sr;                                                                                   \
  x.zq = zq;                                                                                       \
  x.q_sb = q_sb;                                                                                   \
  x.q_sr = q_sr;                                                                                   \
  x.tokens = tokens;                                                                               \
  x.u = u;                                                                                         \
  x.u_res = u_res;                                                                                 \
  x.B = B;                                                                                         \
  x.gamma = gamma;                                                                                 \
  x.V = V;                                                                                         \
  x.scale = scale;                                                                                 \
  x.lenience = lenience;                                                                           \
  x.alpha = alpha;                                                                                 \
  x.inv_den = inv_den;                                                                             \
  x.out_i64 = out_i64;                                                                             \
  x.out_f32 = out_f32;

#define SV_STATS_ENTRY(NAME, DT, FILTER)                                                           \
  extern "C" __global__ void __launch_bounds__(SV_THREADS) NAME(                                   \
      const DT::T* zp, sv_i64 p_sb, sv_i64 p_sr, const DT::T* zq, sv_i64 q_sb, sv_i64 q_sr,        \
      int gamma, sv_i64 V, float scale, sv_i64 chunk1, float* partials, int topk, float top_p,     \
      float* cand, int* cextra, float* rowstat, unsigned int* tickets) {                           \
    sv_exact_stats<DT, FILTER>(zp, p_sb, p_sr, zq, q_sb, q_sr, gamma, V, scale, chunk1, partials,  \
                               topk, top_p, cand, cextra, rowstat, tickets);                       \
  }

#define SV_SIGMOID_ENTRY(NAME, DT, FILTER)                                                         \
  extern "C" __global__ void __launch_bounds__(SV_THREADS) NAME(                                   \
      SV_CTX_PARAMS, sv_i64 chunk2, float* masses, int* rowflags, unsigned int* counters,          \
      const float* rowstat) {                                                                      \
    SV_FILL_CTX(DT)                                                                                \
    sv_sigmoid<DT, FILTER>(x, chunk2, masses, rowflags, counters, rowstat);                        \
  }

#define SV_ENTRY_POINTS(SUFFIX, DT)                                                                \
  SV_STATS_ENTRY(sv_exact_stats_##SUFFIX, DT, SV_PLAIN)                                            \
  SV_STATS_ENTRY(sv_exact_stats_topk_##SUFFIX, DT, SV_TOPK)                                        \
  SV_STATS_ENTRY(sv_exact_stats_topp_##SUFFIX, DT, SV_TOPP)                                        \
  extern "C" __global__ void __launch_bounds__(SV_THREADS) sv_exact_resample_##SUFFIX(             \
      SV_CTX_PARAMS, sv_i64 chunk2, int K1, const float* partials, float* masses,                  \
      unsigned int* counters, int filtered, const float* rowstat) {                               \
    SV_FILL_CTX(DT)                                                                                \
    sv_exact_resample<DT>(x, chunk2, K1, partials, masses, counters, filtered, rowstat);           \
  }                                                                                                \
  SV_SIGMOID_ENTRY(sv_sigmoid_##SUFFIX, DT, false)                                                 \
  SV_SIGMOID_ENTRY(sv_sigmoid_filtered_##SUFFIX, DT, true)

#define TT sv_f32::T
SV_ENTRY_POINTS(f32, sv_f32)
#undef TT
#define TT sv_f16::T
SV_ENTRY_POINTS(f16, sv_f16)
#undef TT
#define TT sv_bf16::T
SV_ENTRY_POINTS(bf16, sv_bf16)
#undef TT
