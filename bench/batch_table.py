"""The seed's table, redone: throughput, TTFT, TPOT and peak memory at batch 1, 4, 8, 16 and
32, for transformers ``generate()`` and for mini-infer, on equal-length requests.

    python bench/batch_table.py [--dtype bfloat16] [--prompt-len 128] [--max-tokens 64]

Batch B means B requests of the same prompt and output length, all at t = 0: one static
batch for transformers, ``max_num_seqs = B`` for mini-infer.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import common  # noqa: F401  (before torch: the engine's OpenMP wait policy, bench/common.py)
import torch
from common import machine_info, write_result
from offline import DTYPES, load_hf, run_hf_static, run_mini_infer


def requests_of(batch: int, prompt_len: int, max_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(prompt_len)],
             "max_tokens": max_tokens} for _ in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    hf = load_hf(args.model, args.dtype, args.device)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        requests = requests_of(batch, args.prompt_len, args.max_tokens)
        rows.append({"batch": batch, "transformers": run_hf_static(hf, requests, batch, args.device),
                     "mini-infer": run_mini_infer("mini-infer", args.model, args.dtype, args.device, requests)})
    result = {"model": args.model, "dtype": args.dtype, "device": args.device,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "machine": machine_info(), "rows": rows}
    path = write_result(f"batch-table-{args.model.replace(':', '_')}-{args.dtype}-{args.device}", result, args.out)
    _plot(result, path.with_suffix(".png"))
    print(f"{'batch':>5} | {'system':<12}{'out tok/s':>10}{'TTFT p50 s':>11}{'TPOT p50 ms':>12}{'peak GiB':>9}")
    for row in rows:
        for system in ("transformers", "mini-infer"):
            s = row[system]
            print(f"{row['batch']:>5} | {system:<12}{s['output_tokens_per_s']:>10.1f}{s['ttft_s']['p50']:>11.3f}"
                  f"{1000 * s['tpot_s']['p50']:>12.1f}{s['peak_memory_gib']:>9.2f}")
    print(f"wrote {path} and {path.with_suffix('.png').name}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in result["rows"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for system, style in (("transformers", "s--"), ("mini-infer", "o-")):
        axes[0].plot(batches, [r[system]["output_tokens_per_s"] for r in result["rows"]], style, label=system)
        axes[1].plot(batches, [r[system]["ttft_s"]["p50"] for r in result["rows"]], style, label=system)
        axes[2].plot(batches, [1000 * r[system]["tpot_s"]["p50"] for r in result["rows"]], style, label=system)
    for ax, label in zip(axes, ("output tokens/s", "TTFT p50 (s)", "TPOT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}, {result['dtype']}, {result['device']}: prompt {result['prompt_len']}, "
                 f"output {result['max_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
