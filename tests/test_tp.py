"""Tensor parallelism on CPU: 2 ranks joined by gloo give the tokens one process gives.

The tests save tiny random models as folders, run the same work in one process and in two ranks
started by `parallel.spawn` (one pair of ranks for all the cases of CASES), and compare: greedy
tokens equal, logits within TP_TOLERANCE (the all-reduce adds the ranks' partial sums in another
order than one process's matrix product), each rank holding its own heads' KV.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpage_cli.engine import Engine, EngineConfig
from kvpage_cli.engine.model.parallel import Shard, spawn
from kvpage_cli.errors import ModelError, UsageError

from .conftest import TINY_ARCHS, random_prompt, tiny_model, with_native_library

# logits of order 1-10 (conftest's init); one process vs two ranks, float32 weights and KV (the
# shipped models are asked for float32 KV: bfloat16 KV, their default, rounds K and V, and where a
# value sits at a rounding boundary the all-reduce's order moves it: 0.039 and 0.022 measured)
TP_TOLERANCE = 1e-3


def work(engine: Engine, prompt: list[int], new_tokens: int = 24) -> dict:
    """What is compared: the logits after a prefill and after each of a few decode steps, the
    greedy tokens of a longer decode, and the KV bytes one token takes in the store."""
    ctx = engine.prefill(prompt)
    first = engine.logits(ctx).clone()
    steps = []
    for token in prompt[:4]:
        list(engine.generate(ctx, [token], max_new_tokens=0))
        steps.append(engine.logits(ctx).clone())
    tokens = list(engine.generate(ctx, max_new_tokens=new_tokens, stop=()))
    return {"first": first, "steps": torch.stack(steps), "tokens": tokens,
            "kv_bytes_per_token": engine.kv_bytes_per_token(), "num_kv_heads": engine.spec.num_kv_heads,
            "weight_bytes": engine.runner.weight_bytes}


# Every comparison of one process with two ranks over a tiny model runs in one pair of ranks
# (starting a pair costs seconds of imports): (model, EngineConfig fields, prompt) per case.
CASES = {
    **{arch: (lambda arch=arch: tiny_model(arch), {"prefill_chunk": 128, "pool_mib": 1.0}, (300, 5))
       for arch in TINY_ARCHS},  # 300 tokens: past the sliding window (100) of mistral and gemma3
    "one kv head": (lambda: tiny_model("gemma3_text", num_key_value_heads=1), {"pool_mib": 1.0}, (200, 9)),
    **{weights: (lambda: tiny_model("llama", hidden_size=128, intermediate_size=256, head_dim=32),
                 {"pool_mib": 1.0, "weights": weights, "backend": "native"}, (150, 2))
       for weights in ("bfloat16", "int8", "int4")},
    # a pool of 5 slots per layer (the first block and the 2 newest always kept, 2 chosen), 10 blocks and more
    **{policy: (lambda: tiny_model("llama"), {"mode": "selective", "policy": policy,
                                             "pool_mib": 5 * 3 * 2 * 2 * 64 * 16 * 4 / 2**20}, (640, 6))
       for policy in ("quest", "draft", "scores", "lru")},
    # SmolLM2-135M's shape: 9 query heads over 3 KV heads
    "9 over 3 heads": (lambda: tiny_model("llama", num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                                          hidden_size=144, intermediate_size=96), {"pool_mib": 1.0}, (200, 4)),
}


def _rank(rank: int, home: str, cases: list[tuple[str, str, dict, list[int]]], out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, folder, config, prompt in cases:
        results[name] = work(Engine.load(folder, EngineConfig(home=home, tp=2, **config)), prompt)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory, kv_home) -> dict[str, tuple[dict, list[dict]]]:
    """Per case: what one process computes, and what each of two ranks computes."""
    folder = tmp_path_factory.mktemp("tp-cases")
    cases, alone = [], {}
    for index, (name, (make, config, (length, seed))) in enumerate(CASES.items()):
        model_folder = folder / f"model{index}"
        make().save_pretrained(model_folder, safe_serialization=True)
        prompt = random_prompt(length, seed=seed)
        alone[name] = work(Engine.load(str(model_folder), EngineConfig(home=str(kv_home), **config)), prompt)
        cases.append((name, str(model_folder), config, prompt))
    out = str(folder / "result")
    spawn(_rank, 2, (str(kv_home), cases, out))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    return {name: (alone[name], [r[name] for r in ranks]) for name in CASES}


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_two_ranks_give_the_tokens_of_one_process(arch, split_runs):
    alone, ranks = split_runs[arch]
    for result in ranks:
        assert result["tokens"] == alone["tokens"], arch
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert (result["steps"] - alone["steps"]).abs().max().item() < TP_TOLERANCE
        # each rank stores its own KV heads: half of one process's bytes per token
        assert result["num_kv_heads"] * 2 == alone["num_kv_heads"]
        assert result["kv_bytes_per_token"] * 2 == alone["kv_bytes_per_token"]
    assert alone["first"].abs().max() > 1.0  # logits big enough for the tolerance to mean something


def test_fewer_kv_heads_than_ranks_are_replicated(split_runs):
    """Gemma 3 270M has one KV head: each rank keeps it, its query heads split."""
    alone, ranks = split_runs["one kv head"]
    for result in ranks:
        assert result["tokens"] == alone["tokens"]
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert result["num_kv_heads"] == alone["num_kv_heads"] == 1


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4"])
def test_compact_weights_split_the_same_way(weights, split_runs):
    """Formats made at load are made from each rank's part, so a rank holds about half the bytes."""
    alone, ranks = split_runs[weights]
    for result in ranks:
        assert result["tokens"] == alone["tokens"], weights
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
        assert result["weight_bytes"] < 0.6 * alone["weight_bytes"]


