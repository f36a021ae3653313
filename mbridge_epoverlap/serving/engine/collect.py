"""Merge the serving workers' reports of a cluster job into the `serve-bench` result.

`python -m mbridge_epoverlap.serving.engine.collect --plan PLAN.json --out DIR --results RESULT.json` runs after
srun has finished the workers (each wrote `DIR/rank<R>.json`); it adds the reference check and the
machine, as `serve-bench` does locally.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.serving.engine.collect", description=__doc__)
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--results", required=True, type=Path)
    args = parser.parse_args(argv)

    from mbridge_epoverlap.machine import machine
    from mbridge_epoverlap.serving.engine.bench import matches_reference
    from mbridge_epoverlap.serving.engine.plan import EnginePlan
    from mbridge_epoverlap.serving.engine.run import _collect, merge
    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from mbridge_epoverlap.serving.workers.requests import Request

    plan = EnginePlan.from_json(args.plan.read_text())
    ranks = _collect(args.out)["ranks"]
    complete = len(ranks) == plan.world and not any("error" in r for r in ranks)
    result = merge(plan, ranks, failed=not complete)
    spec = load_spec(plan.source, seed=plan.seed, num_layers=plan.num_layers, dtype=plan.dtype)
    requests = [Request(str(r["id"]), tuple(r["prompt_ids"])) for dealt in plan.requests for r in dealt]
    by_id = {r.id: r for r in requests}
    ordered = [by_id[c["id"]] for c in result["completions"]]
    result["matches_reference"] = complete and matches_reference(spec, ordered, result["completions"],
                                                                  plan.max_new_tokens)
    result["machine"] = machine()
    result["model"] = spec.describe()
    tmp = args.results.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.results)
    print(f"tokens/s {result['tokens_per_s']:.1f}, matches reference {result['matches_reference']}, "
          f"results {args.results}")
    return EXIT_OK if complete else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
