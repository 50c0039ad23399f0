// The packed linear op in C++ (spyre_serve::packed_linear's CPU kernel, once the extension is loaded).
//
// linear.py defines the op that the compiled graphs call for every linear layer, with its Python kernel as
// the fallback (registered for CompositeExplicitAutograd, which serves CPU only while no CPU kernel is
// registered): it finds the layer's weight packed for oneDNN, and with a step's live-row hint multiplies only
// the live rows, by the row linear (linear_row.cpp) when they are a few (set_row_limits). The hint is a prefix
// of every input's rows, or, for an input of a given row count, up to two spans (a mixed step: its used piece
// places and live decode rows, with dead places between them; linear.live_rows). That Python kernel cost
// 10-30 us a call around the GEMM (a decode step calls it 121 times for SmolLM2; in the 8-row graph that one
// stream decodes in, 3.7 ms a step: bench/README.md run 29). This is the same decision in C++; linear.py
// keeps its state here in step (the packed weights by their weight's address, the live rows, whether the row
// linear may run: not within paged_attention.disabled(), the tests' oracle). Built into the same extension as
// paged_attention.cpp and linear_row.cpp (one translation unit, paged_attention.py).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

std::shared_mutex packed_mutex;
std::unordered_map<int64_t, at::Tensor> packed_weights;  // a weight's address -> that weight packed for oneDNN
std::atomic<int64_t> live_rows{-1};  // the step's live rows (linear.live_rows); -1: every row is live
std::atomic<bool> may_run_row{true};  // false within paged_attention.disabled(): oneDNN runs every row
// the most live rows of a step that the row linear takes, by the weight's dtype (linear.row_limits(),
// given with the rest of linear.py's state); 0 until then: oneDNN
std::atomic<int64_t> row_limit_float{0};
std::atomic<int64_t> row_limit_bf16{0};

// for an input of exactly `rows` rows, its live rows are the spans [start, end) (linear.live_rows' spans)
struct LiveSpans {
  int64_t rows;
  std::array<std::pair<int64_t, int64_t>, 2> spans;
};
std::shared_mutex spans_mutex;
std::vector<LiveSpans> live_spans;

void register_packed(int64_t address, const at::Tensor& packed) {
  std::unique_lock<std::shared_mutex> lock(packed_mutex);
  packed_weights[address] = packed;
}

void forget_packed(int64_t address) {
  {
    std::unique_lock<std::shared_mutex> lock(packed_mutex);
    packed_weights.erase(address);
  }
  forget_rows(address);  // the row linear's panels of that weight (linear_row.cpp)
}

void set_live(int64_t live) {
  live_rows.store(live < 0 ? -1 : live, std::memory_order_relaxed);
}

// flat: (rows, start0, end0, start1, end1) per row count, each span within [0, rows); empty: none
void set_live_spans(c10::IntArrayRef flat) {
  TORCH_CHECK(flat.size() % 5 == 0, "set_live_spans: (rows, start0, end0, start1, end1) per entry, got ",
              flat.size(), " numbers");
  std::vector<LiveSpans> spans;
  for (size_t i = 0; i < flat.size(); i += 5) {
    const int64_t rows = flat[i];
    TORCH_CHECK(0 <= flat[i + 1] && flat[i + 1] <= flat[i + 2] && flat[i + 2] <= flat[i + 3] &&
                    flat[i + 3] <= flat[i + 4] && flat[i + 4] <= rows,
                "set_live_spans: spans out of order or beyond ", rows, " rows");
    spans.push_back({rows, {{{flat[i + 1], flat[i + 2]}, {flat[i + 3], flat[i + 4]}}}});
  }
  std::unique_lock<std::shared_mutex> lock(spans_mutex);
  live_spans = std::move(spans);
}

// the live rows of an input of m rows: its own spans, else the live prefix (the whole input without a hint)
std::array<std::pair<int64_t, int64_t>, 2> spans_of(int64_t m) {
  {
    std::shared_lock<std::shared_mutex> lock(spans_mutex);
    for (const auto& entry : live_spans) {
      if (entry.rows == m) {
        return entry.spans;
      }
    }
  }
  const int64_t hint = live_rows.load(std::memory_order_relaxed);
  return {{{0, hint < 0 ? m : std::min(hint, m)}, {m, m}}};
}

void set_row(bool row) {
  may_run_row.store(row, std::memory_order_relaxed);
}

void set_row_limits(int64_t float32, int64_t bfloat16) {
  row_limit_float.store(std::max<int64_t>(float32, 0), std::memory_order_relaxed);
  row_limit_bf16.store(std::max<int64_t>(bfloat16, 0), std::memory_order_relaxed);
}

