"""Training throughput from Megatron's iteration log lines: TFLOP/s per GPU and tokens/s.

Megatron (with --log-throughput) prints, per logged iteration, the elapsed time per iteration, the TFLOP/s/GPU
and the global batch size; tokens/s = global batch * sequence length / iteration time.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
_BATCH = re.compile(r"global batch size:\s+(\d+)")
_LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


@dataclass(frozen=True)
class Sample:
    iteration: int
    ms: float
    tflops_per_gpu: float | None
    global_batch: int
    lm_loss: float | None


@dataclass(frozen=True)
class Summary:
    iterations: int
    median_ms: float
    median_tflops_per_gpu: float | None
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    last_lm_loss: float | None


def parse_line(line: str) -> Sample | None:
    it, ms, batch = _ITER.search(line), _MS.search(line), _BATCH.search(line)
    if not (it and ms and batch):
        return None
    tflops, loss = _TFLOPS.search(line), _LOSS.search(line)
    return Sample(int(it.group(1)), float(ms.group(1)), float(tflops.group(1)) if tflops else None,
                  int(batch.group(1)), float(loss.group(1)) if loss else None)


def summarize(lines: Iterable[str], seq_length: int, world_size: int, skip_first: int = 1) -> Summary | None:
    """Medians over the logged iterations after the first ``skip_first`` (start-up and compilation)."""
    samples = [s for s in map(parse_line, lines) if s is not None]
    steady = samples[skip_first:] or samples
    if not steady:
        return None
    median_ms = statistics.median(s.ms for s in steady)
    tflops = [s.tflops_per_gpu for s in steady if s.tflops_per_gpu is not None]
    tokens = statistics.median(s.global_batch * seq_length / (s.ms / 1000.0) for s in steady)
    return Summary(len(steady), median_ms, statistics.median(tflops) if tflops else None, tokens,
                   tokens / world_size, samples[-1].lm_loss)


def write(summary: Summary, path: Path) -> None:
    Path(path).write_text(json.dumps(asdict(summary), indent=2) + "\n")


def describe(summary: Summary) -> str:
    tflops = "n/a" if summary.median_tflops_per_gpu is None else f"{summary.median_tflops_per_gpu:.1f}"
    return (f"throughput over {summary.iterations} iterations: {tflops} TFLOP/s/GPU, "
            f"{summary.tokens_per_s:,.0f} tokens/s ({summary.tokens_per_s_per_gpu:,.0f} per GPU), "
            f"{summary.median_ms:.1f} ms/iteration")
