"""The prefix-aware request router (app.router): its hashes, its bounded index and its
choices, on Serve's RequestRouter with stand-in replicas (no Ray cluster); and the setting
that selects it. Over HTTP with two replicas: tests/e2e/test_cluster.py."""
import asyncio

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from app import AppConfig, request_router_config
from app.router import BYTES_PER_TOKEN, PrefixAwareRouter, PrefixIndex, prefix_hashes
from engine.sampling_params import SamplingParams

DEPLOYMENT = DeploymentID(name="EngineServer", app_name="default")


def test_token_id_prefix_hashes_cover_full_blocks_and_chain():
    ids = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    hashes = prefix_hashes({"prompt_token_ids": ids}, None, 16)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert prefix_hashes({"prompt_token_ids": ids[:32]}, None, 16) == hashes[:2]
    assert prefix_hashes({"prompt_token_ids": ids[:15]}, None, 16) == []
    # A different first block changes every later hash (chained), as does a salt.
    other = prefix_hashes({"prompt_token_ids": [7] + ids[1:]}, None, 16)
    assert not set(other) & set(hashes)
    assert not set(prefix_hashes({"prompt_token_ids": ids}, "tenant-a", 16)) & set(hashes)
    assert prefix_hashes({"prompt_token_ids": ids}, None, 16, max_chunks=2) == hashes[:2]


def test_text_and_chat_prefix_hashes():
    chunk = 16 * BYTES_PER_TOKEN
    text = "x" * (2 * chunk + 5)
    assert len(prefix_hashes({"prompt": text}, None, 16)) == 2
    assert prefix_hashes({"prompt": text[:chunk]}, None, 16) == prefix_hashes({"prompt": text}, None, 16)[:1]
    # A conversation's next turn starts with the hashes of the turn before.
    turn1 = [{"role": "system", "content": "You answer about document 7. " * 10},
             {"role": "user", "content": "What is it about?"}]
    turn2 = turn1 + [{"role": "assistant", "content": "A cat."}, {"role": "user", "content": "Why?"}]
    first = prefix_hashes({"messages": turn1, "add_generation_prompt": True}, None, 16)
    second = prefix_hashes({"messages": turn2, "add_generation_prompt": True}, None, 16)
    assert len(first) >= 4 and second[:len(first)] == first
    # Text and chat prompts of the same bytes do not share hashes; nor do token ids.
    assert not set(prefix_hashes({"prompt": "a" * chunk}, None, 16)) & set(
        prefix_hashes({"messages": [{"role": "user", "content": "a" * chunk}]}, None, 16))


def test_prefix_index_matches_from_the_first_hash_and_stays_bounded():
    index = PrefixIndex(max_entries=5)
    index.insert("r1", [b"a", b"b", b"c"])
    index.insert("r2", [b"a"])
    assert index.match([b"a", b"b", b"c", b"d"], ["r1", "r2", "r3"]) == {"r1": 3, "r2": 1, "r3": 0}
    assert index.match([b"a", b"z", b"c"], ["r1"]) == {"r1": 1}  # a match ends at the first miss
    index.insert("r3", [b"x", b"y"])  # 6 entries: the oldest, (r1, a), ages out
    assert len(index) == 5 and (index.size("r1"), index.size("r2"), index.size("r3")) == (2, 1, 2)
    assert index.match([b"a", b"b"], ["r1", "r2"]) == {"r1": 0, "r2": 1}
    for n in range(1000):
        index.insert("r1", [n.to_bytes(4, "big")])
    assert len(index) == 5 and index.size("r1") == 5 and index.size("r3") == 0
    index.remove("r1")
    assert len(index) == 0 and index.size("r1") == 0
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndex(0)


