"""tests/conftest.py's torchrun hook: a GPU-suite rank whose test fails prints the failure and exits at once."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, env_extra):
    (tmp_path / "test_lockstep.py").write_text(textwrap.dedent(f"""
        def test_fails_here():
            assert 1 + 1 == 3, "the reason the peers should see"

        def test_never_reached():
            open({str(tmp_path / "reached")!r}, "w").close()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_lockstep.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_failing_rank_under_torchrun_prints_the_failure_and_exits_before_its_next_test(tmp_path):
    out = _run(tmp_path, {"TORCHELASTIC_RUN_ID": "t", "WORLD_SIZE": "2", "RANK": "1"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "test_fails_here failed on rank 1" in out.stderr and "the reason the peers should see" in out.stderr
    assert not (tmp_path / "reached").exists()


def test_outside_torchrun_a_failure_is_an_ordinary_pytest_failure(tmp_path):
    out = _run(tmp_path, {})
    assert out.returncode == 1 and "1 failed, 1 passed" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "reached").exists()
