"""Shared fixtures: tiny random models of every supported architecture, and the real models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton decides at kernel definition whether to interpret: set it before anything imports them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

THREADS = torch.get_num_threads()  # torch's own thread count here (the cores), as every test starts with it


@pytest.fixture(autouse=True)
def torch_threads():
    """Puts torch's thread count back after each test: an engine loaded with `threads` (the CLI's
    --threads) sets it for the whole process, and the tests after one that asked for 1 ran on one
    core (the real review 105 s where it takes 68)."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "corpus"
SAMPLES = REPO / "samples"

# Tiny random models: small enough for fast tests, large init so that logits are of order 1-10.
TINY_ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 100},
    "gemma3_text": {"sliding_window": 100, "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
}


def tiny_config(arch: str, **overrides):
    from transformers import AutoConfig

    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=320, max_position_embeddings=4096, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kwargs.update(TINY_ARCHS[arch])
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_model(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).eval()


@pytest.fixture(scope="session")
def kv_home(tmp_path_factory) -> Path:
    """The cache folder for tests: KVPAGE_HOME when set (CI shares converted weights), else a temp dir."""
    home = os.environ.get("KVPAGE_HOME")
    return Path(home) if home else tmp_path_factory.mktemp("kvpage-home")


@pytest.fixture(scope="session")
def native_library(kv_home) -> Path | None:
    """The native kernel library as built in kv_home (built there first where it is not yet); None
    where it cannot be built. A new home compiles it again (about 12 s on 2 cores): tests that make their own
    homes copy it in (`with_native_library`) or have `native._compile` copy it."""
    from kvpage_cli.engine import native

    compiler = native._compiler()
    if compiler is None:
        return None
    target = native.library_path(kv_home)
    try:
        native._open_verified(target, kv_home, lambda out: native._compile(compiler, native.sources(), out))
    except native.NativeUnavailable:
        return None
    return target


AMX_EMULATION = Path(__file__).with_name("amx_emulation.h")


@pytest.fixture(scope="session")
def tile_library(kv_home, native_library):
    """(lib, how): the native kernels where their AMX tile paths run. "hardware": this CPU's own
    library, where the CPU has AMX and Linux grants its tile state; "emulated" elsewhere: a copy of
    the library built with tests/amx_emulation.h, the tile instructions done in C as Intel's manual
    defines them (the same sources, their tile branches compiled as on an AMX machine; built once
    into kv_home, about 20 s). Emulating needs AVX512-BF16, which the tile paths' other instructions
    use; a CPU with neither skips."""
    import hashlib

    from kvpage_cli.engine import native

    if native_library is None:
        pytest.skip("no C compiler: the native kernels cannot be built")
    lib = native.load(kv_home)
    if native.qgemm_tiles(lib) and native.prefill_amx(lib):
        return lib, "hardware"
    if not native.has_bf16_prefill(lib):
        pytest.skip("this CPU has no AMX and no AVX512-BF16: its tile paths can be neither run nor emulated")
    # the header's own hash in the flags: the library's cache key covers the sources and the flags
    tag = hashlib.sha256(AMX_EMULATION.read_bytes()).hexdigest()[:16]
    flags, loaded = list(native._FLAGS), native._LIB
    native._FLAGS[:] = flags + ["-mamx-tile", "-mamx-bf16", "-include", str(AMX_EMULATION),
                                f"-DKVP_AMX_EMULATION={tag}"]
    native._LIB = None
    try:
        emulated = native.load(kv_home)
    except native.NativeUnavailable as exc:
        pytest.fail(f"the kernels with emulated AMX tiles do not build: {exc}")
    finally:
        native._FLAGS[:] = flags
        native._LIB = loaded
    assert native.qgemm_tiles(emulated) and native.prefill_amx(emulated)
    return emulated, "emulated"


@pytest.fixture
def on_tiles(tile_library, monkeypatch):
    """The tile library, its tiles on, as the one engines load for this test (native._LIB)."""
    from kvpage_cli.engine import native

    lib, _ = tile_library
    monkeypatch.setattr(native, "_LIB", lib)
    native.qgemm_tiles(lib, True)
    native.prefill_amx(lib, True)
    return lib


@pytest.fixture
def tiles_if_any(request):
    """on_tiles where the tile paths can run (the CPU's or emulated), else None: the plain library,
    which has no tiles to change a result."""
    try:
        return request.getfixturevalue("on_tiles")
    except pytest.skip.Exception:
        return None


