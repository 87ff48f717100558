"""The `lmserve` command: generate | serve | bench | memory | quantize | diagnose | simulate | router.

Each subcommand lives in its own module exposing `add_parser(subparsers)` (which sets `func`); modules
keep heavy imports (torch, FastAPI) inside their run functions so `lmserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module path, function that adds the subparser
SUBCOMMANDS: list[tuple[str, str]] = [
    ("lmserve.entrypoints.generate_cli", "add_parser"),
    ("lmserve.entrypoints.memory_cli", "add_memory_parser"),
    ("lmserve.entrypoints.bench_cli", "add_parser"),
    ("lmserve.entrypoints.openai.serve_cli", "add_parser"),
    ("lmserve.entrypoints.quantize_cli", "add_parser"),
    ("lmserve.entrypoints.diagnose_cli", "add_parser"),
    ("lmserve.entrypoints.simulate_cli", "add_parser"),
    ("lmserve.entrypoints.router_cli", "add_parser"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_names()) + "}")
    for module, fn in SUBCOMMANDS:
        getattr(importlib.import_module(module), fn)(sub)
    return parser


def _names() -> list[str]:
    return [m.rsplit(".", 1)[1].removesuffix("_cli") for m, _ in SUBCOMMANDS]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
