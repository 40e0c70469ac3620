"""scripts/native_backtrace.c, preloaded, prints the native frames of a crash that Python's faulthandler shows only
as the Python line that called into native code (how session 21 found the diagnostics segfault)."""
import os
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_preloaded_native_backtrace_names_the_faulting_frames_and_the_process_still_dies_of_the_signal(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    lib = tmp_path / "native_backtrace.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), os.path.join(ROOT, "scripts", "native_backtrace.c")],
                   check=True, capture_output=True)
    crash = ("import ctypes, faulthandler, threading\n"
             "faulthandler.enable(all_threads=True)\n"
             "t = threading.Thread(target=lambda: ctypes.string_at(8))\n"
             "t.start(); t.join()\n")
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, LD_PRELOAD=str(lib)))
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr)
    err = out.stderr
    assert "Fatal Python error: Segmentation fault" in err  # faulthandler ran first ...
    assert "== native backtrace: signal 11 in thread" in err and "== end of native backtrace ==" in err  # ... then it
    frames = err.split("== native backtrace:")[1].split("== end of native backtrace ==")[0]
    # the frames lead down to the native call that faulted (ctypes' foreign call)
    assert any(name in frames for name in ("_ctypes", "libffi", "ffi_call")), frames
