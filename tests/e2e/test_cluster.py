"""Scale-out on a real two-node Ray cluster (tests/cluster.py: a head and a worker raylet on
this machine): the prefix-aware router against Serve's power of two choices, autoscaling
1 -> 2 -> 1 under a burst, and the loss of the worker node. Traffic to 127.0.0.1 only, every
request bounded by a client timeout; the cluster is stopped at the end of the module."""
import asyncio
import json
import random
import time

import aiohttp
import pytest
from ray import serve

from tests.cluster import URL, TwoNodeCluster, load_config

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WORDS = ("river stone cloud engine garden ticket silver forest lamp window harbor violin "
         "pepper canyon marble rocket orchard candle meadow bridge").split()
TIMEOUT_S = 60  # no client waits longer than this for an answer
# Each engine replica's KV cache: room for the routing test's conversations (about 5,000
# tokens a replica, 46 KB a token in fp32) and small enough for a shared 2-core, 24 GiB machine.
# Eager: these tests are about routing, scaling and failure, and each replica's glue compile
# costs ~13 s on two shared cores (tests/engine/test_compiled_glue.py tests the compiled path).
SMALL_KV = {"kv_cache_memory_gb": 0.5, "enforce_eager": True}


@pytest.fixture(scope="module")
def cluster():
    with TwoNodeCluster() as c:
        yield c


def conversation_opening(i: int) -> str:
    """A system prompt of about 200 tokens that only conversation ``i`` has."""
    rng = random.Random(i)
    return f"Conversation {i}. Notes: " + " ".join(rng.choice(WORDS) for _ in range(180))


