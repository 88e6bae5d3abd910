"""Property test of the KV cache manager with prefix caching: random steps, hits, forks, frees,
evictions and resets, checked after every rule against the test's own model of the cache.

The model keeps, for every block, what each slot holds: the token sequence (up to and including
that slot's position) whose K/V was written there. A step runs as the scheduler and runner do:
at most one admission (first, see below), then running requests' chunks, each allocated in
turn (a request that does not fit may preempt another, whose part of the step is dropped);
then the step's copy-on-write copies (every source read before any destination is written),
then every write, then ``cache_full_blocks``, then the events are sealed and fed to mirrors.

The admission comes first in its step (the scheduler admits after running requests; the
same-step hit that needs a copy is covered by
``test_a_copy_on_write_never_reads_a_block_this_step_has_yet_to_compute`` in test_scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from engine_worker.kv_cache.events import KVEventRecorder
from engine_worker.kv_cache.manager import KVCacheManager
from quire.block_hash import hash_block_tokens
from quire.kv_events import KVCacheMirror

ALPHABET = st.sampled_from([0, 1])  # few symbols, so prefixes repeat and hits happen
SALTS = st.sampled_from([None, None, "s"])
MOSTLY = st.sampled_from([True, True, True, False])
MAX_TOKENS = 24  # a sequence stops growing here, so the small pools still fit some

Slot = tuple[int, ...] | None


@dataclass
class Seq:
    tokens: list[int]
    salt: str | None
    num_computed: int = 0


@dataclass
class Planned:
    """One request's part of a step."""

    req_id: str
    first: int
    num_tokens: int
    copies: tuple[tuple[int, int], ...]


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.events = KVEventRecorder("cpu")
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                                 events=self.events)
        self.seqs: dict[str, Seq] = {}
        self.contents: dict[int, list[Slot]] = {i: [None] * block_size
                                                for i in range(num_blocks)}
        self.hash_prefix: dict[int, tuple[int, ...]] = {}  # hash -> the tokens it names
        self.next_id = 0
        self.mirror = KVCacheMirror.from_snapshot(self.events.snapshot(self.kv.pool.cached))
        self.late_mirror: KVCacheMirror | None = None
        self.num_hits = self.num_copies = self.num_evictions = 0

    # ------------------------------------------------------------------------ helpers
    def hashes(self, seq: Seq) -> list[int]:
        hashes = hash_block_tokens(seq.tokens, self.bs, cache_salt=seq.salt)
        for i, block_hash in enumerate(hashes):
            prefix = tuple(seq.tokens[:(i + 1) * self.bs])
            assert self.hash_prefix.setdefault(block_hash, prefix) == prefix
        return hashes

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def live_ids(self) -> list[str]:
        return sorted(self.seqs)

    def seal(self) -> None:
        self.events.seal()
        for batch in self.events.take():
            self.num_evictions += sum(type(e).__name__ == "BlockRemoved" for e in batch.events)
            assert self.mirror.apply(batch)
            if self.late_mirror is not None:
                assert self.late_mirror.apply(batch)

    def check_context(self, req_id: str, num_tokens: int) -> None:
        seq, table = self.seqs[req_id], self.kv.get_block_ids(req_id)
        for pos in range(num_tokens):
            held = self.contents[table[pos // self.bs]][pos % self.bs]
            assert held == tuple(seq.tokens[:pos + 1]), (req_id, pos, held)

    # ------------------------------------------------------------------------- rules
    @rule(data=st.data(), num_steps=st.integers(1, 6))
    def steps(self, data, num_steps: int) -> None:
        """A few engine steps in a row; a request whose tokens are all computed may first get
        a new token, as sampling would give it."""
        for _ in range(num_steps):
            for req_id in self.live_ids():
                seq = self.seqs[req_id]
                if (seq.num_computed == len(seq.tokens) < MAX_TOKENS
                        and data.draw(MOSTLY, label="sampled")):
                    seq.tokens.append(data.draw(ALPHABET, label="token"))
            self.step(data)

    def step(self, data) -> None:
        planned: list[Planned] = []
        if data.draw(MOSTLY, label="admit"):
            self._admit(data, planned)
        candidates = [r for r in self.live_ids()
                      if self.seqs[r].num_computed < len(self.seqs[r].tokens)
                      and r not in {p.req_id for p in planned}]
        order = data.draw(st.permutations(candidates), label="order")
        for req_id in order[:data.draw(st.integers(0, len(order)), label="num_running")]:
            if req_id not in self.seqs:
                continue  # preempted earlier in this step
            seq = self.seqs[req_id]
            num_new = data.draw(st.integers(1, len(seq.tokens) - seq.num_computed), label="n")
            before = self._observable()
            allocation = self.kv.allocate_slots(req_id, seq.num_computed, num_new,
                                                block_hashes=self.hashes(seq))
            if allocation is None:
                assert self._observable() == before, "a failed allocation changed something"
            if allocation is None and data.draw(st.booleans(), label="preempt"):
                victims = [r for r in self.live_ids() if r != req_id]
                if victims:
                    victim = data.draw(st.sampled_from(victims), label="victim")
                    self.kv.free(victim)
                    del self.seqs[victim]
                    planned = [p for p in planned if p.req_id != victim]
                    allocation = self.kv.allocate_slots(req_id, seq.num_computed, num_new,
                                                        block_hashes=self.hashes(seq))
            if allocation is not None:
                planned.append(Planned(req_id, seq.num_computed, num_new, allocation.copies))
        self._run(planned)

    def _admit(self, data, planned: list[Planned]) -> None:
        source = self.live_ids()
        if source and data.draw(MOSTLY, label="reuse tokens"):
            # a prefix of a live request's tokens, plus a random tail
            donor = self.seqs[data.draw(st.sampled_from(source), label="donor")]
            head = donor.tokens[:data.draw(st.integers(0, len(donor.tokens)), label="head")]
            salt = donor.salt
        else:
            head, salt = [], data.draw(SALTS, label="salt")
        tail = data.draw(st.lists(ALPHABET, min_size=0 if head else 1, max_size=8), label="tail")
        seq = Seq(head + tail, salt)
        hashes = self.hashes(seq)
        prefix = self.kv.find_cached_prefix(hashes, len(seq.tokens))
        assert prefix.num_tokens <= len(seq.tokens) - 1
        assert prefix.num_tokens <= len(prefix.blocks) * self.bs
        num_new = data.draw(st.integers(1, len(seq.tokens) - prefix.num_tokens), label="chunk")
        req_id = self.new_id()
        before = self._observable()
        allocation = self.kv.allocate_slots(req_id, prefix.num_tokens, num_new, prefix, hashes)
        if allocation is None:
            assert self._observable() == before, "a failed allocation changed something"
            return
        self.num_hits += prefix.num_tokens > 0
        seq.num_computed = prefix.num_tokens
        self.seqs[req_id] = seq
        planned.append(Planned(req_id, prefix.num_tokens, num_new, allocation.copies))

    def _run(self, planned: list[Planned]) -> None:
        copies = [c for p in planned for c in p.copies]
        self.num_copies += len(copies)
        sources = [list(self.contents[src]) for src, _ in copies]
        for (_, dst), content in zip(copies, sources):
            self.contents[dst] = content
        for p in planned:  # what the step reads before its own writes: hits and copies
            self.check_context(p.req_id, p.first)
        pool = self.kv.pool
        for p in planned:
            seq, table = self.seqs[p.req_id], self.kv.get_block_ids(p.req_id)
            for pos in range(p.first, p.first + p.num_tokens):
                block = pool.blocks[table[pos // self.bs]]
                written = tuple(seq.tokens[:pos + 1])
                # a write goes into a private block (no admission shares a block another
                # request is writing: admissions come first), and into a cached one only as its
                # hash says
                assert block.ref_cnt == 1, f"{p.req_id} writes into shared {block}"
                if block.block_hash is not None:
                    named = self.hash_prefix[block.block_hash]
                    assert named[:pos + 1] == written, f"{p.req_id} overwrites cached {block}"
                self.contents[block.block_id][pos % self.bs] = written
        for p in planned:
            seq = self.seqs[p.req_id]
            seq.num_computed = p.first + p.num_tokens
            self.check_context(p.req_id, seq.num_computed)
            self.kv.cache_full_blocks(p.req_id, self.hashes(seq), seq.num_computed, seq.tokens,
                                      seq.salt)
        self.seal()

    @precondition(lambda self: any(s.num_computed == len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def sample(self, data) -> None:
        """A request whose tokens are all computed gets new ones (sampled, or a next turn)."""
        ready = [r for r in self.live_ids()
                 if self.seqs[r].num_computed == len(self.seqs[r].tokens)]
        seq = self.seqs[data.draw(st.sampled_from(ready), label="req")]
        seq.tokens += data.draw(st.lists(ALPHABET, min_size=1, max_size=3), label="tokens")

    @precondition(lambda self: any(s.num_computed == len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data) -> None:
        ready = [r for r in self.live_ids()
                 if self.seqs[r].num_computed == len(self.seqs[r].tokens)]
        parent_id = data.draw(st.sampled_from(ready), label="parent")
        parent, child_id = self.seqs[parent_id], self.new_id()
        table = self.kv.get_block_ids(parent_id)
        refs = [self.kv.pool.blocks[b].ref_cnt for b in table]
        self.kv.fork(parent_id, child_id)
        assert self.kv.get_block_ids(child_id) == table
        assert [self.kv.pool.blocks[b].ref_cnt for b in table] == [r + 1 for r in refs]
        self.seqs[child_id] = Seq(list(parent.tokens), parent.salt, parent.num_computed)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data) -> None:
        req_id = data.draw(st.sampled_from(self.live_ids()), label="req")
        table = self.kv.get_block_ids(req_id)
        free_before = self.kv.pool.free_queue.block_ids()
        self.kv.free(req_id)
        del self.seqs[req_id]
        released = [b for b in reversed(table) if self.kv.pool.blocks[b].ref_cnt == 0]
        # blocks whose last holder left join the tail, the request's tail block first
        assert self.kv.pool.free_queue.block_ids() == free_before + list(dict.fromkeys(released))
        self.seal()

    @rule(data=st.data())
    def hit(self, data) -> None:
        """A read-only lookup: whatever it finds holds exactly the queried tokens."""
        tokens = data.draw(st.lists(ALPHABET, min_size=1, max_size=12), label="tokens")
        salt = data.draw(SALTS, label="salt")
        probe = Seq(tokens, salt)
        prefix = self.kv.find_cached_prefix(self.hashes(probe), len(tokens))
        for i, block in enumerate(prefix.blocks):
            for j in range(self.bs):
                assert self.contents[block.block_id][j] == tuple(tokens[:i * self.bs + j + 1])

    @rule()
    def reset(self) -> None:
        idle = not self.seqs
        assert self.kv.reset_prefix_cache() == idle
        if idle:
            assert self.kv.pool.cached == {}
        self.seal()

    @rule()
    def take_snapshot(self) -> None:
        self.late_mirror = KVCacheMirror.from_snapshot(self.events.snapshot(self.kv.pool.cached))

    def _observable(self):
        pool = self.kv.pool
        return (pool.free_queue.block_ids(), [b.ref_cnt for b in pool.blocks],
                {h: b.block_id for h, b in pool.cached.items()},
                {r: self.kv.get_block_ids(r) for r in self.seqs})

    # --------------------------------------------------------------------- invariants
    @invariant()
    def blocks_are_accounted_for(self) -> None:
        pool = self.kv.pool
        free_ids = pool.free_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        tables = [self.kv.get_block_ids(r) for r in self.seqs]
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == sum(t.count(block.block_id) for t in tables)
            in_queue = block.block_id in free_ids
            assert in_queue == (block.ref_cnt == 0), f"{block} free and referenced"
        in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + in_use == pool.num_blocks

    @invariant()
    def cached_hashes_name_their_contents(self) -> None:
        pool = self.kv.pool
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
            prefix = self.hash_prefix[block_hash]
            start = len(prefix) - self.bs
            assert self.contents[block.block_id] == [prefix[:start + j + 1]
                                                     for j in range(self.bs)]
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached[block.block_hash] is block
        assert self.kv.stats().num_cached_blocks == len(pool.cached)

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for req_id, seq in self.seqs.items():
            table = self.kv.get_block_ids(req_id)
            assert len(table) * self.bs >= seq.num_computed
            self.check_context(req_id, seq.num_computed)

    @invariant()
    def mirrors_match_the_cached_set(self) -> None:
        assert self.mirror.block_hashes == set(self.kv.pool.cached)
        if self.late_mirror is not None:
            assert self.late_mirror.block_hashes == set(self.kv.pool.cached)

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            event(f"hits: {self.num_hits > 0}")
            event(f"copies: {self.num_copies > 0}")
            event(f"evictions: {self.num_evictions > 0}")
            for req_id in self.live_ids():
                self.kv.free(req_id)
            assert self.kv.stats().num_free_blocks == self.kv.stats().num_blocks


PrefixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50,
                                                deadline=None)
test_prefix_cache_manager_properties = PrefixCacheMachine.TestCase
