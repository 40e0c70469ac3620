"""Run a recipe on this host's GPUs: one torchrun, `parallelism.gpus_per_node` processes.

The cluster's env file (if the recipe names one) is read the way bash would source it into the current
environment, so an interactive node of a Slurm cluster gets the same settings as a batch job.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping

from omegaconf import DictConfig

from uccl_ep_train.launchers import throughput
from uccl_ep_train.launchers.argv import Invocation
from uccl_ep_train.launchers.validation import Topology, cluster_environment


def command(inv: Invocation, topo: Topology, python: str | None = None) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, so the launching interpreter's torch is used)."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(topo.gpus_per_node), "-m", inv.module, *inv.argv]


def environment(cfg: DictConfig, inv: Invocation, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment + the cluster's env file + the run's variables (later wins)."""
    base = dict(os.environ if environ is None else environ)
    base.update(cluster_environment(cfg, base))
    base.update(inv.env)
    return base


def render(cfg: DictConfig, inv: Invocation, topo: Topology) -> str:
    """The command as one shell line (variables the run sets first), for dry runs and the run directory."""
    env = dict(cluster_environment(cfg))
    env.update(inv.env)
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + shlex.join(command(inv, topo))


def run(cfg: DictConfig, inv: Invocation, topo: Topology, run_dir: Path) -> int:
    """Start torchrun, copy its output to the terminal and to <run_dir>/train.log, then summarise throughput."""
    log_path = Path(run_dir) / "train.log"
    lines: list[str] = []
    with open(log_path, "a") as log, subprocess.Popen(
            command(inv, topo), env=environment(cfg, inv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
                if "iteration" in line and "elapsed time per iteration" in line:
                    lines.append(line)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        code = proc.wait()
    summary = throughput.summarize(lines, cfg.training.seq_length, topo.world_size)
    if summary is not None:
        throughput.write(summary, Path(run_dir) / "throughput.json")
        print(f"uccl-ep-train: {throughput.describe(summary)} (saved in {Path(run_dir) / 'throughput.json'})")
    return code
