// Paged attention on the CPU for a whole flattened batch in one call: decode tokens and prefill
// chunks alike, reading K and V in place through the block table (no gather, no padding).
// Same contract as kernels/reference.py's paged_attention. Built at first use by
// kernels/cpu_attention.py (torch.utils.cpp_extension).
//
// This file is the driver: it checks the arguments, picks the kernels of the best instruction
// set this CPU runs (attention_kernels.cpp), cuts the batch into tasks (attention_kernel.h:
// AttentionTask) and runs them on torch's intra-op threads:
//   - a decode token: one task per KV head (its GQA group of query heads together, so K/V is
//     read once per KV head), or with the AVX2 and scalar kernels one task for all its KV
//     heads (attention_tile.h: attend_decode); or several over its context when there are
//     fewer tasks than threads (split-K, merged afterwards);
//   - a prefill chunk: one task per KV head and kPrefillRowsPerTask query rows (tokens x group);
//     or, where the caller asks (bf16 on a CPU with AMX), one torch SDPA call for a chunk of
//     kSdpaMinQueryTokens or more (run_sdpa_prefills).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "attention_kernel.h"

namespace {

using mini_infer::AttentionProblem;
using mini_infer::AttentionTask;
using mini_infer::IsaKernels;
using mini_infer::TaskBuffers;

// Whether the KV caches hold fp8 (kv_cache_dtype "fp8_e5m2" or "fp8_e4m3").
bool is_fp8(c10::ScalarType dtype) { return dtype == torch::kFloat8_e5m2 || dtype == torch::kFloat8_e4m3fn; }

constexpr int64_t kPrefillRowsPerTask = 64;  // query rows (tokens x group) of one prefill task
constexpr int64_t kTasksPerThread = 4;       // split decode contexts until there are this many
constexpr int64_t kMinSplitKeys = 256;       // keys of one split, at least
// Below this many (query row, key) pairs, about 30 us of work, a call runs on one thread: waking
// the others costs more (ATen's at::internal::GRAIN_SIZE is the same number of elements).
constexpr int64_t kMinParallelWork = 32768;
// silu_and_mul runs on one thread below this many output elements (171 rows of SmolLM2's 1,536)
// unless its caller says from how many rows it splits (the engine passes its compiled glue's
// split, engine/models/llama.py: a decode step's activation stays on the step's thread as the
// glue's kernels do). Xeon with AMX-BF16, 2 threads, bf16, warm loop: 64 rows 59.5 us on one
// thread, 34.9 on two; 2,048 rows 1.73 ms and 0.92 ms (docs/PERFORMANCE.md, "SiLU x mul ...").
constexpr int64_t kMinParallelSiluElements = 1 << 18;
// Prefill chunks of at least this many tokens go to torch's SDPA where the caller asks for it
// (run_sdpa_prefills); shorter ones stay tasks beside the decode tokens. Xeon with AMX, bf16,
// 2 threads, SmolLM2's heads, tasks against SDPA: 3 x 64 tokens 0.16 / 0.19 ms, 2 x 100 0.19 /
// 0.24 ms, 16 x 128 2.8 / 1.9 ms (a call's gather, mask and dispatch cost ~50 us).
constexpr int64_t kSdpaMinQueryTokens = 128;

// Whether a sequence's chunk of `query_len` tokens goes to run_sdpa_prefills rather than the tasks.
bool sdpa_chunk(int64_t query_len, bool sdpa) { return sdpa && query_len >= kSdpaMinQueryTokens; }

// ---------------------------------------------------------------- instruction sets

struct IsaEntry {
  const IsaKernels* kernels;
  bool supported;  // by this CPU (and its OS, which must save the vector registers)
};

// Best first. __builtin_cpu_supports also checks that the OS enables the registers (XCR0).
const std::vector<IsaEntry>& isa_entries() {
#ifdef MINI_INFER_X86_KERNELS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  static const std::vector<IsaEntry> entries = {
      {&mini_infer::kAvx512Bf16Kernels,
       avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16")},
      {&mini_infer::kAvx512Kernels, avx512},
      {&mini_infer::kAvx2Kernels, avx2},
      {&mini_infer::kScalarKernels, true}};
#else
  static const std::vector<IsaEntry> entries = {{&mini_infer::kScalarKernels, true}};
#endif
  return entries;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const auto& entry : isa_entries())
    if (entry.supported) names.emplace_back(entry.kernels->name);
  return names;
}

