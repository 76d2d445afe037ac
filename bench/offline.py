"""Offline throughput: a workload through mini-infer and through transformers, in one run.

    python bench/offline.py --workload ../shared/workloads/w1_mixed.json [--dtype bfloat16]

Systems, same model, dtype and device, one after the other in this process:

- ``mini-infer``: ``LLM.generate`` on every request at once (continuous batching), with
  prefix caching (the default), from an empty cache.
- ``mini-infer-no-prefix-caching``: the same with ``enable_prefix_caching=False``. With
  ``--repeats N`` the two alternate N times and each reports its median run.
- ``hf-static-B``: transformers ``generate()`` on static batches of B requests in arrival
  order, left-padded, each batch run to its longest ``max_tokens``; only each request's own
  ``max_tokens`` count as output.
- ``hf-continuous``: transformers' own continuous batching (``generate_batch``'s manager),
  with each request's ``max_tokens``.

Every request is greedy and ignores EOS, so all systems produce the same number of tokens.
Fields of a workload's requests other than ``prompt_token_ids`` and ``max_tokens`` (such as
w3_shared_prefix's ``prefix_id``) are ignored. ``--batch-sizes "" --skip-continuous`` runs
only mini-infer's two systems.
All requests arrive at t = 0: TTFT is measured from the start of the run. The result JSON
also gives the machine's measured matmul rate and the workload's FLOPs, so that each
throughput is a fraction of the compute roofline.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common  # noqa: F401  (before torch: the engine's OpenMP wait policy, bench/common.py)
import torch
from common import (
    PeakMemory,
    load_workload,
    machine_info,
    matmul_flops_per_s,
    percentiles,
    workload_flops,
    write_result,
)

from engine import LLM, SamplingParams
from engine.loader import load_model

STALL_TIMEOUT_S = 900  # seconds without a result before hf-continuous counts as failed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


MINI_INFER = {"mini-infer": True, "mini-infer-no-prefix-caching": False}  # system -> enable_prefix_caching


def run_mini_infer_systems(model: str, dtype: str, device: str, requests: list[dict], repeats: int,
                           populate_kv_cache: bool = True) -> list[dict]:
    """mini-infer with prefix caching on and off, alternating ``repeats`` times; per system
    its run of median output tok/s, with every run's throughput and TTFT p50 beside it."""
    runs: dict[str, list[dict]] = {system: [] for system in MINI_INFER}
    for _ in range(repeats):
        for system, enable_prefix_caching in MINI_INFER.items():
            runs[system].append(run_mini_infer(system, model, dtype, device, requests, enable_prefix_caching,
                                               populate_kv_cache))
    results = []
    for system_runs in runs.values():
        median = sorted(system_runs, key=lambda r: r["output_tokens_per_s"])[(len(system_runs) - 1) // 2]
        results.append({**median, "runs_output_tokens_per_s": [r["output_tokens_per_s"] for r in system_runs],
                        "runs_ttft_p50_s": [r["ttft_s"]["p50"] for r in system_runs]})
    return results


def run_mini_infer(system: str, model: str, dtype: str, device: str, requests: list[dict],
                   enable_prefix_caching: bool = True, populate_kv_cache: bool = True) -> dict:
    llm = LLM(model=model, dtype=dtype, device=device, enable_prefix_caching=enable_prefix_caching)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    llm.reset_prefix_cache()
    if populate_kv_cache:  # not in --quick's smoke run: 2 GiB took up to 22 s on a cold VM
        # The CPU KV cache is backed as it is first written (lazily_zeroed_cpu): back it now, so
        # that the timed run measures steps, not the first touch of memory (as before 2026-12-01).
        llm.llm_engine.model_runner.populate_kv_cache()
    before = llm.llm_engine.stats()  # the warm-up's counts are left out
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    with PeakMemory(device).measure() as memory:
        start = time.perf_counter()
        outputs = llm.generate([r["prompt_token_ids"] for r in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    ttft, tpot = [], []
    for output in outputs:
        m, n = output.metrics, len(output.outputs[0].token_ids)
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
    stats = llm.llm_engine.stats()
    del llm
    queries = stats["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = stats["prefix_cache_hits"] - before["prefix_cache_hits"]
    return _summary(system, requests, seconds, ttft, tpot, memory,
                    num_preemptions=stats["num_preemptions"] - before["num_preemptions"],
                    prefix_cache_queries=queries, prefix_cache_hits=hits,
                    prefix_cache_hit_rate=round(hits / queries, 4) if queries else 0.0)


def load_hf(model: str, dtype: str, device: str):
    """transformers' model of the same spec and weights (the loader's cached directory, or a
    random-weight model of the same shape for dummy specs)."""
    from transformers import AutoModelForCausalLM

    loaded = load_model(model, load_weights=False)
    if loaded.path is None:
        with torch.device(device):  # a 7B model is initialised where it will run
            hf = AutoModelForCausalLM.from_config(loaded.config, dtype=DTYPES[dtype])
    else:
        hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=DTYPES[dtype])
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None  # every request runs to its max_tokens
    hf.generation_config.pad_token_id = 0
    return hf


class _StepClock:
    """A logits processor that only records when each decoding step happened."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def run_hf_static(hf, requests: list[dict], batch_size: int, device: str) -> dict:
    from transformers import LogitsProcessorList

    ttft, tpot = [], []
    with PeakMemory(device).measure() as memory:
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            input_ids, attention_mask = _left_pad([r["prompt_token_ids"] for r in batch], device)
            clock = _StepClock()
            hf.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                        max_new_tokens=max(r["max_tokens"] for r in batch),
                        logits_processor=LogitsProcessorList([clock]))
            for r in batch:
                ttft.append(clock.times[0] - start)
                if r["max_tokens"] > 1:
                    tpot.append((clock.times[r["max_tokens"] - 1] - clock.times[0]) / (r["max_tokens"] - 1))
        seconds = time.perf_counter() - start
    return _summary(f"hf-static-{batch_size}", requests, seconds, ttft, tpot, memory)


def _left_pad(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_hf_continuous(hf, requests: list[dict], device: str) -> dict:
    """transformers' continuous batching, each request with its own ``max_new_tokens``, its
    KV cache and token budget as mini-infer's defaults (``kv_cache_memory_gb``,
    ``max_num_batched_tokens``): left to itself it takes 90% of the free memory (14 GiB on a
    24 GiB machine) and 8,192 tokens a step."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from engine.config import CacheConfig, SchedulerConfig
    from engine.models import head_dim_of

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                              max_new_tokens=max(r["max_tokens"] for r in requests))
    model_config, page_size = hf.config, 256  # ContinuousBatchingConfig's default page_size
    block_bytes = (model_config.num_hidden_layers * page_size * 2 * model_config.num_key_value_heads
                   * head_dim_of(model_config) * hf.dtype.itemsize)
    batching = ContinuousBatchingConfig(num_blocks=int(CacheConfig().kv_cache_memory_gb * 2**30 // block_bytes),
                                        max_batch_tokens=SchedulerConfig().max_num_batched_tokens)
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in requests),
                          max_generated_length=config.max_new_tokens, num_requests=len(requests))
    first_token, last_token = {}, {}
    with PeakMemory(device).measure() as memory:
        start = time.perf_counter()
        with hf.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                    continuous_batching_config=batching,
                                                    warmup=False, workload_hints=hints) as manager:
            ids = [manager.add_request(r["prompt_token_ids"], max_new_tokens=r["max_tokens"], streaming=True)
                   for r in requests]
            want = {request_id: r["max_tokens"] for request_id, r in zip(ids, requests, strict=True)}
            while len(last_token) < len(ids):
                # a stall guard only: on a CPU its first (whole-budget) step takes minutes
                result = manager.get_result(timeout=STALL_TIMEOUT_S)
                if result is None:
                    raise RuntimeError("transformers' continuous batching stopped producing results")
                now = time.perf_counter()
                first_token.setdefault(result.request_id, now)
                if result.is_finished():
                    last_token[result.request_id] = now
        seconds = time.perf_counter() - start
    ttft = [first_token[i] - start for i in ids]
    tpot = [(last_token[i] - first_token[i]) / (want[i] - 1) for i in ids if want[i] > 1]
    return _summary("hf-continuous", requests, seconds, ttft, tpot, memory)


