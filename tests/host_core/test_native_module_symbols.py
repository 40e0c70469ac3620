"""The compiled module keeps a statically linked C++ runtime to itself (CMakeLists.txt, --exclude-libs).

Some toolchains link libstdc++ into the module statically. Exported, those symbols bind at run time to the
libstdc++.so that torch loaded, while the code inlined into the module keeps its own copy; the two disagree about
locale facets, and formatting a number in a std::ostringstream crashed (Proxy::describe on the lent GPU machines).
Where the runtime is linked dynamically (most builds, CI's) the module defines none of these symbols either.
"""
import shutil
import subprocess

import pytest

from uccl_ep_train import native

# Defined only by the C++ runtime itself: std::locale, std::ios_base, and the ABI's exception support.
RUNTIME_PREFIXES = ("_ZNSt6locale", "_ZNKSt6locale", "_ZNSt8ios_base", "__cxa_throw", "__cxa_begin_catch",
                    "_ZTVN10__cxxabiv1")


def test_the_module_exports_no_symbol_of_a_c_plus_plus_runtime_linked_into_it():
    if not native.available():
        pytest.skip("uccl_ep_train._C is not built")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    path = native.module().__file__
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    exported = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert exported, f"nm found no exported symbol at all in {path}"
    leaked = [s for s in exported if s.startswith(RUNTIME_PREFIXES)]
    assert not leaked, (f"{path} exports {len(leaked)} symbols of a C++ runtime linked into it (e.g. "
                        f"{leaked[:3]}): link _C with -Wl,--exclude-libs=libstdc++.a:libsupc++.a")
