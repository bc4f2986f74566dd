"""The bundled evaluation sets, and the refusals of every malformed data set, each naming its row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from specviz.speech.audio import SAMPLE_RATE, load_audio
from specviz.evaluation.data import BUNDLED_SPEECH, BUNDLED_TEXT, describe, load_examples
from specviz.evaluation.examples import EvalDataError, Example
from specviz.text.prompts import MAX_ARTICLE_CHARS
from specviz.runs.settings import SPEECH, TEXT

ARTICLE = "The harbour of Quillon reopened on Monday after a week of repairs to the storm wall."


def write_manifest(folder: Path, rows: list, name: str = "manifest.jsonl") -> Path:
    """Rows as JSONL; a str row is written verbatim (for malformed lines)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path = folder / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def text_row(i: int, **changes) -> dict:
    return {"id": f"t{i}", "article": ARTICLE, "summary": "The Quillon harbour reopened.", **changes}


def tone(seconds: float = 0.5, rate: int = SAMPLE_RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def refusal(path, *needles, **kwargs) -> str:
    with pytest.raises(EvalDataError) as caught:
        load_examples(path, **kwargs)
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    return message


# --- the bundled sets ----------------------------------------------------------------------------------------


def test_bundled_text_set():
    examples = load_examples(BUNDLED_TEXT)
    assert len(examples) == 12
    assert len({e.id for e in examples}) == 12
    for e in examples:
        assert e.task == TEXT
        assert 120 <= len(e.input.split()) <= 220, e.id
        assert 25 <= len(e.reference.split()) <= 45, e.id
    assert describe(BUNDLED_TEXT).startswith("12 articles from ")
    assert describe(BUNDLED_TEXT).endswith(" (manifest.jsonl)")


def test_bundled_speech_set():
    examples = load_examples(BUNDLED_SPEECH)
    assert len(examples) == 12
    assert len({e.id for e in examples}) == 12
    for e in examples:
        assert e.task == SPEECH
        assert Path(e.input).is_absolute() and Path(e.input).parent == BUNDLED_SPEECH.resolve()
        assert 8 <= len(e.reference.split()) <= 25, e.id
        info = sf.info(e.input)
        assert (info.samplerate, info.channels, info.subtype) == (SAMPLE_RATE, 1, "PCM_16")
        audio = load_audio(e.input)
        assert audio.dtype == np.float32 and audio.ndim == 1
        assert 2.0 <= len(audio) / SAMPLE_RATE <= 12.0, e.id
    assert describe(BUNDLED_SPEECH).startswith("12 audio clips from ")
    assert sum(p.stat().st_size for p in BUNDLED_SPEECH.iterdir()) < 1_500_000


def test_limit_and_file_forms(tmp_path):
    assert [e.id for e in load_examples(BUNDLED_TEXT, limit=3)] == [e.id for e in load_examples(BUNDLED_TEXT)[:3]]
    # a .jsonl file of any name, blank lines skipped, extra keys ignored, an article read from a file
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(ARTICLE, encoding="utf-8")
    path = write_manifest(tmp_path, [text_row(1, source="wire"), "", "   ",
                                     {"id": "t2", "article_file": "docs/a.txt", "summary": "s"}], name="mine.jsonl")
    examples = load_examples(path)
    assert [(e.id, e.input) for e in examples] == [("t1", ARTICLE), ("t2", ARTICLE)]
    assert describe(path) == f"2 articles from {tmp_path} (mine.jsonl)"


# --- malformed manifests: every refusal names the file and the line -------------------------------------------


@pytest.mark.parametrize("rows, needles", [
    ([text_row(1), text_row(2), '{"id": "t3", "article": '], ["line 3", "invalid JSON"]),
    ([text_row(1), text_row(2), '["t3", "an array"]'], ["line 3", "JSON object", "array"]),
    ([text_row(1), {"id": "t2", "article": ARTICLE}], ["line 2", "'summary' is missing"]),
    ([text_row(1), text_row(2, summary="  ")], ["line 2", "'summary' is empty"]),
    ([text_row(1, id="")], ["line 1", "'id' is empty"]),
    ([text_row(1, id=7)], ["line 1", "'id' must be a string"]),
    ([{"article": ARTICLE, "summary": "s"}], ["line 1", "'id' is missing"]),
    ([text_row(1, id="a\nb")], ["line 1", "one line"]),
    ([text_row(1), text_row(2), text_row(1)], ["line 3", "'t1' repeats", "line 1"]),
    ([text_row(1), text_row(2, article="x" * (MAX_ARTICLE_CHARS + 1))], ["line 2", "too long"]),
    ([text_row(1), {"id": "s1", "audio": "s1.flac", "transcript": "hello"}], ["line 2", "speech row", "line 1"]),
    ([text_row(1, audio="s1.flac")], ["line 1", "both"]),
    ([{"id": "x", "summary": "s"}], ["line 1", "no input"]),
    ([text_row(1, article=None, article_file="../outside.txt")], ["line 1", "both"]),
    ([{"id": "x", "article_file": "../outside.txt", "summary": "s"}], ["line 1", "leads outside"]),
], ids=["bad-json", "non-object", "no-summary", "blank-summary", "empty-id", "int-id", "no-id", "multiline-id",
        "duplicate-id", "long-article", "mixed-tasks", "two-inputs", "no-input", "article-and-file",
        "article-file-escape"])
def test_malformed_text_rows(tmp_path, rows, needles):
    (tmp_path / "outside.txt").write_text(ARTICLE, encoding="utf-8")
    path = write_manifest(tmp_path / "set", rows)
    message = refusal(tmp_path / "set", *needles)
    assert str(path) in message


@pytest.mark.parametrize("audio, needles", [
    ("../escape.flac", ["line 2", "leads outside"]),
    ("/etc/hostname", ["line 2", "absolute path"]),
    ("missing.flac", ["line 2", "'missing.flac' is missing"]),
    ("", ["line 2", "'audio' is empty"]),
    ("link.flac", ["line 2", "leads outside"]),  # a link inside the folder to a file outside it
], ids=["dotdot", "absolute", "missing", "empty", "symlink"])
def test_malformed_speech_rows(tmp_path, audio, needles):
    sf.write(tmp_path / "escape.flac", tone(), SAMPLE_RATE)
    folder = tmp_path / "set"
    folder.mkdir()
    sf.write(folder / "ok.flac", tone(), SAMPLE_RATE)
    (folder / "link.flac").symlink_to(tmp_path / "escape.flac")
    write_manifest(folder, [{"id": "s1", "audio": "ok.flac", "transcript": "a tone"},
                            {"id": "s2", "audio": audio, "transcript": "a tone"}])
    refusal(folder, *needles)


def test_empty_and_oversized_sets(tmp_path, monkeypatch):
    write_manifest(tmp_path / "empty", ["", "  "])
    refusal(tmp_path / "empty", "no examples")
    refusal(tmp_path / "nowhere", "no such file or folder")
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    refusal(tmp_path / "notes.txt", ".jsonl or .parquet")

    import specviz.evaluation.data as eval_data
    import specviz.evaluation.examples as eval_examples
    monkeypatch.setattr(eval_data, "MAX_ROWS", 3)
    monkeypatch.setattr(eval_examples, "MAX_ROWS", 3)
    write_manifest(tmp_path / "big", [text_row(i) for i in range(4)])
    refusal(tmp_path / "big", "more than 3 examples", "limit=")
    assert len(load_examples(tmp_path / "big", limit=2)) == 2
    refusal(tmp_path / "big", "limit must be", limit=0)
    monkeypatch.setattr(eval_examples, "MAX_FILE_BYTES", 100)
    refusal(tmp_path / "big", "over the 100-byte limit")


def test_columns_apply_only_to_datasets():
    refusal(BUNDLED_TEXT, "columns=", columns={"input": "text"})


def test_example_with_samples_compares_by_identity():
    a = Example("x", SPEECH, tone(), "a tone")
    assert a == a and a != Example("x", SPEECH, tone(), "a tone")


# --- Hugging Face data sets ----------------------------------------------------------------------------------


@pytest.fixture
def datasets():
    return pytest.importorskip("datasets")


def news_table(datasets):
    return datasets.Dataset.from_dict({
        "document": [ARTICLE, ARTICLE + " Boats queued at dawn."],
        "highlights": ["Quillon harbour reopened.", "Quillon harbour reopened; boats queued."],
        "story": ["q-1", "q-2"],
    })


def test_save_to_disk_text_with_columns(tmp_path, datasets):
    news_table(datasets).save_to_disk(str(tmp_path / "news"))
    columns = {"input": "document", "reference": "highlights", "id": "story"}
    examples = load_examples(tmp_path / "news", columns=columns)
    assert [(e.id, e.task, e.reference) for e in examples] == [
        ("q-1", TEXT, "Quillon harbour reopened."), ("q-2", TEXT, "Quillon harbour reopened; boats queued.")]
    expected = f"2 articles from {tmp_path / 'news'} (Hugging Face data set)"
    assert describe(tmp_path / "news", columns=columns) == expected
    assert describe(tmp_path / "news", examples=examples[:1]).startswith("1 article from ")
    # the id defaults to the row index; an unknown column is named with the ones there are
    assert [e.id for e in load_examples(tmp_path / "news", columns={"input": "document", "reference": "highlights"})] \
        == ["0", "1"]
    refusal(tmp_path / "news", "no column 'article'", "document, highlights, story")
    refusal(tmp_path / "news", "unknown name(s) 'summary'", columns={"summary": "highlights"})


def test_parquet_text_with_columns(tmp_path, datasets):
    table = news_table(datasets)
    table.to_parquet(str(tmp_path / "news.parquet"))
    examples = load_examples(tmp_path / "news.parquet", columns={"input": "document", "reference": "highlights"},
                             limit=1)
    assert [(e.id, e.input) for e in examples] == [("0", ARTICLE)]
    # a bad row is named by its index
    bad = datasets.Dataset.from_dict({"article": [ARTICLE, ARTICLE], "summary": ["fine", ""]})
    bad.to_parquet(str(tmp_path / "bad" / "part-0.parquet"))
    refusal(tmp_path / "bad", f"{tmp_path / 'bad'}, row 1", "'summary' is empty")


def test_dataset_speech_arrays_are_resampled(tmp_path, datasets):
    rate = 8_000
    audio = [{"array": tone(1.0, rate).tolist(), "sampling_rate": rate},
             {"array": tone(0.5, rate).tolist(), "sampling_rate": rate}]
    table = datasets.Dataset.from_dict({"speech": audio, "sentence": ["one second", "half a second"]})
    table.save_to_disk(str(tmp_path / "clips"))
    # the input column is a struct of samples, so the set is speech even though no column is named 'audio'
    examples = load_examples(tmp_path / "clips", columns={"input": "speech", "reference": "sentence"})
    assert [e.task for e in examples] == [SPEECH, SPEECH]
    lengths = [len(e.input) for e in examples]
    assert lengths == [SAMPLE_RATE, SAMPLE_RATE // 2]
    assert all(e.input.dtype == np.float32 and not e.input.flags.writeable for e in examples)

    table.rename_columns({"speech": "audio", "sentence": "text"}).to_parquet(str(tmp_path / "clips.parquet"))
    assert [e.reference for e in load_examples(tmp_path / "clips.parquet")] == ["one second", "half a second"]


def test_dataset_audio_bytes_and_paths(tmp_path, monkeypatch, datasets):
    sf.write(tmp_path / "a.wav", tone(1.0, 22_050), 22_050)
    flac = tmp_path / "b.flac"
    sf.write(flac, tone(1.0), SAMPLE_RATE)
    cells = [{"bytes": (tmp_path / "a.wav").read_bytes(), "path": "a.wav"}, {"bytes": None, "path": "b.flac"}]
    table = datasets.Dataset.from_dict({"audio": cells, "transcript": ["bytes", "path"]})
    table = table.cast_column("audio", datasets.Audio(decode=False))
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "b.flac").write_bytes(flac.read_bytes())  # paths are relative to the data set's folder
    monkeypatch.chdir(tmp_path / "set")  # where datasets looks for b.flac while writing
    table.to_parquet(str(tmp_path / "set" / "clips.parquet"))
    first, second = load_examples(tmp_path / "set" / "clips.parquet")
    assert isinstance(first.input, np.ndarray) and abs(len(first.input) - SAMPLE_RATE) <= 1
    assert second.input == str((tmp_path / "set" / "b.flac").resolve())

    paths = datasets.Dataset.from_dict({"audio_file": ["/etc/hostname"], "transcript": ["x"]})
    paths.to_parquet(str(tmp_path / "paths.parquet"))
    refusal(tmp_path / "paths.parquet", "row 0", "absolute path", columns={"input": "audio_file"})


def test_datasets_package_missing(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    refusal(tmp_path / "x.parquet", "pip install datasets")
