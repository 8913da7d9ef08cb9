// Attention of each frame to itself over one flat sequence, float32 on x86-64 CPUs (encoder process).
//
// The CPU counterpart of a variable-length attention kernel: q, k, v are [rows, heads, head_dim]
// with frames lying back to back from row 0 (lengths given, zero-padded); rows after the last
// frame are padding and come out as zeros. It computes exactly softmax(q k^T / sqrt(d)) v per
// frame and head, the same math as torch's scaled_dot_product_attention, without a mask and
// without ever touching another frame's keys.
//
// Why a kernel of our own: with a vision tower's small heads (head_dim 16..128) the work per
// score is a handful of vector instructions, and torch's CPU flash kernel spends most of its
// time around them (score blocks written and re-read through memory between its GEMM calls,
// per-call set-up for every frame). Here a task is 16 (AVX-512) or 12 (AVX2) query rows of one
// frame and head: their scores for a tile of 256 keys stay in L1, the softmax runs online over
// the tiles, and the running output stays in registers (AVX-512) or in L1 (AVX2). AVX-512 heads
// of 16 have a kernel of their own (attend_row_lanes: a lane per query row, no score tile). Tasks are
// split between threads by their cost (keys x rows), not their count, since one large frame
// costs as much as many small ones.
//
// One source, two builds, chosen by encoder_server/vision/native/__init__.py for the CPU it runs
// on (torch.utils.cpp_extension, on first use): -mavx512f (16-lane vectors, 32 registers) and
// -mavx2 -mfma (8 lanes, 16 registers, so smaller register blocks). Only the vector code differs;
// the host side below it (key packing, tasks, threads) is the same for both.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using AttendFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, int, float,
                          float*, int64_t);

