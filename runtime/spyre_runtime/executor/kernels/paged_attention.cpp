// Paged decode attention that reads the KV cache's blocks in place (spyre_kernels::paged_decode).
//
// One query token per row against the row's own cached tokens, found through its block table: the keys and
// values are read once, where they lie, with no gathered copy. Written once on ATen's portable vector layer
// (at::vec::Vectorized: AVX2, AVX-512, VSX, Z vector, NEON/SVE), built with the flags the runtime's
// inductor picks for this CPU (paged_attention.py). The ATen ops in kv_cache.py are its fallback and its
// test oracle; the semantics are theirs:
//   query [B, h, hd]; key_cache, value_cache [num_blocks, block_size, kvh, hd]; block_table [B, nb];
//   seq_lens [B] -> out [B, h, hd]. Row r attends to its positions [start, seq_lens[r]) with start 0, or
//   seq_lens[r] - window with a sliding window; query head i reads KV head i / (h / kvh) (GQA: the heads of
//   a group share every K/V read); a layer with attention sinks adds exp(sink[i]) (one logit per query
//   head, in the scaled units of the scores) to each softmax's denominator. Rows from `live` on (when
//   live >= 0) are dummies: they read nothing and come out zero.
//
// Work: an item is (row, a range of its positions), every head of the row. A long context is split into
// ranges so that every thread has work even at one row; the threads pull items from a shared counter,
// longest first, and the last finisher of a split row merges the splits' partial softmaxes. A thread claims
// its next item at its current item's last block, and asks for that item's first block while the last one
// is read (spread over the last block's tokens, however few): no item starts cold (bench/README.md run 53:
// a 32-row step of 129-160 tokens a row, 30 layers, 0.85-0.88x the time). Inside an item
// the range is walked one block at a time (online softmax), and each block one KV head after another while
// it is in the cache (its slots are contiguous; one head's slice of each slot is not): the group's scores
// for the block, their running max and sum, then the block's values weighted into float accumulators. K/V
// in bf16 or fp16 are widened to fp32 on load; every sum is fp32. The kernel waits on memory, not on
// arithmetic: each slot it reads asks for the same slot of the next block (into L2) and for a slot a few
// tokens ahead (into L1); the heads scored or weighted at once are a compile-time count, so that their sums
// stay in registers (bench/README.md runs 25 and 26). Where head_dim is 1, 2, 4 or 8 whole vectors, the
// head_dim is a compile-time count too: a group's queries (when scoring) or its accumulators (when weighting
// the values) stay in registers across the block's tokens, up to 4 heads at once (run 36: 2.3x less
// arithmetic than the loops over any head_dim, which remain for the other sizes).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(CPU_CAPABILITY_AVX512) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SPYRE_BF16_DOT 1  // this build has bfloat16 dot-product paths, for a CPU that has the instruction
#endif

