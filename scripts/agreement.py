"""Each native precision's agreement with fp32 on a model: teacher-forced top-1 agreement and mean
KL (specdecode.agreement), on the built-in text, in blocks of --chunk positions.

    python scripts/agreement.py [--model PATH] [--precisions bf16,w4a16] [--chunk 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from specdecode.agreement import precision_agreement
from specdecode.models.backends import NATIVE, load_model
from specdecode.models.precision import REFERENCE


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/agreement.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--precisions", default=None,
                   help="comma-separated (default: every native precision this machine runs)")
    p.add_argument("--chunk", type=int, default=8)
    args = p.parse_args(argv)
    loaded = load_model(args.model, REFERENCE.name, NATIVE.name)
    start = time.perf_counter()
    names = None if args.precisions is None else args.precisions.split(",")
    rows = precision_agreement(loaded.model, loaded.tokenizer, names, chunk=args.chunk)
    print(f"# agreement with fp32, {loaded.name}, teacher forced, {rows[0].positions} positions "
          f"in blocks of {args.chunk} ({time.perf_counter() - start:.0f} s)")
    print("precision  top-1 agreement  mean KL (nats)  max KL")
    for r in rows:
        print(f"{r.precision:9s}  {r.top1:15.4f}  {r.mean_kl:14.5f}  {r.max_kl:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
