// A few rows times a float32 or bfloat16 weight (spyre_kernels::linear_row): a decode step of a few live
// sequences (up to linear.row_limits()).
//
// out [m, N] = x [m, K] @ weight [N, K]^T (+ bias [N]). At one row a linear layer is a matrix-vector product
// and waits on memory: every weight is read once per step and each of its values is used once. At a few
// rows the weight is still read once and the FMAs grow with the rows, until they are the bound.
//
// The weight is read from a copy of it in panels (`pack_rows`): [P, K, PW], PW = a few vector widths of
// outputs (32 with AVX-512, 16 with AVX2), the last panel padded with zero outputs. One step of k loads PW
// weights of consecutive outputs, and each row of x multiplies them by one broadcast value into its own PW
// sums: no sum ends in a horizontal add, each weight load serves up to kPanelRows rows of x, and each thread reads
// its panels as one stream from memory (prefetched a few steps ahead into L2). More rows than that take the
// panel again, from L2, a pass per kPanelRows rows; even a pass of one row costs about a third of an 8-row pass
// (a 1-row pass after 24 rows took 4.6 ms of the 121 weights' 42 ms), so AVX-512's panels are 32 outputs
// wide for 14 rows a pass, not 48 for 8: float32 at 25 and 32 rows 0.75 and 0.77-0.81x of oneDNN's time
// instead of 0.82-0.83 and 0.84, bfloat16 pairs at 16 and 32 rows 0.60-0.77 and 0.75-0.85x instead of 0.81-0.83
// and 0.83-0.91 (bench/README.md run 57, SmolLM2's 121 weights, 2 threads). The layer's plain weight [N, K]
// (an earlier version's layout, bench/README.md runs 28-51) made each output a dot product along k that ended
// in a horizontal sum, with x re-read for every four outputs: on SmolLM2's 121 weights at 2 threads (a Zen 4
// EPYC, bench/README.md run 52, the kernels alternating in one process) the panels took 0.93 of its time at
// 1 row and 0.72-0.81 at 4 to 32 rows (float32), and 0.55-0.80 of oneDNN's packed GEMM's from 1 to 40. The
// panels are made once per layer (linear.py registers every packed layer's weight, `register_rows`; a weight
// that nobody registered is put in panels at each call, for tests and benches) and dropped with the layer
// (`forget_rows`).
//
// Every sum is float32, along k in order (at one row of x, the even and odd steps of k in two sums added at the
// end; a bfloat16 weight widened as it is loaded, x once per call, and each output rounded to bfloat16 once).
// Where the CPU has the bfloat16 dot product (AVX-512 BF16, found at run time: `bf16_dot`), bfloat16 panels hold
// pairs along k instead ([P, K2, PW, 2]) and x's rows are read as pairs as they are: one instruction per vector
// takes two values of k, with no widening. SmolLM2's 121 bfloat16
// weights, 2 threads, a Zen 4, the layouts alternating in one process (bench/README.md run 55): widened 9.6 /
// 12.1 / 21.9 / 41.2 ms at 1 / 8 / 16 / 32 rows, in pairs 9.4 / 9.5 / 14.0 / 23.9 (oneDNN's packed GEMM 16.0 /
// 16.3 / 20.3 / 30.4).
//
// A SwiGLU feed-forward's gate and up halves, one weight [2 * half, K] (spyre_kernels::linear_row_glu, for
// linear.packed_glu), are put in panels of the GLU layout: each half in panels of its own, so that panel p of
// the gate and panel count + p of the up half hold the same outputs. A thread makes both panels' sums for a
// few rows and writes only silu(gate) * up: the [m, 2 * half] output is never written nor read back by a kernel
// of the compiled graph. Registered panels say their layout, so a GLU's are never read as a plain layer's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using RowVec = at::vec::Vectorized<float>;