namespace {

// The CPU's bfloat16 dot product (AVX-512 BF16's vdpbf16ps: 16 float32 sums, each += two products of
// bfloat16 pairs), found at run time, as the build's flags are only the vector ISA's; its paths are written
// with its intrinsics in functions of their own target, beside the portable ones (linear_row.cpp's panels of
// pairs, paged_prefill.cpp's tiles of pairs) that run everywhere else and under set_bf16_dot(false).
bool cpu_has_bf16_dot() {
#ifdef SPYRE_BF16_DOT
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

std::atomic<bool> bf16_dot_wanted{true};

inline bool bf16_dot_on() {
  return bf16_dot_wanted.load(std::memory_order_relaxed) && cpu_has_bf16_dot();
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kHeadChunk = 8;      // query heads scored at once (their accumulators stay in registers)
constexpr int64_t kItemsPerThread = 4;  // splits aim at this many items per thread, for balance
constexpr int64_t kMinSplitBlocks = 1;  // a split reads at least this many blocks
constexpr int64_t kParallelWork = 512;  // token-heads below which one thread does everything
constexpr int64_t kNear = 8;            // how many tokens ahead a block's own slots are asked for

template <typename T>
inline Vec load_float(const T* p) {
  Vec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}

template <>
inline Vec load_float<float>(const float* p) {
  return Vec::loadu(p);
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

struct Problem {
  int64_t heads, kvheads, group, head_dim, block_size;
  int64_t k_block, k_slot, k_head, v_block, v_slot, v_head;  // the caches' strides, in elements
  const int64_t* table;
  int64_t table_stride;
  float scale;
  const float* sinks;  // [heads] or null
};

struct Item {
  int64_t row, start, end;
  int64_t partial;  // its slot in the partials buffer, -1 when the item is its row's only one
};

// One thread's working memory: the row's scaled queries, one group's scores for a block, the running
// softmax of every head.
struct Scratch {
  std::vector<float> query, scores, acc, max, sum;
  Scratch(const Problem& p)
      : query(p.heads * p.head_dim),
        scores(p.group * p.block_size),
        acc(p.heads * p.head_dim),
        max(p.heads),
        sum(p.heads) {}
};

// Calls f(std::integral_constant<int, hn>{}) for hn in 1..kHeadChunk: the head loops' count as a constant.
template <typename F>
inline void with_head_count(int64_t hn, F&& f) {
  switch (hn) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// Asks for `width` elements at `p` to be brought into the cache: the next block's slot into L2 (locality 2),
// a block's work ahead, where L1 could not keep it; this block's slot kNear tokens ahead into L1 (3). One
// slot per token read, so that the requests are spread over the loops: a whole block asked for at its start
// left the kernel waiting on full fill buffers (bench/README.md run 26).
template <typename T, int kLocality = 2>
inline void prefetch(const T* p, int64_t width) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t i = 0; i < width; i += kLine) __builtin_prefetch(p + i, 0, kLocality);
}

// How many of the next block's `ahead` slots each of a block's n tokens asks for: all of them spread evenly
// over the n tokens, so that a short block (a row's last, of a few tokens) still asks for the whole of the
// block read after it. Once per block and head chunk, outside the token loops.
inline int64_t slots_per_token(int64_t ahead, int64_t n) {
  return (ahead + n - 1) / n;
}

// Asks for the next block's slots that fall to token t (`per` a token, slots_per_token).
template <typename T>
inline void prefetch_next(const T* next, int64_t stride, int64_t width, int64_t t, int64_t per, int64_t ahead) {
  for (int64_t u = t * per, end = std::min(ahead, u + per); u < end; ++u) prefetch(next + u * stride, width);
}

// The scores of query heads [h0, h0 + HN) against n consecutive keys starting at `keys` (HN a constant, so
// that the heads' sums stay in registers); asks for the next block's first `ahead` keys from `next` on.
template <typename T, int HN>
void score_heads(const Problem& p, const float* q, const T* keys, int64_t n, int64_t h0, float* scores,
                 const T* next, int64_t ahead) {
  const int64_t d = p.head_dim, vec_end = d - d % kLanes, per = slots_per_token(ahead, n);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_next(next, p.k_slot, d, t, per, ahead);
    if (t + kNear < n) prefetch<T, 3>(keys + (t + kNear) * p.k_slot, d);
    const T* k = keys + t * p.k_slot;
    Vec s[HN];
    for (int j = 0; j < HN; ++j) s[j] = Vec(0.f);
    for (int64_t i = 0; i < vec_end; i += kLanes) {
      Vec kv = load_float(k + i);
      for (int j = 0; j < HN; ++j) s[j] = at::vec::fmadd(Vec::loadu(q + (h0 + j) * d + i), kv, s[j]);
    }
    for (int j = 0; j < HN; ++j) {
      float total = hsum(s[j]);
      for (int64_t i = vec_end; i < d; ++i) total += q[(h0 + j) * d + i] * static_cast<float>(k[i]);
      scores[(h0 + j) * p.block_size + t] = total;
    }
  }
}

// Folds one block's scores of head h into its running max and sum; leaves exp(score - max) in `scores`.
void softmax_block(float* scores, int64_t n, float& running_max, float& running_sum, float* acc, int64_t d) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, scores[t]);
  const float new_max = std::max(running_max, block_max);
  const float rescale = std::exp(running_max - new_max);  // 0 for the first block
  const int64_t vec_end = n - n % kLanes;
  Vec total(0.f), m(new_max);
  for (int64_t t = 0; t < vec_end; t += kLanes) {
    Vec e = (Vec::loadu(scores + t) - m).exp_u20();
    e.store(scores + t);
    total = total + e;
  }
  float sum = hsum(total);
  for (int64_t t = vec_end; t < n; ++t) {
    scores[t] = std::exp(scores[t] - new_max);
    sum += scores[t];
  }
  if (rescale != 1.f) {
    for (int64_t i = 0; i < d; ++i) acc[i] *= rescale;
  }
  running_sum = running_sum * rescale + sum;
  running_max = new_max;
}

