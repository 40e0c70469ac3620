"""The command line wires every subcommand and reports, rather than crashes, when one cannot run here."""
import subprocess
import sys

import pytest

from uccl_ep_train import cli


def test_every_subcommand_is_registered():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"train", "bench", "doctor"}


@pytest.mark.parametrize("bench", ["proxy", "dispatch", "internode", "dispatcher"])
def test_every_benchmark_is_reachable_from_the_command_line(bench):
    out = subprocess.run([sys.executable, "-m", "uccl_ep_train", "bench", bench, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and bench in out.stdout


def test_missing_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