// 2^y for y <= 0 in 8 lanes (both builds: the AVX2 attention and the GELU), as exp2_512 below does,
// without AVX-512's scalef: 2^n is built in the exponent bits, so y is clamped at -100 first (2^-100
// is nothing to a sum that holds 1, and keeps the exponent and every product with it a normal float).
// The coefficients are exp2_512's, written out again: folding both into one table changed the
// AVX-512 build's machine code, which is kept as it was measured and tested.
inline __m256 exp2_256(__m256 y) {
  y = _mm256_max_ps(y, _mm256_set1_ps(-100.f));
  const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(1.3264631852507591e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.671486914157867e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550733581185341e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022242426872253e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931470036506653e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

#if defined(__AVX512F__)

constexpr const char* kIsa = "avx512";
constexpr int kQueryRows = 16;   // rows of q per task
constexpr int kKeyTile = 256;    // keys per online-softmax step
constexpr int kScoreRows = 16;   // q rows sharing each key load in q.k (16 accumulators: 8 ran 3-5 % slower)

// 2^y for finite y: y <= 0 in attend, y <= kSlack (below) in attend_row_lanes. Scores are
// kept in base-2 units (q is pre-scaled by log2(e) / sqrt(d)), so exp(x - max) is 2^(y - max):
// n = round(y), f = y - n in [-1/2, 1/2] exactly, 2^f by a degree-5 polynomial fitted for relative
// error (1.9e-7 in float32, about two ulp; degree 6 gave 1.0e-7 and cost one more FMA per 16
// scores), then scaled by 2^n. y is finite here (a score minus a row's offset), so no clamp: scalef
// gives 0 for an n far below the smallest float.
inline __m512 exp2_512(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.3264631852507591e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671486914157867e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733581185341e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242426872253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470036506653e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x[0..15] -> one vector whose lane i is op over the lanes of x[i]: each step pairs vectors and
// halves the lanes left to combine (distance 1, 2, 4, 8), so 15 steps of blend, blend, permute, op
// take 16 horizontal reductions at once. The task's 16 rows' maxima and sums are reduced so, a lane
// each, instead of one scalar reduction (and one scalar exp2) per row and tile.
template <class Op>
inline __m512 lanes_of_each(const __m512* x, Op op) {
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)
    a[k] = op(_mm512_mask_blend_ps(0xAAAA, x[2 * k], x[2 * k + 1]),
              _mm512_permute_ps(_mm512_mask_blend_ps(0xAAAA, x[2 * k + 1], x[2 * k]), 0xB1));
  for (int k = 0; k < 4; ++k)
    b[k] = op(_mm512_mask_blend_ps(0xCCCC, a[2 * k], a[2 * k + 1]),
              _mm512_permute_ps(_mm512_mask_blend_ps(0xCCCC, a[2 * k + 1], a[2 * k]), 0x4E));
  for (int k = 0; k < 2; ++k) {
    const __m512 hi = _mm512_mask_blend_ps(0xF0F0, b[2 * k + 1], b[2 * k]);
    c[k] = op(_mm512_mask_blend_ps(0xF0F0, b[2 * k], b[2 * k + 1]), _mm512_shuffle_f32x4(hi, hi, 0xB1));
  }
  const __m512 hi = _mm512_mask_blend_ps(0xFF00, c[1], c[0]);
  return op(_mm512_mask_blend_ps(0xFF00, c[0], c[1]), _mm512_shuffle_f32x4(hi, hi, 0x4E));
}

// One task: rows [0, qn) of q (row stride qs) of one frame and head, against the frame's L keys.
// kt: keys transposed, [D, ks] (column 0 = the frame's first key); v: [L, D] with row stride vs.
// Each row's running maximum m and sum l live in one lane of a vector (lane i: row i). A head size
// that is not a multiple of 16 (72: Qwen3-VL's larger towers) has its last vector masked.
template <int D>
void attend(const float* q, int64_t qs, const float* kt, int64_t ks, const float* v, int64_t vs, int64_t L, int qn,
            float scale, float* out, int64_t os) {
  static_assert(kQueryRows == 16 && kScoreRows == kQueryRows, "a lane per q row, one q.k block per task");
  constexpr int NV = (D + 15) / 16;
  static_assert(NV >= 2, "heads of 16 go to attend_row_lanes");
  // the columns of output vector c: all 16, but for the last vector of a head size like 72
  constexpr __mmask16 kLast = D % 16 ? static_cast<__mmask16>((1u << (D % 16)) - 1) : static_cast<__mmask16>(0xFFFF);
  const auto cols = [](int c) { return c == NV - 1 ? kLast : static_cast<__mmask16>(0xFFFF); };
  // q rows per pass of p.v: PR * NV accumulators in registers; a power of two, so passes tile the 16 rows.
  // Five vectors (72, 80) take 4 rows, 20 accumulators: 1.19-1.22x faster than 2 rows, paired; six gained nothing.
  constexpr int PR = NV == 2 ? 8 : NV <= 5 ? 4 : 2;
  alignas(64) float S[kQueryRows][kKeyTile];
  alignas(64) float Q[kQueryRows][D];
  alignas(64) float row_max[kQueryRows], row_corr[kQueryRows];
  __m512 O[kQueryRows][NV];
  __m512 sums[kQueryRows];
  for (int i = 0; i < kQueryRows; ++i) {
    for (int d = 0; d < D; ++d) Q[i][d] = i < qn ? q[i * qs + d] * scale : 0.f;
    for (int c = 0; c < NV; ++c) O[i][c] = _mm512_setzero_ps();
  }
  const auto vmax = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
  const auto vadd = [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); };
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < L; j0 += kKeyTile) {
    const int kn = static_cast<int>(std::min<int64_t>(kKeyTile, L - j0));
    const int nv = (kn + 15) / 16;
    const __mmask16 tail = kn % 16 ? static_cast<__mmask16>((1u << (kn % 16)) - 1) : static_cast<__mmask16>(0xFFFF);
    // scores S = q . k for the 16 rows x 16 keys at a time, and each row's maximum over the tile
    __m512 rowmax[kQueryRows];
    for (int i = 0; i < kQueryRows; ++i) rowmax[i] = _mm512_set1_ps(-INFINITY);
    for (int jv = 0; jv < nv; ++jv) {
      const __mmask16 mask = jv == nv - 1 ? tail : static_cast<__mmask16>(0xFFFF);
      const float* kcol = kt + j0 + jv * 16;
      __m512 a[kScoreRows];
      for (int r = 0; r < kScoreRows; ++r) a[r] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m512 kk = _mm512_maskz_loadu_ps(mask, kcol + d * ks);
        for (int r = 0; r < kScoreRows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(Q[r][d]), kk, a[r]);
      }
      for (int r = 0; r < kScoreRows; ++r) {
        _mm512_store_ps(S[r] + jv * 16, a[r]);
        rowmax[r] = _mm512_mask_max_ps(rowmax[r], mask, rowmax[r], a[r]);
      }
    }
    // online softmax over this tile of keys, the 16 rows' maxima and old weights a lane each; the
    // max with -200 keeps -inf - x (the first tile) from a NaN, and 2^-200 is 0 to the sums
    const __m512 mnew = _mm512_max_ps(m, lanes_of_each(rowmax, vmax));
    const __m512 corr = exp2_512(_mm512_max_ps(_mm512_sub_ps(m, mnew), _mm512_set1_ps(-200.f)));
    _mm512_store_ps(row_max, mnew);
    _mm512_store_ps(row_corr, corr);
    m = mnew;
    // lanes past the last key are zeroed
    const int full = kn / 16;
    for (int i = 0; i < qn; ++i) {
      float* s = S[i];
      const __m512 mv = _mm512_set1_ps(row_max[i]);
      __m512 sum = _mm512_setzero_ps();
      for (int jv = 0; jv < full; ++jv) {
        const __m512 e = exp2_512(_mm512_sub_ps(_mm512_load_ps(s + jv * 16), mv));
        _mm512_store_ps(s + jv * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (full < nv) {
        const __m512 e = _mm512_maskz_mov_ps(tail, exp2_512(_mm512_sub_ps(_mm512_load_ps(s + full * 16), mv)));
        _mm512_store_ps(s + full * 16, e);
        sum = _mm512_add_ps(sum, e);
      }
      sums[i] = sum;
      const __m512 cv = _mm512_set1_ps(row_corr[i]);
      for (int c = 0; c < NV; ++c) O[i][c] = _mm512_mul_ps(O[i][c], cv);
    }
    for (int i = qn; i < kQueryRows; ++i) sums[i] = _mm512_setzero_ps();
    l = _mm512_fmadd_ps(l, corr, lanes_of_each(sums, vadd));
    // O += p . v, PR rows at a time, each key's row of v loaded once per pass
    for (int i0 = 0; i0 < qn; i0 += PR) {
      const int rows = std::min(PR, qn - i0);
      __m512 acc[PR][NV];
      for (int r = 0; r < PR; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = r < rows ? O[i0 + r][c] : _mm512_setzero_ps();
      for (int j = 0; j < kn; ++j) {
        const float* vr = v + (j0 + j) * vs;
        for (int c = 0; c < NV; ++c) {
          const __m512 vv = _mm512_maskz_loadu_ps(cols(c), vr + c * 16);
          for (int r = 0; r < PR; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(S[i0 + r][j]), vv, acc[r][c]);
        }
      }
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < NV; ++c) O[i0 + r][c] = acc[r][c];
    }
  }
  alignas(64) float inv[kQueryRows];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
  for (int i = 0; i < qn; ++i) {
    const __m512 iv = _mm512_set1_ps(inv[i]);
    for (int c = 0; c < NV; ++c) _mm512_mask_storeu_ps(out + i * os + c * 16, cols(c), _mm512_mul_ps(O[i][c], iv));
  }
}

// Heads of 16, a lane per query row. Lane i of every vector is q row i: the 16 rows' scores for one
// key are one vector, a chain of 16 FMAs (q transposed, each key's values broadcast), and the 16
// output columns are 16 accumulators, each key's weights times its v value broadcast. The scores
// never go through memory and no row needs a horizontal reduction: for head_dim 16 this ran 1.18-1.23x
// the lanes-over-keys attend, which took heads of 16 before (one layer of the bench's frames, paired).
//
// The offset subtracted from a row's scores (M) is not its running maximum but one of its real
// scores, first the frame's first key's, moved up only when a step of keys scores more than
// kSlack above it (base-2 units), with the sums and outputs rescaled then. So every weight is at
// most 2^kSlack (no overflow), the weight of the key M came from is 1 (the sum is never below 1, so
// nothing that matters underflows), and the result is the same softmax as with the exact maximum.
constexpr float kSlack = 24.f;
constexpr int kRowKeys = 8;  // keys per step: 8 score chains in flight (4 ran 1.11x slower)

template <int N>
inline void row_lane_step(const float (&qt)[16][16], const float* k, int64_t ks, const float* v, int64_t vs,
                          __m512& neg_m, __m512& l, __m512 (&o)[16]) {
  __m512 s[N];
  for (int t = 0; t < N; ++t) s[t] = neg_m;
#pragma GCC unroll 16
  for (int d = 0; d < 16; ++d) {
    const __m512 qd = _mm512_load_ps(qt[d]);
    for (int t = 0; t < N; ++t) s[t] = _mm512_fmadd_ps(qd, _mm512_set1_ps(k[t * ks + d]), s[t]);
  }
  __m512 top = s[0];
  for (int t = 1; t < N; ++t) top = _mm512_max_ps(top, s[t]);
  if (__builtin_expect(_mm512_cmp_ps_mask(top, _mm512_set1_ps(kSlack), _CMP_GT_OQ) != 0, 0)) {
    // rows scoring above M + kSlack move M up to this block's best score
    const __m512 up = _mm512_max_ps(top, _mm512_setzero_ps());
    const __m512 corr = exp2_512(_mm512_sub_ps(_mm512_setzero_ps(), up));
    l = _mm512_mul_ps(l, corr);
    for (int d = 0; d < 16; ++d) o[d] = _mm512_mul_ps(o[d], corr);
    for (int t = 0; t < N; ++t) s[t] = _mm512_sub_ps(s[t], up);
    neg_m = _mm512_sub_ps(neg_m, up);
  }
  // the step's weights summed first, then added to the row sums: with one running sum over every key
  // of a 2,048-patch frame the error was 6-7x SDPA's (tests/unit/test_native_attention.py)
  for (int t = 0; t < N; ++t) s[t] = exp2_512(s[t]);
  __m512 step_sum = s[0];
  for (int t = 1; t < N; ++t) step_sum = _mm512_add_ps(step_sum, s[t]);
  l = _mm512_add_ps(l, step_sum);
  for (int t = 0; t < N; ++t)
#pragma GCC unroll 16
    for (int d = 0; d < 16; ++d) o[d] = _mm512_fmadd_ps(s[t], _mm512_set1_ps(v[t * vs + d]), o[d]);
}

// One task as attend, but k is the frame's keys by row ([L, 16], row stride ks), not transposed.
void attend_row_lanes(const float* q, int64_t qs, const float* k, int64_t ks, const float* v, int64_t vs, int64_t L,
                      int qn, float scale, float* out, int64_t os) {
  alignas(64) float qt[16][16];  // q transposed and scaled: qt[d][i] = q[i][d] * scale
  for (int d = 0; d < 16; ++d)
    for (int r = 0; r < 16; ++r) qt[d][r] = r < qn ? q[r * qs + d] * scale : 0.f;
  __m512 o[16];
  __m512 first = _mm512_setzero_ps();
  for (int d = 0; d < 16; ++d) {
    o[d] = _mm512_setzero_ps();
    first = _mm512_fmadd_ps(_mm512_load_ps(qt[d]), _mm512_set1_ps(k[d]), first);
  }
  __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), first), l = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kRowKeys <= L; j += kRowKeys) row_lane_step<kRowKeys>(qt, k + j * ks, ks, v + j * vs, vs, neg_m, l, o);
  for (; j < L; ++j) row_lane_step<1>(qt, k + j * ks, ks, v + j * vs, vs, neg_m, l, o);
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  for (int d = 0; d < 16; ++d) _mm512_store_ps(qt[d], _mm512_mul_ps(o[d], inv));  // q is done with
  for (int r = 0; r < qn; ++r)
    for (int d = 0; d < 16; ++d) out[r * os + d] = qt[d][r];
}

