// Attention of each frame to itself over one flat sequence, float32 on AVX-512 CPUs (encoder process).
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
// per-call set-up for every frame). Here a task is 16 query rows of one frame and head: their
// scores for a tile of 256 keys stay in L1, the softmax runs online over the tiles, and the
// running output stays in registers. Tasks are split between threads by their cost (keys x
// rows), not their count, since one large frame costs as much as many small ones.
//
// Built on first use by encoder_server/vision/native/__init__.py (torch.utils.cpp_extension)
// with -mavx512f; loaded only where the CPU reports AVX-512.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kQueryRows = 16;   // rows of q per task
constexpr int kKeyTile = 256;    // keys per online-softmax step
constexpr int kScoreRows = 16;   // q rows sharing each key load in q.k (16 accumulators: 8 ran 3-5 % slower)

// 2^y for y <= 0. Scores are kept in base-2 units (q is pre-scaled by log2(e) / sqrt(d)), so
// exp(x - max) is 2^(y - max): n = round(y), f = y - n in [-1/2, 1/2] exactly, 2^f by a degree-5
// polynomial fitted for relative error (1.9e-7 in float32, about two ulp; degree 6 gave 1.0e-7 and
// cost one more FMA per 16 scores), then scaled by 2^n. y is finite here (a score minus its row's
// maximum), so no clamp: scalef gives 0 for an n far below the smallest float.
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

// One task: rows [0, qn) of q (row stride qs) of one frame and head, against the frame's L keys.
// kt: keys transposed, [D, ks] (column 0 = the frame's first key); v: [L, D] with row stride vs.
template <int NV>
void attend(const float* q, int64_t qs, const float* kt, int64_t ks, const float* v, int64_t vs, int64_t L, int qn,
            float scale, float* out, int64_t os) {
  constexpr int D = NV * 16;
  // q rows per pass of p.v: PR * NV accumulators in registers; a power of two, so passes tile the 16 rows.
  constexpr int PR = NV == 1 ? 16 : NV == 2 ? 8 : NV <= 4 ? 4 : 2;
  alignas(64) float S[kQueryRows][kKeyTile];
  alignas(64) float Q[kQueryRows][D];
  __m512 O[kQueryRows][NV];
  float m[kQueryRows], l[kQueryRows];
  for (int i = 0; i < kQueryRows; ++i) {
    for (int d = 0; d < D; ++d) Q[i][d] = i < qn ? q[i * qs + d] * scale : 0.f;
    for (int c = 0; c < NV; ++c) O[i][c] = _mm512_setzero_ps();
    m[i] = -INFINITY;
    l[i] = 0.f;
  }
  const int live_rows = (qn + kScoreRows - 1) / kScoreRows * kScoreRows;
  for (int64_t j0 = 0; j0 < L; j0 += kKeyTile) {
    const int kn = static_cast<int>(std::min<int64_t>(kKeyTile, L - j0));
    const int nv = (kn + 15) / 16;
    const __mmask16 tail = kn % 16 ? static_cast<__mmask16>((1u << (kn % 16)) - 1) : static_cast<__mmask16>(0xFFFF);
    // scores S = q . k for kScoreRows rows x 16 keys at a time, and each row's maximum
    __m512 rowmax[kQueryRows];
    for (int i = 0; i < live_rows; ++i) rowmax[i] = _mm512_set1_ps(m[i]);
    for (int i0 = 0; i0 < live_rows; i0 += kScoreRows) {
      for (int jv = 0; jv < nv; ++jv) {
        const __mmask16 mask = jv == nv - 1 ? tail : static_cast<__mmask16>(0xFFFF);
        const float* kcol = kt + j0 + jv * 16;
        __m512 a[kScoreRows];
        for (int r = 0; r < kScoreRows; ++r) a[r] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) {
          const __m512 kk = _mm512_maskz_loadu_ps(mask, kcol + d * ks);
          for (int r = 0; r < kScoreRows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(Q[i0 + r][d]), kk, a[r]);
        }
        for (int r = 0; r < kScoreRows; ++r) {
          _mm512_store_ps(S[i0 + r] + jv * 16, a[r]);
          rowmax[i0 + r] = _mm512_mask_max_ps(rowmax[i0 + r], mask, rowmax[i0 + r], a[r]);
        }
      }
    }
    // online softmax over this tile of keys; lanes past the last key are zeroed
    const int full = kn / 16;
    for (int i = 0; i < qn; ++i) {
      float* s = S[i];
      const float mnew = _mm512_reduce_max_ps(rowmax[i]);
      const __m512 mv = _mm512_set1_ps(mnew);
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
      const float corr = std::exp2(m[i] - mnew);
      l[i] = l[i] * corr + _mm512_reduce_add_ps(sum);
      m[i] = mnew;
      const __m512 cv = _mm512_set1_ps(corr);
      for (int c = 0; c < NV; ++c) O[i][c] = _mm512_mul_ps(O[i][c], cv);
    }
    // O += p . v, PR rows at a time, each key's row of v loaded once per pass
    for (int i0 = 0; i0 < qn; i0 += PR) {
      const int rows = std::min(PR, qn - i0);
      __m512 acc[PR][NV];
      for (int r = 0; r < PR; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = r < rows ? O[i0 + r][c] : _mm512_setzero_ps();
      for (int j = 0; j < kn; ++j) {
        const float* vr = v + (j0 + j) * vs;
        for (int c = 0; c < NV; ++c) {
          const __m512 vv = _mm512_loadu_ps(vr + c * 16);
          for (int r = 0; r < PR; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(S[i0 + r][j]), vv, acc[r][c]);
        }
      }
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < NV; ++c) O[i0 + r][c] = acc[r][c];
    }
  }
  for (int i = 0; i < qn; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / l[i]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + i * os + c * 16, _mm512_mul_ps(O[i][c], inv));
  }
}

using AttendFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, int, float,
                          float*, int64_t);

AttendFn attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend<1>;
    case 32: return attend<2>;
    case 48: return attend<3>;
    case 64: return attend<4>;
    case 80: return attend<5>;
    case 96: return attend<6>;
    case 128: return attend<8>;
    default: return nullptr;
  }
}

}  // namespace

bool supports(int64_t head_dim) { return attend_for(head_dim) != nullptr; }

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
  // Values are read where they lie, one row of head_dim at a time.
  const auto kt = torch::empty({heads, dim, used}, q.options());
  {
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
  const float* ktp = kt.data_ptr<float>();
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
      fn(qp + (start + task.first) * qrs + task.head * qhs, qrs, ktp + task.head * dim * used + start, used,
         vp + start * vrs + task.head * vhs, vrs, size, qn, scale,
         op + ((start + task.first) * heads + task.head) * dim, heads * dim);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("frame_attention", &frame_attention);
  m.def("supports", &supports);
}
