"""The run directory: where a run's resolved recipe, provenance, logs and checkpoints live.

A run directory is never reused by accident: starting a run whose directory already holds files is refused unless
``run.resume=true``, which continues from the directory's last checkpoint (Megatron --load).
"""
from __future__ import annotations

import datetime as _dt
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from uccl_ep_train.launchers.recipes import REPO_DIR, RecipeError
from uccl_ep_train.launchers.validation import Topology

CONFIG_FILE = "config.yaml"
PROVENANCE_FILE = "provenance.txt"
# Megatron writes this next to its checkpoints; it names the last complete one.
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def default_name(cfg: DictConfig, topo: Topology, now: _dt.datetime | None = None) -> str:
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{cfg.model.name}-{cfg.dispatcher.name}-{topo.nodes}x{topo.gpus_per_node}-{stamp}"


def resolve(cfg: DictConfig, topo: Topology, cwd: Path | None = None, now: _dt.datetime | None = None) -> Path:
    """The absolute run directory of ``cfg`` (run.root / run.name; a null name gets a timestamped one)."""
    if cfg.run.resume and not cfg.run.name:
        raise RecipeError("run.resume=true needs the run to continue: add run.name=<existing run directory name>")
    root = Path(str(cfg.run.root)).expanduser()
    if not root.is_absolute():
        root = (cwd or Path.cwd()) / root
    return (root / (cfg.run.name or default_name(cfg, topo, now))).resolve()


def last_checkpoint(run_dir: Path) -> int | None:
    """Iteration of the last complete checkpoint in ``run_dir``, or None."""
    tracker = Path(run_dir) / "checkpoints" / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def check(run_dir: Path, resume: bool) -> int | None:
    """Refuse to overwrite; for a resume, return the iteration it continues from."""
    run_dir = Path(run_dir)
    occupied = run_dir.exists() and any(run_dir.iterdir())
    if not resume:
        if occupied:
            raise RecipeError(
                f"run directory {run_dir} already exists and is not empty: choose another run.name=..., or add "
                f"run.resume=true to continue it from its last checkpoint")
        return None
    if not occupied:
        raise RecipeError(f"run.resume=true but {run_dir} does not exist: check run.root and run.name")
    iteration = last_checkpoint(run_dir)
    if iteration is None:
        raise RecipeError(f"run.resume=true but {run_dir / 'checkpoints'} holds no complete checkpoint "
                          f"({TRACKER_FILE} missing): start a new run (another run.name) instead")
    return iteration


def git_description(repo: Path = REPO_DIR) -> str:
    """'<hash>[ (dirty)]' of the source tree the launcher runs from, or why it is unknown."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return f"unknown ({(head.stderr.strip().splitlines() or ['not a git checkout'])[-1]})"
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
        return head.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def create(run_dir: Path, cfg: DictConfig, resume: bool, command: str, overrides: list[str]) -> None:
    """Make the directory and record the resolved recipe, provenance and the exact command."""
    from uccl_ep_train import __version__

    run_dir = Path(run_dir)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    config_name = f"config.resume-{stamp}.yaml" if resume else CONFIG_FILE
    (run_dir / config_name).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    with open(run_dir / PROVENANCE_FILE, "a") as f:
        f.write(f"[{stamp}] {'resume' if resume else 'start'}\n"
                f"uccl-ep-train {__version__} git {git_description()}\n"
                f"overrides: {' '.join(overrides) or '(none)'}\n"
                f"config: {config_name}\n\n")
    (run_dir / ("command.resume.txt" if resume else "command.txt")).write_text(command + "\n")