bool keys_by_row(int64_t head_dim) { return head_dim == 16; }

AttendFn attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_row_lanes;
    case 32: return attend<32>;
    case 48: return attend<48>;
    case 64: return attend<64>;
    case 72: return attend<72>;
    case 80: return attend<80>;
    case 96: return attend<96>;
    case 128: return attend<128>;
    default: return nullptr;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr const char* kIsa = "avx2";
// 12 accumulators in both products (6 rows x 16 keys or 16 columns), 15 of the 16 registers: 1.15x
// faster than 4 rows (8 accumulators) on the bench frames, in paired runs.
constexpr int kQueryRows = 12;  // rows of q per task
constexpr int kKeyTile = 256;   // keys per online-softmax step
constexpr int kScoreRows = 6;   // q rows per q.k block of 16 keys
constexpr int kValueRows = 6;   // q rows per p.v pass of 16 output columns
static_assert(kQueryRows % kScoreRows == 0 && kScoreRows % kValueRows == 0, "p.v passes must tile the q.k rows");

inline float hmax256(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum256(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes [0, n) of 8 on, for maskload and blends (n in [0, 8]).
inline __m256i lanes_below(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One task, as the AVX-512 attend: rows [0, qn) of q (row stride qs) of one frame and head, against
// the frame's L keys. kt: keys transposed, [D, ks]; v: [L, D] with row stride vs. With 16 registers
// the running output lives in L1 (O), loaded and stored once per tile and pass.
template <int D>
void attend(const float* q, int64_t qs, const float* kt, int64_t ks, const float* v, int64_t vs, int64_t L, int qn,
            float scale, float* out, int64_t os) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  alignas(32) float S[kQueryRows][kKeyTile];
  alignas(32) float Q[kQueryRows][D];
  alignas(32) float O[kQueryRows][D];
  alignas(32) float rowmax[kQueryRows][8];
  float m[kQueryRows], l[kQueryRows];
  for (int i = 0; i < kQueryRows; ++i) {
    for (int d = 0; d < D; ++d) {
      Q[i][d] = i < qn ? q[i * qs + d] * scale : 0.f;
      O[i][d] = 0.f;
    }
    m[i] = -INFINITY;
    l[i] = 0.f;
  }
  const int live_rows = (qn + kScoreRows - 1) / kScoreRows * kScoreRows;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < L; j0 += kKeyTile) {
    const int kn = static_cast<int>(std::min<int64_t>(kKeyTile, L - j0));
    const int nb = (kn + 15) / 16;  // blocks of 16 keys (two vectors)
    const int rest = kn - (nb - 1) * 16;  // keys in the last block, 1..16
    const __m256i tail0 = lanes_below(std::min(rest, 8)), tail1 = lanes_below(std::max(rest - 8, 0));
    // scores S = q . k for kScoreRows rows x 16 keys at a time, and each row's running maximum
    for (int i = 0; i < live_rows; ++i) _mm256_store_ps(rowmax[i], _mm256_set1_ps(m[i]));
    for (int i0 = 0; i0 < live_rows; i0 += kScoreRows) {
      for (int jb = 0; jb < nb; ++jb) {
        const bool last = jb == nb - 1;
        const float* kcol = kt + j0 + jb * 16;
        __m256 a[kScoreRows][2];
        for (int r = 0; r < kScoreRows; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
        if (!last || rest == 16) {
          for (int d = 0; d < D; ++d) {
            const __m256 k0 = _mm256_loadu_ps(kcol + d * ks), k1 = _mm256_loadu_ps(kcol + d * ks + 8);
            for (int r = 0; r < kScoreRows; ++r) {
              const __m256 b = _mm256_broadcast_ss(&Q[i0 + r][d]);
              a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
              a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
            }
          }
        } else {
          for (int d = 0; d < D; ++d) {
            const __m256 k0 = _mm256_maskload_ps(kcol + d * ks, tail0);
            const __m256 k1 = _mm256_maskload_ps(kcol + d * ks + 8, tail1);
            for (int r = 0; r < kScoreRows; ++r) {
              const __m256 b = _mm256_broadcast_ss(&Q[i0 + r][d]);
              a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
              a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
            }
          }
          for (int r = 0; r < kScoreRows; ++r) {  // lanes past the last key take no part in the maximum
            a[r][0] = _mm256_blendv_ps(neg_inf, a[r][0], _mm256_castsi256_ps(tail0));
            a[r][1] = _mm256_blendv_ps(neg_inf, a[r][1], _mm256_castsi256_ps(tail1));
          }
        }
        for (int r = 0; r < kScoreRows; ++r) {
          _mm256_store_ps(S[i0 + r] + jb * 16, a[r][0]);
          _mm256_store_ps(S[i0 + r] + jb * 16 + 8, a[r][1]);
          _mm256_store_ps(rowmax[i0 + r],
                          _mm256_max_ps(_mm256_load_ps(rowmax[i0 + r]), _mm256_max_ps(a[r][0], a[r][1])));
        }
      }
    }
    // online softmax over this tile of keys; lanes past the last key are zeroed
    const int full = kn / 8;
    const __m256i tail = lanes_below(kn % 8);
    for (int i = 0; i < qn; ++i) {
      float* s = S[i];
      const float mnew = hmax256(_mm256_load_ps(rowmax[i]));
      const __m256 mv = _mm256_set1_ps(mnew);
      __m256 sum = _mm256_setzero_ps();
      for (int jv = 0; jv < full; ++jv) {
        const __m256 e = exp2_256(_mm256_sub_ps(_mm256_load_ps(s + jv * 8), mv));
        _mm256_store_ps(s + jv * 8, e);
        sum = _mm256_add_ps(sum, e);
      }
      if (kn % 8) {
        const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(tail),
                                       exp2_256(_mm256_sub_ps(_mm256_load_ps(s + full * 8), mv)));
        _mm256_store_ps(s + full * 8, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float corr = std::exp2(m[i] - mnew);
      l[i] = l[i] * corr + hsum256(sum);
      m[i] = mnew;
      const __m256 cv = _mm256_set1_ps(corr);
      for (int c = 0; c < D; c += 8) _mm256_store_ps(O[i] + c, _mm256_mul_ps(_mm256_load_ps(O[i] + c), cv));
    }
    // O += p . v: kValueRows rows x 16 columns at a time, each key's 16 values loaded once per pass
    for (int c0 = 0; c0 < D; c0 += 16) {
      for (int i0 = 0; i0 < qn; i0 += kValueRows) {
        __m256 acc[kValueRows][2];
        for (int r = 0; r < kValueRows; ++r) {
          acc[r][0] = _mm256_load_ps(O[i0 + r] + c0);
          acc[r][1] = _mm256_load_ps(O[i0 + r] + c0 + 8);
        }
        const float* vr = v + j0 * vs + c0;
        for (int j = 0; j < kn; ++j, vr += vs) {
          const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
          for (int r = 0; r < kValueRows; ++r) {
            const __m256 b = _mm256_broadcast_ss(&S[i0 + r][j]);
            acc[r][0] = _mm256_fmadd_ps(b, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, v1, acc[r][1]);
          }
        }
        for (int r = 0; r < kValueRows; ++r) {
          _mm256_store_ps(O[i0 + r] + c0, acc[r][0]);
          _mm256_store_ps(O[i0 + r] + c0 + 8, acc[r][1]);
        }
      }
    }
  }
  for (int i = 0; i < qn; ++i) {
    const __m256 inv = _mm256_set1_ps(1.f / l[i]);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(out + i * os + c, _mm256_mul_ps(_mm256_load_ps(O[i] + c), inv));
  }
}

bool keys_by_row(int64_t) { return false; }

// Up to 48: from 64 up, with the output in L1 and a pass over the scores per 16 columns, torch's
// SDPA was as fast or faster on the development host.
AttendFn attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend<16>;
    case 32: return attend<32>;
    case 48: return attend<48>;
    default: return nullptr;
  }
}

#else
#error "build with -mavx512f -mfma (AVX-512) or -mavx2 -mfma (AVX2)"
#endif

}  // namespace