@pytest.mark.parametrize("policy", ["quest", "draft", "scores", "lru"])
def test_selective_mode_keeps_the_same_blocks_on_every_rank(policy, split_runs):
    """Each rank scores blocks with its own heads; the scores are summed over the ranks, so every
    rank keeps the blocks one process keeps: the same tokens."""
    alone, ranks = split_runs[policy]
    for result in ranks:
        assert result["tokens"] == alone["tokens"], policy
        assert (result["steps"] - alone["steps"]).abs().max().item() < TP_TOLERANCE


def test_kv_heads_that_do_not_divide_are_shared_out_unevenly(split_runs):
    """SmolLM2-135M's shape: 9 query heads over 3 KV heads, on 2 ranks: 2 KV heads and 1."""
    alone, ranks = split_runs["9 over 3 heads"]
    for result in ranks:
        assert result["tokens"] == alone["tokens"]
        assert (result["first"] - alone["first"]).abs().max().item() < TP_TOLERANCE
    assert [r["num_kv_heads"] for r in ranks] == [2, 1]
    assert sum(r["kv_bytes_per_token"] for r in ranks) == alone["kv_bytes_per_token"]


def _ask_rank(rank: int, folder: str, home: str, path: str, out: str, kv_cache: bool = False) -> None:
    torch.set_num_threads(1)
    engine = Engine.load(folder, EngineConfig(home=home, tp=2, max_context=1024, kv_cache=kv_cache))
    torch.save(ask_work(engine, path), f"{out}.{rank}")


def ask_work(engine: Engine, path: str) -> dict:
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import Asker

    asker = Asker(engine, load(path), [QUESTION], max_new_tokens=12)
    text = "".join(piece for _, piece in asker.answers())
    return {"mode": asker.mode, "answer": text, "blocks": list(asker.selections[0].blocks)}


def test_retrieval_reads_the_same_blocks_on_every_rank(tiny_cli_model, kv_home, tmp_path, native_library):
    """A document longer than the context: the question's attention to the index's blocks is summed
    over the ranks, so every rank reads the blocks one process reads."""
    from .conftest import SAMPLES

    path = str(SAMPLES / "contract.txt")
    alone = ask_work(Engine.load(str(tiny_cli_model), EngineConfig(home=str(kv_home), max_context=1024)), path)
    assert alone["mode"] == "retrieval"
    out, home = str(tmp_path / "result"), with_native_library(tmp_path / "home", native_library)
    # with the saved KV: the first run computes and saves each rank's index windows, the second maps them back
    for run in range(2):
        spawn(_ask_rank, 2, (str(tiny_cli_model), str(home), path, f"{out}{run}", True))
        assert all(torch.load(f"{out}{run}.{rank}") == alone for rank in range(2))


