"""GPT pretraining with ``--moe-token-dispatcher-type uccl`` available.

    torchrun --nproc-per-node 8 -m megatron_patch.pretrain_gpt [--megatron-lm DIR] <Megatron arguments>

Applies :func:`megatron_patch.apply`, then:

- by default (self-contained, megatron-core wheel only): parses Megatron's arguments and runs
  ``megatron.training.pretrain`` with our own GPT model provider, datasets provider and forward step
  (:mod:`megatron_patch.gpt_provider`); no Megatron-LM checkout is needed;
- with ``--megatron-lm DIR`` (or ``$MEGATRON_LM_PATH``): runs that checkout's own ``pretrain_gpt.py`` as
  ``__main__`` with the remaining arguments, for features the compact driver does not implement (SFT, FIM,
  packed sequences, ModelOpt, ...) or to track a Megatron-LM version exactly.

``--megatron-lm`` is ours and is taken out of the argument list; everything else is Megatron's.
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
    """The pretrain_gpt.py of a Megatron-LM checkout; raises MegatronLMNotFound saying where it looked.

    :func:`main` asks only when ``--megatron-lm DIR`` or ``$MEGATRON_LM_PATH`` is given (which must then hold the
    script); the other places are looked at when neither is given."""
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


def checkout_requested(directory: str | None, env: dict[str, str] | None = None) -> bool:
    """Whether to run a Megatron-LM checkout's script (``--megatron-lm DIR`` or ``$MEGATRON_LM_PATH``)."""
    env = os.environ if env is None else env
    return bool(directory) or bool(env.get(ENV))


def run_checkout(script: Path, megatron_argv: list[str]) -> None:
    """Run a checkout's pretrain_gpt.py as ``__main__`` (the patch must be applied)."""
    root = str(script.parent)
    if root not in sys.path:
        sys.path.insert(0, root)  # pretrain_gpt.py imports model_provider and gpt_builders from its directory
    sys.argv = [str(script)] + megatron_argv
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    directory, megatron_argv = split_argv(list(sys.argv[1:] if argv is None else argv))
    script = None
    if checkout_requested(directory):
        try:
            script = find_script(directory)  # before the patch: a wrong path fails at once
        except MegatronLMNotFound as exc:
            raise SystemExit(f"megatron_patch.pretrain_gpt: {exc}") from None
    import megatron_patch

    report = megatron_patch.apply()
    if int(os.environ.get("RANK", "0")) == 0:
        print(report, flush=True)
    if script is not None:
        run_checkout(script, megatron_argv)
    else:
        from megatron_patch import gpt_provider

        gpt_provider.main(megatron_argv)


if __name__ == "__main__":
    main()