bool supports(int64_t head_dim) { return attend_for(head_dim) != nullptr; }

std::string isa() { return kIsa; }

torch::Tensor frame_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v must be [rows, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need a contiguous last dim");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const AttendFn fn = attend_for(dim);
  TORCH_CHECK(fn != nullptr, "unsupported head_dim ", dim);
  auto len = lengths.to(at::kLong).contiguous();
  const int64_t* lp = len.data_ptr<int64_t>();
  std::vector<int64_t> starts, sizes;
  int64_t used = 0;
  for (int64_t f = 0; f < len.numel() && lp[f] > 0; ++f) {
    starts.push_back(used);
    sizes.push_back(lp[f]);
    used += lp[f];
  }
  TORCH_CHECK(used <= rows, "frame lengths add up to ", used, " rows, more than the ", rows, " given");
  auto out = torch::empty({rows, heads, dim}, q.options());
  if (used < rows) out.narrow(0, used, rows - used).zero_();
  if (used == 0) return out;
  // Per head, keys transposed: kt[h][d][j] = k[j][h][d], so that a vector load takes 16 keys' values at one d.
  // Packed in tiles of 64 rows (their keys stay in L1 while every head and dim is written), in parallel.
  // Values are read where they lie, one row of head_dim at a time; so are the keys where the kernel
  // takes them by row (keys_by_row).
  const bool by_row = keys_by_row(dim);
  const auto kt = by_row ? torch::Tensor() : torch::empty({heads, dim, used}, q.options());
  if (!by_row) {
    const float* kp = k.data_ptr<float>();
    float* tp = kt.data_ptr<float>();
    const int64_t krs = k.stride(0), khs = k.stride(1);
    constexpr int64_t kTile = 64;
    at::parallel_for(0, (used + kTile - 1) / kTile, 1, [&](int64_t tb, int64_t te) {
      for (int64_t tile = tb; tile < te; ++tile) {
        const int64_t j0 = tile * kTile, j1 = std::min(used, j0 + kTile);
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < dim; ++d) {
            float* dst = tp + (h * dim + d) * used;
            const float* src = kp + h * khs + d;
            for (int64_t j = j0; j < j1; ++j) dst[j] = src[j * krs];
          }
      }
    });
  }
  struct Task { int64_t frame, head, first; };
  std::vector<Task> tasks;
  std::vector<int64_t> cost{0};  // prefix sums of each task's key count: threads get equal shares of work
  for (size_t f = 0; f < sizes.size(); ++f)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < sizes[f]; r += kQueryRows) {
        tasks.push_back({static_cast<int64_t>(f), h, r});
        cost.push_back(cost.back() + sizes[f]);
      }
  const float scale = 1.4426950408889634f / std::sqrt(static_cast<float>(dim));  // log2(e) / sqrt(d)
  const float* qp = q.data_ptr<float>();
  // the keys the kernel reads: k itself by row, or kt; key j of head h at j * key_step + h * key_head,
  // and the stride the kernel is given (between keys by row, between dims in kt)
  const float* ktp = by_row ? k.data_ptr<float>() : kt.data_ptr<float>();
  const int64_t key_step = by_row ? k.stride(0) : 1, key_head = by_row ? k.stride(1) : dim * used;
  const int64_t key_stride = by_row ? k.stride(0) : used;
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qrs = q.stride(0), qhs = q.stride(1), vrs = v.stride(0), vhs = v.stride(1);
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  auto share_start = [&](int64_t share) {
    if (share >= shares) return static_cast<int64_t>(tasks.size());
    return static_cast<int64_t>(std::lower_bound(cost.begin(), cost.end(), cost.back() * share / shares) - cost.begin());
  };
  at::parallel_for(0, shares, 1, [&](int64_t sb, int64_t se) {
    for (int64_t t = share_start(sb), end = share_start(se); t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t start = starts[task.frame], size = sizes[task.frame];
      const int qn = static_cast<int>(std::min<int64_t>(kQueryRows, size - task.first));
      fn(qp + (start + task.first) * qrs + task.head * qhs, qrs, ktp + start * key_step + task.head * key_head,
         key_stride, vp + start * vrs + task.head * vhs, vrs, size, qn, scale,
         op + ((start + task.first) * heads + task.head) * dim, heads * dim);
    }
  });
  return out;
}

