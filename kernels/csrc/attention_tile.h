// Flash-attention over a paged KV cache, written once against the vector primitives of
// vec_*.h and included into one namespace per instruction set by attention_kernels.cpp (so no
// include guard). One task (attention_kernel.h: AttentionTask) walks its keys a tile of
// kLanes keys at a time:
//
//   KeyCursor         where the tile's keys and values sit in the cache (block table)
//   tile_scores       scale * q.k for every query row and key of the tile (one vector per row)
//   softmax_update    causal mask, running max and sum, probabilities (online softmax)
//   accumulate_values acc = alpha * acc + probabilities @ values
//
// (A prefill task on the native bf16 path takes row_scores and row_softmax_update instead of
// the first two: vectors over query rows, not keys; see "prefill: query rows as lanes".)
//
// Each key and value row is read from memory once per task, for all of its query rows (the
// GQA group of a decode token; tokens x group for a prefill chunk).

// A position in one sequence's keys of one KV head, walked through its block table.
struct KeyCursor {
  int64_t key, block, row;  // key = block_table[block] row `row`
  KeyCursor(const AttentionProblem& p, int64_t first_key)
      : key(first_key), block(first_key / p.block_size), row(first_key % p.block_size) {}

  // Element offsets (into k_cache or v_cache) of the next n keys; moves past them.
  void take(const AttentionProblem& p, const int32_t* table, int64_t kv_head, int n, int64_t* offsets) {
    for (int r = 0; r < n; ++r) {
      offsets[r] = table[block] * p.cache_block_stride + row * p.cache_row_stride + kv_head * p.cache_head_stride;
      if (++row == p.block_size) row = 0, ++block;
    }
    key += n;
  }
};

// Loops over head_dim run to kHeadDim, a compile-time head_dim (64, 128: fully unrolled, the
// query row held in registers), or to the runtime head_dim where kHeadDim is 0.
template <int64_t kHeadDim>
constexpr int64_t dim(int64_t head_dim) {
  return kHeadDim ? kHeadDim : head_dim;
}

// A row as fp32: an fp32 cache row in place, others converted into `buffer`.
template <int64_t kHeadDim>
const float* f32_row(const float* row, int64_t, float*) {
  return row;
}
template <int64_t kHeadDim, class T>
const float* f32_row(const T* row, int64_t head_dim, float* buffer) {
  for (int64_t d = 0; d < dim<kHeadDim>(head_dim); d += kLanes) vstore(buffer + d, vload(row + d));
  return buffer;
}

template <int64_t kHeadDim>
vfloat vdot(const float* q, const float* k, int64_t head_dim) {
  vfloat acc = vzero();
  for (int64_t d = 0; d < dim<kHeadDim>(head_dim); d += kLanes) acc = vfma(vload(q + d), vload(k + d), acc);
  return acc;
}

// scores[m][r] = scale * q_m . k_r for the tile's keys; `Row` is float, or bf16_t on the native
// bf16 path. A tile has kLanes keys: a short one points its missing keys at a row of zeros.
// One vector of partial sums per key, then one add tree per query row.
template <int64_t kHeadDim, class Row>
void tile_scores(const Row* query, int64_t rows, const Row* const* keys, int64_t head_dim, float scale,
                 float* scores) {
  for (int64_t m = 0; m < rows; ++m) {
    const Row* q = query + m * head_dim;
    vfloat partial[kLanes];
    for (int r = 0; r < kLanes; ++r) partial[r] = vdot<kHeadDim>(q, keys[r], head_dim);
    vstore(scores + m * kMaxTileKeys, vmul(vreduce_rows(partial), vset1(scale)));
  }
}

// exp(x) = 2^k exp(r), k = round(x log2 e), |r| <= ln(2) / 2, exp(r) by Cephes' expf
// polynomial (S. Moshier, Cephes Math Library, expf.c); about 1 ulp. 0 below -87.3, -inf
// included (exp(-87.3) is near the smallest normal float).
inline vfloat vexp(vfloat x) {
  const vfloat clamped = vmax(vmin(x, vset1(88.3f)), vset1(-87.3f));
  const vfloat k = vround(vmul(clamped, vset1(1.44269504f)));
  vfloat r = vfma(k, vset1(-0.693359375f), clamped);  // ln 2 in two parts: r is exact
  r = vfma(k, vset1(2.12194440e-4f), r);
  vfloat poly = vset1(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    poly = vfma(poly, r, vset1(c));
  const vfloat exp_r = vfma(poly, vmul(r, r), vadd(r, vset1(1.f)));
  return vzero_below(x, -87.3f, vscale_pow2(exp_r, k));
}

// Online softmax over one tile (Milakov & Gimelshein 2018, "Online normalizer calculation for
// softmax"). Row m (token m / group, at position first_pos + m / group) sees the tile's keys up
// to its own position. Scores become probabilities exp(s - row_max) in place; alpha[m] =
// exp(old row_max - new row_max) rescales what the earlier tiles accumulated.
inline void softmax_update(float* scores, int64_t rows, int64_t group, int64_t first_pos, int64_t key0, int n,
                           float* row_max, float* row_sum, float* alpha) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t m = 0; m < rows; ++m) {
    const int visible = static_cast<int>(std::clamp<int64_t>(first_pos + m / group - key0 + 1, 0, n));
    float* s = scores + m * kMaxTileKeys;
    const vfloat x = vkeep_first(vload(s), visible, neg_inf);
    const float top = std::max(row_max[m], vreduce_max(x));
    alpha[m] = top > row_max[m] ? std::exp(row_max[m] - top) : 1.f;
    if (top == neg_inf) {  // nothing visible yet
      vstore(s, vzero());
      continue;
    }
    const vfloat prob = vexp(vsub(x, vset1(top)));
    vstore(s, prob);
    row_sum[m] = row_sum[m] * alpha[m] + vreduce_add(prob);
    row_max[m] = top;
  }
}

// A tile's probabilities p(m, r), query row m and key r: row-major from softmax_update,
// p[m * kMaxTileKeys + r], or key-major from row_softmax_update, p[r * key_stride + m], which
// on the native bf16 path come as bf16 pairs too: pairs[j * key_stride + m] for keys 2j, 2j + 1.
struct TileProbs {
  const float* p;
  int64_t key_stride = 0;
  const uint32_t* pairs = nullptr;
};