// `isa` by name, or "auto": the best one this CPU runs at this head_dim. `caller` names the
// function in errors.
const IsaKernels& select_kernels(const std::string& isa, int64_t head_dim, const char* caller = "paged_attention") {
  for (const auto& entry : isa_entries()) {
    const IsaKernels& k = *entry.kernels;
    if (isa == "auto") {
      if (entry.supported && head_dim % k.head_dim_multiple == 0) return k;
    } else if (isa == k.name) {
      TORCH_CHECK(entry.supported, caller, ": this CPU cannot run the '", isa, "' kernels");
      TORCH_CHECK(head_dim % k.head_dim_multiple == 0, caller, ": the '", isa,
                  "' kernels need head_dim a multiple of ", k.head_dim_multiple, "; got ", head_dim);
      return k;
    }
  }
  TORCH_CHECK(false, caller, ": unknown isa '", isa, "' (the isa argument or $MINI_INFER_CPU_ISA); this CPU runs: ",
              c10::Join(", ", supported_isas()));
}

// The kernels `isa` ("auto" or a name) runs at head_dim; errors as select_kernels.
std::string selected_isa(int64_t head_dim, const std::string& isa) { return select_kernels(isa, head_dim).name; }

// ---------------------------------------------------------------- planning

struct Work {
  AttentionTask task;
  int64_t partial;  // split-K slot of its result, or -1: the result is final
  int64_t cost;     // query rows x keys
};

// The splits of one decode token's context, for its task's KV heads [kv_head, kv_head + num_heads).
struct SplitGroup {
  int64_t token, kv_head, num_heads, first_partial, num_partials;
};

struct Plan {
  std::vector<Work> work;  // costliest first
  std::vector<SplitGroup> splits;
  int64_t num_partials = 0;
  int64_t max_rows = 0;         // query rows of the largest task
  int64_t max_decode_rows = 0;  // of the largest decode task (a split-K slot's rows)
  bool whole_decode_tokens = false;  // a decode task takes every KV head of its token
  int64_t total_cost = 0;
};

struct BatchShape {
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  int64_t num_seqs, num_tokens, num_kv_heads, num_blocks;
};

// Every sequence's query range and the block-table entries it will read, checked, so that no
// kernel reads outside the cache.
void check_batch(const BatchShape& s, const AttentionProblem& p) {
  TORCH_CHECK(s.query_start_loc[0] == 0, "paged_attention: query_start_loc[0] must be 0");
  TORCH_CHECK(s.query_start_loc[s.num_seqs] <= s.num_tokens, "paged_attention: query_start_loc[-1] = ",
              s.query_start_loc[s.num_seqs], " exceeds the ", s.num_tokens, " query tokens");
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t query_len = s.query_start_loc[i + 1] - s.query_start_loc[i], len = s.seq_lens[i];
    TORCH_CHECK(query_len >= 0 && query_len <= len, "paged_attention: sequence ", i, " has ", query_len,
                " query tokens but seq_lens[", i, "] = ", len);
    if (query_len == 0) continue;
    const int64_t blocks = (len + p.block_size - 1) / p.block_size;
    TORCH_CHECK(blocks <= p.table_stride, "paged_attention: sequence ", i, " needs ", blocks,
                " blocks; block_tables has ", p.table_stride, " columns");
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t block = p.block_tables[i * p.table_stride + b];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_attention: block_tables[", i, "][", b, "] = ", block,
                  " is outside the cache's ", s.num_blocks, " blocks");
    }
  }
}

// Decode contexts are split when the batch has fewer tasks than kTasksPerThread per thread;
// `forced_splits` > 0 overrides that (tests).
int64_t decode_splits(int64_t len, int64_t num_tasks, int64_t threads, int64_t forced_splits) {
  if (forced_splits > 0) return std::min(forced_splits, len);
  const int64_t wanted = (kTasksPerThread * threads + num_tasks - 1) / num_tasks;
  return std::max<int64_t>(1, std::min(wanted, len / kMinSplitKeys));
}

