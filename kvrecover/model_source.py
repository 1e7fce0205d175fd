"""Find the checkpoint folder for a `model` argument."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str | Path | None) -> Path:
    """A local checkpoint folder for `model`.

    `None` is the built-in default model; an existing folder is used as is; any
    other string is tried as a Hugging Face hub id in the local cache only
    (offline: nothing is downloaded).
    """
    if model is None:
        from kvrecover.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    if path.exists():
        raise ValueError(f"model must be a checkpoint folder, got the file {path}")
    if str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(model), local_files_only=True))
        except Exception:
            pass
    raise ValueError(
        f"model {str(model)!r} is neither a local checkpoint folder nor a hub id "
        "in the local Hugging Face cache"
    )
