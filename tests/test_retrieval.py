"""Retrieval mode: a document longer than the context is indexed window by window; each question
reads the blocks chosen for it, moved right after the head."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig
from kvpage_cli.engine.index import RetrievalIndex
from kvpage_cli.ingest import load
from kvpage_cli.tasks import Asker
from kvpage_cli.tasks.ask import READ_AGAIN_TOKENS, read_again, reading_order
from kvpage_cli.tasks.retrieval import UNIT_BLOCKS, Selection, lexical_terms, search_terms

from .conftest import SAMPLES, random_prompt, tiny_model


@pytest.fixture(scope="module")
def short_engine(tiny_cli_model, kv_home):
    """The tiny llama with SmolLM2's tokenizer, told its context is 1,024 tokens."""
    return Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home), max_context=1024, backend="native"))


def test_a_document_past_the_context_is_answered_from_its_blocks(short_engine):
    doc = load(str(SAMPLES / "contract.txt"))  # about 6K tokens
    asker = Asker(short_engine, doc, ["Which law governs the agreement?", "Who may terminate?"], max_new_tokens=4)
    assert asker.mode == "retrieval"
    list(asker.answers())
    assert all(asker.complete)
    index = asker.retriever.index
    covered = sorted(t for b in index.blocks for t in range(b.first, b.first + BLOCK_TOKENS))
    assert covered == list(range(len(index.tokens)))  # every document token in exactly one kept block
    assert len(index.rest) < BLOCK_TOKENS and index.tokens + index.rest == asker.prefix_ids[
        len(index.head.tokens):len(index.head.tokens) + len(index.tokens) + len(index.rest)]
    budget = asker.budget()
    for selection, sources in zip(asker.selections, asker.sources):
        assert 0 < len(selection.blocks) <= budget < selection.total
        assert sources and all(s["where"].startswith("line") for s in sources)
        for s in sources:
            assert doc.text[s["start"]:s["end"]].strip()
    # the lexical signal alone puts the governing-law clause among the blocks of that question
    law = doc.text.index("laws of the State of Delaware")
    chosen = asker.retriever.select("Which State's laws govern?", asker.question_ids[0], budget, signals=("lexical",))
    assert any(s <= law < e for s, e in (asker.retriever.char_spans[i] for i in chosen.blocks))


def test_a_document_that_fits_asks_the_whole_document_in_auto_mode(short_engine):
    doc = load(str(SAMPLES / "repo" / "README.md"))
    asker = Asker(short_engine, doc, "What does it do?", max_new_tokens=4)
    assert asker.mode == "exact"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_every_block_assembled_in_place_gives_the_exact_prefill(arch, kv_home):
    model = tiny_model(arch)
    engine = Engine.load(model, EngineConfig(home=str(kv_home), backend="native"))
    head, doc, question = random_prompt(100, seed=1), random_prompt(700, seed=2), random_prompt(20, seed=3)
    index = RetrievalIndex.build(engine, head, doc, window=1024, overlap=0)  # one window: every block where it was
    ctx = engine.append(index.assemble(list(range(index.num_blocks))), index.rest)
    assert ctx.tokens == head + doc
    align = len(index.head.tokens) - len(head)
    exact = engine.append(engine.prefill(head + doc[:align]), doc[align:len(doc) - len(index.rest)])  # same chunks
    exact = engine.append(exact, index.rest)
    a = engine.logits(engine.append(ctx, question)).clone()
    b = engine.logits(engine.append(exact, question)).clone()
    if arch == "llama":
        assert torch.equal(a, b)  # moved by 0: the same bits
    else:  # gemma's sliding layers see only the question's window after an assembly
        assert not torch.equal(a, b)


def test_windows_overlap_and_blocks_move_to_consecutive_places(kv_home):
    engine = Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home), backend="native"))
    head, doc = random_prompt(70, seed=4), random_prompt(1000, seed=5)
    index = RetrievalIndex.build(engine, head, doc, window=256, overlap=128)
    align = -len(head) % BLOCK_TOKENS
    assert len(index.head.tokens) == len(head) + align
    assert index.tokens + index.rest == doc[align:] and len(index.tokens) % BLOCK_TOKENS == 0
    base = len(index.head.tokens) // BLOCK_TOKENS
    # the first window's blocks follow the head; later windows' own tokens start after their overlap
    assert [b.position for b in index.blocks[:4]] == [base, base + 1, base + 2, base + 3]
    assert [b.position for b in index.blocks[4:8]] == [base + 2, base + 3, base + 4, base + 5]
    ctx = index.assemble([2, 9, 5])  # in the order given
    assert ctx.num_cached == len(index.head.tokens) + 3 * BLOCK_TOKENS
    assert ctx.tokens[-3 * BLOCK_TOKENS:] == [t for b in (2, 9, 5) for t in index.tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS]]
    with pytest.raises(ValueError, match="twice"):
        index.assemble([2, 2])
    list(engine.generate(ctx, [7, 8, 9], max_new_tokens=3, stop=()))
    before = engine.store.bytes_used
    index.release()
    engine.release(ctx)
    assert engine.store.bytes_used < before