void add_decode(Plan& plan, int64_t seq, int64_t token, int64_t len, int64_t kv_head, int64_t num_heads,
                int64_t group, int64_t splits) {
  const int64_t tile = mini_infer::kMaxTileKeys;
  const int64_t chunk = ((len + splits - 1) / splits + tile - 1) / tile * tile;
  const int64_t parts = (len + chunk - 1) / chunk;
  plan.max_decode_rows = std::max(plan.max_decode_rows, group * num_heads);
  if (parts > 1) plan.splits.push_back({token, kv_head, num_heads, plan.num_partials, parts});
  for (int64_t key = 0; key < len; key += chunk) {
    const int64_t end = std::min(len, key + chunk);
    plan.work.push_back({{seq, kv_head, token, 1, len - 1, key, end, num_heads},
                         parts > 1 ? plan.num_partials++ : -1, group * num_heads * (end - key)});
  }
}

void add_prefill(Plan& plan, int64_t seq, int64_t token_begin, int64_t query_len, int64_t len, int64_t kv_head,
                 int64_t group) {
  const int64_t tokens_per_task = std::max<int64_t>(1, kPrefillRowsPerTask / group);
  for (int64_t j = 0; j < query_len; j += tokens_per_task) {
    const int64_t num_tokens = std::min(tokens_per_task, query_len - j), first_pos = len - query_len + j;
    plan.work.push_back({{seq, kv_head, token_begin + j, num_tokens, first_pos, 0, first_pos + num_tokens}, -1,
                         num_tokens * group * (first_pos + num_tokens)});
  }
}

// `sdpa`: the chunks sdpa_chunk picks are left out (run_sdpa_prefills computes them).
Plan plan_work(const BatchShape& s, int64_t group, int64_t forced_splits, bool whole_decode_tokens, bool sdpa) {
  int64_t tasks = 0;  // without splits
  const int64_t tokens_per_task = std::max<int64_t>(1, kPrefillRowsPerTask / group);
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t query_len = s.query_start_loc[i + 1] - s.query_start_loc[i];
    if (sdpa_chunk(query_len, sdpa)) continue;
    const int64_t per_head = (query_len + tokens_per_task - 1) / tokens_per_task;
    tasks += query_len == 1 && whole_decode_tokens ? 1 : s.num_kv_heads * per_head;
  }
  Plan plan;
  plan.whole_decode_tokens = whole_decode_tokens;
  const int64_t threads = at::get_num_threads();
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t token = s.query_start_loc[i], query_len = s.query_start_loc[i + 1] - token, len = s.seq_lens[i];
    if (sdpa_chunk(query_len, sdpa)) continue;
    const int64_t splits = decode_splits(len, tasks, threads, forced_splits);
    if (query_len == 1 && whole_decode_tokens) {
      add_decode(plan, i, token, len, 0, s.num_kv_heads, group, splits);
      plan.max_rows = std::max(plan.max_rows, plan.max_decode_rows);
      continue;
    }
    for (int64_t h = 0; h < s.num_kv_heads && query_len > 0; ++h) {
      if (query_len == 1)
        add_decode(plan, i, token, len, h, 1, group, splits);
      else
        add_prefill(plan, i, token, query_len, len, h, group);
    }
    plan.max_rows = std::max(plan.max_rows, std::min(query_len, tokens_per_task) * group);
  }
  std::stable_sort(plan.work.begin(), plan.work.end(), [](const Work& a, const Work& b) { return a.cost > b.cost; });
  for (const Work& w : plan.work) plan.total_cost += w.cost;
  return plan;
}

// ---------------------------------------------------------------- running

// One thread's TaskBuffers, for tasks of up to `rows` query rows.
class ThreadBuffers {
 public:
  ThreadBuffers(int64_t rows, int64_t head_dim) {
    const int64_t tile = mini_infer::kMaxTileKeys;
    rows = (rows + tile - 1) / tile * tile;  // whole vectors of rows, at any vector width
    storage_.resize(rows * head_dim * 2 + rows * (4 + tile + tile / 2) + (2 * tile + 1) * head_dim);
    float* next = storage_.data();
    auto take = [&next](int64_t n) { float* out = next; next += n; return out; };
    view_ = {take(rows * head_dim), take(rows), take(rows), take(rows), take(rows * tile),
             take(rows * head_dim), take(tile * head_dim), take(tile * head_dim), take(head_dim), take(rows),
             reinterpret_cast<uint32_t*>(take(rows * tile / 2))};
  }
  const TaskBuffers& view() const { return view_; }

 private:
  std::vector<float> storage_;
  TaskBuffers view_;
};

