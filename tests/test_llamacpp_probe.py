"""A llama.cpp binary that dies on this CPU becomes a clear error, never a dead interpreter
(models.llamacpp_probe), and the install script builds what runs here (scripts/
install_llamacpp.py).

The faulting binary is real: a shared library whose function executes `ud2` (the instruction
the CPU refuses with SIGILL, as an unconfigured AMX tile instruction does), called by a stand-in
binding at the step where ggml's AMX kernels would run (several positions, weights opened with
extra buffer types), or at every decode. The cause of the Xeon crash itself (GCC 12 deleting the
AMX tile configuration) is reproduced from the compiler's own output, which needs no AMX CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.models import llamacpp_probe
from specdecode.models.llamacpp_probe import probe, require_runs

REPO = Path(__file__).resolve().parent.parent
CC = shutil.which("cc") or shutil.which("gcc")
REQUIRED = os.environ.get("SPECDECODE_REQUIRE_LLAMACPP") == "1"

FAKE_BINDING = '''
"""A stand-in for llama_cpp: every call succeeds, except that decoding runs `ud2` where the
real binding's AMX path would run ({when})."""
import ctypes, os, time
_lib = ctypes.CDLL(os.path.join(os.path.dirname(__file__), "libtrap.so"))
_extra = {{"on": False}}
class _Params:
    use_extra_bufts = True
class _Batch:
    def __init__(self, n):
        self.token = [0] * n; self.pos = [0] * n; self.n_seq_id = [0] * n
        self.seq_id = [[0] for _ in range(n)]; self.logits = [0] * n; self.n_tokens = 0
def llama_log_callback(f): return f
def llama_log_set(cb, user): return None
def llama_backend_init(): return None
def llama_model_default_params(): return _Params()
def llama_context_default_params(): return _Params()
def llama_model_load_from_file(path, params):
    _extra["on"] = params.use_extra_bufts
    return 1
def llama_init_from_model(model, params): return 1
def llama_batch_init(n, embd, seqs): return _Batch(n)
def llama_decode(ctx, batch):
    if {condition}:
        _lib.trap()
    return 0
