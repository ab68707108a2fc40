"""Model configuration for the native Llama-family runner, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError

# model_type -> does the attention projection carry q/k/v biases
NATIVE_FAMILIES = {"llama": False, "mistral": False, "qwen2": True}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    sliding_window: int | None = None
    rope_type: str = "default"
    rope_params: dict[str, float] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _require(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise SpecDecodeError(f"{source}: field '{key}' is missing")
    return raw[key]


def _rope(raw: dict[str, Any], source: str) -> tuple[float, str, dict[str, float]]:
    """rope_theta, rope type and its parameters, from transformers v4 or v5 config layouts."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise SpecDecodeError(
            f"{source}: rope type '{rope_type}' is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    return theta, rope_type, {k: float(v) for k, v in params.items() if isinstance(v, int | float)}


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config dict; unknown families raise with the name."""
    family = str(_require(raw, "model_type", source))
    if family not in NATIVE_FAMILIES:
        raise SpecDecodeError(
            f"{source}: architecture '{family}' has no native runner "
            f"(native: {', '.join(NATIVE_FAMILIES)}); other families run through the "
            "transformers adapter (--backend transformers)"
        )
    hidden = int(_require(raw, "hidden_size", source))
    heads = int(_require(raw, "num_attention_heads", source))
    theta, rope_type, rope_params = _rope(raw, source)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if raw.get("mlp_bias"):
        raise SpecDecodeError(f"{source}: mlp_bias = true is not supported by the native runner")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise SpecDecodeError(f"{source}: hidden_act '{act}' is not supported (only 'silu')")
    return ModelConfig(
        family=family,
        vocab_size=int(_require(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", source)),
        num_layers=int(_require(raw, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=NATIVE_FAMILIES[family] or bool(raw.get("attention_bias", False)),
        sliding_window=int(window) if window else None,
        rope_type=rope_type,
        rope_params=rope_params,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
    )


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecDecodeError(f"{path}: not found (a checkpoint folder needs config.json)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"{path}: unreadable config ({exc})") from exc
    if not isinstance(raw, dict):
        raise SpecDecodeError(f"{path}: expected a JSON object")
    return raw
