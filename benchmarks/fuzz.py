"""Fuzz the parsers that read the network and the disk: a million mutated inputs each.

Runs every target of :mod:`elasticps.testing.fuzz` (the frame header, a JSON
control body, a task-ledger record, a Kafka record, a shard checkpoint file,
and a shard file's metadata with a matching CRC-32) on ``--inputs`` inputs,
and prints one JSON line per target:

- ``inputs``, ``accepted``, ``rejected`` (by error class: the parser's
  documented errors), ``crashes`` (any other error) and ``first_crashes``
  (the error and the input, in hex);
- ``slowest_input_s``: the longest one mutated input took, seconds (a hang
  would show here, or never end);
- ``max_rss_growth_mib``: how much the process's peak resident memory grew
  during the target, MiB (every target's seeds are parsed once first, so
  that imports do not count).

It exits 1 if any input crashed a parser. ``tests/unit/test_fuzz.py`` runs the
same targets on a few thousand inputs each.

Usage::

    .venv/bin/python benchmarks/fuzz.py                      # 1,000,000 each
    .venv/bin/python benchmarks/fuzz.py --inputs 20000 --targets frame_header,task_record

This checks robustness, not speed: ``wall_s`` says only how long the run took.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys


def main(argv: list[str] | None = None) -> int:
    from elasticps.testing.fuzz import TARGETS, fuzz

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs per target")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the mutations")
    args = parser.parse_args(argv)
    names = [n for n in args.targets.split(",") if n]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; expected some of {sorted(TARGETS)}")
    for name in names:  # imports and first calls, before any memory is measured
        fuzz(TARGETS[name], len(TARGETS[name].seeds()))
    crashed = False
    for name in names:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = fuzz(TARGETS[name], args.inputs, seed=args.seed)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        line = {**result.as_dict(), "max_rss_growth_mib": round((after - before) / 1024, 1)}
        print(json.dumps({"seed": args.seed, **line}), flush=True)
        crashed |= result.crash_count > 0
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
