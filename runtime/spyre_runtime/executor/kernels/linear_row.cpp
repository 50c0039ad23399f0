// One row times a float32 weight (spyre_kernels::linear_row): a decode step of one live sequence.
//
// out [1, N] = x [1, K] @ weight [N, K]^T (+ bias [N]). At one row a linear layer is a matrix-vector product
// and waits on memory: every weight is read once per step and each of its floats is used once. oneDNN's GEMM
// on the weight packed for it (linear.py) runs one row at 10-22 GB/s on SmolLM2's shapes (2 threads, AVX2
// EPYC with a 25.7 GB/s read probe), this loop at 20-26.5 (bench/README.md run 28). The rows of the weight are
// split over the threads in tasks of at least 64 KiB; four rows at a time share each load of x, with one
// vector accumulator each; every sum is float32. Built into the same extension as paged_attention.cpp (the
// two sources one after the other, paged_attention.py), on ATen's portable vector layer.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

using RowVec = at::vec::Vectorized<float>;

float row_sum(RowVec acc) {
  return at::vec::vec_reduce_all<float>([](RowVec a, RowVec b) { return a + b; }, acc);
}

// out[j] = x . weight[j] (+ bias[j]) for the weight rows [begin, end)
void rows_times(const float* x, const float* weight, const float* bias, float* out, int64_t k_len,
                int64_t begin, int64_t end) {
  constexpr int64_t width = RowVec::size();
  int64_t j = begin;
  for (; j + 4 <= end; j += 4) {
    const float* w0 = weight + j * k_len;
    const float* w1 = w0 + k_len;
    const float* w2 = w1 + k_len;
    const float* w3 = w2 + k_len;
    RowVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    int64_t k = 0;
    for (; k + width <= k_len; k += width) {
      const RowVec xv = RowVec::loadu(x + k);
      a0 = at::vec::fmadd(RowVec::loadu(w0 + k), xv, a0);
      a1 = at::vec::fmadd(RowVec::loadu(w1 + k), xv, a1);
      a2 = at::vec::fmadd(RowVec::loadu(w2 + k), xv, a2);
      a3 = at::vec::fmadd(RowVec::loadu(w3 + k), xv, a3);
    }
    float s0 = row_sum(a0), s1 = row_sum(a1), s2 = row_sum(a2), s3 = row_sum(a3);
    for (; k < k_len; ++k) {
      s0 += w0[k] * x[k];
      s1 += w1[k] * x[k];
      s2 += w2[k] * x[k];
      s3 += w3[k] * x[k];
    }
    out[j] = s0 + (bias ? bias[j] : 0.f);
    out[j + 1] = s1 + (bias ? bias[j + 1] : 0.f);
    out[j + 2] = s2 + (bias ? bias[j + 2] : 0.f);
    out[j + 3] = s3 + (bias ? bias[j + 3] : 0.f);
  }
  for (; j < end; ++j) {
    const float* w = weight + j * k_len;
    RowVec acc(0.f);
    int64_t k = 0;
    for (; k + width <= k_len; k += width) {
      acc = at::vec::fmadd(RowVec::loadu(w + k), RowVec::loadu(x + k), acc);
    }
    float s = row_sum(acc);
    for (; k < k_len; ++k) {
      s += w[k] * x[k];
    }
    out[j] = s + (bias ? bias[j] : 0.f);
  }
}

// out[0:N] = x @ weight^T (+ bias) for a checked one-row float32 x, over the threads
void row_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, float* out);

at::Tensor linear_row(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({1, weight.dim() == 2 ? weight.size(0) : 0}, x.options().dtype(at::kFloat));
  row_into(x, weight, bias, out.data_ptr<float>());
  return out;
}

void row_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, float* out) {
  TORCH_CHECK(weight.dim() == 2, "linear_row: weight must be 2-d [out, in], got ", weight.dim(), "-d");
  const int64_t n_out = weight.size(0), k_len = weight.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear_row: float32 only, got x ", x.scalar_type(), " and weight ", weight.scalar_type());
  TORCH_CHECK(x.numel() == k_len, "linear_row: x must be one row of ", k_len, " values, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "linear_row: x and weight must be contiguous");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out,
                "linear_row: bias must be a contiguous float32 [", n_out, "], got ", bias->sizes());
    bias_ptr = bias->data_ptr<float>();
  }
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(4, (16384 / std::max<int64_t>(k_len, 1) + 3) / 4 * 4);
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    rows_times(x_ptr, w_ptr, bias_ptr, out, k_len, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def("linear_row(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("linear_row", &linear_row);
}
