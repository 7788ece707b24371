"""The decode step on a device (engine/device_step.py), run on the CPU: the torch backend and the
Triton kernels under the interpreter stand for the GPU. What a GPU needs is checked here: a step
reads the device back once (its tokens), nothing inside the layers; its tensors keep their storage
from step to step (what a CUDA graph captures); and it gives the per-layer path's tokens, with the
Triton kernels its very bits."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig
from kvpage_cli.engine.engine import Request
from kvpage_cli.engine.hostreads import HostReads

from .conftest import random_prompt, tiny_model

# head dim 64: a size the Triton kernels take
SHAPE = dict(head_dim=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


def slot_mib(model) -> float:
    """A pool slot in every layer of a SHAPE model: K and V, 2 heads of 64 rows of 64, fp32."""
    return 2 * 2 * BLOCK_TOKENS * 64 * 4 * model.config.num_hidden_layers / 2**20


# the prompt-chunk tests run on the GPU where there is one (bench/gpu_check.sh), else on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load(model, kv_home, backend: str, step: str, pool_mib: float = 4.0, device: str = "cpu", **config) -> Engine:
    return Engine.load(model, EngineConfig(home=str(kv_home), device=device, backend=backend, kv_path="pool",
                                           pool_mib=pool_mib, decode_step=step, **config))


def decode(engine: Engine, document: list[int], batch: int, new_tokens: int, fork: bool = True):
    """Greedy answers of `batch` questions over one document; per sequence its tokens and the
    logits after each step (cloned as they come)."""
    doc = engine.prefill(document)
    requests = [Request(engine.fork(doc) if fork else engine.prefill(document), [7 + i, 11 + i],
                        max_new_tokens=new_tokens, stop=()) for i in range(batch)]
    logits = {id(r): [] for r in requests}
    for request, _ in engine.run(requests):
        logits[id(request)].append(request.ctx.last_logits.clone())
    return [r.generated for r in requests], [logits[id(r)] for r in requests]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_triton_device_step_gives_the_per_layer_paths_bits(arch, kv_home):
    """Forks over one document cross a block boundary while decoding (a new block each, and the
    shared partial block copied on write on the device); Gemma's sliding layers drop blocks."""
    model = tiny_model(arch, **SHAPE, sliding_window=64) if arch == "gemma3_text" else tiny_model(arch, **SHAPE,
                                                                                                 num_hidden_layers=2)
    document = random_prompt(BLOCK_TOKENS + 60, seed=5)  # with the prompts, 2 short of the third block
    host_tokens, host_logits = decode(load(model, kv_home, "triton", "host"), document, 3, 8)
    engine = load(model, kv_home, "triton", "eager")
    tokens, logits = decode(engine, document, 3, 8)
    assert tokens == host_tokens
    for ours, theirs in zip(logits, host_logits):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert int(engine.device_decode.invalid_reads) == 0
    assert engine.device_decode.prefilled_rows > 0 and engine.device_decode.buffers  # both ran on resident slots


def test_the_torch_device_step_agrees_with_the_per_layer_path(kv_home):
    model = tiny_model("llama", seed=3)
    document = random_prompt(3 * BLOCK_TOKENS + 5, seed=6)
    host_tokens, host_logits = decode(load(model, kv_home, "torch", "host"), document, 4, 12)
    engine = load(model, kv_home, "torch", "eager")
    tokens, logits = decode(engine, document, 4, 12)
    assert tokens == host_tokens
    worst = max(float((a - b).abs().max()) for ours, theirs in zip(logits, host_logits) for a, b in zip(ours, theirs))
    assert worst < 1e-4  # the pairs' states in one batch: the same attention, other roundings
    assert int(engine.device_decode.invalid_reads) == 0


@pytest.mark.parametrize("backend,batch", [("torch", 1), ("torch", 16), ("triton", 1), ("triton", 16)])
def test_a_decode_step_reads_the_device_once_and_never_inside_its_layers(backend, batch, kv_home):
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    engine = load(model, kv_home, backend, "eager", pool_mib=32.0)
    doc = engine.prefill(random_prompt(BLOCK_TOKENS + 20, seed=8))
    requests = [Request(engine.fork(doc), [5 + i], max_new_tokens=5, stop=()) for i in range(batch)]
    steps = engine.run(requests)
    for _ in range(2 * batch):  # the prompt's step, then the first decode step (sequences join the pool)
        next(steps)
    with HostReads() as reads:
        for _ in range(2 * batch):  # two steady decode steps
            next(steps)
    assert reads.count == 2, reads.sites  # the tokens, once a step
    assert reads.by_phase["forward"] == 0
    list(steps)


