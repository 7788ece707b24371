"""The saved-KV cache: a second prefill of a document loads its blocks instead of computing them,
with the same bits; damaged, foreign or half-written files are never used; processes share it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig, EngineWarning, PrefillProgress
from kvpage_cli.engine.kv.saved.disk import KVCache

from .conftest import random_prompt, tiny_model

SEGMENT = 256  # the prefill chunk these tests use: saved prefixes end on multiples of it


def load(model, home, **config) -> Engine:
    config.setdefault("backend", "torch")  # a fresh home would compile the native kernels first
    config.setdefault("kv_cache", True)
    config.setdefault("prefill_chunk", SEGMENT)
    return Engine.load(model, EngineConfig(home=str(home), **config))


def fresh_logits(model, home, ids, **config) -> torch.Tensor:
    engine = load(model, home, kv_cache=False, **config)
    return engine.logits(engine.prefill(ids)).clone()


def prefill(engine: Engine, ids: list[int], label: str = "doc"):
    """(context, its logits, the events it reported)."""
    events = []
    ctx = engine.prefill(ids, events.append, label=label)
    return ctx, engine.logits(ctx).clone(), events


def warnings(events) -> list[str]:
    return [e.message for e in events if isinstance(e, EngineWarning)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("arch,kv_path,kv_dtype", [("llama", "store", "auto"), ("llama", "pool", "auto"),
                                                   ("gemma3_text", "store", "auto"), ("mistral", "pool", "auto"),
                                                   ("gemma3_text", "pool", "int8")])
def test_second_prefill_loads_the_document_and_gives_the_same_bits(arch, kv_path, kv_dtype, tmp_path):
    model = tiny_model(arch)  # gemma3 and mistral have sliding-window layers (window 100)
    ids = random_prompt(7 * SEGMENT + 100, seed=3)
    reference = fresh_logits(model, tmp_path, ids, kv_path=kv_path, kv_dtype=kv_dtype)
    engine = load(model, tmp_path, kv_path=kv_path, kv_dtype=kv_dtype)

    first, first_logits, _ = prefill(engine, ids)
    assert first.cached_prefix == 0
    second, second_logits, events = prefill(engine, ids)
    assert second.cached_prefix == 7 * SEGMENT and second.cached_prefix % BLOCK_TOKENS == 0
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert progress[0].cached == progress[-1].cached == 7 * SEGMENT
    assert progress[-1].done == progress[-1].total == len(ids)
    assert engine.stats().cached_tokens == 7 * SEGMENT
    assert torch.equal(first_logits, reference) and torch.equal(second_logits, reference)
    assert list(engine.generate(first, max_new_tokens=12, stop=())) == list(engine.generate(second, max_new_tokens=12, stop=()))
    assert not warnings(events)


def test_a_prompt_ending_on_a_segment_boundary_recomputes_its_last_segment(llama, tmp_path):
    ids = random_prompt(4 * SEGMENT, seed=4)
    engine = load(llama, tmp_path)
    prefill(engine, ids)
    ctx, logits, _ = prefill(engine, ids)
    assert ctx.cached_prefix == 3 * SEGMENT  # the last token's logits are always computed
    assert torch.equal(logits, fresh_logits(llama, tmp_path, ids))


def test_a_shared_prefix_is_reused_up_to_where_the_prompts_part(llama, tmp_path):
    document = random_prompt(5 * SEGMENT + 30, seed=5)
    question_a, question_b = random_prompt(300, seed=6), random_prompt(200, seed=7)
    engine = load(llama, tmp_path)
    prefill(engine, document + question_a)
    ctx, logits, _ = prefill(engine, document + question_b)
    assert ctx.cached_prefix == 5 * SEGMENT  # the segment holding the document's end differs
    assert torch.equal(logits, fresh_logits(llama, tmp_path, document + question_b))
    other, _, _ = prefill(engine, random_prompt(3 * SEGMENT, seed=8))
    assert other.cached_prefix == 0


def test_forks_of_a_loaded_document_answer_like_a_fresh_one(llama, tmp_path):
    document, question = random_prompt(3 * SEGMENT + 10, seed=9), random_prompt(40, seed=10)
    engine = load(llama, tmp_path)
    expected = list(engine.generate(engine.fork(engine.prefill(document, use_cache=False)), question, max_new_tokens=10, stop=()))
    prefill(engine, document)
    doc, _, _ = prefill(engine, document)
    assert doc.cached_prefix == 3 * SEGMENT
    assert list(engine.generate(engine.fork(doc), question, max_new_tokens=10, stop=())) == expected
    assert list(engine.generate(engine.fork(doc), question, max_new_tokens=10, stop=())) == expected


@pytest.mark.parametrize("arch,length", [("llama", 3 * SEGMENT + 2 * BLOCK_TOKENS), ("llama", 2 * SEGMENT),
                                         ("gemma3_text", 3 * BLOCK_TOKENS)])
def test_a_prompt_read_without_its_logits_is_restored_whole_with_the_same_bits(arch, length, tmp_path):
    """A retrieval index's head: no logits read, so its last blocks are saved and loaded too."""
    model = tiny_model(arch)  # gemma3: its sliding-window layers keep only the blocks still seen
    ids, question = random_prompt(length, seed=21), random_prompt(40, seed=22)
    fresh = load(model, tmp_path, kv_cache=False)
    expected = fresh.logits(fresh.append(fresh.prefill(ids), question)).clone()
    expected_tokens = list(fresh.generate(fresh.prefill(ids), question, max_new_tokens=8, stop=()))
    engine = load(model, tmp_path)
    first = engine.prefill(ids, label="head", logits=False)
    second = engine.prefill(ids, label="head", logits=False)
    assert first.cached_prefix == 0 and second.cached_prefix == length and second.last_logits is None
    for ctx in (first, second):
        assert torch.equal(engine.logits(engine.append(engine.fork(ctx), question)), expected)
        assert list(engine.generate(engine.fork(ctx), question, max_new_tokens=8, stop=())) == expected_tokens
    # read with its logits, the prompt's last token is computed again, as always
    assert engine.prefill(ids, label="head").cached_prefix == (length - 1) // SEGMENT * SEGMENT
    [entry] = engine.kv_cache.list_entries()
    assert entry.label == "head" and entry.tokens == length


