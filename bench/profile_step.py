"""Where one engine step's time goes, for a prefill step and a decode step of a workload.

    python bench/profile_step.py --workload ../shared/workloads/w1_mixed.json [--dtype float32]

It queues the whole workload, then profiles (torch.profiler, CPU time by operator) the first
step (a 2048-token prefill) and a decode step once every request is running, and reports the
share of matmuls (``aten::mm``, ``aten::addmm``), attention (``kernels.paged_attention``: the C++ decode
kernel or SDPA), the KV store, and everything else.
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

from common import load_workload, machine_info, write_result
from torch.profiler import ProfilerActivity, profile, record_function

import kernels
from engine import LLM, SamplingParams
from engine.sampling_params import RequestOutputKind

# Inclusive CPU time of these profiler events; none of them nests inside another. Matmuls
# are the GEMM calls themselves: eager ``aten::linear`` reaches them through ``aten::matmul``,
# the compiled glue (``engine.models.llama.compile_glue``) calls them directly, an ``addmm``
# where a bias or a residual add is folded in.
GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention": ("mini_infer::paged_attention",),
    "kv store": ("mini_infer::store_kv",),
}


def _labelled(fn, label: str):
    """``fn`` inside a profiler range named ``label`` (the C++ kernel is otherwise invisible)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def profile_step(engine) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
    totals = {name: 0.0 for name in GROUPS}
    for event in prof.key_averages():
        for name, keys in GROUPS.items():
            if event.key in keys:
                totals[name] += event.cpu_time_total / 1e6
    shares = {name: round(seconds / wall, 3) for name, seconds in totals.items()}
    shares["other (python, norms, rope, sampler, ...)"] = round(1 - sum(shares.values()), 3)
    return {"wall_s": round(wall, 4), "seconds": {k: round(v, 4) for k, v in totals.items()},
            "share": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true", help="no compiled glue")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kernels.paged_attention = _labelled(kernels.paged_attention, GROUPS["attention"][0])
    kernels.store_kv = _labelled(kernels.store_kv, GROUPS["kv store"][0])
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager)
    engine = llm.llm_engine
    requests = load_workload(args.workload)["requests"]
    for i, r in enumerate(requests):
        engine.add_request(str(i), r["prompt_token_ids"], SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY))
    prefill = profile_step(engine)
    prefill["num_tokens"] = engine.config.scheduler.max_num_batched_tokens
    while engine.stats()["num_waiting"] or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    decode = profile_step(engine)
    decode["num_seqs"] = engine.stats()["num_running"]
    result = {"workload": args.workload.name, "model": args.model, "dtype": args.dtype,
              "attention_backend": engine.model_runner.backend,
              "compiled_glue": engine.model_runner.compiled_glue, "machine": machine_info(),
              "prefill_step": prefill, "decode_step": decode}
    path = write_result(f"profile-step-{args.dtype}", result, args.out)
    for name in ("prefill_step", "decode_step"):
        step = result[name]
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in step["share"].items())
        print(f"{name}: {1000 * step['wall_s']:.0f} ms: {shares}")
    print(f"wrote {path}")
    while engine.has_unfinished_requests():  # leave the engine idle
        for request_id in [r.request_id for r in list(engine.scheduler.requests.values())]:
            engine.abort_request(request_id)


if __name__ == "__main__":
    main()