async def _post(session, body: dict) -> tuple[int, dict, str | None]:
    """A chat completion: its status, its JSON body and the replica that served it."""
    async with session.post(URL + "/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as response:
        return response.status, await response.json(content_type=None), response.headers.get("x-mini-infer-replica")


async def run_conversations(num_conversations: int, num_turns: int, concurrency: int) -> list[str]:
    """Multi-turn chats, each turn resending the conversation so far, in rounds: every
    conversation's first turn, then every second turn, ..., each round in its own random
    order (other users' requests come between two turns of one user, as when people read
    and type); returns the replica of every turn. Raises on any answer but 200."""
    replicas = []
    limit = asyncio.Semaphore(concurrency)
    chats = [[{"role": "system", "content": conversation_opening(i)}] for i in range(num_conversations)]

    async def turn(session, messages, n):
        messages.append({"role": "user", "content": f"Question {n}: which word comes first?"})
        async with limit:
            status, body, replica = await _post(session, {"model": MODEL, "messages": messages,
                                                          "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        replicas.append(replica)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    async with aiohttp.ClientSession() as session:
        for n in range(num_turns):
            order = random.Random(n).sample(chats, len(chats))
            await asyncio.gather(*(turn(session, messages, n) for messages in order))
    return replicas


async def check_completions_batches() -> None:
    """A completions batch (one engine call per prompt, routed each by itself) answers in
    full, streamed and not. Under the prefix router the calls of one batch, which share
    Serve's internal request id, once waited for a replica for ever after the first was
    routed (app.router.PrefixAwareRouter._fulfill_next_pending_request)."""
    prompts = ["Hi there", "Hello", conversation_opening(100), conversation_opening(101)]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(URL + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            result = await response.json()
        assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
        assert {c["finish_reason"] for c in result["choices"]} == {"length"}
        assert result["usage"]["completion_tokens"] == 16
        async with session.post(URL + "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status == 200, await response.text()
            events = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finished = [c["index"] for e in events[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1, 2, 3]


def hit_rate(stats: list[dict]) -> float:
    """The cluster's prefix-cache hit rate: hit tokens over looked-up tokens, all replicas."""
    return sum(s["prefix_cache_hits"] for s in stats) / sum(s["prefix_cache_queries"] for s in stats)


def test_prefix_router_raises_the_hit_rate_and_still_spreads_load(cluster):
    """32 conversations x 3 turns: with ``prefix`` a conversation's turns meet their cached
    prefix; with ``pow2`` a turn lands on the replica that holds it about half the time
    (a coin flip per turn: with 48 conversations pow2 measured 0.31-0.47 against prefix's
    0.63; with 32, 0.42 against 0.63, and the test took 135 s instead of 156)."""
    results = {}
    for router in ("prefix", "pow2"):
        # pow2 also calls its engine replicas over Ray's actor calls instead of gRPC
        # (engine_transport): the suite serves real traffic through both transports
        transport = "grpc" if router == "prefix" else "ray"
        args = {**SMALL_KV, "request_router": router, "engine_transport": transport}
        cluster.deploy(load_config("serve_multi_replica.yaml", args=args), 2)
        replicas = asyncio.run(run_conversations(32, 3, concurrency=8))
        asyncio.run(check_completions_batches())
        shares = {r: replicas.count(r) / len(replicas) for r in set(replicas)}
        results[router] = (hit_rate(cluster.stats()), shares)
    print(results)
    (prefix_rate, prefix_shares), (pow2_rate, _) = results["prefix"], results["pow2"]
    # prefix: every later turn meets its conversation's cached prefix, 0.628 in every run so
    # far; pow2's coin flips gave 0.31-0.47, so the comparison is strict but not a ratio
    assert prefix_rate >= 0.6 and prefix_rate > pow2_rate, results
    assert len(prefix_shares) == 2 and max(prefix_shares.values()) <= 0.65, results


def _engine_replicas() -> dict:
    """Serve's engine replicas by state (``{"RUNNING": 1}``), empty while it lists none."""
    app = serve.status().applications.get("default")
    status = app.deployments.get("EngineServer") if app is not None else None
    return dict(status.replica_states) if status is not None else {}


def test_autoscaling_scales_out_under_a_burst_and_back_when_idle(cluster):
    cluster.deploy(load_config("serve_autoscaling.yaml", args={"enforce_eager": True}), 1)
    assert _engine_replicas() == {"RUNNING": 1}
    body = {"model": MODEL, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count to ten."}]}

    async def burst_until_two_replicas():
        statuses = []
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                statuses += [s for s, _, _ in await asyncio.gather(*(_post(session, body) for _ in range(12)))]
                if _engine_replicas().get("RUNNING") == 2:
                    # Both replicas serve: a last wave reaches the new one too.
                    statuses += [s for s, _, _ in await asyncio.gather(*(_post(session, body) for _ in range(12)))]
                    return statuses, True
        return statuses, False

    statuses, scaled_out = asyncio.run(burst_until_two_replicas())
    assert scaled_out, _engine_replicas()
    assert set(statuses) == {200}, statuses
    deadline = time.monotonic() + 120
    while _engine_replicas() != {"RUNNING": 1} and time.monotonic() < deadline:
        time.sleep(2)
    assert _engine_replicas() == {"RUNNING": 1}


def test_two_nodes_serve_and_losing_one_is_survived(cluster):
    """One engine replica per node; the worker node is killed under load: every client gets
    an answer or an OpenAI error within TIMEOUT_S, the service answers again from the head's
    replica within 60 s, and that replica ends with no KV block in use."""
    config = load_config("serve_multi_replica.yaml", args=SMALL_KV, engine={"max_replicas_per_node": 1},
                         ingress={"ray_actor_options": {"num_cpus": 0, "resources": {"node_a": 0.01}}})
    cluster.deploy(config, 2)
    assert {s["node_id"] for s in cluster.stats()} == {cluster.head_node_id, cluster.worker_node_id}

    async def client(session, i, stop_at, outcomes):
        while time.monotonic() < stop_at:
            body = {"model": MODEL, "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}
            status, answer, _ = await _post(session, body)
            outcomes.append((status, answer))

    async def main():
        outcomes = []
        async with aiohttp.ClientSession() as session:
            stop_at = time.monotonic() + 15
            clients = [asyncio.create_task(client(session, i, stop_at, outcomes)) for i in range(6)]
            await asyncio.sleep(4)
            await asyncio.to_thread(cluster.remove_worker)
            removed_at = time.monotonic()
            await asyncio.gather(*clients)
            while time.monotonic() - removed_at < 60:
                status, _, _ = await _post(session, {"model": MODEL, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
                if status == 200:
                    return outcomes, time.monotonic() - removed_at
                await asyncio.sleep(1)
            return outcomes, None

    outcomes, recovered_after = asyncio.run(main())
    for status, answer in outcomes:  # an answer, or OpenAI's error envelope
        assert status == 200 and answer["choices"] or set(answer["error"]) >= {"message", "type", "code"}, answer
    assert any(status == 200 for status, _ in outcomes)
    assert recovered_after is not None and recovered_after < 60
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = cluster.stats()
        if len(stats) == 1 and stats[0]["num_free_blocks"] == stats[0]["num_total_blocks"]:
            break
        time.sleep(1)
    assert len(stats) == 1 and stats[0]["node_id"] == cluster.head_node_id, stats
    assert stats[0]["num_free_blocks"] == stats[0]["num_total_blocks"], stats
