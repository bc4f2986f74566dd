"""Faults (issue 22, item 4): real processes killed with SIGKILL mid-conversion and mid-export.

* The embedded Whisper conversion (`whisper_loader.ensure_embedded_whisper`, the real 145 MB checkpoint) is
  killed at points read from its own output: while assembling model.bin, converting, saving the safetensors,
  right after sealing, right after the rename, at two seeded-random times, and while replacing an entry an
  older converter made (before removing it, and halfway through removing it). After each kill nothing in the
  cache may be trusted unless it is byte-identical to a clean conversion; a fresh start must then say why it
  converts again (or convert afresh, or trust a whole entry), end with a sealed entry identical to the clean
  one, and leave no work directory behind: a killed run never reaches its `finally`, so its
  `.whisper-base.partial-<pid>` (up to 0.3 GB) is removed by the next start, and a live pid's is kept.
* A 24 MB trace export (`page.export`: Trace.save writes a `.part`, then renames it) is killed as its `.part`
  is created, as it starts filling (leaving it cut short), at seeded-random times and as soon as an export
  returned. Every `*.json` left must load and equal the trace, a `.part` is hidden and never beside a final
  name, and a fresh interpreter's exports work and prune every leftover.

Each killed or restarted process is a child forked from one "zygote" process that imported torch,
transformers and specviz once (an import costs ~6 s here, a conversion ~2 s), so the kills stay many and
the test short; the children share nothing with each other but what the code under test writes to disk.
Run with -s to see the tables (their figures are in docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from specviz.page import actions as page
from specviz.cache import CACHE_ENV, MARKER, damage
from specviz.config import SamplingConfig, SpecConfig
from specviz.models.loading import ModelPair
from specviz.traces.trace import Trace
from specviz.traces.json_format import trace_from_dict, load_trace
from specviz.speech.whisper_loader import _CONVERTER_VERSION, EMBEDDED_WHISPER

from conftest import decode, perturbed_copy, tiny_qwen, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SEED = 22  # issue 22: every random kill time comes from here
NAME = EMBEDDED_WHISPER.name
MADE_FROM = {"sha256": EMBEDDED_WHISPER.sha256, "converter": _CONVERTER_VERSION}
TRACE_MB = 24  # big enough that a write takes tens of milliseconds, so kills land inside it
CHILD_S = 120  # no child may stay silent longer than this

# ---------------------------------------------------------------------------------------------------------------
# The zygote: imports once, then forks one child per job; the test kills children by pid.

ZYGOTE = r'''
import json, os, sys, traceback
while line := sys.stdin.readline():
    job = json.loads(line)
    if not job["fork"]:  # run in the zygote itself: what every later child shares (imports, a loaded trace)
        try:
            exec(job["code"], globals())
            print("INLINE DONE", flush=True)
        except BaseException:
            traceback.print_exc()
            print("INLINE FAILED", flush=True)
        continue
    sys.stdout.flush()
    sys.stderr.flush()
    gate_r, gate_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(gate_w)
        os.read(gate_r, 1)  # wait until the zygote has printed this pid: the test reads it first
        os.close(gate_r)
        code = 1
        try:
            os.environ.update(job["env"])
            exec(job["code"], {**globals(), "ARGS": job["args"]})
            code = 0
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(gate_r)
    print("PID", pid, flush=True)
    os.write(gate_w, b"x")
    os.close(gate_w)
    _, status = os.waitpid(pid, 0)  # reaped at once: a killed child's pid is dead, not a zombie
    print("EXIT", os.waitstatus_to_exitcode(status), flush=True)
'''

PRELUDE = """
import json, os, shutil, time
from pathlib import Path
from specviz import cache
from specviz.page import actions as page
from specviz.speech import whisper_loader
from specviz.traces.json_format import load_trace
from specviz.traces.trace import Trace
print("EXPORT_DIR", page.EXPORT_DIR, flush=True)
"""


class Zygote:
    """A Python process holding the imports; `start` forks a child running some code, `inline` runs code in it."""

    def __init__(self, env: dict[str, str], log: Path):
        self.log = log
        self._log_handle = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", ZYGOTE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log_handle, env=env, cwd=ROOT,
                                     text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.child: Child | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def line(self, timeout: float) -> str | None:
        """The next line any child (or the zygote) printed; None when none came within `timeout`."""
        try:
            line = self._lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if line is None:
            raise AssertionError(f"the zygote process ended; its stderr:\n{self.log_tail()}")
        return line

    def _send(self, job: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def inline(self, code: str, timeout: float = CHILD_S) -> list[str]:
        self._send({"fork": False, "code": code})
        said = []
        while (line := self.line(timeout)) not in ("INLINE DONE", "INLINE FAILED"):
            assert line is not None, f"the zygote said nothing for {timeout} s"
            said.append(line)
        assert line == "INLINE DONE", f"the zygote failed to run {code!r}:\n{self.log_tail()}"
        return said

    def start(self, code: str, env: dict[str, str], args: dict) -> "Child":
        assert self.child is None or self.child.exit_code is not None, "one child at a time"
        self._send({"fork": True, "code": code, "env": env, "args": args})
        line = self.line(CHILD_S)
        assert line and line.startswith("PID "), f"expected the child's pid, got {line!r}:\n{self.log_tail()}"
        self.child = Child(self, int(line.split()[1]))
        return self.child

    def close(self) -> None:
        if self.child is not None and self.child.exit_code is None:
            self.child.kill()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._log_handle.close()


class Child:
    """One forked process: what it printed so far, and how it ended."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.said: list[str] = []
        self.at: list[float] = []  # when each line arrived (time.monotonic)
        self.exit_code: int | None = None

    def read(self, timeout: float) -> str | None:
        """Its next line; None when nothing came within `timeout` or once it has exited."""
        if self.exit_code is not None:
            return None
        line = self.zygote.line(timeout)
        if line is None:
            return None
        if line.startswith("EXIT "):
            self.exit_code = int(line.split()[1])
            return None
        self.said.append(line)
        self.at.append(time.monotonic())
        return line

    def wait(self, timeout: float = CHILD_S) -> int:
        deadline = time.monotonic() + timeout
        while self.exit_code is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"child {self.pid} still runs after {timeout} s; it said {self.said[-5:]}")
            self.read(deadline - time.monotonic())
        return self.exit_code

    def kill(self) -> bool:
        """SIGKILL it unless it has ended already; True when the kill is what ended it."""
        if self.exit_code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended on its own an instant ago; the zygote reports how
        return self.wait(30) == -signal.SIGKILL


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The zygote, with TMPDIR (so page.EXPORT_DIR) and the cache pointed into this test's own folder; this
    process's cache too (the recorded run calibrates costs into it)."""
    root = tmp_path_factory.mktemp("faults")
    (root / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TMPDIR": str(root / "tmp"), CACHE_ENV: str(root / "own-cache"), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    zygote = Zygote(env, root / "zygote-stderr.log")
    said = zygote.inline(PRELUDE)
    print(f"\nzygote ready (torch, transformers, specviz imported once) in {time.perf_counter() - start:.1f} s")
    export_dir = Path(said[-1].split(" ", 1)[1])
    assert export_dir == root / "tmp" / "gradio" / "specviz-exports", f"exports would go to {export_dir}, outside the test"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(CACHE_ENV, str(root / "own-cache"))
            yield zygote, root, export_dir
    finally:
        zygote.close()
        shutil.rmtree(root, ignore_errors=True)  # GBs of models and traces: not kept among pytest's old runs


def print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A Markdown table, ready for docs/benchmarks.md."""
    print(f"\n{title}\n\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


# ---------------------------------------------------------------------------------------------------------------
# 1. The Whisper conversion killed

CONVERT = r'''
final = cache.cache_dir() / whisper_loader.EMBEDDED_WHISPER.name

def say(*words):
    print(*words, flush=True)

def hold(where):  # an exact kill point: stop here until the test kills this process
    say("PAUSED", where)
    time.sleep(600)

pause = ARGS["pause"]
if pause == "sealed":  # the work copy is sealed; the old entry is not yet removed, the new one not renamed
    real_seal = whisper_loader.seal
    def sealed(directory, info):
        real_seal(directory, info)
        hold("sealed")
    whisper_loader.seal = sealed
elif pause == "removing-old":  # in the middle of rmtree(final): its first file is gone, the rest are not
    real_unlink, entry = os.unlink, os.path.realpath(final)
    def unlink(path, *, dir_fd=None):
        real_unlink(path, dir_fd=dir_fd)
        folder = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.path.dirname(path)
        if folder == entry:
            hold(f"removed {os.path.basename(path)}")
    os.unlink = unlink
elif pause == "renamed":  # the new entry is in place; the work directory (model.bin, 145 MB) still exists
    real_rmtree = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        work = Path(path)
        if work.name.startswith(f".{final.name}.partial-") and work.exists() and (final / cache.MARKER).exists():
            hold("renamed")
        real_rmtree(path, *args, **kwargs)
    shutil.rmtree = rmtree
whisper_loader.ensure_embedded_whisper(lambda message, fraction: say("PROGRESS", json.dumps([message, fraction])))
say("DONE")
'''


def progress(line: str) -> tuple[str, float | None] | None:
    if not line.startswith("PROGRESS "):
        return None
    message, fraction = json.loads(line.removeprefix("PROGRESS "))
    return message, fraction


def progress_at(prefix: str, fraction: float | None = None) -> Callable[[str], bool]:
    """Kill on the first progress line starting with `prefix` (at `fraction` or beyond, when given)."""
    def fires(line: str) -> bool:
        said = progress(line)
        return said is not None and said[0].startswith(prefix) and (fraction is None or (said[1] or 0) >= fraction)
    return fires


def messages(child: Child) -> list[str]:
    """The progress messages a conversion child printed."""
    return [said[0] for line in child.said if (said := progress(line))]


def paused(line: str) -> bool:
    return line.startswith("PAUSED ")


@dataclass(frozen=True)
class KillPoint:
    name: str
    fires: Callable[[str], bool] | None = None  # kill on the first line of the child's this accepts
    delay: float | None = None  # or: this many seconds after its first progress line
    pause: str | None = None  # a hook in the child that stops it at an exact point
    old_entry: bool = False  # the cache holds an entry an older converter made: this start replaces it


def kill_points(conversion_s: float) -> list[KillPoint]:
    rng = random.Random(SEED)
    delays = sorted(rng.uniform(0.05, 0.8) * conversion_s for _ in range(2))  # within the conversion
    return [
        KillPoint("assembling model.bin (≥ 50 %)", fires=progress_at("assembling", 0.5)),
        KillPoint("converting CTranslate2 → torch", fires=progress_at("converting")),
        KillPoint("saving the safetensors", fires=progress_at("saving")),
        KillPoint("sealed, before the rename", fires=paused, pause="sealed"),
        KillPoint("renamed, before its work dir is removed", fires=paused, pause="renamed"),
        *(KillPoint(f"seeded random: {d:.2f} s after its first progress line", delay=d) for d in delays),
        KillPoint("replacing an older converter's entry: sealed, before removing it", fires=paused,
                  pause="sealed", old_entry=True),
        KillPoint("replacing an older converter's entry: mid-removal", fires=paused, pause="removing-old",
                  old_entry=True),
    ]


def convert(zygote: Zygote, cache: Path, point: KillPoint | None = None) -> Child:
    """Start a conversion into `cache`; with a kill point, SIGKILL it there (returns once it is reaped)."""
    child = zygote.start(CONVERT, {CACHE_ENV: str(cache)}, {"pause": point.pause if point else None})
    if point is None:
        assert child.wait() == 0, f"the conversion failed: {child.said[-3:]}\n{zygote.log_tail()}"
        return child
    deadline = None
    while child.exit_code is None and not (deadline is not None and time.monotonic() >= deadline):
        line = child.read(CHILD_S if deadline is None else deadline - time.monotonic())
        if line is None:
            assert child.exit_code is not None or deadline is not None, f"child silent for {CHILD_S} s"
            continue
        if point.delay is not None and deadline is None and progress(line):
            deadline = time.monotonic() + point.delay
        if point.fires and point.fires(line):
            break
    child.kill()
    return child


def hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_nothing_trusted_unless_whole(cache: Path, clean: dict[str, str], point: str) -> None:
    """Any sealed directory the kill left (the entry, or a work copy) that damage() passes is the clean one."""
    for marker in cache.rglob(MARKER):
        folder = marker.parent
        if damage(folder, MADE_FROM) is None:
            assert hashes(folder) == clean, f"killed at {point!r}: {folder} is trusted but not a whole conversion"


def on_disk(cache: Path) -> str:
    """What a kill left in the cache, in words."""
    final = cache / NAME
    if not final.exists():
        found = ["no entry"]
    else:
        reason = damage(final, MADE_FROM)
        found = ["whole entry" if reason is None else f"untrusted entry ({reason or 'no marker'})"]
    for work in sorted(cache.glob(f".{NAME}.partial-*")):
        size = sum(f.stat().st_size for f in work.rglob("*") if f.is_file())
        found.append(f"work dir of the dead pid ({size / 1e6:.0f} MB{', sealed copy inside' if any(work.rglob(MARKER)) else ''})")
    return "; ".join(found)


def landed(child: Child) -> str:
    """Where the child was when killed: the last thing it said."""
    if not child.said:
        return "before any output"
    last = child.said[-1]
    said = progress(last)
    if said is None:
        return last.removeprefix("PAUSED ").lower()
    message, fraction = said
    return message + (f" ({fraction:.0%})" if fraction is not None and fraction < 1 else "")


def make_old_entry(cache: Path, clean_entry: Path) -> None:
    """A whole entry sealed by an older converter version: a start must rebuild (replace) it."""
    shutil.copytree(clean_entry, cache / NAME)
    marker = cache / NAME / MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "converter": _CONVERTER_VERSION - 1}))


def check_restart(zygote: Zygote, cache: Path, clean: dict[str, str], point: str) -> tuple[str, float]:
    """A fresh start after the kill: says what it does and why, and ends whole, sealed and tidy. Returns what
    it did, in words, and how long it took."""
    final = cache / NAME
    reason = damage(final, MADE_FROM) if final.exists() else ""
    start = time.perf_counter()
    said = messages(convert(zygote, cache))
    elapsed = time.perf_counter() - start
    converted = any(m.startswith("assembling") for m in said)
    distrust = [m for m in said if "cannot be trusted" in m]
    if reason:
        expected = f"the converted {NAME} in the cache cannot be trusted ({reason}); converting it again"
        assert expected in said, f"killed at {point!r}: the next start did not say {expected!r}: {said}"
        summary = f"\"cannot be trusted ({reason})\", converted again"
    elif reason == "":
        assert not distrust, f"killed at {point!r}: nothing was converted there, yet the start said {distrust}"
        summary = "converted afresh"
    else:
        summary = "trusted the entry as it was"
    assert converted == (reason is not None), f"killed at {point!r}: entry damage {reason!r}, messages {said}"
    assert damage(final, MADE_FROM) is None, f"killed at {point!r}: the next start left {damage(final, MADE_FROM)!r}"
    assert hashes(final) == clean, f"killed at {point!r}: the rebuilt entry differs from a clean conversion"
    left = sorted(p.name for p in cache.iterdir())
    assert left == [NAME], f"killed at {point!r}: the next start left {left} in the cache (a dead pid's work dir?)"
    return summary, elapsed


def check_live_work_kept(zygote: Zygote, cache: Path, clean_entry: Path, dead_pid: int) -> tuple[str, ...]:
    """Removing dead pids' work dirs must spare a conversion still running (another process's, here this one's)."""
    shutil.copytree(clean_entry, cache / NAME)
    live, dead = cache / f".{NAME}.partial-{os.getpid()}", cache / f".{NAME}.partial-{dead_pid}"
    for work in (live, dead):
        (work / "ct2").mkdir(parents=True)
        (work / "ct2" / "model.bin").write_bytes(b"half a model")
    child = convert(zygote, cache)
    assert not any(m.startswith("assembling") for m in messages(child)), "a whole entry was converted again"
    assert live.is_dir(), "a start removed the work directory of a conversion that is still running"
    assert not dead.exists(), f"a start kept the work directory of the dead pid {dead_pid}"
    shutil.rmtree(cache)
    return ("(none: a start beside two work dirs)", "—", "whole entry; work dirs of a live and a dead pid",
            "trusted the entry as it was", "the dead pid's work dir removed, the live one's kept")


def test_conversion_killed_anywhere_is_never_trusted_and_is_rebuilt(world):
    zygote, root, _ = world
    start = time.perf_counter()
    clean_cache = root / "clean-cache"
    child = convert(zygote, clean_cache)
    first = next(i for i, line in enumerate(child.said) if progress(line))
    conversion_s = child.at[-1] - child.at[first]  # from its first progress line to DONE
    clean_entry = clean_cache / NAME
    clean = hashes(clean_entry)
    assert damage(clean_entry, MADE_FROM) is None and MARKER in clean
    print(f"\nclean conversion: {conversion_s:.2f} s from its first progress line "
          f"({(clean_entry / 'model.safetensors').stat().st_size / 1e6:.0f} MB of safetensors)")

    rows = []
    for i, point in enumerate(kill_points(conversion_s)):
        cache = root / f"cache-{i}"
        if point.old_entry:
            make_old_entry(cache, clean_entry)
        victim = convert(zygote, cache, point)
        was_killed = victim.exit_code == -signal.SIGKILL
        assert was_killed or point.delay is not None, f"{point.name!r}: the child ended by itself: {victim.said[-3:]}"
        where = landed(victim) if was_killed else "it had finished"
        assert_nothing_trusted_unless_whole(cache, clean, point.name)
        found = on_disk(cache)
        said, restart_s = check_restart(zygote, cache, clean, point.name)
        rows.append((point.name, where, found, said, f"identical, sealed, no work dir ({restart_s:.1f} s)"))
        shutil.rmtree(cache)
    kills = len(rows)
    rows.append(check_live_work_kept(zygote, root / "cache-live", clean_entry, dead_pid=victim.pid))
    total = time.perf_counter() - start
    print_table(f"Whisper conversion killed with SIGKILL ({kills} kills, seed {SEED}; {total:.1f} s in all)",
                ("kill point", "where it was", "the cache after the kill", "the next start", "outcome"), rows)


# ---------------------------------------------------------------------------------------------------------------
# 2. A trace export killed

EXPORT = r'''
for i in range(ARGS["exports"]):
    print("EXPORTING", i, flush=True)
    print("EXPORTED", page.export(TRACE), flush=True)
'''

FRESH_EXPORTS = r'''
import json, sys
from specviz.page import actions as page
from specviz.traces.json_format import load_trace
small = load_trace(sys.argv[1])
print(json.dumps([page.export(small) for _ in range(page.EXPORTS_KEPT)]))
'''

POLL_S = 0.0005


def recorded_traces(root: Path) -> tuple[Trace, Path, Trace, Path]:
    """A real recorded run (tiny model pair, a small vocabulary so that it takes a second), saved as is and
    padded to TRACE_MB with an extra meta field (meta is free-form beyond the keys the page reads)."""
    vocab = 1000
    target = tiny_qwen(0, vocab_size=vocab)
    pair = ModelPair(perturbed_copy(target, noise=0.03, seed=1), target, word_tokenizer(vocab), "tiny-draft",
                     "tiny-target", vocab)
    rng = random.Random(SEED)
    prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in (12, 5, 21)]
    cfg = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=1.0, top_p=0.9), max_new_tokens=20, seed=5)
    small = decode(pair, prompts, cfg, meta={"input": "fault test ✓"})
    data = small.to_dict()
    line = "fault test padding " + "x" * 1000
    data["meta"]["fault_test_padding"] = [line] * int(TRACE_MB * 1e6 / (len(line) + 8))
    big = trace_from_dict(data)
    small.save(root / "small.json")
    big.save(root / "big.json")
    return small, root / "small.json", big, root / "big.json"