// Split-K partial results: per slot and query row (up to `rows` of them: a decode task's),
// head_dim accumulator values, max, sum.
struct Partials {
  float* data;
  int64_t rows, group, head_dim;
  float* row(int64_t slot, int64_t m) const { return data + (slot * rows + m) * (head_dim + 2); }
};

template <class scalar_t>
struct Output {
  scalar_t* data;
  int64_t token_stride, head_stride;
  scalar_t* row(int64_t token, int64_t head) const { return data + token * token_stride + head * head_stride; }
};

// A finished task's rows: normalised into the output, or kept whole for the split-K merge.
template <class scalar_t>
void store_result(const Work& w, const TaskBuffers& b, const Output<scalar_t>& out, const Partials& partials) {
  const int64_t group = partials.group, head_dim = partials.head_dim, rows_per_token = group * w.task.num_heads;
  for (int64_t m = 0; m < w.task.num_tokens * rows_per_token; ++m) {
    const float* acc = b.acc + m * head_dim;
    if (w.partial >= 0) {
      float* dst = partials.row(w.partial, m);
      std::copy(acc, acc + head_dim, dst);
      dst[head_dim] = b.row_max[m], dst[head_dim + 1] = b.row_sum[m];
      continue;
    }
    scalar_t* dst = out.row(w.task.token_begin + m / rows_per_token, w.task.kv_head * group + m % rows_per_token);
    const float inv_sum = 1.f / b.row_sum[m];
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv_sum);
  }
}

// The splits of one decode token, combined: each split's accumulator and sum weighted by
// exp(its max - the overall max).
template <class scalar_t>
void merge_splits(const SplitGroup& s, const Output<scalar_t>& out, const Partials& partials, float* acc) {
  const int64_t head_dim = partials.head_dim;
  for (int64_t g = 0; g < partials.group * s.num_heads; ++g) {
    float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t i = 0; i < s.num_partials; ++i) top = std::max(top, partials.row(s.first_partial + i, g)[head_dim]);
    std::fill(acc, acc + head_dim, 0.f);
    for (int64_t i = 0; i < s.num_partials; ++i) {
      const float* part = partials.row(s.first_partial + i, g);
      const float weight = std::exp(part[head_dim] - top);
      sum += weight * part[head_dim + 1];
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * part[d];
    }
    scalar_t* dst = out.row(s.token, s.kv_head * partials.group + g);
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[d] / sum);
  }
}

template <class scalar_t>
void run_plan(const Plan& plan, const AttentionProblem& problem, int64_t num_kv_heads, mini_infer::AttendFn attend,
              torch::Tensor& out) {
  const Output<scalar_t> output{out.data_ptr<scalar_t>(), out.stride(0), out.stride(1)};
  auto partial_storage = torch::empty({plan.num_partials * plan.max_decode_rows * (problem.head_dim + 2)},
                                      torch::dtype(torch::kFloat32));
  const Partials partials{partial_storage.data_ptr<float>(), plan.max_decode_rows, problem.group, problem.head_dim};
  const int64_t num_work = static_cast<int64_t>(plan.work.size());
  const int64_t workers = plan.total_cost < kMinParallelWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_work);
  // Tasks are taken in order, costliest first, by whichever thread is free, `claim` at a time:
  // where decode tokens are split by KV head and there are plenty of tasks, num_kv_heads of
  // them, which in a decode batch are one sequence's KV heads (equal costs keep their order).
  // A block holds every KV head's row of a token side by side, so the sequence's blocks then
  // pass through one core's caches, not two. Decode, 2 threads, an AMD EPYC (avx512_bf16),
  // medians of 7 alternating rounds against one task at a time: bf16 0.79-0.83x the time
  // (b64 x ctx512 0.963 -> 0.796 ms), fp32 0.88-0.96x. (Where attend_decode takes the
  // head_dim, and with the AVX2 kernels always, decode tokens are whole tasks: see
  // paged_attention.)
  const bool claim_heads = !plan.whole_decode_tokens && num_work >= kTasksPerThread * workers * num_kv_heads;
  const int64_t claim = claim_heads ? num_kv_heads : 1;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const ThreadBuffers buffers(plan.max_rows, problem.head_dim);
    for (int64_t first = next.fetch_add(claim); first < num_work; first = next.fetch_add(claim)) {
      for (int64_t i = first; i < std::min(num_work, first + claim); ++i) {
        attend(problem, plan.work[i].task, buffers.view());
        store_result(plan.work[i], buffers.view(), output, partials);
      }
    }
  });
  // Contexts are split only when there are few tasks (kTasksPerThread per thread): a few merges.
  std::vector<float> acc(problem.head_dim);
  for (const SplitGroup& split : plan.splits) merge_splits(split, output, partials, acc.data());
}

