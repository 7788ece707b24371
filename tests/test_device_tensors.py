"""On a GPU the queries the engine keeps (an answer's for its evidence, `find`'s, a prompt's for
selective mode and for retrieval's keys and bounds signals) and a decode step's queries live in
the device's memory, while the store's blocks and what is computed from them live in the host's.
An operation that mixes the two fails there. A CPU has one device, so these tests mark those
queries as another device's (`Elsewhere`): an operation that mixes a marked tensor with a host
tensor of more than one element, without moving it to the host first, raises, as CUDA would."""

from __future__ import annotations

import pytest
import torch

from kvpage_cli.engine import BLOCK_TOKENS, Engine, EngineConfig
from kvpage_cli.engine.attention.selector import Selector
from kvpage_cli.engine.engine import Request
from kvpage_cli.ingest import load
from kvpage_cli.tasks import Asker
from kvpage_cli.tasks.find import Finder

from .conftest import SAMPLES, random_prompt, tiny_model, with_native_library


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            target = arg
        elif isinstance(arg, torch.Tensor):
            target = "cpu" if not isinstance(arg, Elsewhere) else None
    return target is not None and torch.device(target).type == "cpu"


class Elsewhere(torch.Tensor):
    """A tensor that stands for one in a GPU's memory (see the module docstring). Results computed
    from it are marked too; `.cpu()` and `.to("cpu")` give an unmarked one. A marked tensor may be
    indexed by host indices (CUDA allows that), nothing else mixes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(args, kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor)
        if func is torch.Tensor.numpy:
            raise RuntimeError("numpy() of a device tensor")
        if func is not torch.Tensor.__getitem__:
            tensors = list(_tensors((args, kwargs)))
            if any(isinstance(t, Elsewhere) for t in tensors) and any(
                    not isinstance(t, Elsewhere) and t.dim() > 0 for t in tensors):
                raise RuntimeError(f"{getattr(func, '__name__', func)} mixes a device tensor with a host tensor")
        return super().__torch_function__(func, types, args, kwargs)


def marked(q: torch.Tensor) -> torch.Tensor:
    return q.as_subclass(Elsewhere)


class _Layers(dict):
    def __setitem__(self, layer, value):
        q, start = value
        super().__setitem__(layer, (marked(q), start))


class _Captured(dict):
    """The dispatch's kept queries (ctx id -> layer -> (q, first position)), each marked."""

    def setdefault(self, key, default=None):
        return super().setdefault(key, _Layers())


def on_a_device(engine: Engine) -> Engine:
    engine.dispatch.captured = _Captured()
    return engine


def test_the_marker_catches_what_cuda_refuses():
    device, host = marked(torch.ones(3, 4)), torch.ones(4, 5)
    with pytest.raises(RuntimeError, match="mixes"):
        device @ host
    with pytest.raises(RuntimeError, match="mixes"):
        torch.cat([device.reshape(-1), host.reshape(-1)])
    assert type(device.cpu() @ host) is torch.Tensor and type(device.to("cpu")) is torch.Tensor
    assert isinstance(device * 2 + device.sum(), Elsewhere)  # a host scalar mixes, as in CUDA
    assert isinstance(device[torch.tensor([0, 2])], Elsewhere)  # host indices index a device tensor


def test_an_answers_evidence_and_find_move_the_device_queries_they_read(tiny_cli_model, tmp_path, native_library):
    with_native_library(tmp_path, native_library)
    engine = on_a_device(Engine.load(str(tiny_cli_model), EngineConfig(home=str(tmp_path), backend="native",
                                                                       max_context=1024, kv_cache=True)))
    doc = load(str(SAMPLES / "contract.txt"))
    asker = Asker(engine, doc, "Which State's laws govern the agreement?", max_new_tokens=6)
    list(asker.answers())
    assert asker.evidence[0]
    finder = Finder(engine, doc)
    assert finder.find("Which laws govern?", count=2)
    finder.release()


@pytest.mark.parametrize("signals", [("lexical", "keys"), ("bounds",)])
def test_retrievals_model_signals_move_the_device_queries_they_read(signals, tiny_cli_model, tmp_path, native_library):
    with_native_library(tmp_path, native_library)
    engine = on_a_device(Engine.load(str(tiny_cli_model), EngineConfig(home=str(tmp_path), backend="native",
                                                                       max_context=1024)))
    doc = load(str(SAMPLES / "contract.txt"))
    question = "Which State's laws govern the agreement?"
    asker = Asker(engine, doc, question, max_new_tokens=2, evidence=False)
    retriever = asker.index()
    assert retriever.select(question, asker.question_ids[0], asker.budget(), signals=signals).blocks


@pytest.mark.parametrize("policy", ["scores", "quest"])
def test_selective_mode_moves_the_device_queries_it_scores_blocks_with(policy, kv_home, monkeypatch):
    model = tiny_model("llama")
    cfg = model.config
    slot_bytes = 2 * cfg.num_key_value_heads * BLOCK_TOKENS * cfg.head_dim * 4
    engine = on_a_device(Engine.load(model, EngineConfig(home=str(kv_home), backend="torch", kv_path="pool",
                                                         mode="selective", policy=policy,
                                                         pool_mib=6 * cfg.num_hidden_layers * slot_bytes / 2**20)))
    select = Selector.select
    monkeypatch.setattr(Selector, "select", lambda self, layer, q, *rest: select(self, layer, marked(q), *rest))
    doc = engine.prefill(random_prompt(24 * BLOCK_TOKENS, seed=7))
    request = Request(engine.fork(doc), [5, 6, 7], max_new_tokens=4, stop=())
    list(engine.run([request]))
    assert len(request.generated) == 4
    assert engine.stats().blocks_attended < engine.stats().blocks_candidate  # it did select


def test_what_reads_the_logits_moves_them_first(tiny_cli_model, tmp_path, native_library, monkeypatch):
    """The model's logits come from the device too: an answer (sampling, its stops), a score and a
    review's zero-shot questions read them."""
    from kvpage_cli.engine.model.runner import ModelRunner
    from kvpage_cli.tasks.review import Reviewer

    with_native_library(tmp_path, native_library)
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, *args: marked(forward(self, *args)))
    engine = on_a_device(Engine.load(str(tiny_cli_model), EngineConfig(home=str(tmp_path), backend="native")))
    doc = load(str(SAMPLES / "repo" / "src" / "ledgerline" / "config.py"))
    asker = Asker(engine, doc, "Where is the VAT rate configured?", max_new_tokens=6)
    list(asker.answers())
    assert asker.evidence[0]
    ctx = engine.prefill(random_prompt(40, seed=3))
    assert isinstance(engine.logits(ctx), Elsewhere)  # the marker holds
    assert len(engine.score(ctx, [5, 6, 7])) == 3
    assert Reviewer(engine, load(str(SAMPLES / "contract.txt")), max_batch=8).findings()
