// A few rows times a float32 or bfloat16 weight (spyre_kernels::linear_row): a decode step of a few live
// sequences (up to linear.ROW_LINEAR_ROWS).
//
// out [m, N] = x [m, K] @ weight [N, K]^T (+ bias [N]). At one row a linear layer is a matrix-vector product
// and waits on memory: every weight is read once per step and each of its floats is used once. oneDNN's GEMM
// on the weight packed for it (linear.py) runs one row at 10-22 GB/s on SmolLM2's shapes (2 threads, AVX2
// EPYC with a 25.7 GB/s read probe), the one-row version of this loop at 20-26.5 (bench/README.md run 28).
// At a few rows the weight is still read once and the FMAs grow with the rows: they are hidden behind the
// reads only if the reads are asked for early, so each task prefetches the weight four tiles ahead into L2
// (without it, or into L1, the loop was slower than oneDNN's from four rows: bench/README.md run 50). The
// rows of the weight are split over the threads in tasks of at least 64 KiB; a tile of four weight rows
// shares each load of x, and each load of the weight serves up to four rows of x (two where a vector register
// holds fewer than 16 floats), with one vector accumulator per pair; every sum is float32 (a bfloat16 weight is
// widened as it is loaded, x once per call, and each output rounded to bfloat16 once). Built into the same
// extension as paged_attention.cpp (the sources one after the other, paged_attention.py), on ATen's portable
// vector layer; the prefetch is the compiler's builtin (GCC and Clang, on every ISA Spyre ships with).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

using RowVec = at::vec::Vectorized<float>;

float row_sum(RowVec acc) {
  return at::vec::vec_reduce_all<float>([](RowVec a, RowVec b) { return a + b; }, acc);
}

// the weight rows at a time of a tile, and the x rows (at most) that share each load of them: a tile's
// accumulators, W * R vectors, stay in registers (AVX-512 has 32, the others 16 or so of their width)
constexpr int kTileW = 4;
constexpr int kTileR = RowVec::size() >= 16 ? 4 : 2;

// one vector of floats from the weight: float32 as it is, bfloat16 widened (the sums stay float32)
inline RowVec load_row(const float* p) {
  return RowVec::loadu(p);
}

inline RowVec load_row(const c10::BFloat16* p) {
  RowVec v;
  at::vec::load_to_float<c10::BFloat16>(p, v);
  return v;
}