template <bool kKeyMajor>
float prob(const TileProbs& probs, int64_t m, int r) {
  return kKeyMajor ? probs.p[r * probs.key_stride + m] : probs.p[m * kMaxTileKeys + r];
}

// Whether bf16 values take vec_avx512.h's accumulate_pairs_bf16 (which keeps acc's elements
// in its own order until natural_order()).
template <class V, int64_t kHeadDim>
constexpr bool uses_bf16_pairs() {
#ifdef MINI_INFER_NATIVE_BF16
  return std::is_same_v<V, bf16_t> && kHeadDim > 0 && kHeadDim % 32 == 0;
#else
  return false;
#endif
}

// acc[m0 + i] = alpha * acc[m0 + i] + sum_r p(m0 + i, r) * values[r] for i < kRows, over
// head_dim: each slice of kLanes values is read once for the kRows accumulators in registers.
template <int64_t kHeadDim, int kRows, bool kKeyMajor, class V>
void accumulate_rows(const TileProbs& probs, const float* alpha, int64_t m0, const V* const* values, int n,
                     int64_t head_dim, float* acc) {
#ifdef MINI_INFER_NATIVE_BF16
  if constexpr (uses_bf16_pairs<V, kHeadDim>()) {
    if constexpr (kKeyMajor) {
      return accumulate_pairs_bf16<kRows>(probs.pairs + m0, 1, probs.key_stride, alpha + m0, values, n, kHeadDim,
                                          acc + m0 * kHeadDim);
    } else {
      alignas(64) uint32_t pairs[kRows * kMaxTileKeys / 2];
      pack_row_pairs<kRows>(probs.p + m0 * kMaxTileKeys, pairs);
      return accumulate_pairs_bf16<kRows>(pairs, kMaxTileKeys / 2, 1, alpha + m0, values, n, kHeadDim,
                                          acc + m0 * kHeadDim);
    }
  }
#endif
  for (int64_t d = 0; d < dim<kHeadDim>(head_dim); d += kLanes) {
    vfloat a[kRows];
    for (int i = 0; i < kRows; ++i) a[i] = vmul(vload(acc + (m0 + i) * head_dim + d), vset1(alpha[m0 + i]));
    for (int r = 0; r < n; ++r) {
      const vfloat v = vload(values[r] + d);
      for (int i = 0; i < kRows; ++i) a[i] = vfma(vset1(prob<kKeyMajor>(probs, m0 + i, r)), v, a[i]);
    }
    for (int i = 0; i < kRows; ++i) vstore(acc + (m0 + i) * head_dim + d, a[i]);
  }
}

constexpr int kValueRows = 8;  // query rows per pass over a tile's values

template <int64_t kHeadDim, bool kKeyMajor, class V>
void accumulate_values(const TileProbs& probs, const float* alpha, int64_t rows, const V* const* values, int n,
                       int64_t head_dim, float* acc) {
  int64_t m0 = 0;
  for (; m0 + kValueRows <= rows; m0 += kValueRows)
    accumulate_rows<kHeadDim, kValueRows, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc);
  switch (rows - m0) {
    case 7: accumulate_rows<kHeadDim, 7, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    case 6: accumulate_rows<kHeadDim, 6, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    case 5: accumulate_rows<kHeadDim, 5, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    case 4: accumulate_rows<kHeadDim, 4, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    case 3: accumulate_rows<kHeadDim, 3, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    case 2: accumulate_rows<kHeadDim, 2, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    case 1: accumulate_rows<kHeadDim, 1, kKeyMajor>(probs, alpha, m0, values, n, head_dim, acc); break;
    default: break;
  }
}

// One tile's P @ V into b.acc: values as they are where they can be (fp32, the bf16 pairs, or
// a single pass over them), else converted to fp32 once for the passes.
template <class T, int64_t kHeadDim, bool kKeyMajor>
void accumulate_tile(const TileProbs& probs, const TaskBuffers& b, int64_t rows, const T* const* values, int n,
                     int64_t head_dim) {
  if (std::is_same_v<T, float> || uses_bf16_pairs<T, kHeadDim>() || rows <= kValueRows) {
    accumulate_values<kHeadDim, kKeyMajor>(probs, b.alpha, rows, values, n, head_dim, b.acc);
  } else {
    const float* f32_values[kLanes];
    for (int r = 0; r < n; ++r) f32_values[r] = f32_row<kHeadDim>(values[r], head_dim, b.v_tile + r * head_dim);
    accumulate_values<kHeadDim, kKeyMajor>(probs, b.alpha, rows, f32_values, n, head_dim, b.acc);
  }
}

// Query row m of the task (token-major, see AttentionTask) in the query tensor.
template <class T>
const T* query_row(const AttentionProblem& p, const AttentionTask& t, int64_t m) {
  const int64_t rows_per_token = p.group * t.num_heads;
  return static_cast<const T*>(p.query) + (t.token_begin + m / rows_per_token) * p.query_token_stride +
         (t.kv_head * p.group + m % rows_per_token) * p.query_head_stride;
}

#ifdef MINI_INFER_NATIVE_BF16
// ---------------------------------------------------------------- prefill: query rows as lanes
//
// A prefill task holds up to 64 query rows (tokens x group) against each key, so on the
// native bf16 path its vectors run over rows instead of keys: q.k for 16 rows at once is
// head_dim / 2 vdpbf16ps with the key's bf16 pairs broadcast, with no add tree per row and
// tile (tile_scores needs one), and the online softmax runs lane-wise with no horizontal max
// or sum. Scores sit key-major, st[r * R + m], R the rows rounded up to whole vectors (padded
// rows have zero queries and see no key); P @ V is accumulate_values, as for decode. On an AMD
// EPYC (avx512_bf16), 2 threads, SmolLM2's heads: 1.33-1.54x faster prefill attention. The
// same layout in fp32 (16 multiply-adds per vector instead of 32) was 0.8-0.9x as fast as
// the add trees, so fp32 and the converting paths keep tile_scores.

