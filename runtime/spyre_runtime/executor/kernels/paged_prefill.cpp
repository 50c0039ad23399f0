// A prompt piece's causal attention that reads the KV cache's blocks in place (spyre_kernels::paged_prefill).
//
// The chunk region of a mixed step holds pieces of prompts (kv_cache.paged_prefill): each piece's tokens sit
// at consecutive positions and attend to their own request's cached tokens, this step's included, up to their
// own position. The ATen path gathers a piece's blocks (or views them) and runs torch's flash attention, whose
// float32 GEMMs go through MKL's sgemm: on an AMD EPYC that is its AVX2 path, and a 144-token prompt's 30
// layers took 12 ms of a 105 ms step there (bench/README.md run 33). This kernel is the same attention on ATen's
// portable vector layer (at::vec: AVX2, AVX-512, VSX, Z vector, NEON/SVE), in the extension of
// paged_attention.cpp, whose helpers (Vec, kLanes, load_float) it shares; the ATen path stays its fallback
// and its test oracle:
//   query [n, h, hd]: the piece's tokens at positions start .. start + n - 1; key_cache, value_cache
//   [num_blocks, block_size, kvh, hd]; table [nb]: the piece's blocks; token i sees the slots [lo, start + i]
//   with lo = 0, or start + i - window + 1 with a sliding window; query head j reads KV head j / (h / kvh);
//   sinks add exp(sink[j]) to each softmax's denominator, as paged_decode's -> out [n, h, hd].
//
// Work: first every KV head's keys of every block the piece reads are laid out once as [hd, block] float
// tiles, so that scoring is FMAs of a broadcast query value with a vector of keys, with no horizontal sum.
// Then an item is (KV head, a tile of kTile tokens): the group's heads of those tokens, as rows, against every
// block up to the tile's last position (the last block's columns only up to it), with an online softmax;
// kRows rows are scored, and weight the values, at once, kVecs vectors each, so that their sums stay in
// registers; the values are read where they lie. The threads pull items from a shared counter, those that read
// the most first. Every sum is float32; K/V in bf16 or fp16 are widened on load.
// A bfloat16 query over a bfloat16 cache, where the CPU has the bfloat16 dot product (paged_attention.cpp's
// `bf16_dot_on`), takes it instead: the keys and the values are laid out once as tiles of pairs (along the head
// dimension, along the slots), the query is read as it is and each block's weights are rounded to bfloat16,
// so that one instruction per vector adds two products to a float32 sum. SmolLM2's 30 layers, a prompt's 256
// tokens, 2 threads, a Zen 4 (bench/README.md run 55): 14.5 ms against 18.3 widened (0.73-0.79 at 144 and 256
// tokens and at a later chunk); the online softmax (fold_block) is then a fifth of the kernel's time.

