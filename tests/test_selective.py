"""Selective mode: policies, always-kept blocks, sliding windows, and the mover's valid bits."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig
from kvpage_cli.engine.attention.policy import QuestPolicy, always_kept, choose

from .conftest import random_prompt, tiny_model

POLICIES = ["lru", "quest", "draft", "scores"]


def selective(model, kv_home, policy: str, slots: int, **config) -> Engine:
    cfg = model.config
    slot_bytes = 2 * cfg.num_key_value_heads * BLOCK_TOKENS * cfg.head_dim * 4
    pool_mib = slots * cfg.num_hidden_layers * slot_bytes / 2**20
    engine = Engine.load(model, EngineConfig(home=str(kv_home), mode="selective", policy=policy, pool_mib=pool_mib,
                                             draft_layers=1, **config))
    assert engine.pool.num_slots == slots
    return engine


def record_selections(engine: Engine) -> list[tuple[int, list[int]]]:
    """Wraps the selector: returns the list it appends (layer, chosen logical blocks) to."""
    selections = []
    select = engine.dispatch.selector.select

    def recording(layer, q, ctx, ids, positions, step):
        chosen_ids, chosen_pos = select(layer, q, ctx, ids, positions, step)
        selections.append((layer, chosen_pos.tolist(), positions.tolist(), ctx.num_blocks, step))
        return chosen_ids, chosen_pos

    engine.dispatch.selector.select = recording
    return selections


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kv_path", ["store", "pool"])
def test_a_pool_holding_every_block_gives_the_exact_bits(policy, kv_path, tiny_models, kv_home):
    """Every block chosen: exact mode's tokens and logits, bit for bit (on the pool path the mover
    copies the next layer's blocks ahead: a copy of the block a step writes into, made before the
    step's row was written, once hid that row from every layer after the first)."""
    model = tiny_models["llama"]
    ids = random_prompt(20 * BLOCK_TOKENS + 9, seed=51)

    def run(engine):
        ctx = engine.prefill(ids)
        return [(token, ctx.last_logits.clone()) for token in engine.generate(ctx, max_new_tokens=20, stop=())]

    expected = run(Engine.load(model, EngineConfig(home=str(kv_home), kv_path=kv_path)))
    got = run(selective(model, kv_home, policy, 40, kv_path=kv_path))
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))


def test_quest_chooses_the_block_whose_keys_bound_every_query(tiny_models, kv_home):
    model = tiny_models["llama"]
    engine = selective(model, kv_home, "quest", 6)
    ctx = engine.prefill(random_prompt(30 * BLOCK_TOKENS, seed=52))
    needle = 17
    group = engine.store.groups[0]
    block_id = ctx.tables[0].ids[needle]
    for layer in range(model.config.num_hidden_layers):
        k = group.k_block(engine.store.layer_pos[layer], block_id)
        k[:, 0] = 50.0  # one key row far out along +1 in every dimension, one along -1:
        k[:, 1] = -50.0  # q.k can be as large as 50 * sum|q| here, more than anywhere else
        engine.policy.written(layer, block_id, k[:, :2], True)
    selections = record_selections(engine)
    list(engine.generate(ctx, max_new_tokens=1, stop=()))
    list(engine.generate(ctx, max_new_tokens=2, stop=()))
    assert selections
    for _, chosen, _, _, _ in selections:
        assert needle in chosen


def test_quest_scores_match_a_brute_force_upper_bound():
    torch.manual_seed(0)
    policy = QuestPolicy(num_layers=1, num_kv_heads=2, head_dim=8, group_size=3)
    keys = [torch.randn(2, 64, 8) for _ in range(5)]
    for block_id, k in enumerate(keys):
        policy.written(0, block_id, k[:, :30], True)
        policy.written(0, block_id, k[:, 30:], False)
    q = torch.randn(6, 8)
    scores = policy.scores(0, q, torch.arange(5), torch.arange(5), None)
    for block_id, k in enumerate(keys):
        qg = q.view(2, 3, 8)
        true_max = torch.einsum("hgd,htd->hgt", qg, k).amax(-1).sum()
        assert scores[block_id] >= true_max - 1e-4  # an upper bound of the real maximum


def test_choose_keeps_the_kept_blocks_and_breaks_ties_by_position():
    positions = torch.arange(10, dtype=torch.int32)
    ids = positions + 100
    keep = always_kept(positions, 10, recent_blocks=2)
    scores = torch.tensor([0.0, 5, 1, 5, 1, 0, 0, 0, 9, 9])
    chosen_ids, chosen_pos = choose(ids, positions, scores, keep, budget=5)
    assert chosen_pos.tolist() == [0, 1, 3, 8, 9]  # sink, the two 5s, the recent two
    assert chosen_ids.tolist() == [100, 101, 103, 108, 109]
    scores = torch.zeros(10)
    assert choose(ids, positions, scores, keep, budget=4)[1].tolist() == [0, 7, 8, 9]  # ties: later first