// a panel's outputs in vectors, and the most rows of x that share its weight loads: the accumulators,
// kPanelRows * kPanelVecs vectors, stay in registers beside the step's weights and x's broadcast value
// (AVX-512 has 32, AVX2 16: 12 sums, 2 weights and x's value; on SmolLM2's 121 weights, an AVX2 EPYC, 6 rows
// a pass took 0.81-0.95x the time of 4 at 6 to 16 rows in float32 and 0.85-0.99x at 6 to 256 in bfloat16, the
// same at 1 to 4 rows and at 32 to 256 in float32: bench/README.md run 66)
constexpr int kPanelVecs = 2;
constexpr int kPanelRows = RowVec::size() >= 16 ? 14 : 6;
// where a bfloat16 weight is widened as it is loaded (a CPU without the bf16 dot product; the runtime sends it
// up to 8 rows, linear.ROW_LINEAR_ROWS, every row where oneDNN packs no bfloat16), the widening takes registers
// of its own with AVX-512: 8 rows a pass; AVX2 widens into the weight's own registers, 6 as float32
constexpr int kWidenedRows = RowVec::size() >= 16 ? 8 : 6;
constexpr int64_t kPanel = RowVec::size() * kPanelVecs;  // PW, a panel's outputs
// the weight is prefetched this far ahead of the loads: 48 steps of k of a float32 panel, 96 of a bfloat16 one.
// SmolLM2's 121 float32 weights with the caches written over between passes, as a step's other work does
// (bench/README.md run 52): 1.5 KiB ahead took 1.1-1.5x the time of this at 1 to 16 rows, 12 KiB 0.97-1.05x
constexpr int64_t kAheadBytes = 6144;

// the panels of a weight of n_out outputs
inline int64_t panel_count(int64_t n_out) {
  return (n_out + kPanel - 1) / kPanel;
}

// one vector of floats from the weight: float32 as it is, bfloat16 widened (the sums stay float32)
inline RowVec load_row(const float* p) {
  return RowVec::loadu(p);
}

inline RowVec load_row(const c10::BFloat16* p) {
  RowVec v;
  at::vec::load_to_float<c10::BFloat16>(p, v);
  return v;
}

// sums[r * kPanel + o] = x[r] . panel's output o, for R rows of x (float32, k_len apart) and one panel [K, PW]
template <int R, typename T>
inline void panel_rows(const float* x, int64_t k_len, const T* panel, float* sums) {
  // one row: its kPanelVecs sums would each wait on the last FMA at every step of k, so the odd steps of k add
  // into sums of their own (acc[1]), added to the even steps' at the end (on a copy of this kernel over
  // SmolLM2's 120 float32 layer weights, 2 threads: 1.008-1.069x the rate, median 1.014x, bench/README.md
  // run 60)
  constexpr int kSums = R == 1 ? 2 : R;
  RowVec acc[kSums][kPanelVecs];
  for (int r = 0; r < kSums; ++r) {
    for (int j = 0; j < kPanelVecs; ++j) {
      acc[r][j] = RowVec(0.f);
    }
  }
  const auto fetch = [&](int64_t k, RowVec* w) {
    const T* step = panel + k * kPanel;
    const char* ahead = reinterpret_cast<const char*>(step) + kAheadBytes;
    for (int64_t line = 0; line < kPanel * static_cast<int64_t>(sizeof(T)); line += 64) {
      __builtin_prefetch(ahead + line, 0, 2);
    }
    for (int j = 0; j < kPanelVecs; ++j) {
      w[j] = load_row(step + j * RowVec::size());
    }
  };
  int64_t k = 0;
  if constexpr (R == 1) {
    for (; k + 1 < k_len; k += 2) {
      RowVec w[kPanelVecs], v[kPanelVecs];
      fetch(k, w);
      fetch(k + 1, v);
      const RowVec xe(x[k]), xo(x[k + 1]);
      for (int j = 0; j < kPanelVecs; ++j) {
        acc[0][j] = at::vec::fmadd(w[j], xe, acc[0][j]);
        acc[1][j] = at::vec::fmadd(v[j], xo, acc[1][j]);
      }
    }
  }
  for (; k < k_len; ++k) {
    RowVec w[kPanelVecs];
    fetch(k, w);
    for (int r = 0; r < R; ++r) {
      const RowVec xr(x[r * k_len + k]);
      for (int j = 0; j < kPanelVecs; ++j) {
        acc[r][j] = at::vec::fmadd(w[j], xr, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kPanelVecs; ++j) {
      (R == 1 ? acc[0][j] + acc[1][j] : acc[r][j]).store(sums + r * kPanel + j * RowVec::size());
    }
  }
}

// f(std::integral_constant<int, R>{}) for R = rows, a panel kernel's row count (1 .. kPanelRows)
template <typename F>
inline void by_rows(int rows, F&& f) {
  switch (rows) {
#define SPYRE_PANEL_ROWS(n)                                     \
  case n:                                                       \
    f(std::integral_constant<int, (n <= kPanelRows ? n : 1)>{}); \
    break;
    SPYRE_PANEL_ROWS(1)
    SPYRE_PANEL_ROWS(2)
    SPYRE_PANEL_ROWS(3)
    SPYRE_PANEL_ROWS(4)
    SPYRE_PANEL_ROWS(5)
    SPYRE_PANEL_ROWS(6)
    SPYRE_PANEL_ROWS(7)
    SPYRE_PANEL_ROWS(8)
    SPYRE_PANEL_ROWS(9)
    SPYRE_PANEL_ROWS(10)
    SPYRE_PANEL_ROWS(11)
    SPYRE_PANEL_ROWS(12)
    SPYRE_PANEL_ROWS(13)
#undef SPYRE_PANEL_ROWS
    default:
      f(std::integral_constant<int, kPanelRows>{});
  }
}

template <typename T>
inline void panel_of(int rows, const float* x, int64_t k_len, const T* panel, float* sums) {
  by_rows(rows, [&](auto r) { panel_rows<decltype(r)::value>(x, k_len, panel, sums); });
}

#ifdef SPYRE_BF16_DOT
// sums[r * kPanel + o] = x[r] . panel's output o, for R rows of x (bfloat16, pairs of k, k2_len pairs apart)
// and one panel of pairs [K2, PW, 2], by the bfloat16 dot product: per pair of k, one load of each of the
// panel's vectors serves every row; the sums are float32 (a pair's products exact, each added in turn)
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void pair_panel_rows(const c10::BFloat16* x, int64_t k2_len,
                                                                  const c10::BFloat16* panel, float* sums) {
  static_assert(kPanelVecs * 16 == kPanel, "a panel of pairs is kPanelVecs vectors of 16 outputs");
  __m512 acc[R][kPanelVecs];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kPanelVecs; ++j) {
      acc[r][j] = _mm512_setzero_ps();
    }
  }
  for (int64_t k2 = 0; k2 < k2_len; ++k2) {
    const char* step = reinterpret_cast<const char*>(panel + k2 * 2 * kPanel);
    for (int64_t line = 0; line < 2 * kPanel * static_cast<int64_t>(sizeof(c10::BFloat16)); line += 64) {
      __builtin_prefetch(step + kAheadBytes + line, 0, 2);
    }
    __m512i w[kPanelVecs];
    for (int j = 0; j < kPanelVecs; ++j) {
      w[j] = _mm512_loadu_si512(step + 64 * j);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (r * k2_len + k2) * 2, sizeof(pair));
      const __m512i xr = _mm512_set1_epi32(pair);
      for (int j = 0; j < kPanelVecs; ++j) {
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[j], (__m512bh)xr);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kPanelVecs; ++j) {
      _mm512_storeu_ps(sums + r * kPanel + j * 16, acc[r][j]);
    }
  }
}