// The chunks sdpa_chunk picks through torch's CPU scaled_dot_product_attention, one call per
// chunk, from inside this call (no Python per sequence): the chunk's keys and values are
// gathered from its blocks into one [len, num_kv_heads, head_dim] copy each (index_select over
// whole blocks; 1.5 KiB a token for SmolLM2 in bf16, next to 2 x 9 x 64 x len multiply-adds per
// query token), its queries and output are strided views of `query` and `out`. A chunk that
// starts its sequence is causal (is_causal); one after a cached context sees every cached key
// and the causal part of its own (a bool mask, false above diagonal len - query_len). torch's kernel
// (its flash attention for the CPU, GQA through enable_gqa) blocks over queries and keys and
// runs its matmuls through cpublas: on a Xeon with AMX, 2 threads, SmolLM2's heads, bf16, 5
// chunks of 400 tokens took 3.1 ms against the key-tile kernels' 6.6 ms (docs/PERFORMANCE.md).
void run_sdpa_prefills(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& tables, const BatchShape& s, double scale, torch::Tensor& out) {
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t token = s.query_start_loc[i], query_len = s.query_start_loc[i + 1] - token, len = s.seq_lens[i];
    if (!sdpa_chunk(query_len, true)) continue;
    const int64_t blocks = (len + block_size - 1) / block_size;
    const auto ids = tables[i].narrow(0, 0, blocks).to(torch::kInt64);
    auto gather = [&](const torch::Tensor& cache) {  // [1, num_kv_heads, len, head_dim], strided
      return cache.index_select(0, ids).view({blocks * block_size, num_kv_heads, head_dim}).narrow(0, 0, len)
          .to(query.scalar_type())  // an fp8 cache, widened (exactly) to the query's dtype
          .transpose(0, 1).unsqueeze(0);
    };
    const auto q = query.narrow(0, token, query_len).transpose(0, 1).unsqueeze(0);  // [1, H, query_len, D]
    std::optional<torch::Tensor> mask;
    if (query_len < len)  // row r is position len - query_len + r: keys up to it
      mask = torch::ones({query_len, len}, torch::dtype(torch::kBool)).tril(len - query_len);
    const auto o = at::scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), mask, 0.0,
                                                    /*is_causal=*/!mask.has_value(), scale, /*enable_gqa=*/true);
    out.narrow(0, token, query_len).copy_(o.squeeze(0).transpose(0, 1));
  }
}

}  // namespace

