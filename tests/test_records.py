"""A precision and a backend are each one record: a toy precision and a toy backend, added here by
their records alone (models.precision.PRECISIONS, models.backends.BACKENDS), are taken by
--precision / --backend and their help, loaded and run, refused or allowed to speculate by what
their records say, measured as `bench --targets` targets and named in the report's audit
command, with no other line of the package changed. The records' own facts (kernel paths, CPU
requirements, bytes per parameter, fidelity) are checked against the real precisions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import specdecode
from specdecode.bench.records import AuditVerdict, ConfigSpec
from specdecode.bench.targets import parse_targets, precision_of, skip_reason
from specdecode.errors import SpecDecodeError
from specdecode.models import backends, precision
from specdecode.models.backends import LoadRequest, load_model
from specdecode.models.loading import LoadedModel
from tests.conftest import make_checkpoint

STEP = 1 / 64  # the toy precision rounds every weight to a multiple of this


class RoundedLinear(nn.Module):
    """The toy precision's matrix: W rounded to multiples of STEP, fp32 products (PyTorch's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> None:
        super().__init__()
        self.register_buffer("weight", torch.round(weight.detach().float() / STEP) * STEP)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def exact_panels(self) -> None:  # no row-invariant layout: the model runs it op by op
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def rounded_ends(head: torch.Tensor, embed: torch.Tensor, tied: bool, exact: bool
                 ) -> tuple[nn.Module, nn.Module]:
    return RoundedLinear(head, None, exact), nn.Embedding.from_pretrained(embed)


TOY_PATH = precision.KernelPath("PyTorch, rounded weights", False)
TOY = precision.Precision(
    "toy64", "weights rounded to multiples of 1/64", (precision.F32,), (TOY_PATH,),
    "PyTorch's kernels pick their path by shape: not row-invariant", "rounded",
    precision.NATIVE, RoundedLinear, rounded_ends)


def load_on_toy(request: LoadRequest) -> LoadedModel:
    """The toy backend: the native runner's fp32 model, reporting itself as backend "toy"."""
    runs = TOY_BACKEND.precision(request.precision)  # refuses what the record does not take
    loaded = backends.load_on_native(dataclasses.replace(request, precision=runs))
    loaded.model.backend = "toy"  # type: ignore[misc]
    return loaded


TOY_BACKEND = backends.Backend(
    "toy", "a backend made by a test", load_on_toy, lambda: ("fp32",), lambda: "fp32",
    "none", runs_as="fp32", bench_target="toy-target", bench_aliases=("toy",))


@pytest.fixture()
def toys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "PRECISIONS", (*precision.PRECISIONS, TOY))
    monkeypatch.setattr(backends, "BACKENDS", (*backends.BACKENDS, TOY_BACKEND))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("records") / "m")


def help_of(command: str) -> str:
    from specdecode.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._actions[1])))
    return sub.choices[command].format_help()  # type: ignore[no-any-return]


def test_the_toy_records_are_taken_and_listed(toys: None) -> None:
    assert "toy64" in precision.choices()
    assert "toy" in backends.choices()
    text = " ".join(help_of("generate").split())
    assert "toy64" in text and "toy" in text.split("--backend", 1)[1]
    assert parse_targets("fp32,toy64,TOY") == ["fp32", "toy64", "toy-target"]
    assert precision_of("toy64") == "toy64" and precision_of("toy-target") == "fp32"


def test_without_the_records_nothing_knows_them() -> None:
    """The control: the same names, with the records not added, are unknown everywhere."""
    with pytest.raises(SpecDecodeError, match="unknown precision 'toy64'"):
        precision.check_choice("toy64")
    with pytest.raises(SpecDecodeError, match="unknown backend 'toy'"):
        backends.get("toy")
    with pytest.raises(SpecDecodeError, match="unknown target"):
        parse_targets("toy64")


def test_a_toy_precision_loads_runs_and_is_refused_speculation(toys: None, folder: Path
                                                                ) -> None:
    sd = specdecode.load(folder, precision="toy64")
    assert sd.loaded.precision == "toy64"
    qkv = sd.loaded.model.layers[0].qkv
    assert isinstance(qkv, RoundedLinear)
    assert torch.equal(qkv.weight, torch.round(qkv.weight / STEP) * STEP)
    out = sd.generate("t1 t2", max_tokens=4)
    assert len(out.tokens) == 4
    # its record says no kernel path of it is row-invariant: refused before anything loads
    assert precision.coupling("toy64") == TOY.invariance
    with pytest.raises(SpecDecodeError, match="not row-invariant"):
        specdecode.load(folder, precision="toy64", drafter="ngram")
    assert "not row-invariant" in str(skip_reason("toy64", ConfigSpec("ngram-k4", "ngram", 4)))


def test_a_toy_backend_loads_and_is_named_in_the_report(toys: None, folder: Path) -> None:
    from specdecode.bench.records import RunHeader
    from specdecode.report.audit import audit_command

    loaded = load_model(str(folder), backend="toy")
    assert loaded.backend == "toy" and loaded.precision == "fp32"
    with pytest.raises(SpecDecodeError, match="does not apply to the toy backend"):
        load_model(str(folder), "bf16", backend="toy")
    header = RunHeader.__new__(RunHeader)  # only what audit_command reads
    object.__setattr__(header, "runner", {"details": {}})
    object.__setattr__(header, "hardware", type("H", (), {"torch_threads": 2})())
    spec = ConfigSpec("toy-target/ngram-k4", "ngram", 4, precision="fp32", target="toy-target")
    verdict = AuditVerdict.__new__(AuditVerdict)
    argv, _ = audit_command(header, spec, verdict, None)
    assert "--precision fp32 --backend toy " in argv + " "


def test_the_records_state_their_facts() -> None:
    """What the coming K-quant and AVX-512 precisions will be built on: each native record
    names its weight kinds with bytes per parameter, the kernel paths that run it (the
    row-invariant kernels first where it has them), what they need (a missing requirement is
    named), and its fidelity; int8 alone has no row-invariant path."""
    native = precision.of_backend(precision.NATIVE)
    names = [p.name for p in native]
    assert names[:2] == ["fp32", "checkpoint"] and {"bf16", "int8", "w8a16", "w4a16"} <= set(names)
    assert [p.name for p in native if not p.row_invariant] == ["int8"]
    assert {n: precision.get(n).fidelity for n in ("fp32", "checkpoint", "bf16", "int8",
                                                     "w4a16")} == {
        "fp32": "reference", "checkpoint": "checkpoint", "bf16": "rounded",
        "int8": "quantized", "w4a16": "rounded"}
    assert precision.get("w4a16").bytes_per_weight == (0.625, 2.0)
    assert precision.get("fp32").bytes_per_weight == (4.0, 4.0)
    for p in native:
        assert p.weights and all(w.bytes_per_weight > 0 for w in p.weights), p.name
        if p.row_invariant:
            assert p.paths[0] is precision.ROW_INVARIANT, p.name
    needy = precision.KernelPath("a VNNI path", True, cpu_flags=("no_such_cpu_flag",))
    assert needy.missing() == "it needs CPU features no_such_cpu_flag"
    assert precision.KernelPath("plain", True).missing() is None
