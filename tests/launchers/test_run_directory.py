"""Run directories (refusal to overwrite, resume, provenance), the `train` command, throughput parsing and a
local torchrun end to end with a stand-in training module."""
import json
import sys
import textwrap

import pytest

from uccl_ep_train import cli
from uccl_ep_train.launchers import argv as argv_mod
from uccl_ep_train.launchers import local, rundir, throughput
from uccl_ep_train.launchers.recipes import RecipeError

MEGATRON_LINE = (" [2026-01-01 00:00:00.000000] iteration {it:8d}/      50 | consumed samples:          160 | "
                 "elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | "
                 "learning rate: 1.000000E-03 | global batch size:    16 | lm loss: {loss:.6E} | loss scale: 1.0 |")


def test_existing_run_directory_is_refused_unless_resuming(tmp_path):
    run = tmp_path / "r"
    assert rundir.check(run, resume=False) is None  # new: fine
    run.mkdir()
    (run / "config.yaml").write_text("x")
    with pytest.raises(RecipeError, match=r"already exists and is not empty: choose another run.name=.*"
                                          r"run.resume=true"):
        rundir.check(run, resume=False)
    with pytest.raises(RecipeError, match="holds no complete checkpoint"):
        rundir.check(run, resume=True)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / rundir.TRACKER_FILE).write_text("250\n")
    assert rundir.check(run, resume=True) == 250


def test_resume_without_a_name_or_directory_says_what_to_give(recipe, tmp_path):
    cfg, topo = recipe("run.resume=true")
    with pytest.raises(RecipeError, match=r"needs the run to continue: add run.name="):
        rundir.resolve(cfg, topo)
    with pytest.raises(RecipeError, match="does not exist"):
        rundir.check(tmp_path / "missing", resume=True)


def test_run_directory_records_resolved_recipe_git_hash_and_command(recipe, tmp_path):
    cfg, topo = recipe(f"run.root={tmp_path}", "run.name=a")
    run = rundir.resolve(cfg, topo)
    assert run == tmp_path / "a"
    rundir.create(run, cfg, False, "torchrun ...", ["model=tiny_1gpu"])
    saved = (run / "config.yaml").read_text()
    assert "name: tiny_1gpu" in saved and "megatron_type: uccl" in saved
    provenance = (run / "provenance.txt").read_text()
    assert "git " in provenance and "overrides: model=tiny_1gpu" in provenance
    assert (run / "command.txt").read_text() == "torchrun ...\n"
    with pytest.raises(RecipeError):
        rundir.check(run, resume=False)


def test_train_refuses_an_existing_run_dir_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "train.log").write_text("old")
    code = cli.main(["train", f"run.root={tmp_path}", "run.name=a", "--dry-run"])
    assert code == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def test_train_dry_run_prints_the_resolved_recipe_and_exact_command(tmp_path, capsys):
    code = cli.main(["train", "parallelism=ep2", "dispatcher=alltoall", f"run.root={tmp_path}", "run.name=b",
                     "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# ---- resolved recipe ----" in out and "megatron_type: alltoall" in out
    command = out.split("# ---- command ----\n", 1)[1]
    assert "torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 -m megatron_patch.pretrain_gpt" in command
    assert "--expert-model-parallel-size 2" in command and "--moe-token-dispatcher-type alltoall" in command
    assert not (tmp_path / "b").exists()  # a dry run creates nothing


def test_train_dry_run_reports_validation_errors(capsys):
    assert cli.main(["train", "cluster=p5en_efa", "--dry-run"]) == 2
    assert "cluster.account is not set" in capsys.readouterr().err


def test_throughput_summary_gives_tflops_and_tokens_per_second():
    lines = [MEGATRON_LINE.format(it=i, ms=ms, tf=tf, loss=10.0 - i)
             for i, (ms, tf) in enumerate([(5000.0, 1.0), (100.0, 20.0), (200.0, 10.0), (100.0, 20.0)], 1)]
    summary = throughput.summarize(["noise", *lines], seq_length=1024, world_size=2)
    assert summary.iterations == 3  # the first (start-up) iteration is skipped
    assert summary.median_ms == 100.0 and summary.median_tflops_per_gpu == 20.0
    assert summary.tokens_per_s == pytest.approx(16 * 1024 / 0.1)
    assert summary.tokens_per_s_per_gpu == pytest.approx(16 * 1024 / 0.1 / 2)
    assert summary.last_lm_loss == pytest.approx(6.0)


def test_local_environment_applies_the_cluster_file_but_the_callers_values_win(recipe):
    cfg, topo = recipe("cluster=mi300x_thor2", "cluster.account=a", "cluster.container.image=i")
    inv = argv_mod.build(cfg, topo, "/tmp/r")
    env = local.environment(cfg, inv, {"PATH": "/bin", "NCCL_IB_GID_INDEX": "7"})
    assert env["NCCL_IB_GID_INDEX"] == "7" and env["UCCL_IB_MAX_INFLIGHT_NORMAL"] == "1"
    assert env["PATH"] == "/bin" and env["UCCL_EP_NUM_SMS"] == "24"


def test_local_run_starts_torchrun_logs_and_summarises_throughput(recipe, tmp_path, monkeypatch, capsys):
    """torchrun (CPU) starts a stand-in for megatron_patch.pretrain_gpt that prints Megatron's log lines."""
    pytest.importorskip("torch.distributed.run")
    fake = tmp_path / "fake_pretrain.py"
    fake.write_text(textwrap.dedent(f"""
        import os, sys
        assert "--moe-token-dispatcher-type" in sys.argv and os.environ["UCCL_EP_NUM_SMS"] == "24"
        for it in range(1, 4):
            print({MEGATRON_LINE!r}.format(it=it, ms=100.0 * it, tf=5.0, loss=9.0), flush=True)
    """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:" + ":".join(sys.path))
    cfg, topo = recipe(f"run.root={tmp_path}", "run.name=local", "run.entry_module=fake_pretrain")
    run = rundir.resolve(cfg, topo)
    rundir.create(run, cfg, False, "cmd", [])
    assert local.run(cfg, argv_mod.build(cfg, topo, run), topo, run) == 0
    assert "iteration        3/" in (run / "train.log").read_text()
    summary = json.loads((run / "throughput.json").read_text())
    assert summary["median_tflops_per_gpu"] == 5.0 and summary["iterations"] == 2
    assert "TFLOP/s/GPU" in capsys.readouterr().out