def llama_batch_free(batch): return None
def llama_free(ctx): return None
def llama_model_free(model): return None
'''


def _fake_binding(root: Path, name: str, condition: str, when: str) -> str:
    """Write package `name` under `root` (its libtrap.so built with the system compiler)."""
    if CC is None:
        pytest.skip("no C compiler to build the faulting library")
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "trap.c").write_text("void trap(void) { __builtin_trap(); }\n", encoding="utf-8")
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(pkg / "libtrap.so"), str(pkg / "trap.c")],
                   check=True)
    (pkg / "__init__.py").write_text(FAKE_BINDING.format(condition=condition, when=when),
                                     encoding="utf-8")
    return name


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    root = tmp_path / "site"
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))  # the probe's children import it too
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return {
        "amx": _fake_binding(root, "fake_amx", '_extra["on"] and batch.n_tokens > 1',
                             "several positions on extra buffer types"),
        "always": _fake_binding(root, "fake_always", "True", "every decode"),
        "fine": _fake_binding(root, "fake_fine", "False", "never"),
        "hang": _fake_binding(root, "fake_hang", 'time.sleep(60) or False', "never: it hangs"),
    }


def test_a_binary_that_faults_is_named_by_signal_and_step_not_a_dead_interpreter(
        fakes: dict[str, str]) -> None:
    result = probe(fakes["amx"])
    assert result.ok("backend")  # extra buffer types off: the faulting path is never taken
    failure = result.failures["default"]
    assert failure is not None and "SIGILL" in failure and "cannot run" in failure
    assert "decode probe-v1-F16.gguf 8" in failure  # the first multi-row step of the first model
    with pytest.raises(SpecDecodeError, match="does not run on this CPU") as err:
        require_runs("default", "peer llama-cpp-python", fakes["amx"])
    assert "install_llamacpp.sh --rebuild" in str(err.value)
    require_runs("backend", "target", fakes["amx"])  # no error

    always = probe(fakes["always"])
    assert not always.ok("backend") and not always.ok("default")
    assert "decode probe-v1-F16.gguf 1" in (always.failures["backend"] or "")
    assert probe(fakes["fine"]).ok("backend") and probe(fakes["fine"]).ok("default")


def test_the_answer_is_cached_per_binary_and_a_damaged_entry_is_probed_again(
        fakes: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    first = probe(fakes["amx"])
    calls: list[str] = []
    real = llamacpp_probe.run_child

    def counting(module: str, mode: str, models: list[Path]) -> str | None:
        calls.append(mode)
        return real(module, mode, models)

    monkeypatch.setattr(llamacpp_probe, "run_child", counting)
    assert probe(fakes["amx"]) == first and calls == []  # cached: no child ran
    entries = list((tmp_path / "cache" / "probes").glob("llamacpp-*.json"))
    assert len(entries) == 1
    entries[0].write_text("{not json", encoding="utf-8")
    assert probe(fakes["amx"]) == first and calls == ["backend", "default"]
    assert json.loads(entries[0].read_text(encoding="utf-8"))["failures"]["backend"] is None
    # another binary (a rebuild changes the library's bytes) is another key
    lib = tmp_path / "site" / fakes["amx"] / "libtrap.so"
    lib.write_bytes(lib.read_bytes() + b"\0")
    calls.clear()
    probe(fakes["amx"])
    assert calls == ["backend", "default"]


def test_a_hung_binary_is_reported_not_waited_on(fakes: dict[str, str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp_probe, "TIMEOUT_S", 8.0)
    failure = probe(fakes["hang"]).failures["backend"]
    assert failure is not None and failure.startswith("hung for 8 s in: decode")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None and not REQUIRED,
                    reason="needs llama-cpp-python (the backend loads through it)")
def test_the_backend_refuses_before_touching_a_faulting_binary(
        fakes: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from specdecode.models.config import ModelConfig
    from specdecode.models.llamacpp import LlamaCppModel

    monkeypatch.setattr(llamacpp_probe, "BINDING", fakes["always"])
    cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_layers=1, num_heads=4, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position=128, tie_embeddings=False)
    with pytest.raises(SpecDecodeError, match=r"missing\.gguf: the llama\.cpp binding .* "
                                              r"killed by SIGILL"):
        LlamaCppModel(tmp_path / "missing.gguf", cfg)


def test_the_real_binding_runs_here() -> None:
    """The installed build passes its own probe on this CPU (the install script's proof)."""
    if importlib.util.find_spec("llama_cpp") is None and not REQUIRED:
        pytest.skip("llama-cpp-python is not installed")
    result = probe()
    assert result.ok("backend") and result.ok("default"), result.failures


# --- the install script ----------------------------------------------------------------------

def _script() -> Any:
    spec = importlib.util.spec_from_file_location("install_llamacpp",
                                                  REPO / "scripts" / "install_llamacpp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["install_llamacpp"] = module
    spec.loader.exec_module(module)
    return module


def test_the_compiler_check_sees_gcc12_delete_the_amx_tile_configuration() -> None:
    """The Xeon crash's cause, shown without an AMX CPU: GCC 12's `_tile_loadconfig` declares
    an 8-byte operand, so the stores of the tile shapes before it are deleted (fewer
    instructions than with the full 64-byte operand); the control (the full operand both
    times) must not be reported."""
    m = _script()
    cc = m.compiler()
    if m._instructions_before_load(cc, True) is None:
        pytest.skip(f"{cc} cannot build AMX code")
    assert not m.tile_config_dropped(cc, full_operand_both=True)
    version = m.compiler_version(cc)
    if "(Debian 12." in version or " 12.2.0" in version:
        assert m.tile_config_dropped(cc)
        flags, why = m.flag_sets(cc, False)[0]
        assert any("-mno-amx-int8" in f for f in flags) and "SIGILL" in why


def test_the_wheel_cache_keys_on_the_cpu_and_refuses_half_written_wheels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _script()
    flags = list(m.FLAGS)
    key = m.wheel_key(flags, "", "c++")
    assert m.wheel_key(flags, "-DGGML_AVX512=OFF", "c++") != key
    monkeypatch.setattr(m, "cpu_flags", lambda: ["avx2", "fma"])
    assert m.wheel_key(flags, "", "c++") != key  # another CPU kind: another wheel
    folder = tmp_path / "w"
    folder.mkdir()
    assert m.whole_wheel(folder) is None
    wheel = folder / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llama_cpp/__init__.py", "x = 1\n" * 1000)
        z.writestr("llama_cpp/lib/libllama.so", b"\x7fELF" * 10000)
    assert m.whole_wheel(folder) == wheel
    wheel.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])  # an interrupted copy
    assert m.whole_wheel(folder) is None


def test_the_script_falls_back_to_amx_off_when_the_native_build_dies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _script()
    monkeypatch.setenv("SPECDECODE_WHEELS", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.setattr(m, "tile_config_dropped", lambda cc: False)
    built: list[str] = []

    def build(folder: Path, cmake_args: str) -> Path:
        built.append(cmake_args)
        return folder / "x.whl"

    monkeypatch.setattr(m, "build", build)
    monkeypatch.setattr(m, "install", lambda wheel: None)
    outcomes = iter([(False, "default: killed by SIGILL"), (True, "backend: runs")])
    monkeypatch.setattr(m, "prove", lambda: next(outcomes))
    assert m.main([]) == 0
    assert len(built) == 2 and "-mno-amx" not in built[0] and "-mno-amx-int8" in built[1]
    outcomes = iter([(False, "killed by SIGILL")] * 2)
    monkeypatch.setattr(m, "prove", lambda: next(outcomes))
    assert m.main(["--rebuild"]) == 1
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_AVX512=OFF")
    built.clear()
    monkeypatch.setattr(m, "prove", lambda: (True, "runs"))
    assert m.main(["--rebuild"]) == 0
    assert built[0].endswith(" -DGGML_AVX512=OFF")  # the user's CMAKE_ARGS come last: they win


def test_probe_module_runs_as_a_command() -> None:
    out = subprocess.run([sys.executable, "-m", "specdecode.models.llamacpp_probe", "--help"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "--refresh" in out.stdout