@dataclass(frozen=True)
class ExportKill:
    name: str
    after: int  # armed when the child starts its export number `after` (0-based)
    delay: float | None = None  # then: kill this many seconds later
    on_part: int | None = None  # or: as soon as a new .part file holds at least this many bytes (mid-write)
    on_return: bool = False  # or: as soon as that export has returned


def parts(exports: Path) -> set[Path]:
    found = set()
    for folder in folders(exports):
        try:
            found.update(p for p in folder.iterdir() if p.name.endswith(".part"))
        except FileNotFoundError:  # pruned meanwhile by the exporting child
            pass
    return found


def part_bytes(found: set[Path]) -> int:
    """The size of the largest of these .part files; -1 when there is none (or it was renamed meanwhile)."""
    sizes = [-1]
    for path in found:
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:
            pass
    return max(sizes)


def folders(exports: Path) -> set[Path]:
    return {p for p in exports.iterdir() if p.is_dir()}


def export_and_kill(zygote: Zygote, exports: Path, kill: ExportKill) -> Child:
    child = zygote.start(EXPORT, {}, {"exports": 6})
    before = parts(exports)
    armed = None
    while child.exit_code is None:
        if armed is not None and kill.delay is not None and time.monotonic() >= armed + kill.delay:
            break
        if armed is not None and kill.on_part is not None and part_bytes(parts(exports) - before) >= kill.on_part:
            break
        line = child.read(CHILD_S if armed is None else POLL_S)
        if line is None:
            assert child.exit_code is not None or armed is not None, f"export child silent for {CHILD_S} s"
        elif line == f"EXPORTING {kill.after}":
            armed = time.monotonic()
        elif kill.on_return and armed is not None and line.startswith("EXPORTED "):
            break
    child.kill()
    return child