namespace {

constexpr int64_t kTile = 16;  // tokens an item takes
constexpr int kRows = 4;       // rows (a token's query head) scored and weighted at once
constexpr int kVecs = 4;       // vectors of scores or of outputs a row holds at once

struct PrefillProblem {
  int64_t n, start, heads, kvheads, group, head_dim, block_size, window;
  int64_t v_block, v_slot, v_head;  // the value cache's strides, in elements
  int64_t first_block;              // the first block any token reads (a window skips the earlier ones)
  int64_t tile_width;               // a key tile's columns: block_size rounded up to kVecs vectors
  const int64_t* table;
  float scale;
  const float* sinks;  // [heads] or null
  const int64_t* rows;  // the piece's token t is row rows[t] of the query and of out, or row t where null
};

// the query's and out's row of the piece's token t
inline int64_t row_of(const PrefillProblem& p, int64_t t) {
  return p.rows != nullptr ? p.rows[t] : t;
}

// keys of (KV head, block b) as a [head_dim, tile_width] float tile, zero past the block's slots
template <typename T>
void lay_out_keys(const PrefillProblem& p, const at::Tensor& key_cache, int64_t kvhead, int64_t b, float* tile) {
  const T* kc = key_cache.const_data_ptr<T>();
  const int64_t w = p.tile_width;
  const T* block = kc + p.table[b] * key_cache.stride(0) + kvhead * key_cache.stride(2);
  std::fill(tile, tile + p.head_dim * w, 0.f);
  for (int64_t s = 0; s < p.block_size; ++s) {
    const T* key = block + s * key_cache.stride(1);
    for (int64_t d = 0; d < p.head_dim; ++d) tile[d * w + s] = static_cast<float>(key[d]);
  }
}

// scores[r][c0, c0 + KN vectors) = q[r] . keys for rows [0, kRows)
template <int KN>
void score_columns(const float* q, int64_t head_dim, const float* tile, int64_t width, int64_t c0, float* scores) {
  Vec s[kRows][KN];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < KN; ++c) s[r][c] = Vec(0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec k[KN];
    for (int c = 0; c < KN; ++c) k[c] = Vec::loadu(tile + d * width + c0 + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Vec qv(q[r * head_dim + d]);
      for (int c = 0; c < KN; ++c) s[r][c] = at::vec::fmadd(qv, k[c], s[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < KN; ++c) s[r][c].store(scores + r * width + c0 + c * kLanes);
}

// f(v0, std::integral_constant<int, V>{}) for vectors [v0, v0 + V) of `count`, V = kVecs but at the end
template <typename F>
void by_vectors(int64_t count, F&& f) {
  for (int64_t v0 = 0; v0 < count; v0 += kVecs) {
    switch (std::min<int64_t>(kVecs, count - v0)) {
      case 1: f(v0, std::integral_constant<int, 1>{}); break;
      case 2: f(v0, std::integral_constant<int, 2>{}); break;
      case 3: f(v0, std::integral_constant<int, 3>{}); break;
      default: f(v0, std::integral_constant<int, kVecs>{}); break;
    }
  }
}

// scores[r][0, columns) = q[r] . keys for rows [0, kRows), `columns` a multiple of kLanes: the tile's columns
// up to the item's last position (the caller masks the rest of each row's)
void score_rows(const float* q, int64_t head_dim, const float* tile, int64_t width, int64_t columns,
                float* scores) {
  by_vectors(columns / kLanes, [&](int64_t v0, auto kn) {
    score_columns<decltype(kn)::value>(q, head_dim, tile, width, v0 * kLanes, scores);
  });
}

// acc[r] += sum_t weights[r][t] * values[t] for rows [0, kRows), n values, output vectors [v0, v0 + VN)
template <typename T, int VN>
void weigh_values(const T* values, int64_t v_slot, int64_t n, const float* weights, int64_t width, float* acc,
                  int64_t head_dim, int64_t v0) {
  // the block's sums start at zero and are added to acc at the end: started from acc's values, GCC wrote
  // every accumulator back to the stack at each token (a store per FMA; perf, 2026-11-29)
  Vec a[kRows][VN];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < VN; ++c) a[r][c] = Vec(0.f);
  for (int64_t t = 0; t < n; ++t) {
    Vec v[VN];
    for (int c = 0; c < VN; ++c) v[c] = load_float(values + t * v_slot + (v0 + c) * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Vec w(weights[r * width + t]);
      for (int c = 0; c < VN; ++c) a[r][c] = at::vec::fmadd(w, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < VN; ++c) {
      float* out = acc + r * head_dim + (v0 + c) * kLanes;
      (Vec::loadu(out) + a[r][c]).store(out);
    }
  }
}

#ifdef SPYRE_BF16_DOT
// The bfloat16 dot product's kernels (a bfloat16 query over a bfloat16 cache, where the CPU has it): the keys'
// tiles hold pairs along the head dimension ([hd / 2, tile_width, 2]) and the values' pairs along the slots
// ([tile_width / 2, hd, 2]), so that one instruction per vector takes two values of either sum; the query is
// read as it is (the scale applied to the sums) and the weights are rounded to bfloat16 (as the output is).
static_assert(kLanes == 16, "the bfloat16 dot product's vectors are 16 float32 sums");

// scores[r][c0, c0 + KN vectors) = scale * q[r] . keys for rows [0, kRows), q bfloat16 [kRows, head_dim]
template <int KN>
__attribute__((target("avx512f,avx512bf16"))) void score_columns_dot(const c10::BFloat16* q, int64_t head_dim,
                                                                    const c10::BFloat16* tile, int64_t width,
                                                                    int64_t c0, float scale, float* scores) {
  __m512 s[kRows][KN];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < KN; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < head_dim / 2; ++d2) {
    __m512i k[KN];
    for (int c = 0; c < KN; ++c) k[c] = _mm512_loadu_si512(tile + (d2 * width + c0 + c * kLanes) * 2);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * head_dim + 2 * d2, sizeof(pair));
      const __m512i qr = _mm512_set1_epi32(pair);
      for (int c = 0; c < KN; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], (__m512bh)k[c], (__m512bh)qr);
    }
  }
  const __m512 m = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < KN; ++c) _mm512_storeu_ps(scores + r * width + c0 + c * kLanes, _mm512_mul_ps(s[r][c], m));
}