// acc[h] += sum_t weights[h][t] * values[t] for heads [h0, h0 + HN) of the group; asks for the next
// block's first `ahead` values from `next` on.
template <typename T, int HN>
void accumulate_heads(const Problem& p, const T* values, int64_t n, const float* weights, float* acc, int64_t h0,
                      const T* next, int64_t ahead) {
  const int64_t d = p.head_dim, vec_end = d - d % kLanes, per = slots_per_token(ahead, n);
  for (int64_t i = 0; i < vec_end; i += kLanes) {
    Vec a[HN];
    for (int j = 0; j < HN; ++j) a[j] = Vec::loadu(acc + (h0 + j) * d + i);
    for (int64_t t = 0; t < n; ++t) {
      if (i == 0) prefetch_next(next, p.v_slot, d, t, per, ahead);
      if (i == 0 && t + kNear < n) prefetch<T, 3>(values + (t + kNear) * p.v_slot, d);
      Vec v = load_float(values + t * p.v_slot + i);
      for (int j = 0; j < HN; ++j) a[j] = at::vec::fmadd(Vec(weights[(h0 + j) * p.block_size + t]), v, a[j]);
    }
    for (int j = 0; j < HN; ++j) a[j].store(acc + (h0 + j) * d + i);
  }
  for (int64_t i = vec_end; i < d; ++i) {
    for (int64_t t = 0; t < n; ++t) {
      const float v = static_cast<float>(values[t * p.v_slot + i]);
      for (int j = 0; j < HN; ++j) acc[(h0 + j) * d + i] += weights[(h0 + j) * p.block_size + t] * v;
    }
  }
}

// Loads the DV vectors of heads [h0, h0 + HN) from `base` (HN rows of DV vectors).
template <int HN, int DV>
inline void load_heads(Vec (&out)[HN][DV], const float* base, int64_t h0) {
  constexpr int64_t d = DV * kLanes;
  for (int j = 0; j < HN; ++j)
    for (int c = 0; c < DV; ++c) out[j][c] = Vec::loadu(base + (h0 + j) * d + c * kLanes);
}

// Loads token t's DV vectors from a block's slots at `base` (`stride` apart), after asking for the next
// block's slots that fall to token t (`per` a token, prefetch_next) and for this block's slot kNear tokens
// on, as the loops over any head_dim do.
template <typename T, int DV>
inline void load_slot(Vec (&out)[DV], const T* base, int64_t stride, int64_t t, int64_t n, const T* next,
                      int64_t per, int64_t ahead) {
  constexpr int64_t d = DV * kLanes;
  prefetch_next(next, stride, d, t, per, ahead);
  if (t + kNear < n) prefetch<T, 3>(base + (t + kNear) * stride, d);
  for (int c = 0; c < DV; ++c) out[c] = load_float(base + t * stride + c * kLanes);
}