def _cached_rank(rank: int, folder: str, home: str, prompt: list[int], out: str, drop: bool) -> None:
    torch.set_num_threads(1)
    engine = Engine.load(folder, EngineConfig(home=home, tp=2, kv_cache=True, prefill_chunk=128, pool_mib=1.0))
    if drop and rank == 1:  # this rank's files are gone (its index rows stay): no rank may restore the prefix
        for path in engine.kv_cache.segments_dir.glob("*/*-r1of2.kvb"):
            path.unlink()
    ctx = engine.prefill(prompt, label="doc")
    tokens = list(engine.generate(ctx, max_new_tokens=12, stop=()))
    torch.save({"cached": ctx.cached_prefix, "tokens": tokens}, f"{out}.{rank}")


def test_saved_kv_is_restored_only_where_every_rank_has_it(tmp_path, kv_home, native_library):
    """Each rank saves its own heads' KV in its own files, and the document is one entry of the
    cache; a second run restores the prefix on both ranks; when one rank's files are gone, neither
    restores it. The tokens are the same every time; `kvpage cache rm` removes every rank's files."""
    from kvpage_cli.engine.kv.saved.disk import KVCache

    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder, safe_serialization=True)
    home, prompt = with_native_library(tmp_path / "home", native_library), random_prompt(600, seed=8)
    runs = []
    for drop in (False, False, True):
        out = str(tmp_path / f"run{len(runs)}")
        spawn(_cached_rank, 2, (str(folder), str(home), prompt, out, drop))
        runs.append([torch.load(f"{out}.{rank}") for rank in range(2)])
        if len(runs) == 1:
            files = sorted((home / "kv" / "segments").glob("*/*.kvb"))
            [entry] = KVCache.open(home).list_entries()
            assert (entry.label, entry.tokens, entry.segments) == ("doc", 512, 4)
            assert entry.bytes == sum(f.stat().st_size for f in files)
            assert sorted(f.name.split("-")[1] for f in files) == ["r0of2.kvb"] * 4 + ["r1of2.kvb"] * 4
    assert [r["cached"] for r in runs[0]] == [0, 0]
    assert [r["cached"] for r in runs[1]] == [512, 512]  # whole 128-token segments before the last token
    assert [r["cached"] for r in runs[2]] == [0, 0]
    assert all(r["tokens"] == runs[0][0]["tokens"] for run in runs for r in run)
    assert [e.label for e in KVCache.open(home).remove("doc")] == ["doc"]
    assert not list((home / "kv" / "segments").glob("*/*.kvb"))


def test_a_model_that_does_not_divide_is_refused():
    from kvpage_cli.engine.model.spec import spec_from_config

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
    engine = Engine.load(model, EngineConfig(home=home, tp=2, kv_dtype="float32", activations="float32"))
    torch.save(work(engine, engine.tokenizer(text)["input_ids"], 8), f"{out}.{rank}")


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_the_shipped_models_on_two_ranks_give_their_tokens(model, tmp_path, kv_home):
    """Their GGUF blocks split by rows (heads, MLP rows, vocabulary) and by block-aligned columns:
    SmolLM2's 9 query heads over 3 KV heads go 6 and 3, Gemma's one KV head to both ranks."""
    from .conftest import SAMPLES

    text = (SAMPLES / "contract.txt").read_text()[:1500]
    # float32 activations: rounding to int8 (the default for Gemma's K-quants) is a step function, so
    # the all-reduce's last-bit differences can move an activation to the next integer, and Gemma's
    # third greedy token here wins by 0.06 of a logit
    engine = Engine.load(model, EngineConfig(home=str(kv_home), kv_dtype="float32", activations="float32"))
    alone = work(engine, engine.tokenizer(text)["input_ids"], 8)
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


# -- the command line: `--tp 2` starts its ranks; torchrun starts them too -------------------------

KVPAGE = Path(sys.executable).with_name("kvpage")


def kvpage_env(kv_home) -> dict:
    """The environment the `kvpage` processes run in: this checkout first on the path (the console
    script would import the installed package), the home folder the tests' own."""
    root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, KVPAGE_HOME=str(kv_home),
                PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


QUESTION = "Which law governs this agreement?"


def cli(args: list[str], kv_home, **extra) -> subprocess.CompletedProcess:
    env = kvpage_env(kv_home)
    env.pop("KVPAGE_MODEL", None)
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, **extra)


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    from .conftest import SAMPLES

    path = tmp_path_factory.mktemp("tp") / "contract.txt"
    path.write_text((SAMPLES / "contract.txt").read_text()[:2500])
    return path


