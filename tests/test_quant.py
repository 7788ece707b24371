"""Weights kept quantized: the native kernels against the gguf package's reference, the formats
made at load, and engines that run on them (batched, paged, on the real models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig, native
from kvpage_cli.engine.quant import (BF16, BLOCKS, F16, F32, I8_ROW, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
                                     QuantMatrix, UnsupportedFormat, quantize)
from kvpage_cli.errors import ModelError, UsageError

from .conftest import random_prompt, tiny_model
from .test_batch import batched, one_at_a_time

FORMATS = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32]
SCALE_OFFSETS = {Q4_0: [0], Q4_1: [0, 2], Q5_0: [0], Q5_1: [0, 2], Q8_0: [0], Q4_K: [0, 2], Q5_K: [0, 2], Q6_K: [208]}


@pytest.fixture(scope="module")
def lib(kv_home):
    try:
        return native.load(kv_home)
    except native.NativeUnavailable as exc:
        pytest.fail(f"the native kernels must build on the test machines: {exc}")


def random_matrix(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `qtype`: every quantized bit pattern is valid; the fp16 scales are kept
    finite and of realistic size."""
    rng = np.random.default_rng(seed)
    if qtype in (F16, F32):
        values = rng.standard_normal((rows, cols)).astype(np.float16 if qtype == F16 else np.float32)
        return np.ascontiguousarray(values.view(np.uint8))
    if qtype == BF16:
        return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).view(torch.uint8).numpy()
    values, size = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def reference(qtype: int, data: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = np.array(dequantize(data, GGMLQuantizationType(qtype)), dtype=np.float32)
    return torch.from_numpy(values.reshape(rows, cols))


@pytest.mark.parametrize("qtype", FORMATS, ids=str)
def test_every_format_dequantizes_as_the_gguf_reference_bit_for_bit(qtype, lib):
    rows, cols = 40, 512
    data = random_matrix(qtype, rows, cols)
    matrix = QuantMatrix(qtype, data, rows, cols)
    assert torch.equal(matrix.dequantize(lib), reference(qtype, data, rows, cols))
    picked = torch.tensor([7, 0, 39, 7])
    assert torch.equal(matrix.take(lib, picked), reference(qtype, data, rows, cols)[picked])


@pytest.mark.parametrize("qtype", FORMATS, ids=str)
def test_a_few_rows_get_the_bits_they_get_alone_and_the_product_of_the_dequantized_weights(qtype, lib):
    rows, cols = 72, 768
    data = random_matrix(qtype, rows, cols, seed=1)
    matrix = QuantMatrix(qtype, data, rows, cols)
    w = reference(qtype, data, rows, cols).double()
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(2))
    exact = (x.double() @ w.t()).float()
    tolerance = 1e-5 * (x.abs().double() @ w.abs().t()).float()  # fp32 rounding of a sum of |terms|
    few = matrix.matmul(lib, x, few_rows=True)
    many = matrix.matmul(lib, x, few_rows=False)
    assert ((few - exact).abs() <= tolerance).all()
    assert ((many - exact).abs() <= tolerance).all()
    for r in range(x.shape[0]):  # a row's bits do not depend on the rows beside it
        assert torch.equal(matrix.matmul(lib, x[r:r + 1], few_rows=True)[0], few[r])


def test_a_permuted_matrix_gives_its_outputs_in_feature_order(lib):
    data = random_matrix(Q8_0, 8, 64, seed=3)
    perm = torch.tensor([3, 1, 7, 0, 2, 6, 4, 5])
    plain, permuted = QuantMatrix(Q8_0, data, 8, 64), QuantMatrix(Q8_0, data, 8, 64, perm)
    x = torch.randn(3, 64)
    assert torch.equal(permuted.matmul(lib, x, True), plain.matmul(lib, x, True)[:, perm])
    assert torch.equal(permuted.dequantize(lib), plain.dequantize(lib)[perm])