void pair_panel_of(int rows, const c10::BFloat16* x, int64_t k2_len, const c10::BFloat16* panel, float* sums) {
  by_rows(rows, [&](auto r) { pair_panel_rows<decltype(r)::value>(x, k2_len, panel, sums); });
}
#endif

// silu(g) * u of one vector of each
inline RowVec glu_vec(const RowVec& g, const RowVec& u) {
  return g * u / (RowVec(1.f) + g.neg().exp_u20());
}

// silu(gate) * up, in place in `gate`, over kPanel floats (the outputs past a panel's width are its padding)
inline void glu_sums(float* gate, const float* up) {
  for (int64_t o = 0; o < kPanel; o += RowVec::size()) {
    glu_vec(RowVec::loadu(gate + o), RowVec::loadu(up + o)).store(gate + o);
  }
}

// out [m, n_out] (+ bias) from the weight's panels, over the threads by panel: panel_sums(rows, r0, p, sums)
// gives the sums of rows r0 .. r0 + rows - 1 of x with panel p's outputs. With Glu, out [m, n_out] =
// silu(x @ gate^T + bias_g) * (x @ up^T + bias_u) from panels in the GLU layout (`pack_glu_rows`: the gate's
// `count` panels, then the up half's), each panel's sums meeting the same outputs' other half in registers'
// reach, so only the product is written (the step's graph no longer writes [m, 2 * n_out] and reads it back)
template <bool Glu, typename T, typename PanelSums>
void rows_times(int64_t m, int pass, const T* bias, T* out, int64_t n_out, const PanelSums& panel_sums) {
  const int64_t count = panel_count(n_out);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kPanelRows * kPanel];
    alignas(64) float up[Glu ? kPanelRows * kPanel : 1];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanel, width = std::min<int64_t>(kPanel, n_out - first);
      for (int64_t r0 = 0; r0 < m; r0 += pass) {
        const int rows = static_cast<int>(std::min<int64_t>(pass, m - r0));
        panel_sums(rows, r0, p, sums);
        if constexpr (Glu) {
          panel_sums(rows, r0, count + p, up);
        }
        for (int r = 0; r < rows; ++r) {
          float* row_sums = sums + r * kPanel;
          if (bias) {
            for (int64_t o = 0; o < width; ++o) {
              row_sums[o] += static_cast<float>(bias[first + o]);
              if constexpr (Glu) up[r * kPanel + o] += static_cast<float>(bias[n_out + first + o]);
            }
          }
          if constexpr (Glu) {
            glu_sums(row_sums, up + r * kPanel);
          }
          T* row_out = out + (r0 + r) * n_out + first;
          for (int64_t o = 0; o < width; ++o) {
            row_out[o] = static_cast<T>(row_sums[o]);
          }
        }
      }
    }
  });
}

