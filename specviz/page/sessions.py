"""What the page's browser sessions share and what keeps them apart: the loaded models (one load per pair,
hub ids and local paths checked against what the server accepts) and each session's Stop flag."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from specviz.models.hub import HUB_ID
from specviz import openmp
from specviz.models.loading import DEFAULT, ModelLoadError, ModelPair, Progress, load_pair
from specviz.runs.settings import SPEECH, TEXT, Settings
from specviz.text.prompts import InputError


@dataclass(frozen=True)
class ModelAccess:
    """Which model names the page takes from its visitors.

    On localhost the visitor is the operator: any hub id or local path. On a public address local paths are
    accepted only under directories the operator named (--models-dir), and the refusal reads the same
    whether or not the path exists, so the page cannot be used to probe the server's disk.
    """

    allowed_dirs: tuple[Path, ...] | None = None  # None: any local path

    def check(self, name: str, role: str) -> None:
        if name == DEFAULT or (role == "draft" and name.startswith("layers:")) or self.allowed_dirs is None:
            return
        if HUB_ID.match(name) and ".." not in name and not Path(name).expanduser().exists():
            return  # a hub id, which transformers resolves from its own cache or the hub
        real = Path(name).expanduser().resolve()
        if not any(real == d or d in real.parents for d in self.allowed_dirs):
            raise ModelLoadError(f"the {role} model {name!r} is not accepted here: this server takes the default "
                                 "models, hub ids, and local models under the directories it was started with "
                                 "(--models-dir)")


@dataclass(frozen=True)
class VisitorLimits:
    """What one visitor's run, comparison or evaluation may ask of a page that strangers share.

    On a Space (or any non-local address) visitors share two cores and one queue: one visitor's 8192-token
    Compare of five rounds would hold everyone else for an hour. Locally the operator is the only visitor and
    nothing is capped. A request over a limit is refused with the limit named, before any model runs.
    """

    max_new_tokens: int | None = None  # a Run's tokens (None: no cap)
    sequences: int | None = None  # a Run's batch of samples
    compare_rounds: int | None = None
    compare_tokens: int | None = None  # each run of a comparison is target-only or speculative: 5+ runs a round
    eval_examples: int | None = None

    @property
    def shared(self) -> bool:
        return self != VisitorLimits()

    def _over(self, what: str, value: int, cap: int | None) -> None:
        if cap is not None and value > cap:
            raise InputError(f"this page is shared, so {what} is at most {cap} here (asked: {value}); run specviz on "
                             "your own machine for more")

    def check_run(self, settings: Settings) -> None:
        self._over("a run's max new tokens", settings.max_new_tokens, self.max_new_tokens)
        self._over("a run's number of sequences", settings.sequences, self.sequences)

    def check_compare(self, settings: Settings, rounds: int) -> None:
        self._over("a comparison's max new tokens", settings.max_new_tokens, self.compare_tokens)
        self._over("a comparison's number of rounds", rounds, self.compare_rounds)
        self._over("a comparison's number of sequences", settings.sequences, self.sequences)

    def check_evaluation(self, examples: int) -> None:
        self._over("an evaluation's number of examples", examples, self.eval_examples)


# On a shared page a Run of the default 96 tokens takes ~10-20 s on two cores and a Compare of 2 rounds × 4 runs
# of 64 tokens about a minute: what one visitor holds stays within a minute or two of everyone else's wait.
SHARED_LIMITS = VisitorLimits(max_new_tokens=256, sequences=2, compare_rounds=2, compare_tokens=64, eval_examples=2)


class ModelCache:
    """Loaded pairs by name, shared by all sessions: read-only but for each pair's prompt caches, which
    lock (specviz.models.prompt_cache).

    One lock per pair keeps two sessions from loading the same pair twice without making a session that
    wants another pair wait for a slow load; the short table lock guards the lock table and each load's latest
    progress, which a session waiting on another's load (or on the start-up preparation) shows as its own.
    """

    WAIT_POLL_S = 0.5  # how often a session waiting on another's load repeats that load's progress

    def __init__(self, loader: Callable[..., Any] = load_pair, speech_loader: Callable[..., Any] | None = None,
                 access: ModelAccess = ModelAccess(), device: str | None = None):
        self._text_loader, self._speech_loader, self.access = loader, speech_loader, access
        # where every pair loads: the page's --device, handed to the loaders; None leaves it to them (CUDA when present)
        self.device = device
        self._where = {} if device is None else {"device": device}
        self._pairs: dict[tuple, Any] = {}
        self._key_locks: dict[tuple, threading.Lock] = {}
        self._latest: dict[tuple, tuple[str, float | None]] = {}  # a load in flight: its last progress
        self._table_lock = threading.Lock()

    def text(self, draft: str, target: str, progress: Progress) -> ModelPair:
        self.access.check(draft, "draft")
        self.access.check(target, "target")
        return self._get((TEXT, draft, target),
                         lambda said: self._text_loader(draft, target, progress=said, **self._where), progress)

    def speech(self, draft: str, target: str, progress: Progress):
        from specviz.speech.asr import load_speech_pair

        self.access.check(draft, "draft")
        self.access.check(target, "target")
        loader = self._speech_loader or load_speech_pair
        return self._get((SPEECH, draft, target),
                         lambda said: loader(target, draft, dtype="fp32", progress=said, **self._where), progress)

    def prepare(self, progress: Progress = lambda message, fraction: None) -> threading.Thread:
        """Start loading the default text pair in the background (a Space's start: its first visitor should not
        wait for a cold cache), the CPU kernels building beside it on the other core. A Run that asks for the pair
        meanwhile waits for this load and shows its progress."""
        from specviz import native

        def load() -> None:
            builder = threading.Thread(target=native.available, name="specviz-kernels", daemon=True)
            builder.start()  # g++ in its own process while the blocks are packed
            try:
                self.text(DEFAULT, DEFAULT, progress)
            except Exception as e:  # a visitor's Run then meets the same failure, with the page's message
                progress(f"preparing the default models failed: {type(e).__name__}: {e}", None)
            builder.join()

        thread = threading.Thread(target=load, name="specviz-prepare", daemon=True)
        thread.start()
        return thread

    def _get(self, key: tuple, load: Callable[[Progress], Any], progress: Progress):
        with self._table_lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        while not key_lock.acquire(timeout=self.WAIT_POLL_S):  # another session is loading this pair
            with self._table_lock:
                latest = self._latest.get(key)
            if latest is not None:
                progress(*latest)
        try:
            if key not in self._pairs:
                def said(message: str, fraction: float | None) -> None:
                    with self._table_lock:
                        self._latest[key] = (message, fraction)
                    progress(message, fraction)

                with openmp.team_released():  # loaded in a handler's thread, which outlives the load
                    self._pairs[key] = load(said)
            return self._pairs[key]
        finally:
            with self._table_lock:
                self._latest.pop(key, None)
            key_lock.release()


class Activity:
    """Which sessions' work (runs, comparisons, evaluations) is going on this server, so that a timing knows
    whether another session's decoding or drawing shared the cores with it. The lock guards the table; each
    entry is a mutable record that only this class writes."""

    @dataclass(eq=False)  # entries are told apart by identity (one session may hold two)
    class Entry:
        owner: str  # the browser session
        overlapped: bool = False  # another session's work ran at some moment of this one's

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: list[Activity.Entry] = []

    @contextmanager
    def running(self, owner: str) -> Iterator["Activity.Entry"]:
        """Mark `owner`'s work as going on while the block runs; the entry says whether another session's was too."""
        entry = Activity.Entry(owner)
        with self._lock:
            others = [e for e in self._active if e.owner != owner]
            for other in others:
                other.overlapped = True
            entry.overlapped = bool(others)
            self._active.append(entry)
        try:
            yield entry
        finally:
            with self._lock:
                self._active.remove(entry)

    def overlapped(self, entry: "Activity.Entry") -> bool:
        with self._lock:
            return entry.overlapped


class StopFlag:
    """Set by the page's Stop button, a closed browser session, or a consumer that went away; read by the
    decoding thread between iterations. A threading.Event makes that hand-over safe; `reason` is written
    before the event is set and read only after it is seen set."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def stop(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class Stops:
    """The current run's StopFlag of each browser session. Gradio runs the Stop and unload handlers in
    other threads than the run; the lock guards only this table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: dict[str, StopFlag] = {}

    def start(self, session: str) -> StopFlag:
        flag = StopFlag()
        with self._lock:
            self._flags[session] = flag
        return flag

    def stop(self, session: str, reason: str) -> bool:
        with self._lock:
            flag = self._flags.get(session)
        if flag is None:
            return False
        flag.stop(reason)
        return True

    def end(self, session: str, flag: StopFlag) -> None:
        with self._lock:
            if self._flags.get(session) is flag:
                del self._flags[session]