@pytest.mark.parametrize("fmt, step", [("bfloat16", 2.0 ** -7), ("int8", 1 / 127), ("int4", 1 / 15)])
def test_weights_made_at_load_are_within_half_a_step_of_the_float_weights(fmt, step, lib):
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(4))
    matrix = quantize(weight, fmt)
    error = (matrix.dequantize(lib) - weight).abs()
    if fmt == "bfloat16":
        assert (error <= weight.abs() * step / 2 * 1.001).all()
    elif fmt == "int8":  # a scale per row: max |w| / 127
        assert (error <= weight.abs().amax(1, keepdim=True) * step / 2 * 1.01).all()
    else:  # groups of 32 from their min to their max in 15 steps (fp16 scales: a little more)
        groups = weight.view(96, 8, 32)
        spread = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)).expand(-1, -1, 32).reshape(96, 256)
        assert (error <= spread * step * 0.6 + 1e-3).all()
    assert matrix.nbytes < weight.numel() * {"bfloat16": 2.01, "int8": 1.02, "int4": 0.63}[fmt]


@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_batch_on_compact_weights_gives_every_sequence_the_bits_it_gets_alone(fmt, arch, kv_home):
    engine = Engine.load(tiny_model(arch), EngineConfig(home=str(kv_home), backend="native", weights=fmt, pool_mib=0.2))
    assert engine.runner.weights == fmt
    assert list(engine.runner.weight_formats()) == [{"int8": "int8", "int4": "Q4_1", "bfloat16": "BF16"}[fmt]]
    doc = engine.prefill(random_prompt(3 * BLOCK_TOKENS + 9, seed=5))
    questions = [random_prompt(n, seed=80 + n) for n in (1, 7, 70, 3)]
    new_tokens = [5, 2, 3, 6]
    alone_tokens, alone_logits = one_at_a_time(engine, doc, questions, new_tokens)
    tokens, logits, _ = batched(engine, doc, questions, new_tokens, max_batch=3)
    assert tokens == alone_tokens
    for a, b in zip(alone_logits, logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt, close", [("bfloat16", 0.02), ("int8", 0.05), ("int4", 0.5)])
def test_compact_weights_compute_nearly_the_float_model(fmt, close, kv_home):
    model = tiny_model("qwen3")
    prompt = random_prompt(150, seed=6)
    base = Engine.load(model, EngineConfig(home=str(kv_home), backend="native", weights="float32"))
    other = Engine.load(model, EngineConfig(home=str(kv_home), backend="native", weights=fmt))
    a, b = base.prefill(prompt).last_logits, other.prefill(prompt).last_logits
    assert (a - b).abs().max() <= close * a.abs().max()
    assert base.stats().weight_bytes > other.stats().weight_bytes
    assert base.fingerprint != other.fingerprint  # saved KV of one is never read by the other


def test_formats_that_cannot_apply_say_why(kv_home):
    with pytest.raises(ModelError, match="not a GGUF file"):
        Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home), backend="native", weights="gguf"))
    with pytest.raises(UsageError, match="native CPU kernels"):
        Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home), backend="torch", weights="int8"))
    with pytest.raises(UnsupportedFormat, match="IQ4_NL are not supported"):  # auto falls back to float32 on it
        QuantMatrix(20, np.zeros((4, 18), np.uint8), 4, 32)
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int3")
    auto = Engine.load(tiny_model("llama"), EngineConfig(home=str(kv_home), backend="torch"))
    assert auto.runner.weights == "float32"  # auto: float32 where the native kernels do not run


@pytest.mark.real_model
def test_smollm2_runs_on_its_gguf_blocks_as_on_the_dequantized_weights(smollm2, kv_home):
    """The default model keeps its file's Q4_1/Q8_0 blocks (auto) and computes what the weights
    dequantized to fp32 compute, up to the order of the sums."""
    assert smollm2.runner.weights == "gguf"
    assert set(smollm2.runner.weight_formats()) == {"Q4_1", "Q8_0"}
    assert smollm2.stats().weight_bytes < 100 * 2**20  # fp32: 513 MiB
    dense = Engine.load("smollm2", EngineConfig(home=str(kv_home), pool_mib=16, weights="float32"))
    ids = smollm2.tokenizer("Termination. Either party may terminate this Agreement upon thirty days' notice.")["input_ids"]
    a, b = smollm2.prefill(ids), dense.prefill(ids)
    assert (a.last_logits - b.last_logits).abs().max() < 1e-3 * a.last_logits.abs().max()
    assert list(smollm2.generate(a, max_new_tokens=16, stop=())) == list(dense.generate(b, max_new_tokens=16, stop=()))
