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
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence


from specviz.text.prompts import MAX_ARTICLE_CHARS
from specviz.runs.tasks import SPEECH, SUMMARIZE, TASKS, TEXT, TRANSCRIBE
from specviz.evaluation.datasets import checked_columns, read_dataset
from specviz.evaluation.examples import (MAX_ROWS, EvalDataError, Example, article_text,
                                        check_file_size, example_id, member_path, text_field, too_many)

BUNDLED_TEXT = SUMMARIZE.bundled
BUNDLED_SPEECH = TRANSCRIBE.bundled

MANIFEST = "manifest.jsonl"

# Keys of a manifest row, by task: (the input's keys, the reference's key).
_TEXT_INPUTS = (SUMMARIZE.input_key, "article_file")
_SPEECH_INPUT = TRANSCRIBE.input_key





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
    noun = TASKS[examples[0].task].input_noun
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





# ---------------------------------------------------------------------------------------------------------------
# Checks shared by both forms; `where` is "FILE, line N" or "FILE, row N"


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
    return TASKS[task].kind


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
    spec = TASKS[task]
    if spec.input_is_file:  # an audio clip: checked to exist inside the folder, decoded by the cell that runs it
        given = str(member_path(folder, row[spec.input_key], spec.input_key, where))
    elif "article" in row:
        given = article_text(row["article"], "article", where)
    else:
        given = _article_file(folder, row["article_file"], where)
    reference = text_field(row.get(spec.reference_noun), spec.reference_noun, where)
    return Example(ident, task, given, reference)