def test_the_read_counter_sees_a_read_added_to_the_layers(kv_home, monkeypatch):
    """The counter behind the test above: an `.item()` in the attention of a step is caught."""
    model = tiny_model("llama", num_hidden_layers=2)
    engine = load(model, kv_home, "torch", "eager")
    ctx = engine.prefill(random_prompt(40, seed=9))
    original = engine.device_decode._attend
    monkeypatch.setattr(engine.device_decode, "_attend", lambda layer, q, bufs: (q.sum().item(), original(layer, q, bufs))[1])
    steps = engine.generate(ctx, [3], max_new_tokens=4, stop=())
    next(steps)
    with HostReads() as reads:
        next(steps)
    assert reads.by_phase["forward"] == 2  # one per layer
    assert reads.count == 3, reads.sites


def test_a_steps_tensors_keep_their_storage_and_padding_changes_no_real_row(kv_home):
    """Three sequences run padded to four: the fourth row is padding. Its buffers are the same
    tensors from step to step; the three real rows get the tokens they get when each sequence
    decodes alone (padded to one, the same as unpadded)."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    document = random_prompt(40, seed=10)
    engine = load(model, kv_home, "triton", "eager")
    doc = engine.prefill(document)
    requests = [Request(engine.fork(doc), [9 + i], max_new_tokens=6, stop=()) for i in range(3)]
    pointers = set()
    for request, _ in engine.run(requests):
        for bufs in engine.device_decode.buffers.values():
            pointers.add((bufs.layout.batch, bufs.meta.data_ptr(), bufs.next_tokens.data_ptr(), bufs.logits.data_ptr(),
                          tuple(s.data_ptr() for s in bufs.states)))
    assert {p[0] for p in pointers} == {4}
    assert len(pointers) == 1  # one shape, the same storage at every step
    for i, request in enumerate(requests):
        alone = load(model, kv_home, "triton", "eager")
        single = Request(alone.fork(alone.prefill(document)), [9 + i], max_new_tokens=6, stop=())
        list(alone.run([single]))
        assert single.generated == request.generated
        assert (single.ctx.last_logits - request.ctx.last_logits).abs().max() < 1e-5


def test_a_steps_buffer_holds_what_packing_it_afresh_writes(kv_home):
    """A group's plan is packed into the step's buffer once and kept while the plan and the slots
    stand. Forks cross into new blocks (new plans, new slots) and finish at different steps (other
    padded sizes, buffers used again): at every step the buffer holds, field by field, what it holds
    when every field is packed afresh over a buffer of junk."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    document = random_prompt(BLOCK_TOKENS - 3, seed=14)

    def buffers_at_each_step(afresh: bool):
        engine = load(model, kv_home, "torch", "eager")
        device, prepare, seen = engine.device_decode, engine.device_decode._prepare, []

        def recorded(requests, starts):
            if afresh:
                for bufs in device.buffers.values():
                    bufs.packed = [None] * len(bufs.packed)
                    bufs.host_np[:] = 12345
            bufs, kv_bytes = prepare(requests, starts)
            seen.append({name: bufs.host_np[part].tolist() for name, part in bufs.layout.fields.items()})
            return bufs, kv_bytes

        device._prepare = recorded
        doc = engine.prefill(document)
        requests = [Request(engine.fork(doc), [7 + i], max_new_tokens=n, stop=()) for i, n in enumerate((6, 9, 14))]
        list(engine.run(requests))
        return seen, [r.generated for r in requests]

    kept, kept_tokens = buffers_at_each_step(afresh=False)
    fresh, fresh_tokens = buffers_at_each_step(afresh=True)
    assert len(kept) == 13 and kept_tokens == fresh_tokens  # 13 device steps: the first token is the prompt's
    for step, (ours, theirs) in enumerate(zip(kept, fresh)):
        assert ours == theirs, f"step {step}: " + ", ".join(name for name in ours if ours[name] != theirs[name])