@pytest.mark.parametrize("policy", POLICIES)
def test_always_kept_blocks_are_always_read(policy, tiny_models, kv_home):
    model = tiny_models["qwen3"]
    engine = selective(model, kv_home, policy, 5)
    selections = record_selections(engine)
    list(engine.generate(engine.prefill(random_prompt(25 * BLOCK_TOKENS + 3, seed=53)), max_new_tokens=70, stop=()))
    assert len(selections) >= 69 * model.config.num_hidden_layers
    for layer, chosen, candidates, num_blocks, _ in selections:
        assert 0 in chosen
        assert all(p in chosen for p in range(num_blocks - 2, num_blocks))
        if layer >= 1 or policy != "draft":
            assert len(chosen) <= 5
        else:
            assert chosen == candidates  # the draft layer reads every block


def test_sliding_window_layers_never_lose_a_block_of_their_window(kv_home):
    model = tiny_model("gemma3_text", sliding_window=300)  # window: 300 tokens, about 5 blocks
    engine = selective(model, kv_home, "quest", 3)
    selections = record_selections(engine)
    ctx = engine.prefill(random_prompt(20 * BLOCK_TOKENS, seed=54))
    list(engine.generate(ctx, max_new_tokens=40, stop=()))
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    for layer, chosen, candidates, _, query in selections:
        if layer in sliding:
            assert chosen == candidates  # the whole window
            window = range(max(0, query - 300 + 1) // BLOCK_TOKENS, query // BLOCK_TOKENS + 1)
            assert set(window) <= set(chosen)


def test_selection_is_deterministic(tiny_models, kv_home):
    model = tiny_models["llama"]
    ids = random_prompt(30 * BLOCK_TOKENS, seed=55)
    runs = []
    for _ in range(2):
        engine = selective(model, kv_home, "quest", 6)
        selections = record_selections(engine)
        tokens = list(engine.generate(engine.prefill(ids), max_new_tokens=12, stop=()))
        runs.append((tokens, selections))
    assert runs[0] == runs[1]


def test_a_static_policy_reuses_its_choice_only_while_the_candidates_are_the_same(tiny_models, kv_home):
    # "scores" reuses a layer's choice while its candidate blocks are unchanged; the decode below
    # crosses two block boundaries, where the candidates change and the choice is made again
    model = tiny_models["llama"]
    ids = random_prompt(30 * BLOCK_TOKENS - 20, seed=57)
    runs = []
    for static in (True, False):
        engine = selective(model, kv_home, "scores", 6)
        policy = engine.dispatch.selector.policy
        policy.static = static
        scored = []
        score = policy.scores
        policy.scores = lambda *args: scored.append(1) or score(*args)
        selections = record_selections(engine)
        tokens = list(engine.generate(engine.prefill(ids), max_new_tokens=100, stop=()))
        runs.append((tokens, selections, len(scored)))
    assert runs[0][:2] == runs[1][:2]
    inputs = {(layer, tuple(candidates), num_blocks) for layer, _, candidates, num_blocks, _ in runs[0][1]}
    assert runs[0][2] == len(inputs) < len(runs[0][1]) == runs[1][2]  # scored once per layer and candidate set
    assert {num_blocks for _, _, num_blocks in inputs} == {30, 31, 32}
    for layer, chosen, candidates, _, _ in runs[0][1]:
        assert candidates[-1] in chosen  # the newest block, once it appears


def test_scores_follow_a_question_appended_after_a_shared_document(tiny_models, kv_home):
    # the CLI prefills a document once and appends each question to a fork: the blocks must then be
    # ranked by the question's attention, as if document and question had been one prompt
    model = tiny_models["llama"]
    document = random_prompt(20 * BLOCK_TOKENS + 5, seed=58)
    question = random_prompt(40, seed=59)
    engine = selective(model, kv_home, "scores", 6)
    doc = engine.prefill(document)
    doc_scores = engine.block_scores(doc)
    asked = engine.append(engine.fork(doc), question)
    assert engine.block_scores(doc) is doc_scores  # the document keeps its own ranking
    whole = engine.prefill(document + question)
    asked_scores = engine.block_scores(asked)
    assert [t.shape[0] for t in asked_scores] == [whole.num_blocks] * model.config.num_hidden_layers
    for mine, reference in zip(asked_scores, engine.block_scores(whole)):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)
    for mine, before in zip(asked_scores, doc_scores):
        assert not torch.allclose(mine[:before.shape[0]], before)  # the question changed the ranking