def test_identifiers_split_into_words_for_the_lexical_signal():
    assert lexical_terms("TooManyRedirects max_redirects") == ["toomanyredirects", "too", "many", "redirects",
                                                                "max_redirects", "max", "redirects"]


def test_words_match_by_their_stems_so_an_inflected_question_finds_its_clause(short_engine, tmp_path):
    assert search_terms("governs governed laws law max_retries") == [
        "govern", "govern", "law", "law", "max_retri", "max", "retri"]
    lines = [f"{n}. The Supplier shall deliver the goods of order {n} to the warehouse on the date set." for n in range(300)]
    lines[250] = "250. This Agreement is governed by the laws of the State of Delaware."
    (tmp_path / "supply.txt").write_text("\n".join(lines) + "\n")
    doc = load(str(tmp_path / "supply.txt"))
    asker = Asker(short_engine, doc, "Which law governs?", max_new_tokens=4)
    retriever = asker.index()
    selection = retriever.select_lazily(asker.questions[0], retriever.tail + asker.question_ids[0], asker.budget())
    law = doc.text.index("governed by the laws")
    assert selection.share < 0.5  # the clause is chosen, not the document read whole
    assert any(s <= law < e for s, e in (retriever.char_spans[i] for i in selection.blocks))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_an_index_is_saved_and_a_second_run_maps_it_reading_only_what_it_uses(kv_dtype, tmp_path):
    """int8 KV too: its blocks are saved and mapped with their scales, and decoded where moved."""
    model = tiny_model("llama")
    head, doc, question = random_prompt(90, seed=6), random_prompt(1600, seed=7), random_prompt(12, seed=8)

    def ask(engine, chosen):
        index = RetrievalIndex.build(engine, head, doc, window=256, overlap=64)
        ctx = engine.append(index.assemble(chosen), index.rest + question)
        return index, engine.logits(ctx).clone()

    first_engine = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, kv_dtype=kv_dtype))
    first, expected = ask(first_engine, [3, 11, 20])
    assert first.loaded_windows == 0
    second_engine = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, kv_dtype=kv_dtype))
    second, logits = ask(second_engine, [3, 11, 20])
    assert second.loaded_windows == len(second.windows) == len(first.windows)
    # the head (instructions, the document's first tokens) is loaded too: nothing is prefilled
    assert first.head.cached_prefix == 0 and second.head.cached_prefix == len(second.head.tokens) == 128
    assert torch.equal(logits, expected)  # the saved blocks are the same bits
    read = {(id(m), j) for m, j in (second.mapped[i] for i in range(second.num_blocks)) if j in m.checked}
    assert len(read) == 3  # only the blocks the question used were read from disk
    # neither run keeps the index in memory: saved windows are read from their files
    assert all(m is not None for m in first.mapped) and all(m is not None for m in second.mapped)
    assert first_engine.store.bytes_used < first.index_bytes and second_engine.store.bytes_used < second.index_bytes

    # a damaged block on disk: noticed when read, its window computed again, the answer unchanged
    mapped, j = second.mapped[11]
    path = next(p for p in (tmp_path / "kv" / "segments").glob("*/*.kvb") if p.stat().st_size and _holds(p, mapped))
    data = bytearray(path.read_bytes())
    bounds_bytes = mapped.bounds().numel() * 2  # the key bounds follow the blocks
    data[len(data) - 4 - bounds_bytes - mapped.header["block_bytes"] * (mapped.num_blocks - j) + 16] ^= 0xFF  # block j
    path.write_bytes(bytes(data))
    third_engine = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, kv_dtype=kv_dtype))
    events = []
    third = RetrievalIndex.build(third_engine, head, doc, window=256, overlap=64, on_event=events.append)
    ctx = third_engine.append(third.assemble([3, 11, 20]), third.rest + question)
    assert torch.equal(third_engine.logits(ctx), expected)
    assert any("checksum" in getattr(e, "message", "") for e in events)