// The task's query rows as bf16 pairs, transposed and zero-padded to R rows:
// qt[j * R + m] = (q_m[2j], q_m[2j + 1]).
inline void load_query_pairs(const AttentionProblem& p, const AttentionTask& t, int64_t R, uint32_t* qt) {
  const int64_t rows = t.num_tokens * p.group;
  for (int64_t m = 0; m < R; ++m) {
    if (m >= rows) {
      for (int64_t j = 0; j < p.head_dim / 2; ++j) qt[j * R + m] = 0u;
      continue;
    }
    const bf16_t* src = query_row<bf16_t>(p, t, m);
    for (int64_t j = 0; j < p.head_dim / 2; ++j) qt[j * R + m] = bf16_pair(src, j);
  }
}

// Scores of the tile's keys r < n (two at a time: keys[n] is a row of zeros when n is odd) for
// all R rows, four vectors of rows at a time: st[r * R + m] = scale * q_m . k_r.
inline void row_scores(const uint32_t* qt, int64_t R, const bf16_t* const* keys, int n, int64_t head_dim, float scale,
                       float* st) {
  for (int r = 0; r < n; r += 2) {
    float* s0 = st + r * R;
    float* s1 = s0 + R;
    for (int64_t m0 = 0; m0 < R; m0 += 4 * kLanes) {
      switch (std::min<int64_t>(4, (R - m0) / kLanes)) {
        case 4: row_scores_bf16<4>(qt, R, m0, keys[r], keys[r + 1], head_dim, scale, s0, s1); break;
        case 3: row_scores_bf16<3>(qt, R, m0, keys[r], keys[r + 1], head_dim, scale, s0, s1); break;
        case 2: row_scores_bf16<2>(qt, R, m0, keys[r], keys[r + 1], head_dim, scale, s0, s1); break;
        default: row_scores_bf16<1>(qt, R, m0, keys[r], keys[r + 1], head_dim, scale, s0, s1); break;
      }
    }
  }
}

// softmax_update for key-major scores, lane-wise over rows: row m (at position row_pos[m],
// -1 for padding) sees key key0 + r where key0 + r <= row_pos[m]. Scores become
// probabilities in place; the row past an odd n becomes zeros (the bf16 pairs read it).
// Where a row has seen nothing yet its max stays -inf and exp() is taken against 0 instead
// (flash attention's "safe" max), so no inf - inf.
inline void row_softmax_update(float* st, int64_t R, const float* row_pos, int64_t key0, int n, float* row_max,
                               float* row_sum, float* alpha) {
  const vfloat neg_inf = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < R; m += kLanes) {
    const vfloat pos = vload(row_pos + m), old_max = vload(row_max + m);
    vfloat top = old_max;
    for (int r = 0; r < n; ++r) {
      float* s = st + r * R + m;
      const vfloat x = vselect_le(vset1(static_cast<float>(key0 + r)), pos, vload(s), neg_inf);
      vstore(s, x);
      top = vmax(top, x);
    }
    const vfloat safe = vselect_le(top, vset1(std::numeric_limits<float>::lowest()), vzero(), top);
    vfloat sum = vzero();
    for (int r = 0; r < n; ++r) {
      float* s = st + r * R + m;
      const vfloat prob = vexp(vsub(vload(s), safe));
      vstore(s, prob);
      sum = vadd(sum, prob);
    }
    if (n % 2) vstore(st + n * R + m, vzero());
    const vfloat a = vexp(vsub(old_max, safe));
    vstore(alpha + m, a);
    vstore(row_sum + m, vfma(vload(row_sum + m), a, sum));
    vstore(row_max + m, top);
  }
}
#endif

// The task's query rows (token-major, see AttentionTask) as `Row`s.
template <class T, class Row>
void load_queries(const AttentionProblem& p, const AttentionTask& t, Row* rows) {
  for (int64_t m = 0; m < t.num_tokens * p.group * t.num_heads; ++m) {
    const T* src = query_row<T>(p, t, m);
    Row* dst = rows + m * p.head_dim;
    if constexpr (std::is_same_v<Row, T>)
      std::memcpy(dst, src, p.head_dim * sizeof(T));
    else
      for (int64_t d = 0; d < p.head_dim; d += kLanes) vstore(dst + d, vload(src + d));
  }
}

// Prefetches `span` elements from each of the n offsets: a row of head_dim, or the rows of a
// decode task's KV heads at one key position.
template <class T>
void prefetch_rows(const void* cache, const int64_t* offsets, int n, int64_t span) {
  const char* base = static_cast<const char*>(cache);
  for (int r = 0; r < n; ++r)
    for (int64_t byte = 0; byte < span * static_cast<int64_t>(sizeof(T)); byte += 64)
      vprefetch(base + offsets[r] * static_cast<int64_t>(sizeof(T)) + byte);
}

// Walks the task's keys a tile at a time: fills b.acc, b.row_max and b.row_sum.
//
// A sequence's blocks are scattered over the cache, where the hardware prefetchers cannot
// follow: each tile prefetches the keys of a tile about 4 KiB of keys ahead before its own
// scores, and that tile's values before its own value pass. (Without prefetch, decode ran at
// half the speed from DRAM; prefetching keys and values together ran 10-25% slower. On an AMD
// EPYC, one thread: bf16 at head_dim 64 (2 KiB tiles) ran 7-13% faster two tiles ahead than
// one, fp32 (4 KiB tiles) 3-5% slower; PREFETCHT1 instead of T0 was slower in both. An fp8
// cache's tiles are 1 KiB: four ahead; on a Xeon with AMX, 2 threads, bf16 queries, batch 64 x
// context 512, two ahead took 1.41 ms, four 1.28, eight 1.45.)
template <class T, int64_t kHeadDim>
constexpr int prefetch_tiles_ahead() {
  if constexpr (sizeof(T) == 1) return 4;
  return kLanes * (kHeadDim ? kHeadDim : 64) * static_cast<int64_t>(sizeof(T)) < 4096 ? 2 : 1;
}

