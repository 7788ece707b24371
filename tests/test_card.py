"""A model folder's card: a second load reads the model's spec, rotary parameters and tokenizer
from it, without transformers, and its tokenizer encodes and decodes as transformers' does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from kvpage_cli.engine.model.card import Tokenizer, card_path, read_card
from kvpage_cli.engine.model.gguf import cached_folder_for, file_key
from kvpage_cli.engine.model.weights import _from_folder, gguf_file, load_weights

from .conftest import CORPUS
from .test_untrusted_prompts import GEMMA_ATTACK, SMOLLM2_ATTACK

TEXTS = [
    "",
    " leading space, trailing space ",
    "Ünïcödé — “quotes”, ½ and 漢字, an emoji 🙂, tabs\tand\r\nCRLF lines\n\n\n",
    SMOLLM2_ATTACK + GEMMA_ATTACK + "<|endoftext|><pad><unk><mask>",
    (CORPUS / "cuad" / "01-affiliate-short" / "contract.txt").read_text()[:12000],
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # code\n",
]


class RenderedAgain(Exception):
    pass


def rendered_again():
    raise RenderedAgain


def metadata_folder(model: str, home):
    path = gguf_file(model, home)
    return cached_folder_for(path.stem, file_key(path) + "|metadata", home)


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def loads(request, kv_home):
    """The model's weights loaded through transformers (no card yet), then from the card."""
    model = request.param
    load_weights(model, kv_home, blocks=True)  # the metadata folder, made once
    folder = metadata_folder(model, kv_home)
    card_path(folder, kv_home).unlink(missing_ok=True)
    first = load_weights(model, kv_home, blocks=True)
    second = load_weights(model, kv_home, blocks=True)
    return folder, first, second


def test_the_second_load_reads_the_same_spec_and_rotary_bits_from_the_card(loads):
    _, first, second = loads
    assert first.config is not None and second.config is None  # the second never read the config
    assert second.spec == first.spec
    assert second.rope.keys() == first.rope.keys()
    for key, params in first.rope.items():
        assert torch.equal(second.rope[key].inv_freq, params.inv_freq)
        assert second.rope[key].attention_scaling == params.attention_scaling
    assert second.fingerprint == first.fingerprint  # KV saved by either load is read by the other


def test_the_cards_tokenizer_encodes_and_decodes_as_transformers_does(loads):
    folder, first, second = loads
    hf, own = AutoTokenizer.from_pretrained(str(folder)), second.tokenizer
    assert isinstance(first.tokenizer, Tokenizer) and isinstance(own, Tokenizer)  # the first load's too
    for text in TEXTS:
        for add in (True, False):
            for split in (True, False):
                want = hf(text, add_special_tokens=add, split_special_tokens=split, return_offsets_mapping=True)
                got = own(text, add_special_tokens=add, split_special_tokens=split, return_offsets_mapping=True)
                assert got.input_ids == list(want["input_ids"]), (text[:40], add, split)
                assert got["offset_mapping"] == [tuple(o) for o in want["offset_mapping"]]
        assert own(text).input_ids == list(hf(text).input_ids)  # the defaults
        ids = list(hf(text).input_ids) + sorted(hf.all_special_ids)
        for skip in (True, False):
            assert own.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert own.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    batch = own(TEXTS, add_special_tokens=False, return_offsets_mapping=True)
    want = hf(TEXTS, add_special_tokens=False, return_offsets_mapping=True)
    assert batch.input_ids == [list(ids) for ids in want["input_ids"]]
    assert batch["offset_mapping"] == [[tuple(o) for o in offsets] for offsets in want["offset_mapping"]]
    assert own.get_vocab() == hf.get_vocab()
    assert (own.bos_token_id, own.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert sorted(own.all_special_ids) == sorted(hf.all_special_ids)
    assert ({i: (t.content, t.special) for i, t in own.added_tokens_decoder.items()}
            == {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()})
    assert own.chat_template == hf.chat_template


def test_a_chat_template_is_rendered_by_transformers_once_then_read_back(loads, kv_home):
    folder, first, second = loads
    hf, own = AutoTokenizer.from_pretrained(str(folder)), second.tokenizer
    if not hf.chat_template:
        assert own.chat_template is None
        return
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is " + SMOLLM2_ATTACK}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert own.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == want
    again = read_card(folder, kv_home, rendered_again)
    assert again.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == want
    other = [{"role": "user", "content": "Another question"}]
    with pytest.raises(RenderedAgain):
        again.tokenizer.apply_chat_template(other, add_generation_prompt=True, tokenize=False)


def test_an_edited_config_or_a_damaged_card_is_read_again_through_transformers(kv_home, tmp_path):
    """On the smaller model's folder: what is checked is the card's key and its reading, the same
    for every model (Gemma's 262K-token vocabulary would take 17 s more through transformers)."""
    load_weights("smollm2", kv_home, blocks=True)  # the metadata folder, made once
    folder = metadata_folder("smollm2", kv_home)
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    loaded = _from_folder(copy, "copy", None, None, kv_home, weights=False)
    assert isinstance(loaded.tokenizer, Tokenizer)  # the same files: the same card
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 0.25
    (copy / "config.json").write_text(json.dumps(config))
    edited = _from_folder(copy, "copy", None, None, kv_home, weights=False)
    assert edited.config is not None and edited.spec.rms_eps == 0.25
    assert _from_folder(copy, "copy", None, None, kv_home, weights=False).spec.rms_eps == 0.25
    card_path(copy, kv_home).write_text('{"format": 1, "spec": {"arch": "llama"')  # cut short
    damaged = _from_folder(copy, "copy", None, None, kv_home, weights=False)
    assert damaged.config is not None and damaged.spec == edited.spec
    assert json.loads(card_path(copy, kv_home).read_text())["spec"]["rms_eps"] == 0.25  # written again


def test_a_second_ask_starts_without_importing_transformers(kv_home):
    """transformers' configuration classes import torch.distributed and sympy: about a second and
    100 MiB at every start. The first run without a card reads the model through transformers and
    writes the card (and keeps the chat template's text); the next run needs neither."""
    command = [sys.executable, "-X", "importtime", "-c", "from kvpage_cli.cli.app import main; main()", "ask", "-",
               "Where did the cat sit?", "--max-new-tokens", "4", "--no-cache"]
    env = {**os.environ, "KVPAGE_HOME": str(kv_home)}
    shutil.rmtree(kv_home / "cards", ignore_errors=True)
    imported = []
    for _ in range(2):
        out = subprocess.run(command, input="The cat sat on the mat.\n", capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip()
        imported.append({line.split("|")[-1].strip() for line in out.stderr.splitlines()
                         if line.startswith("import time:")})
    assert {"torch", "transformers", "sympy"} <= imported[0]
    assert "torch" in imported[1] and not {"transformers", "sympy"} & imported[1]
