"""The step-time cost of structured outputs: a workload with every request JSON-constrained
against the same workload unconstrained, in one process, interleaved.

    python bench/structured_outputs.py --workload ../shared/workloads/w2_short.json [--rounds 2]
    python bench/structured_outputs.py --workload ../shared/workloads/w2_short.json --masks-only 1 64 256

Each round runs ``unconstrained`` then ``json`` (``LLM.generate`` on every request at once,
greedy, ``ignore_eos``, each request's ``max_tokens``). In ``json`` every request carries
``SCHEMA``, whose ``minItems`` keeps every sampled token of every request inside the
grammar (the schema cannot end within 128 tokens), so every row of every step is masked:
the worst case of the batched mask fill plus the bitmask kernel. The grammar is compiled
before the clock starts (a warm-up request), as a service's LRU cache would hold it.
Reported: output tok/s per system and round, the json / unconstrained ratio of the best
rounds, the extra milliseconds per engine step, and the host time per step spent filling
the bitmasks (``ModelRunner._fill_grammar_bitmask``) and applying them
(``engine.sampler.apply_grammar_bitmask``), timed around those two calls.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import load_workload, machine_info, write_result

import engine.sampler as sampler_module
from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 64,
          "items": {"type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                   "name": {"type": "string", "maxLength": 16},
                                   "kind": {"enum": ["book", "film", "song"]},
                                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
                    "required": ["id", "name", "kind", "tags"], "additionalProperties": False}}


def run(llm: LLM, requests: list[dict], constrained: bool) -> dict:
    structured_outputs = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True,
                             structured_outputs=structured_outputs) for r in requests]
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    clocks = {"step": _Clock(engine, "step"), "mask_fill": _Clock(runner, "_fill_grammar_bitmask"),
              "mask_apply": _Clock(sampler_module, "apply_grammar_bitmask")}
    try:
        start = time.perf_counter()
        outputs = llm.generate([r["prompt_token_ids"] for r in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        for clock in clocks.values():
            clock.restore()
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_steps = clocks["step"].calls
    return {"system": "json" if constrained else "unconstrained", "seconds": seconds, "num_steps": num_steps,
            "num_output_tokens": num_output, "output_tok_per_s": num_output / seconds,
            "ms_per_step": 1000 * seconds / num_steps,
            # host time filling the bitmasks (xgrammar, C++ threads) and applying them, per step
            "mask_fill_ms_per_step": 1000 * clocks["mask_fill"].seconds / num_steps,
            "mask_apply_ms_per_step": 1000 * clocks["mask_apply"].seconds / num_steps,
            "num_masked_steps": clocks["mask_apply"].calls}  # steps whose sampler applied bitmasks


class _Clock:
    """Counts calls of ``owner.name`` and the seconds spent in them, until ``restore``."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.calls, self.seconds = owner, name, 0, 0.0
        self.original = getattr(owner, name)
        self.had_own = name in vars(owner)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)

    def restore(self) -> None:
        if self.had_own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)


def masks_only(batch_sizes: list[int], num_steps: int = 32) -> list[dict]:
    """The constrained part of a step alone, without the model: for B sequences of SCHEMA,
    fill the B bitmasks (one batched call), apply them to random ``[B, vocab]`` fp32 logits,
    take each row's argmax and advance each matcher by it. Needs only the tokenizer."""
    import torch

    from engine.loader import load_model
    from engine.sampler import apply_grammar_bitmask
    from engine.scheduler_output import SamplingRow
    from engine.structured_outputs import GrammarBitmask, StructuredOutputManager

    loaded = load_model("smollm2-135m-instruct", load_weights=False)
    vocab_size = loaded.config.vocab_size
    manager = StructuredOutputManager(loaded.tokenizer, vocab_size, loaded.tokenizer.eos_token_id)
    bitmask = GrammarBitmask(vocab_size, torch.device("cpu"))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    results = []
    for batch_size in batch_sizes:
        grammars = [manager.grammar(params.structured_outputs) for _ in range(batch_size)]
        for grammar in grammars:
            grammar.wait(600)
            assert grammar.is_ready() and grammar.error is None
        rows = [SamplingRow(params, [], [], 0, None, g) for g in grammars]
        generator = torch.Generator().manual_seed(0)
        fill = apply = accept = 0.0
        for _ in range(num_steps):
            logits = torch.randn(batch_size, vocab_size, generator=generator)
            t0 = time.perf_counter()
            step_bitmask = bitmask.fill(rows)
            t1 = time.perf_counter()
            apply_grammar_bitmask(logits, step_bitmask)
            tokens = logits.argmax(dim=-1).tolist()
            t2 = time.perf_counter()
            assert all(g.accept(t) for g, t in zip(grammars, tokens, strict=True))
            t3 = time.perf_counter()
            fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
        result = {"batch_size": batch_size, "fill_ms": 1000 * fill / num_steps,
                  "apply_argmax_ms": 1000 * apply / num_steps, "accept_ms": 1000 * accept / num_steps}
        results.append(result)
        print(f"B={batch_size:4d}: fill {result['fill_ms']:.2f} ms, apply+argmax {result['apply_argmax_ms']:.2f} ms, "
              f"accept {result['accept_ms']:.2f} ms per step", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--num-requests", type=int, default=None, help="the first N requests (default: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: results/...)")
    parser.add_argument("--masks-only", type=int, nargs="+", default=None, metavar="B",
                        help="only time the constrained part of a step for these batch sizes (no model)")
    args = parser.parse_args()
    if args.masks_only:
        result = {"masks_only": masks_only(args.masks_only), "schema": SCHEMA, "machine": machine_info()}
        print(f"wrote {write_result('structured-masks-cpu', result, args.out)}")
        return
    workload = load_workload(args.workload)
    requests = workload["requests"][:args.num_requests]
    llm = LLM(dtype=args.dtype, device=args.device)
    # Warm up both paths; the json run compiles SCHEMA here, off the clock.
    warm = StructuredOutputsParams(json=SCHEMA)
    llm.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, structured_outputs=warm)],
                 use_tqdm=False)
    runs = []
    for round_index in range(args.rounds):
        for constrained in (False, True):
            result = {"round": round_index, **run(llm, requests, constrained)}
            runs.append(result)
            print(f"round {round_index} {result['system']:>13}: {result['output_tok_per_s']:7.1f} output tok/s, "
                  f"{result['ms_per_step']:6.1f} ms/step over {result['num_steps']} steps, masks "
                  f"{result['mask_fill_ms_per_step']:.2f} ms fill + {result['mask_apply_ms_per_step']:.2f} ms "
                  "apply per step", flush=True)
    best = {name: max((r for r in runs if r["system"] == name), key=lambda r: r["output_tok_per_s"])
            for name in ("unconstrained", "json")}
    ratio = best["json"]["output_tok_per_s"] / best["unconstrained"]["output_tok_per_s"]
    extra_ms = best["json"]["ms_per_step"] - best["unconstrained"]["ms_per_step"]
    print(f"json / unconstrained output tok/s: {ratio:.3f}x; +{extra_ms:.1f} ms per step")
    result = {"workload": workload["name"], "num_requests": len(requests), "dtype": args.dtype,
              "device": args.device, "schema": SCHEMA, "runs": runs, "ratio": ratio,
              "extra_ms_per_step": extra_ms, "machine": machine_info()}
    path = write_result(f"structured-{workload['name']}-{args.dtype}-{args.device}", result, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
