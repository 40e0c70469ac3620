"""Where the main threads' wall time goes inside the internode calls, from a py-spy profile in its raw format.

The host steps of a call (`bench internode`'s `*_host_step_us_by_rank`) say how long each step took, not what the
thread did meanwhile: working, waiting for its stream, or waiting for a CPU. py-spy samples the stacks, idle ones
included, so the samples inside a call split into the host's own waits and the rest, by the innermost frame of this
package. Record on the GPU machine (py-spy from a carried wheel; scripts/gpu-check.sh, step pyspy_internode):

    py-spy record --subprocesses --idle --rate 500 --format raw -o prof.raw -- torchrun ... bench internode ...
    python3 scripts/pyspy_summary.py prof.raw [--top 25] [--wait NAME ...]

Each line of the raw format is a stack, outermost frame first, frames "function (path:line)" joined by ";", then a
space and its sample count. A sample belongs to a call when its stack passes through the backend's dispatch or
combine (uccl_ep_train/internode/, or uccl_ep_train/internode.py in profiles made before session 48); dispatches are
split by whether the stack also passes through _uncached_dispatch. It is charged to the innermost frame of
uccl_ep_train, and counted as waiting when that frame's function is one of the waits (default: _drain, the host
polling its stream's mark).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from typing import Dict, Iterable, List, Optional, Tuple

PACKAGE = "uccl_ep_train/"
# the backend's package, and the one file it was before session 48 (older profiles in docs/benchmarks/)
BACKEND = ("uccl_ep_train/internode/", "uccl_ep_train/internode.py")
WAITS = ("_drain",)
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<path>.+):(?P<line>\d+)\)$")


def parse_frame(frame: str) -> Optional[Tuple[str, str, int]]:
    """(function, path, line) of one py-spy frame; None for frames without a location (process, thread, native)."""
    m = _FRAME.match(frame.strip())
    # py-spy names methods by their class ("NativeInternodeBackend.dispatch"); the summary keys on the method
    return (m["func"].rpartition(".")[2], m["path"], int(m["line"])) if m else None


def in_backend(path: str) -> bool:
    """Whether a frame's file is the internode backend's."""
    return BACKEND[0] in path or path.endswith(BACKEND[1])


def call_kind(frames: List[Optional[Tuple[str, str, int]]]) -> Optional[str]:
    """"uncached dispatch", "cached dispatch" or "combine" for a stack inside one of the backend's calls, else None."""
    names = {f[0] for f in frames if f and in_backend(f[1])}
    if "combine" in names:
        return "combine"
    if "dispatch" in names:
        return "uncached dispatch" if "_uncached_dispatch" in names else "cached dispatch"
    return None


def summarize(lines: Iterable[str], waits: Tuple[str, ...] = WAITS) -> Dict[str, dict]:
    """Per call kind: samples in all, samples waiting, and the samples of host work by innermost package frame."""
    out: Dict[str, dict] = {}
    for raw in lines:
        raw = raw.rstrip("\n")
        stack, _, count = raw.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [parse_frame(f) for f in stack.split(";")]
        kind = call_kind(frames)
        if kind is None:
            continue
        ours = [f for f in frames if f and PACKAGE in f[1]]
        inner = ours[-1]
        entry = out.setdefault(kind, {"samples": 0, "waiting": 0, "work": collections.Counter()})
        n = int(count)
        entry["samples"] += n
        if inner[0] in waits:
            entry["waiting"] += n
        else:
            where = inner[1][inner[1].rindex(PACKAGE):]
            entry["work"][f"{inner[0]} ({where}:{inner[2]})"] += n
    return out


def render(summary: Dict[str, dict], top: int) -> str:
    parts = []
    for kind, e in sorted(summary.items()):
        work = e["samples"] - e["waiting"]
        parts.append(f"## {kind}: {e['samples']} samples, {e['waiting']} waiting "
                     f"({100 * e['waiting'] / max(e['samples'], 1):.0f}%), {work} host work")
        for frame, n in e["work"].most_common(top):
            parts.append(f"{n:8d} {100 * n / max(work, 1):6.1f}%  {frame}")
        parts.append("")
    return "\n".join(parts) if parts else "no sample passed through the backend's dispatch or combine\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy record --format raw output")
    p.add_argument("--top", type=int, default=25, help="frames listed per call kind")
    p.add_argument("--wait", action="append", default=[], metavar="NAME",
                   help=f"a function that counts as waiting besides {', '.join(WAITS)} (repeatable)")
    args = p.parse_args(argv)
    with open(args.raw) as f:
        sys.stdout.write(render(summarize(f, WAITS + tuple(args.wait)), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