class FakeReplica:
    """What the router reads of Serve's ``RunningReplica``."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 100
        self.queue_len = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


# How 300 new one-block prefixes fall on three equally loaded replicas by rendezvous hashing
# (sha256: the same on every machine)
RENDEZVOUS_300 = {"r1": 103, "r2": 89, "r3": 108}


def _request(prompt: dict, salt: str | None = None) -> PendingRequest:
    return PendingRequest(args=[prompt, SamplingParams(cache_salt=salt)], kwargs={},
                          metadata=RequestMetadata(request_id="r", internal_request_id="r"))


async def _router(replicas, **kwargs) -> PrefixAwareRouter:
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                               use_replica_queue_len_cache=True)
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)
    await asyncio.sleep(0)
    return router


def _set_loads(router, replicas, loads) -> None:
    for replica, load in zip(replicas, loads, strict=True):
        replica.queue_len = load
        router.replica_queue_len_cache.update(replica.replica_id, load)


def _names(ranks) -> list[list[str]]:
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def test_router_prefers_the_longest_match_while_balanced_else_least_load():
    async def main():
        replicas = [FakeReplica("r1"), FakeReplica("r2"), FakeReplica("r3")]
        router = await _router(replicas, block_size=16, imbalanced_threshold=4)
        ids = list(range(64))
        first = _request({"prompt_token_ids": ids[:40]})
        # A new prefix: the least loaded replica first, then a pair of the others.
        _set_loads(router, replicas, [2, 0, 1])
        ranks = await router.choose_replicas(replicas, first)
        assert _names(ranks)[0] == ["r2"] and len(ranks[1]) == 2
        router.on_request_routed(first, replicas[1].replica_id, None)
        # The same prefix, longer: r2 holds it, though now the most loaded (within 4).
        _set_loads(router, replicas, [0, 3, 1])
        longer = _request({"prompt_token_ids": ids})
        assert _names(await router.choose_replicas(replicas, longer))[0] == ["r2"]
        # Another salt is another prefix: least load again.
        salted = _request({"prompt_token_ids": ids}, salt="tenant-b")
        assert _names(await router.choose_replicas(replicas, salted))[0] == ["r1"]
        # Of equal loads, the prefix's own replica (rendezvous hashing): the same one every
        # time, whatever the replicas routed before (a replica with less history won every
        # tie, so a burst of new prefixes all went to one replica: 36 of 36 in a trial).
        _set_loads(router, replicas, [0, 0, 0])
        (own,) = _names(await router.choose_replicas(replicas, salted))[0]
        for _ in range(5):
            assert _names(await router.choose_replicas(replicas, salted))[0] == [own]
        chosen = []
        for k in range(300):
            chosen += _names(await router.choose_replicas(replicas, _request({"prompt_token_ids": [k] * 16})))[0]
        assert {name: chosen.count(name) for name in ("r1", "r2", "r3")} == RENDEZVOUS_300
        # Imbalanced (spread 5 > 4): power of two choices, one rank of two random replicas.
        _set_loads(router, replicas, [0, 5, 1])
        ranks = await router.choose_replicas(replicas, longer)
        assert len(ranks) == 1 and len(ranks[0]) == 2
        # A prompt without one full block: power of two choices too.
        assert len(await router.choose_replicas(replicas, _request({"prompt_token_ids": ids[:8]}))) == 1
        # A replica that goes away takes its entries with it.
        router.update_replicas([replicas[0], replicas[2]])
        assert len(router.index) == 0

    asyncio.run(main())


def test_router_passes_over_a_full_replica_while_another_has_room():
    """A replica at ``replica_capacity`` refuses more (503 overloaded): the prefix that it
    holds goes to one with room instead (a trial: 4 of 12 refused beside an idle replica)."""
    async def main():
        replicas = [FakeReplica("r1"), FakeReplica("r2")]
        router = await _router(replicas, block_size=16, replica_capacity=8)
        held = _request({"prompt_token_ids": list(range(32))})
        router.on_request_routed(held, replicas[0].replica_id, None)
        _set_loads(router, replicas, [7, 0])
        assert _names(await router.choose_replicas(replicas, held)) == [["r1"], ["r2"]]
        _set_loads(router, replicas, [8, 0])  # full; within the imbalance threshold (16)
        assert _names(await router.choose_replicas(replicas, held)) == [["r2"]]
        _set_loads(router, replicas, [8, 8])  # both full: Serve's power of two choices
        assert _names(await router.choose_replicas(replicas, held)) == [["r1", "r2"]]

    asyncio.run(main())


def test_a_burst_counts_the_requests_it_handed_over_before_they_are_sent():
    """Routing tasks run between a hand-over and the send that updates Serve's queue-length
    cache: the router counts what it handed over itself, so a burst for one prefix fills its
    replica to capacity and no further (a trial: 12 at once went to a replica of 8)."""
    async def main():
        replicas = [FakeReplica("r1"), FakeReplica("r2")]
        router = await _router(replicas, block_size=16, replica_capacity=4)
        prompt = {"prompt_token_ids": list(range(32))}
        router.on_request_routed(_request(prompt), replicas[0].replica_id, None)
        _set_loads(router, replicas, [0, 0])  # stays so: nothing is sent here
        burst = [_request(prompt) for _ in range(6)]
        routing = [asyncio.ensure_future(router._choose_replica_for_request(r)) for r in burst]
        done, _ = await asyncio.wait(routing, timeout=5)
        assert len(done) == 6
        chosen = [task.result().replica_id.unique_id for task in routing]
        assert sorted(chosen) == ["r1"] * 4 + ["r2"] * 2, chosen
        for _ in range(4):  # they finish: r1 has room again
            router.decrement_queue_len_cache(replicas[0].replica_id)
        assert _names(await router.choose_replicas(replicas, _request(prompt)))[0] == ["r1"]
        # A replica's own count caps what the router counts beyond the last second's hand-overs
        router._in_flight[replicas[1].replica_id] = 9
        router._handed[replicas[1].replica_id].clear()
        router.on_new_queue_len_info(replicas[1].replica_id, 1)
        assert router._in_flight[replicas[1].replica_id] == 1

    asyncio.run(main())


def test_router_probes_replicas_missing_from_the_queue_length_cache():
    async def main():
        replicas = [FakeReplica("r1"), FakeReplica("r2")]
        router = await _router(replicas)
        replicas[0].queue_len, replicas[1].queue_len = 7, 2
        for r in replicas:
            router.replica_queue_len_cache.invalidate_key(r.replica_id)
        ranks = await router.choose_replicas(replicas, _request({"prompt": "y" * 200}))
        assert _names(ranks) == [["r2"], ["r1"]]

    asyncio.run(main())


def test_calls_sharing_a_request_id_are_each_routed_to_their_own_choice():
    """A completions batch's engine calls share Serve's internal request id (the ingress
    request's). Serve's RequestRouter found the pending request to give a replica to by that
    id, so only the first was routed and the others waited for ever; each is now routed, to
    the replica its prefix chose."""
    async def main():
        replicas = [FakeReplica("r1"), FakeReplica("r2")]
        router = await _router(replicas, block_size=16)
        _set_loads(router, replicas, [0, 0])
        on_r1, on_r2 = {"prompt_token_ids": list(range(64))}, {"prompt_token_ids": list(range(100, 164))}
        router.on_request_routed(_request(on_r1), replicas[0].replica_id, None)
        router.on_request_routed(_request(on_r2), replicas[1].replica_id, None)
        batch = [_request(p) for p in (on_r2, {"prompt": "Hi there"}, on_r1, {"prompt": "Hello"})]
        assert len({r.metadata.internal_request_id for r in batch}) == 1
        routing = [asyncio.ensure_future(router._choose_replica_for_request(r)) for r in batch]
        done, pending = await asyncio.wait(routing, timeout=5)
        for task in pending:
            task.cancel()
        assert len(done) == 4, f"{len(pending)} of 4 calls never routed"
        chosen = [task.result().replica_id.unique_id for task in routing]
        assert (chosen[0], chosen[2]) == ("r2", "r1")

    asyncio.run(main())


def test_request_router_setting():
    assert AppConfig.load({}).resolved_request_router == "pow2"
    assert AppConfig.load({"num_engine_replicas": 2}).resolved_request_router == "prefix"
    two = AppConfig.load({"num_engine_replicas": 2, "request_router": "pow2"})
    assert request_router_config(two).is_default_request_router()
    prefix = request_router_config(AppConfig.load({"request_router": "prefix", "block_size": 32,
                                                   "router_imbalanced_threshold": 3, "max_num_seqs": 16,
                                                   "max_waiting_requests": 8}))
    assert prefix.request_router_class == "app.router.PrefixAwareRouter"
    # a replica holds max_num_seqs running and max_waiting_requests waiting
    assert prefix.request_router_kwargs == {"block_size": 32, "imbalanced_threshold": 3, "replica_capacity": 24}
    with pytest.raises(ValidationError, match="request_router"):
        AppConfig.load({"request_router": "round_robin"})