def folder_state(folder: Path, whole_size: int) -> str:
    names = [p.name for p in folder.iterdir()]
    if not names:
        return "an empty export folder (killed before the write)"
    if all(n.endswith(".part") for n in names):
        size = sum((folder / n).stat().st_size for n in names)
        return f"a .part of {size / 1e6:.1f} of {whole_size / 1e6:.1f} MB"
    return "whole"


def check_exports(exports: Path, big: Trace, whole: bytes, checked: set[Path], kill: str) -> None:
    """Every final name holds the whole trace; a .part is hidden and never beside (or under) a final name."""
    for path in sorted(exports.rglob("*")):
        if path.is_dir():
            continue
        if path.name.endswith(".part"):
            assert path.name.startswith("."), f"killed at {kill!r}: a partial file is not hidden: {path}"
            assert not list(path.parent.glob("*.json")), f"killed at {kill!r}: {path} lies beside a final export"
            continue
        assert path.suffix == ".json" and not path.name.startswith("."), f"killed at {kill!r}: stray {path}"
        if path not in checked:
            assert path.read_bytes() == whole, f"killed at {kill!r}: {path} is not the whole trace"
            assert load_trace(path) == big, f"killed at {kill!r}: {path} does not load as the trace"
            checked.add(path)


def measure_export(zygote: Zygote) -> float:
    """Seconds one export of the big trace takes in a child (from its own EXPORTING / EXPORTED lines)."""
    child = zygote.start(EXPORT, {}, {"exports": 3})
    stamps = []
    while child.read(CHILD_S) is not None:
        stamps.append(time.monotonic())
    assert child.exit_code == 0 and len(stamps) == 6, child.said
    return (stamps[-1] - stamps[0]) / 2.5  # from EXPORTING 0 to EXPORTED 2: two and a half exports