void score_rows_dot(const c10::BFloat16* q, int64_t head_dim, const c10::BFloat16* tile, int64_t width,
                    int64_t columns, float scale, float* scores) {
  by_vectors(columns / kLanes, [&](int64_t v0, auto kn) {
    score_columns_dot<decltype(kn)::value>(q, head_dim, tile, width, v0 * kLanes, scale, scores);
  });
}

// weights[r][0, columns) rounded to bfloat16 into pairs[r][0, columns), rows [0, kRows)
__attribute__((target("avx512f,avx512bf16"))) void weights_to_pairs(const float* weights, int64_t width,
                                                                   int64_t columns, c10::BFloat16* pairs) {
  for (int r = 0; r < kRows; ++r)
    for (int64_t t = 0; t < columns; t += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + r * width + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights + r * width + t)));
}

// acc[r] += sum over slot pairs of weights[r] . values, rows [0, kRows), `pairs` pairs of slots, output vectors
// [v0, v0 + VN); weights bfloat16 [kRows, width], values a tile of pairs along the slots
template <int VN>
__attribute__((target("avx512f,avx512bf16"))) void weigh_values_dot(const c10::BFloat16* tile, int64_t pairs,
                                                                   const c10::BFloat16* weights, int64_t width,
                                                                   float* acc, int64_t head_dim, int64_t v0) {
  __m512 a[kRows][VN];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < VN; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t t2 = 0; t2 < pairs; ++t2) {
    __m512i v[VN];
    for (int c = 0; c < VN; ++c) v[c] = _mm512_loadu_si512(tile + (t2 * head_dim + (v0 + c) * kLanes) * 2);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, weights + r * width + 2 * t2, sizeof(pair));
      const __m512i wr = _mm512_set1_epi32(pair);
      for (int c = 0; c < VN; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)v[c], (__m512bh)wr);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < VN; ++c) {
      float* out = acc + r * head_dim + (v0 + c) * kLanes;
      _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), a[r][c]));
    }
  }
}
#endif

// keys and values of (KV head, block b) as tiles of bfloat16 pairs (the dot product's): keys [hd / 2, w, 2],
// values [w / 2, hd, 2], zero past the block's slots and past the piece's last position (slots nobody has
// written yet, which a pair may take beside a visible one)
void lay_out_pairs(const PrefillProblem& p, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   int64_t kvhead, int64_t b, c10::BFloat16* keys, c10::BFloat16* values) {
  using B = c10::BFloat16;
  const int64_t w = p.tile_width, d = p.head_dim;
  const B* kb = key_cache.const_data_ptr<B>() + p.table[b] * key_cache.stride(0) + kvhead * key_cache.stride(2);
  const B* vb = value_cache.const_data_ptr<B>() + p.table[b] * p.v_block + kvhead * p.v_head;
  std::fill(keys, keys + d * w, B(0.f));
  std::fill(values, values + d * w, B(0.f));
  const int64_t slots = std::min(p.block_size, p.start + p.n - b * p.block_size);
  for (int64_t t = 0; t < slots; ++t) {
    const B* key = kb + t * key_cache.stride(1);
    const B* value = vb + t * p.v_slot;
    for (int64_t i = 0; i < d; ++i) {
      keys[((i / 2) * w + t) * 2 + i % 2] = key[i];
      values[((t / 2) * d + i) * 2 + t % 2] = value[i];
    }
  }
}

