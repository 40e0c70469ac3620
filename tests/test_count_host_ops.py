"""scripts/count_host_ops.py counts what each host step of an internode forward pair issues on the CPU stand-in: the
steps come from the backend's own laps, and the counts from its torch ops, native calls and uploads."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_step_of_a_2x2_forward_pair_is_listed_with_what_it_issued():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "count_host_ops.py"), "--world", "4",
                          "--ranks-per-node", "2"], capture_output=True, text=True, timeout=600, check=True).stdout
    steps = {line.split()[0]: line[40:].strip() for line in out.splitlines() if line.strip()}
    assert {"dispatch.entry", "dispatch.reader_before_counts", "combine.gather", "combine.finish"} <= set(steps)
    # the pipelined gather makes its by-arrival table in one native call (gather_rows_by_arrival, since session 43),
    # has the second stream wait for ours (stream_wait) and launches gather_tiles there, uploading its tile table and
    # the rows' ends, and (at 2 x 2 nothing is planned ahead by default: UCCL_EP_PLAN_AHEAD=auto) its hop plan's
    # table
    assert "native 3" in steps["combine.gather"] and "uploads 3" in steps["combine.gather"], steps["combine.gather"]
    # the dispatch after the combine goes before the count read (docs/internode.md, "The forward before the count
    # read"): behind notify's wait, native launches only, and no upload -- the tables from the count rows, our own
    # records' pack, the gate, the forward, the node barrier's two kernels and the unpack
    assert steps["dispatch.reader_before_counts"] == "native 7", steps["dispatch.reader_before_counts"]
