"""Megatron-LM's GPT pretraining with ``--moe-token-dispatcher-type uccl`` available.

    torchrun --nproc-per-node 8 -m megatron_patch.pretrain_gpt [--megatron-lm DIR] <Megatron-LM arguments>

Applies :func:`megatron_patch.apply` and then runs Megatron-LM's own ``pretrain_gpt.py`` as ``__main__``, with the
remaining arguments, so every Megatron flag (``--mock-data`` for synthetic data included) behaves as users know it.

Why not a driver of our own: the megatron-core wheel ships ``megatron.training`` (0.19) but not the GPT model
provider and builders (``model_provider.py``, ``gpt_builders.py``, ``pretrain_gpt.py`` live in the root of the
Megatron-LM repository), and ``megatron.training.pretrain``'s signature changes between releases. Running the
checkout's script keeps us correct for whichever Megatron-LM the user has.

Where the script is looked for, first hit wins: ``--megatron-lm DIR``, ``$MEGATRON_LM_PATH``, every ``sys.path``
entry (Megatron-LM's root is on PYTHONPATH in most setups), the working directory.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

SCRIPT = "pretrain_gpt.py"
ENV = "MEGATRON_LM_PATH"


class MegatronLMNotFound(RuntimeError):
    """No Megatron-LM checkout with pretrain_gpt.py was found."""


def split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take our own ``--megatron-lm DIR`` (or ``--megatron-lm=DIR``) out of argv; the rest is Megatron's."""
    rest, directory, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--megatron-lm":
            if i + 1 >= len(argv):
                raise SystemExit("--megatron-lm needs a directory (a Megatron-LM checkout)")
            directory, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--megatron-lm="):
            directory = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return directory, rest


def find_script(directory: str | None = None, search_path: list[str] | None = None,
                env: dict[str, str] | None = None) -> Path:
    """The pretrain_gpt.py of a Megatron-LM checkout; raises MegatronLMNotFound saying where it looked."""
    env = os.environ if env is None else env
    candidates: list[tuple[str, Path]] = []
    if directory:
        candidates.append(("--megatron-lm", Path(directory)))
    if env.get(ENV):
        candidates.append((f"${ENV}", Path(env[ENV])))
    candidates += [("sys.path", Path(p)) for p in (sys.path if search_path is None else search_path) if p]
    candidates.append(("working directory", Path.cwd()))
    for origin, root in candidates:
        script = root / SCRIPT
        if script.is_file():
            return script
        if origin in ("--megatron-lm", f"${ENV}"):
            raise MegatronLMNotFound(f"{origin} points to {root}, which has no {SCRIPT}: give the root of a "
                                     "Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM)")
    try:
        import megatron.training  # noqa: F401

        has_training = "megatron.training is importable, but"
    except ImportError:
        has_training = "megatron.training is not importable (some megatron-core wheels, 0.16 among them, lack it), and"
    raise MegatronLMNotFound(
        f"{has_training} Megatron-LM's {SCRIPT} (with model_provider.py and gpt_builders.py beside it) was not "
        f"found on sys.path or in the working directory. Clone https://github.com/NVIDIA/Megatron-LM (a version "
        f"matching your megatron-core) and pass --megatron-lm DIR, set {ENV}=DIR, or put DIR on PYTHONPATH.")


def main(argv: list[str] | None = None) -> None:
    directory, megatron_argv = split_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        script = find_script(directory)
    except MegatronLMNotFound as exc:
        raise SystemExit(f"megatron_patch.pretrain_gpt: {exc}") from None
    import megatron_patch

    report = megatron_patch.apply()
    if int(os.environ.get("RANK", "0")) == 0:
        print(report, flush=True)
    root = str(script.parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # pretrain_gpt.py imports model_provider and gpt_builders from its directory
    sys.argv = [str(script)] + megatron_argv
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