// Q: the query's element type; T: the cache's (Q's own, or fp8e5m2_t). kOneHead: the task has
// one KV head (t.num_heads == 1), known at compile time; else any number.
template <class Q, class T, int64_t kHeadDim, bool kOneHead>
void attend_tiles(const AttentionProblem& p, const AttentionTask& t, const TaskBuffers& b) {
  const int64_t num_heads = kOneHead ? 1 : t.num_heads;
  // Keys stay in the cache's dtype where the dot product takes it natively, else become fp32.
  using Row = std::conditional_t<std::is_same_v<Q, bf16_t> && std::is_same_v<T, bf16_t> && kNativeBf16Dot,
                                 bf16_t, float>;
  // rows: the query rows of one KV head; a decode task's heads take turns on each tile.
  const int64_t rows = t.num_tokens * p.group, head_dim = p.head_dim;
  const int64_t span = (num_heads - 1) * p.cache_head_stride + head_dim;  // prefetched per key
  // Prefill tasks on the native bf16 path run with rows as lanes, padded to whole vectors
  // (TaskBuffers has room for that).
  const bool lanes = std::is_same_v<Row, bf16_t> && t.num_tokens > 1 && rows >= kLanes;
  const int64_t padded = lanes ? (rows + kLanes - 1) / kLanes * kLanes : rows;
  Row* query = static_cast<Row*>(b.query);
#ifdef MINI_INFER_NATIVE_BF16
  if (lanes) {
    load_query_pairs(p, t, padded, static_cast<uint32_t*>(b.query));
    for (int64_t m = 0; m < padded; ++m)
      b.row_pos[m] = m < rows ? static_cast<float>(t.first_pos + m / p.group) : -1.f;
  }
#endif
  if (!lanes) load_queries<Q>(p, t, query);
  std::fill(b.acc, b.acc + rows * num_heads * head_dim, 0.f);
  std::fill(b.row_max, b.row_max + padded * num_heads, -std::numeric_limits<float>::infinity());
  std::fill(b.row_sum, b.row_sum + padded * num_heads, 0.f);
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.block_tables + t.seq * p.table_stride;
  // Offsets and sizes (kLanes keys, fewer at the end, 0 past it) of this tile and the ones up
  // to the prefetched one: tile i in ring[i % kRing].
  constexpr int kRing = prefetch_tiles_ahead<T, kHeadDim>() + 1;
  int64_t ring[kRing][kLanes];
  int ring_n[kRing];
  KeyCursor cursor(p, t.key_begin);
  for (int i = 0; i < kRing; ++i) {
    ring_n[i] = static_cast<int>(std::clamp<int64_t>(t.key_end - cursor.key, 0, kLanes));
    cursor.take(p, table, t.kv_head, ring_n[i], ring[i]);
  }
  const Row* keys[kLanes];
  const T* values[kLanes];
  std::fill(keys, keys + kLanes, reinterpret_cast<const Row*>(b.zeros));
  for (int64_t key0 = t.key_begin, tile = 0; key0 < t.key_end; ++tile) {
    const int64_t* offset = ring[tile % kRing];
    const int n = ring_n[tile % kRing];
    const int ahead = (tile + kRing - 1) % kRing;
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t head = h * p.cache_head_stride;
      for (int r = 0; r < n; ++r) {
        if constexpr (std::is_same_v<Row, T>)
          keys[r] = k_cache + offset[r] + head;
        else
          keys[r] = f32_row<kHeadDim>(k_cache + offset[r] + head, head_dim, b.k_tile + r * head_dim);
        values[r] = v_cache + offset[r] + head;
      }
      if (n < kLanes) {  // a short tile's missing keys and values: rows of zeros
        std::fill(keys + n, keys + kLanes, reinterpret_cast<const Row*>(b.zeros));
        std::fill(values + n, values + kLanes, reinterpret_cast<const T*>(b.zeros));
      }
      // A task of several KV heads reads each key position's rows as one span, which the
      // hardware prefetchers follow: prefetching its keys too ran 0.91-0.95x as fast (AVX2, fp32).
      if (num_heads == 1) prefetch_rows<T>(p.k_cache, ring[ahead], ring_n[ahead], span);
#ifdef MINI_INFER_NATIVE_BF16
      if constexpr (std::is_same_v<Row, bf16_t>) {
        if (lanes) {  // a prefill task: one KV head
          row_scores(static_cast<const uint32_t*>(b.query), padded, keys, n, head_dim, p.scale, b.scores);
          row_softmax_update(b.scores, padded, b.row_pos, key0, n, b.row_max, b.row_sum, b.alpha);
          if constexpr (uses_bf16_pairs<T, kHeadDim>()) pack_key_major_pairs(b.scores, padded, n, b.prob_pairs);
          prefetch_rows<T>(p.v_cache, ring[ahead], ring_n[ahead], span);
          accumulate_tile<T, kHeadDim, true>({b.scores, padded, b.prob_pairs}, b, rows, values, n, head_dim);
        }
      }
#endif
      if (!lanes) {
        TaskBuffers bh = b;  // this head's rows
        bh.acc += h * rows * head_dim, bh.row_max += h * rows, bh.row_sum += h * rows, bh.alpha += h * rows;
        tile_scores<kHeadDim>(query + h * rows * head_dim, rows, keys, head_dim, p.scale, bh.scores);
        softmax_update(bh.scores, rows, p.group, t.first_pos, key0, n, bh.row_max, bh.row_sum, bh.alpha);
        if (h == 0) prefetch_rows<T>(p.v_cache, ring[ahead], ring_n[ahead], span);
        accumulate_tile<T, kHeadDim, false>({bh.scores}, bh, rows, values, n, head_dim);
      }
    }
    key0 += n;
    // This tile's slot now takes the tile kRing after it.
    int64_t* slot = ring[tile % kRing];
    ring_n[tile % kRing] = static_cast<int>(std::clamp<int64_t>(t.key_end - cursor.key, 0, kLanes));
    cursor.take(p, table, t.kv_head, ring_n[tile % kRing], slot);
  }
#ifdef MINI_INFER_NATIVE_BF16
  if constexpr (uses_bf16_pairs<T, kHeadDim>()) natural_order(b.acc, rows * num_heads, head_dim);
#endif
}

