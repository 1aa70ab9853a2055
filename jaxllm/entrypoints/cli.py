"""The `jaxllm` command: `serve` (OpenAI-compatible server), `generate` (complete prompts,
streamed to the terminal), `chat` (talk to the model in the terminal) and `bench`
(throughput, latency, a server under load: jaxllm/bench/commands.py).

Only argparse is imported up front, so `jaxllm --help` answers at once; the engine (JAX, the
model) loads inside the subcommand.
"""

from __future__ import annotations

import argparse
import logging
import dataclasses
import os
import re
import sys
import time
import typing

from jaxllm.config import EngineArgs
from jaxllm.entrypoints.openai.server_args import ServerArgs

DESCRIPTION = """\
jaxllm serves large language models with JAX: a paged KV cache and continuous batching, behind
an OpenAI-compatible HTTP API.

Without --model every command uses the bundled SmolLM2-135M-Instruct. The first start compiles
jaxllm's C++ CPU kernels and the model for every batch shape (70-90 s on a 2-core CPU); later
starts reuse the caches (~/.cache/jaxllm, or $JAXLLM_CACHE_DIR) and take 20-26 s.
"""

EXAMPLES = """\
examples:
  jaxllm generate "The capital of France is"        complete a prompt, streamed as it is generated
  jaxllm generate --file prompts.txt --max-tokens 64  one prompt per line, all batched together
  jaxllm chat --system "You are a pirate."           chat in the terminal (/reset, /exit)
  jaxllm serve                                       OpenAI API at http://127.0.0.1:8000/v1
  jaxllm serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8080 --api-key secret
  jaxllm bench throughput --output-json t.json       offline throughput, as `vllm bench` measures it

then, with the server running:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}]}'

run `jaxllm <command> --help` for each command's options.
"""


def parse_size(text: str) -> int:
    """'2GiB', '512M', '1.5G', '1000000' -> bytes (K/M/G/T are powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB or a number of bytes)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


# Fields that only mean something to HTTP clients: only `serve` takes them.
SERVE_ONLY_FIELDS = ("served_model_name",)


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_engine_args(parser: argparse.ArgumentParser, *, serving: bool = False) -> None:
    """One flag per `EngineArgs` field (see `add_dataclass_args`)."""
    group = parser.add_argument_group("model and engine (names as in vLLM)")
    skip = () if serving else SERVE_ONLY_FIELDS
    add_dataclass_args(group, EngineArgs, skip=skip)


def add_dataclass_args(group, cls, *, skip=(), defaults=None) -> None:
    """One flag per field of the dataclass `cls` (EngineArgs, ServerArgs): `--max-num-seqs` for
    `max_num_seqs`, parsed as the annotation says (`int | None` as int, default None), with the
    field's `help`, `metavar` and `choices`; `size=True` fields take sizes such as 4GiB, bools are
    --x / --no-x. `defaults` overrides fields' defaults (e.g. from the environment)."""
    hints = typing.get_type_hints(cls)
    instance = cls()
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if not meta.get("cli", True) or field.name in skip:
            continue
        default = (defaults or {}).get(field.name, getattr(instance, field.name))
        kwargs = {"default": default, "help": _help_with_default(meta["help"], default)}
        value_type = meta.get("type") or _flag_type(cls.__name__, field.name, hints[field.name])
        if value_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = parse_size if meta.get("size") else value_type
            kwargs.update({key: meta[key] for key in ("metavar", "choices", "nargs") if key in meta})
        group.add_argument("--" + field.name.replace("_", "-"), **kwargs)


def _flag_type(owner: str, name: str, hint) -> type:
    """`int` or `int | None` -> int; likewise float, str and bool."""
    types = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    if len(types) != 1 or types[0] not in (bool, int, float, str):
        raise TypeError(f"{owner}.{name}: no command-line flag for a field of type {hint}")
    return types[0]


def _help_with_default(text: str, default) -> str:
    """The field's help, ending in its default unless the text already names it."""
    if "default" not in text.lower():
        shown = ("on" if default else "off") if isinstance(default, bool) else default
        text = f"{text} (default: {shown})"
    return text.replace("%", "%%")  # argparse %-formats help texts


