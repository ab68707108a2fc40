"""The argument groups and checks the subcommands share. The draft-length range is
`limits.MAX_K`, written nowhere else; the drafter's flags become one `DrafterOptions`
(`drafter_options`), checked as the Python API and the bench configurations check theirs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from specdecode.bench.options import BenchOptions
from specdecode.drafters.options import DEFAULT_KMAX, DrafterOptions
from specdecode.errors import SpecDecodeError
from specdecode.limits import K_RANGE, RULES

MEASUREMENT_FLAGS = ("--precision", "--backend", "--threads")  # every model-running command


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model and the measurement flags --precision, --backend, --threads: the target every
    model-running command takes, and how it runs (the same on each, so a figure of one command
    can be reproduced with another: `generate` at the threads `bench` measured with)."""
    from specdecode.models import backends, precision

    p.add_argument("--model", default=None,
                   help="checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--precision", default=precision.AUTO,
                   help=f"{' | '.join(precision.choices())} (default auto: "
                        f"{precision.NATIVE_DEFAULT} where the row-invariant kernels build, else "
                        f"{precision.REFERENCE.name}; with --backend llama.cpp: the GGUF's own; "
                        "docs/cli.md#precisions)")
    p.add_argument("--backend", default=backends.AUTO,
                   help=f"{' | '.join(backends.choices())} (auto: native where the family has "
                        "one, else transformers; llama.cpp: the GGUF on llama.cpp, "
                        "docs/llamacpp.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, also llama.cpp's (default: torch's choice; stated in "
                        "bench reports)")


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's thread count from --threads (where the command has it and it is given),
    checked, before anything loads."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise SpecDecodeError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def add_measurement_args(p: argparse.ArgumentParser) -> None:
    """--no-chat-template: how `bench` and `tune` send their workload's turns."""
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the raw turns instead of the model's chat template")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--workload, --specbench, --categories, --strict (`bench`, `tune`)."""
    p.add_argument("--workload", default=None,
                   help="JSONL file, Spec-Bench or plain format, or a built-in workload: "
                        "default (the default), structured (JSON-schema prompts) or "
                        "repetitive (documents asked about again, spread over the run; from "
                        "--specbench when given) (a file of any of these names: ./NAME)")
    p.add_argument("--specbench", default=None, metavar="FILE",
                   help="--workload repetitive: build it from this Spec-Bench question.jsonl "
                        "(its summarization, rag and coding prompts) instead of the built-in "
                        "documents")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--strict", action="store_true",
                   help="refuse a workload with a malformed line instead of skipping it")


def add_run_args(p: argparse.ArgumentParser, out_help: str) -> None:
    """--out, --seed, --resamples, --quiet: a measured run's output (`bench`, `tune`)."""
    p.add_argument("--out", type=Path, default=None, help=out_help)
    p.add_argument("--seed", type=int, default=BenchOptions.seed)
    p.add_argument("--resamples", type=int, default=None, help="bootstrap resamples")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling parameters (`generate`, `audit`)."""
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: a random one, reported by --json): the same "
                        "seed gives the same tokens whatever the drafter, k or batch under "
                        "--rule invariant")
    add_rule_arg(p)


def add_rule_arg(p: argparse.ArgumentParser) -> None:
    """--rule: how sampled drafts are verified (`generate`, `audit`, `serve`)."""
    p.add_argument("--rule", choices=RULES, default=RULES[0],
                   help="how sampled drafts are verified: invariant (default; the output is "
                        "plain decoding's for the seed, whatever the drafting, batch or "
                        "traffic) or residual (the standard rejection rule: more drafts "
                        "accepted from a weak model drafter, tokens depend on what was "
                        "drafted). docs/design.md")


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """The drafter and its draft length (`generate`, `audit`, `serve`)."""
    p.add_argument("--drafter", default="none",
                   help="none | int8 | w4a16 | ngram | ngram-tree | suffix | layerskip | heads "
                        "(--heads) | distilled | draft-model | xtok (these two with "
                        "--draft-model) | ngram+X (prompt lookup where it expects to pay, else "
                        "drafter X: w4a16, int8, distilled, draft-model, layerskip, or auto: the "
                        "one measured at load to pay best on this target and machine, or none; "
                        "suffix+X: the suffix lookup's trees, else X). ngram-tree "
                        "and suffix draft token trees; suffix also from earlier requests; "
                        "X-tree (X: w4a16, int8, distilled, draft-model): X with its next "
                        "choice as a sibling where it is unsure (docs/drafters.md)")
    p.add_argument("--draft-model", default=None,
                   help="draft checkpoint (GGUF file or folder) for --drafter draft-model (same "
                        "tokenizer as the target) or xtok (any tokenizer: drafts through text)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft-model, int8, w4a16 and layerskip draft through the lowest N token "
                        "ids of the head only (a cheaper draft step; the target still verifies "
                        "over the whole vocabulary, so output is unchanged; default: every id)")
    p.add_argument("--distilled", default=None,
                   help="distilled draft folder for --drafter distilled (default: the shipped one)")
    p.add_argument("--heads", default=None,
                   help="trained heads folder for --drafter heads (default: the shipped ones)")
    p.add_argument("--k", default="auto",
                   help=f"draft length {K_RANGE}, or auto (default): the controller picks "
                        "0..--kmax per step from measured acceptance and costs")
    p.add_argument("--kmax", type=int, default=DEFAULT_KMAX,
                   help="largest draft length for --k auto")
    p.add_argument("--max-step-cost", type=float, default=None,
                   help="under --k auto, no step may cost more than this many plain steps of "
                        "the same batch (bounds the inter-token latency tail; inf: no cap; "
                        "default: no cap, serve: 1.5)")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output (docs/structured-output.md): at most one of these."""
    g = p.add_argument_group("structured output (llguidance; at most one)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to this JSON schema (a .json file)")
    g.add_argument("--regex", default=None, metavar="R",
                   help="constrain the output to match this regular expression")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="constrain the output to this Lark or GBNF grammar (a file)")


