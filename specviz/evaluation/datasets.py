"""Hugging Face data sets for an evaluation (a `save_to_disk` folder, parquet files): columns mapped to
ours, every row checked with specviz.evaluation.examples' checks, audio cells read or resampled to 16 kHz."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from specviz.speech.audio import AudioError, load_audio, to_model_input
from specviz.evaluation.examples import (COLUMN_NAMES, MAX_ROWS, EvalDataError, Example, article_text, check_file_size, example_id, member_path, text_field, too_many)
from specviz.runs.tasks import SUMMARIZE, TRANSCRIBE, Task


def checked_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    columns = dict(columns or {})
    unknown = sorted(set(columns) - set(COLUMN_NAMES))
    if unknown:
        raise EvalDataError(f"columns: unknown name(s) {', '.join(map(repr, unknown))}; map "
                            f"{', '.join(COLUMN_NAMES)} to the data set's column names")
    for ours, theirs in columns.items():
        if not isinstance(theirs, str) or not theirs:
            raise EvalDataError(f"columns: {ours!r} must map to a column name, got {theirs!r}")
    return columns


def _datasets():
    try:
        import datasets
    except ImportError:
        raise EvalDataError("reading a Hugging Face data set or parquet files needs the datasets package: "
                            "pip install datasets") from None
    return datasets


@contextmanager
def _quiet(datasets) -> Iterator[None]:
    """datasets draws progress bars while it loads; the evaluation draws its own, so silence them meanwhile."""
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def read_dataset(form: str, source: Path, columns: dict[str, str], limit: int | None) -> list[Example]:
    datasets = _datasets()
    with _quiet(datasets), tempfile.TemporaryDirectory(prefix="specviz-eval-") as cache:
        if form == "disk":
            try:
                table = datasets.load_from_disk(str(source))
            except (OSError, ValueError, KeyError) as e:
                raise EvalDataError(f"{source}: not a readable data set ({e})") from None
            folder = source
        else:
            files = sorted(source.glob("*.parquet")) if source.is_dir() else [source]
            for file in files:
                check_file_size(file)
            try:
                # a throwaway cache: the rows become Examples below, and nothing is left in ~/.cache
                table = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                              cache_dir=cache, keep_in_memory=True)
            except (OSError, ValueError) as e:
                raise EvalDataError(f"{source}: not readable as parquet ({e})") from None
            folder = source if source.is_dir() else source.parent
        if len(table) > MAX_ROWS and limit is None:
            raise too_many(source)
        if limit is not None and len(table) > limit:
            table = table.select(range(limit))
        return _dataset_examples(table, source, folder, columns, datasets)


def _dataset_examples(table, source: Path, folder: Path, columns: dict[str, str], datasets) -> list[Example]:
    names = list(table.column_names)
    input_col = columns.get("input") or ("audio" if "audio" in names else "article")
    task: Task = TRANSCRIBE if _is_audio_column(input_col, table.features.get(input_col), datasets) else SUMMARIZE
    ref_default = task.reference_noun
    if task is TRANSCRIBE and ref_default not in names:
        ref_default = "text"  # what many speech data sets call the transcript
    ref_col = columns.get("reference", ref_default)
    id_col = columns.get("id")
    for col, ours in ((input_col, "input"), (ref_col, "reference"), (id_col, "id")):
        if col is not None and col not in names:
            raise EvalDataError(f"{source}: no column {col!r} for the {ours} (columns: {', '.join(names)}); "
                                f"name it with columns={{{ours!r}: ...}}")
    if task is TRANSCRIBE and isinstance(table.features[input_col], datasets.Audio):
        # undecoded cells ({path, bytes}): specviz.speech.audio decodes them, with its limits, not datasets' backend
        table = table.cast_column(input_col, datasets.Audio(decode=False))
    table = table.select_columns([c for c in (input_col, ref_col, id_col) if c is not None])
    seen: dict[str, str] = {}
    examples = []
    for index, row in enumerate(table):
        where = f"{source}, row {index}"
        ident = example_id(_dataset_id(row[id_col], where) if id_col else str(index), where, seen)
        if task is TRANSCRIBE:  # reading audio cells is this module's own (datasets' forms of audio)
            given = _audio_cell(row[input_col], folder, input_col, where)
        else:
            given = article_text(row[input_col], input_col, where)
        examples.append(Example(ident, task.name, given, text_field(row[ref_col], ref_col, where)))
    return examples


def _is_audio_column(name: str, feature: Any, datasets) -> bool:
    """Speech when the input column is a datasets Audio feature, a struct (a dict a cell), or is named for
    audio (a column of file paths)."""
    return isinstance(feature, (datasets.Audio, dict)) or "audio" in name.lower()


def _dataset_id(value: Any, where: str) -> Any:
    # many public data sets number their rows: an integer id is as good as a string one
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _audio_cell(cell: Any, folder: Path, column: str, where: str) -> str | np.ndarray:
    """A path (checked like a manifest's) or 16 kHz mono samples, from any form datasets stores audio in."""
    if isinstance(cell, str):
        return str(member_path(folder, cell, column, where))
    if not isinstance(cell, dict):
        raise EvalDataError(f"{where}: '{column}' must be a file path or a dict with array and sampling_rate, "
                            f"bytes, or path; got {type(cell).__name__}")
    try:
        if cell.get("array") is not None:
            return _frozen(_resampled(cell["array"], cell.get("sampling_rate"), where))
        if cell.get("bytes"):
            return _frozen(_decoded(cell["bytes"], Path(str(cell.get("path") or "audio")).suffix))
        if cell.get("path"):
            return str(member_path(folder, cell["path"], column, where))
    except AudioError as e:
        raise EvalDataError(f"{where}: {e}") from None
    raise EvalDataError(f"{where}: '{column}' holds neither samples (array), file contents (bytes) nor a path")


def _resampled(array: Iterable[float], rate: Any, where: str) -> np.ndarray:
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise EvalDataError(f"{where}: an audio array needs an integer sampling_rate, got {rate!r}")
    try:
        samples = np.asarray(array, dtype=np.float32)
    except (TypeError, ValueError):
        raise EvalDataError(f"{where}: the audio array is not a list of numbers") from None
    return to_model_input(samples, rate, where)


def _decoded(data: bytes, suffix: str) -> np.ndarray:
    """Embedded file contents, decoded through a temporary file so specviz.speech.audio's header checks apply. The
    samples stay in memory: about 4 MB a minute of audio."""
    with tempfile.TemporaryDirectory(prefix="specviz-eval-") as folder:
        file = Path(folder) / f"clip{suffix[:8]}"
        file.write_bytes(data)
        return load_audio(file)


def _frozen(samples: np.ndarray) -> np.ndarray:
    # one example's samples feed many cells (models x settings); none may change them for the next
    samples.setflags(write=False)
    return samples