// ---------------------------------------------------------------- decode: one query token
//
// A task of one query token (the GQA group of query rows of each of its KV heads) walks its
// keys kDecodeChunk at a time, one softmax update per query row and chunk, with fewer
// instructions per key than attend_tiles: a query row's scores of kLanes keys are a vector of
// partial sums per key (each slice of the query loaded once for all of them, the keys' slices
// as memory operands) and one add tree; each value row is read once per pass of kDecodeRows
// query rows, whose kDecodeRows x kDecodeVectors accumulators stay in registers, and each
// probability is broadcast once per pass (attend_tiles broadcasts it once per vector of
// head_dim). Throughout a chunk's arithmetic the next chunk's rows (every KV head's) are
// prefetched a few lines at a time (AheadPieces), so that misses are in flight all the while;
// and when a head's turn in a chunk starts, its rows of the chunk are prefetched at once, so
// that the misses still pending overlap each other. Only compile-time head_dims.
// A bf16 cache is read in halves (vload_halves: each pair of elements widened in place, the
// even ones and the odd ones as two vectors), so bf16 keys and values are never copied to
// fp32 and their widening takes two instructions per 16 elements; the query rows and the
// accumulators are kept in that order (halves_order) and put back at the end of the task.
// Zen 3 EPYC (AVX2), 2 threads, SmolLM2's heads, LLC flushed, against attend_tiles in turns:
// docs/PERFORMANCE.md, "A decode kernel for AVX2", and "bf16 read in halves" after it. The
// AVX-512 kernels, on a Zen 5 EPYC (avx512_bf16, whose attend_tiles dotted bf16 pairs with
// vdpbf16ps): 1.14-1.6x as fast, bf16 0.55-0.65 -> 0.76-0.83 of copy at batch 16-256 x
// context 512, fp32 0.53-0.59 -> 0.73-0.79 ("attend_decode with the AVX-512 kernels").
// On AVX512_BF16 with bf16 queries the scores are vdpbf16ps dot products (the bf16_t* overload of decode_scores_bf16):
// 7.5-8.8% less time with K/V in L1, within the noise from memory (Zen 4 EPYC). kPrefetchL2
// sends every prefetch here to L2 instead of L1; on a Zen 4 EPYC (2 threads, LLC flushed,
// b64-256 x ctx512) that ran bf16 1.55-1.63x and fp32 1.41-1.62x as fast, b16 bf16 0.78-0.82x
// (docs/PERFORMANCE.md, "On an AMD EPYC with AVX512-BF16, Zen 4").

constexpr int kDecodeChunk = static_cast<int>(kMaxTileKeys);  // keys per softmax update
constexpr int kDecodeRows = 3;     // query rows per pass over the values
constexpr int kDecodeVectors = 4;  // vectors of head_dim per pass: 3 x 4 accumulators, 3
                                   // probabilities and a value vector fill AVX2's 16 registers
                                   // (bf16: one probability at a time, vbroadcast_once)

// A prefetch into L1 (vprefetch), or into L2 where kL2 (AttentionProblem::prefetch_l2).
template <bool kL2>
inline void vprefetch_to(const void* p) {
  if constexpr (kL2)
    vprefetch_l2(p);
  else
    vprefetch(p);
}

// The rows of the next chunk, asked for a few lines at a time from inside this chunk's
// arithmetic, so that misses are in flight all the while instead of arriving in bursts that
// the core waits out: when a KV head's turn in a chunk starts, the next chunk's key and value
// rows of that head are listed in pieces of kGrainLines lines (list), and the turn's score and
// value loops ask for them in proportion to the work done (step). A value type: the loops take
// it by value and hand it on, so its state stays in registers (kept in the caller's memory, its
// bookkeeping made the arithmetic 1.2-1.4x as long: bf16 1.22 against 0.99 ms, fp32 1.47
// against 1.05, two threads, K/V in L1). Against 8371f47 (the next chunk's rows of a head
// asked for a key at a time in its first value pass), b64 x ctx512, 2 threads, LLC flushed:
// docs/PERFORMANCE.md, "The next chunk asked for through the arithmetic".
template <class T, int64_t kHeadDim, bool kL2 = false>
struct AheadPieces {
  static constexpr int64_t kLineElements = 64 / static_cast<int64_t>(sizeof(T));
  static constexpr int kRowLines = static_cast<int>((kHeadDim + kLineElements - 1) / kLineElements);
  // Lines asked for together: fp32, bound by memory here, is fastest a line at a time; bf16,
  // bound by its arithmetic, with fewer instructions a row (128 bytes) at a time.
  static constexpr int kGrainLines = std::min(kRowLines, sizeof(T) >= 4 ? 1 : 2);
  static constexpr int kParts = kRowLines / kGrainLines;  // pieces of a row
  static_assert(kRowLines % kGrainLines == 0, "rows in whole pieces");
  static constexpr int kMaxPieces = 2 * kDecodeChunk * kParts;

  const T* const* piece = nullptr;  // the next piece to ask for
  const T* const* end = nullptr;
  int64_t credit = 0, per_unit = 0;  // pieces per unit of work (vector FMAs), in 1/256ths

  // The pieces of n rows of keys and of values at `offsets` (+ head) into `pieces`, to be asked
  // for over `units` of work.
  static AheadPieces list(const T* k_cache, const T* v_cache, const int64_t* offsets, int n, int64_t head,
                          int64_t units, const T** pieces) {
    const T** out = pieces;
    for (int r = 0; r < n; ++r) {
#pragma GCC unroll 16
      for (int e = 0; e < kParts; ++e) *out++ = k_cache + offsets[r] + head + e * kGrainLines * kLineElements;
#pragma GCC unroll 16
      for (int e = 0; e < kParts; ++e) *out++ = v_cache + offsets[r] + head + e * kGrainLines * kLineElements;
    }
    const int64_t count = out - pieces;
    return {pieces, out, 0, (count * 256 + units - 1) / std::max<int64_t>(units, 1)};
  }
  // After `units` vector FMAs of work: the pieces due by then.
  void step(int64_t units) {
    credit += units * per_unit;
    for (int64_t due = credit >> 8; due > 0 && piece < end; --due, ++piece)
#pragma GCC unroll 16
      for (int e = 0; e < kGrainLines; ++e) vprefetch_to<kL2>(*piece + e * kLineElements);
    credit &= 255;
  }
  void finish() {
    for (; piece < end; ++piece)
#pragma GCC unroll 16
      for (int e = 0; e < kGrainLines; ++e) vprefetch_to<kL2>(*piece + e * kLineElements);
  }
};

