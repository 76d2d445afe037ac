"""Command line: ``python -m engine generate --prompt "..."`` or ``--workload FILE.json``;
``--dashboard-port PORT`` serves the live dashboard of the run (``app.dashboard``).

A workload file is the format of ``shared/workloads/*.json``: ``{"requests": [{"id",
"prompt_token_ids", "max_tokens"}, ...]}``, generated greedily with ``ignore_eos``; other
fields of a request (w3_shared_prefix's ``prefix_id``) are ignored.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import typing
from pathlib import Path
from typing import Iterator

from engine.config import engine_args
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.workload import WorkloadError, read_workload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for one prompt or a workload file")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a prompt (sent through the chat template unless --raw)")
    source.add_argument("--workload", type=Path, help="a workload JSON file")
    gen.add_argument("--raw", action="store_true", help="send --prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--json-out", type=Path, help="also write the workload summary here")
    gen.add_argument("--populate-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                     help="--workload: back the whole CPU KV cache with memory before the clock starts "
                     "(ModelRunner.populate_kv_cache, as bench/offline.py does), so that the throughput "
                     "measures the steps and not the first touch of each page the run writes; the "
                     "summary says how long it took (default: on)")
    gen.add_argument("--dashboard-port", type=int, default=None,
                     help="serve the live dashboard (KV blocks, queues, tokens/s) at "
                     "http://127.0.0.1:PORT/dashboard while generating")
    add_engine_args(gen.add_argument_group("engine", "settings of engine.config, by field name"))
    return parser


def add_engine_args(group) -> None:
    """One option per engine setting (``engine.config.engine_args()``): ``--block-size``
    and so on, with the field's type, default, allowed values and help."""
    for arg in engine_args():
        flag = "--" + arg.name.replace("_", "-")
        value_type = _base_type(arg.type)
        if value_type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=arg.default,
                               help=arg.help)
        else:
            group.add_argument(flag, type=value_type, default=arg.default, choices=arg.choices,
                               help=f"{arg.help} (default: {arg.default})")


def _base_type(annotation) -> type:
    """``int | None`` -> ``int``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


@contextlib.contextmanager
def _dashboard(llm: LLM, port: int | None) -> Iterator[LLM]:
    """Serve ``app.dashboard``'s page for ``llm`` on ``port`` for the ``with`` block (nothing
    when ``port`` is ``None``)."""
    if port is None:
        yield llm
        return
    from app.dashboard import OfflineDashboard  # only here: the engine runs without the app

    try:
        dashboard = OfflineDashboard(llm, port)
    except OSError as exc:
        raise SystemExit(f"--dashboard-port: cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    print(f"dashboard: {dashboard.url}", file=sys.stderr, flush=True)
    try:
        yield llm
    finally:
        dashboard.close()


def _build_llm(args) -> LLM:
    return LLM(**{arg.name: getattr(args, arg.name) for arg in engine_args()})


def run_prompt(llm: LLM, args, params: SamplingParams) -> None:
    if args.raw:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    print(completion.text)
    print(f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} output "
          f"tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)


def run_workload(llm: LLM, path: Path, populate_kv_cache: bool = True) -> dict:
    """Generate every request of a workload file; return the throughput summary.

    With ``populate_kv_cache`` the CPU KV cache is backed with memory first, outside the
    timed run: the engine commits it page by page as steps first write it
    (``engine.model_runner.lazily_zeroed_cpu``), and on a VM whose memory is cold each 2 MiB
    page then costs the step that touches it ~1-5 ms of kernel time (w1_mixed, bf16, a Xeon
    with AMX: 451-455 output tok/s without, 480-485 with; docs/PERFORMANCE.md)."""
    requests = read_workload(path)["requests"]
    populated, populate_s = False, 0.0
    if populate_kv_cache:
        start = time.perf_counter()
        populated = llm.llm_engine.model_runner.populate_kv_cache()
        populate_s = time.perf_counter() - start
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.llm_engine.stats()
    return {"workload": path.name, "requests": len(outputs), "output_tokens": output_tokens,
            "prompt_tokens": sum(len(p) for p in prompts), "seconds": round(seconds, 3),
            "output_tokens_per_s": round(output_tokens / seconds, 2),
            "dtype": str(llm.llm_engine.model_runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(llm.llm_engine.model_runner.kv_cache_dtype).removeprefix("torch."),
            "device": str(llm.llm_engine.model_runner.device),
            "attention_backend": llm.llm_engine.model_runner.backend,
            "num_preemptions": stats["num_preemptions"],
            "kv_cache_populated": populated,
            "kv_cache_populate_s": round(populate_s, 3) if populate_kv_cache else None,
            "cpu_attention": llm.llm_engine.model_runner.cpu_attention,
            "enable_prefix_caching": llm.llm_engine.config.cache.enable_prefix_caching,
            "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "prefix_cache_hit_rate": round(stats["prefix_cache_hit_rate"], 4)}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.dashboard_port is not None and not 0 <= args.dashboard_port <= 65535:
        raise SystemExit(f"--dashboard-port: {args.dashboard_port} is not a TCP port (0 to 65535)")
    if args.prompt is not None:
        try:  # bad values fail before loading, in one line naming the flag
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    max_tokens=args.max_tokens)
        except InvalidRequestError as exc:
            raise SystemExit(f"--{(exc.param or 'prompt').replace('_', '-')}: {exc}") from None
        with _dashboard(_build_llm(args), args.dashboard_port) as llm:
            run_prompt(llm, args, params)
        return
    try:  # checked before loading the model
        read_workload(args.workload)
    except WorkloadError as exc:
        raise SystemExit(f"--workload: {exc}") from None
    with _dashboard(_build_llm(args), args.dashboard_port) as llm:
        summary = run_workload(llm, args.workload, args.populate_kv_cache)
    print(f"requests: {summary['requests']}  output tokens: {summary['output_tokens']}  "
          f"seconds: {summary['seconds']:.2f}  output tokens/s: {summary['output_tokens_per_s']:.1f}  "
          f"({summary['dtype']}, KV cache {summary['kv_cache_dtype']}, {summary['device']}, "
          f"attention {summary['attention_backend']}, "
          f"prefix cache hits {summary['num_cached_tokens']} tokens)")
    if summary["kv_cache_populated"]:
        print(f"(the KV cache was backed with memory before the timed run, in {summary['kv_cache_populate_s']:.2f} s; "
              "--no-populate-kv-cache times the first touch of its pages too)")
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