def _holds(path, mapped) -> bool:
    return mapped.header["key"] in path.name


def test_an_unsaved_index_is_kept_in_files_of_its_own_then_removed(tmp_path):
    """Past the saved-KV cache's limit (or without the cache) a long document's index still leaves
    memory window by window: its files live in the home's tmp folder until the index is released."""
    model = tiny_model("llama")
    head, doc, question = random_prompt(90, seed=6), random_prompt(1600, seed=7), random_prompt(12, seed=8)

    def ask(engine, **build):
        index = RetrievalIndex.build(engine, head, doc, window=256, overlap=64, **build)
        ctx = engine.append(index.assemble([3, 11, 20]), index.rest + question)
        logits = engine.logits(ctx).clone()
        engine.release(ctx)
        return index, logits

    saved_engine = Engine.load(model, EngineConfig(home=str(tmp_path / "saved"), backend="native", kv_cache=True))
    _, expected = ask(saved_engine)
    engine = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, cache_mib=0.01))
    events = []
    index, logits = ask(engine, on_event=events.append)
    assert any("not saved" in getattr(e, "message", "") for e in events)  # past --cache-mib
    assert not list((tmp_path / "kv" / "segments").glob("*/*.kvb"))
    scratch = list((tmp_path / "tmp").glob("index-*"))
    assert len(scratch) == 1 and list(scratch[0].glob("segments/*/*.kvb"))
    assert all(m is not None for m in index.mapped) and engine.store.bytes_used < index.index_bytes
    assert torch.equal(logits, expected)
    index.release()
    assert not list((tmp_path / "tmp").glob("index-*"))  # removed with the index
    # and with --no-cache the same
    index, logits = ask(engine, use_cache=False)
    assert len(list((tmp_path / "tmp").glob("index-*"))) == 1 and torch.equal(logits, expected)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_key_bounds_hold_every_key_and_are_saved_with_the_index(kv_dtype, tmp_path):
    """The bounds signal's per-block key min/max: true bounds of every key (bfloat16 rounded
    outward), so the bound of each block is at least its largest q.k; saved with the windows and
    read back without reading any block; recomputed from the keys when damaged on disk."""
    from kvpage_cli.engine.attention.policy import key_bound

    model = tiny_model("llama")
    head, doc, question = random_prompt(90, seed=6), random_prompt(1600, seed=7), random_prompt(12, seed=8)
    engine = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, kv_dtype=kv_dtype))
    index = RetrievalIndex.build(engine, head, doc, window=256, overlap=64)
    assert bool(index.has_bounds.all())  # computed as the windows were
    everything = list(range(index.num_blocks))
    queries = engine.queries_after(index.head, question)
    for f, layer in enumerate(index.bound_layers):
        k, v = index._kv(engine.store.group_of(layer), engine.store.layer_pos[layer], everything, values=False)
        assert v is None
        low, high = index.kmin[:, f, :, None, :].float(), index.kmax[:, f, :, None, :].float()
        assert bool((low <= k).all()) and bool((k <= high).all())
        true_min = k.amin(dim=2)
        assert bool(((true_min - index.kmin[:, f].float()).abs() <= true_min.abs() * 2**-7).all())  # a bf16 step
        moved = index._moved_queries(queries, layer, everything)  # [C, Hkv, G*t, D]
        largest = torch.matmul(moved, k.float().transpose(-1, -2)).amax(dim=-1)
        assert bool((key_bound(moved, index.kmin[:, f], index.kmax[:, f]) >= largest - 1e-4).all())
    expected = index.bound_scores(queries)
    assert expected.shape == (index.num_blocks,) and torch.isfinite(expected).all()

    again = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, kv_dtype=kv_dtype))
    mapped = RetrievalIndex.build(again, head, doc, window=256, overlap=64)
    assert mapped.loaded_windows == len(mapped.windows) and not bool(mapped.has_bounds.any())
    assert torch.equal(mapped.bound_scores(queries), expected)  # read from the files
    assert torch.equal(mapped.kmin, index.kmin) and torch.equal(mapped.kmax, index.kmax)
    assert not any(isinstance(j, int) for m, _ in mapped.mapped for j in m.checked)  # no block was read

    # damaged bounds on disk: noticed, computed again from the keys, the same values
    window = mapped.mapped[0][0]
    path = next(p for p in (tmp_path / "kv" / "segments").glob("*/*.kvb") if _holds(p, window))
    data = bytearray(path.read_bytes())
    data[len(data) - 4 - 8] ^= 0xFF  # inside the bounds, which end the payload
    path.write_bytes(bytes(data))
    third = Engine.load(model, EngineConfig(home=str(tmp_path), backend="native", kv_cache=True, kv_dtype=kv_dtype))
    events = []
    rebuilt = RetrievalIndex.build(third, head, doc, window=256, overlap=64, on_event=events.append)
    assert torch.equal(rebuilt.bound_scores(queries), expected)
    assert any("key bounds" in getattr(e, "message", "") for e in events)