@pytest.fixture(scope="module")
def asked_alone(contract, tiny_cli_model, kv_home):
    """The question asked by one process (the answer the ranks must print), as JSON and as text."""
    common = ["ask", str(contract), QUESTION, "--model", str(tiny_cli_model), "--max-new-tokens", "12"]
    runs = {"json": cli([str(KVPAGE), *common, "--json"], kv_home), "text": cli([str(KVPAGE), *common], kv_home)}
    for run in runs.values():
        assert run.returncode == 0, run.stderr
    return common, runs


def test_ask_with_tp_2_prints_what_one_process_prints(asked_alone, kv_home, contract):
    common, runs = asked_alone
    common = [*common, "--json"]
    alone = runs["json"]
    split = cli([str(KVPAGE), *common, "--tp", "2"], kv_home)
    assert split.returncode == 0, split.stderr
    one, two = json.loads(alone.stdout), json.loads(split.stdout)  # stdout: one JSON document, rank 0's
    assert two["answer"] == one["answer"] and two["document_tokens"] == one["document_tokens"]
    assert two["stats"]["store_mib"] < one["stats"]["store_mib"]  # rank 0's own KV heads: half
    assert split.stderr.count("kvpage: prefill") == 1  # one statistics line: rank 0's
    stdin = [str(KVPAGE), *common[:1], "-", *common[2:]]  # the prompt names its source: compare stdin with stdin
    piped = [cli(stdin + tp, kv_home, input=contract.read_text()) for tp in ([], ["--tp", "2"])]
    assert piped[1].returncode == 0, piped[1].stderr
    assert json.loads(piped[1].stdout)["answer"] == json.loads(piped[0].stdout)["answer"]  # rank 0 read stdin


def test_the_ranks_run_the_kvpage_rank_0_runs_wherever_it_is_started(asked_alone, kv_home, tmp_path):
    """Started from a folder that holds another kvpage_cli (a checkout of another version), the
    ranks still import rank 0's: two versions would run different steps and wait on each other."""
    other = tmp_path / "kvpage_cli"
    other.mkdir()
    (other / "__init__.py").write_text("raise ImportError('the kvpage_cli of the working directory')\n")
    common, runs = asked_alone
    split = cli([str(KVPAGE), *common, "--json", "--tp", "2"], kv_home, cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    assert json.loads(split.stdout)["answer"] == json.loads(runs["json"].stdout)["answer"]


def test_ask_under_torchrun_prints_what_one_process_prints(asked_alone, kv_home):
    common, runs = asked_alone
    alone = runs["text"]
    torchrun = Path(sys.executable).with_name("torchrun")
    split = cli([str(torchrun), "--standalone", "--nproc-per-node", "2", str(KVPAGE), *common, "--tp", "2"], kv_home)
    assert split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout  # rank 1 printed nothing
    # one rank in a process group runs the split path too (bench/gpu_check.sh does it with NCCL on a GPU)
    one = cli([str(torchrun), "--standalone", "--nproc-per-node", "1", str(KVPAGE), *common, "--tp", "1"], kv_home)
    assert one.returncode == 0 and one.stdout == alone.stdout, one.stderr


def test_an_error_on_rank_0_ends_every_rank_with_one_message(tiny_cli_model, kv_home, tmp_path):
    run = cli([str(KVPAGE), "ask", str(tmp_path / "missing.txt"), QUESTION, "--model", str(tiny_cli_model),
               "--tp", "2"], kv_home)
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("kvpage: error:")]
    assert len(errors) == 1 and "missing.txt" in errors[0], run.stderr


def _start(args: list[str], kv_home) -> subprocess.Popen:
    env = kvpage_env(kv_home)
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True,  # its own process group, as a terminal gives a command
                            preexec_fn=_interruptible)