// The same two loops for a head_dim of DV whole vectors (DV a constant): the HN heads' queries, or their
// accumulators, stay in registers across the block's tokens, so a token costs its DV loads and HN * DV FMAs,
// with no accumulator reloaded and no chain of FMAs longer than one per token.
template <typename T, int HN, int DV>
void score_fixed(const Problem& p, const float* q, const T* keys, int64_t n, int64_t h0, float* scores,
                 const T* next, int64_t ahead) {
  Vec qv[HN][DV];
  load_heads<HN, DV>(qv, q, h0);
  const int64_t per = slots_per_token(ahead, n);
  for (int64_t t = 0; t < n; ++t) {
    Vec kv[DV];
    load_slot<T, DV>(kv, keys, p.k_slot, t, n, next, per, ahead);
    for (int j = 0; j < HN; ++j) {
      Vec s = qv[j][0] * kv[0];
      for (int c = 1; c < DV; ++c) s = at::vec::fmadd(qv[j][c], kv[c], s);
      scores[(h0 + j) * p.block_size + t] = hsum(s);
    }
  }
}

template <typename T, int HN, int DV>
void accumulate_fixed(const Problem& p, const T* values, int64_t n, const float* weights, float* acc, int64_t h0,
                      const T* next, int64_t ahead) {
  Vec a[HN][DV];
  load_heads<HN, DV>(a, acc, h0);
  const int64_t per = slots_per_token(ahead, n);
  for (int64_t t = 0; t < n; ++t) {
    Vec vv[DV];
    load_slot<T, DV>(vv, values, p.v_slot, t, n, next, per, ahead);
    for (int j = 0; j < HN; ++j) {
      const Vec w(weights[(h0 + j) * p.block_size + t]);
      for (int c = 0; c < DV; ++c) a[j][c] = at::vec::fmadd(w, vv[c], a[j][c]);
    }
  }
  constexpr int64_t d = DV * kLanes;
  for (int j = 0; j < HN; ++j)
    for (int c = 0; c < DV; ++c) a[j][c].store(acc + (h0 + j) * d + c * kLanes);
}

// The vector registers the fixed loops may fill: AVX-512 has 32, AVX2 16 (VSX and Z more; 16 is safe).
constexpr int kRegisters = kLanes >= 16 ? 32 : 16;

// How many heads the fixed loops take at once for a head_dim of `dv` vectors: their DV * HN accumulators,
// the token's DV values and a weight within the registers; 1 to 4.
constexpr int64_t heads_at_once(int dv) {
  const int fit = (kRegisters - dv - 1) / dv;
  return fit < 1 ? 1 : (fit > 4 ? 4 : fit);
}