// Folds one block's masked scores of a row into its running max and sum; leaves the weights in `scores`.
void fold_block(float* scores, int64_t width, float& running_max, float& running_sum, float* acc, int64_t d) {
  const Vec masked(-std::numeric_limits<float>::infinity()), zero(0.f);
  Vec top = masked;
  for (int64_t t = 0; t < width; t += kLanes) top = at::vec::maximum(top, Vec::loadu(scores + t));
  const float block_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
  if (block_max == -std::numeric_limits<float>::infinity()) {  // no slot of this block is visible
    std::fill(scores, scores + width, 0.f);
    return;
  }
  const float new_max = std::max(running_max, block_max);
  const float rescale = std::exp(running_max - new_max);  // 0 for the first block
  const Vec m(new_max);
  Vec total(0.f);
  for (int64_t t = 0; t < width; t += kLanes) {  // masked scores are -inf: their weight is 0
    const Vec x = Vec::loadu(scores + t);
    const Vec e = Vec::blendv((x - m).exp_u20(), zero, x == masked);
    e.store(scores + t);
    total = total + e;
  }
  if (rescale != 1.f) {
    const Vec r(rescale);
    for (int64_t i = 0; i < d; i += kLanes) (Vec::loadu(acc + i) * r).store(acc + i);
  }
  running_sum = running_sum * rescale + hsum(total);
  running_max = new_max;
}

struct PrefillScratch {
  std::vector<float> query, acc, scores, max, sum;
  std::vector<c10::BFloat16> query_pairs, weight_pairs;  // the dot product's query and weights
  PrefillScratch(const PrefillProblem& p, int64_t rows, bool dot)
      : query(rows * p.head_dim),
        acc(rows * p.head_dim),
        scores(rows * p.tile_width),
        max(rows),
        sum(rows),
        query_pairs(dot ? rows * p.head_dim : 0),
        weight_pairs(dot ? rows * p.tile_width : 0) {}
};

// One item: tokens [t0, t1) of the piece, the heads of KV head `kvhead`'s group, as rows r = t * group + j.
// T: the caches' element type; Q: the query's and the output's (T, or float32 over a narrower cache).
// `pairs`: the tiles of bfloat16 pairs (lay_out_pairs) when the dot product runs (bfloat16 only), else null.
template <typename T, typename Q>
void prefill_item(const PrefillProblem& p, const Q* query, const T* vc, const float* tiles,
                  const c10::BFloat16* pairs, int64_t kvhead, int64_t t0, int64_t t1, Q* out, PrefillScratch& s) {
  const int64_t g = p.group, d = p.head_dim, w = p.tile_width, bs = p.block_size;
  const int64_t rows = (t1 - t0) * g, padded = (rows + kRows - 1) / kRows * kRows;
  for (int64_t r = 0; r < padded; ++r) {
    const Q* src = query + (row_of(p, t0 + r / g) * p.heads + kvhead * g + r % g) * d;
    if (pairs != nullptr) {  // as it is (bfloat16), the scale applied to the sums
      c10::BFloat16* q = s.query_pairs.data() + r * d;
      for (int64_t i = 0; i < d; ++i) q[i] = r < rows ? static_cast<c10::BFloat16>(src[i]) : c10::BFloat16(0.f);
      continue;
    }
    float* q = s.query.data() + r * d;
    if (r >= rows) {
      std::fill(q, q + d, 0.f);
      continue;
    }
    for (int64_t i = 0; i < d; ++i) q[i] = static_cast<float>(src[i]) * p.scale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + padded * d, 0.f);
  std::fill(s.max.begin(), s.max.begin() + padded, -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.begin() + padded, 0.f);
  const int64_t last = p.start + t1 - 1;  // the tile's last position
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, p.start + t0 - p.window + 1) : 0;
  const int64_t nb_total = (p.start + p.n + bs - 1) / bs;
  for (int64_t b = lo / bs; b <= last / bs; ++b) {
    const int64_t tile_index = kvhead * (nb_total - p.first_block) + b - p.first_block;
    const int64_t n = std::min(bs, last + 1 - b * bs);  // slots past the tile's last position weigh 0
    const int64_t columns = (n + kLanes - 1) / kLanes * kLanes;  // and are not scored
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
#ifdef SPYRE_BF16_DOT
      if (pairs != nullptr) {
        score_rows_dot(s.query_pairs.data() + r0 * d, d, pairs + tile_index * 2 * d * w, w, columns, p.scale,
                       s.scores.data() + r0 * w);
        continue;
      }
#endif
      score_rows(s.query.data() + r0 * d, d, tiles + tile_index * d * w, w, columns, s.scores.data() + r0 * w);
    }
    for (int64_t r = 0; r < rows; ++r) {  // causal (and window) mask, then the online softmax
      const int64_t pos = p.start + t0 + r / g;
      float* sc = s.scores.data() + r * w;
      // the block's visible columns [from, to): up to the row's position and the block's end, from its window
      const int64_t to = std::clamp<int64_t>(pos - b * bs + 1, 0, bs);
      const int64_t from = p.window > 0 ? std::clamp<int64_t>(pos - p.window + 1 - b * bs, 0, to) : 0;
      std::fill(sc, sc + from, -std::numeric_limits<float>::infinity());
      std::fill(sc + to, sc + columns, -std::numeric_limits<float>::infinity());
      fold_block(sc, columns, s.max[r], s.sum[r], s.acc.data() + r * d, d);
    }
    const T* values = vc + p.table[b] * p.v_block + kvhead * p.v_head;
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
#ifdef SPYRE_BF16_DOT
      if (pairs != nullptr) {
        c10::BFloat16* weights = s.weight_pairs.data() + r0 * w;
        weights_to_pairs(s.scores.data() + r0 * w, w, columns, weights);
        const c10::BFloat16* value_pairs = pairs + (tile_index * 2 + 1) * d * w;
        float* acc = s.acc.data() + r0 * d;
        by_vectors(d / kLanes, [&](int64_t v0, auto vn) {
          weigh_values_dot<decltype(vn)::value>(value_pairs, (n + 1) / 2, weights, w, acc, d, v0);
        });
        continue;
      }
