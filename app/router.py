"""Prefix-aware routing of requests to engine replicas, on Ray Serve's request-router API.

Each engine replica has its own prefix cache (``engine.block_manager``): a request whose
prompt starts like one a replica served before reuses that replica's KV blocks, and only that
replica's. ``PrefixAwareRouter`` sends a request to the replica most likely to hold its
prefix, from what it routed there: per replica, the chained hashes of the block-aligned
chunks of the prompts it sent (``PrefixIndex``, least recently used entries age out).

The decision, per request (SGLang's cache-aware router and Ray Serve LLM's
``PrefixCacheAffinityRouter`` make the same trade-off between hits and balance):

1. load imbalanced (the spread of the replicas' ongoing requests is over
   ``imbalanced_threshold``), or no replica below ``replica_capacity``: power of two
   choices, Serve's default;
2. else, of the replicas below ``replica_capacity`` (the requests an engine replica holds
   before it refuses one: a full replica is passed over, not sent a request it would refuse
   while another has room), those with the longest matching prefix (at least one chunk);
3. else (a new prefix) one of the least loaded of them, by rendezvous hashing of the prefix's
   first chunk with each replica's id: a burst of new prefixes spreads over equally loaded
   replicas, while the prompts of one new prefix go to the same one.

Serve then takes the least loaded of the chosen replicas that has room, and falls back to a
power-of-two pair of the others below capacity when none has.

The router runs inside every ``DeploymentHandle`` of the engine deployment (each ingress
replica has its own), so each ingress replica's index covers the requests it routed: with
several ingress replicas the match is approximate, never wrong (a miss costs a prefill).
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Hashable, Iterable, Sequence
from itertools import accumulate

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.block_manager import hash_block_tokens, root_hash

# Approximate bytes of text per token of a byte-level BPE tokenizer on English text (about 4
# for GPT-2's and SmolLM2's): text chunks of block_size * this many bytes stand for one KV
# block each.
BYTES_PER_TOKEN = 4
# Chunks hashed per request: a match longer than this adds nothing to the choice of replica.
MAX_PREFIX_CHUNKS = 256
# Seconds after its hand-over that a request may still be on its way to its replica, not yet
# in the replica's own count (it is sent as its caller wakes, in milliseconds).
RECENT_S = 1.0


def prefix_hashes(prompt: dict, cache_salt: str | None, block_size: int,
                  max_chunks: int = MAX_PREFIX_CHUNKS) -> list[bytes]:
    """Chained hashes of a prompt's full block-aligned chunks, first chunk first.

    A chunk is ``block_size`` token ids (``prompt_token_ids``) or ``block_size *
    BYTES_PER_TOKEN`` bytes of UTF-8 text (``prompt``, or ``messages`` in a canonical JSON
    form, one message after the other, so that a conversation's next turn starts with the
    same bytes as the turn before: the same prefix property as the chat template's text,
    without a tokenizer in the ingress). Each hash covers its chunk and every chunk before
    it, and ``cache_salt`` enters the first: for token ids they are the engine's own block
    hashes (``engine.block_manager.hash_block_tokens``); equal hashes mean equal prefixes
    (sha256, collision resistant).

    Args:
        prompt: ``EngineServer.generate``'s prompt: ``{"prompt": str}``,
            ``{"prompt_token_ids": list[int]}`` or ``{"messages": [...], ...}``.
        cache_salt: the request's salt, or ``None``.
        block_size: tokens per KV block.
        max_chunks: at most this many hashes.

    Returns:
        Up to ``max_chunks`` 32-byte digests; empty for a prompt shorter than one chunk.
    """
    if "prompt_token_ids" in prompt:  # the engine's own block hashes
        ids = prompt["prompt_token_ids"]
        blocks = [ids[start:start + block_size]
                  for start in range(0, min(len(ids) // block_size, max_chunks) * block_size, block_size)]
        return list(accumulate(blocks, hash_block_tokens, initial=root_hash(cache_salt)))[1:]
    if "messages" in prompt:
        kind = b"chat"
        data = b"".join(json.dumps(m, sort_keys=True, ensure_ascii=False).encode() + b"\n"
                        for m in prompt["messages"])
    else:
        kind = b"text"
        data = str(prompt.get("prompt", "")).encode()
    size = block_size * BYTES_PER_TOKEN
    chunks = [data[start:start + size] for start in range(0, min(len(data) // size, max_chunks) * size, size)]
    root = hashlib.sha256(kind + b"\0" + root_hash(cache_salt)).digest()
    return list(accumulate(chunks, lambda parent, chunk: hashlib.sha256(parent + chunk).digest(), initial=root))[1:]


class PrefixIndex:
    """Which prefix hashes were routed to which replica, at most ``max_entries`` (replica,
    hash) pairs: the least recently routed pair goes first.

    Args:
        max_entries: the bound on entries (each about 220 bytes of Python objects).

    Raises:
        ValueError: ``max_entries`` < 1.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1; got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[Hashable, bytes], None] = OrderedDict()
        self._sizes: Counter[Hashable] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def size(self, replica: Hashable) -> int:
        """Entries of ``replica``."""
        return self._sizes[replica]

    def insert(self, replica: Hashable, hashes: Sequence[bytes]) -> None:
        """Record that ``replica`` was sent a prompt with these prefix hashes (now the most
        recent); evicts the oldest entries beyond ``max_entries``."""
        for h in hashes:
            key = (replica, h)
            if key in self._entries:
                self._entries.move_to_end(key)
            else:
                self._entries[key] = None
                self._sizes[replica] += 1
        while len(self._entries) > self.max_entries:
            (oldest, _), _ = self._entries.popitem(last=False)
            self._sizes[oldest] -= 1

    def match(self, hashes: Sequence[bytes], replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """For each replica, how many of ``hashes`` (from the first) it was sent."""
        matches = {}
        for replica in replicas:
            n = 0
            while n < len(hashes) and (replica, hashes[n]) in self._entries:
                n += 1
            matches[replica] = n
        return matches

    def remove(self, replica: Hashable) -> None:
        """Forget a replica (gone: its cache went with it)."""
        for key in [key for key in self._entries if key[0] == replica]:
            del self._entries[key]
        del self._sizes[replica]


def _rendezvous_weight(prefix_hash: bytes, replica_id: ReplicaID) -> bytes:
    """Highest-random-weight (rendezvous) hashing, Thaler and Ravishankar 1998: each prefix
    ranks the replicas in an order of its own, the same on every call."""
    return hashlib.sha256(prefix_hash + replica_id.unique_id.encode()).digest()


class PrefixAwareRouter(RequestRouter):
    """Ray Serve request router for the engine deployment (``request_router: prefix``):
    the longest prefix match while load is balanced, power of two choices when it is not.

    Serve builds it with the deployment's ``request_router_config`` and passes
    ``request_router_kwargs`` to ``initialize_state``.
    """

    def initialize_state(self, block_size: int = 16, imbalanced_threshold: int = 16,
                         replica_capacity: int = 768, max_entries: int = 200_000) -> None:
        """Args:
            block_size: the engine's tokens per KV block (``EngineConfig.block_size``).
            imbalanced_threshold: ongoing requests between the most and the least loaded
                replica beyond which the router balances load instead of matching prefixes.
            replica_capacity: ongoing requests at which an engine replica is full
                (``AppConfig.engine_capacity``: it refuses more with 503 ``overloaded``).
            max_entries: ``PrefixIndex``'s bound: (replica, chunk hash) pairs remembered.
        """
        self.block_size = block_size
        self.imbalanced_threshold = imbalanced_threshold
        self.replica_capacity = replica_capacity
        self.index = PrefixIndex(max_entries)
        # per replica: requests this router handed to it that have not finished, and when
        # each of the last second's was handed over
        self._in_flight: Counter[ReplicaID] = Counter()
        self._handed: defaultdict[ReplicaID, deque[float]] = defaultdict(deque)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas, most preferred first (Serve takes the least loaded replica with
        room in the first rank that has one)."""
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        hashes = self._hashes(pending_request)
        if not hashes or len(candidate_replicas) < 2:
            return [pair]
        loads = await self._queue_lens(candidate_replicas)
        room = {i: load for i, load in loads.items() if load < self.replica_capacity}
        if not room or max(loads.values()) - min(loads.values()) > self.imbalanced_threshold:
            return [pair]
        by_id = {r.replica_id: r for r in candidate_replicas}
        matches = self.index.match(hashes, room)
        longest = max(matches.values())
        if longest > 0:
            preferred = [by_id[i] for i, n in matches.items() if n == longest]
        else:  # a new prefix: the least loaded, and of those the prefix's own (rendezvous)
            least = min(room.values())
            tied = [i for i, load in room.items() if load == least]
            preferred = [by_id[max(tied, key=lambda i: _rendezvous_weight(hashes[0], i))]]
        rest = [by_id[i] for i in room if by_id[i] not in preferred]
        return [preferred, random.sample(rest, min(2, len(rest)))] if rest else [preferred]

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: RequestMetadata | None = None) -> None:
        """Give ``replica`` to the pending request whose ``metadata`` this is (the request its
        routing task chose for), found by identity.

        Serve's ``RequestRouter`` finds it by ``internal_request_id``, which every call made
        while serving one request shares (Serve passes the caller's own id on to its calls):
        of a completions batch's engine calls only the first was found, and the others'
        routing tasks chose replicas for ever, probing their queue lengths, until the ingress
        failed its health checks (Ray 2.60). ``FIFOMixin`` would give the replica to the
        oldest pending request instead, and with it this request's prefix match."""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                self._remove_pending_request_from_indices(pending)
                self._in_flight[replica.replica_id] += 1
                self._recent_hand_overs(replica.replica_id).append(time.monotonic())
                return

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        """Serve's hook as a request sent to the replica finishes, however it ends."""
        super().decrement_queue_len_cache(replica_id)
        if self._in_flight[replica_id] > 0:
            self._in_flight[replica_id] -= 1

    def on_new_queue_len_info(self, replica_id: ReplicaID, num_ongoing_requests: int) -> None:
        """Serve's hook with the replica's own count: this router's count is cut to it and
        the requests handed over within ``RECENT_S`` (still on their way), so that one that
        never reached the replica (refused by Serve and retried, or its caller cancelled
        before the send) does not count for ever."""
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self._in_flight[replica_id] = min(self._in_flight[replica_id],
                                          num_ongoing_requests + len(self._recent_hand_overs(replica_id)))

    def _recent_hand_overs(self, replica_id: ReplicaID) -> deque[float]:
        """When the last ``RECENT_S`` seconds' hand-overs to the replica were (older ones dropped)."""
        handed = self._handed[replica_id]
        while handed and handed[0] < time.monotonic() - RECENT_S:
            handed.popleft()
        return handed

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Serve's hook once a request is sent: remember its prefix on that replica."""
        hashes = self._hashes(pending_request)
        if hashes:
            self.index.insert(replica_id, hashes)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.index.remove(replica_id)
            self._in_flight.pop(replica_id, None)
            self._handed.pop(replica_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)
        self._in_flight.pop(replica_id, None)

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The request's prefix hashes; none for calls other than ``generate(prompt,
        params, ...)`` (``/ready``'s one-token probe is one too: it has no full chunk)."""
        args = pending_request.args if pending_request is not None else ()
        if len(args) < 2 or not isinstance(args[0], dict):
            return []
        return prefix_hashes(args[0], getattr(args[1], "cache_salt", None), self.block_size)

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per replica: Serve's cached queue lengths, probed where missing
        (a replica that does not answer is left out), or where more, the requests this
        router handed to it that have not finished. Serve's cache counts a request once it is
        sent, and a replica's reply sets it to what that replica had then, but routing tasks
        run between a hand-over and the send: in a burst every choice saw the loads from
        before it (a trial: 12 requests at once went to a replica that held 8, and 4 were
        refused beside an idle replica)."""
        loads, unknown = {}, []
        cache = self._replica_queue_len_cache
        for r in replicas:
            queue_len = cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if queue_len is None:
                unknown.append(r)
            else:
                loads[r.replica_id] = queue_len
        for r, queue_len in await self._probe_queue_lens(unknown, 0) if unknown else ():
            if queue_len is not None:
                loads[r.replica_id] = queue_len
        return {replica_id: max(load, self._in_flight[replica_id]) for replica_id, load in loads.items()}
