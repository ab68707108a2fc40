"""`DrafterOptions`: what every front end (the CLI's generate, audit, serve, bench and tune, the
server, the Python API, a bench configuration string) says about the drafter, in one frozen value
that `drafters.registry.drafter_factory` alone reads.

It also declares the drafter names and which options each one reads, so that an option given to
a drafter that does not read it is an error naming the option (`ngram:heads=x`,
`--drafter ngram --heads DIR`) instead of being dropped. An option left at None takes the
drafter's default. Imports nothing above the errors and limits modules, so that the command line
and the API can check their input with it before anything loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from specdecode.errors import SpecDecodeError
from specdecode.limits import (
    DEFAULT_KMAX,
    K_RANGE,
    MAX_TREE_NODES,
    SUFFIX_ISOLATION,
    SUFFIX_STORE_MIN_MIB,
    valid_k,
)

# Names. A hybrid is a lookup, "+", a model drafter (drafters.hybrid); "X-tree" is model drafter
# X proposing sibling leaves where it is unsure (token trees).
PREFIX = "ngram+"  # a hybrid's name: its lookup (this, or SUFFIX_PREFIX), then its model's
SUFFIX_PREFIX = "suffix+"  # the lookup is drafters.suffix (token trees, earlier requests too)
TREE_SUFFIX = "-tree"
# Drafters spelled like precisions: "int8" and "w4a16" are DRAFTERS, the target's copy at that
# precision drafting in the target's cache (drafters.draft_model.quantized_copy; a w4a16 copy
# drafts for a target of any precision), not the precisions of models.precision. Code compares
# these drafter names through the constants, never as precision names; QUANTIZED_COPIES gives
# each one's precision.
INT8_COPY = "int8"
W4A16_COPY = "w4a16"
QUANTIZED_COPIES = {INT8_COPY: "int8", W4A16_COPY: "w4a16"}  # drafter -> its copy's precision
TREE_MODELS = (W4A16_COPY, INT8_COPY, "distilled", "draft-model")
# "auto": the model part chosen at load by measured cost and acceptance (drafters.auto)
AUTO = "auto"
HYBRID_MODELS = (W4A16_COPY, INT8_COPY, "distilled", "draft-model", "layerskip", AUTO)

_LOOKUP = ("ngram_max", "ngram_min")
# The options each single drafter reads (k, kmax and max_step_cost are the engine's: every
# drafter takes them), and the ones it cannot run without.
USES: dict[str, tuple[str, ...]] = {
    "none": (),
    "draft-model": ("draft_model", "draft_vocab"),
    INT8_COPY: ("draft_vocab",),
    W4A16_COPY: ("draft_vocab",),
    "ngram": _LOOKUP,
    "layerskip": ("layers", "draft_vocab"),
    "heads": ("heads",),
    "distilled": ("distilled",),
    "xtok": ("draft_model",),
    "suffix": (*_LOOKUP, "tree_nodes", "suffix_mib", "suffix_requests", "suffix_isolation"),
    "ngram-tree": (*_LOOKUP, "tree_nodes"),
}
REQUIRES: dict[str, tuple[str, ...]] = {"draft-model": ("draft_model",),
                                        "xtok": ("draft_model",)}
DRAFTERS = (*USES, *(m + TREE_SUFFIX for m in TREE_MODELS),
            *(prefix + m for prefix in (PREFIX, SUFFIX_PREFIX) for m in HYBRID_MODELS))

# How the command line spells an option (errors name both, so that either reader finds it).
FLAGS = {"name": "--drafter", "k": "--k", "kmax": "--kmax", "max_step_cost": "--max-step-cost",
         "draft_model": "--draft-model", "draft_vocab": "--draft-vocab", "heads": "--heads",
         "distilled": "--distilled",
         "suffix_mib": "--suffix-mib", "suffix_requests": "--suffix-requests",
         "suffix_isolation": "--suffix-isolation"}
ALIASES = {"model": "draft_model"}  # a bench configuration's `model=PATH`
ENGINE_OPTIONS = ("k", "kmax", "max_step_cost")


def model_part(name: str) -> str | None:
    """The model drafter of a hybrid's name ("ngram+w4a16" -> "w4a16"); None for another name."""
    for prefix in (PREFIX, SUFFIX_PREFIX):
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return None