#endif
      const float* weights = s.scores.data() + r0 * w;
      float* acc = s.acc.data() + r0 * d;
      by_vectors(d / kLanes, [&](int64_t v0, auto vn) {
        weigh_values<T, decltype(vn)::value>(values, p.v_slot, n, weights, w, acc, d, v0);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kvhead * g + r % g;
    float denom = s.sum[r];
    if (p.sinks != nullptr) denom += std::exp(p.sinks[head] - s.max[r]);
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    Q* dest = out + (row_of(p, t0 + r / g) * p.heads + head) * d;
    for (int64_t i = 0; i < d; ++i) dest[i] = static_cast<Q>(s.acc[r * d + i] * inv);
  }
}

template <typename T, typename Q>
void run_prefill(const PrefillProblem& p, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, at::Tensor& out) {
  const int64_t bs = p.block_size, d = p.head_dim, w = p.tile_width;
  const int64_t nb = (p.start + p.n + bs - 1) / bs - p.first_block;
  // the bfloat16 dot product for a bfloat16 query over a bfloat16 cache, where the CPU has it: tiles of pairs
  // (keys and values) instead of the keys' float tiles
  const bool dot = std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16> && bf16_dot_on();
  std::vector<float> tiles(dot ? 0 : p.kvheads * nb * d * w);
  std::vector<c10::BFloat16> pairs(dot ? p.kvheads * nb * 2 * d * w : 0);
  const int64_t work = p.n * (p.start + p.n) * p.heads;  // about twice the score count
  const bool parallel = work >= 64 * 1024 && at::get_num_threads() > 1;
  auto lay_out = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (dot) {
        c10::BFloat16* keys = pairs.data() + i * 2 * d * w;
        lay_out_pairs(p, key_cache, value_cache, i / nb, p.first_block + i % nb, keys, keys + d * w);
      } else {
        lay_out_keys<T>(p, key_cache, i / nb, p.first_block + i % nb, tiles.data() + i * d * w);
      }
    }
  };
  if (parallel) {
    at::parallel_for(0, p.kvheads * nb, 1, lay_out);
  } else {
    lay_out(0, p.kvheads * nb);
  }
  std::vector<std::pair<int64_t, int64_t>> items;  // (kv head, first token), the latest tiles first
  for (int64_t t0 = (p.n - 1) / kTile * kTile; t0 >= 0; t0 -= kTile)
    for (int64_t h = 0; h < p.kvheads; ++h) items.emplace_back(h, t0);
  const Q* q = query.const_data_ptr<Q>();
  const T* vc = value_cache.const_data_ptr<T>();
  Q* o = out.mutable_data_ptr<Q>();
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    PrefillScratch s(p, (kTile * p.group + kRows - 1) / kRows * kRows, dot);
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      const auto [h, t0] = items[i];
      prefill_item<T, Q>(p, q, vc, tiles.data(), dot ? pairs.data() : nullptr, h, t0, std::min(p.n, t0 + kTile),
                         o, s);
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (!parallel || threads <= 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, threads, 1, worker);
  }
}