def from_flags(cls, args: argparse.Namespace):
    """The `cls` (EngineArgs, ServerArgs) that the flags in `args` give (a field without a flag keeps its default)."""
    given = vars(args)
    return cls(**{field.name: given[field.name] for field in dataclasses.fields(cls) if field.name in given})


def engine_args(args: argparse.Namespace) -> EngineArgs:
    return from_flags(EngineArgs, args)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="jaxllm's log level (uvicorn's: --uvicorn-log-level) (default: %(default)s)",
    )


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="most tokens per answer (default: %(default)s)"
    )
    group.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: %(default)s)")
    group.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="makes the samples reproducible (default: random)",
    )
    group.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop at this text (repeatable)")


def sampling_params(args: argparse.Namespace):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="jaxllm", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"jaxllm {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    serve = commands.add_parser(
        "serve",
        formatter_class=formatter,
        help="run the OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, "
        "/v1/chat/completions, plus /tokenize, /detokenize, /health, /version and Prometheus "
        "/metrics.\nThe model is loaded and compiled first; a line starting with 'jaxllm: ready' "
        "(with the URL) says when requests are accepted.",
        epilog="example:\n  jaxllm serve --port 8080 --api-key secret\n"
        "  python -c \"from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8080/v1', "
        "api_key='secret'); print(c.models.list())\"",
    )
    add_engine_args(serve, serving=True)
    add_log_level(serve)
    add_dataclass_args(
        serve.add_argument_group("server (limits: docs/serving.md)"),
        ServerArgs,
        defaults={"api_key": os.environ.get("JAXLLM_API_KEY")},
    )
    serve.set_defaults(run=run_serve)

    generate = commands.add_parser(
        "generate",
        formatter_class=formatter,
        help="complete prompts, streaming the text to the terminal",
        description="Complete each prompt (plain text completion, no chat template) and print the prompt "
        "followed by its continuation as it is generated. All prompts run batched together; their "
        "texts are printed in order.",
        epilog='example:\n  jaxllm generate --temperature 0 --max-tokens 32 "def fibonacci(n):" "Once upon a time"',
    )
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete")
    generate.add_argument("--file", metavar="PATH", help="read prompts from a file, one per line ('-' for stdin)")
    add_sampling_args(generate, max_tokens=128)
    add_engine_args(generate)
    add_log_level(generate)
    generate.set_defaults(run=run_generate)

    chat = commands.add_parser(
        "chat",
        formatter_class=formatter,
        help="chat with the model in the terminal",
        description="An interactive chat through the model's chat template: type a message and press Enter; "
        "the answer streams back. Commands: /reset starts over, /exit (or Ctrl-D) quits, Ctrl-C "
        "stops an answer. Reads stdin line by line, so `echo hi | jaxllm chat` works too.",
    )
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    add_sampling_args(chat, max_tokens=512)
    add_engine_args(chat)
    add_log_level(chat)
    chat.set_defaults(run=run_chat)

    from jaxllm.entrypoints.models_command import add_models_parser

    add_models_parser(commands, formatter)

    from jaxllm.entrypoints.run_batch import add_run_batch_parser

    add_run_batch_parser(commands, formatter, sys.modules[__name__])

    from jaxllm.bench.commands import add_bench_parser

    add_bench_parser(commands, add_engine_args, engine_args)
    return parser