def _interruptible() -> None:
    """SIGINT neither ignored nor blocked, as a shell starts a foreground command: a child inherits
    both from its parent, and this test process's may differ after the tests before it (the full
    suite twice started kvpage with Ctrl-C not acted on; this file alone never did)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_rank_1(process: subprocess.Popen) -> int:
    """Rank 1's pid, once the run is decoding: rank 0 prints the answer as it is decoded, so its
    first character on stdout says both ranks are past loading and in their collectives."""
    assert process.stdout.read(1), process.communicate()[1]
    ranks = children(process.pid)
    assert ranks, "rank 0 started no rank"
    return ranks[0]


def test_a_rank_that_dies_ends_the_run_with_its_exit_code(tiny_cli_model, kv_home, contract):
    process = _start([str(KVPAGE), "ask", str(contract), QUESTION, "--model", str(tiny_cli_model),
                      "--max-new-tokens", "4000", "--tp", "2"], kv_home)
    rank1 = _wait_for_rank_1(process)
    os.kill(rank1, signal.SIGKILL)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, stderr  # a rank ended by a signal has no exit code of its own
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert errors and errors[-1] == "kvpage: error: rank 1 of the tensor-parallel run: ended by signal SIGKILL", stderr


def test_ctrl_c_ends_every_rank(tiny_cli_model, kv_home, contract):
    process = _start([str(KVPAGE), "ask", str(contract), QUESTION, "--model", str(tiny_cli_model),
                      "--max-new-tokens", "4000", "--tp", "2"], kv_home)
    rank1 = _wait_for_rank_1(process)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert not alive(rank1)  # no orphan: rank 0 waits for its ranks before it exits


def test_info_lists_each_ranks_share_measured_in_the_rank(tiny_cli_model, kv_home):
    args = [str(KVPAGE), "info", "--model", str(tiny_cli_model), "--json"]
    alone = json.loads(cli(args, kv_home).stdout)
    split = cli(args + ["--tp", "2"], kv_home)
    assert split.returncode == 0, split.stderr
    data = json.loads(split.stdout)
    shares = data["tp_ranks"]
    assert [s["rank"] for s in shares] == [0, 1]
    assert [s["heads"] for s in shares] == [2, 2] and [s["kv_heads"] for s in shares] == [1, 1]
    assert sum(s["kv_bytes_per_token"] for s in shares) == alone["kv_bytes_per_token"] == data["kv_bytes_per_token"]
    # each rank holds half the matrices (the norms are replicated, and small)
    for share in shares:
        assert 0.45 * alone["weights_mib"] < share["weights_mib"] < 0.55 * alone["weights_mib"]
    assert "tp_ranks" not in alone


def review_work(engine: Engine, path: str) -> list[dict]:
    from kvpage_cli.ingest import load
    from kvpage_cli.tasks import Reviewer

    reviewer = Reviewer(engine, load(path))
    return [f.to_dict() for f in reviewer.findings()] + [t.to_dict() for t in reviewer.terms]


def scores_apart(item, found: list[float]):
    """The item without the model's calibrated scores (which differ in the last digits with the
    summation order), the scores appended to `found`."""
    if isinstance(item, dict):
        out = {}
        for key, value in item.items():
            if key == "score":
                found.append(value)
            elif key == "answer_scores":
                found.extend(value[k] for k in sorted(value))
                out[key] = sorted(value)
            else:
                out[key] = scores_apart(value, found)
        return out
    if isinstance(item, list):
        return [scores_apart(x, found) for x in item]
    return item


def _review_rank(rank: int, home: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.save(review_work(Engine.load("smollm2", EngineConfig(home=home, tp=2, kv_dtype="float32")), path),
               f"{out}.{rank}")


@pytest.mark.real_model
def test_the_sample_contracts_clauses_are_reviewed_the_same_on_two_ranks(tmp_path, kv_home):
    """Five clauses of the README's contract (payment terms, the renewal, termination for
    convenience, the cap, the governing law) as a contract of their own: the same categories,
    levels, reasons, quotes and values; the model's scores within 1e-3."""
    from kvpage_cli.ingest import load, split_clauses

    from .conftest import SAMPLES

    doc = load(str(SAMPLES / "contract.txt"))
    kept = [c for c in split_clauses(doc) if c.id in ("3.1", "4.2", "5.2", "11.2", "17.1")]
    path = tmp_path / "five-clauses.txt"
    path.write_text("MASTER SERVICES AGREEMENT\n\n" + "\n\n".join(doc.text[c.start:c.end].strip() for c in kept) + "\n")
    alone_scores: list[float] = []
    alone = scores_apart(review_work(Engine.load("smollm2", EngineConfig(home=str(kv_home), kv_dtype="float32")),
                                     str(path)), alone_scores)
    assert any(f.get("risk") == "high" for f in alone) and alone_scores
    out = str(tmp_path / "result")
    spawn(_review_rank, 2, (str(kv_home), str(path), out))
    for rank in range(2):
        scores: list[float] = []
        assert scores_apart(torch.load(f"{out}.{rank}"), scores) == alone
        assert len(scores) == len(alone_scores) and max(abs(a - b) for a, b in zip(scores, alone_scores)) < 1e-3