// scores[r] = scale * q . keys[r], r < kDecodeChunk (fp32 rows; a missing key a row of zeros);
// each kLanes keys are a step of `ahead` (AheadPieces).
template <int64_t kHeadDim, class Stream>
Stream decode_scores(const float* q, const float* const* keys, float scale, float* scores, Stream ahead) {
#pragma GCC unroll 16
  for (int k0 = 0; k0 < kDecodeChunk; k0 += kLanes) {
    ahead.step(kHeadDim);
    vfloat partial[kLanes];
#pragma GCC unroll 16
    for (int r = 0; r < kLanes; ++r) partial[r] = vzero();
#pragma GCC unroll 16
    for (int64_t d = 0; d < kHeadDim; d += kLanes) {
      const vfloat qd = vload(q + d);
#pragma GCC unroll 16
      for (int r = 0; r < kLanes; ++r) partial[r] = vfma(qd, vload(keys[k0 + r] + d), partial[r]);
    }
    vstore(scores + k0, vmul(vreduce_rows(partial), vset1(scale)));
  }
  return ahead;
}

// Keys k0 .. k0 + kKeys of kRows query rows (sums[i][r]: key k0 + r's partial sums of row i)
// into `partial`; after each kLanes keys, each row's add tree, times `scale`, into its scores
// (kMaxTileKeys apart).
template <int kRows, int kKeys>
inline void gather_scores(const vfloat (&sums)[kRows][kKeys], int k0, float scale, vfloat (&partial)[kRows][kLanes],
                          float* scores) {
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 16
    for (int r = 0; r < kKeys; ++r) partial[i][(k0 + r) % kLanes] = sums[i][r];
  if ((k0 + kKeys) % kLanes == 0)
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i)
      vstore(scores + i * kMaxTileKeys + k0 + kKeys - kLanes, vmul(vreduce_rows(partial[i]), vset1(scale)));
}

// Rows of head_dim fp32 elements, each block of 2 kLanes reordered as its even elements then its
// odd ones (the order in which vload_halves gives bf16 elements), or back (kBack).
template <bool kBack = false>
void halves_order(float* rows, int64_t num_rows, int64_t head_dim) {
  float block[2 * kLanes];
  for (int64_t d = 0; d < num_rows * head_dim; d += 2 * kLanes) {
    std::copy(rows + d, rows + d + 2 * kLanes, block);
    for (int i = 0; i < kLanes; ++i) {
      if (kBack) rows[d + 2 * i] = block[i], rows[d + 2 * i + 1] = block[kLanes + i];
      else rows[d + i] = block[2 * i], rows[d + kLanes + i] = block[2 * i + 1];
    }
  }
}

// scores[i * kMaxTileKeys + r] = scale * q_i . keys[r] for kRows query rows (halves_order,
// kHeadDim apart) and r < kDecodeChunk, from bf16 key rows (a missing key a row of zeros): two
// keys at a time, each slice of a key widened once (vload_halves) for all kRows rows, kRows x
// 2 accumulators in registers, the query's slices memory operands; each row's partial sums of
// kLanes keys then go through one add tree. No fp32 copy of the keys (f32_row) is made: that
// copy, its stores and its reloads took a quarter of the kernel's time. Each kKeys keys are a
// step of `ahead` (AheadPieces).
template <int64_t kHeadDim, int kRows, class Stream>
Stream decode_scores_bf16(const float* q, const bf16_t* const* keys, float scale, float* scores, Stream ahead) {
  constexpr int kKeys = kLanes >= 2 ? 2 : 1;  // keys per pass over head_dim (kLanes a multiple)
  vfloat partial[kRows][kLanes];  // a query row's partial sums of kLanes keys, for one add tree
  // Loads bound these passes, not FMAs: about twice the FMAs' time (docs/PERFORMANCE.md).
  constexpr int64_t kScoreUnits = 2 * kRows * kKeys * (kHeadDim / kLanes);
#pragma GCC unroll 16
  for (int k0 = 0; k0 < kDecodeChunk; k0 += kKeys) {
    ahead.step(kScoreUnits);
    vfloat sums[kRows][kKeys];
#pragma GCC unroll 16
    for (int64_t d = 0; d < kHeadDim; d += 2 * kLanes) {
#pragma GCC unroll 16
      for (int r = 0; r < kKeys; ++r) {
        vfloat even, odd;
        vload_halves(keys[k0 + r] + d, even, odd);
#pragma GCC unroll 16
        for (int i = 0; i < kRows; ++i) {  // the first slice's products start the sums
          const vfloat sum = d == 0 ? vmul(even, vload(q + i * kHeadDim))
                                    : vfma(even, vload(q + i * kHeadDim + d), sums[i][r]);
          sums[i][r] = vfma(odd, vload(q + i * kHeadDim + d + kLanes), sum);
        }
      }
    }
    gather_scores<kRows, kKeys>(sums, k0, scale, partial, scores);
  }
  return ahead;
}

#ifdef MINI_INFER_NATIVE_BF16
// decode_scores_bf16 with vdpbf16ps (AVX512_BF16), picked by the query's type: bf16 query rows in their natural order
// (kHeadDim apart) against bf16 key rows, each product of a pair of elements exact and summed
// in fp32, so a row's 32 elements of a key take one instruction instead of the two widenings
// and two FMAs of decode_scores_bf16 (whose widening each key shares among kRows rows). Same
// add tree, same steps of `ahead`.
template <int64_t kHeadDim, int kRows, class Stream>
Stream decode_scores_bf16(const bf16_t* q, const bf16_t* const* keys, float scale, float* scores, Stream ahead) {
  constexpr int kKeys = 2;
  static_assert(kHeadDim % 32 == 0, "head_dim in whole 32-element slices");
  vfloat partial[kRows][kLanes];
  constexpr int64_t kScoreUnits = 2 * kRows * kKeys * (kHeadDim / kLanes);  // as decode_scores_bf16's
#pragma GCC unroll 16
  for (int k0 = 0; k0 < kDecodeChunk; k0 += kKeys) {
    ahead.step(kScoreUnits);
    vfloat sums[kRows][kKeys];
#pragma GCC unroll 16
    for (int64_t d = 0; d < kHeadDim; d += 32) {
#pragma GCC unroll 16
      for (int r = 0; r < kKeys; ++r) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(keys[k0 + r] + d);
#pragma GCC unroll 16
        for (int i = 0; i < kRows; ++i)
          sums[i][r] = _mm512_dpbf16_ps(d == 0 ? _mm512_setzero_ps() : sums[i][r],
                                        (__m512bh)_mm512_loadu_si512(q + i * kHeadDim + d), k);
      }
    }
    gather_scores<kRows, kKeys>(sums, k0, scale, partial, scores);
  }
  return ahead;
}
#endif