def _version() -> str:
    from jaxllm.version import __version__

    return __version__


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _log_to_stderr(level: str = "info") -> None:
    """jaxllm's log lines at `level` and above (INFO: the dtype picked, the weights loaded, each
    finished request, the engine's stats) on stderr, once each, with the time."""
    log = logging.getLogger("jaxllm")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s jaxllm: %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False  # once: libraries may give the root logger a handler later
    log.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _log_to_stderr(getattr(args, "log_level", "info"))
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # bad options, a missing model, a taken port: no traceback
        print(f"jaxllm {args.command}: error: {e}", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    from jaxllm.entrypoints.openai.api_server import run_server

    if args.process_id != 0:  # a follower: run process 0's steps on this process's devices
        from jaxllm.engine.llm_engine import LLMEngine

        print(
            f"jaxllm: process {args.process_id} of {args.num_processes} follows process 0", file=sys.stderr, flush=True
        )
        LLMEngine(engine_args(args)).follow()
        return 0

    print(
        f"jaxllm: loading {args.model or 'the default model'} and compiling (the first start takes a while)...",
        file=sys.stderr,
        flush=True,
    )
    server_args = from_flags(ServerArgs, args)
    server_args.verify()
    code = run_server(engine_args(args), server_args)
    if code and args.num_processes > 1:
        # The engine stopped (e.g. another process died). JAX's distributed runtime would wait at
        # exit for the processes that are gone, then abort; leave now with our own status.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# ----------------------------------------------------------------------------- generate and chat


def _load(args: argparse.Namespace):
    from jaxllm.engine.llm import LLM

    print(f"jaxllm: loading {args.model or 'the default model'}...", file=sys.stderr, flush=True)
    fields = vars(engine_args(args))
    return LLM(fields.pop("model"), **fields)


class _Terminal:
    """Writes streamed text to stdout; the prompt is shown in bold when stdout is a terminal."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.tty = self.out.isatty()

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def bold(self, text: str) -> None:
        self.write(f"\033[1m{text}\033[0m" if self.tty else text)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        with sys.stdin if args.file == "-" else open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    if not prompts:
        print("jaxllm generate: error: give prompts as arguments or with --file (see --help)", file=sys.stderr)
        return 2
    params = sampling_params(args)
    engine = _load(args).engine
    term = _Terminal()
    # Every prompt is queued at once (batched); the texts are shown in order: the first unfinished
    # prompt streams live while the later ones collect their text until their turn.
    texts, finished, status = [""] * len(prompts), [False] * len(prompts), 0
    for i, prompt in enumerate(prompts):
        try:
            engine.add_request(str(i), prompt, params, output_kind="delta")
        except ValueError as e:
            texts[i], finished[i] = f"[error: {e}]", True
    start, tokens0 = time.perf_counter(), engine.stats.generation_tokens
    shown = 0
    term.bold(prompts[0])
    term.write(texts[0])
    try:
        while shown < len(prompts):
            for out in engine.step():
                i = int(out.request_id)
                delta = out.outputs[0].text
                texts[i] += delta
                finished[i] = out.finished
                if i == shown:
                    term.write(delta)
            while shown < len(prompts) and finished[shown]:
                term.write("\n")
                shown += 1
                if shown < len(prompts):
                    term.write("\n")
                    term.bold(prompts[shown])
                    term.write(texts[shown])
    except KeyboardInterrupt:
        engine.abort_request([str(i) for i in range(len(prompts))])
        term.write("\n")
        status = 130
    seconds = time.perf_counter() - start
    tokens = engine.stats.generation_tokens - tokens0
    print(
        f"jaxllm: {len(prompts)} prompt(s), {tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} "
        f"tokens/s)",
        file=sys.stderr,
    )
    return status


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _load(args)
    engine = llm.engine
    term = _Terminal()
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if interactive:
        print(
            f"jaxllm chat with {engine.model_name}: type a message, /reset to start over, /exit to quit.",
            file=sys.stderr,
        )
    for turn in range(sys.maxsize):
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break  # end of input
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        request_id = f"chat-{turn}"
        try:
            engine.add_request(
                request_id, None, params, prompt_token_ids=llm.apply_chat_template(messages), output_kind="delta"
            )
        except ValueError as e:
            messages.pop()
            print(f"jaxllm chat: error: {e} (/reset starts over)", file=sys.stderr)
            continue
        if interactive:
            term.bold("assistant> ")
        reply, done = "", False
        try:
            while not done:
                for out in engine.step():
                    reply += out.outputs[0].text
                    term.write(out.outputs[0].text)
                    done = out.finished
        except KeyboardInterrupt:  # stop this answer, keep chatting
            engine.abort_request(request_id)
        term.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