def test_a_prompt_of_a_part_block_is_not_restored_whole(llama, tmp_path):
    ids = random_prompt(2 * SEGMENT + 10, seed=23)
    engine = load(llama, tmp_path)
    engine.prefill(ids, logits=False)
    assert engine.prefill(ids, logits=False).cached_prefix == 2 * SEGMENT


def test_a_damaged_end_of_a_prompt_is_discarded_and_recomputed(llama, tmp_path):
    from kvpage_cli.engine.kv.saved.keys import end_key

    ids, question = random_prompt(SEGMENT + 3 * BLOCK_TOKENS, seed=24), random_prompt(30, seed=25)
    engine = load(llama, tmp_path)
    expected = engine.logits(engine.append(engine.prefill(ids, use_cache=False), question)).clone()
    engine.prefill(ids, logits=False)
    _flip_a_byte(engine.kv_cache.path(end_key(engine.cache_seed, ids)))
    events = []
    ctx = engine.prefill(ids, events.append, logits=False)
    assert ctx.cached_prefix == SEGMENT and "checksum" in warnings(events)[0]
    assert torch.equal(engine.logits(engine.append(ctx, question)), expected)
    assert engine.prefill(ids, logits=False).cached_prefix == SEGMENT + 3 * BLOCK_TOKENS  # saved again


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "another model"])
def test_a_damaged_or_foreign_file_is_discarded_and_recomputed(damage, llama, tmp_path):
    ids = random_prompt(6 * SEGMENT + 50, seed=11)
    engine = load(llama, tmp_path / "home")
    prefill(engine, ids)
    cache = engine.kv_cache
    entry = cache.list_entries()[0]
    assert entry.tokens == 6 * SEGMENT and entry.segments == 6
    from kvpage_cli.engine.kv.saved.keys import chain_keys

    keys = chain_keys(engine.cache_seed, ids, SEGMENT)
    victim = cache.path(keys[3])
    if damage == "flipped byte":
        _flip_a_byte(victim)
    elif damage == "truncated":
        _truncate(victim)
    else:  # the same tokens saved by another model, put where this model looks
        other = load(tiny_model("llama", seed=1), tmp_path / "other")
        prefill(other, ids)
        victim.write_bytes(other.kv_cache.path(chain_keys(other.cache_seed, ids, SEGMENT)[3]).read_bytes())

    ctx, logits, events = prefill(engine, ids)
    assert ctx.cached_prefix == 3 * SEGMENT  # the segments before the bad one are still good
    [message] = warnings(events)
    assert {"flipped byte": "checksum", "truncated": "truncated", "another model": "another model"}[damage] in message
    assert torch.equal(logits, fresh_logits(llama, tmp_path / "home", ids))
    # The bad segment was recomputed and saved again: the next run loads everything, silently.
    ctx, logits, events = prefill(engine, ids)
    assert ctx.cached_prefix == 6 * SEGMENT and not warnings(events)
    assert torch.equal(logits, fresh_logits(llama, tmp_path / "home", ids))