// GELU, tanh approximation, for the tower's eager path: x * sigmoid(2u) with u = sqrt(2/pi) (x +
// 0.044715 x^3), that is x / (1 + 2^y) with y = -2 log2(e) u, in 8 lanes (both builds). torch's own
// CPU kernel for it took 1.1 ms for [8192, 64] on the development host, 4x a plain exp of the same
// tensor. y is clamped to [-100, 64]: past either end the result is x or 0 to float precision.
namespace {

void gelu_tanh_range(const float* x, float* out, int64_t n) {
  constexpr float kA = -2.302208198144325f;  // -2 log2(e) sqrt(2/pi)
  constexpr float kB = kA * 0.044715f;
  const __m256 a = _mm256_set1_ps(kA), b = _mm256_set1_ps(kB), one = _mm256_set1_ps(1.f);
  const __m256 hi = _mm256_set1_ps(64.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 y = _mm256_min_ps(_mm256_mul_ps(v, _mm256_fmadd_ps(b, _mm256_mul_ps(v, v), a)), hi);
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, exp2_256(y))));
  }
  for (; i < n; ++i) {
    const float v = x[i];
    out[i] = v / (1.f + std::exp2(std::min(v * (kA + kB * v * v), 64.f)));
  }
}

}  // namespace

torch::Tensor gelu_tanh(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "float32 CPU tensors only");
  const auto input = x.contiguous();
  auto out = torch::empty_like(input);
  const float* xp = input.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, input.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    gelu_tanh_range(xp + begin, op + begin, end - begin);
  });
  return out;
}

