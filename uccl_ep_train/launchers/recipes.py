"""Finding and composing the Hydra recipes, and reading the per-cluster environment files.

The recipes ship inside the wheel as ``uccl_ep_train/recipes`` and the launch scripts as
``uccl_ep_train/launch_scripts`` (CMakeLists.txt installs them); an editable install reads the repository's
``recipes/`` and ``launch/`` instead. A user's ``--config-dir`` adds config groups options beside ours.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Sequence

PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = PACKAGE_DIR.parent
GROUPS = ("model", "parallelism", "dispatcher", "cluster", "training", "data")


class RecipeError(ValueError):
    """A recipe cannot be composed or does not validate. The message says what to change."""


def recipes_dir() -> Path:
    """The packaged recipes (wheel) or, for an editable install / source checkout, the repository's recipes/."""
    for candidate in (PACKAGE_DIR / "recipes", REPO_DIR / "recipes"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise RecipeError(
        f"no recipes found in {PACKAGE_DIR / 'recipes'} or {REPO_DIR / 'recipes'}: reinstall uccl-ep-train "
        "(pip install -e . from a checkout, or the wheel)")


def launch_dir() -> Path:
    """The sbatch scripts and per-cluster env files (launch/ in a checkout, launch_scripts/ in the wheel)."""
    for candidate in (PACKAGE_DIR / "launch_scripts", REPO_DIR / "launch"):
        if (candidate / "env").is_dir():
            return candidate
    raise RecipeError(f"no launch scripts found in {PACKAGE_DIR / 'launch_scripts'} or {REPO_DIR / 'launch'}")


def available(group: str, config_dir: str | os.PathLike | None = None) -> list[str]:
    """Option names of a config group (ours plus the user's), for listings and error messages."""
    names = set()
    for root in filter(None, (recipes_dir(), config_dir)):
        folder = Path(root) / group
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml") if not p.stem.startswith("_"))
    if group == "training":
        names.discard("base")
    return sorted(names)


def compose(overrides: Sequence[str] = (), config_dir: str | os.PathLike | None = None):
    """Compose ``config.yaml`` with Hydra overrides (``model=deepseek_v3 training.train_iters=10``).

    ``config_dir``: a folder with the same group layout (``cluster/mycluster.yaml``...) whose options become
    selectable; a name that exists in both places resolves to ours, so give your own files new names.
    """
    try:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RecipeError(f"recipes need hydra-core: pip install 'uccl-ep-train[recipes]' ({exc})") from None

    overrides = list(overrides)
    if config_dir is not None:
        config_dir = Path(config_dir).expanduser().resolve()
        if not config_dir.is_dir():
            raise RecipeError(f"--config-dir {config_dir} is not a directory")
        overrides.append(f"hydra.searchpath=[file://{config_dir}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None, job_name="uccl_ep_train"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise RecipeError(_explain_compose_error(str(exc), config_dir)) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def _explain_compose_error(message: str, config_dir) -> str:
    match = re.search(r"Could not find '(\w+)/([^']+)'", message)
    if match and match.group(1) in GROUPS:
        group = match.group(1)
        return (f"there is no {group} recipe named {match.group(2)!r}: choose one of "
                f"{', '.join(available(group, config_dir))} (or add {group}/{match.group(2)}.yaml to a --config-dir)")
    return f"cannot compose the recipe: {message}"


# ------------------------------------------------------------------------------------------------ env files

_EXPORT = re.compile(r'^export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$')
_DEFAULTED = re.compile(r'^\$\{([A-Za-z_][A-Za-z0-9_]*):-(.*)\}$')
# The one form of `source` allowed: a file beside this one, whichever directory bash was started in.
_SOURCE = re.compile(r'^source\s+"\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/([A-Za-z0-9_.-]+\.sh)"$')


def env_file_path(name: str | None) -> Path | None:
    """Resolve a cluster's ``env_file``: an absolute path, or a name relative to launch/env/."""
    if not name:
        return None
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = launch_dir() / "env" / name
    if not path.is_file():
        raise RecipeError(f"cluster.env_file {name!r} not found (looked at {path}): give an absolute path or a "
                          f"file name in {launch_dir() / 'env'}")
    return path


def env_file_lines(path: str | os.PathLike, _seen: tuple = ()) -> list[tuple[Path, int, str]]:
    """(file, line number, text) of every line bash reads when sourcing an env file: each
    ``source "$(dirname "${BASH_SOURCE[0]}")/other.sh"`` line is replaced by the lines of other.sh (beside it)."""
    path = Path(path)
    if path.resolve() in _seen:
        raise RecipeError(f"{path}: sourced again from {_seen[-1]} (a cycle of env files)")
    out = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        included = _SOURCE.match(raw.strip())
        if included:
            other = path.parent / included.group(1)
            if not other.is_file():
                raise RecipeError(f"{path}:{lineno}: sources {other.name}, which is not in {path.parent}")
            out += env_file_lines(other, _seen + (path.resolve(),))
        else:
            out.append((path, lineno, raw))
    return out


def parse_env_file(path: str | os.PathLike, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a per-cluster env file sets, as bash would when sourcing it into ``environ``.

    The files keep to one form so that this parser and bash agree: ``export NAME="${NAME:-value}"`` (the caller's
    value wins) or ``export NAME=value``, and ``source "$(dirname "${BASH_SOURCE[0]}")/other.sh"`` to read a file
    beside it (in the same form) at that point; comments and blank lines are skipped; anything else is an error.
    ``environ=None`` gives the file's own defaults (what a fresh node gets).
    """
    environ = {} if environ is None else environ
    out: dict[str, str] = {}
    for path, lineno, raw in env_file_lines(path):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _EXPORT.match(line)
        if not match:
            raise RecipeError(f"{path}:{lineno}: only `export NAME=\"${{NAME:-value}}\"` lines (and `source` of a "
                              f"file beside it as \"$(dirname \"${{BASH_SOURCE[0]}}\")/other.sh\"\") are allowed, "
                              f"got {raw!r}")
        name, value = match.group(1), _unquote(match.group(2))
        defaulted = _DEFAULTED.match(value)
        if defaulted:
            if defaulted.group(1) != name:
                raise RecipeError(f"{path}:{lineno}: {name} defaults from ${{{defaulted.group(1)}}}; "
                                  f"use ${{{name}:-...}}")
            # What bash expands: the value set earlier in these files, else the caller's.
            current = out[name] if name in out else environ.get(name, "")
            value = current or defaulted.group(2)
        elif "$" in value or "`" in value:
            raise RecipeError(f"{path}:{lineno}: {name}: only the ${{{name}:-default}} form may expand variables")
        out[name] = value
    return out


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text