// query: [num_tokens, num_heads, head_dim]; returns the same shape and dtype. `isa`: "auto" or
// one of supported_isas(); `num_splits` > 0 splits every decode context that many ways (tests);
// `sdpa_prefill`: bf16 prefill chunks of kSdpaMinQueryTokens or more go through
// run_sdpa_prefills, not the tasks.
// `prefetch_l2`: decode tasks prefetch the rows ahead of them into L2, not L1
// (AttentionProblem::prefetch_l2).
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                              const torch::Tensor& seq_lens, double scale, const std::string& isa,
                              int64_t num_splits, bool sdpa_prefill, bool prefetch_l2) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "paged_attention: query [T, H, D], cache [N, B, KVH, D]");
  const bool fp8_cache = is_fp8(k_cache.scalar_type());
  TORCH_CHECK((query.scalar_type() == k_cache.scalar_type() || fp8_cache) &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: the caches must share a dtype with each other and with query, or be "
              "float8_e5m2 or float8_e4m3fn; got query ", query.scalar_type(), ", caches ", k_cache.scalar_type(),
              " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "paged_attention: k_cache and v_cache differ in shape or strides");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1, "paged_attention: head_dim must be contiguous");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "paged_attention: query and cache head_dim differ");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "paged_attention: num_heads % num_kv_heads != 0");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_attention: block_tables [S, max_blocks], query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 && block_tables.size(0) >= seq_lens.numel(),
              "paged_attention: query_start_loc needs num_seqs + 1 entries and block_tables num_seqs rows");
  const auto tables = block_tables.contiguous(), starts = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const int64_t head_dim = query.size(2), group = query.size(1) / k_cache.size(2);
  const AttentionProblem problem{query.data_ptr(), query.stride(0), query.stride(1),
                                 k_cache.data_ptr(), v_cache.data_ptr(),
                                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                 tables.data_ptr<int32_t>(), tables.size(1),
                                 k_cache.size(1), head_dim, group, static_cast<float>(scale), prefetch_l2};
  const BatchShape shape{starts.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), lens.numel(), query.size(0),
                         k_cache.size(2), k_cache.size(0)};
  check_batch(shape, problem);
  const IsaKernels& kernels = select_kernels(isa, head_dim);
  // A decode token is one task, all KV heads together, where attend_decode takes its head_dim
  // (every instruction set) and at every head_dim with the AVX2 and scalar kernels: a key
  // position's rows of every KV head lie side by side, so a task reads each block once, front
  // to back, and attend_decode, which needs such tasks, brought both dtypes to 0.7-0.8 of the
  // copy bandwidth on a Zen 5 EPYC's AVX-512 kernels and a Zen 3's AVX2 ones
  // (docs/PERFORMANCE.md, "A decode kernel for AVX2", "attend_decode with the AVX-512
  // kernels"). Through attend_tiles, the AVX-512 kernels' whole tasks ran 0.78-0.89x as fast
  // as one task per KV head (attention_kernels.cpp), so there they stay one per KV head.
  const bool whole_decode_tokens = kernels.whole_decode_tokens || mini_infer::decode_kernel_head_dim(head_dim);
  const bool sdpa = sdpa_prefill && query.scalar_type() == torch::kBFloat16;
  const Plan plan = plan_work(shape, group, num_splits, whole_decode_tokens, sdpa);
  auto out = torch::empty_like(query);
  // an fp8 cache: the kernels that widen it as they read it
  const bool e5m2 = k_cache.scalar_type() == torch::kFloat8_e5m2;
  switch (query.scalar_type()) {
    case torch::kFloat32:
      run_plan<float>(plan, problem, shape.num_kv_heads,
                      !fp8_cache ? kernels.attend_f32 : e5m2 ? kernels.e5m2.attend_f32 : kernels.e4m3.attend_f32, out);
      break;
    case torch::kBFloat16:
      run_plan<c10::BFloat16>(
          plan, problem, shape.num_kv_heads,
          !fp8_cache ? kernels.attend_bf16 : e5m2 ? kernels.e5m2.attend_bf16 : kernels.e4m3.attend_bf16, out);
      break;
    case torch::kHalf:
      run_plan<c10::Half>(plan, problem, shape.num_kv_heads,
                          !fp8_cache ? kernels.attend_f16 : e5m2 ? kernels.e5m2.attend_f16 : kernels.e4m3.attend_f16,
                          out);
      break;
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16; got ", query.scalar_type());
  }
  if (sdpa) run_sdpa_prefills(query, k_cache, v_cache, tables, shape, scale, out);
  return out;
}

namespace {

// store_kv into fp8 caches (format F) from fp32, bf16 or fp16 keys and values (checked by
// store_kv), each row rounded by `round` (Fp8Kernels::from_*), T the kernels' name of scalar_t.
template <class scalar_t, class T, class F>
void store_kv_fp8(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
                  const int64_t* slot, void (*round)(const T*, F*, int64_t)) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = k_cache.size(1);
  const scalar_t* k_src = key.data_ptr<scalar_t>();
  const scalar_t* v_src = value.data_ptr<scalar_t>();
  auto* k_dst = static_cast<F*>(k_cache.data_ptr());
  auto* v_dst = static_cast<F*>(v_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t cache_row = slot[t] / block_size * k_cache.stride(0) + slot[t] % block_size * k_cache.stride(1);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t row = cache_row + h * k_cache.stride(2);
      round(reinterpret_cast<const T*>(k_src + t * key.stride(0) + h * key.stride(1)), k_dst + row, head_dim);
      round(reinterpret_cast<const T*>(v_src + t * value.stride(0) + h * value.stride(1)), v_dst + row, head_dim);
    }
  }
}