def export_kills(export_s: float) -> list[ExportKill]:
    rng = random.Random(SEED)
    randoms = sorted((rng.randrange(2), rng.uniform(0, export_s)) for _ in range(4))
    return [
        ExportKill("as its .part file is created (export 0)", after=0, on_part=0),
        *(ExportKill(f"as its .part file starts filling (export {k})", after=k, on_part=1) for k in (0, 1)),
        *(ExportKill(f"seeded random: {d * 1000:.0f} ms into export {k}", after=k, delay=d) for k, d in randoms),
        ExportKill("as soon as an export returned", after=0, on_return=True),
    ]


def kill_one_export(zygote: Zygote, exports: Path, kill: ExportKill, whole_size: int) -> tuple[Child, list[str]]:
    """Kill an exporting child as `kill` says; the states of the export folders it made. A kill meant to land
    mid-write may come late (the write takes ~20 ms, the test polls): then it is tried again, up to 5 times."""
    before = folders(exports)
    for _ in range(5):
        child = export_and_kill(zygote, exports, kill)
        states = [folder_state(f, whole_size) for f in sorted(folders(exports) - before, key=lambda f: f.stat().st_mtime)]
        if kill.on_part is None or any(".part" in s for s in states):
            break
    assert child.exit_code == -signal.SIGKILL, f"{kill.name!r}: the export child was not killed: {child.said[-3:]}"
    return child, states


