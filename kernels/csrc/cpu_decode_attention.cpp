// Paged decode attention on the CPU: one query token per sequence, reading K and V in place
// through the block table (no gather, no padding). Same contract as kernels/reference.py for
// query length 1. Built at first use by kernels/cpu_attention.py (torch.utils.cpp_extension).
//
// Work split: one OpenMP task per (sequence, KV head). A task loads the group's query heads,
// computes their scores against every cached key of the sequence (each key row is read once
// for the whole group), takes a numerically stable softmax in fp32, and accumulates the
// weighted values (each value row read once). Keys and values may be fp32, fp16 or bf16;
// arithmetic is fp32.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Element loads as fp32. bf16 is the top half of an fp32: a shift converts it exactly, in a
// form the compiler vectorises.
inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Keys and values are taken kTile rows at a time: kTile independent dot products (or
// kTile value rows folded into one accumulator pass) keep the FMA units busy where one row
// at a time waits on each dot product's horizontal sum.
constexpr int64_t kTile = 4;

template <typename T>
void decode_attention_impl(const torch::Tensor& query,      // [num_seqs, num_heads, head_dim]
                           const torch::Tensor& k_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                           const torch::Tensor& v_cache,    // same
                           const torch::Tensor& block_tables,  // [num_seqs, max_blocks], int32
                           const torch::Tensor& seq_lens,   // [num_seqs], int32
                           double scale, torch::Tensor& out) {  // [num_seqs, num_heads, head_dim]
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // Cache strides in elements (the cache may be a view of a larger tensor).
  const int64_t sb = k_cache.stride(0), ss = k_cache.stride(1), sh = k_cache.stride(2);
  const int64_t qs = query.stride(0), qh = query.stride(1), os = out.stride(0), oh = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const int64_t max_len = num_seqs == 0 ? 0 : *std::max_element(lens, lens + num_seqs);

#pragma omp parallel
  {
    // Scratch per thread, sized once for the longest sequence (not per task).
    std::vector<float> q(group * head_dim), scores(group * std::max<int64_t>(max_len, 1)),
        acc(group * head_dim);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const int64_t len = lens[s];
        if (len <= 0) continue;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < head_dim; ++d)
            q[g * head_dim + d] = to_float(q_ptr[s * qs + (kvh * group + g) * qh + d]) * fscale;
        const int32_t* table = tables + s * max_blocks;
        const int64_t num_seq_blocks = (len + block_size - 1) / block_size;
        // Scores: each key row is read once, for every query head of the group.
        for (int64_t b = 0, t = 0; b < num_seq_blocks; ++b) {
          const T* block = k_ptr + static_cast<int64_t>(table[b]) * sb + kvh * sh;
          const int64_t rows = std::min(block_size, len - t);
          int64_t o = 0;
          for (; o + kTile <= rows; o += kTile, t += kTile) {
            const T* __restrict k0 = block + o * ss;
            const T* __restrict k1 = k0 + ss;
            const T* __restrict k2 = k1 + ss;
            const T* __restrict k3 = k2 + ss;
            for (int64_t g = 0; g < group; ++g) {
              const float* __restrict qg = q.data() + g * head_dim;
              float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
              for (int64_t d = 0; d < head_dim; ++d) {
                d0 += qg[d] * to_float(k0[d]);
                d1 += qg[d] * to_float(k1[d]);
                d2 += qg[d] * to_float(k2[d]);
                d3 += qg[d] * to_float(k3[d]);
              }
              float* out_scores = scores.data() + g * len + t;
              out_scores[0] = d0, out_scores[1] = d1, out_scores[2] = d2, out_scores[3] = d3;
            }
          }
          for (; o < rows; ++o, ++t) {
            const T* __restrict k = block + o * ss;
            for (int64_t g = 0; g < group; ++g) {
              const float* __restrict qg = q.data() + g * head_dim;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(k[d]);
              scores[g * len + t] = dot;
            }
          }
        }
        // Softmax in fp32, stable: subtract the row maximum (vectorised exp).
        for (int64_t g = 0; g < group; ++g) {
          float* row = scores.data() + g * len;
          const float top = *std::max_element(row, row + len);
#pragma omp simd
          for (int64_t t = 0; t < len; ++t) row[t] = expf(row[t] - top);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < len; ++t) sum += row[t];
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t t = 0; t < len; ++t) row[t] *= inv;
        }
        // Weighted values: each value row is read once, for every query head of the group.
        for (int64_t b = 0, t = 0; b < num_seq_blocks; ++b) {
          const T* block = v_ptr + static_cast<int64_t>(table[b]) * sb + kvh * sh;
          const int64_t rows = std::min(block_size, len - t);
          int64_t o = 0;
          for (; o + kTile <= rows; o += kTile, t += kTile) {
            const T* __restrict v0 = block + o * ss;
            const T* __restrict v1 = v0 + ss;
            const T* __restrict v2 = v1 + ss;
            const T* __restrict v3 = v2 + ss;
            for (int64_t g = 0; g < group; ++g) {
              const float* p = scores.data() + g * len + t;
              const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
              float* __restrict a = acc.data() + g * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d)
                a[d] += p0 * to_float(v0[d]) + p1 * to_float(v1[d]) + p2 * to_float(v2[d]) + p3 * to_float(v3[d]);
            }
          }
          for (; o < rows; ++o, ++t) {
            const T* __restrict v = block + o * ss;
            for (int64_t g = 0; g < group; ++g) {
              const float pt = scores[g * len + t];
              float* __restrict a = acc.data() + g * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += pt * to_float(v[d]);
            }
          }
        }
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < head_dim; ++d)
            o_ptr[s * os + (kvh * group + g) * oh + d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  }
}

}  // namespace

// query: [num_seqs, num_heads, head_dim]; returns the same shape and dtype.
torch::Tensor decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "decode_attention: query [S, H, D], cache [N, B, KVH, D]");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "decode_attention: query and caches must share a dtype");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "decode_attention: k_cache and v_cache strides differ");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1, "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "decode_attention: num_heads % num_kv_heads != 0");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "decode_attention: block_tables and seq_lens must be int32");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(query, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "Paged decode attention on the CPU (one query per sequence)");
}
