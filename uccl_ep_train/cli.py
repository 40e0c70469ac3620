"""`uccl-ep-train`: the command line. Each subcommand lives in the module that owns its concept and registers itself
with `register(subparsers)`; this file only wires them together (and imports them lazily, so `doctor` works on a
machine where torch or Megatron is missing)."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module providing register(subparsers) that sets `func` on its parser
_SUBCOMMANDS = {
    "train": "uccl_ep_train.launchers.train_cli",
    "bench": "uccl_ep_train.bench.cli",
    "doctor": "uccl_ep_train.doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uccl-ep-train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in _SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            stub = sub.add_parser(name, help=f"(unavailable: {exc})")
            stub.set_defaults(func=lambda args, exc=exc: _unavailable(exc))
            continue
        module.register(sub)
    return parser


def _unavailable(exc: Exception) -> int:
    print(f"uccl-ep-train: this subcommand cannot run here: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
