"""Resolve a `model` value (local path, HF id in the local cache, or an offline test model) to a directory.

Resolved once by the driver, so every process (trainer, servers, tokenizer) loads the same files.
``refractor-testing/<name>`` builds one of refractor's deterministic tiny checkpoints
(``tiny-qwen2``, ``tiny-llama``, ``tiny-qwen3``) on first use: no download, used by the CPU quick start.
"""

from __future__ import annotations

from pathlib import Path

from refractor.errors import RefractorUserError

TESTING_PREFIX = "refractor-testing/"


class ModelNotFoundError(RefractorUserError, FileNotFoundError):
    pass


def resolve_model_path(model: str) -> Path:
    if model.startswith(TESTING_PREFIX):
        from refractor import testing

        builders = {
            "tiny-qwen2": testing.tiny_qwen2,
            "tiny-llama": testing.tiny_llama,
            "tiny-qwen3": testing.tiny_qwen3,
            # random weights in Qwen2.5-0.5B's shape: a GPU run's real sizes without a download
            "qwen2.5-0.5b-shaped": testing.qwen25_shaped,
        }
        name = model[len(TESTING_PREFIX) :]
        if name not in builders:
            raise ModelNotFoundError(
                f"unknown test model `{model}`; available: {', '.join(TESTING_PREFIX + n for n in builders)}"
            )
        return builders[name]()
    local = Path(model).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {local} has no config.json")
        return local.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as err:  # not in the cache (and we never download at run time)
        raise ModelNotFoundError(
            f"model `{model}` is neither a local directory nor in the Hugging Face cache "
            f"({type(err).__name__}). Download it first (`hf download {model}`) "
            "or pass a local path."
        ) from None