// the attention of a piece of n tokens into out (query's shape and dtype, both contiguous): token t's query is
// row rows[t] of `query` and its output goes to that row of out, where `rows` is given; rows t otherwise
void prefill_into(const at::Tensor& query, const int64_t* rows, int64_t n, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& table_in, int64_t start, double scale,
                  const std::optional<at::Tensor>& sinks_in, int64_t window, at::Tensor& out) {
  const int64_t heads = query.size(1), head_dim = query.size(2);
  const int64_t kvheads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(head_dim % kLanes == 0 && block_size % kLanes == 0, "paged_prefill: head_dim ", head_dim,
              " and block_size ", block_size, " must be multiples of the vector width ", kLanes);
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 1 && start >= 0 && start + n <= table.size(0) * block_size,
              "paged_prefill: positions ", start, " to ", start + n, " are outside the piece's ", table.size(0),
              " blocks");
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == heads, "paged_prefill: sinks must hold one logit per query head (", heads,
                "), got ", sinks.numel());
  }
  if (n == 0) return;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t width = (block_size + kVecs * kLanes - 1) / (kVecs * kLanes) * (kVecs * kLanes);
  PrefillProblem p{n,
                   start,
                   heads,
                   kvheads,
                   heads / kvheads,
                   head_dim,
                   block_size,
                   window,
                   value_cache.stride(0),
                   value_cache.stride(1),
                   value_cache.stride(2),
                   lo / block_size,
                   width,
                   table.const_data_ptr<int64_t>(),
                   static_cast<float>(scale),
                   sinks.defined() ? sinks.const_data_ptr<float>() : nullptr,
                   rows};
  with_float_types(query, key_cache, "paged_prefill", [&](auto t, auto q) {
    run_prefill<decltype(t), decltype(q)>(p, query, key_cache, value_cache, out);
  });
}

at::Tensor paged_prefill(const at::Tensor& query_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& table, int64_t start, double scale,
                         const std::optional<at::Tensor>& sinks, int64_t window) {
  check_attention_inputs("paged_prefill", "tokens", query_in, key_cache, value_cache);
  const at::Tensor query = query_in.contiguous();
  at::Tensor out = at::empty_like(query);
  prefill_into(query, nullptr, query.size(0), key_cache, value_cache, table, start, scale, sinks, window, out);
  return out;
}

// a piece of a mixed step's region in place: token t is the region's row rows[t], read from `query` and written
// to `out` (both [T, heads, head_dim], contiguous, of one dtype), whose other rows are left as they are, so
// that no piece is gathered from the region and scattered back
void paged_prefill_rows(const at::Tensor& query, const at::Tensor& rows_in, at::Tensor& out,
                        const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& table,
                        int64_t start, double scale, const std::optional<at::Tensor>& sinks, int64_t window) {
  check_attention_inputs("paged_prefill_rows", "tokens", query, key_cache, value_cache);
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_prefill_rows: query and out must be contiguous and alike, got ", query.sizes(), " ",
              query.scalar_type(), " and ", out.sizes(), " ", out.scalar_type());
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  TORCH_CHECK(rows.dim() == 1, "paged_prefill_rows: rows must be 1-d, got ", rows.sizes());
  const int64_t n = rows.size(0), count = query.size(0);
  const int64_t* r = rows.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(r[t] >= 0 && r[t] < count, "paged_prefill_rows: row ", r[t], " is outside the query's ", count,
                " tokens");
  }
  prefill_into(query, r, n, key_cache, value_cache, table, start, scale, sinks, window, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "paged_prefill(Tensor query, Tensor key_cache, Tensor value_cache, Tensor table, int start, float scale, "
      "Tensor? sinks=None, int window=0) -> Tensor");
  m.def(
      "paged_prefill_rows(Tensor query, Tensor rows, Tensor(a!) out, Tensor key_cache, Tensor value_cache, "
      "Tensor table, int start, float scale, Tensor? sinks=None, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_prefill_rows", &paged_prefill_rows);
}