// Calls f(std::integral_constant<int, dv>{}) when head_dim is dv whole vectors for dv in 1, 2, 4 or 8, and
// returns true; false (f not called) for any other head_dim.
template <typename F>
inline bool with_vector_count(int64_t head_dim, F&& f) {
  if (head_dim % kLanes != 0) return false;
  switch (head_dim / kLanes) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

// Calls f(std::integral_constant<int, hn>{}, h0, fetch) for the group's heads in chunks [h0, h0 + hn) of at
// most `most` heads (hn a constant, never above `most`); `fetch`: how many of the next block's slots the
// chunk asks for (the first chunk asks for `ahead`, the others for none).
template <int64_t most, typename F>
inline void for_head_chunks(int64_t g, int64_t ahead, F&& f) {
  for (int64_t h0 = 0; h0 < g; h0 += most) {
    with_head_count(std::min(most, g - h0), [&](auto hn) {
      if constexpr (decltype(hn)::value <= most) f(hn, h0, h0 == 0 ? ahead : 0);
    });
  }
}

// One KV head's group of query heads over n tokens of a block: their scores, the softmax folded into each
// head's running max and sum, and the values weighted into the accumulators. DV > 0: head_dim is DV whole
// vectors (the fixed loops); 0: any head_dim.
template <typename T, int DV>
void attend_group(const Problem& p, const T* keys, const T* values, int64_t n, const T* next_keys,
                  const T* next_values, int64_t ahead, int64_t first, Scratch& s) {
  const int64_t d = p.head_dim, g = p.group;
  const float* q = s.query.data() + first * d;
  float* acc = s.acc.data() + first * d;
  float* scores = s.scores.data();
  constexpr int64_t most = DV > 0 ? heads_at_once(DV) : kHeadChunk;
  for_head_chunks<most>(g, ahead, [&](auto hn, int64_t h0, int64_t fetch) {
    if constexpr (DV == 0) {
      score_heads<T, decltype(hn)::value>(p, q, keys, n, h0, scores, next_keys, fetch);
    } else {
      score_fixed<T, decltype(hn)::value, DV>(p, q, keys, n, h0, scores, next_keys, fetch);
    }
  });
  for (int64_t h = 0; h < g; ++h) {
    softmax_block(scores + h * p.block_size, n, s.max[first + h], s.sum[first + h], acc + h * d, d);
  }
  for_head_chunks<most>(g, ahead, [&](auto hn, int64_t h0, int64_t fetch) {
    if constexpr (DV == 0) {
      accumulate_heads<T, decltype(hn)::value>(p, values, n, scores, acc, h0, next_values, fetch);
    } else {
      accumulate_fixed<T, decltype(hn)::value, DV>(p, values, n, scores, acc, h0, next_values, fetch);
    }
  });
}

// The row's query heads, scaled, as float32 in `s` (Q: the query's type, which may be wider than the cache's).
template <typename Q>
void load_query(const Problem& p, const Q* query, int64_t row, Scratch& s) {
  const Q* q = query + row * p.heads * p.head_dim;
  for (int64_t i = 0; i < p.heads * p.head_dim; ++i) s.query[i] = static_cast<float>(q[i]) * p.scale;
}

// Every head of the item's row (its query in `s`, load_query) over the item's positions: leaves the running
// max, sum and the unnormalized output of each in `s`. A block is read whole, one KV head after another, while
// it is in the cache: an item's reads are the block's contiguous slots, not one head's slice of each.
// `claim()` is called once, at the item's last block: it returns the item this thread takes next (or null),
// whose first block is then asked for while the last one is read, so that no item starts cold.
template <typename T, typename Claim>
void attend_range(const Problem& p, const T* kc, const T* vc, const Item& item, Claim&& claim, Scratch& s) {
  const int64_t d = p.head_dim, g = p.group;
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.max.begin(), s.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  const int64_t* table = p.table + item.row * p.table_stride;
  for (int64_t pos = item.start; pos < item.end;) {
    const int64_t offset = pos % p.block_size, n = std::min(p.block_size - offset, item.end - pos);
    const int64_t block = table[pos / p.block_size];
    // the next block's keys and values are fetched while this one is computed, each head's with its own:
    // the item's own next block, else the first block of the item this thread takes next
    int64_t next = block, next_offset = 0, ahead = 0;
    if (pos + n < item.end) {
      next = table[(pos + n) / p.block_size];
      ahead = std::min(p.block_size, item.end - pos - n);
    } else if (const Item* following = claim()) {
      next = p.table[following->row * p.table_stride + following->start / p.block_size];
      next_offset = following->start % p.block_size;
      ahead = std::min(p.block_size - next_offset, following->end - following->start);
    }
    for (int64_t kvhead = 0; kvhead < p.kvheads; ++kvhead) {
      const T* keys = kc + block * p.k_block + offset * p.k_slot + kvhead * p.k_head;
      const T* values = vc + block * p.v_block + offset * p.v_slot + kvhead * p.v_head;
      const T* next_keys = kc + next * p.k_block + next_offset * p.k_slot + kvhead * p.k_head;
      const T* next_values = vc + next * p.v_block + next_offset * p.v_slot + kvhead * p.v_head;
      const int64_t first = kvhead * g;  // the group's first query head
      const bool fixed = with_vector_count(d, [&](auto dv) {
        attend_group<T, decltype(dv)::value>(p, keys, values, n, next_keys, next_values, ahead, first, s);
      });
      if (!fixed) attend_group<T, 0>(p, keys, values, n, next_keys, next_values, ahead, first, s);
    }
    pos += n;
  }
}

// out[h] = acc[h] / (sum[h] + exp(sink[h] - max[h])) for every head of a row.
template <typename T>
void write_output(const Problem& p, const float* acc, const float* max, const float* sum, T* out) {
  for (int64_t j = 0; j < p.heads; ++j) {
    float denom = sum[j];
    if (p.sinks != nullptr) denom += std::exp(p.sinks[j] - max[j]);
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    for (int64_t i = 0; i < p.head_dim; ++i) out[j * p.head_dim + i] = static_cast<T>(acc[j * p.head_dim + i] * inv);
  }
}

// Merges the partial softmaxes of `count` splits (each: max[h], sum[h], acc[h * hd]) into one.
void merge_splits(const Problem& p, const float* partials, int64_t count, Scratch& s) {
  const int64_t heads = p.heads, d = p.head_dim, stride = heads * (d + 2);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for (int64_t j = 0; j < heads; ++j) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < count; ++c) top = std::max(top, partials[c * stride + j]);
    float total = 0.f;
    for (int64_t c = 0; c < count; ++c) {
      const float* part = partials + c * stride;
      const float w = std::exp(part[j] - top);
      total += part[heads + j] * w;
      const float* acc = part + 2 * heads + j * d;
      for (int64_t i = 0; i < d; ++i) s.acc[j * d + i] += acc[i] * w;
    }
    s.max[j] = top;
    s.sum[j] = total;
  }
}