// out[r * n_out + i] = x[r] . w[i] (+ bias[i]) for R rows of x (float32) and W rows of the weight (T), both
// k_len long; each load of a weight vector serves the R rows, each load of an x vector the W weight rows
template <int R, int W, typename T>
inline void tile(const float* x, const T* w, const T* bias, T* out, int64_t k_len, int64_t n_out) {
  constexpr int64_t width = RowVec::size();
  RowVec acc[W][R];
  for (int i = 0; i < W; ++i) {
    for (int r = 0; r < R; ++r) {
      acc[i][r] = RowVec(0.f);
    }
  }
  int64_t k = 0;
  for (; k + width <= k_len; k += width) {
    RowVec wv[W];
    for (int i = 0; i < W; ++i) {
      wv[i] = load_row(w + i * k_len + k);
      __builtin_prefetch(w + (i + 4 * W) * k_len + k, 0, 2);  // a line of a row four tiles on, into L2
    }
    for (int r = 0; r < R; ++r) {
      const RowVec xv = RowVec::loadu(x + r * k_len + k);
      for (int i = 0; i < W; ++i) {
        acc[i][r] = at::vec::fmadd(wv[i], xv, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < W; ++i) {
    for (int r = 0; r < R; ++r) {
      float s = row_sum(acc[i][r]);
      for (int64_t t = k; t < k_len; ++t) {
        s += static_cast<float>(w[i * k_len + t]) * x[r * k_len + t];
      }
      out[r * n_out + i] = static_cast<T>(s + (bias ? static_cast<float>(bias[i]) : 0.f));
    }
  }
}

template <int W, typename T>
inline void tile_rows(int r, const float* x, const T* w, const T* bias, T* out, int64_t k_len, int64_t n_out) {
  switch (r) {
    case 1:
      tile<1, W>(x, w, bias, out, k_len, n_out);
      break;
    case 2:
      tile<2, W>(x, w, bias, out, k_len, n_out);
      break;
    case 3:
      tile<3 <= kTileR ? 3 : 1, W>(x, w, bias, out, k_len, n_out);
      break;
    default:
      tile<kTileR, W>(x, w, bias, out, k_len, n_out);
  }
}

// out[r][j] = x[r] . weight[j] (+ bias[j]) for the m rows of x and the weight rows [begin, end): tile by tile
// of kTileW weight rows, and within a tile the x rows kTileR at a time (the tile's weight is in L1 again)
template <typename T>
void rows_times(const float* x, int64_t m, const T* weight, const T* bias, T* out, int64_t k_len, int64_t n_out,
                int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + kTileW <= end; j += kTileW) {
    for (int64_t r = 0; r < m; r += kTileR) {
      tile_rows<kTileW>(static_cast<int>(std::min<int64_t>(kTileR, m - r)), x + r * k_len, weight + j * k_len,
                        bias ? bias + j : nullptr, out + r * n_out + j, k_len, n_out);
    }
  }
  for (; j < end; ++j) {
    for (int64_t r = 0; r < m; r += kTileR) {
      tile_rows<1>(static_cast<int>(std::min<int64_t>(kTileR, m - r)), x + r * k_len, weight + j * k_len,
                   bias ? bias + j : nullptr, out + r * n_out + j, k_len, n_out);
    }
  }
}

// out [m, N] (contiguous, the weight's dtype) = x @ weight^T (+ bias) for a checked x of m rows, over the threads
void rows_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               at::Tensor& out);

at::Tensor linear_row(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t k_len = weight.dim() == 2 ? weight.size(1) : 0;
  at::Tensor out = at::empty({k_len && x.dim() >= 1 ? x.numel() / k_len : 0, weight.dim() == 2 ? weight.size(0) : 0},
                             x.options());
  rows_into(x, weight, bias, out);
  return out;
}

void rows_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               at::Tensor& out) {
  TORCH_CHECK(weight.dim() == 2, "linear_row: weight must be 2-d [out, in], got ", weight.dim(), "-d");
  const int64_t n_out = weight.size(0), k_len = weight.size(1);
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "linear_row: float32 or bfloat16 only, x and weight alike, got x ", x.scalar_type(), " and weight ",
              dtype);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k_len && k_len > 0, "linear_row: x must be rows of ", k_len,
              " values, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "linear_row: x and weight must be contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n_out,
                "linear_row: bias must be a contiguous ", dtype, " [", n_out, "], got ", bias->scalar_type(), " ",
                bias->sizes());
  }
  const int64_t m = x.numel() / k_len;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.numel() == m * n_out,
              "linear_row: out must be a contiguous ", dtype, " [", m, ", ", n_out, "]");
  // x's rows in float32 once (a few KiB), so the tiles' inner loop widens only the weight
  const at::Tensor xf = dtype == at::kFloat ? x : x.to(at::kFloat).contiguous();
  const float* x_ptr = xf.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(kTileW, (16384 / k_len + kTileW - 1) / kTileW * kTileW);
  const auto run = [&](auto* w_ptr, auto* bias_ptr, auto* out_ptr) {
    at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
      rows_times(x_ptr, m, w_ptr, bias_ptr, out_ptr, k_len, n_out, begin, end);
    });
  };
  if (dtype == at::kFloat) {
    run(weight.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>());
  } else {
    using B = c10::BFloat16;
    run(weight.data_ptr<B>(), has_bias ? bias->data_ptr<B>() : static_cast<B*>(nullptr), out.data_ptr<B>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def("linear_row(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("linear_row", &linear_row);
}
