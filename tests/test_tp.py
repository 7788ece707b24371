"""Tensor parallelism on CPU: 2 ranks joined by gloo give the tokens one process gives.

Each test saves a tiny random model as a folder, runs the same work in one process and in two
ranks started by `parallel.spawn`, and compares: greedy tokens equal, logits within TP_TOLERANCE
(the all-reduce adds the ranks' partial sums in another order than one process's matrix
product), each rank holding its own heads' KV.
"""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import Engine, EngineConfig
from kvpage_cli.engine.parallel import Shard, spawn
from kvpage_cli.errors import ModelError, UsageError

from .conftest import TINY_ARCHS, random_prompt, tiny_model

TP_TOLERANCE = 1e-3  # logits of order 1-10 (conftest's init); one process vs two ranks, float32


def work(engine: Engine, prompt: list[int]) -> dict:
    """What is compared: the logits after a prefill and after each of a few decode steps, the
    greedy tokens of a longer decode, and the KV bytes one token takes in the store."""
    ctx = engine.prefill(prompt)
    first = engine.logits(ctx).clone()
    steps = []
    for token in prompt[:4]:
        list(engine.generate(ctx, [token], max_new_tokens=0))
        steps.append(engine.logits(ctx).clone())
    tokens = list(engine.generate(ctx, max_new_tokens=24, stop=()))
    return {"first": first, "steps": torch.stack(steps), "tokens": tokens,
            "kv_bytes_per_token": engine.kv_bytes_per_token(), "num_kv_heads": engine.spec.num_kv_heads,
            "weight_bytes": engine.runner.weight_bytes}


def _rank(rank: int, folder: str, home: str, config: dict, prompt: list[int], out: str) -> None:
    torch.set_num_threads(1)
    engine = Engine.load(folder, EngineConfig(home=home, tp=2, **config))
    torch.save(work(engine, prompt), f"{out}.{rank}")


def run_both(model, tmp_path, kv_home, config: dict, prompt: list[int]) -> tuple[dict, list[dict]]:
    folder = tmp_path / "model"
    model.save_pretrained(folder, safe_serialization=True)
    alone = work(Engine.load(str(folder), EngineConfig(home=str(kv_home), **config)), prompt)
    out = str(tmp_path / "result")
    spawn(_rank, 2, (str(folder), str(kv_home), config, prompt, out))
    return alone, [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_two_ranks_give_the_tokens_of_one_process(arch, tmp_path, kv_home):
    prompt = random_prompt(300, seed=5)  # past the sliding window (100) of mistral and gemma3
    alone, ranks = run_both(tiny_model(arch), tmp_path, kv_home, {"prefill_chunk": 128, "pool_mib": 1.0}, prompt)
    for result in ranks:
        assert result["tokens"] == alone["tokens"], arch
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert (result["steps"] - alone["steps"]).abs().max().item() < TP_TOLERANCE
        # each rank stores its own KV heads: half of one process's bytes per token
        assert result["num_kv_heads"] * 2 == alone["num_kv_heads"]
        assert result["kv_bytes_per_token"] * 2 == alone["kv_bytes_per_token"]
    assert alone["first"].abs().max() > 1.0  # logits big enough for the tolerance to mean something


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path, kv_home):
    """Gemma 3 270M has one KV head: each rank keeps it, its query heads split."""
    model = tiny_model("gemma3_text", num_key_value_heads=1)
    alone, ranks = run_both(model, tmp_path, kv_home, {"pool_mib": 1.0}, random_prompt(200, seed=9))
    for result in ranks:
        assert result["tokens"] == alone["tokens"]
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert result["num_kv_heads"] == alone["num_kv_heads"] == 1


@pytest.mark.parametrize("weights", ["int8", "int4", "bfloat16"])
def test_compact_weights_split_the_same_way(weights, tmp_path, kv_home):
    """Formats made at load are made from each rank's part, so a rank holds about half the bytes."""
    prompt = random_prompt(150, seed=2)
    alone, ranks = run_both(tiny_model("llama", hidden_size=128, intermediate_size=256, head_dim=32), tmp_path,
                            kv_home, {"pool_mib": 1.0, "weights": weights, "backend": "native"}, prompt)
    for result in ranks:
        assert result["tokens"] == alone["tokens"], weights
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert result["weight_bytes"] < 0.6 * alone["weight_bytes"]


def test_kv_heads_that_do_not_divide_are_shared_out_unevenly(tmp_path, kv_home):
    """SmolLM2-135M's shape: 9 query heads over 3 KV heads, on 2 ranks: 2 KV heads and 1."""
    model = tiny_model("llama", num_attention_heads=9, num_key_value_heads=3, head_dim=16, hidden_size=144,
                       intermediate_size=96)
    alone, ranks = run_both(model, tmp_path, kv_home, {"pool_mib": 1.0}, random_prompt(200, seed=4))
    for result in ranks:
        assert result["tokens"] == alone["tokens"]
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
    assert [r["num_kv_heads"] for r in ranks] == [2, 1]
    assert sum(r["kv_bytes_per_token"] for r in ranks) == alone["kv_bytes_per_token"]


def test_a_model_that_does_not_divide_is_refused():
    from kvpage_cli.engine.spec import spec_from_config

    from .conftest import tiny_config

    spec = spec_from_config(tiny_config("gemma3_text", num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ModelError, match="cannot be split over 4 ranks"):  # one KV head read by 2 query heads
        Shard(0, 4).check(spec)
    Shard(1, 2).check(spec)  # over 2 ranks: each keeps the KV head and one query head
    shares = [Shard(rank, 4).mlp(spec) for rank in range(4)]
    assert [len(r) for r in shares] == [32] * 4 and shares[-1].stop == spec.intermediate_size


def test_tp_without_a_process_group_says_how_to_start_one(tmp_path, kv_home):
    with pytest.raises(UsageError, match="--tp 2"):
        Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home), tp=2))


def _real_rank(rank: int, model: str, home: str, text: str, out: str) -> None:
    torch.set_num_threads(1)
    engine = Engine.load(model, EngineConfig(home=home, tp=2))
    torch.save(work(engine, engine.tokenizer(text)["input_ids"]), f"{out}.{rank}")


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_the_shipped_models_on_two_ranks_give_their_tokens(model, tmp_path, kv_home):
    """Their GGUF blocks split by rows (heads, MLP rows, vocabulary) and by block-aligned columns:
    SmolLM2's 9 query heads over 3 KV heads go 6 and 3, Gemma's one KV head to both ranks."""
    from .conftest import SAMPLES

    text = (SAMPLES / "contract.txt").read_text()[:1500]
    engine = Engine.load(model, EngineConfig(home=str(kv_home)))
    alone = work(engine, engine.tokenizer(text)["input_ids"])
    del engine
    out = str(tmp_path / "result")
    spawn(_real_rank, 2, (model, str(kv_home), text, out))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for result in ranks:
        assert result["tokens"] == alone["tokens"]
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert (result["steps"] - alone["steps"]).abs().max().item() < TP_TOLERANCE
        assert result["weight_bytes"] < 0.6 * alone["weight_bytes"]
    assert alone["first"].abs().max() > 10