def test_signals_are_checked_and_each_selects_the_budget(short_engine):
    doc = load(str(SAMPLES / "contract.txt"))
    asker = Asker(short_engine, doc, "Which law governs the agreement?", max_new_tokens=4)
    retriever = asker.index()
    asked = retriever.tail + asker.question_ids[0]
    budget = asker.budget()
    for signals in [("lexical",), ("bounds",), ("keys",), ("bounds", "keys"), ("lexical", "bounds", "keys")]:
        selection = retriever.select(asker.questions[0], asked, budget, signals=signals)
        assert budget - UNIT_BLOCKS < len(selection.blocks) <= budget and selection.blocks == sorted(set(selection.blocks))
    with pytest.raises(ValueError, match="signals must be some of lexical, bounds, keys"):
        retriever.select(asker.questions[0], asked, budget, signals=("bm25",))


def test_the_budget_follows_the_pool_where_blocks_are_read_through_it(tiny_cli_model, kv_home):
    """Through the pool (kv_path "pool", as on a GPU) a question reads no more blocks than the pool
    holds beside the head, the question and its answer, so they stay resident; a larger pool reads
    more, up to retrieval_tokens."""
    doc = load(str(SAMPLES / "contract.txt"))
    budgets = {}
    for pool_mib in (0.3, 0.5, 64.0):
        engine = Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home), max_context=2048, backend="native",
                                                               kv_path="pool", pool_mib=pool_mib))
        asker = Asker(engine, doc, "Which law governs the agreement?", max_new_tokens=4)
        asker.index()
        fixed = len(asker.retriever.index.head.tokens) + len(asker.retriever.tail) + len(asker.question_ids[0]) + 4
        budgets[pool_mib] = asker.budget()
        assert budgets[pool_mib] == min(engine.pool.num_slots * BLOCK_TOKENS - fixed,
                                        2048 - fixed, engine.config.retrieval_tokens) // BLOCK_TOKENS
        selection = asker.retriever.select(asker.questions[0], asker.retriever.tail + asker.question_ids[0],
                                           budgets[pool_mib])
        assert len(selection.blocks) <= budgets[pool_mib]
        asker.retriever.index.release()
    assert budgets[0.3] < budgets[0.5] < budgets[64.0]


def test_selective_mode_over_a_document_past_the_context_decodes_the_retrieved_blocks_selectively(tiny_cli_model, kv_home):
    """Retrieval composes with selective decode: the blocks chosen for the question are assembled,
    then each decode step attends the policy's share of them (no more than the pool's slots)."""
    engine = Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home), max_context=1024, backend="native",
                                                           mode="selective", pool_mib=0.3))
    doc = load(str(SAMPLES / "contract.txt"))
    asker = Asker(engine, doc, "Which law governs the agreement?", max_new_tokens=6)
    assert asker.mode == "retrieval"
    before = engine.stats()
    answer = "".join(piece for _, piece in asker.answers())
    stats = engine.stats()
    assert asker.complete == [True] and answer.strip()
    attended = stats.blocks_attended - before.blocks_attended
    candidates = stats.blocks_candidate - before.blocks_candidate
    assert 0 < attended < candidates  # decode steps skipped some of the assembled blocks


@pytest.fixture(scope="module")
def short_gemma(tiny_cli_model, tmp_path_factory, kv_home):
    """A random 3-layer Gemma 3 (sliding windows of 512 tokens around one full-attention layer)
    with SmolLM2's tokenizer, told its context is 1,024 tokens."""
    import shutil

    from .conftest import TOKENIZER_FILES

    folder = tmp_path_factory.mktemp("tiny-gemma")
    model = tiny_model("gemma3_text", seed=0, vocab_size=49152, sliding_window=512, max_position_embeddings=8192,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny_cli_model / name).exists():
            shutil.copy(tiny_cli_model / name, folder / name)
    return Engine.load(str(folder), EngineConfig(home=str(kv_home), max_context=1024, backend="native"))


