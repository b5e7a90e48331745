"""The KV tier (DESIGN.md §2, "KV tier"; issue 57): the stage's store in host memory and on disk,
a claim's lanes filed there and loaded back on a real engine, and the coordinator's choice of
lane, entry and eviction. Through `mesh serve`: tests/test_kv_tier_served.py."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from mesh.cli.kv_tier_args import tier_size
from mesh.serving.kv_index import BLOCK, TierIndex, key_of
from mesh.serving.prefix_cache import EVICT_MIN, RESTORE_MIN, PrefixCache, matched
from stage.engine import Step
from stage.kv_tier import Kept, KvTier, Shelf
from stage.lane_tier import Begin, LaneTier
from stage.llama_engine import EngineConfig, LlamaRangeEngine

SHELF = Shelf("range-a", "coordinator-1")


def _kept(n: int, fill: int = 1) -> Kept:
    return Kept(n, bytes([fill]) * n)


def test_host_memory_spills_to_disk_then_drops_the_least_recently_used(tmp_path: Path):
    tier = KvTier(ram=250, disk=250, root=tmp_path)
    for key in "abc":
        tier.put(SHELF, key, _kept(100))
    assert [k for _, _, k in tier.in_ram] == ["b", "c"]
    assert [k for _, _, k in tier.on_disk] == ["a"]
    tier.put(SHELF, "d", _kept(100))
    tier.put(SHELF, "e", _kept(100))  # b then c go to disk; a, the oldest there, is dropped
    assert tier.take(SHELF, "a") is None
    assert tier.take(SHELF, "b") == _kept(100)  # from disk
    assert tier.take(SHELF, "b") is None  # taken: it went back into a lane
    assert (tier.stats.hits_disk, tier.stats.misses, tier.stats.dropped) == (1, 2, 1)
    assert tier.take(Shelf("range-a", "coordinator-2"), "d") is None  # another coordinator's shelf


def test_a_restarted_stage_finds_its_entries_and_a_torn_or_flipped_file_is_never_served(tmp_path: Path):
    tier = KvTier(ram=1 << 20, disk=1 << 20, root=tmp_path)
    for key in ("whole", "flipped", "torn"):
        tier.put(SHELF, key, _kept(1000, fill=7))
    tier.flush()  # the stage stops
    files = {p.stem: p for p in tmp_path.glob("*/*/*.kv")}
    assert set(files) == {"whole", "flipped", "torn"}
    data = bytearray(files["flipped"].read_bytes())
    data[-1] ^= 1
    files["flipped"].write_bytes(bytes(data))
    files["torn"].write_bytes(files["torn"].read_bytes()[:-10])
    again = KvTier(ram=1 << 20, disk=1 << 20, root=tmp_path)
    assert again.take(SHELF, "whole") == _kept(1000, fill=7)
    assert again.take(SHELF, "flipped") is None
    assert again.take(SHELF, "torn") is None
    assert again.stats.corrupt == 2
    assert not list(tmp_path.glob("*/*/*.kv"))  # taken or deleted
    assert KvTier(ram=1 << 20, disk=1 << 20, root=tmp_path).take(Shelf("range-b", "coordinator-1"), "whole") is None


def test_without_disk_nothing_outlives_the_stage(tmp_path: Path):
    tier = KvTier(ram=1 << 20, disk=0, root=tmp_path)
    tier.put(SHELF, "a", _kept(10))
    tier.flush()
    assert not list(tmp_path.rglob("*.kv"))
    assert not KvTier(ram=0, disk=0, root=tmp_path).enabled


def test_sizes_read_as_operators_write_them():
    assert tier_size("0") == 0
    assert tier_size("2GiB") == tier_size("2G") == 2 << 30
    assert tier_size("800MB") == 800_000_000


def test_the_coordinator_files_an_overwritten_lane_and_restores_the_entry_that_holds_most():
    index = TierIndex()
    cache = PrefixCache(index=index)
    a = list(range(100, 200))
    cache.keep(0, a)
    taken = cache.take(list(range(500, 600)), free=[0])  # another conversation takes the only lane
    assert taken.begin == Begin(evict=True)
    assert key_of(a) in index.entries
    cache.keep(0, list(range(500, 600)))
    back = cache.take([*a, 1, 2, 3], free=[0])  # a returns: loaded from the tier into the lane
    assert back == type(back)(0, len(a), Begin(evict=True, restore=key_of(a), positions=len(a)))
    assert key_of(a) not in index.entries  # it is in the lane now
    cache.keep(0, [*a, 1, 2, 3])
    again = cache.take([*a, 1, 2, 3, 4], free=[0])  # a chat's next turn: its own lane, nothing filed
    assert again == type(again)(0, len(a) + 3, Begin())
    cache.keep(0, [*a, 1, 2, 3, *range(EVICT_MIN - 1)])
    few = cache.take([*a, 1, 2, 3, 9], free=[0])  # fewer than EVICT_MIN tokens lost: not worth a copy
    assert not few.begin.evict


def test_an_entry_reused_in_part_stays_for_its_own_conversation(tmp_path: Path):
    """Sixteen ledgers on four lanes: two whose first words begin alike share a token past the
    chat template. A request reusing a few tokens of another conversation's entry must neither
    spend that entry (its conversation came back to a full prefill every turn: TTFT 7 s, not
    0.4) nor load it for less than it costs."""
    index = TierIndex()
    cache = PrefixCache(index=index)
    template, a, b = [1, 2, 3], list(range(100, 200)), list(range(300, 400))
    index.add([*template, *a])
    cache.keep(0, [*template, 9, *b])
    near = cache.take([*template, a[0], *b], free=[0])  # one token more than the lane: not worth it
    assert near.begin == Begin(evict=True)
    assert near.cached == len(template)
    cache.keep(0, [*template, 9, *b])
    shared = [*template, *a[:RESTORE_MIN], *b]  # shares RESTORE_MIN tokens of a's entry
    part = cache.take(shared, free=[0])
    assert part.cached == len(template) + RESTORE_MIN
    assert part.begin == Begin(evict=True, restore=key_of([*template, *a]), positions=len(a) + 3, keep=True)
    assert key_of([*template, *a]) in index.entries  # still a's
    cache.keep(0, shared)
    back = cache.take([*template, *a, 7], free=[0])
    assert back.cached == len(a) + 3
    assert back.begin == Begin(evict=True, restore=key_of([*template, *a]), positions=len(a) + 3)
    assert key_of([*template, *a]) not in index.entries
    # and on the stage: an entry loaded with `keep` stays, in host memory or on disk
    tier = KvTier(ram=150, disk=1000, root=tmp_path)
    tier.put(SHELF, "a", _kept(100))
    tier.put(SHELF, "b", _kept(100))  # a goes to disk
    for key in "ab":
        assert tier.take(SHELF, key, keep=True) == tier.take(SHELF, key) == _kept(100)
        assert tier.take(SHELF, key) is None
    assert (tier.stats.hits_ram, tier.stats.hits_disk, tier.stats.misses) == (2, 2, 2)


def test_the_index_finds_by_blocks_what_matching_every_entry_finds():
    """Entries sharing a long system prompt, and others: the block index finds the entry a
    token-by-token match over every entry finds, for any prompt sharing a block or more."""
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(1000, size=300)]
    index = TierIndex()
    for i in range(200):
        index.add([*(system if i % 2 else []), *(int(t) for t in rng.integers(1000, size=int(rng.integers(32, 200))))])
    held = list(index.entries.values())
    prompts = [[*held[7], 1], [*held[8][:150], 2, 3], [*system, 4, 5], [*held[9][:BLOCK - 1], 6], [7] * 50]
    for exact in (False, True):
        for prompt in prompts:
            linear = max(matched(tokens, prompt, exact) for tokens in held)
            found = index.best(prompt, functools.partial(matched, exact=exact))[1]
            assert found == (linear if linear >= BLOCK else 0)
    for key in list(index.entries):
        index.remove(key)
    assert not index.blocks  # nothing left behind


def test_an_exact_cache_restores_only_an_entry_the_prompt_extends_whole():
    """Recurrent state stands at one position: all of an entry, or none of it."""
    index = TierIndex()
    index.add(list(range(50)))
    cache = PrefixCache(exact=True, index=index)
    assert cache.take([*range(40), 7, 7], free=[0]).begin == Begin()
    assert cache.take([*range(50), 7], free=[0]).begin.restore == key_of(range(50))


def test_the_index_survives_a_restart_and_an_unreadable_one_starts_empty(tmp_path: Path):
    path = tmp_path / "index.json"
    index = TierIndex(path)
    index.add([1, 2, 3])
    index.save()
    assert list(TierIndex(path).entries.values()) == [(1, 2, 3)]
    path.write_text("{not json")
    assert not TierIndex(path).entries


@pytest.mark.parametrize("threads", [1, None])
def test_a_lane_filed_and_loaded_into_another_computes_as_a_fresh_prefill(tmp_path: Path, tiny_gguf: Path, threads):
    """Past 512 cells, at one thread and at the default thread count: the restored lane's next
    row, and one after a trim into it, equal a fresh prefill's bit for bit."""
    engine = LlamaRangeEngine(tiny_gguf, EngineConfig(first=True, final=True, lanes=3, ctx_per_lane=1024,
                                                      threads=threads or 2))
    tiers = LaneTier(engine, KvTier(ram=0, disk=1 << 30, root=tmp_path), SHELF)
    tokens = np.random.default_rng(1).integers(1, engine.n_vocab, 700).astype(np.int32)
    one = np.array([5], dtype=np.int32)
    try:
        for start in range(0, 700, 128):
            engine.step([Step(0, start, tokens=tokens[start : start + 128])])
        tiers.ended(0, "seq", 700)
        tiers.begin(0, Begin(evict=True))  # filed (on disk: no host memory here)
        engine.trim(0, 0)
        tiers.begin(2, Begin(restore="seq", positions=700))
        assert engine.position(2) == 700
        restored = engine.step([Step(2, 700, tokens=one)])[0]
        fresh = [engine.step([Step(1, s, tokens=tokens[s : s + 128])]) for s in range(0, 700, 128)]
        assert fresh
        assert np.array_equal(engine.step([Step(1, 700, tokens=one)])[0], restored)
        tiers.ended(2, "seq2", 701)
        tiers.begin(2, Begin(evict=True))
        tiers.begin(0, Begin(restore="seq2", positions=701))
        trimmed = engine.step([Step(0, 600, tokens=one)])[0]  # the frame's start trims the entry
        assert np.array_equal(engine.step([Step(1, 600, tokens=one)])[0], trimmed)
        tiers.begin(0, Begin(restore="gone", positions=5))  # not here: the lane is left empty
        assert engine.position(0) == 0
    finally:
        engine.close()
