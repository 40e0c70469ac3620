"""A per-cluster env file may `source "$(dirname "${BASH_SOURCE[0]}")/other.sh"` (launch/env/amd_common.sh): the
Python parser follows it as bash does, and the rendered sbatch script embeds the sourced lines in its place."""
import os
import subprocess

import pytest

from conftest import SLURM_FILL
from uccl_ep_train.launchers import argv as argv_mod
from uccl_ep_train.launchers import slurm
from uccl_ep_train.launchers.recipes import RecipeError, env_file_lines, launch_dir, parse_env_file

SOURCE = 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"\n'


def _bash_values(path, names, environ, cwd):
    script = "set -euo pipefail; source " + str(path) + "; " + "; ".join(f'printf "%s=%s\\n" {k} "${k}"' for k in names)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, cwd=cwd,
                         env={"PATH": os.environ["PATH"], **environ}).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_parser_follows_a_source_beside_the_file_as_bash_does(tmp_path):
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "common.sh").write_text('export SHARED="${SHARED:-from-common}"\nexport BOTH="${BOTH:-common}"\n')
    cluster = env_dir / "cluster.sh"
    # BOTH is set by common.sh first, so the cluster file's own default loses (as in bash)
    cluster.write_text('export OWN="${OWN:-7}"\n' + SOURCE + 'export BOTH="${BOTH:-cluster}"\nexport LAST=1\n')
    for environ in ({}, {"SHARED": "caller", "BOTH": "caller"}, {"BOTH": ""}):
        ours = parse_env_file(cluster, environ)
        assert list(ours) == ["OWN", "SHARED", "BOTH", "LAST"]
        assert _bash_values(cluster, ours, environ, cwd=tmp_path) == ours  # bash started elsewhere: still found
    assert parse_env_file(cluster)["BOTH"] == "common"
    assert parse_env_file(cluster, {"SHARED": "caller"})["SHARED"] == "caller"


def test_amd_cluster_files_take_the_shared_amd_settings_and_keep_their_nic_caps():
    common = parse_env_file(launch_dir() / "env" / "amd_common.sh")
    for name, inflight in (("mi300x_thor2.sh", "1572864"), ("mi355x_pollara.sh", "4194304")):
        values = parse_env_file(launch_dir() / "env" / name)
        assert common.items() <= values.items()
        assert values["UCCL_IB_MAX_INFLIGHT_BYTES"] == inflight and "UCCL_IB_MAX_INFLIGHT_BYTES" not in common
        assert [f.name for f, _, _ in env_file_lines(launch_dir() / "env" / name)].count("amd_common.sh") > 0


def test_env_file_source_errors_name_the_file_and_the_fix(tmp_path):
    cluster = tmp_path / "cluster.sh"
    cluster.write_text(SOURCE)
    with pytest.raises(RecipeError, match=r"sources common.sh, which is not in"):
        parse_env_file(cluster)
    (tmp_path / "common.sh").write_text('source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"\n')
    with pytest.raises(RecipeError, match="sourced again from .*common.sh"):
        parse_env_file(cluster)
    cluster.write_text("source common.sh\n")  # relative to bash's working directory: not what the job would read
    with pytest.raises(RecipeError, match=r"only `export .*BASH_SOURCE"):
        parse_env_file(cluster)


@pytest.mark.parametrize("cluster", ["mi300x_thor2", "mi355x_pollara"])
def test_rendered_sbatch_embeds_the_sourced_amd_settings_in_place(recipe, tmp_path, cluster):
    cfg, topo = recipe("model=multi_node_ep16_32", "parallelism=ep32_four_nodes", f"cluster={cluster}", *SLURM_FILL)
    run_dir = tmp_path / "runs" / "r"
    text = slurm.render(cfg, argv_mod.build(cfg, topo, run_dir), topo, run_dir)
    lines = text.splitlines()
    assert not [ln for ln in lines if ln.startswith("source ")]  # the job reads no file beside the launcher
    common = [ln for ln in (launch_dir() / "env" / "amd_common.sh").read_text().splitlines()
              if not ln.startswith("# shellcheck")]
    start = lines.index(common[0])
    assert lines[start:start + len(common)] == common
    assert start < lines.index(next(ln for ln in lines if ln.startswith("export NCCL_IB_HCA=")))