def lookup_part(name: str) -> str:
    """The lookup drafter of a hybrid's name ("suffix+w4a16" -> "suffix")."""
    return "suffix" if name.startswith(SUFFIX_PREFIX) else "ngram"


def tree_base(name: str) -> str | None:
    """The model drafter of an "X-tree" name ("w4a16-tree" -> "w4a16"); None for another."""
    base = name.removesuffix(TREE_SUFFIX)
    return base if base != name and base in TREE_MODELS else None


def parts(name: str) -> tuple[str, ...]:
    """The single drafters a name is made of (a hybrid: its lookup and its model drafter)."""
    model = model_part(name)
    if model is not None:
        return (lookup_part(name), model)
    base = tree_base(name)
    return (base,) if base is not None else (name,)


def reads(name: str) -> tuple[str, ...]:
    """The drafter options `name` reads (besides k, kmax and max_step_cost)."""
    return tuple(dict.fromkeys(o for part in parts(name) for o in USES.get(part, ())))


def needs(name: str) -> tuple[str, ...]:
    """The drafter options `name` cannot run without."""
    return tuple(dict.fromkeys(o for part in parts(name) for o in REQUIRES.get(part, ())))


def label(option: str) -> str:
    """An option as errors name it: `heads (--heads)`, `ngram_max`."""
    flag = FLAGS.get(option)
    return option if flag is None else f"{option} ({flag})"