struct Plan {
  std::vector<Item> items;
  std::vector<int64_t> first_partial;  // per row: its first partial slot, -1 when unsplit
  std::vector<int64_t> splits;         // per row: how many items
  int64_t partials = 0;
  int64_t work = 0;  // token-heads read
};

Plan plan_items(const int64_t* seq_lens, int64_t live, int64_t kvheads, int64_t capacity, int64_t window,
                int64_t block_size) {
  Plan plan;
  std::vector<int64_t> starts(live), ends(live);
  for (int64_t r = 0; r < live; ++r) {
    const int64_t end = seq_lens[r];
    TORCH_CHECK(end >= 0 && end <= capacity, "paged_decode: seq_lens[", r, "]=", end,
                " is outside the row's block table (0 to ", capacity, " tokens)");
    ends[r] = end;
    starts[r] = window > 0 ? std::max<int64_t>(0, end - window) : 0;
    plan.work += (end - starts[r]) * kvheads;
  }
  const int64_t threads = at::get_num_threads();
  int64_t split = plan.work / std::max<int64_t>(1, threads * kItemsPerThread * kvheads);
  split = std::max(split, kMinSplitBlocks * block_size);
  split = (split + block_size - 1) / block_size * block_size;
  if (threads == 1 || plan.work < kParallelWork) split = capacity + 1;  // one thread: never split
  plan.first_partial.assign(live, -1);
  plan.splits.assign(live, 0);
  for (int64_t r = 0; r < live; ++r) {
    const int64_t len = ends[r] - starts[r];
    const int64_t count = len == 0 ? 0 : (len + split - 1) / split;
    plan.splits[r] = count;
    if (count > 1) plan.first_partial[r] = plan.partials;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t start = starts[r] + c * split;
      plan.items.push_back({r, start, std::min(ends[r], start + split), count > 1 ? plan.partials++ : -1});
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const Item& a, const Item& b) { return a.end - a.start > b.end - b.start; });
  return plan;
}

