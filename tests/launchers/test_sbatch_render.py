"""The rendered sbatch script of a 32-node run, executed with stand-ins for srun and scontrol: the command every
node starts is exactly the Megatron argv, under the cluster's environment."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import SLURM_FILL
from uccl_ep_train.launchers import argv as argv_mod
from uccl_ep_train.launchers import slurm
from uccl_ep_train.launchers.recipes import launch_dir

STUB_SRUN = """#!/bin/bash
# Stand-in for srun: record the command and the environment the node would see.
printf '%s\\n' "$@" > "$STUB_OUT/argv"
env > "$STUB_OUT/env"
"""
STUB_SCONTROL = """#!/bin/bash
printf 'node-%03d\\n' $(seq 1 "$SLURM_NNODES")
"""


def _stub_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("git", "#!/bin/bash\necho abc123\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run_script(tmp_path: Path, script: Path, nodes: int, extra_env=None) -> tuple[list[str], dict]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {"PATH": f"{_stub_bin(tmp_path)}:{os.environ['PATH']}", "STUB_OUT": str(out), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": f"node-[001-{nodes:03d}]", "SLURM_JOB_ID": "4242", "HOME": str(tmp_path),
           **(extra_env or {})}
    subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True, text=True, cwd=tmp_path)
    argv = (out / "argv").read_text().splitlines()
    node_env = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    return argv, node_env


def _render(recipe, tmp_path, *overrides):
    cfg, topo = recipe(*overrides)
    run_dir = tmp_path / "runs" / "dsv3"
    inv = argv_mod.build(cfg, topo, run_dir)
    text = slurm.render(cfg, inv, topo, run_dir, list(overrides))
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    return cfg, topo, inv, text, script


def test_32_node_p5en_sbatch_starts_torchrun_per_node_in_the_container(recipe, tmp_path):
    cfg, topo, inv, text, script = _render(
        recipe, tmp_path, "model=deepseek_v3", "parallelism=dsv3_pp16_ep16", "cluster=p5en_efa", *SLURM_FILL)
    assert topo.nodes == 32 and topo.world_size == 256
    for line in ("#SBATCH --nodes=32", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --account=acct", "#SBATCH --exclusive", "#SBATCH --cpus-per-task=192",
                 f"#SBATCH --output={tmp_path}/runs/dsv3/slurm-%j.out"):
        assert line in text.splitlines()
    assert "launch/env/" in text and 'export FI_PROVIDER="${FI_PROVIDER:-efa}"' in text

    argv, node_env = _run_script(tmp_path, script, 32)
    i = argv.index("python")
    srun, torchrun = argv[:i], argv[i:]
    assert srun[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"] and "--cpu-bind=cores" in srun
    assert "--container-image=registry/uccl:latest" in srun
    assert f"--container-mounts={tmp_path}/runs:{tmp_path}/runs" in srun
    m = torchrun.index("-m", 3)
    assert torchrun[:m] == ["python", "-m", "torch.distributed.run", "--nnodes", "32", "--nproc-per-node", "8",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-001:29500", "--rdzv-id", "4242"]
    assert torchrun[m + 1] == "megatron_patch.pretrain_gpt"
    assert torchrun[m + 2:] == inv.argv  # quoting survives bash: the layout and layer pattern arrive intact
    assert node_env["MASTER_ADDR"] == "node-001" and node_env["FI_PROVIDER"] == "efa"
    assert node_env["NCCL_MAX_NCHANNELS"] == "16" and node_env["UCCL_EP_NUM_SMS"] == "24"


def test_mi300x_docker_sbatch_passes_the_cluster_environment_into_the_container(recipe, tmp_path):
    _, _, inv, _, script = _render(
        recipe, tmp_path, "model=deepseek_v3", "parallelism=dsv3_pp16_ep16", "cluster=mi300x_thor2", *SLURM_FILL)
    argv, node_env = _run_script(tmp_path, script, 32, {"UCCL_IB_GID_INDEX": "1"})
    d = argv.index("docker")
    image = argv.index("registry/uccl:latest")
    docker = argv[d:image]
    assert {"--device=/dev/kfd", "--device=/dev/dri", "--device=/dev/infiniband", "--network=host"} <= set(docker)
    passed = {docker[i + 1] for i, w in enumerate(docker) if w == "-e"}
    assert {"UCCL_IB_MAX_INFLIGHT_NORMAL", "UCCL_IB_MAX_INFLIGHT_BYTES", "HSA_NO_SCRATCH_RECLAIM",
            "MASTER_ADDR", "SLURM_JOB_ID", "UCCL_EP_NUM_SMS"} <= passed
    assert argv[-len(inv.argv):] == inv.argv
    assert node_env["UCCL_IB_MAX_INFLIGHT_BYTES"] == "1572864"
    assert node_env["UCCL_IB_GID_INDEX"] == "1"  # a value set when submitting wins over the file's default


@pytest.mark.parametrize("cluster", ["p5en_efa", "mi300x_thor2", "mi355x_pollara"])
def test_rendered_scripts_pass_bash_n_and_shellcheck(recipe, tmp_path, cluster):
    *_, script = _render(recipe, tmp_path, "model=multi_node_ep16_32", "parallelism=ep32_four_nodes",
                         f"cluster={cluster}", *SLURM_FILL)
    subprocess.run(["bash", "-n", str(script)], check=True)
    _shellcheck(script)


def _shellcheck(*paths):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed here (apt-get install shellcheck); CI installs it")
    result = subprocess.run(["shellcheck", "-x", *map(str, paths)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


SHELL_FILES = sorted([*launch_dir().glob("*.sbatch"), *launch_dir().glob("*.sh"), *launch_dir().glob("env/*.sh")])


@pytest.mark.parametrize("path", SHELL_FILES, ids=[p.name for p in SHELL_FILES])
def test_launch_scripts_pass_bash_n_and_shellcheck(path):
    subprocess.run(["bash", "-n", str(path)], check=True)
    _shellcheck(path)


def test_ready_p5en_sbatch_runs_the_recipe_model_and_refuses_a_used_run_dir(recipe, tmp_path):
    cfg, _ = recipe("model=deepseek_v3", "parallelism=dsv3_pp16_ep16", "cluster=p5en_efa", *SLURM_FILL)
    env = {"UCCL_LAUNCH_DIR": str(launch_dir()), "IMAGE": "img.sqsh", "RUN_ROOT": str(tmp_path / "runs"),
           "SLURM_SUBMIT_DIR": str(tmp_path)}
    argv, node_env = _run_script(tmp_path, launch_dir() / "p5en_efa.sbatch", 32, env)
    assert "--container-image=img.sqsh" in argv and node_env["FI_PROVIDER"] == "efa"
    model = argv_mod.model_args(cfg.model)
    start = argv.index("--num-layers")
    assert argv[start:start + len(model)] == model
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "uccl"
    assert argv[argv.index("--pipeline-model-parallel-layout") + 1] == "Et|(tt|)*30,mL"
    # the same RUN_DIR again: refused
    run_dir = tmp_path / "runs" / "deepseek_v3-uccl-32x8-4242"
    assert (run_dir / "checkpoints").is_dir()
    result = subprocess.run(["bash", str(launch_dir() / "p5en_efa.sbatch")], capture_output=True, text=True,
                            env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_NNODES": "32",
                                 "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n", "STUB_OUT": str(tmp_path),
                                 **env})
    assert result.returncode == 1 and "exists and is not empty" in result.stderr