def _prefill_in_child(home: str, seed: int, barrier=None, die_before_rename: bool = False) -> None:
    model = tiny_model("llama")
    engine = load(model, home)
    if die_before_rename:
        KVCache._commit = lambda self, tmp, path: os.kill(os.getpid(), signal.SIGKILL)
    if barrier is not None:
        barrier.wait(timeout=60)
    engine.prefill(random_prompt(4 * SEGMENT + 10, seed=seed), label="shared")


def test_a_writer_killed_before_the_rename_leaves_nothing_that_is_used(llama, tmp_path):
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=_prefill_in_child, args=(str(tmp_path), 12), kwargs={"die_before_rename": True})
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    leftovers = list((tmp_path / "kv" / "segments").glob("*/*.tmp"))
    assert leftovers  # the dead writer's temporary file is there ...
    ids = random_prompt(4 * SEGMENT + 10, seed=12)
    engine = load(llama, tmp_path)
    ctx, logits, events = prefill(engine, ids)
    assert ctx.cached_prefix == 0 and not warnings(events)  # ... and is not used
    assert torch.equal(logits, fresh_logits(llama, tmp_path, ids))
    assert not any(p.exists() for p in leftovers)  # the next writer swept it away
    assert prefill(engine, ids)[0].cached_prefix == 4 * SEGMENT


