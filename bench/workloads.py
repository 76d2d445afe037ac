"""The project's fixed benchmark workloads, regenerated here for machines that have only this
repository (the GPU check's machine has no ``../shared``).

``make_workload(name)`` returns exactly the requests of ``../shared/workloads/<name>.json``:
the same generator (``../shared/workloads/make_workloads.py``), seeds and order of draws from
Python's ``random.Random``, whose integer draws are the same on every Python 3 version
(``tests/bench/test_workloads.py`` compares them where the shared folder exists).

    python bench/workloads.py w1_mixed --out /tmp/w1_mixed.json
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOKEN_RANGE = (100, 49000)  # inside SmolLM2's 49,152-token vocabulary

# name: (num_requests, prompt_len [lo, hi], output_len [lo, hi], seed)
PLAIN = {"w1_mixed": (64, (16, 512), (16, 256), 0), "w2_short": (256, (8, 64), (64, 128), 1)}
# name: (num_requests, num_prefixes, prefix_len, suffix_len [lo, hi], output_len [lo, hi], seed)
SHARED_PREFIX = {"w3_shared_prefix": (96, 6, 384, (16, 64), (32, 64), 2)}
NAMES = (*PLAIN, *SHARED_PREFIX)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def _plain(name: str) -> dict:
    n, (plo, phi), (olo, ohi), seed = PLAIN[name]
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt_len = rng.randint(plo, phi)
        requests.append({"id": f"{name}-{i}", "prompt_token_ids": _tokens(rng, prompt_len),
                         "max_tokens": rng.randint(olo, ohi)})
    return {"name": name, "num_requests": n, "prompt_len": [plo, phi], "output_len": [olo, ohi],
            "seed": seed, "ignore_eos": True, "requests": requests}


def _shared_prefix(name: str) -> dict:
    n, num_prefixes, prefix_len, (slo, shi), (olo, ohi), seed = SHARED_PREFIX[name]
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(n):
        suffix = _tokens(rng, rng.randint(slo, shi))
        requests.append({"id": f"{name}-{i}", "prefix_id": i % num_prefixes,
                         "prompt_token_ids": prefixes[i % num_prefixes] + suffix,
                         "max_tokens": rng.randint(olo, ohi)})
    return {"name": name, "num_requests": n, "num_prefixes": num_prefixes,
            "prefix_len": prefix_len, "suffix_len": [slo, shi], "output_len": [olo, ohi],
            "seed": seed, "ignore_eos": True, "requests": requests}


def make_workload(name: str) -> dict:
    """The workload ``name`` (one of ``NAMES``) as the JSON object of its shared file.

    Raises:
        ValueError: for an unknown name.
    """
    if name in PLAIN:
        return _plain(name)
    if name in SHARED_PREFIX:
        return _shared_prefix(name)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(make_workload(args.name)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