def test_a_sliding_window_model_reads_its_best_passages_again_right_before_the_question(short_gemma, short_engine):
    """Sliding-window layers keep nothing in the index, so a Gemma question would see only itself
    in 5 of every 6 layers: the passages that matched best (1,024 tokens of them, of the selected
    ones) are computed again right before the question, the best last, and not attended twice."""
    doc = load(str(SAMPLES / "contract.txt"))
    asker = Asker(short_gemma, doc, "Which State's laws govern the agreement?", max_new_tokens=4, lazy=False)
    assert asker.mode == "retrieval"
    [request], _ = asker._retrieval_requests(short_gemma.stop_ids)
    selection, retriever = asker.selections[0], asker.retriever
    index = retriever.index
    law = doc.text.index("laws of the State of Delaware")
    best = selection.best[0]
    assert retriever.char_spans[best[0]][0] <= law < retriever.char_spans[best[-1]][1]
    again = read_again(selection, READ_AGAIN_TOKENS)  # up to four passages, of the selected ones, the best last
    chosen_best = [p for p in selection.best if set(p) <= set(selection.blocks)]
    assert len(chosen_best) < len(selection.best)  # here the budget leaves one of the four out: it is not read
    assert sorted(again) == sorted(b for p in chosen_best for b in p) and again[-len(best):] == list(best)
    read_again_tokens = [t for b in again
                         for t in index.tokens[index.blocks[b].first:index.blocks[b].first + BLOCK_TOKENS]]
    assert request.token_ids == read_again_tokens + retriever.tail + asker.question_ids[0]
    assert len(request.ctx.tokens) == len(index.head.tokens) + BLOCK_TOKENS * (len(selection.blocks) - len(again))
    assert set(again) <= set(selection.blocks)  # still reported among the blocks the question read
    short_gemma.release(request.ctx)
    list(asker.answers())
    assert asker.complete == [True]
    # a model without sliding-window layers reads everything from the index
    plain = Asker(short_engine, doc, "Which State's laws govern the agreement?", max_new_tokens=4)
    [request], _ = plain._retrieval_requests(short_engine.stop_ids)
    assert request.token_ids == plain.retriever.tail + plain.question_ids[0]
    # ... in document order, the best passage last (right before the question)
    chosen, index = plain.selections[0], plain.retriever.index
    order = reading_order(chosen, [])
    assert sorted(order) == chosen.blocks and order[-len(chosen.best[0]):] == list(chosen.best[0])
    assert request.ctx.tokens[-len(order) * BLOCK_TOKENS:] == [
        t for b in order for t in index.tokens[index.blocks[b].first:index.blocks[b].first + BLOCK_TOKENS]]
    short_engine.release(request.ctx)


def test_the_best_passage_is_read_last_with_the_passages_that_adjoin_it():
    """Document order, but the run of passages holding the best one moves right before the question
    (a needle cut by a passage's end stays whole); read-again passages likewise, best run last."""
    passages = [tuple(range(i, i + 4)) for i in (0, 8, 12, 20)]
    selection = Selection(sorted(b for p in passages for b in p), 40, best=(passages[2], passages[0], passages[3]))
    assert reading_order(selection, []) == [0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 10, 11, 12, 13, 14, 15]
    assert reading_order(Selection([0, 1, 5], 40), []) == [0, 1, 5]  # nothing named best: document order
    assert reading_order(selection, [12, 13, 14, 15]) == [0, 1, 2, 3, 8, 9, 10, 11, 20, 21, 22, 23]
    assert read_again(selection, 512) == [0, 1, 2, 3, 12, 13, 14, 15]
    adjoining = Selection(selection.blocks, 40, best=(passages[2], passages[1], passages[0]))
    assert read_again(adjoining, 512) == [8, 9, 10, 11, 12, 13, 14, 15]
    assert read_again(adjoining, 768) == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    assert read_again(adjoining, 200) == []
    unselected = Selection(selection.blocks, 40, best=(passages[2], (30, 31, 32, 33), passages[0]))
    assert read_again(unselected, 768) == [0, 1, 2, 3, 12, 13, 14, 15]  # a passage left out by the budget is not read
