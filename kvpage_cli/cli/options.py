"""Options shared by the commands, declared once and added to each command by group.

A command takes `opts: Options` and lists the groups it wants:

    @shared_options(MODEL, GENERATION, OUTPUT, RUN)
    def ask(path: ..., question: ..., opts: Options) -> None:
        engine_config = opts.engine_config()

Adding an option every command of a group gets is one `Shared(...)` line in SHARED; when it
feeds `EngineConfig`, `config=` names the field (or maps the value to fields), e.g.

    Shared("no_cache", bool, False, _opt("--no-cache", group=MODEL, help="..."), MODEL,
           lambda value: {"kv_cache": not value}),
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import typer

from ..engine import DEFAULT_MODEL, EngineConfig
from ..engine.config import ACTIVATIONS, BACKENDS, DEVICES, DTYPES, KV_DTYPES, MODES, POLICIES, WEIGHTS, default
from ..errors import UsageError
from .progress import PROGRESS_LINE_S

# Groups of shared options.
MODEL = "Model and engine"
GENERATION = "Generation"
OUTPUT = "Output"
RUN = "Messages"

Format = Literal["table", "text", "markdown", "json", "jsonl", "html", "docx", "pdf"]

PASSWORD_ENV = "KVPAGE_PDF_PASSWORD"
Password = Annotated[str | None, typer.Option(
    "--password", envvar=PASSWORD_ENV, show_envvar=True, rich_help_panel="Input",
    help="Password of an encrypted PDF. On a shared machine prefer the environment variable, or nothing: "
         "when stdin and stderr are a terminal kvpage asks for it, without echo (--password is visible in ps).")]
"""The --password parameter of the commands that read a document."""


@dataclass(frozen=True)
class Shared:
    """One shared option: its parameter name, type, default, the typer.Option, and its group.

    config: the EngineConfig field it sets (a name), or a function from its value to a dict of
    fields; None when it does not feed the engine. A value of None is left to EngineConfig."""

    name: str
    type: Any
    default: Any
    option: Any
    group: str
    config: str | Callable[[Any], dict] | None = None


def _opt(*decls: str, group: str, **kwargs) -> Any:
    return typer.Option(*decls, rich_help_panel=group, **kwargs)


SHARED: tuple[Shared, ...] = (
    Shared("model", str, DEFAULT_MODEL, _opt("--model", "-m", envvar="KVPAGE_MODEL", group=MODEL, show_envvar=True,
           help="Alias (smollm2, gemma3-270m), a Hugging Face model folder or a .gguf file."), MODEL),
    Shared("mode", Literal[MODES], default("mode"), _opt("--mode", group=MODEL,
           help="auto: exact when the document fits the model's context, else retrieval. exact: every block "
                "takes part in every attention step (lossless). retrieval: the document is indexed once and each "
                "question reads the blocks chosen for it. selective: decode steps attend only the blocks the "
                "policy keeps in the pool (approximate); over a document longer than the context, those of the "
                "blocks retrieval chose."), MODEL, "mode"),
    Shared("pool_mib", float | None, default("pool_mib"), _opt("--pool-mib", group=MODEL, metavar="MIB",
           help="Size of the slot pool on the compute device, in MiB; it does not grow with the document "
                "(default: 64 on a CPU; on a GPU, a quarter of its memory free after the weights, at most the KV "
                "of a full batch of the model's longest context). Where "
                "attention reads blocks through the pool (GPU), it also bounds how much of a long document a "
                "question reads in retrieval mode (see 'kvpage info')."),
           MODEL, "pool_mib"),
    Shared("dtype", Literal[DTYPES], default("dtype"), _opt("--dtype", group=MODEL,
           help="Weights, activations and KV blocks."), MODEL, "dtype"),
    Shared("kv_dtype", Literal[KV_DTYPES], default("kv_dtype"), _opt("--kv-dtype", group=MODEL,
           help="The KV blocks' element type: bfloat16 halves the bytes each decode step reads and the memory "
                "the document takes, with fp32 weights and activations; int8 (a scale per row) keeps about a "
                "quarter; answers differ by that rounding (bench/engine.py --kv-dtypes measures it). float32 keeps "
                "K and V as computed (logits as transformers' fp32 ones). auto: bfloat16 beside quantized "
                "weights (gguf, int8, int4, bfloat16) except on Triton, else --dtype."),
           MODEL, "kv_dtype"),
    Shared("weights", Literal[WEIGHTS], default("weights"), _opt("--weights", group=MODEL,
           help="How weight matrices are kept and read: gguf keeps a .gguf file's own quantized blocks, "
                "mapped from the file (faster decoding than float32 in a fraction of the memory: "
                "bench/engine.py --weights measures it); bfloat16, int8 and int4 are made at load from float weights; auto is gguf for "
                "a GGUF model on the native CPU kernels, else float32. Answers differ from float32 by the "
                "rounding of the format (see 'kvpage info')."), MODEL, "weights"),
    Shared("activations", Literal[ACTIVATIONS], default("activations"), _opt("--activations", group=MODEL,
           help="What quantized weights multiply: float32 (the weights' exact values times fp32 "
                "activations), int8 (activations rounded to 8 bits in groups of 32, 256 for K-quants, and "
                "integer dot products, as llama.cpp does: faster decoding of multi-billion-parameter models; "
                "answers differ by that rounding; bench/quant_models.py measures it) or auto (int8 for "
                "K-quant matrices, Q2_K to Q6_K, prompts too; float32 for the others)."), MODEL,
           "activations"),
    Shared("device", Literal[DEVICES], default("device"), _opt("--device", group=MODEL,
           help="Compute device; auto picks CUDA when torch sees one (the CPU with --backend native)."),
           MODEL, "device"),
    Shared("backend", Literal[BACKENDS], default("backend"), _opt("--backend", group=MODEL,
           help="Attention kernels: auto is Triton on CUDA (torch for head sizes other than 64, 128, 256), "
                "the native C kernels on CPU."), MODEL, "backend"),
    Shared("policy", Literal[POLICIES], default("policy"), _opt("--policy", group=MODEL,
           help="Which blocks stay in the pool in selective mode."), MODEL, "policy"),
    Shared("no_cache", bool, False, _opt("--no-cache", group=MODEL,
           help="Neither load nor save the document's KV in KVPAGE_HOME/kv (see 'kvpage cache')."),
           MODEL, lambda value: {"kv_cache": not value}),
    Shared("cache_mib", float, default("cache_mib"), _opt("--cache-mib", group=MODEL, metavar="MIB", min=0,
           help="Size limit of the saved-KV cache; least recently used documents are evicted past it."),
           MODEL, "cache_mib"),
    Shared("tp", int, default("tp"), _opt("--tp", group=MODEL, min=1, max=64, metavar="N",
           help="Split the model over N processes (tensor parallel: each holds 1/N of the heads, the MLP "
                "and the KV). kvpage starts them; under torchrun, give the total number of ranks."),
           MODEL, "tp"),
    Shared("threads", int | None, default("threads"), _opt("--threads", group=MODEL, min=1,
           help="CPU threads for torch and the native kernels (default: torch's choice)."), MODEL, "threads"),
    Shared("max_new_tokens", int | None, None, _opt("--max-new-tokens", group=GENERATION, min=1,
           help="Most tokens generated per answer (review: per clause rationale; default 40; ask: 256)."),
           GENERATION),
    Shared("json_out", bool, False, _opt("--json", group=OUTPUT, help="Print one JSON document."), OUTPUT),
    Shared("fmt", Format | None, None, _opt("--format", "-f", group=OUTPUT,
           help="Output format (default: table on a terminal, else text; with --out, from its suffix). "
                "review also writes html (one self-contained report), docx (Word comments) and pdf (highlights)."),
           OUTPUT),
    Shared("out", Path | None, None, _opt("--out", "-o", group=OUTPUT, dir_okay=False, metavar="FILE",
           help="Write the output to FILE, only once the run is complete (nothing on stdout)."), OUTPUT),
    Shared("quiet", bool, False, _opt("--quiet", "-q", group=RUN,
           help="No statistics or warnings on stderr; errors only."), RUN),
    Shared("verbose", bool, False, _opt("--verbose", "-v", group=RUN,
           help="Also print model-loading stages and a line per clause on stderr; where stderr is not a "
                f"terminal (a log), a long prefill or indexing says how far it is every {PROGRESS_LINE_S:.0f} s."),
           RUN),
    Shared("no_color", bool, False, _opt("--no-color", group=RUN,
           help="No colours on stderr or in tables (NO_COLOR is honoured too)."), RUN),
    Shared("debug", bool, False, _opt("--debug", envvar="KVPAGE_DEBUG", group=RUN,
           help="Show the full traceback of an error (also KVPAGE_DEBUG=1)."), RUN),
)


class Options:
    """The shared option values of one command run, as attributes (`opts.model`, `opts.quiet`)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        self._names = set(values)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    @property
    def home(self) -> str | None:
        """Cache folder for converted weights and saved KV: KVPAGE_HOME, else the engine's default."""
        return os.environ.get("KVPAGE_HOME") or None

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The EngineConfig these options ask for; an impossible value is a usage error."""
        fields: dict[str, Any] = {"home": self.home}
        for shared in SHARED:
            if shared.config is None or shared.name not in self._names:
                continue
            value = getattr(self, shared.name)
            if callable(shared.config):
                fields.update(shared.config(value))
            elif value is not None:
                fields[shared.config] = value
        fields.update(overrides)
        try:
            return EngineConfig(**fields)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def shared_options(*groups: str, taken: tuple[str, ...] = ()) -> Callable:
    """Adds the shared options of `groups` to a command that takes `opts: Options`.

    The command's own parameters come first in --help; the shared ones follow in their panels.
    `taken`: short names the command uses for options of its own (`ask -q QUESTION`); the shared
    options keep only their other names there (`--quiet`).
    The wrapped function is called as `fn(**own, opts=Options(...))` inside the error guard."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "opts"]
        added = [s for s in SHARED if s.group in groups]
        params = own + [
            inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=s.default,
                              annotation=Annotated[s.type, _without(s.option, taken)])
            for s in added
        ]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            from . import ranks
            from .session import guarded

            given = dict(kwargs)  # every argument: the ranks --tp starts run the command with them
            opts = Options({s.name: kwargs.pop(s.name) for s in added})
            return guarded(opts, lambda: ranks.run(opts, command, given, lambda: fn(opts=opts, **kwargs)))

        command.__signature__ = signature.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def _without(option: Any, names: tuple[str, ...]) -> Any:
    """The typer option without the declarations in `names`."""
    decls = tuple(d for d in option.param_decls if d not in names)
    if len(decls) == len(option.param_decls):
        return option
    copy_ = copy.copy(option)
    copy_.param_decls = decls
    return copy_
