"""The report's audit section: the power of each sampled audit, and the `specdecode audit`
command that repeats it with enough samples to detect AUDIT_REAL_TV."""

from __future__ import annotations

import shlex
from typing import Any

from specdecode.bench.records import AuditVerdict, ConfigSpec, RunHeader
from specdecode.bench.workloads import Prompt, prompts_from_description
from specdecode.drafters.options import ALIASES as OPTION_ALIASES
from specdecode.drafters.options import FLAGS as OPTION_FLAGS
from specdecode.limits import AUDIT_REAL_TV
from specdecode.models import backends
from specdecode.report.analysis import Analysis
from specdecode.report.cells import DASH, num

# the drafter options `specdecode audit` has flags for (cli.args.add_drafter_args; spelled as
# drafters.options.FLAGS says); it cannot repeat the others
AUDIT_OPTIONS = ("draft_model", "heads", "distilled", "kmax", "max_step_cost")


def audit_command(header: RunHeader, spec: ConfigSpec, verdict: AuditVerdict,
                  prompt: Prompt | None) -> tuple[str, list[str]]:
    """The `specdecode audit` command that repeats a sampled audit of this run with
    `verdict.samples_needed` samples per side (the target, measurement flags, drafter, k,
    temperature and prompt the run used), and what it cannot repeat."""
    details = header.runner.get("details") or {}
    argv = ["specdecode", "audit"]
    if details.get("source"):
        argv += ["--model", str(details["source"])]
    target = backends.bench_target(spec.target) if spec.target else None
    if target is not None:  # a run of several targets: this configuration's own
        argv += ["--precision", target.precision, "--backend", target.backend.name]
    else:
        argv += ["--precision", header.model.precision]
        if details.get("backend"):
            argv += ["--backend", str(details["backend"])]
    argv += ["--threads", str(header.hardware.torch_threads), "--drafter", spec.drafter,
             "--k", str(spec.k)]
    caveats = []
    for key, value in spec.options.items():
        option = OPTION_ALIASES.get(key, key)
        if option in AUDIT_OPTIONS:
            argv += [OPTION_FLAGS[option], str(value)]
        else:
            caveats.append(f"the drafter option {key}={value} is not a flag of specdecode "
                           "audit: it audits the drafter's default")
    argv += ["--temperature", f"{verdict.temperature:g}"] if verdict.temperature else []
    if prompt is not None and prompt.turns:
        argv += ["--prompt", prompt.turns[0]]
        if verdict.turn:
            caveats.append(f"the run audited turn {verdict.turn + 1} of conversation "
                           f"{prompt.id}; the command audits its first turn")
        if prompt.constraint:
            caveats.append("the prompt has a structured-output constraint: add it with "
                           "--json-schema, --regex or --grammar")
    if details.get("chat") is False:
        caveats.append("the run sent raw turns (--no-chat-template); the audit applies the "
                       "model's chat template")
    argv += ["--samples", str(verdict.samples_needed)]
    if verdict.false_alarm is not None:
        argv += ["--false-alarm", f"{verdict.false_alarm:g}"]
    return shlex.join(argv), caveats


def audit_power(analysis: Analysis) -> list[dict[str, Any]]:
    """Per sampled audit that states its power (one per config and temperature: its verdict
    is reused at every batch size): the TV distance it detects, whether that makes it a smoke
    check (it detects only distances above AUDIT_REAL_TV), and the command of an audit that
    detects AUDIT_REAL_TV."""
    header = analysis.results.header
    prompts = {p.id: p for p in prompts_from_description(header.workload)}
    specs = {c.name: c for c in header.configs}
    out, seen = [], set()
    for v in analysis.audits:
        key = (v.config, v.temperature)
        if v.detectable_tv is None or v.samples_needed is None or v.config not in specs \
                or key in seen:
            continue
        seen.add(key)
        command, caveats = audit_command(header, specs[v.config], v, prompts.get(v.prompt_id))
        out.append({"config": v.config, "samples": v.n_compared,
                    "tv": num(v.detectable_tv), "smoke": v.detectable_tv > AUDIT_REAL_TV,
                    "false_alarm": DASH if v.false_alarm is None else f"{v.false_alarm:g}",
                    "temperature": DASH if v.temperature is None else f"{v.temperature:g}",
                    "prompt": v.prompt_id or DASH, "needed": v.samples_needed,
                    "command": command, "caveats": caveats})
    return out


