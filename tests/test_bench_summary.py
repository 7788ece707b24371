"""bench/: every result is a stamped document, and the tables made from them are current.

No benchmark runs here: the result files are read, and write_result writes a small payload.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402
import compare  # noqa: E402
import summary  # noqa: E402

STAMP = {"migrated", "commit", "dirty", "date", "machine", "cpu", "cores", "threads", "gpu", "versions", "command",
         "args"}


def test_bench_readme_and_docs_tables_are_those_the_results_give():
    for path, text in summary.expected().items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is out of date: run python bench/summary.py"


@pytest.mark.parametrize("path", sorted(p for p in common.RESULTS.rglob("*") if p.is_file()),
                         ids=lambda p: str(p.relative_to(common.RESULTS)))
def test_a_result_is_a_stamped_document_of_its_benchmark(path):
    assert path.suffix == ".json" and path.parent.parent == common.RESULTS
    document = json.loads(path.read_text())
    assert document["schema"] == common.SCHEMA
    assert document["bench"] == path.parent.name and document["bench"] in summary.BENCHMARKS
    stamp = document["stamp"]
    assert set(stamp) - {"migrated_from", "note"} == STAMP
    assert re.fullmatch(r"[0-9a-f]{40}", stamp["commit"]) and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:]{8}\+00:00", stamp["date"])
    # the file's name says when, where and on which commit
    assert path.name.startswith(f"{stamp['date'][:10]}-{stamp['cpu']['tag']}-") and stamp["commit"][:7] in path.name
    if stamp["migrated"]:
        assert stamp["migrated_from"].startswith("bench/results/") and stamp["dirty"] is None
    else:
        assert set(stamp["cpu"]["flags"]) == set(common.CPU_FLAGS) and stamp["versions"]["torch"]
    assert summary.HEADLINES[document["bench"]](document["results"], stamp)


def test_write_result_stamps_the_run_and_never_replaces_an_earlier_result(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    args = argparse.Namespace(contexts="256", json_path=None, worker=None)
    first = common.write_result("engine", args, {"rows": [{"context": 256, "decode_tok_s": 10.0}]})
    second = common.write_result("engine", args, {"rows": []})
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    document = json.loads(first.read_text())
    stamp = document["stamp"]
    assert document["schema"] == common.SCHEMA and document["bench"] == "engine"
    assert document["results"] == {"rows": [{"context": 256, "decode_tok_s": 10.0}]}
    assert stamp["commit"] == head and stamp["migrated"] is False and isinstance(stamp["dirty"], bool)
    assert first == tmp_path / "engine" / (f"{stamp['date'][:10]}-{stamp['cpu']['tag']}-{head[:7]}"
                                           + ("-dirty" if stamp["dirty"] else "") + ".json")
    assert second == first.with_name(first.stem + "-2.json") and json.loads(second.read_text())["results"] == {"rows": []}
    assert stamp["threads"] == torch.get_num_threads() and stamp["args"] == {"contexts": "256", "json_path": None}
    assert stamp["versions"]["torch"] == torch.__version__ and stamp["command"].startswith("python ")
    assert set(stamp["cpu"]["flags"]) == set(common.CPU_FLAGS)
    chosen = common.write_result("engine", args, {"rows": []}, tmp_path / "mine.json")  # --json PATH
    assert chosen == tmp_path / "mine.json" and json.loads(chosen.read_text())["bench"] == "engine"


@pytest.mark.parametrize("cpu, tag", [
    (("AuthenticAMD", 0x19, 0x11, "AMD EPYC"), "zen4"),  # a VM whose model name says no more
    (("AuthenticAMD", 0x19, 0x01, "AMD EPYC 7763 64-Core Processor"), "zen3"),
    (("AuthenticAMD", 0x1a, 0x02, "AMD EPYC"), "zen5"),
    (("GenuineIntel", 6, 0x8f, "Intel(R) Xeon(R) Platinum 8488C"), "spr"),
    (("GenuineIntel", 6, 0x99, "Intel(R) Core(TM) i9-14900K CPU @ 3.20GHz"), "core-i9-14900k"),
    ((None, None, None, None), "cpu"),
])
def test_a_results_file_name_carries_its_cpus_microarchitecture(cpu, tag):
    assert common.cpu_tag(*cpu) == tag


def stamped(bench: str, results, **stamp) -> dict:
    return {"bench": bench, "results": results,
            "stamp": {"commit": "0" * 40, "dirty": False, "date": "2026-12-06T00:00:00+00:00", "migrated": False,
                      "cpu": {"tag": "zen4"}, "args": None, **stamp}}


def test_a_headline_gives_kvpage_against_its_peer_in_the_same_run():
    rows = [{"model": "smollm2", "context": c, "system": s, "prefill_tok_s": p, "decode_tok_s": d, "weights": w}
            for c, s, p, d, w in [(1024, "transformers", 400.0, 10.0, None), (1024, "llama.cpp", 200.0, 50.0, None),
                                  (1024, "kvpage", 800.0, 60.0, "gguf"), (1024, "kvpage", 100.0, 5.0, "float32"),
                                  (8192, "transformers", 200.0, 5.0, None), (8192, "llama.cpp", 100.0, 25.0, None),
                                  (8192, "kvpage", 300.0, 20.0, "gguf")]]
    assert summary.engine({"rows": rows}, {}) == ("smollm2, kvpage gguf, 1K-8K: prefill 1.50-2.00x, decode 4.00-6.00x "
                                                  "transformers; prefill 3.00-4.00x, decode 0.80-1.20x llama.cpp")
    batch = [{"prefix": 1024, "batch": b, "system": s, "decode_tok_s": t, "x_batch1": x, "x_transformers": xt}
             for b, s, t, x, xt in [(1, "kvpage", 40.0, 1.0, 2.0), (1, "transformers", 20.0, None, None),
                                    (16, "kvpage", 320.0, 8.0, 4.0), (64, "kvpage", 400.0, 10.0, 8.0)]]
    assert summary.batch({"rows": batch}, {}) == "1K, batch 16: 320.0 tok/s, 8.0x batch 1, 4.00x transformers"
    # quantized files: the default activations' decode at every prompt length, not the faster mode's
    quant = [{"shape": "1b", "format": "Q4_K_M", "prompt_tokens": n, "system": s, "prefill_tok_s": p, "decode_tok_s": d}
             for n, s, p, d in [(128, "llama.cpp", 100.0, 30.0), (128, "kvpage (auto activations)", 120.0, 24.0),
                                (128, "kvpage (float32 activations)", 50.0, 40.0), (1024, "llama.cpp", 80.0, 25.0),
                                (1024, "kvpage (auto activations)", 160.0, 30.0)]]
    assert summary.quant_models({"rows": quant}, {}) == ("decode against llama.cpp: 1b Q4_K_M 0.80-1.20x "
                                                         "(prefill of 1024 tokens 2.00x)")


def test_compare_sets_the_rows_of_two_results_side_by_side_with_their_ratio():
    a = stamped("batch", {"rows": [{"prefix": 1024, "batch": 16, "system": "kvpage", "decode_tok_s": 200.0,
                                    "x_batch1": 5.0}]})
    b = stamped("batch", {"rows": [{"prefix": 1024, "batch": 16, "system": "kvpage", "decode_tok_s": 300.0,
                                    "x_batch1": 6.0},
                                   {"prefix": 8192, "batch": 16, "system": "kvpage", "decode_tok_s": 90.0}]})
    assert compare.compare(a, b) == [{"case": "16, 1024, kvpage", "measure": "decode_tok_s", "a": 200.0, "b": 300.0,
                                      "b_over_a_x": 1.5}]
    assert [line["measure"] for line in compare.compare(a, b, ["x_batch1"])] == ["x_batch1"]
