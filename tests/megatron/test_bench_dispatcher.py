"""The `bench dispatcher` subcommand's command line (timing itself needs GPUs: see docs/megatron.md)."""
from __future__ import annotations

import argparse

from uccl_ep_train.bench import dispatcher as bench


def _parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["dispatcher"] + argv)


def test_defaults_are_the_deepseek_v3_shape_and_every_dispatcher():
    args = _parse([])
    assert (args.tokens, args.hidden, args.topk, args.experts) == (4096, 7168, 8, 256)
    assert args.dispatchers.split(",") == ["alltoall", "allgather", "flex", "uccl"]
    assert args.func is bench.run


def test_shape_and_json_options_are_parsed():
    args = _parse(["--tokens", "128", "--hidden", "256", "--topk", "2", "--experts", "8", "--json", "-",
                   "--dispatchers", "uccl,alltoall"])
    assert (args.tokens, args.hidden, args.topk, args.experts, args.json) == (128, 256, 2, 8, "-")


def test_without_torchrun_it_explains_how_to_start(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert bench.run(_parse([])) == 2
    assert "torchrun" in capsys.readouterr().err