@dataclass(frozen=True)
class DrafterOptions:
    """The drafter, its draft length and its options; None: the drafter's default.

    k: the draft length 1..MAX_K, or "auto" (the controller picks 0..kmax each step, steps no
    wider than max_step_cost plain steps of the batch when that is set). draft_model: a draft
    checkpoint (draft-model, xtok). heads, distilled: their weights' folders (default: the
    shipped ones). layers: the blocks layerskip runs (default: calibrated). draft_vocab: the
    quantized copies, layerskip and a native draft-model draft through the lowest draft_vocab
    token ids of the head (drafters.draft_head; default: the whole head). ngram_max,
    ngram_min: the match lengths of the lookups. tree_nodes: a lookup tree's node budget.
    suffix_mib, suffix_requests: the caps of the suffix drafter's store of earlier requests;
    suffix_isolation: whose earlier text a server request drafts from ("user" or "shared").
    """

    name: str = "none"
    k: int | Literal["auto"] = "auto"
    kmax: int = DEFAULT_KMAX
    max_step_cost: float | None = None
    draft_model: str | None = None
    heads: str | None = None
    distilled: str | None = None
    layers: tuple[int, ...] | None = None
    draft_vocab: int | None = None
    ngram_max: int | None = None
    ngram_min: int | None = None
    tree_nodes: int | None = None
    suffix_mib: float | None = None
    suffix_requests: int | None = None
    suffix_isolation: str | None = None

    @property
    def auto(self) -> bool:
        """The controller chooses the draft length (k = "auto")."""
        return self.k == "auto"

    @property
    def draft_length(self) -> int:
        """The longest draft a step may have: k, or kmax under "auto"; 0 without a drafter."""
        if self.name == "none":
            return 0
        return self.kmax if self.k == "auto" else int(self.k)

    @property
    def speculates(self) -> bool:
        return self.name != "none"

    def given(self) -> dict[str, Any]:
        """The drafter options set (not None), engine options left out."""
        return {option: value for option, value in dataclasses.asdict(self).items()
                if option not in ("name", *ENGINE_OPTIONS) and value is not None}

    def check(self) -> DrafterOptions:
        """Raise SpecDecodeError naming the first bad option: an unknown drafter, a value out
        of range, an option this drafter does not read, or one it needs and lacks. Returns
        self."""
        if self.name not in DRAFTERS:
            raise SpecDecodeError(f"unknown drafter {self.name!r} (known: "
                                  f"{', '.join(DRAFTERS)})")
        _check_k(self.k, self.kmax)
        cost = self.max_step_cost
        if cost is not None and not (isinstance(cost, int | float) and cost >= 1.0):
            raise SpecDecodeError(f"{label('max_step_cost')} must be a number >= 1 (plain "
                                  f"steps), got {cost}")  # (nan fails this too; inf: no cap)
        for option, value in self.given().items():
            _check_value(option, value)
        used = reads(self.name)
        for option in self.given():
            if option not in used:
                takes = ", ".join(used) if used else "no drafter options"
                raise SpecDecodeError(f"the {self.name} drafter does not use {label(option)} "
                                      f"(it takes {takes})")
        given = self.given()
        for option in needs(self.name):
            if option not in given:
                flag = FLAGS.get(option, option)
                raise SpecDecodeError(f"--drafter {self.name} needs {flag} PATH ({option})")
        return self

    @classmethod
    def from_mapping(cls, name: str, options: Mapping[str, Any],
                     k: int | Literal["auto"] = "auto") -> DrafterOptions:
        """Options given as a mapping (a bench configuration's key=value pairs: `model` stands
        for draft_model, a list for layers), checked; an unknown key is an error naming it."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"name", "k"}
        values: dict[str, Any] = {}
        for key, value in options.items():
            option = ALIASES.get(key, key)
            if option not in fields:
                raise SpecDecodeError(f"drafter {name!r} takes no option {key!r} (options: "
                                      f"{', '.join(sorted(fields | set(ALIASES)))})")
            values[option] = _coerce(option, value)
        return cls(name, k, **values).check()


def _check_k(k: object, kmax: object) -> None:
    if k != "auto" and not valid_k(k):
        raise SpecDecodeError(f"{label('k')} must be an integer in {K_RANGE} or auto, got {k!r}")
    if not valid_k(kmax):
        raise SpecDecodeError(f"{label('kmax')} must be an integer in {K_RANGE}, got {kmax!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_value(option: str, value: Any) -> None:
    """Raise SpecDecodeError naming `option` when its value is out of range."""
    bad = ""
    if option in ("draft_model", "heads", "distilled"):
        bad = "" if isinstance(value, str) and value else "a path"
    elif option in ("ngram_max", "ngram_min"):  # their order: the drafter checks it
        bad = "" if _is_int(value) else "an integer"
    elif option in ("suffix_requests", "draft_vocab"):  # draft_vocab's top: drafters.draft_head
        bad = "" if _is_int(value) and value >= 1 else "an integer >= 1"
    elif option == "tree_nodes":
        bad = "" if _is_int(value) and 1 <= value <= MAX_TREE_NODES else \
            f"an integer in 1..{MAX_TREE_NODES}"
    elif option == "layers":  # which blocks exist: layerskip checks them
        bad = "" if isinstance(value, tuple) and all(_is_int(v) for v in value) else \
            "a list of block indices"
    elif option == "suffix_mib":
        bad = "" if isinstance(value, int | float) and not isinstance(value, bool) and \
            math.isfinite(value) and value >= SUFFIX_STORE_MIN_MIB else \
            f"a number of MiB >= {SUFFIX_STORE_MIN_MIB:g} (16 KiB: the smallest suffix store)"
    elif option == "suffix_isolation":
        bad = "" if value in SUFFIX_ISOLATION else f"one of {', '.join(SUFFIX_ISOLATION)}"
    if bad:
        raise SpecDecodeError(f"{label(option)} must be {bad}, got {value!r}")


def _coerce(option: str, value: Any) -> Any:
    """A mapping's value in the field's type where it reads as one (a path written as a number
    stays text; one layer is a list of one)."""
    if option in ("draft_model", "heads", "distilled", "suffix_isolation"):
        return str(value)
    if option == "layers":
        return tuple(value) if isinstance(value, list | tuple) else (value,)
    if option == "suffix_mib" and _is_int(value):
        return float(value)
    return value
