"""What an evaluation data set is made of, whatever its form: checked `Example`s, the refusal that names a
file and a row, and the checks every reader applies to a row's fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specviz.text.prompts import InputError, check_article_size

MAX_ROWS = 10_000  # each example runs once per model pair and setting: more would be days of GPU time
MAX_FILE_BYTES = 256 * 2**20  # a JSONL or parquet file is read whole; 256 MiB is 2,000 articles of max size
MAX_ID_CHARS = 200  # ids label rows of reports and tables: one short line

COLUMN_NAMES = ("input", "reference", "id")

class EvalDataError(ValueError):
    """A data set that cannot be evaluated; the message names the file and the row."""


@dataclass(frozen=True, eq=False)  # eq=False: comparing two audio arrays with == has no single truth value
class Example:
    id: str  # unique within the data set
    task: str  # TEXT or SPEECH
    input: str | np.ndarray  # TEXT: the article; SPEECH: an absolute audio path, or mono float32 16 kHz samples
    reference: str  # the reference summary (TEXT) or transcript (SPEECH)


def too_many(source: Path) -> EvalDataError:
    return EvalDataError(f"{source} holds more than {MAX_ROWS:,} examples; evaluate a part of it with "
                         f"limit= (at most {MAX_ROWS:,})")


def check_file_size(file: Path) -> None:
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvalDataError(f"{file} is {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit of an "
                            f"evaluation file; split it, or evaluate a part of it")


def text_field(value: Any, what: str, where: str) -> str:
    """A non-blank string, else an error naming `what`."""
    if value is None:
        raise EvalDataError(f"{where}: '{what}' is missing")
    if not isinstance(value, str):
        raise EvalDataError(f"{where}: '{what}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise EvalDataError(f"{where}: '{what}' is empty")
    return value


def example_id(value: Any, where: str, seen: dict[str, str]) -> str:
    ident = text_field(value, "id", where)
    if len(ident) > MAX_ID_CHARS or not ident.isprintable():
        raise EvalDataError(f"{where}: the id must be one line of at most {MAX_ID_CHARS} printable characters")
    if ident in seen:
        raise EvalDataError(f"{where}: the id {ident!r} repeats that of {seen[ident]}")
    seen[ident] = where
    return ident


def article_text(value: Any, what: str, where: str) -> str:
    article = text_field(value, what, where)
    try:
        check_article_size(article)
    except InputError as e:
        raise EvalDataError(f"{where}: {e}") from None
    return article


def member_path(folder: Path, name: Any, what: str, where: str) -> Path:
    """The file `name` names inside `folder`. A data set may only point at its own files: an absolute path or
    one that leaves the folder (through '..' or a link) is refused, so a downloaded data set cannot make the
    evaluation read elsewhere on the machine."""
    name = text_field(name, what, where)
    if Path(name).is_absolute():
        raise EvalDataError(f"{where}: '{what}' must be relative to {folder}, got the absolute path {name!r}")
    root = folder.resolve()
    file = (root / name).resolve()
    if not file.is_relative_to(root):
        raise EvalDataError(f"{where}: '{what}' {name!r} leads outside {folder}; a data set names only its "
                            f"own files")
    if not file.is_file():
        raise EvalDataError(f"{where}: '{what}' {name!r} is missing (no such file in {folder})")
    return file
