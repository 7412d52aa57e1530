#!/usr/bin/env python3
"""Cross-compile on the CPU build host what a benchmark run on the GPU will ask for, so that the GPU's minutes
go to measuring: every shape tools/baselines.py benchmarks, at the heuristic default and at the config
tkjit.get serves there (the shipped tuned DB), for one arch. Then ship the cache as a bundle:

    python benchmarks/h200/scripts/prebuild.py --arch sm_90a [--kernels a,b,...] [-j 2]
    python benchmarks/h200/scripts/prebuild.py --from-json gets.json    # what GPU tests ask for: record_gets.py
    tkjit bundle export --from-cache --arch sm_90a -o .gpu/prebuilt.tgz      # on the GPU: tkjit bundle import

Keys carry the nvcc and TileLang versions: the GPU host hits these entries only where its versions match
(`tkjit doctor` prints them); anything else it compiles as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))

from baselines import SHAPES  # noqa: E402

import tkjit  # noqa: E402
from tkjit.canon import canonical_json  # noqa: E402
from tkjit.pool import compile_many, unique_jobs  # noqa: E402
from tkjit.registry import all_specs  # noqa: E402
from tkjit.tuning_db import choose_config  # noqa: E402


def jobs_for(names: list[str], arch: str) -> list[tuple]:
    jobs = []
    for name in names:
        spec = tkjit.get_spec(name)
        for shape in SHAPES[name]:
            full = spec.canonical_shape(shape)
            for cfg, source in (choose_config(spec, full, arch, None),
                                (spec.default_config(full, arch), "default")):
                jobs.append((spec.name, spec.static_shape(full), cfg, arch, source))
    return unique_jobs(jobs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--kernels", default="", help="comma-separated (default: every kernel with benchmark shapes)")
    p.add_argument("--from-json", default=None, help="jobs recorded by record_gets.py (instead of the benchmark's)")
    p.add_argument("-j", "--jobs", type=int, default=None)
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            jobs = [tuple(job) for job in json.load(f)]
        known = {spec.name for spec in all_specs()}
        unknown = sorted({job[0] for job in jobs} - known)  # specs a test registers for itself
        if unknown:
            print(f"left out (not in the catalog): {', '.join(unknown)}")
        jobs = [job for job in jobs if job[0] in known]
    else:
        names = [k for k in args.kernels.split(",") if k] or sorted(SHAPES)
        jobs = jobs_for(names, args.arch)
    print(f"{len(jobs)} kernel(s) for {args.arch}", flush=True)
    failed = 0
    for job, (key, err) in zip(jobs, compile_many(jobs, args.jobs)):
        failed += err is not None
        print(f"{job[0]} {canonical_json(job[1])} {canonical_json(job[2])}: "
              f"{'FAILED ' + str(err).splitlines()[0][:200] if err else key[:12]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
