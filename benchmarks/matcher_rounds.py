"""The device matcher's loop rounds on one chip's problems of a recipe, by cost family and target count.

A training step solves ``images x (decoder layers + 1) x group_detr`` problems per chip at once (``v5e.yaml``: 16 x 3 x
13 = 624, 300 queries, up to 100 targets); its search loop runs as many rounds as the hardest of them needs, and each
round is a chain of small ops the chip waits for (``aot`` gives each loop's bytes per round). Runs the solver's own
code in eager CPU torch (the XLA program runs the same bodies; ``tests/test_shards.py`` checks the step records the
same count) on rfdetr-like costs (``spmd_rfdetr.model.matching_problems``): ``trained`` (every target has a few
close predictions, as when fine-tuning from COCO weights), ``random``, ``untrained`` (all queries predict nearly the
same box: the first steps from scratch).

    python benchmarks/matcher_rounds.py --json benchmarks/results/matcher-rounds-v5e-2026-12-04.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spmd_rfdetr.model.matching import solve_assignment_with_stats
from spmd_rfdetr.model.matching_problems import detr_costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16, help="images per chip")
    parser.add_argument("--problems-per-image", type=int, default=39, help="(decoder layers + 1) x group_detr")
    parser.add_argument("--queries", type=int, default=300, help="queries per group")
    parser.add_argument("--max-targets", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {"images": args.images, "problems_per_image": args.problems_per_image, "queries": args.queries,
           "max_targets": args.max_targets, "families": {}}
    for mode in ("trained", "random", "untrained"):
        for low, high in ((1, 10), (10, 30), (30, args.max_targets), (args.max_targets, args.max_targets)):
            g = torch.Generator().manual_seed(0)
            cost, _ = detr_costs(args.images * args.problems_per_image, args.queries, args.max_targets, g, mode=mode)
            # an image's targets are the same in all of its problems, as in the step
            counts = torch.randint(low, high + 1, (args.images,), generator=g).repeat_interleave(args.problems_per_image)
            valid = torch.arange(args.max_targets)[None, :] < counts[:, None]
            start = time.perf_counter()
            result = solve_assignment_with_stats(cost, valid)
            row = {"search_rounds": int(result.iterations), "rounds_median": float(result.rounds.float().median()),
                   "unconverged": int((~result.converged).sum()), "eager_s": round(time.perf_counter() - start, 1)}
            out["families"][f"{mode} T={low}..{high}"] = row
            print(f"{mode:9s} targets {low}..{high}: {row}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