// two vectors of floats into T: float32 as they are, bfloat16 rounded (one vector of bfloat16)
inline void store_pair(float* out, const RowVec& a, const RowVec& b) {
  a.store(out);
  b.store(out + RowVec::size());
}

inline void store_pair(c10::BFloat16* out, const RowVec& a, const RowVec& b) {
  at::vec::convert_from_float<c10::BFloat16>(a, b).store(out);
}

// out [m, half] = silu(full[:, :half]) * full[:, half:] for a GEMM's output full [m, 2 * half] (the GLU of the
// rows that oneDNN multiplied), over the threads by row, each value rounded once
template <typename T>
void glu_of_rows(const T* full, int64_t m, int64_t half, T* out) {
  constexpr int64_t kStep = 2 * RowVec::size();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = full + r * 2 * half;
      const T* up = gate + half;
      T* row_out = out + r * half;
      int64_t o = 0;
      for (; o + kStep <= half; o += kStep) {
        const int64_t next = o + RowVec::size();
        store_pair(row_out + o, glu_vec(load_row(gate + o), load_row(up + o)),
                   glu_vec(load_row(gate + next), load_row(up + next)));
      }
      for (; o < half; ++o) {
        const float g = static_cast<float>(gate[o]);
        row_out[o] = static_cast<T>(g * static_cast<float>(up[o]) / (1.f + std::exp(-g)));
      }
    }
  });
}

// the panels of a 2-d weight [N, K] now: [P, K, PW], or of pairs along k [P, K2, PW, 2] (K2 = K / 2 rounded
// up) where bfloat16 runs on the CPU's bfloat16 dot product (paged_attention.cpp's `bf16_dot_on`)
std::vector<int64_t> panel_sizes(const at::Tensor& weight, bool glu = false) {
  const int64_t k_len = weight.size(1);
  const int64_t count = glu ? 2 * panel_count(weight.size(0) / 2) : panel_count(weight.size(0));
  if (weight.scalar_type() == at::kBFloat16 && bf16_dot_on()) {
    return {count, (k_len + 1) / 2, kPanel, 2};
  }
  return {count, k_len, kPanel};
}