// store_kv_fp8 by the keys' dtype, with the rounding kernels of one fp8 format.
template <class F>
void store_kv_fp8_as(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                     torch::Tensor& v_cache, const int64_t* slot, const mini_infer::Fp8Kernels<F>& fp8) {
  switch (key.scalar_type()) {
    case torch::kFloat32: return store_kv_fp8<float>(key, value, k_cache, v_cache, slot, fp8.from_f32);
    case torch::kBFloat16: return store_kv_fp8<c10::BFloat16>(key, value, k_cache, v_cache, slot, fp8.from_bf16);
    default: return store_kv_fp8<c10::Half>(key, value, k_cache, v_cache, slot, fp8.from_f16);
  }
}

}  // namespace

// Writes each token's key and value rows into its cache slot: kernels/reference.py's store_kv.
// key, value: [num_tokens, num_kv_heads, head_dim] in the caches' dtype (or fp32, bf16 or fp16
// into float8_e5m2 or float8_e4m3fn caches, rounded as kv_store.h's to_fp8), any strides with head_dim
// contiguous; slot_mapping: [num_tokens] int64, flat slot per token, -1 skips one. Every slot
// is checked before anything is written. `isa` ("auto" or a name) rounds to fp8.
void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping, const std::string& isa) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              "store_kv: CPU tensors only");
  TORCH_CHECK(key.dim() == 3 && k_cache.dim() == 4, "store_kv: key [T, KVH, D], cache [N, B, KVH, D]");
  TORCH_CHECK(key.sizes() == value.sizes(), "store_kv: key and value differ in shape");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "store_kv: k_cache and v_cache differ in shape or strides");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              "store_kv: key [T, ", key.size(1), ", ", key.size(2), "] does not fit cache rows [", k_cache.size(2),
              ", ", k_cache.size(3), "]");
  const bool fp8_cache = is_fp8(k_cache.scalar_type());
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (key.scalar_type() == k_cache.scalar_type() ||
                   (fp8_cache && (key.scalar_type() == torch::kFloat32 || key.scalar_type() == torch::kBFloat16 ||
                                  key.scalar_type() == torch::kHalf))),
              "store_kv: key, value and caches must share a dtype, or the caches be float8_e5m2 or float8_e4m3fn "
              "and key and value fp32, bf16 or fp16; got key ", key.scalar_type(), ", value ", value.scalar_type(),
              ", caches ", k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1,
              "store_kv: head_dim must be contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == torch::kInt64 &&
                  slot_mapping.numel() == key.size(0),
              "store_kv: slot_mapping must be int64 [num_tokens]");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "store_kv: slot_mapping[", t, "] = ", slot[t],
                " is outside the cache's ", num_slots, " slots");
  if (fp8_cache && key.scalar_type() != k_cache.scalar_type()) {  // rounded by the `isa` kernels
    const IsaKernels& kernels = select_kernels(isa, 0, "store_kv");
    if (k_cache.scalar_type() == torch::kFloat8_e5m2) return store_kv_fp8_as(key, value, k_cache, v_cache, slot, kernels.e5m2);
    return store_kv_fp8_as(key, value, k_cache, v_cache, slot, kernels.e4m3);
  }
  const int64_t element = key.element_size(), row_bytes = key.size(2) * element;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t cache_row = slot[t] / block_size * k_cache.stride(0) + slot[t] % block_size * k_cache.stride(1);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = (cache_row + h * k_cache.stride(2)) * element;
      std::memcpy(k_dst + dst, k_src + (t * key.stride(0) + h * key.stride(1)) * element, row_bytes);
      std::memcpy(v_dst + dst, v_src + (t * value.stride(0) + h * value.stride(1)) * element, row_bytes);
    }
  }
}

namespace {

// An element as fp32 (exact): itself, a bf16's bits as the top half of one, or an fp16's value.
inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float as_float(c10::Half x) { return static_cast<float>(x); }

// The index of the largest of x[0, n) (fp32, bf16 or fp16), the first of equals; the first NaN
// where there is one (torch.argmax's answer). Two vectorised passes (the max, then
// 256-element chunks compared with it) and a scalar search inside the chunk that holds it.
// On x86-64 GCC builds a copy per vector width and picks one by the running CPU's flags when
// the extension loads.
template <class T>
#ifdef MINI_INFER_X86_KERNELS
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
int64_t argmax_row(const T* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = as_float(x[i]);
    top = v > top ? v : top;
    nan |= v != v;
  }
  if (nan)
    for (int64_t i = 0; i < n; ++i)
      if (as_float(x[i]) != as_float(x[i])) return i;
  constexpr int64_t kChunk = 256;
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t end = std::min(n, begin + kChunk);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = begin; i < end; ++i) hit |= as_float(x[i]) == top;
    if (hit)
      for (int64_t i = begin; i < end; ++i)
        if (as_float(x[i]) == top) return i;
  }
  return 0;  // every value is -inf: the first (top stayed -inf, and x[0] == top above)
}

