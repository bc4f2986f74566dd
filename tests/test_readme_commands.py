"""The commands README.md's "Measured figures" table cites are commands this CLI takes: each `python -m specviz …`
parses with the CLI's own parser (placeholders such as ARTICLE standing for a real file), each script and test
file it names exists, and each result file or input it names is in the repository. Running them is the
benchmarks' job (minutes each); this keeps the table from citing a flag or a file that is gone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from specviz.cli.commands import build_parser

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = {"ARTICLE": "assets/sample_article.txt", "FILE": "out.json"}


def _table_commands() -> list[str]:
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Measured figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and "`" in line]
    return [command for row in rows for command in re.findall(r"`([^`]+)`", row.rsplit("|", 2)[-2])]


def test_the_measured_table_cites_commands():
    assert len(_table_commands()) >= 8


def test_every_cli_command_in_the_measured_table_parses():
    parser = build_parser()
    for command in _table_commands():
        if not command.startswith("python -m specviz "):
            continue
        words = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)[3:] if w != "..."]
        parser.parse_args(words)  # exits (SystemExit) on an unknown flag or a bad value


def test_every_file_the_measured_table_names_exists():
    for command in _table_commands():
        for word in shlex.split(command):
            if re.search(r"\.(py|sh|txt|flac)$", word) and "*" not in word:
                assert (ROOT / word).exists(), f"{command!r} names {word}, which is not in the repository"