// a weight [N, K] in its panels (panel_sizes), the outputs past N and the values past K zero
at::Tensor pack_rows(const at::Tensor& weight) {
  RECORD_FUNCTION("spyre_kernels::pack_rows", std::vector<c10::IValue>());
  TORCH_CHECK(weight.dim() == 2, "pack_rows: weight must be 2-d [out, in], got ", weight.dim(), "-d");
  const int64_t n_out = weight.size(0), k_len = weight.size(1), count = panel_count(n_out);
  const std::vector<int64_t> sizes = panel_sizes(weight);
  if (sizes.size() == 4) {
    const int64_t k2_len = sizes[1];
    at::Tensor padded = at::zeros({count * kPanel, 2 * k2_len}, weight.options());
    padded.narrow(0, 0, n_out).narrow(1, 0, k_len).copy_(weight);
    return padded.view({count, kPanel, k2_len, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  at::Tensor padded = at::zeros({count * kPanel, k_len}, weight.options());
  padded.narrow(0, 0, n_out).copy_(weight);
  return padded.view({count, kPanel, k_len}).transpose(1, 2).contiguous();
}

// a GLU's weight [2 * half, K] (gate, then up) in the GLU layout: each half in panels of its own, the gate's
// first, so panel p of the gate and panel count + p of the up half hold the same outputs (the plain layout's
// when half is a multiple of a panel's width)
at::Tensor pack_glu_rows(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "linear_row_glu: weight must be 2-d [2 * half, in], got ",
              weight.sizes());
  const int64_t half = weight.size(0) / 2, span = panel_count(half) * kPanel;
  at::Tensor halves = at::zeros({2 * span, weight.size(1)}, weight.options());
  halves.narrow(0, 0, half).copy_(weight.narrow(0, 0, half));
  halves.narrow(0, span, half).copy_(weight.narrow(0, half, half));
  return pack_rows(halves);
}

// a weight's panels, and whether they are in the GLU layout (pack_glu_rows): a layout is never read as the other
struct Panels {
  at::Tensor panels;
  bool glu;
};
std::shared_mutex rows_mutex;
std::unordered_map<int64_t, Panels> row_panels;  // a weight's address -> its panels (register_rows)

void register_rows(int64_t address, const at::Tensor& weight) {
  at::Tensor panels = pack_rows(weight);
  std::unique_lock<std::shared_mutex> lock(rows_mutex);
  row_panels[address] = {std::move(panels), false};
}

void register_glu_rows(int64_t address, const at::Tensor& weight) {
  at::Tensor panels = pack_glu_rows(weight);
  std::unique_lock<std::shared_mutex> lock(rows_mutex);
  row_panels[address] = {std::move(panels), true};
}

void forget_rows(int64_t address) {
  std::unique_lock<std::shared_mutex> lock(rows_mutex);
  row_panels.erase(address);
}

// the registered panels of this weight (by its address, of its layout, shape and dtype), else new ones
at::Tensor panels_of(const at::Tensor& weight, bool glu = false) {
  {
    std::shared_lock<std::shared_mutex> lock(rows_mutex);
    const auto found = row_panels.find(reinterpret_cast<int64_t>(weight.data_ptr()));
    if (found != row_panels.end() && found->second.glu == glu &&
        found->second.panels.scalar_type() == weight.scalar_type() &&
        found->second.panels.sizes() == c10::IntArrayRef(panel_sizes(weight, glu))) {
      return found->second.panels;
    }
  }
  return glu ? pack_glu_rows(weight) : pack_rows(weight);
}

// out [m, N] (contiguous, the weight's dtype) = x @ weight^T (+ bias) for a checked x of m rows, over the threads;
// with `glu`, out [m, N / 2] = silu(the first half's outputs) * the second half's (linear_row_glu). With `count`
// >= 0, only rows first .. first + count - 1 of x, into the same rows of out (packed_linear.cpp's live spans:
// no narrowed views, which cost a dispatcher call each, 121 layers a step)
void rows_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               at::Tensor& out, bool glu = false, int64_t first = 0, int64_t count = -1);

at::Tensor rows_op(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, bool glu) {
  const int64_t k_len = weight.dim() == 2 ? weight.size(1) : 0;
  const int64_t n_out = weight.dim() == 2 ? weight.size(0) / (glu ? 2 : 1) : 0;
  at::Tensor out = at::empty({k_len && x.dim() >= 1 ? x.numel() / k_len : 0, n_out}, x.options());
  rows_into(x, weight, bias, out, glu);
  return out;
}

at::Tensor linear_row(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return rows_op(x, weight, bias, false);
}

// silu(x @ gate^T + bias_g) * (x @ up^T + bias_u) for a GLU's weight [2 * half, K] (gate, then up) and bias
at::Tensor linear_row_glu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return rows_op(x, weight, bias, true);
}