def test_export_killed_anywhere_leaves_only_whole_files(world):
    zygote, root, exports = world
    start = time.perf_counter()
    small, small_path, big, big_path = recorded_traces(root)
    whole = big_path.read_bytes()
    zygote.inline(f"TRACE = load_trace({str(big_path)!r})")
    # A server that has run a while holds EXPORTS_KEPT folders and prunes the oldest on every export.
    for i in range(page.EXPORTS_KEPT):
        (exports / f"earlier-{i:03d}").mkdir(parents=True)
        os.utime(exports / f"earlier-{i:03d}", (1e9 + i, 1e9 + i))
    export_s = measure_export(zygote)
    kills = export_kills(export_s)

    checked: set[Path] = set()
    offered: list[str] = []
    rows = []
    for kill in kills:
        child, states = kill_one_export(zygote, exports, kill, len(whole))
        offered += [line.split(" ", 1)[1] for line in child.said if line.startswith("EXPORTED ")]
        check_exports(exports, big, whole, checked, kill.name)
        unfinished = [s for s in states if s != "whole"]
        assert len(unfinished) <= 1, f"{kill.name!r}: one export was in flight, yet {unfinished}"
        where = unfinished[0] if unfinished else "none (every folder whole)"
        assert ".part" in where or kill.on_part is None, f"{kill.name!r}: never landed mid-write in 5 tries"
        rows.append((kill.name, where, f"{states.count('whole')} whole", "every *.json whole and equal"))
    assert all(p.endswith(".json") and not Path(p).name.startswith(".") for p in offered), offered

    # A fresh server process: its exports work and prune what the killed ones left, .part files included.
    leftovers = len(parts(exports))
    fresh = subprocess.run([sys.executable, "-c", FRESH_EXPORTS, str(small_path)], capture_output=True, text=True,
                           env={**os.environ, "GRADIO_TEMP_DIR": str(exports.parent), CACHE_ENV: str(root / "own-cache"),
                                "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=CHILD_S)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    made = [Path(p) for p in json.loads(fresh.stdout.splitlines()[-1])]
    assert folders(exports) == {p.parent for p in made}, "the fresh process did not prune down to its own exports"
    assert not parts(exports), "a killed export's .part survived a full round of pruning"
    for path in made:
        assert [p.name for p in path.parent.iterdir()] == [path.name] and load_trace(path) == small
    rows.append((f"(then a fresh process exports {len(made)} times)", f"{leftovers} .part files left by the kills",
                 f"{len(made)} whole", "all leftovers pruned; its exports whole"))
    print_table(f"Trace export ({len(whole) / 1e6:.0f} MB) killed with SIGKILL ({len(kills)} kills, seed {SEED}; "
                f"one export {export_s * 1000:.0f} ms; {time.perf_counter() - start:.1f} s in all)",
                ("kill point", "the export in flight when killed", "exports that child finished", "check"), rows)