def with_native_library(home: Path, library: Path | None) -> Path:
    """`home`, holding a copy of `library` (and its hash) where kvpage looks for it; returns `home`.

    Each copy is written beside its place and renamed over it, as kvpage writes the library: a
    copy written into the file in place would change a library this process already has loaded
    from there under it (its pages are the file's), and the next call into it would crash."""
    from kvpage_cli.engine import native
    from kvpage_cli.engine.home import private_dir

    if library is not None:
        target = native.library_path(home)
        private_dir(target.parent)
        for path in (library, library.with_name(library.name + ".sha256")):
            destination = target.with_name(path.name)
            partial = destination.with_name(destination.name + f".{os.getpid()}.copy")
            shutil.copyfile(path, partial)
            os.replace(partial, destination)
    return home


@pytest.fixture(scope="session")
def tiny_models():
    return {arch: tiny_model(arch) for arch in TINY_ARCHS}


def random_prompt(length: int, seed: int = 1, vocab: int = 320) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


@pytest.fixture(scope="session")
def smollm2(kv_home):
    from kvpage_cli.engine import Engine, EngineConfig

    return Engine.load("smollm2", EngineConfig(home=str(kv_home), pool_mib=16))


@pytest.fixture(scope="session")
def gemma(kv_home):
    from kvpage_cli.engine import Engine, EngineConfig

    return Engine.load("gemma3-270m", EngineConfig(home=str(kv_home), pool_mib=16))


# -- the tiny model the CLI tests pass as --model FOLDER -----------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def tiny_cli_model(tmp_path_factory, kv_home) -> Path:
    """A random 2-layer llama with SmolLM2's tokenizer, saved as a Hugging Face folder.

    Its output is gibberish, but `kvpage ... --model FOLDER` runs the whole command path through
    the same model factory users use, in seconds."""
    import shutil

    from kvpage_cli.engine.model.weights import resolve_folder
    from kvpage_cli.errors import ModelError

    try:
        smollm2_folder = resolve_folder("smollm2", kv_home)
    except ModelError as exc:
        pytest.skip(f"the CLI tests borrow SmolLM2's tokenizer: {exc}")
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", seed=0, vocab_size=49152, num_hidden_layers=2, max_position_embeddings=8192,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm2_folder / name).exists():
            shutil.copy(smollm2_folder / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def hostile_docx(tmp_path_factory) -> dict[str, Path]:
    """The DOCX files of tests/hostile.py, written once: "numbering" (a list from 10^9 in letters),
    "zip bomb" (1 GiB of XML in about 1 MB), "nesting" (1,500 nested hyperlinks)."""
    from . import hostile

    folder = tmp_path_factory.mktemp("hostile")
    files = {"numbering": hostile.numbering_bomb(), "zip bomb": hostile.zip_bomb(), "nesting": hostile.nesting_bomb()}
    paths = {}
    for name, data in files.items():
        paths[name] = folder / f"{name.replace(' ', '-')}.docx"
        paths[name].write_bytes(data)
    return paths


# -- one real review, shared ---------------------------------------------------------------------

@pytest.fixture(scope="session")
def sample_review(kv_home):
    """`kvpage review samples/contract.pdf --json` with the real default model, run once per session
    (a few minutes on a CPU): test_cli_e2e checks what it says, the format tests render it."""
    from typer.testing import CliRunner

    from kvpage_cli.cli.app import app
    from kvpage_cli.engine.model.weights import resolve_folder
    from kvpage_cli.errors import ModelError

    try:
        resolve_folder("smollm2", kv_home)
    except ModelError as exc:
        pytest.fail(f"the default model must be installed for this test: {exc}")
    return CliRunner().invoke(app, ["review", str(SAMPLES / "contract.pdf"), "--json"],
                              env={"KVPAGE_HOME": str(kv_home), "KVPAGE_MODEL": None, "KVPAGE_DEBUG": None})


def application(name: str) -> str:
    """The path of a program the output tests open their files with (LibreOffice, poppler); a test
    that needs one fails where it is missing, never skips: .ci/run installs them."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: .ci/run installs it (apt-get install libreoffice-writer-nogui "
                    "poppler-utils chromium)")
    return found