def test_a_failed_write_is_a_warning_and_saves_nothing(llama, tmp_path, monkeypatch):
    def refuse(self, tmp, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(KVCache, "_commit", refuse)
    ids = random_prompt(2 * SEGMENT + 10, seed=13)
    engine = load(llama, tmp_path)
    ctx, logits, events = prefill(engine, ids)
    assert "No space left" in warnings(events)[0]
    assert torch.equal(logits, fresh_logits(llama, tmp_path, ids))
    assert engine.kv_cache.list_entries() == [] and not list((tmp_path / "kv" / "segments").glob("*/*"))


def test_two_processes_writing_the_same_entry_end_with_one_valid_entry(llama, tmp_path):
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    children = [spawn.Process(target=_prefill_in_child, args=(str(tmp_path), 14, barrier)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [c.exitcode for c in children] == [0, 0]
    ids = random_prompt(4 * SEGMENT + 10, seed=14)
    engine = load(llama, tmp_path)
    [entry] = engine.kv_cache.list_entries()
    assert entry.segments == 4 and entry.tokens == 4 * SEGMENT and entry.label == "shared"
    assert len(list((tmp_path / "kv" / "segments").glob("*/*"))) == 4  # no temporary file left
    ctx, logits, events = prefill(engine, ids)
    assert ctx.cached_prefix == 4 * SEGMENT and not warnings(events)
    assert torch.equal(logits, fresh_logits(llama, tmp_path, ids))


def test_eviction_keeps_the_cache_under_its_limit(llama, tmp_path):
    segment = BLOCK_TOKENS  # a 64-token prefill chunk: 64-token segments, small and quick
    probe = load(llama, tmp_path / "probe", prefill_chunk=segment)
    prefill(probe, random_prompt(segment + 1, seed=20))
    segment_bytes = probe.kv_cache.total_bytes
    limit_mib = 10.5 * segment_bytes / 2**20  # room for ten segments
    engine = load(llama, tmp_path / "home", cache_mib=limit_mib, prefill_chunk=segment)
    documents = [random_prompt(4 * segment + 1, seed=21 + i) for i in range(5)]  # four segments each
    for i, document in enumerate(documents):
        prefill(engine, document, label=f"doc{i}")
        assert engine.kv_cache.total_bytes <= limit_mib * 2**20
    assert [e.label for e in engine.kv_cache.list_entries()][:2] == ["doc4", "doc3"]
    assert prefill(engine, documents[4], label="doc4")[0].cached_prefix == 4 * segment  # the newest is whole
    assert prefill(engine, documents[0], label="doc0")[0].cached_prefix == 0  # the oldest went first
    smaller = KVCache.open(tmp_path / "home", cache_mib=4.5 * segment_bytes / 2**20)
    smaller.trim()  # a lower limit applies at once
    assert smaller.total_bytes <= 4.5 * segment_bytes and [e.label for e in smaller.list_entries()] == ["doc0"]
    # A document larger than the whole cache keeps only the prefix that fits.
    big = load(llama, tmp_path / "big", cache_mib=2.5 * segment_bytes / 2**20, prefill_chunk=segment)
    prefill(big, random_prompt(6 * segment + 1, seed=30))
    assert big.kv_cache.list_entries()[0].tokens == 2 * segment


def test_cache_files_are_readable_by_the_user_only(llama, tmp_path):
    engine = load(llama, tmp_path)
    prefill(engine, random_prompt(2 * SEGMENT + 1, seed=40))
    folder = tmp_path / "kv"
    paths = [folder, *folder.rglob("*")]
    assert len([p for p in paths if p.suffix == ".kvb"]) == 2
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_list_remove_and_clear(llama, tmp_path):
    engine = load(llama, tmp_path)
    prefill(engine, random_prompt(3 * SEGMENT + 1, seed=50), label="a.pdf")
    prefill(engine, random_prompt(2 * SEGMENT + 1, seed=51), label="b.txt")
    prefill(engine, random_prompt(SEGMENT + 1, seed=52), label="")
    cache = KVCache.open(tmp_path)  # what `kvpage cache` opens, without a model
    entries = cache.list_entries()
    assert [(e.label, e.tokens, e.segments) for e in entries] == [("", 256, 1), ("b.txt", 512, 2), ("a.pdf", 768, 3)]
    assert all(e.model == "LlamaForCausalLM" and e.bytes > 0 for e in entries)
    assert sum(e.bytes for e in entries) == cache.total_bytes
    assert [e.label for e in cache.remove("a.pdf")] == ["a.pdf"]
    assert cache.remove(entries[0].key[:7]) == []  # a key prefix names an entry from 8 characters
    assert [e.label for e in cache.remove(entries[0].key[:8])] == [""]
    assert cache.remove("no-such-document") == []
    assert [e.label for e in cache.list_entries()] == ["b.txt"]
    assert [e.label for e in cache.clear()] == ["b.txt"]
    assert cache.list_entries() == [] and cache.total_bytes == 0
    assert not list((tmp_path / "kv" / "segments").glob("*/*"))


def _share(cache: KVCache, keys: list[str], index: int, heads: int) -> None:
    """Writes one rank's share of segment `index` of a chain (`heads` KV heads of random K/V)."""
    header = {"key": keys[index], "parent": keys[index - 1] if index else "", "root": keys[0], "seed": "s" * 64,
              "start": index * 64, "end": (index + 1) * 64, "dtype": "float32", "block_shape": [heads, 64, 8],
              "groups": [{"window": 0, "layers": 2, "blocks": [index]}]}
    cache.write(header, [torch.randn(2, 2, 1, heads, 64, 8)], "doc", "m")


def test_the_ranks_shares_of_a_document_are_one_entry_kept_and_dropped_together(tmp_path):
    """Tensor parallelism: each rank writes its own file of every segment under the same chain key;
    `kvpage cache ls` shows one entry, `rm` and eviction remove every rank's file of a segment, and a
    damaged share is discarded alone."""
    keys = [f"{i:x}" * 64 for i in range(1, 4)]  # three chained segments
    ranks = [KVCache(tmp_path / "kv", part=f"r{r}of2") for r in range(2)]
    for index in range(3):
        for rank, heads in zip(ranks, (2, 1)):  # SmolLM2's 3 KV heads over 2 ranks
            _share(rank, keys, index, heads)
    listing = KVCache.open(tmp_path)  # what `kvpage cache` opens: no rank
    files = sorted((tmp_path / "kv" / "segments").glob("*/*.kvb"))
    [entry] = listing.list_entries()
    assert (entry.label, entry.tokens, entry.segments, entry.key) == ("doc", 192, 3, keys[0])
    assert entry.bytes == sum(f.stat().st_size for f in files) == listing.total_bytes
    assert sorted(f.name for f in files) == sorted(f"{k}-r{r}of2.kvb" for k in keys for r in range(2))
    assert ranks[0].present(keys) == ranks[1].present(keys) == set(keys) and listing.present(keys) == set()
    assert ranks[1].read(keys[2], "s" * 64).groups[0].shape == (2, 2, 1, 1, 64, 8)  # rank 1's own heads

    ranks[1].discard(keys[2])  # a bad share: the other rank's file of it stays
    assert ranks[1].present(keys) == set(keys[:2]) and ranks[0].present(keys) == set(keys)
    time_before = [e.last_used for e in listing.list_entries()]
    ranks[0].touch(keys[:1], "")
    assert listing.list_entries()[0].last_used > time_before[0]
    over = KVCache(tmp_path / "kv", limit_bytes=entry.bytes // 2, part="r0of2")
    over.trim()  # evicting cuts the chain from its end, every rank's file of a segment together
    left = sorted(f.name for f in (tmp_path / "kv" / "segments").glob("*/*.kvb"))
    assert left and all(f"{k}-r0of2.kvb" in left and f"{k}-r1of2.kvb" in left for k in {n.split("-")[0] for n in left})
    assert listing.total_bytes <= entry.bytes // 2
    assert [e.label for e in listing.remove("doc")] == ["doc"]
    assert not list((tmp_path / "kv" / "segments").glob("*/*.kvb")) and listing.total_bytes == 0


def test_without_the_cache_nothing_is_read_or_written(llama, tmp_path):
    ids = random_prompt(2 * SEGMENT + 1, seed=60)
    engine = load(llama, tmp_path)
    engine.prefill(ids, use_cache=False)
    assert not (tmp_path / "kv").exists() or KVCache.open(tmp_path).list_entries() == []
    prefill(engine, ids)
    assert engine.prefill(ids, use_cache=False).cached_prefix == 0
    off = load(llama, tmp_path, kv_cache=False)
    assert off.kv_cache is None and off.prefill(ids).cached_prefix == 0


def test_a_damaged_index_is_started_afresh(llama, tmp_path):
    ids = random_prompt(2 * SEGMENT + 1, seed=70)
    prefill(load(llama, tmp_path), ids)
    (tmp_path / "kv" / "index.sqlite").write_bytes(b"not a database" * 100)
    engine = load(llama, tmp_path)
    ctx, logits, _ = prefill(engine, ids)
    assert ctx.cached_prefix == 0 and torch.equal(logits, fresh_logits(llama, tmp_path, ids))
    assert len(list((tmp_path / "kv" / "segments").glob("*/*.kvb"))) == 2  # orphans swept, segments saved again
    assert prefill(engine, ids)[0].cached_prefix == 2 * SEGMENT


def test_selective_mode_gets_the_key_bounds_of_loaded_blocks(llama, tmp_path):
    ids = random_prompt(5 * SEGMENT + 20, seed=80)
    config = dict(mode="selective", policy="quest", pool_mib=0.15)
    reference = load(llama, tmp_path, kv_cache=False, **config)
    ref_ctx = reference.prefill(ids)
    expected = list(reference.generate(reference.fork(ref_ctx), max_new_tokens=12, stop=()))
    prefill(load(llama, tmp_path, **config), ids)
    engine = load(llama, tmp_path, **config)  # a new process would start with no bounds at all
    ctx, _, _ = prefill(engine, ids)
    assert ctx.cached_prefix == 5 * SEGMENT
    for layer in range(llama.config.num_hidden_layers):
        mine, theirs = ctx.tables[0].live()[0], ref_ctx.tables[0].live()[0]
        assert torch.equal(engine.key_bounds.kmin[layer][mine], reference.key_bounds.kmin[layer][theirs])
        assert torch.equal(engine.key_bounds.kmax[layer][mine], reference.key_bounds.kmax[layer][theirs])
    assert list(engine.generate(ctx, max_new_tokens=12, stop=())) == expected


class _FullDisk:
    """A file that takes `room` bytes, then fails the way a full disk does (part of a write lands)."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.room:
            self.file.write(data[:self.room])
            self.room = 0
            raise OSError(28, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_is_one_warning_no_more_writes_and_no_partial_file_read(llama, tmp_path, monkeypatch):
    import types

    from kvpage_cli.engine.kv.saved import disk as kvcache

    opened = []

    def fdopen(fd, mode="r", *args, **kwargs):
        opened.append(fd)
        return _FullDisk(os.fdopen(fd, mode, *args, **kwargs), room=10_000)

    fake_os = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    fake_os.fdopen = fdopen
    monkeypatch.setattr(kvcache, "os", fake_os)  # kvcache's writes only
    ids = random_prompt(4 * SEGMENT + 10, seed=15)
    engine = load(llama, tmp_path)
    ctx, logits, events = prefill(engine, ids)
    [message] = warnings(events)
    assert "No space left on device" in message
    assert len(opened) == 1  # the three segments after the failed one were not attempted
    assert torch.equal(logits, fresh_logits(llama, tmp_path, ids))
    assert list(engine.generate(ctx, max_new_tokens=8, stop=())) == \
        list(engine.generate(engine.prefill(ids, use_cache=False), max_new_tokens=8, stop=()))
    assert not list((tmp_path / "kv" / "segments").glob("*/*"))  # the partial file was removed
    monkeypatch.undo()
    ctx, logits, events = prefill(engine, ids)  # room again: nothing partial is read, all is saved
    assert ctx.cached_prefix == 0 and not warnings(events)
    assert prefill(engine, ids)[0].cached_prefix == 4 * SEGMENT


def test_a_stuck_lock_holder_means_a_wait_with_a_message_then_no_cache(llama, tmp_path, monkeypatch):
    import subprocess
    import sys

    from kvpage_cli.engine.kv.saved import disk as kvcache

    saved = random_prompt(2 * SEGMENT + 10, seed=16)
    engine = load(llama, tmp_path)
    prefill(engine, saved)
    # holds the lock until the test closes its stdin: as long as the prefills take, however slow
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom filelock import FileLock\n"
         f"lock = FileLock({str(tmp_path / 'kv' / 'lock')!r})\nlock.acquire()\nprint('held', flush=True)\n"
         "sys.stdin.read()\nprint('released', flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(kvcache, "LOCK_NOTICE_S", 0.1)
        monkeypatch.setattr(kvcache, "LOCK_TIMEOUT_S", 0.5)
        writes = []
        real_write = KVCache.write
        monkeypatch.setattr(KVCache, "write", lambda self, *a, **k: (writes.append(1), real_write(self, *a, **k)))

        # Reading needs no lock: the saved prefix is used; marking it used waits, then gives up.
        ctx, logits, events = prefill(engine, saved)
        assert ctx.cached_prefix == 2 * SEGMENT
        waiting, gave_up = warnings(events)
        assert "waiting for the saved-KV cache" in waiting and "another kvpage process holds its lock" in waiting
        assert "held the lock" in gave_up and "running without the saved-KV cache" in gave_up
        assert torch.equal(logits, fresh_logits(llama, tmp_path, saved)) and writes == []

        # A new document: its first write waits, says so, gives up; no other segment is tried.
        new = random_prompt(3 * SEGMENT + 10, seed=17)
        ctx, logits, events = prefill(engine, new)
        waiting, gave_up = warnings(events)
        assert "waiting for the saved-KV cache" in waiting and "could not save KV" in gave_up
        assert writes == [1] and torch.equal(logits, fresh_logits(llama, tmp_path, new))
        holder.stdin.close()  # the signal to let go
        assert holder.stdout.readline().strip() == "released"  # it held the lock through both prefills
    finally:
        holder.kill()
        holder.wait()
    ctx, _, events = prefill(engine, new)  # the holder is gone: the cache works again
    assert ctx.cached_prefix == 0 and not warnings(events)
    assert prefill(engine, new)[0].cached_prefix == 3 * SEGMENT


def _ask_in_child(home: str, seed: int, barrier, cleared, results) -> None:
    engine = load(tiny_model("llama"), home)
    ids = random_prompt(6 * SEGMENT + 10, seed=seed)
    engine.prefill(ids[:3 * SEGMENT + 10], label="shared")  # an earlier question saved part of it
    barrier.wait(timeout=120)
    cleared.wait(timeout=120)
    ctx = engine.prefill(ids, label="shared")
    results.put(list(engine.generate(ctx, max_new_tokens=12, stop=())))


def test_two_processes_and_a_clear_in_the_middle_answer_right_and_leave_it_consistent(llama, tmp_path):
    import multiprocessing.connection

    from kvpage_cli.engine.kv.saved.disk import BadSegment

    spawn = multiprocessing.get_context("spawn")
    barrier, cleared, results = spawn.Barrier(3), spawn.Event(), spawn.Queue()
    children = [spawn.Process(target=_ask_in_child, args=(str(tmp_path), 18, barrier, cleared, results))
                for _ in range(2)]
    for child in children:
        child.start()
    barrier.wait(timeout=120)
    cache = KVCache.open(tmp_path)
    assert [e.label for e in cache.clear()] == ["shared"]  # `kvpage cache clear` in the middle
    cleared.set()
    running = [child.sentinel for child in children]
    while running:  # and again while both prefill, restore and save: every 50 ms, or as soon as one ends
        cache.clear()
        ended = multiprocessing.connection.wait(running, timeout=0.05)
        running = [sentinel for sentinel in running if sentinel not in ended]
    answers = [results.get(timeout=60) for _ in children]
    for child in children:
        child.join(60)
    assert [c.exitcode for c in children] == [0, 0]

    ids = random_prompt(6 * SEGMENT + 10, seed=18)
    reference = load(llama, tmp_path / "reference", kv_cache=False)
    expected = list(reference.generate(reference.prefill(ids), max_new_tokens=12, stop=()))
    assert answers == [expected, expected]

    # Consistent: every indexed segment is there and passes its checks, nothing else is.
    engine = load(llama, tmp_path)
    keys = {row[0] for row in sqlite_rows(tmp_path)}
    files = {p.name[:-4] for p in (tmp_path / "kv" / "segments").glob("*/*.kvb")}
    assert files == keys and not list((tmp_path / "kv" / "segments").glob("*/*.tmp"))
    for key in keys:
        try:
            engine.kv_cache.read(key, engine.cache_seed)
        except BadSegment as exc:
            pytest.fail(f"segment {key} is {exc}")
    ctx, logits, events = prefill(engine, ids, label="shared")
    assert not warnings(events)
    assert list(engine.generate(ctx, max_new_tokens=12, stop=())) == expected


def sqlite_rows(home):
    import sqlite3

    with sqlite3.connect(str(home / "kv" / "index.sqlite")) as db:
        return db.execute("SELECT key FROM segments").fetchall()


def test_after_editing_the_models_config_no_saved_kv_is_restored(llama, tmp_path):
    import json

    folder = tmp_path / "model"
    llama.save_pretrained(folder, safe_serialization=True)
    ids = random_prompt(2 * SEGMENT + 10, seed=19)
    prefill(load(str(folder), tmp_path), ids)
    assert prefill(load(str(folder), tmp_path), ids)[0].cached_prefix == 2 * SEGMENT

    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-2  # same weight files, names, sizes and times; other KV
    (folder / "config.json").write_text(json.dumps(config))
    engine = load(str(folder), tmp_path)
    ctx, logits, events = prefill(engine, ids)
    assert ctx.cached_prefix == 0 and not warnings(events)
    assert torch.equal(logits, fresh_logits(str(folder), tmp_path, ids))