def _summary(system: str, requests: list[dict], seconds: float, ttft: list[float],
             tpot: list[float], memory: PeakMemory, **extra) -> dict:
    output_tokens = sum(r["max_tokens"] for r in requests)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return {"system": system, "seconds": round(seconds, 3), "output_tokens": output_tokens,
            "output_tokens_per_s": round(output_tokens / seconds, 2),
            "total_tokens_per_s": round((output_tokens + prompt_tokens) / seconds, 2),
            "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), **memory.as_dict(), **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="8,16,32", help="transformers static batch sizes")
    parser.add_argument("--skip-continuous", action="store_true", help="skip transformers' CB")
    parser.add_argument("--quick", action="store_true", help="8 short requests (CI)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mini-infer system, alternating (the median is reported)")
    parser.add_argument("--out", type=Path, help="result JSON (default results/..., git-ignored)")
    args = parser.parse_args()

    workload = load_workload(args.workload, args.quick)
    requests = workload["requests"]
    config = load_model(args.model, load_weights=False).config
    flops = workload_flops(config, requests)
    # The compute roof: the faster of the dtype's own GEMM and an fp32 GEMM over the same
    # (exactly converted) operands; on a CPU without bf16 units the latter is 4x faster.
    rates = {args.dtype: matmul_flops_per_s(DTYPES[args.dtype], args.device)}
    if args.dtype != "float32":
        rates["float32"] = matmul_flops_per_s(torch.float32, args.device)
    rate = max(rates.values())
    systems = run_mini_infer_systems(args.model, args.dtype, args.device, requests, args.repeats,
                                     populate_kv_cache=not args.quick)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    hf = load_hf(args.model, args.dtype, args.device) if batch_sizes or not args.skip_continuous else None
    for batch_size in batch_sizes:
        systems.append(run_hf_static(hf, requests, batch_size, args.device))
    if not args.skip_continuous:
        systems.append(_try(lambda: run_hf_continuous(hf, requests, args.device), "hf-continuous"))
    for s in systems:
        if "seconds" in s:
            s["roofline_fraction"] = round(flops / s["seconds"] / rate, 4)
    result = {"workload": workload["name"], "model": args.model, "dtype": args.dtype,
              "device": args.device, "num_requests": len(requests),
              "workload_flops": flops, "matmul_flops_per_s": rate,
              "matmul_flops_per_s_by_dtype": rates,
              "roofline_seconds": round(flops / rate, 3), "machine": machine_info(),
              "systems": systems, **_ratios(systems)}
    stem = f"offline-{workload['name']}-{args.model.replace(':', '_')}-{args.dtype}-{args.device}"
    path = write_result(stem, result, args.out)
    _plot(result, path.with_suffix(".png"))
    _print(result, path)


def _try(run, system: str) -> dict:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        return {"system": system, "error": f"{type(exc).__name__}: {exc}"}


def _ratios(systems: list[dict]) -> dict:
    ours = systems[0]["output_tokens_per_s"]
    static = [s for s in systems if s["system"].startswith("hf-static") and "seconds" in s]
    baselines = [s for s in systems[2:] if "seconds" in s]
    off = systems[1]
    out = {"prefix_caching_throughput_ratio": round(ours / off["output_tokens_per_s"], 3),
           "prefix_caching_ttft_p50_ratio": round(off["ttft_s"]["p50"] / systems[0]["ttft_s"]["p50"], 3)}
    if static:
        best = max(static, key=lambda s: s["output_tokens_per_s"])
        out.update(best_static=best["system"], ratio_vs_best_static=round(ours / best["output_tokens_per_s"], 2))
    if baselines:
        best = max(baselines, key=lambda s: s["output_tokens_per_s"])
        out.update(best_baseline=best["system"], ratio_vs_best_baseline=round(ours / best["output_tokens_per_s"], 2))
    return out


def _print(result: dict, path: Path) -> None:
    print(f"{result['workload']}: {result['num_requests']} requests, {result['model']}, "
          f"{result['dtype']} on {result['device']}; matmul roof {result['matmul_flops_per_s'] / 1e9:.0f} "
          f"GFLOP/s, workload {result['workload_flops'] / 1e12:.2f} TFLOP")
    print(f"{'system':<30}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50 s':>11}{'TPOT p50 ms':>12}"
          f"{'peak GiB':>9}{'roofline':>9}")
    for s in result["systems"]:
        if "error" in s:
            print(f"{s['system']:<30} failed: {s['error']}")
            continue
        print(f"{s['system']:<30}{s['output_tokens_per_s']:>10.1f}{s['total_tokens_per_s']:>12.1f}"
              f"{s['ttft_s'].get('p50', float('nan')):>11.2f}{1000 * s['tpot_s'].get('p50', float('nan')):>12.1f}"
              f"{s['peak_memory_gib']:>9.2f}{100 * s['roofline_fraction']:>8.1f}%")
    print(f"prefix caching on / off: output tok/s {result['prefix_caching_throughput_ratio']:.2f}x, "
          f"TTFT p50 {result['prefix_caching_ttft_p50_ratio']:.2f}x lower")
    if "ratio_vs_best_static" in result:
        print(f"mini-infer / {result['best_static']}: {result['ratio_vs_best_static']:.2f}x; "
              f"/ {result['best_baseline']}: {result['ratio_vs_best_baseline']:.2f}x")
    print(f"wrote {path} and {path.with_suffix('.png').name}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in result["systems"] if "seconds" in s]
    names = [s["system"].replace("-no-", "\nno-") for s in systems]
    colors = ["tab:green", "tab:olive"] + ["tab:gray"] * (len(systems) - 2)
    fig, (ax, ttft) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=(3, 2))
    bars = ax.bar(names, [s["output_tokens_per_s"] for s in systems], color=colors)
    for bar, s in zip(bars, systems, strict=True):
        ax.annotate(f"{s['output_tokens_per_s']:.1f}\n({100 * s['roofline_fraction']:.0f}% roof)",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['workload']}: {result['model']}, {result['dtype']}, {result['device']}", fontsize=9)
    ax.margins(y=0.25)
    ax.tick_params(axis="x", labelsize=7)
    bars = ttft.bar(names, [s["ttft_s"]["p50"] for s in systems], color=colors)
    ttft.bar_label(bars, fmt="%.1f", fontsize=8)
    ttft.set_ylabel("TTFT p50, s (all arrive at t = 0)")
    ttft.margins(y=0.2)
    ttft.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