// The online softmax (as softmax_update) of kRows query rows (scores kMaxTileKeys apart) over
// a chunk of n keys, all visible (a decode token sees its whole context): scores become
// probabilities in place, 0 past n. The rows' independent chains (max, exp, sum) are
// interleaved in one call; only a short chunk (n < kDecodeChunk) is masked.
template <int kRows>
void decode_softmax(float* scores, int n, float* row_max, float* row_sum, float* alpha) {
  constexpr int kVectors = kDecodeChunk / kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vfloat x[kRows][kVectors];
  float top[kRows];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) {
    vfloat top_lanes = vset1(neg_inf);
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) {
      x[i][v] = vload(scores + i * kMaxTileKeys + v * kLanes);
      if (n < kDecodeChunk) x[i][v] = vkeep_first(x[i][v], n - v * kLanes, neg_inf);
      top_lanes = vmax(top_lanes, x[i][v]);
    }
    top[i] = std::max(row_max[i], vreduce_max(top_lanes));
  }
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) {
    alpha[i] = top[i] > row_max[i] ? std::exp(row_max[i] - top[i]) : 1.f;
    if (top[i] == neg_inf) {  // nothing but -inf scores yet
      std::fill(scores + i * kMaxTileKeys, scores + i * kMaxTileKeys + kDecodeChunk, 0.f);
      continue;
    }
    vfloat sum = vzero();
#pragma GCC unroll 16
    for (int v = 0; v < kVectors; ++v) {
      const vfloat prob = vexp(vsub(x[i][v], vset1(top[i])));
      vstore(scores + i * kMaxTileKeys + v * kLanes, prob);
      sum = vadd(sum, prob);
    }
    row_sum[i] = row_sum[i] * alpha[i] + vreduce_add(sum);
    row_max[i] = top[i];
  }
}