def constraint_spec(args: argparse.Namespace) -> Any:
    """The constraint the flags of add_constraint_args ask for (constraints.ConstraintSpec,
    checked: a bad schema is one error naming its file, before any model loads), or None."""
    from specdecode.constraints import spec_from_args

    return spec_from_args(args.json_schema, args.regex, args.grammar)


def bench_options(args: argparse.Namespace, **own: Any) -> BenchOptions:
    """The BenchOptions of the flags `bench` and `tune` share (add_model_args,
    add_measurement_args, add_workload_args, add_run_args, --max-tokens), with the command's
    own in `own`: the one place the command line's flags become bench options."""
    from specdecode.bench.plan import parse_categories

    categories = parse_categories(args.categories)
    return BenchOptions(
        model=args.model, precision=args.precision, backend=args.backend, threads=args.threads,
        chat_template=not args.no_chat_template, workload=args.workload,
        specbench=args.specbench, categories=None if categories is None else tuple(categories),
        strict=args.strict, max_tokens=args.max_tokens, out=args.out, seed=args.seed,
        resamples=args.resamples, progress=not args.quiet, **own)


def bind_constraint(spec: Any, loaded: Any, eos: tuple[int, ...]) -> Any:
    """The checked constraint bound to the loaded model's tokenizer (None: none asked)."""
    from specdecode.constraints import compile_constraint

    return None if spec is None else compile_constraint(spec, loaded.tokenizer,
                                                        loaded.model.cfg.vocab_size, eos)


def sampling_params(args: argparse.Namespace) -> Any:
    """SamplingParams from the sampling arguments, checked."""
    from specdecode.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=tuple(args.stop), rule=args.rule,
    )
    params.validate()
    return params


def drafter_options(args: argparse.Namespace) -> DrafterOptions:
    """The DrafterOptions of add_drafter_args's flags (and serve's --suffix-* flags, where the
    command has them), checked: an option the drafter does not read is an error naming it."""
    k: int | Literal["auto"] = "auto"
    if args.k != "auto":
        try:
            k = int(args.k)
        except ValueError:
            raise SpecDecodeError(f"--k must be an integer in {K_RANGE} or auto, got "
                                  f"{args.k}") from None
    serve = vars(args)  # the --suffix-* flags exist on `serve` only
    options = DrafterOptions(
        name=args.drafter, k=k, kmax=args.kmax,
        max_step_cost=args.max_step_cost, draft_model=args.draft_model,
        draft_vocab=args.draft_vocab, heads=args.heads,
        distilled=args.distilled, suffix_mib=serve.get("suffix_mib"),
        suffix_requests=serve.get("suffix_requests"),
        suffix_isolation=serve.get("suffix_isolation"))
    return options.check()
