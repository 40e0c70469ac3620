"""scripts/pyspy_summary.py splits the py-spy samples inside the internode calls into the host's waits and its work,
by the innermost frame of the package: what the host steps of `bench internode` cannot tell apart."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import pyspy_summary as ps  # noqa: E402

SITE = "/tmp/site/uccl_ep_train"
B = "NativeInternodeBackend"  # py-spy names a method by its class
RAW = [
    # a forward (uncached) dispatch: waiting in _drain, planning (through numpy), an upload inside a native call
    'process 41:"python -m uccl_ep_train bench internode";'
    f"<module> (bench.py:3);{B}.dispatch ({SITE}/internode.py:2020);"
    f"{B}._uncached_dispatch ({SITE}/internode.py:2110);{B}._drain ({SITE}/internode.py:870) 7\n",
    f"<module> (bench.py:3);{B}.dispatch ({SITE}/internode.py:2020);{B}._uncached_dispatch ({SITE}/internode.py:2110);"
    f"_dispatch_shape ({SITE}/internode.py:1640);forward_block_bases ({SITE}/internode_plan.py:750);"
    "cumsum (numpy/core/fromnumeric.py:2500) 3\n",
    f"<module> (bench.py:3);{B}.dispatch ({SITE}/internode.py:2020);{B}._uncached_dispatch ({SITE}/internode.py:2110);"
    f"_dispatch_shape ({SITE}/internode.py:1640);upload ({SITE}/upload_staging.py:70) 2\n",
    # a cached dispatch and a combine
    f"<module> (bench.py:3);{B}.dispatch ({SITE}/internode.py:2020);"
    f"{B}._cached_dispatch ({SITE}/internode.py:2040) 4\n",
    f"<module> (bench.py:3);{B}.combine ({SITE}/internode.py:2560);{B}._gather_in_tiles ({SITE}/internode.py:2800) 5\n",
    f"<module> (bench.py:3);{B}.combine ({SITE}/internode.py:2560);{B}._drain ({SITE}/internode.py:870) 1\n",
    # outside the calls, and lines that are not samples
    f"<module> (bench.py:3);_training_steps ({SITE}/bench/internode.py:300) 9\n",
    "<module> (bench.py:3) 2\n",
    "\n",
    " 1\n",
]


def test_samples_inside_each_call_kind_split_into_waits_and_work_by_the_innermost_package_frame():
    s = ps.summarize(RAW)
    assert set(s) == {"uncached dispatch", "cached dispatch", "combine"}  # the bench's own frames are no call
    fwd = s["uncached dispatch"]
    assert (fwd["samples"], fwd["waiting"]) == (12, 7)
    assert fwd["work"] == {"forward_block_bases (uccl_ep_train/internode_plan.py:750)": 3,
                           "upload (uccl_ep_train/upload_staging.py:70)": 2}  # numpy's frame charged to our caller
    assert (s["cached dispatch"]["samples"], s["cached dispatch"]["waiting"]) == (4, 0)
    assert s["combine"]["samples"] == 6 and s["combine"]["waiting"] == 1
    # another function may count as a wait
    assert ps.summarize(RAW, ps.WAITS + ("_gather_in_tiles",))["combine"]["waiting"] == 6


def test_the_backend_package_is_read_like_the_one_file_it_was():
    # since session 48 the backend's methods sit in uccl_ep_train/internode/, one module per part of a call
    where = {"dispatch": "dispatch", "_uncached_dispatch": "dispatch", "_cached_dispatch": "dispatch",
             "_drain": "drains", "_dispatch_shape": "dispatch", "combine": "combine", "_gather_in_tiles": "combine"}
    package = []
    for line in RAW:
        for name, module in where.items():
            line = line.replace(f"{name} ({SITE}/internode.py:", f"{name} ({SITE}/internode/{module}.py:")
        package.append(line)
    assert all(f"{SITE}/internode.py:" not in line for line in package)
    old, new = ps.summarize(RAW), ps.summarize(package)
    assert {k: (v["samples"], v["waiting"]) for k, v in new.items()} == \
        {k: (v["samples"], v["waiting"]) for k, v in old.items()} == \
        {"uncached dispatch": (12, 7), "cached dispatch": (4, 0), "combine": (6, 1)}


def test_the_script_prints_each_call_kinds_share_of_waiting_and_its_top_frames(tmp_path):
    raw = tmp_path / "prof.raw"
    raw.write_text("".join(RAW))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pyspy_summary.py"), str(raw), "--top", "1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "## uncached dispatch: 12 samples, 7 waiting (58%), 5 host work" in out
    assert "       3   60.0%  forward_block_bases (uccl_ep_train/internode_plan.py:750)" in out
    assert "upload (uccl_ep_train/upload_staging.py:70)" not in out  # --top 1
    empty = tmp_path / "none.raw"
    empty.write_text("<module> (x.py:1) 3\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pyspy_summary.py"), str(empty)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("no sample passed through")
