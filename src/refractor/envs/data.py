"""Dataset loading for environments: any HF dataset id (from the local cache when offline) or a
local file/folder, through ``datasets``. Built-ins ship small offline fixtures (``fixture_path``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refractor.errors import RefractorUserError

BUILTIN_DATA_DIR = Path(__file__).parent / "builtin" / "data"
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class DatasetLoadError(RefractorUserError, RuntimeError):
    pass


def fixture_path(name: str) -> Path:
    """Path of a shipped offline fixture, e.g. ``fixture_path("countdown")``."""
    path = BUILTIN_DATA_DIR / f"{name}.jsonl"
    if not path.exists():
        available = sorted(p.stem for p in BUILTIN_DATA_DIR.glob("*.jsonl"))
        raise DatasetLoadError(f"no shipped fixture {name!r}; available: {available}")
    return path


def load_rows(dataset_name: str, subset: str | None = None, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a dataset as dicts. ``dataset_name`` is a local file (.jsonl/.json/.parquet/.csv),
    a local folder (``save_to_disk`` output or data files), or an HF id (``subset``/``split`` apply)."""
    import datasets

    path = Path(str(dataset_name)).expanduser()
    try:
        if path.is_file():
            fmt = _FORMATS.get(path.suffix.lower())
            if fmt is None:
                raise DatasetLoadError(
                    f"unsupported dataset file type {path.suffix!r} ({path}); use one of {sorted(_FORMATS)}"
                )
            ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
        elif path.is_dir() and (path / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(str(dataset_name), subset, split=split)
    except DatasetLoadError:
        raise
    except Exception as err:
        raise DatasetLoadError(
            f"could not load dataset {dataset_name!r} (subset={subset!r}, split={split!r}): "
            f"{type(err).__name__}: {err}. Offline runs need it in the local HF cache; "
            "or pass dataset_name=<local .jsonl/.parquet file or folder>."
        ) from err
    return [dict(row) for row in ds]


def take(items: list, num_samples: int) -> list:
    """The first ``num_samples`` items (all when ``num_samples`` <= 0)."""
    return items if num_samples is None or num_samples <= 0 else items[:num_samples]