// acc[i] = alpha[i] * acc[i] + sum_r probs[i][r] * values[r] for kRows query rows (probs
// kMaxTileKeys apart, acc kHeadDim apart), kDecodeVectors vectors of head_dim a pass; each
// key of each pass is a step of `ahead` (AheadPieces).
template <int64_t kHeadDim, int kRows, class V, class Stream>
Stream decode_values(const float* probs, const float* alpha, const V* const* values, int n, float* acc,
                     Stream ahead) {
  constexpr bool kHalves = std::is_same_v<V, bf16_t>;
  static_assert(kHeadDim % (kDecodeVectors * kLanes) == 0, "head_dim in whole passes");
#pragma GCC unroll 16
  for (int64_t d0 = 0; d0 < kHeadDim; d0 += kDecodeVectors * kLanes) {
    vfloat a[kRows][kDecodeVectors];
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < kDecodeVectors; ++j)
        a[i][j] = vmul(vload(acc + i * kHeadDim + d0 + j * kLanes), vset1(alpha[i]));
    for (int r = 0; r < n; ++r) {
      ahead.step(kRows * kDecodeVectors);
      if constexpr (kHalves) {
#pragma GCC unroll 16
        for (int j = 0; j < kDecodeVectors; j += 2) {
          vfloat even, odd;
          vload_halves(values[r] + d0 + j * kLanes, even, odd);
#pragma GCC unroll 16
          for (int i = 0; i < kRows; ++i) {
            const vfloat p = vbroadcast_once(probs + i * kMaxTileKeys + r);
            a[i][j] = vfma(p, even, a[i][j]), a[i][j + 1] = vfma(p, odd, a[i][j + 1]);
          }
        }
      } else {
        vfloat p[kRows];
#pragma GCC unroll 16
        for (int i = 0; i < kRows; ++i) p[i] = vset1(probs[i * kMaxTileKeys + r]);
#pragma GCC unroll 16
        for (int j = 0; j < kDecodeVectors; ++j) {
          const vfloat v = vload(values[r] + d0 + j * kLanes);
#pragma GCC unroll 16
          for (int i = 0; i < kRows; ++i) a[i][j] = vfma(p[i], v, a[i][j]);
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < kDecodeVectors; ++j) vstore(acc + i * kHeadDim + d0 + j * kLanes, a[i][j]);
  }
  return ahead;
}

// A task of one query token (t.num_tokens == 1, any number of KV heads): attend_tiles' outputs.
// Q: the query's element type, T: the cache's.
template <class Q, class T, int64_t kHeadDim, bool kPrefetchL2>
void attend_decode(const AttentionProblem& p, const AttentionTask& t, const TaskBuffers& b) {
  constexpr bool kHalves = std::is_same_v<T, bf16_t>;  // bf16 keys and values in halves_order
  // bf16 queries and keys on AVX512_BF16: the scores by vdpbf16ps (the bf16_t* overload of decode_scores_bf16), from the
  // query rows as they are (bf16, natural order)
  constexpr bool kDots = kHalves && std::is_same_v<Q, bf16_t> && kNativeBf16Dot;
  const int64_t group = p.group, rows = group * t.num_heads;
  float* query = static_cast<float*>(b.query);
  [[maybe_unused]] const bf16_t* query_bf16 = static_cast<const bf16_t*>(b.query);
  if constexpr (kDots)
    load_queries<Q>(p, t, static_cast<bf16_t*>(b.query));
  else
    load_queries<Q>(p, t, query);
  if constexpr (kHalves && !kDots) halves_order(query, rows, kHeadDim);
  std::fill(b.acc, b.acc + rows * kHeadDim, 0.f);
  std::fill(b.row_max, b.row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(b.row_sum, b.row_sum + rows, 0.f);
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.block_tables + t.seq * p.table_stride;
  int64_t offsets[kDecodeChunk], ahead_offsets[kDecodeChunk];
  const float* keys[kDecodeChunk];
  const bf16_t* bf16_keys[kDecodeChunk];
  const T* values[kDecodeChunk];
  KeyCursor cursor(p, t.key_begin), next(p, std::min(t.key_end, t.key_begin + kDecodeChunk));
  using Ahead = AheadPieces<T, kHeadDim, kPrefetchL2>;
  const T* pieces[Ahead::kMaxPieces];
  // A head's turn in vector FMAs (AheadPieces::step): scores (bf16's counted twice, as
  // decode_scores_bf16 counts them) and values.
  const int64_t score_units = (kHalves ? 2 : 1) * group * kDecodeChunk * (kHeadDim / kLanes);
  const int64_t value_units_per_key = group * (kHeadDim / kLanes);
  for (int64_t key0 = t.key_begin; key0 < t.key_end; key0 += kDecodeChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kDecodeChunk, t.key_end - key0));
    const int n_next = static_cast<int>(std::clamp<int64_t>(t.key_end - next.key, 0, kDecodeChunk));
    cursor.take(p, table, t.kv_head, n, offsets);
    next.take(p, table, t.kv_head, n_next, ahead_offsets);
    std::fill(keys + n, keys + kDecodeChunk, b.zeros);
    std::fill(bf16_keys + n, bf16_keys + kDecodeChunk, reinterpret_cast<const bf16_t*>(b.zeros));
    for (int64_t h = 0; h < t.num_heads; ++h) {
      const int64_t head = h * p.cache_head_stride;
      for (int r = 0; r < n; ++r) {
        if constexpr (kHalves)
          bf16_keys[r] = k_cache + offsets[r] + head;
        else
          keys[r] = f32_row<kHeadDim>(k_cache + offsets[r] + head, kHeadDim, b.k_tile + r * kHeadDim);
        values[r] = v_cache + offsets[r] + head;
        // This chunk's rows of this head, asked for at once (mostly in flight already, from
        // the chunk before): the arithmetic below reads them a few at a time, and misses that
        // wait on each other there cost more than these prefetches (bf16 1.21-1.41x, fp32
        // 1.02-1.15x, b64 x ctx512 from memory; docs/PERFORMANCE.md, "bf16 read in halves").
        for (int64_t e = 0; e < kHeadDim; e += 64 / static_cast<int64_t>(sizeof(T))) {
          vprefetch_to<kPrefetchL2>(k_cache + offsets[r] + head + e);
          vprefetch_to<kPrefetchL2>(values[r] + e);
        }
      }
      // The next chunk's rows of this head, asked for through this turn's arithmetic.
      Ahead ahead = Ahead::list(k_cache, v_cache, ahead_offsets, n_next, head,
                                score_units + value_units_per_key * n, pieces);
      float* probs = b.scores + h * group * kMaxTileKeys;
      if constexpr (kHalves) {  // bf16 query rows (kDots: the vdpbf16ps overload) or fp32 ones in halves_order
        const auto* query_rows = [&] {
          if constexpr (kDots)
            return query_bf16;
          else
            return static_cast<const float*>(query);
        }();
        for (int64_t g = 0; g < group; g += kDecodeRows) {
          const auto* q = query_rows + (h * group + g) * kHeadDim;
          float* s = probs + g * kMaxTileKeys;
          switch (std::min<int64_t>(kDecodeRows, group - g)) {
            case 3: ahead = decode_scores_bf16<kHeadDim, 3>(q, bf16_keys, p.scale, s, ahead); break;
            case 2: ahead = decode_scores_bf16<kHeadDim, 2>(q, bf16_keys, p.scale, s, ahead); break;
            default: ahead = decode_scores_bf16<kHeadDim, 1>(q, bf16_keys, p.scale, s, ahead); break;
          }
        }
      }
      if constexpr (!kHalves)
        for (int64_t g = 0; g < group; ++g)
          ahead = decode_scores<kHeadDim>(query + (h * group + g) * kHeadDim, keys, p.scale, probs + g * kMaxTileKeys,
                                          ahead);
      for (int64_t g = 0; g < group; g += kDecodeRows) {
        const int64_t m = h * group + g;
        float* s = probs + g * kMaxTileKeys;
        switch (std::min<int64_t>(kDecodeRows, group - g)) {
          case 3: decode_softmax<3>(s, n, b.row_max + m, b.row_sum + m, b.alpha + m); break;
          case 2: decode_softmax<2>(s, n, b.row_max + m, b.row_sum + m, b.alpha + m); break;
          default: decode_softmax<1>(s, n, b.row_max + m, b.row_sum + m, b.alpha + m); break;
        }
      }
      for (int64_t g = 0; g < group; g += kDecodeRows) {
        const int64_t m = h * group + g;
        const float* pg = probs + g * kMaxTileKeys;
        float* acc = b.acc + m * kHeadDim;
        switch (std::min<int64_t>(kDecodeRows, group - g)) {
          case 3: ahead = decode_values<kHeadDim, 3>(pg, b.alpha + m, values, n, acc, ahead); break;
          case 2: ahead = decode_values<kHeadDim, 2>(pg, b.alpha + m, values, n, acc, ahead); break;
          default: ahead = decode_values<kHeadDim, 1>(pg, b.alpha + m, values, n, acc, ahead); break;
        }
      }
      ahead.finish();
    }
  }
  if constexpr (kHalves) halves_order<true>(b.acc, rows, kHeadDim);
}

// One task (AttentionTask): fills b.acc, b.row_max and b.row_sum; the caller normalises. Q is
// the query's element type, T the cache's.
template <class Q, class T = Q>
void attend(const AttentionProblem& p, const AttentionTask& t, const TaskBuffers& b) {
  // decode_kernel_head_dim's sizes
  if (t.num_tokens == 1 && p.head_dim == 64)
    return p.prefetch_l2 ? attend_decode<Q, T, 64, true>(p, t, b) : attend_decode<Q, T, 64, false>(p, t, b);
  if (t.num_tokens == 1 && p.head_dim == 128)
    return p.prefetch_l2 ? attend_decode<Q, T, 128, true>(p, t, b) : attend_decode<Q, T, 128, false>(p, t, b);
  switch (p.head_dim) {  // the common head sizes get unrolled loops
    case 64:
      return t.num_heads == 1 ? attend_tiles<Q, T, 64, true>(p, t, b) : attend_tiles<Q, T, 64, false>(p, t, b);
    case 128:
      return t.num_heads == 1 ? attend_tiles<Q, T, 128, true>(p, t, b) : attend_tiles<Q, T, 128, false>(p, t, b);
    default:
      return t.num_heads == 1 ? attend_tiles<Q, T, 0, true>(p, t, b) : attend_tiles<Q, T, 0, false>(p, t, b);
  }
}