// Rotary embedding of q and k in bfloat16, for the tower's eager bfloat16 path: the reference's
// float32 math (x * cos - partner * sin in each half, products and sums in float32, one rounding to
// bfloat16 at the end) in one pass that reads x once and writes each result once. torch's mixed-dtype,
// broadcast, strided element-wise ops spent 250-350 ms of a 1.7 s eager bfloat16 call of
// Qwen3-VL-2B's tower on it (24 layers of [2560, 2, 16, 64]); this is one read and one write of it.
namespace {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// No fused multiply-adds here: each product rounds to float32 before the sum, as in the reference,
// so the results equal torch's bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_row(const uint16_t* x, const float* cos, const float* sin, uint16_t* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = bf16_to_float(x[i]), b = bf16_to_float(x[i + half]);
    out[i] = float_to_bf16(a * cos[i] - b * sin[i]);
    out[i + half] = float_to_bf16(b * cos[i] + a * sin[i]);
  }
}
#pragma GCC pop_options

}  // namespace

// x [rows, a, b, dim] bfloat16 (any strides, a contiguous last dim); cos, sin [rows, half] float32
// (any row stride, contiguous along half), broadcast over a and b. Returns a new contiguous
// [rows, a, b, dim] bfloat16 tensor.
torch::Tensor rotary_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a [rows, a, b, dim] bfloat16 CPU tensor");
  const int64_t rows = x.size(0), na = x.size(1), nb = x.size(2), dim = x.size(3), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && x.stride(3) == 1, "x needs an even, contiguous last dim");
  for (const auto& t : {cos, sin})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == half && t.stride(1) == 1 &&
                    t.scalar_type() == at::kFloat && t.device().is_cpu(),
                "cos and sin must be [rows, dim / 2] float32 CPU tensors, contiguous along dim / 2");
  auto out = torch::empty({rows, na, nb, dim}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t xr = x.stride(0), xa = x.stride(1), xb = x.stride(2), cr = cos.stride(0), sr = sin.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, na * nb * dim)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t a = 0; a < na; ++a)
        for (int64_t b = 0; b < nb; ++b)
          rotate_row(xp + r * xr + a * xa + b * xb, cp + r * cr, sp + r * sr, op + ((r * na + a) * nb + b) * dim,
                     half);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("frame_attention", &frame_attention);
  m.def("supports", &supports);
  m.def("isa", &isa);
  m.def("gelu_tanh", &gelu_tanh);
  m.def("rotary_bf16", &rotary_bf16);
}