def test_the_mover_never_lets_attention_read_an_unfinished_copy(tiny_models, kv_home, monkeypatch):
    """A slow link, made deterministic: each prefetched copy lands only once attention has come to
    a slot whose copy is still in flight (an event the layer's wait sets), so the layer must wait
    for it; every slot a layer reads has its valid bit set, and the tokens are the exact run's.
    A budget of 12 blocks through 8 slots reads each layer in two passes, so the blocks of the
    first pass have left the slots by the next step and are prefetched again (whole blocks only:
    the block a step writes into is copied when its layer reads it)."""
    import sys
    import threading

    model = tiny_models["llama"]
    ids = random_prompt(24 * BLOCK_TOKENS, seed=56)
    reference = selective(model, kv_home, "lru", 8, kv_path="pool")
    reference.set_selection("lru", 12)
    expected = list(reference.generate(reference.prefill(ids), max_new_tokens=12, stop=()))

    engine = selective(model, kv_home, "lru", 8, kv_path="pool")
    engine.set_selection("lru", 12)
    mover = engine.pool.mover
    waited_for = threading.Event()  # set when attention waits for a copy: only then do prefetches land
    landed, in_flight = [], []  # prefetched copies done; per wait of attention, whether its copy was still out
    real_start, real_wait = mover.start, mover.wait

    def start(copy, valid, slot):
        def slowly():  # on the mover's thread; the bound only turns a regression's hang into a failure
            assert waited_for.wait(timeout=300), "attention never waited for a copy in flight"
            copy()
            landed.append(slot)

        return real_start(slowly, valid, slot)

    def wait(handle):
        if sys._getframe(1).f_code.co_name == "load":  # the pool's load for a layer's attention
            in_flight.append(not handle.done())
            waited_for.set()
        return real_wait(handle)

    monkeypatch.setattr(mover, "start", start)
    monkeypatch.setattr(mover, "wait", wait)
    from kvpage_cli.engine import native

    decode = native.decode_states
    reads = []

    def checked(lib, q, k_addr, v_addr, plan, *args, **kwargs):
        layer = layer_of(k_addr)
        assert layer is not None  # the pool path reads slots only
        assert bool((engine.pool.valid[layer][plan.item_ids.long()] == 1).all()), "read a slot whose copy is not done"
        reads.append(layer)
        return decode(lib, q, k_addr, v_addr, plan, *args, **kwargs)

    def layer_of(k_addr):
        return next((i for i, t in enumerate(engine.pool.k_addr) if t is k_addr), None)

    monkeypatch.setattr(native, "decode_states", checked)
    try:
        tokens = list(engine.generate(engine.prefill(ids), max_new_tokens=12, stop=()))
    finally:
        waited_for.set()  # a failure leaves no copy waiting
    assert tokens == expected
    assert reads and mover.prefetched > 0 and landed
    assert in_flight and in_flight[0]  # the first wait found its copy still in flight: attention did wait
    assert int(engine.pool.invalid_reads) == 0  # the pool's own count, on the device


def test_the_pool_counts_a_slot_handed_out_before_its_copy_landed(tiny_models, kv_home, monkeypatch):
    """A mover that reports its copies done without making them (the bug the valid bits guard
    against): the pool hands out slots whose bit is 0, and its device-side count says how many."""
    from concurrent.futures import Future

    engine = selective(tiny_models["llama"], kv_home, "lru", 8, kv_path="pool")
    engine.set_selection("lru", 12)  # two passes a layer: the first pass's blocks are prefetched again
    mover = engine.pool.mover

    def start(copy, valid, slot):  # never copies, never sets the bit, and says it is done
        valid[slot] = 0
        mover.prefetched += 1
        done = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(mover, "start", start)
    list(engine.generate(engine.prefill(random_prompt(24 * BLOCK_TOKENS, seed=58)), max_new_tokens=4, stop=()))
    assert mover.prefetched > 0
    assert int(engine.pool.invalid_reads) > 0


def test_a_separate_draft_model_ranks_the_blocks(tiny_models, kv_home, tmp_path):
    model = tiny_models["llama"]
    draft = tiny_model("llama", seed=9, num_hidden_layers=1)  # same vocabulary, another model
    draft.save_pretrained(tmp_path)
    ids = random_prompt(24 * BLOCK_TOKENS, seed=57)
    exact = Engine.load(model, EngineConfig(home=str(kv_home)))
    expected = list(exact.generate(exact.prefill(ids), max_new_tokens=10, stop=()))

    large = selective(model, kv_home, "draft", 40, draft_model=str(tmp_path))
    assert large.draft is not None and large.policy.draft_layers == 0
    assert list(large.generate(large.prefill(ids), max_new_tokens=10, stop=())) == expected

    small = selective(model, kv_home, "draft", 6, draft_model=str(tmp_path))
    selections = record_selections(small)
    ctx = small.prefill(ids)
    fork = small.fork(ctx)  # the draft's context forks with ours
    assert fork.draft is not None and fork.draft is not ctx.draft
    list(small.generate(fork, max_new_tokens=10, stop=()))
    assert fork.draft.draft_mass[1]  # the draft's attention arrived, block by block
    assert len(fork.draft.tokens) == len(fork.tokens) - 1  # in lockstep (the last token is not fed yet)
    assert all(len(chosen) <= 6 for _, chosen, _, _, _ in selections)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_models, kv_home, tmp_path):
    tiny_model("llama", vocab_size=500).save_pretrained(tmp_path)
    from kvpage_cli.errors import ModelError

    with pytest.raises(ModelError, match="tokenizer"):
        selective(tiny_models["llama"], kv_home, "draft", 6, draft_model=str(tmp_path))