// oneDNN's GEMM on the packed weight; ATen's plain one where the packed entry is the weight itself, not oneDNN's
// opaque copy (oneDNN packs no such dtype on this CPU, linear.py `packed_copy`)
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  if (!packed.is_mkldnn()) {
    return at::linear(x, packed, bias);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// the row linear of `n` rows of `flat` from row r into the same rows of out (with `glu`, the GLU of its two halves),
// seen by the profiler under its op's name
void few_rows(const at::Tensor& flat, int64_t r, int64_t n, const at::Tensor& weight,
              const c10::optional<at::Tensor>& bias, at::Tensor& out, bool glu) {
  RECORD_FUNCTION(glu ? "spyre_kernels::linear_row_glu" : "spyre_kernels::linear_row", std::vector<c10::IValue>());
  rows_into(flat, weight, bias, out, glu, r, n);
}

// rows r .. r + n - 1 of a contiguous out [m, N] set to zero (a step's dummy rows), without a view of them
void zero_rows(at::Tensor& out, int64_t r, int64_t n) {
  const int64_t row_bytes = out.numel() / std::max<int64_t>(out.size(0), 1) * out.element_size();
  std::memset(static_cast<char*>(out.data_ptr()) + r * row_bytes, 0, n * row_bytes);
}

// oneDNN's GEMM of x [.., K] by the packed weight; with `glu` (a GLU's weight, gate then up), then the GLU of
// its output's halves, in one pass over it
at::Tensor onednn_rows(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       bool glu) {
  at::Tensor full = onednn_linear(x, packed, bias);
  if (!glu) {
    return full;
  }
  std::vector<int64_t> sizes(full.sizes().begin(), full.sizes().end());
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, full.options());
  glu_of(full.contiguous(), out);
  return out;
}

// packed_linear (glu false) and packed_glu (true): the same decisions, and with `glu` the GLU of the two halves
at::Tensor packed_rows(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       bool glu) {
  const char* name = glu ? "packed_glu" : "packed_linear";
  at::Tensor packed;
  {
    std::shared_lock<std::shared_mutex> lock(packed_mutex);
    const auto found = packed_weights.find(reinterpret_cast<int64_t>(weight.data_ptr()));
    TORCH_CHECK(found != packed_weights.end(), name, ": a weight ", weight.sizes(),
                " that pack_linears did not pack");
    packed = found->second;
  }
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1), name, ": x ", x.sizes(),
              " does not fit the weight ", weight.sizes());
  TORCH_CHECK(!glu || weight.size(0) % 2 == 0, name, ": a weight ", weight.sizes(),
              " with an odd count of outputs is no GLU's (gate, then up)");
  const int64_t k_len = x.size(-1), n_out = weight.size(0) / (glu ? 2 : 1);
  const int64_t m = k_len ? x.numel() / k_len : 0;
  const auto spans = spans_of(m);
  const int64_t live = (spans[0].second - spans[0].first) + (spans[1].second - spans[1].first);
  const auto dtype = weight.scalar_type();
  const int64_t most = dtype == at::kFloat      ? row_limit_float.load(std::memory_order_relaxed)
                       : dtype == at::kBFloat16 ? row_limit_bf16.load(std::memory_order_relaxed)
                                                : 0;
  const bool rows_ok = x.scalar_type() == dtype && may_run_row.load(std::memory_order_relaxed);
  // the row linear takes every live row when they are at most `most` (by the weight's dtype), else oneDNN
  // takes them all: in a mixed step whose chunk is oneDNN's, its decode rows then read the packed weight that
  // the chunk has just brought into the cache, not the plain one from memory (bench/README.md run 50)
  const bool by_rows = rows_ok && live > 0 && live <= most;
  if (live == m && !by_rows) {
    return onednn_rows(x, packed, bias, glu);
  }
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n_out;
  const at::Tensor flat = x.reshape({m, k_len}).contiguous();
  at::Tensor out = at::empty({m, n_out}, x.options());
  if (by_rows && live == m) {  // every row, by the row linear: no span to walk (a decode step's 121 calls)
    few_rows(flat, 0, m, weight, bias, out, glu);
    return out.view(sizes);
  }
  // only the dead rows are zeroed (before, between and after the spans): a mixed step's output is hundreds
  // of rows
  int64_t done = 0;
  for (const auto& [start, end] : spans) {
    if (start > done) {
      zero_rows(out, done, start - done);
    }
    if (end > start && by_rows) {
      few_rows(flat, start, end - start, weight, bias, out, glu);
    } else if (end > start) {
      const at::Tensor rows = flat.narrow(0, start, end - start);
      out.narrow(0, start, end - start).copy_(onednn_rows(rows, packed, bias, glu));
    }
    done = std::max(done, end);
  }
  if (done < m) {
    zero_rows(out, done, m - done);
  }
  return out.view(sizes);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return packed_rows(x, weight, bias, false);
}

at::Tensor packed_glu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return packed_rows(x, weight, bias, true);
}

torch::Library* serving = nullptr;  // the CPU kernels of spyre_serve's packed ops, once they serve (never freed:
std::mutex serving_mutex;            // a registration that outlives the dispatcher at exit would crash)

// from now on the CPU kernels of spyre_serve::packed_linear and packed_glu are these: called by linear.py once it
// has registered the packed weights and the live rows, so no call finds the state empty
void serve_packed_linear() {
  std::lock_guard<std::mutex> lock(serving_mutex);
  if (serving == nullptr) {
    serving = new torch::Library(torch::Library::IMPL, "spyre_serve", c10::DispatchKey::CPU, __FILE__, __LINE__);
    serving->impl("packed_linear", &packed_linear);
    serving->impl("packed_glu", &packed_glu);
  }
}

}  // namespace

// linear.py's state, and the switch to this kernel: kernels for every dispatch key (they take no tensor, or
// one that is only kept)
TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def("register_packed(int address, Tensor packed) -> ()", &register_packed);
  m.def("forget_packed(int address) -> ()", &forget_packed);
  m.def("set_live(int live) -> ()", &set_live);
  m.def("set_live_spans(int[] flat) -> ()", &set_live_spans);
  m.def("set_row(bool row) -> ()", &set_row);
  m.def("set_row_limits(int float32, int bfloat16) -> ()", &set_row_limits);
  m.def("serve_packed_linear() -> ()", &serve_packed_linear);
}
