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


def test_uccl_sync_free_builds_the_uccl_dispatcher_in_sync_free_mode_and_plain_uccl_does_not(monkeypatch):
    import pytest

    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils

    from uccl_ep_train.megatron import dispatcher as uccl_dispatcher

    built = []

    class Recorder:
        def __init__(self, num_local, local, cfg, pg_collection=None, options=None):
            built.append(options)

    monkeypatch.setattr(moe_utils, "get_default_pg_collection", lambda: None)
    monkeypatch.setattr(uccl_dispatcher, "UCCLTokenDispatcher", Recorder)
    bench._build("uccl-sync-free", None, 4, [0, 1, 2, 3])
    bench._build("uccl", None, 4, [0, 1, 2, 3])
    bench._build("uccl-sync-free", None, 4, [0, 1, 2, 3], sync_free_rows=34000)
    assert [o.sync_free for o in built] == [True, False, True]
    assert [o.num_worst_tokens for o in built] == [0, 0, 34000]  # 0: the dispatcher's worst case
    assert _parse(["--sync-free-rows", "34000"]).sync_free_rows == 34000 and _parse([]).sync_free_rows == 0
    assert _parse(["--dispatchers", "uccl,uccl-sync-free"]).dispatchers == "uccl,uccl-sync-free"
