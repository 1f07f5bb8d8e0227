"""One stage of the check in this process: `python -m hilore_verl.gpucheck.stage NAME --device D --out DIR [--tiny]`.

A stage is a function `(report: StageReport, ctx: Context) -> None` (gpucheck/context.py) that records
checks and figures in DIR/stage_NAME.json. An exception is recorded as a failed check and the process
exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from hilore_verl.gpucheck import environment, model, profile_stage, shared, stages
from hilore_verl.gpucheck.context import Context, StageReport


def _stages():
    return {"environment": environment.environment, "codecs": stages.codecs, "runtime": stages.runtime,
            "shared_prompt": shared.shared_prompt_stage, "model": model.model_stage,
            "profile": profile_stage.profile_stage}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hilore_verl.gpucheck.stage")
    parser.add_argument("name")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    report = StageReport(os.path.join(args.out, f"stage_{args.name}.json"))
    report.write()
    try:
        _stages()[args.name](report, Context(args.device, args.tiny, args.out))
    except BaseException as err:  # recorded, then the process fails
        report.check("stage ran to the end", False, f"{type(err).__name__}: {err}".splitlines()[0][:300])
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