// T: the caches' element type; Q: the query's and the output's (T, or float32 over a narrower cache).
template <typename T, typename Q>
void run(const Problem& p, const Plan& plan, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, at::Tensor& out) {
  const Q* q = query.const_data_ptr<Q>();
  const T* kc = key_cache.const_data_ptr<T>();
  const T* vc = value_cache.const_data_ptr<T>();
  Q* o = out.mutable_data_ptr<Q>();
  const int64_t stride = p.heads * (p.head_dim + 2);
  std::vector<float> partials(plan.partials * stride);
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[plan.splits.size()]);
  for (size_t i = 0; i < plan.splits.size(); ++i) left[i].store(plan.splits[i], std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(plan.items.size());
  auto worker = [&](int64_t, int64_t) {
    Scratch s(p);
    // a thread's next item is claimed at its current item's last block (attend_range), not before: until
    // then it stays for whichever thread is free first
    for (int64_t i = next.fetch_add(1), claimed = -1; i < count; i = claimed, claimed = -1) {
      auto claim = [&]() -> const Item* {
        claimed = next.fetch_add(1);
        return claimed < count ? &plan.items[claimed] : nullptr;
      };
      const Item& item = plan.items[i];
      load_query(p, q, item.row, s);
      attend_range(p, kc, vc, item, claim, s);
      if (claimed < 0) claimed = next.fetch_add(1);
      Q* dest = o + item.row * p.heads * p.head_dim;
      if (item.partial < 0) {
        write_output(p, s.acc.data(), s.max.data(), s.sum.data(), dest);
        continue;
      }
      float* part = partials.data() + item.partial * stride;
      std::copy(s.max.begin(), s.max.end(), part);
      std::copy(s.sum.begin(), s.sum.end(), part + p.heads);
      std::copy(s.acc.begin(), s.acc.end(), part + 2 * p.heads);
      if (left[item.row].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the row's last split
        merge_splits(p, partials.data() + plan.first_partial[item.row] * stride, plan.splits[item.row], s);
        write_output(p, s.acc.data(), s.max.data(), s.sum.data(), dest);
      }
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || plan.work < kParallelWork) {
    worker(0, 1);
  } else {
    at::parallel_for(0, threads, 1, worker);
  }
}

// What both attention ops ask of their query [n, heads, head_dim] and caches [num_blocks, block_size, kv_heads,
// head_dim]; each failure names the op and what was wrong.
void check_attention_inputs(const char* op, const char* what, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache) {
  TORCH_CHECK(query.dim() == 3, op, ": query must be [", what, ", heads, head_dim], got ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), op,
              ": the caches must both be [num_blocks, block_size, kv_heads, head_dim], got ", key_cache.sizes(),
              " and ", value_cache.sizes());
  // a cache narrower than the model (--kv-cache-dtype) is read under a float32 query
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  (query.scalar_type() == key_cache.scalar_type() || query.scalar_type() == at::kFloat),
              op, ": the caches must share a dtype, and the query must have it or be float32 (", query.scalar_type(),
              ", ", key_cache.scalar_type(), ", ", value_cache.scalar_type(), ")");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, op, ": the caches' head_dim must be contiguous");
  TORCH_CHECK(key_cache.size(3) == query.size(2), op, ": query head_dim ", query.size(2), " != cache head_dim ",
              key_cache.size(3));
  const int64_t heads = query.size(1), kvheads = key_cache.size(2);
  TORCH_CHECK(kvheads > 0 && heads % kvheads == 0, op, ": ", heads, " query heads do not share ", kvheads,
              " KV heads evenly");
}