void rows_into(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               at::Tensor& out, bool glu, int64_t first, int64_t count) {
  const char* name = glu ? "linear_row_glu" : "linear_row";
  TORCH_CHECK(weight.dim() == 2, name, ": weight must be 2-d [out, in], got ", weight.dim(), "-d");
  const int64_t n_out = weight.size(0), k_len = weight.size(1);
  TORCH_CHECK(!glu || n_out % 2 == 0, name, ": weight must have an even count of outputs (gate, then up), got ",
              n_out);
  const int64_t width = glu ? n_out / 2 : n_out;  // out's columns
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype, name,
              ": float32 or bfloat16 only, x and weight alike, got x ", x.scalar_type(), " and weight ", dtype);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k_len && k_len > 0, name, ": x must be rows of ", k_len,
              " values, got ", x.sizes());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), name, ": x and weight must be contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n_out, name,
                ": bias must be a contiguous ", dtype, " [", n_out, "], got ", bias->scalar_type(), " ",
                bias->sizes());
  }
  const int64_t all = x.numel() / k_len, m = count < 0 ? all : count;
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.numel() == all * width, name,
              ": out must be a contiguous ", dtype, " [", all, ", ", width, "]");
  TORCH_CHECK(0 <= first && first + m <= all, name, ": rows ", first, " .. ", first + m, " beyond ", all);
  const at::Tensor panels = panels_of(weight, glu);
  const auto times = [&](int pass, auto* bias_ptr, auto* out_ptr, const auto& panel_sums) {
    if (glu) {
      rows_times<true>(m, pass, bias_ptr, out_ptr, width, panel_sums);
    } else {
      rows_times<false>(m, pass, bias_ptr, out_ptr, width, panel_sums);
    }
  };
  using B = c10::BFloat16;
#ifdef SPYRE_BF16_DOT
  if (panels.dim() == 4) {  // pairs: x's rows as pairs too, a zero after an odd k_len (a copy only then)
    const int64_t k2_len = panels.size(1);
    const at::Tensor xp = 2 * k2_len == k_len ? x : at::constant_pad_nd(x.reshape({all, k_len}), {0, 1}, 0);
    const B* x_ptr = xp.data_ptr<B>() + first * 2 * k2_len;
    const B* panel_ptr = panels.data_ptr<B>();
    times(kPanelRows, has_bias ? bias->data_ptr<B>() : static_cast<B*>(nullptr), out.data_ptr<B>() + first * width,
          [&](int rows, int64_t r0, int64_t p, float* sums) {
            pair_panel_of(rows, x_ptr + r0 * 2 * k2_len, k2_len, panel_ptr + p * k2_len * 2 * kPanel, sums);
          });
    return;
  }
#endif
  // x's rows in float32 once (a few KiB), so the inner loop widens only the weight
  const at::Tensor xf = dtype == at::kFloat ? x : x.to(at::kFloat).contiguous();
  const float* x_ptr = xf.data_ptr<float>() + first * k_len;
  const auto widened = [&](auto* panel_ptr, auto* bias_ptr, auto* out_ptr) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(panel_ptr)>>;
    times(std::is_same_v<T, float> ? kPanelRows : kWidenedRows, bias_ptr, out_ptr,
          [&](int rows, int64_t r0, int64_t p, float* sums) {
            panel_of<T>(rows, x_ptr + r0 * k_len, k_len, panel_ptr + p * k_len * kPanel, sums);
          });
  };
  if (dtype == at::kFloat) {
    widened(panels.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
            out.data_ptr<float>() + first * width);
  } else {
    widened(panels.data_ptr<B>(), has_bias ? bias->data_ptr<B>() : static_cast<B*>(nullptr),
            out.data_ptr<B>() + first * width);
  }
}

// a GLU of the rows oneDNN multiplied: out [m, half] = silu(full[:, :half]) * full[:, half:] (packed_linear.cpp)
void glu_of(const at::Tensor& full, at::Tensor& out) {
  const int64_t half = out.size(-1), m = out.numel() / std::max<int64_t>(half, 1);
  if (full.scalar_type() == at::kFloat) {
    glu_of_rows(full.data_ptr<float>(), m, half, out.data_ptr<float>());
  } else {
    glu_of_rows(full.data_ptr<c10::BFloat16>(), m, half, out.data_ptr<c10::BFloat16>());
  }
}

// whether the bfloat16 row linear and prompt attention run on the CPU's bfloat16 dot product (`want`: allowed
// to; tests and benches compare both): true only where this build and the CPU have it. Panels already made in
// the other layout are made again at their next call.
bool set_bf16_dot(bool want) {
  bf16_dot_wanted.store(want, std::memory_order_relaxed);
  return bf16_dot_on();
}

bool bf16_dot() {
  return bf16_dot_on();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def("linear_row(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_row_glu(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // linear.py's registry of panels (kernels for every dispatch key: they keep a tensor, or take none)
  m.def("register_rows(int address, Tensor weight) -> ()", &register_rows);
  m.def("register_glu_rows(int address, Tensor weight) -> ()", &register_glu_rows);
  m.def("forget_rows(int address) -> ()", &forget_rows);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("set_bf16_dot(bool want) -> bool", &set_bf16_dot);
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("linear_row", &linear_row);
  m.impl("linear_row_glu", &linear_row_glu);
}
