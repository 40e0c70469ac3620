"""`bench dispatch --emulate-nodes N` (the command issue 5 names) runs the internode bench at its shape."""
import pytest

pytest.importorskip("torch")

from uccl_ep_train.bench import internode  # noqa: E402
from uccl_ep_train.cli import build_parser  # noqa: E402


def _run(monkeypatch, argv):
    seen = []
    monkeypatch.setattr(internode, "run", lambda args: seen.append(args) or 0)
    args = build_parser().parse_args(["bench", "dispatch", *argv])
    return args.func(args), seen


def test_emulate_nodes_runs_the_internode_bench_with_this_commands_shape_and_its_own_defaults(monkeypatch, tmp_path):
    out = str(tmp_path / "r.json")
    rc, seen = _run(monkeypatch, ["--emulate-nodes", "2", "--tokens", "512", "--hidden", "1024", "--topk", "4",
                                  "--experts", "64", "--iters", "3", "--warmup", "1", "--json", out])
    assert rc == 0 and len(seen) == 1
    got, defaults = vars(seen[0]), vars(internode.namespace())
    given = dict(emulate_nodes=2, tokens=512, hidden=1024, topk=4, experts=64, iters=3, warmup=1, json=out)
    assert {k: got[k] for k in given} == given
    assert {k: v for k, v in got.items() if k not in given} == {k: v for k, v in defaults.items() if k not in given}
    assert got["layers"] == 4 and got["compute_us"] == 500.0 and got["share_gpu"] is False


@pytest.mark.parametrize("extra,named", [(["--plot", "p.png"], "--plot"), (["--sweep", "128"], "--sweep"),
                                         (["--num-sms", "8"], "--num-sms"), (["--local-sms", "0"], "--local-sms")])
def test_emulate_nodes_refuses_the_options_only_the_intranode_bench_has(monkeypatch, extra, named):
    with pytest.raises(SystemExit, match=named):
        _run(monkeypatch, ["--emulate-nodes", "2", *extra])


def test_emulate_nodes_below_one_is_refused_and_zero_keeps_the_intranode_bench(monkeypatch):
    with pytest.raises(SystemExit, match="--emulate-nodes must be >= 1"):
        _run(monkeypatch, ["--emulate-nodes", "-1"])
    args = build_parser().parse_args(["bench", "dispatch"])
    assert args.emulate_nodes == 0


def test_the_internode_namespace_refuses_names_it_does_not_have():
    with pytest.raises(ValueError, match="no argument"):
        internode.namespace(sweep="128")


def test_share_gpu_is_passed_on_with_emulate_nodes_and_refused_without(monkeypatch):
    rc, seen = _run(monkeypatch, ["--emulate-nodes", "2", "--share-gpu"])
    assert rc == 0 and seen[0].share_gpu is True
    with pytest.raises(SystemExit, match="--share-gpu needs --emulate-nodes"):
        _run(monkeypatch, ["--share-gpu"])