template <class T>
void argmax_rows_of(const torch::Tensor& logits, int64_t* index) {
  const int64_t rows = logits.size(0), cols = logits.size(1), stride = logits.stride(0);
  const T* data = logits.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinParallelWork / cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) index[r] = argmax_row(data + r * stride, cols);
  });
}

}  // namespace

// torch.argmax(logits, dim=-1) for fp32, bf16 or fp16 logits [num_rows, vocab] (rows any stride,
// vocab contiguous): int64 [num_rows], rows split over torch's intra-op threads.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  (dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf),
              "argmax_rows: logits must be a 2-D fp32, bf16 or fp16 CPU tensor; got ", logits.dim(), "-D ", dtype,
              " on ", logits.device());
  TORCH_CHECK(logits.size(1) > 0 && (logits.stride(1) == 1 || logits.size(1) == 1),
              "argmax_rows: logits need a contiguous, non-empty last dimension");
  auto out = torch::empty({logits.size(0)}, torch::dtype(torch::kInt64));
  if (dtype == torch::kFloat32)
    argmax_rows_of<float>(logits, out.data_ptr<int64_t>());
  else if (dtype == torch::kBFloat16)
    argmax_rows_of<c10::BFloat16>(logits, out.data_ptr<int64_t>());
  else
    argmax_rows_of<c10::Half>(logits, out.data_ptr<int64_t>());
  return out;
}

// SwiGLU's activation on a fused gate/up projection: x [..., 2 * n] bf16 -> [..., n],
// silu(x[..., :n]) * x[..., n:] computed in fp32 and rounded once (activation.h), by the
// kernels of `isa` ("auto" or a name, as paged_attention's); rows split over torch's intra-op
// threads from `parallel_from_rows` rows (0: from kMinParallelSiluElements output elements).
torch::Tensor silu_and_mul(const torch::Tensor& x, const std::string& isa, int64_t parallel_from_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16,
              "silu_and_mul: x must be a bf16 CPU tensor; got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: x's last dimension must be even (gate and up halves); got ", x.sizes());
  TORCH_CHECK(parallel_from_rows >= 0, "silu_and_mul: parallel_from_rows must be >= 0; got ", parallel_from_rows);
  // head_dim 0: every instruction set qualifies (the activation takes rows of any length)
  const mini_infer::SiluAndMulFn row = select_kernels(isa, 0, "silu_and_mul").silu_and_mul_bf16;
  const int64_t n = x.size(-1) / 2;
  auto in = x.reshape({-1, 2 * n});
  if (in.stride(1) != 1) in = in.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, x.options());
  const int64_t rows = in.size(0), stride = in.stride(0);
  const auto* src = reinterpret_cast<const mini_infer::bf16_t*>(in.data_ptr());
  auto* dst = reinterpret_cast<mini_infer::bf16_t*>(out.data_ptr());
  const int64_t grain = parallel_from_rows > 0 ? parallel_from_rows
                                               : std::max<int64_t>(1, kMinParallelSiluElements / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(src + r * stride, src + r * stride + n, dst + r * n, n);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(mini_infer, m) { m.def("silu_and_mul(Tensor x, str isa, int parallel_from_rows=0) -> Tensor"); }
TORCH_LIBRARY_IMPL(mini_infer, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_kv", &store_kv, "Write new keys and values into their paged-cache slots", py::arg("key"),
        py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &paged_attention, "Paged causal attention on the CPU (decode tokens and prefill chunks)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("isa") = "auto", py::arg("num_splits") = 0,
        py::arg("sdpa_prefill") = false, py::arg("prefetch_l2") = false, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) for fp32, bf16 or fp16 [rows, vocab] logits",
        py::arg("logits"), py::call_guard<py::gil_scoped_release>());
  m.def("supported_isas", &supported_isas, "Instruction sets this CPU runs, best first");
  m.def("selected_isa", &selected_isa, "The instruction set a call with `isa` runs at a head_dim", py::arg("head_dim"),
        py::arg("isa") = "auto");
}
