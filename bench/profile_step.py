"""Where one engine step's time goes, for a prefill step and a decode step of a workload.

    python bench/profile_step.py --workload ../shared/workloads/w1_mixed.json [--dtype float32]
        [--kv-cache-dtype fp8_e5m2]

It queues the whole workload, then profiles (torch.profiler, CPU time by operator) the first
step (a 2048-token prefill) and a decode step once every request is running, and reports the
share of matmuls (``aten::mm``, ``aten::addmm``, oneDNN's ``_linear_pointwise`` on prepacked
weights), attention (``kernels.paged_attention``: the C++ decode kernel or SDPA), the KV
store, and everything else; then the decode step's shares again without the profiler
(``unprofiled_decode``).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (before torch: the engine's OpenMP wait policy, bench/common.py)
import torch
from common import load_workload, machine_info, write_result
from torch.profiler import ProfilerActivity, profile, record_function

import kernels
from engine import LLM, SamplingParams
from engine.config import KV_CACHE_DTYPES
from engine.models.llama import Linear
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


class _Timed:
    """Wall time spent inside ``fn`` while ``on`` (``time.perf_counter``; no profiler)."""

    def __init__(self, fn) -> None:
        self.fn, self.on, self.seconds = fn, False, 0.0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if not self.on:
            return self.fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def unprofiled_decode(engine, attention: _Timed, kv_store: _Timed, steps: int = 8) -> dict:
    """A decode step's shares without the profiler, which adds ~10% to a step, all of it to
    "other": the median wall time of ``steps`` decode steps; attention and the KV store timed
    around their calls; the matmuls replayed right after at the same shapes (every ``Linear``
    of the model and the LM head on ``num_seqs`` random rows: the step's own GEMMs cannot be
    timed from Python inside the compiled glue). "other" is what remains."""
    walls, attn, store = [], [], []
    for _ in range(steps):
        attention.seconds = kv_store.seconds = 0.0
        attention.on = kv_store.on = True
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        attention.on = kv_store.on = False
        attn.append(attention.seconds)
        store.append(kv_store.seconds)
    model = engine.model_runner.model
    num_seqs = engine.stats()["num_running"]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(num_seqs, m.in_features, dtype=engine.model_runner.dtype) for m in linears}
    replays = []
    with torch.inference_mode():
        for _ in range(steps):
            start = time.perf_counter()
            for m in linears:
                m(inputs[m.in_features])
            model.compute_logits(inputs[model.config.hidden_size])
            replays.append(time.perf_counter() - start)
    seconds = {"matmul (replayed)": statistics.median(replays), "attention": statistics.median(attn),
               "kv store": statistics.median(store)}
    wall = statistics.median(walls)
    shares = {name: round(t / wall, 3) for name, t in seconds.items()}
    shares["other (python, norms, rope, sampler, ...)"] = round(1 - sum(shares.values()), 3)
    return {"wall_s": round(wall, 4), "num_seqs": num_seqs, "steps": steps,
            "seconds": {k: round(v, 4) for k, v in seconds.items()}, "share": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true", help="no compiled glue")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the engine's kv_cache_dtype")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    timed_attention = _Timed(_labelled(kernels.paged_attention, GROUPS["attention"][0]))
    timed_store = _Timed(_labelled(kernels.store_kv, GROUPS["kv store"][0]))
    kernels.paged_attention, kernels.store_kv = timed_attention, timed_store
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    # Back the CPU KV cache now, as bench/offline.py does, so that the steps profiled are not
    # charged with the first touch of the blocks they write (the prefill step's KV store took
    # 19% of it on a Xeon with AMX without this, 2026-12-01).
    engine.model_runner.populate_kv_cache()
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
    unprofiled = unprofiled_decode(engine, timed_attention, timed_store)
    result = {"workload": args.workload.name, "model": args.model, "dtype": args.dtype,
              "kv_cache_dtype": args.kv_cache_dtype,
              "attention_backend": engine.model_runner.backend,
              "compiled_glue": engine.model_runner.compiled_glue,
              "prepacked_weights": engine.model_runner.prepacked_weights, "machine": machine_info(),
              "prefill_step": prefill, "decode_step": decode, "decode_step_unprofiled": unprofiled}
    path = write_result(f"profile-step-{args.dtype}", result, args.out)
    for name in ("prefill_step", "decode_step", "decode_step_unprofiled"):
        step = result[name]
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in step["share"].items())
        print(f"{name}: {1000 * step['wall_s']:.0f} ms: {shares}")
    print(f"wrote {path}")
    while engine.has_unfinished_requests():  # leave the engine idle
        for request_id in [r.request_id for r in list(engine.scheduler.requests.values())]:
            engine.abort_request(request_id)


if __name__ == "__main__":
    main()