def test_the_store_holds_the_devices_rows_when_the_host_path_takes_over(kv_home):
    """Decode on the device, then append a prompt (a host-path step reading the store), then decode
    again: the same bits as the host path throughout, the rows the device wrote copied back."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    document = random_prompt(BLOCK_TOKENS - 6, seed=12)

    def run(step: str):
        engine = load(model, kv_home, "triton", step)
        ctx = engine.prefill(document)
        first = list(engine.generate(ctx, [4], max_new_tokens=10, stop=()))  # crosses into a new block
        second = list(engine.generate(ctx, [5, 6, 7], max_new_tokens=3, stop=()))
        return engine, first + second, engine.logits(ctx).clone()

    _, host_tokens, host_logits = run("host")
    engine, tokens, logits = run("eager")
    assert tokens == host_tokens and torch.equal(logits, host_logits)
    assert engine.device_decode.resident.mirrored_blocks > 0


def test_blocks_that_do_not_fit_the_pool_run_on_the_host_path(kv_home):
    """They stream through the pool instead, and the user is told once what pool would keep them
    on the device."""
    from kvpage_cli.engine import EngineWarning

    model = tiny_model("llama", **SHAPE)
    per_slot = slot_mib(model)
    engine = load(model, kv_home, "torch", "eager", pool_mib=4 * per_slot)  # four slots per layer
    assert engine.pool.num_slots == 4
    events = []
    first = (engine.pool.num_slots - 1) * BLOCK_TOKENS
    ctx = engine.prefill(random_prompt(first, seed=13))  # fits: on the device
    assert engine.device_decode.prefilled_rows == first
    engine.append(ctx, random_prompt(8 * BLOCK_TOKENS, seed=14), events.append)  # a chunk that does not
    tokens = list(engine.generate(ctx, [1], max_new_tokens=3, stop=(), on_event=events.append))
    assert len(tokens) == 3 and engine.device_decode.prefilled_rows == first
    assert not engine.device_decode.buffers  # no decode step ran on the device
    assert engine.stats().blocks_moved > 0  # streamed through the pool instead
    warnings = [e.message for e in events if isinstance(e, EngineWarning)]
    assert len(warnings) == 1 and "--pool-mib" in warnings[0], warnings
    wanted = float(warnings[0].split("--pool-mib ")[1].split()[0].replace(",", ""))
    bigger = load(model, kv_home, "torch", "eager", pool_mib=wanted)
    ctx = bigger.append(bigger.prefill(random_prompt(first, seed=13)), random_prompt(8 * BLOCK_TOKENS, seed=14))
    assert list(bigger.generate(ctx, [1], max_new_tokens=3, stop=())) == tokens
    assert bigger.device_decode.prefilled_rows > 0 and bigger.device_decode.buffers  # the pool it named: on the device


@pytest.mark.parametrize("arch,backend", [("llama", "triton"), ("gemma3_text", "triton"), ("llama", "torch")])
def test_prompt_chunks_run_on_the_devices_slots_with_the_per_layer_paths_bits(arch, backend, kv_home):
    """A document in chunks of 48 tokens (chunks that begin and end inside blocks; Gemma's sliding
    layers drop blocks between them), then prompts of three lengths appended to its forks together
    (one copies the shared partial block on write): on the device each chunk's rows go into resident
    slots and attend there, and the logits are the per-layer path's bits. A step the device does
    not take (scoring keeps every row's logits) then reads the rows back from the store."""
    overrides = dict(sliding_window=64) if arch == "gemma3_text" else dict(num_hidden_layers=2)
    model = tiny_model(arch, **SHAPE, **overrides)
    document = random_prompt(5 * 48 + 7, seed=21)
    prompts = [random_prompt(n, seed=30 + n) for n in (5, 70, 33)]

    def run(step: str):
        engine = load(model, kv_home, backend, step, prefill_chunk=48, device=DEVICE)
        doc = engine.prefill(document)
        logits = [engine.logits(doc).clone()]
        forks = [engine.fork(doc) for _ in prompts]
        engine.append_many(forks, prompts)
        logits += [engine.logits(f).clone() for f in forks]
        return engine, logits, engine.score(forks[1], [3, 4, 5])

    _, host_logits, host_scores = run("host")
    engine, logits, scores = run("eager")
    assert all(torch.equal(a, b) for a, b in zip(logits, host_logits))
    assert scores == host_scores
    device = engine.device_decode
    assert device.prefilled_rows == len(document) + sum(map(len, prompts))
    assert int(device.invalid_reads) == 0 and device.resident.loaded_blocks == 0  # nothing came from the store


def test_a_prompt_chunk_reads_no_device_value(kv_home):
    """A chunk on the device reads nothing back in its layers; around them, on a GPU, it waits once
    for its end (its time) and the progress clock once, and the run's end once for the rows copied
    back; on a CPU nothing (the logits are read by whoever samples from them)."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    engine = load(model, kv_home, "triton", "eager", pool_mib=32.0, prefill_chunk=64, device=DEVICE)
    ctx = engine.prefill(random_prompt(3 * BLOCK_TOKENS, seed=22))
    with HostReads() as reads:
        engine.append(ctx, random_prompt(2 * BLOCK_TOKENS + 9, seed=23))  # three chunks
    assert engine.device_decode.prefilled_rows == 5 * BLOCK_TOKENS + 9
    assert reads.by_phase["forward"] == 0, reads.sites
    assert reads.count <= (2 * 3 + 1 if DEVICE == "cuda" else 0), reads.sites


def test_a_fork_of_a_document_whose_block_was_evicted_copies_it_from_the_store(kv_home):
    """A document's partly filled block leaves the pool for another document's chunks; then a fork
    of the first appends, which copies that block on write from the store and loads the copy into
    a slot: the fork's logits are the per-layer path's."""
    model = tiny_model("llama", **SHAPE)
    per_slot = slot_mib(model)

    def run(step: str):
        engine = load(model, kv_home, "torch", step, pool_mib=4 * per_slot, prefill_chunk=64)
        first = engine.prefill(random_prompt(BLOCK_TOKENS - 4, seed=31))  # one block, partly filled
        engine.prefill(random_prompt(4 * BLOCK_TOKENS, seed=32))  # four blocks: the first one's slot goes
        fork = engine.append(engine.fork(first), random_prompt(2, seed=33))
        return engine, engine.logits(fork).clone()

    _, host_logits = run("host")
    engine, logits = run("eager")
    assert engine.device_decode.resident.evicted_blocks > 0 and engine.device_decode.prefilled_rows > 0
    assert torch.equal(logits, host_logits)


def test_the_saved_kv_cache_keeps_the_rows_a_device_prefill_wrote(tmp_path):
    """Saved chunk by chunk while the device prefills (the store must hold each chunk's rows when
    its segment is saved), the blocks restored by a per-layer engine give the logits it computes."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    document = random_prompt(4 * BLOCK_TOKENS + 11, seed=24)
    saving = load(model, tmp_path, "torch", "eager", prefill_chunk=64, kv_cache=True, device=DEVICE)
    saved = saving.prefill(document, label="doc")
    assert saving.device_decode.prefilled_rows == len(document)
    restoring = load(model, tmp_path, "torch", "host", prefill_chunk=64, kv_cache=True, device=DEVICE)
    restored = restoring.prefill(document, label="doc")
    assert restored.cached_prefix == 4 * BLOCK_TOKENS
    computed = load(model, tmp_path, "torch", "host", prefill_chunk=64, device=DEVICE)
    expected = computed.logits(computed.prefill(document))
    assert torch.equal(restoring.logits(restored), expected)
    assert torch.equal(saving.logits(saved), expected)


def test_a_decode_step_that_does_not_fit_says_so_to_the_runs_callback(kv_home):
    """The prompt fills the pool exactly (on the device); its first decode step needs one block
    more: the warning reaches the callback of the run that decodes."""
    from kvpage_cli.engine import EngineWarning

    model = tiny_model("llama", **SHAPE)
    per_slot = slot_mib(model)
    engine = load(model, kv_home, "torch", "eager", pool_mib=4 * per_slot)
    ctx = engine.prefill(random_prompt(4 * BLOCK_TOKENS, seed=41))
    assert engine.device_decode.prefilled_rows == 4 * BLOCK_TOKENS
    events = []
    assert len(list(engine.generate(ctx, [], max_new_tokens=2, stop=(), on_event=events.append))) == 2
    warnings = [e.message for e in events if isinstance(e, EngineWarning)]
    assert len(warnings) == 1 and "reads 5 blocks per layer" in warnings[0], warnings


def selective_decode(model, kv_home, backend: str, step: str, policy: str, document: list[int], new_tokens: int,
                     recent: int):
    """Three forks decoded in selective mode, 3 blocks a query (the first, the `recent` last and
    the best others): their tokens and logits, and the engine."""
    engine = load(model, kv_home, backend, step, mode="selective", policy=policy)
    engine.set_selection(policy, budget=3, recent_blocks=recent)
    return (*decode(engine, document, 3, new_tokens), engine)


@pytest.mark.parametrize("arch,backend,policy,recent", [("llama", "triton", "quest", 0),
                                                        ("gemma3_text", "triton", "scores", 1),
                                                        ("llama", "torch", "quest", 1), ("llama", "torch", "scores", 1)])
def test_selective_mode_on_the_device_chooses_the_per_layer_paths_blocks(arch, backend, policy, recent, kv_home):
    """Each layer's blocks chosen on the device (the quest policy's key bounds kept per slot, or the
    scores policy's relevance packed with the plan): the blocks the per-layer path's selector
    chooses, so its tokens, and with the Triton kernels its bits. The forks cross into a new block
    (its bounds start again; with no recent block kept, the tail competes by the bounds of the
    rows the device wrote) and Gemma's sliding layers read their whole window."""
    model = tiny_model(arch, **SHAPE, sliding_window=64) if arch == "gemma3_text" else tiny_model(arch, **SHAPE,
                                                                                                 num_hidden_layers=2)
    document = random_prompt(5 * BLOCK_TOKENS + 54, seed=17)  # with the prompts, 8 tokens short of a new block
    host_tokens, host_logits, host = selective_decode(model, kv_home, backend, "host", policy, document, 12,
                                                      recent)
    tokens, logits, engine = selective_decode(model, kv_home, backend, "eager", policy, document, 12, recent)
    assert any(key[2] is not None for key in engine.device_decode.buffers)  # steps chose on the device
    assert tokens == host_tokens
    pairs = [(a, b) for ours, theirs in zip(logits, host_logits) for a, b in zip(ours, theirs)]
    if backend == "triton":
        assert all(torch.equal(a, b) for a, b in pairs)
    else:  # the pairs' states in one batch: the same attention, other roundings
        assert max(float((a - b).abs().max()) for a, b in pairs) < 1e-4
    assert engine.metrics.blocks_attended == host.metrics.blocks_attended < engine.metrics.blocks_candidate
    assert engine.metrics.blocks_candidate == host.metrics.blocks_candidate
    assert int(engine.device_decode.invalid_reads) == 0


def test_the_hosts_key_bounds_take_in_the_rows_the_device_wrote(kv_home):
    """After decoding on the device, the quest policy's bounds on the host (which steps on the
    per-layer path choose by) are those of every row now in the store, the device's included."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    engine = load(model, kv_home, "torch", "eager", mode="selective", policy="quest")
    engine.set_selection("quest", budget=3, recent_blocks=1)
    ctx = engine.prefill(random_prompt(5 * BLOCK_TOKENS + 54, seed=19))
    list(engine.generate(ctx, [3], max_new_tokens=12, stop=()))  # crosses into a seventh block
    assert engine.device_decode.buffers and ctx.num_blocks == 7
    store, bounds = engine.store, engine.key_bounds
    for layer in range(2):
        group, pos = store.group_of(layer), store.layer_pos[layer]
        for p, block_id in enumerate(ctx.tables[group.index].ids):
            k = group.k_values(pos, block_id)[:, :min(BLOCK_TOKENS, ctx.num_cached - p * BLOCK_TOKENS)].float()
            assert torch.equal(bounds.kmin[layer][block_id], k.amin(dim=1))
            assert torch.equal(bounds.kmax[layer][block_id], k.amax(dim=1))


@pytest.mark.parametrize("policy", ["quest", "scores"])
def test_a_selective_step_reads_the_device_once_and_never_inside_its_layers(policy, kv_home):
    """The choice is made on the device: the step's one readback brings the tokens and the count of
    blocks chosen."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=2)
    engine = load(model, kv_home, "torch", "eager", pool_mib=32.0, mode="selective", policy=policy)
    engine.set_selection(policy, budget=2, recent_blocks=1)
    doc = engine.prefill(random_prompt(4 * BLOCK_TOKENS + 20, seed=18))
    requests = [Request(engine.fork(doc), [5 + i], max_new_tokens=5, stop=()) for i in range(16)]
    steps = engine.run(requests)
    for _ in range(32):  # the prompts' step, then the first decode step (sequences join the pool)
        next(steps)
    with HostReads() as reads:
        for _ in range(32):  # two steady decode steps
            next(steps)
    assert reads.count == 2, reads.sites
    assert reads.by_phase["forward"] == 0
    list(steps)
    assert any(key[2] is not None for key in engine.device_decode.buffers)
    assert engine.metrics.blocks_attended < engine.metrics.blocks_candidate


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (bench/gpu_check.sh runs this)")
@pytest.mark.parametrize("batch", [1, 5, 16])
def test_on_a_gpu_the_graph_the_eager_step_and_the_per_layer_path_give_the_same_bits(batch, kv_home):
    """The step captured as a CUDA graph, the same step run eagerly, and the per-layer path with a
    one-slot pool (every block streamed) and a pool holding everything: the same tokens, the same
    bits where the batch needs no padding (1, 16), within 1e-4 where it does (5 rows run as 8)."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=4)
    document = random_prompt(3 * BLOCK_TOKENS + 10, seed=14)
    runs = {}
    for name, step, pool_mib in (("graph", "graph", 64.0), ("eager", "eager", 64.0), ("host", "host", 64.0),
                                 ("one slot", "host", None)):
        if pool_mib is None:
            pool_mib = slot_mib(model)  # one slot per layer
        engine = Engine.load(model, EngineConfig(home=str(kv_home), device="cuda", backend="triton", kv_path="pool",
                                                 pool_mib=pool_mib, decode_step=step))
        runs[name] = decode(engine, document, batch, 24)
        if step == "graph":
            assert any(b.graph for b in engine.device_decode.buffers.values())
            assert int(engine.device_decode.invalid_reads) == 0
    tokens, logits = runs["graph"]
    for name, (other_tokens, other_logits) in runs.items():
        assert other_tokens == tokens, name
        for ours, theirs in zip(logits, other_logits):
            if name == "eager" or batch in (1, 16):  # the same rows through the weights: the same bits
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), name
            else:  # 5 rows padded to 8: cuBLAS may choose another kernel for 8 rows than for 5
                assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-4, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (bench/gpu_check.sh runs this)")
@pytest.mark.parametrize("policy", ["quest", "scores"])
def test_on_a_gpu_selective_mode_chooses_in_the_graph_as_the_per_layer_path_does(policy, kv_home):
    """Selective mode's choice (sorts, scatters, the bounds' updates) captured in the CUDA graph:
    the per-layer path's tokens, and its bits where the batch needs no padding (4 forks)."""
    model = tiny_model("llama", **SHAPE, num_hidden_layers=4)
    document = random_prompt(5 * BLOCK_TOKENS + 54, seed=17)
    runs = {}
    for step in ("graph", "host"):
        engine = load(model, kv_home, "triton", step, pool_mib=64.0, device="cuda", mode="selective", policy=policy)
        engine.set_selection(policy, budget=3, recent_blocks=1)
        runs[step] = (*decode(engine, document, 4, 12), engine)
    tokens, logits, engine = runs["graph"]
    assert any(b.graph for b in engine.device_decode.buffers.values())
    assert any(key[2] is not None for key in engine.device_decode.buffers)
    assert tokens == runs["host"][0]
    assert all(torch.equal(a, b) for ours, theirs in zip(logits, runs["host"][1]) for a, b in zip(ours, theirs))
    assert engine.metrics.blocks_attended == runs["host"][2].metrics.blocks_attended
