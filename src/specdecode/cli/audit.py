"""`specdecode audit`: the losslessness audit of a configuration (exit status 1 on FAIL)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from specdecode.cli.args import (
    add_constraint_args,
    add_drafter_args,
    add_model_args,
    add_sampling_args,
    bind_constraint,
    constraint_spec,
    drafter_options,
    sampling_params,
)
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.drafters.options import DrafterOptions

AUDIT_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)
FAULTS = ["q-without-temperature", "top-p-one-side", "sampler-one-side", "q-from-other-model"]


def register(sub: Any) -> None:
    """Add `audit` to the CLI's subparsers."""
    a = sub.add_parser("audit", help="losslessness audit of a configuration (exit 1 on FAIL)")
    a.add_argument("--prompt", default=None, help="prompt (default: a few built-in ones)")
    a.add_argument("--samples", type=int, default=300,
                   help="sampled mode: generations per side (default 300)")
    a.add_argument("--tokens", type=int, default=2, help="sampled mode: tokens per outcome")
    a.add_argument("--false-alarm", type=float, default=1e-3,
                   help="p-value below which the audit fails (its false-alarm rate)")
    a.add_argument("--inject-fault", default=None, choices=FAULTS,
                   help="deliberately break the drafter to see the audit catch it")
    a.add_argument("--json", action="store_true")
    add_model_args(a)
    add_sampling_args(a)
    add_drafter_args(a)
    add_constraint_args(a)
    a.set_defaults(func=cmd_audit, max_tokens=32)


def _audit_drafter(args: argparse.Namespace, options: DrafterOptions, loaded: Any) -> Any:
    """The per-request drafter maker the audit runs, with --inject-fault applied if asked."""
    from specdecode.drafters.faults import FaultyDrafter
    from specdecode.drafters.registry import drafter_factory

    factory = drafter_factory(options, loaded.model, tokenizer=loaded.tokenizer)
    if factory is None:
        raise SpecDecodeError("the audit needs a drafter (--drafter int8, ngram, ...)")
    if args.inject_fault is None:
        return factory
    draft_model = getattr(factory(), "model", None)
    if draft_model is None or not hasattr(draft_model, "cfg") or args.drafter == "layerskip":
        raise SpecDecodeError(f"--inject-fault needs a model-based drafter, not {args.drafter}")
    other = loaded.model if args.inject_fault == "q-from-other-model" else None
    return lambda: FaultyDrafter(draft_model, args.inject_fault, other)


def cmd_audit(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdecode.audit import audit_greedy, audit_sampled
    from specdecode.models.loading import load_model

    params = sampling_params(args)
    options = drafter_options(args)
    k = options.draft_length  # the audit verifies fixed drafts of this length
    if args.inject_fault is not None and params.rule != "residual" and not params.greedy:
        # the faults corrupt the q a drafter reports, which only the residual rule reads: under
        # the invariant rule they cannot change the output (the audit would rightly pass)
        print("# --inject-fault: the faults corrupt q, which only --rule residual reads: "
              "auditing with --rule residual", file=sys.stderr)
        params = dataclasses.replace(params, rule="residual")
    if args.samples < 10:
        raise SpecDecodeError(f"--samples must be >= 10, got {args.samples}")
    spec = constraint_spec(args)
    loaded = load_model(args.model, args.precision, args.backend)
    tok = loaded.tokenizer
    make = _audit_drafter(args, options, loaded)
    eos = tuple(sorted(set(tok.eos_ids) | set(loaded.model.cfg.eos_token_ids)))
    constraint = bind_constraint(spec, loaded, eos)
    texts = [args.prompt] if args.prompt else list(AUDIT_PROMPTS)
    prompts = [tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": t}])
                          if tok.chat_template else t) for t in texts]
    print(f"# audit: {loaded.name} ({loaded.backend}, {loaded.precision}), drafter "
          f"{args.drafter}{' with fault ' + args.inject_fault if args.inject_fault else ''}, "
          f"k={k}, temperature {params.temperature}"
          f"{'' if params.greedy else ', rule ' + params.rule}"
          f"{', constraint ' + spec.origin if spec else ''}", file=sys.stderr)
    if params.greedy:
        result = audit_greedy(loaded.model, prompts, params, make, k, eos, constraint)
    else:
        bar = tqdm(total=args.samples, desc="audit samples", file=sys.stderr)
        result = audit_sampled(loaded.model, prompts[0], params, make, k, args.samples,
                               args.tokens, args.false_alarm, seed=args.seed or 0, eos=eos,
                               progress=lambda n: bar.update(n - bar.n), constraint=constraint)
        bar.close()
    print(json.dumps(result.to_dict()) if args.json else result.render())
    return 0 if result.passed else 1
