"""megatron_patch.pretrain_gpt (runs Megatron-LM's script with the patch applied) and megatron_patch.primus."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_patch import pretrain_gpt

ROOT = Path(__file__).resolve().parents[2]


def test_megatron_lm_option_is_taken_out_of_megatrons_arguments():
    assert pretrain_gpt.split_argv(["--megatron-lm", "/x", "--num-layers", "2"]) == ("/x", ["--num-layers", "2"])
    assert pretrain_gpt.split_argv(["--megatron-lm=/y", "--mock-data"]) == ("/y", ["--mock-data"])


def test_missing_megatron_lm_checkout_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pretrain_gpt.MegatronLMNotFound, match="pretrain_gpt.py.*--megatron-lm"):
        pretrain_gpt.find_script(None, search_path=[str(tmp_path)], env={})
    with pytest.raises(pretrain_gpt.MegatronLMNotFound, match="MEGATRON_LM_PATH points to"):
        pretrain_gpt.find_script(None, search_path=[], env={"MEGATRON_LM_PATH": str(tmp_path)})


def test_entry_point_applies_the_patch_then_runs_megatron_lms_script_as_main(tmp_path):
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "model_provider.py").write_text("MARK = 'beside the script'\n")
    (checkout / "pretrain_gpt.py").write_text(
        "import sys, megatron_patch, model_provider\n"
        "from megatron_patch import config\n"
        "assert __name__ == '__main__'\n"
        "print('RESULT', megatron_patch.is_applied(), 'uccl' in config.choices(), model_provider.MARK, sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_patch.pretrain_gpt", "--megatron-lm",
                           str(checkout), "--mock-data", "--moe-token-dispatcher-type", "uccl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(out_line for out_line in proc.stdout.splitlines() if out_line.startswith("RESULT"))
    assert line == "RESULT True True beside the script ['--mock-data', '--moe-token-dispatcher-type', 'uccl']"


def test_primus_registration_uses_the_setup_phase_and_applies_the_patch(monkeypatch):
    registered = {}

    def register_patch(patch_id, **kwargs):
        def decorator(fn):
            registered[patch_id] = (kwargs, fn)
            return fn
        return decorator

    fake = types.ModuleType("primus.core.patches")
    fake.register_patch = register_patch
    for name in ("primus", "primus.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "primus.core.patches", fake)
    from megatron_patch import primus

    primus.register()
    primus.register()  # idempotent: the registry replaces an entry with the same id
    kwargs, handler = registered[primus.PATCH_ID]
    assert kwargs["backend"] == "megatron" and kwargs["phase"] == "setup"

    def ctx(value):
        params = types.SimpleNamespace(moe_token_dispatcher_type=value)
        return types.SimpleNamespace(extra={"module_config": types.SimpleNamespace(params=params)})

    assert kwargs["condition"](ctx("uccl")) and not kwargs["condition"](ctx("alltoall"))
    handler(ctx("uccl"))
    import megatron_patch

    assert megatron_patch.is_applied()


def test_primus_register_without_primus_says_what_to_install(monkeypatch):
    from megatron_patch import primus

    monkeypatch.setitem(sys.modules, "primus.core.patches", None)
    with pytest.raises(primus.PrimusUnavailable, match="install Primus"):
        primus.register()


REAL_PRIMUS = """
import types
import megatron_patch
from megatron_patch import primus
from primus.core.patches import run_patches
params = types.SimpleNamespace(moe_token_dispatcher_type="alltoall")
skipped = run_patches(backend="megatron", phase="setup", extra={"module_config": types.SimpleNamespace(params=params)},
                      enabled_ids=[primus.PATCH_ID])
before = megatron_patch.is_applied()
params.moe_token_dispatcher_type = "uccl"
applied = run_patches(backend="megatron", phase="setup", extra={"module_config": types.SimpleNamespace(params=params)},
                      enabled_ids=[primus.PATCH_ID])
print("RESULT", skipped, before, applied, megatron_patch.is_applied())
"""


def test_real_primus_patch_runner_applies_the_patch_only_when_the_config_asks_for_uccl():
    """Primus is not on PyPI: this runs where it is importable (e.g. PYTHONPATH=<Primus checkout>)."""
    pytest.importorskip("primus.core.patches")
    proc = subprocess.run([sys.executable, "-c", REAL_PRIMUS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(out_line for out_line in proc.stdout.splitlines() if out_line.startswith("RESULT"))
    assert line == "RESULT 0 False 1 True", line
