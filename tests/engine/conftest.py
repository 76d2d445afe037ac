"""Shared fixtures for engine tests: the default model in fp32, transformers' reference,
and prompts of mixed lengths cut from a fixed English passage."""
from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

PASSAGE = """\
The old lighthouse keeper kept a logbook for forty-one years, and every entry began the same
way: the date, the direction of the wind, and the colour of the sea at dawn. On calm mornings
he wrote that the water was the grey of a pigeon's wing; in winter storms he wrote only
"black" and underlined it twice. Visitors who came to the island in summer were allowed to
read the early volumes, which were kept in a glass case beside the spiral stairs. Most of
them expected adventure, shipwrecks and rescues, and some of that was there. In the spring
of one year a fishing boat lost its rudder on the reef, and the keeper rowed out with a rope
and a lantern and brought four men home before the tide turned. But the greater part of the
logbook recorded small, patient work: the lamp trimmed at dusk, the brass polished, the
clockwork that turned the lens wound every four hours through the night. He counted the
birds that struck the glass during migration and buried them in a row behind the cottage.
He noted when the first swallows arrived and when the last ones left, and over the decades
the dates crept earlier in spring and later in autumn, a change he remarked on without
trying to explain. When electricity came to the island, the clockwork was removed and sent
to a museum on the mainland. The keeper stayed on for three more years, though there was
little left for him to do, and the entries in those final volumes grow shorter and stranger.
"Wind north-east. Sea like pewter. Nothing to wind." A historian who studied the logbooks
later argued that they were one of the best continuous records of coastal weather in the
country, more reliable than the official station on the headland because the keeper never
missed a day. Scientists have since used his notes on sea colour, wave height and bird
arrivals to check their models of how the climate of the coast has shifted over a century.
The keeper himself never read any of this work. He moved to a small house in the harbour
town, grew beans and potatoes, and walked to the end of the pier each evening to watch the
new automatic light come on. Neighbours said he would stand there until he had counted
three full turns of the beam, then nod, as if satisfied that it was doing its job properly,
and walk home again. His granddaughter, who became an engineer, keeps the last logbook on
her desk. She says that it taught her the most important lesson of her profession: that
the systems people depend on are kept running not by brilliant inventions alone, but by
someone who checks them, writes down what they see, and comes back the next day to check
again. Every new machine she designs has a place for a logbook, even if it is only a file
that nobody but her will ever open.
"""

# Lengths around block boundaries (block_size 16), short, and one long prompt.
PROMPT_LENGTHS = [1, 7, 15, 16, 17, 24, 31, 32, 33, 48, 64, 97, 128, 200, 256, 333, 420, 450]
MAX_TOKENS = 48


@pytest.fixture(scope="session")
def model_dir():
    from engine.loader import gguf_cache_dir, smollm2_gguf_path

    return gguf_cache_dir(smollm2_gguf_path())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def mixed_prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer(PASSAGE).input_ids
    assert len(ids) > max(PROMPT_LENGTHS) + 64
    return [ids[(37 * i) % (len(ids) - n):][:n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own load of the GGUF (not our cache), fp32."""
    from transformers import AutoModelForCausalLM

    from engine.loader import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generations of ``prompts`` as one left-padded batch: the attention
    mask hides the padding and ``generate`` counts each row's positions from its first real
    token, so each row is the prompt's own generation up to float rounding."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


HF_BATCH = 6  # prompts per reference batch: PROMPT_LENGTHS ascends, so a batch's are alike


@pytest.fixture(scope="session")
def hf_expected(hf_model, mixed_prompts) -> list[list[int]]:
    """transformers' greedy tokens for each of ``mixed_prompts``, made in batches of
    ``HF_BATCH``: 32 s against 94 s one prompt at a time on a 2-core EPYC (2026-12-02),
    and the same ids. test_correctness checks that against one-at-a-time generation for the
    two prompts with the most padding in their batches."""
    return [ids for start in range(0, len(mixed_prompts), HF_BATCH)
            for ids in hf_greedy_batch(hf_model, mixed_prompts[start:start + HF_BATCH], MAX_TOKENS)]


@pytest.fixture(scope="session")
def llm():
    """The default model in fp32 with default settings, shared by tests that leave it idle."""
    from engine import LLM

    return LLM(dtype="float32")


def assert_idle(llm) -> None:
    """Invariant 2: an idle engine has every block free (cached ones included) and nothing
    queued; and the block manager's invariants hold (one block per cached hash, no block
    both referenced and free)."""
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert llm.llm_engine.block_manager.block_tables == {}
    llm.llm_engine.block_manager.check_invariants()


def hold_the_second_step(monkeypatch, async_llm) -> threading.Event:
    """Make ``async_llm``'s second step wait until the returned event is set (at most 60 s),
    for a test about what the first output alone holds: it sets the event once it has that
    output. Without the hold, a consumer that the OS runs a step late finds two steps' outputs
    queued, which ``AsyncLLM`` joins into one output. Snapshots are served while it waits, as
    between any two steps."""
    release = threading.Event()
    engine = async_llm.engine
    step, calls = engine.step, itertools.count()

    def step_held():
        if next(calls) == 1:
            deadline = time.monotonic() + 60
            while not release.wait(0.005) and time.monotonic() < deadline:
                async_llm.snapshots.serve()
        return step()

    monkeypatch.setattr(engine, "step", step_held)
    return release


@pytest.fixture(autouse=True)
def _shared_engine_is_left_idle(request):
    """Invariant 2 after every test that used the shared engine: all blocks free."""
    yield
    if "llm" in request.fixturenames:
        assert_idle(request.getfixturevalue("llm"))
