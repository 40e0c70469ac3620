"""How many rows the internode bench's sync-free dispatches receive (bench internode --sync-free [--sync-free-rows
N]): the worst case by default, or a capacity the user names, as training sets it; bad combinations stop the bench
before it starts a process group."""
import pytest

pytest.importorskip("torch")

from uccl_ep_train.bench import internode  # noqa: E402
from uccl_ep_train.cli import build_parser  # noqa: E402


def _args(*argv):
    return build_parser().parse_args(["bench", "internode", *argv])


def test_without_sync_free_the_dispatches_have_no_num_worst_tokens():
    assert internode.num_worst_tokens(_args(), 4) == 0
    assert internode.num_worst_tokens(_args("--expert-major"), 4) == 0


def test_the_worst_case_is_every_token_of_every_rank_and_per_local_expert_for_expert_major():
    # 4096 tokens x 2 ranks; expert-major: x min(top-8, 128 local experts) = 8 rows per token and rank
    assert internode.num_worst_tokens(_args("--sync-free"), 2) == 4096 * 2
    assert internode.num_worst_tokens(_args("--sync-free", "--expert-major"), 2) == 4096 * 2 * 8
    # few local experts bound a token's rows: 16 experts on 8 ranks leave 2 per rank
    small = _args("--sync-free", "--expert-major", "--experts", "16", "--tokens", "100")
    assert internode.num_worst_tokens(small, 8) == 100 * 8 * 2


def test_sync_free_rows_sets_the_capacity_and_is_recorded_as_given():
    args = _args("--sync-free", "--expert-major", "--sync-free-rows", "36000")
    assert args.sync_free_rows == 36000
    assert internode.num_worst_tokens(args, 2) == 36000
    assert internode.namespace().sync_free_rows == 0  # what `bench dispatch --emulate-nodes` starts from


@pytest.mark.parametrize("argv,named", [(["--sync-free-rows", "100"], "needs --sync-free"),
                                        (["--sync-free", "--sync-free-rows", "-1"], "must be >= 0")])
def test_rows_without_sync_free_or_below_zero_stop_the_bench_before_it_starts(monkeypatch, argv, named):
    args = _args(*argv)
    with pytest.raises(SystemExit, match=named):
        internode.check_sync_free_rows(args)
    # run() checks first: it stops before touching CUDA or a process group
    monkeypatch.setattr(internode.os, "environ", {"LOCAL_RANK": "should not be read"})
    with pytest.raises(SystemExit, match=named):
        internode.run(args)
