"""Evaluation data sets: reading a manifest or a Hugging Face data set into checked `Example`s.

A data set comes from whoever runs the evaluation, so it is untrusted input: every row is checked before any
model loads, and every refusal names the file and the row (the 1-based line of a JSONL manifest, the index of
a Hugging Face data set, which is also its default id). Accepted forms:

- a folder holding `manifest.jsonl`, or a `.jsonl` file, one JSON object a line:
  text   `{"id": ..., "article": "<text>", "summary": ...}` or `{"id": ..., "article_file": "a.txt", "summary": ...}`
  speech `{"id": ..., "audio": "a.flac", "transcript": ...}`
  Files are named relative to the manifest's folder and must stay inside it. Extra keys are ignored.
- a `datasets` folder written by `save_to_disk`, a `.parquet` file, or a folder of parquet files, read with
  the `datasets` package; `columns` maps our names (input, reference, id) to the data set's.

Speech files are only checked to exist here: decoding them is the job of the cell that runs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .prompts import MAX_ARTICLE_CHARS, InputError, check_article_size
from .settings import SPEECH, TEXT

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_TEXT = ASSETS / "eval" / "text"
BUNDLED_SPEECH = ASSETS / "eval" / "speech"

MANIFEST = "manifest.jsonl"
MAX_ROWS = 10_000  # each example runs once per model pair and setting: more would be days of GPU time
MAX_FILE_BYTES = 256 * 2**20  # a JSONL or parquet file is read whole; 256 MiB is 2,000 articles of max size
MAX_ID_CHARS = 200  # ids label rows of reports and tables: one short line

# Keys of a manifest row, by task: (the input's keys, the reference's key).
_TEXT_INPUTS = ("article", "article_file")
_SPEECH_INPUT = "audio"
_REFERENCE_KEY = {TEXT: "summary", SPEECH: "transcript"}
COLUMN_NAMES = ("input", "reference", "id")


class EvalDataError(ValueError):
    """A data set that cannot be evaluated; the message names the file and the row."""


@dataclass(frozen=True, eq=False)  # eq=False: comparing two audio arrays with == has no single truth value
class Example:
    id: str  # unique within the data set
    task: str  # TEXT or SPEECH
    input: str | np.ndarray  # TEXT: the article; SPEECH: an absolute audio path, or mono float32 16 kHz samples
    reference: str  # the reference summary (TEXT) or transcript (SPEECH)


# ---------------------------------------------------------------------------------------------------------------
# The public entry points


def load_examples(path: str | Path, columns: Mapping[str, str] | None = None,
                  limit: int | None = None) -> list[Example]:
    """The examples of the data set at `path` (forms: see the module docstring), at most `limit` of them,
    all checked. Raises EvalDataError, naming the file and the row, for anything that cannot be evaluated."""
    limit = _checked_limit(limit)
    form, source = _form(Path(path))
    if form == "jsonl":
        if columns:
            raise EvalDataError(f"{source}: columns= applies to Hugging Face data sets; a manifest names its keys "
                                f"id, article (or article_file) and summary, or id, audio and transcript")
        examples = _read_manifest(source, limit)
    else:
        from .eval_datasets import checked_columns, read_dataset

        examples = read_dataset(form, source, checked_columns(columns), limit)
    if not examples:
        raise EvalDataError(f"{source}: the data set holds no examples")
    return examples


def describe(path: str | Path, *, examples: Sequence[Example] | None = None,
             columns: Mapping[str, str] | None = None, limit: int | None = None) -> str:
    """One line for reports, e.g. '12 articles from assets/eval/text (manifest.jsonl)'. Pass the `examples`
    already loaded from `path` to count those instead of loading the data set again (with columns and limit)."""
    if examples is None:
        examples = load_examples(path, columns, limit)
    if not examples:
        raise EvalDataError(f"{path}: the data set holds no examples")
    form, source = _form(Path(path))
    count = len(examples)
    noun = "article" if examples[0].task == TEXT else "audio clip"
    if source.is_file():  # a manifest or one parquet file
        folder, what = source.parent, source.name
    else:
        folder, what = source, "Hugging Face data set" if form == "disk" else "parquet files"
    return f"{count} {noun}{'s' if count != 1 else ''} from {_shown(folder)} ({what})"


# ---------------------------------------------------------------------------------------------------------------
# Which form a path is


def _form(path: Path) -> tuple[str, Path]:
    """('jsonl' | 'disk' | 'parquet', the file or folder to read)."""
    if path.is_dir():
        if (path / MANIFEST).is_file():
            return "jsonl", path / MANIFEST
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise EvalDataError(f"{path} holds several splits ({', '.join(splits)}); pass one split's folder, "
                                f"e.g. {path / (splits[0] if splits else 'test')}")
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return "disk", path
        if any(path.glob("*.parquet")):
            return "parquet", path
        raise EvalDataError(f"{path} holds neither {MANIFEST}, a data set written by datasets' save_to_disk, "
                            f"nor .parquet files")
    if path.is_file():
        if path.suffix == ".jsonl":
            return "jsonl", path
        if path.suffix == ".parquet":
            return "parquet", path
        raise EvalDataError(f"{path}: an evaluation data set is a .jsonl or .parquet file, or a folder "
                            f"(holding {MANIFEST}, parquet files, or a data set saved with save_to_disk)")
    raise EvalDataError(f"no such file or folder: {path}")


def _shown(path: Path) -> str:
    """The path relative to the working folder where it lies inside it (reports stay short), else absolute."""
    path = path.resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _checked_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_ROWS:
        raise EvalDataError(f"limit must be a whole number from 1 to {MAX_ROWS:,}, got {limit!r}")
    return limit


def too_many(source: Path) -> EvalDataError:
    return EvalDataError(f"{source} holds more than {MAX_ROWS:,} examples; evaluate a part of it with "
                         f"limit= (at most {MAX_ROWS:,})")


def check_file_size(file: Path) -> None:
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise EvalDataError(f"{file} is {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit of an "
                            f"evaluation file; split it, or evaluate a part of it")


# ---------------------------------------------------------------------------------------------------------------
# Checks shared by both forms; `where` is "FILE, line N" or "FILE, row N"


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


def _article_file(folder: Path, name: Any, where: str) -> str:
    file = member_path(folder, name, "article_file", where)
    # UTF-8 holds at most 4 bytes a character: a bigger file is too long before it is read
    if file.stat().st_size > 4 * MAX_ARTICLE_CHARS:
        raise EvalDataError(f"{where}: '{name}' is {file.stat().st_size:,} bytes, longer than any article a "
                            f"prompt can hold (about {MAX_ARTICLE_CHARS:,} characters)")
    try:
        article = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalDataError(f"{where}: '{name}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return article_text(article, "article_file", where)


# ---------------------------------------------------------------------------------------------------------------
# JSONL manifests


def _read_manifest(manifest: Path, limit: int | None) -> list[Example]:
    check_file_size(manifest)
    folder, seen, examples = manifest.parent, {}, []
    task, first = None, ""
    for lineno, row in _json_rows(manifest):
        if len(examples) == (limit or MAX_ROWS):
            if limit:
                break
            raise too_many(manifest)
        where = f"{manifest}, line {lineno}"
        row_task = _row_task(row, where)
        if task is None:
            task, first = row_task, f"line {lineno}"
        elif row_task != task:
            raise EvalDataError(f"{where}: a {_kind(row_task)} row, but {first} is a {_kind(task)} row; a "
                                f"manifest holds one task")
        examples.append(_manifest_example(row, task, folder, where, seen))
    return examples


def _json_rows(manifest: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line, object) of each non-blank line."""
    with manifest.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{manifest}, line {lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise EvalDataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalDataError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
            except RecursionError:  # thousands of nested brackets: no manifest row is like that
                raise EvalDataError(f"{where}: invalid JSON (nested too deeply)") from None
            if not isinstance(row, dict):
                raise EvalDataError(f"{where}: a row must be a JSON object, got {_json_type(row)}")
            yield lineno, row


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(type(value), "a number")


def _kind(task: str) -> str:
    return "text" if task == TEXT else "speech"


def _row_task(row: dict[str, Any], where: str) -> str:
    """The task a row's keys announce; a row that announces both or neither is refused."""
    text = [k for k in _TEXT_INPUTS if k in row]
    speech = _SPEECH_INPUT in row
    if len(text) + speech > 1:
        keys = " and ".join(repr(k) for k in text + [_SPEECH_INPUT] * speech)
        raise EvalDataError(f"{where}: the row has both {keys}; give exactly one input")
    if not text and not speech:
        raise EvalDataError(f"{where}: the row has no input: give 'article' or 'article_file' (text), or "
                            f"'audio' (speech)")
    return SPEECH if speech else TEXT


def _manifest_example(row: dict[str, Any], task: str, folder: Path, where: str, seen: dict[str, str]) -> Example:
    ident = example_id(row.get("id"), where, seen)
    if task == SPEECH:
        given = str(member_path(folder, row["audio"], "audio", where))
    elif "article" in row:
        given = article_text(row["article"], "article", where)
    else:
        given = _article_file(folder, row["article_file"], where)
    reference = text_field(row.get(_REFERENCE_KEY[task]), _REFERENCE_KEY[task], where)
    return Example(ident, task, given, reference)