// The caches a build reads: SPYRE_KERNEL_CACHES, a mask of 1 float32, 2 bfloat16, 4 float16, and
// SPYRE_KERNEL_MIXED, whether a float32 query may read a narrower cache (--kv-cache-dtype). A server's first
// build compiles only its own dtypes' paths (paged_attention.py `start_build`); every path otherwise.
#ifndef SPYRE_KERNEL_CACHES
#define SPYRE_KERNEL_CACHES 7
#endif
#ifndef SPYRE_KERNEL_MIXED
#define SPYRE_KERNEL_MIXED 1
#endif

// Calls f(T{}, Q{}) with T the C++ type of the caches' dtype (float32, bfloat16 or float16; names `op`
// otherwise) and Q the query's: T, or float (check_attention_inputs allows nothing else). A dtype this build
// left out is an error naming it (the runtime's `takes` keeps such calls on the ATen ops).
template <typename F>
void with_float_types(const at::Tensor& query, const at::Tensor& cache, const char* op, F&& f) {
  auto with_query = [&](auto t) {
    if (query.scalar_type() == cache.scalar_type()) return f(t, t);
#if SPYRE_KERNEL_MIXED
    return f(t, float{});
#else
    TORCH_CHECK(false, op, ": this build has no path for a float32 query over a ", cache.scalar_type(),
                " cache");
#endif
  };
  switch (cache.scalar_type()) {
#if SPYRE_KERNEL_CACHES & 1
    case at::kFloat: return with_query(float{});
#endif
#if SPYRE_KERNEL_CACHES & 2
    case at::kBFloat16: return with_query(c10::BFloat16{});
#endif
#if SPYRE_KERNEL_CACHES & 4
    case at::kHalf: return with_query(c10::Half{});
#endif
    default:
      TORCH_CHECK(false, op, ": this build reads no ", cache.scalar_type(),
                  " cache (a build may read float32, bfloat16 and float16)");
  }
}

at::Tensor paged_decode(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_table_in, const at::Tensor& seq_lens_in, double scale,
                        const std::optional<at::Tensor>& sinks_in, int64_t window, int64_t live) {
  check_attention_inputs("paged_decode", "rows", query_in, key_cache, value_cache);
  const int64_t rows = query_in.size(0), heads = query_in.size(1), head_dim = query_in.size(2);
  const int64_t kvheads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(block_table_in.dim() == 2 && block_table_in.size(0) == rows && seq_lens_in.numel() == rows,
              "paged_decode: block_table must be [rows, blocks] and seq_lens [rows] for ", rows, " rows, got ",
              block_table_in.sizes(), " and ", seq_lens_in.sizes());
  live = live < 0 ? rows : std::min(live, rows);
  const at::Tensor query = query_in.contiguous();
  const at::Tensor table = block_table_in.to(at::kLong).contiguous();
  const at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == heads, "paged_decode: sinks must hold one logit per query head (", heads,
                "), got ", sinks.numel());
  }
  Problem p{heads,
            kvheads,
            heads / kvheads,
            head_dim,
            block_size,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            table.const_data_ptr<int64_t>(),
            table.size(1),
            static_cast<float>(scale),
            sinks.defined() ? sinks.const_data_ptr<float>() : nullptr};
  const int64_t capacity = table.size(1) * block_size;
  const Plan plan = plan_items(seq_lens.const_data_ptr<int64_t>(), live, kvheads, capacity, window, block_size);
  bool every_row_read = live == rows;
  for (int64_t r = 0; every_row_read && r < static_cast<int64_t>(plan.splits.size()); ++r) {
    every_row_read = plan.splits[r] > 0;
  }
  at::Tensor out = every_row_read ? at::empty_like(query) : at::zeros_like(query);
  with_float_types(query, key_cache, "paged_decode", [&](auto t, auto q) {
    run<decltype(t), decltype(q)>(p, plan, query, key_cache, value_cache, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(spyre_kernels, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
      "float scale, Tensor? sinks=None, int window=0, int live=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("paged_decode", &paged_decode);
}
