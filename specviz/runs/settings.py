"""Every user setting of a run, declared once: the page's controls, the CLI's flags and a trace's restore
are built from these declarations, and `Settings.spec` is the one resolution of "auto" into a SpecConfig.

A setting's value means the same on every surface; where a surface differs (the CLI decodes greedily by
default and takes longer outputs than a page run should), the declaration says so next to the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from specviz.config import DRAFT_KINDS, GAMMA_POLICIES, MODES, SamplingConfig, SpecConfig
from specviz.decoding.gamma import DEFAULT_POLICY
from specviz.models.loading import DEFAULT
from specviz.runs.tasks import SPEECH, TASKS, TEXT, Task  # noqa: F401 (declared with the tasks; many import them from here)

AUTO = "auto"
_SAME = object()  # a surface's default that is the declared default


class SettingError(ValueError):
    """A value a setting cannot hold; the message names the setting and what it takes."""


@dataclass(frozen=True)
class Setting:
    """How one field of `Settings` appears to users. Its type and page default are the field's own."""

    label: str  # the page's label
    help: str  # the CLI's help; the page's info line where `info` is set
    control: str  # the page's control: radio | dropdown | slider | number | text | none (CLI only)
    choices: tuple[tuple[str, Any], ...] = ()  # (what the page shows, the value); empty: any value in range
    low: float | None = None  # the range every surface accepts
    high: float | None = None
    page_range: tuple[float, float] | None = None  # narrower on the page, where a run should stay interactive
    step: float | None = None  # slider step; None: Gradio's
    tasks: tuple[str, ...] = tuple(TASKS)
    flag: str | None = ""  # the CLI flag; "": --<name-with-dashes>; None: page only
    cli_default: Any = _SAME
    elem_id: str = ""  # the page control's element id; "": <name-with-dashes>
    info: bool = False  # show `help` under the page's control
    # zero (or an empty box) means "auto" for this number: the page's Number cannot be emptied reliably
    zero_is_auto: bool = False

    @property
    def values(self) -> tuple[Any, ...]:
        return tuple(value for _, value in self.choices)


def _setting(default: Any, **declaration: Any) -> Any:
    return dataclasses.field(default=default, metadata={"setting": Setting(**declaration)})


POLICY_CHOICES = (("auto: cost (γ from this machine's measured call costs)", AUTO),
                  *((f"{name}: {words}", name) for name, words in GAMMA_POLICIES.items()))
DRAFT_KIND_CHOICES = (("auto (the fastest measured for the task)", AUTO),
                      *((words, kind) for kind, words in DRAFT_KINDS.items()))
DRAFT_VOCAB_CHOICES = ((AUTO, AUTO), ("all tokens", "0"),
                       *((f"{k:,} + specials + prompt", str(k)) for k in (4096, 8192, 16384, 32768, 65536)))


@dataclass(frozen=True)
class Settings:
    """The user's settings of one run, as plain values ("auto" and 0 where the task decides)."""

    mode: str = _setting(
        "exact", label="Verification mode", control="radio", choices=tuple((m, m) for m in MODES), info=True,
        elem_id="mode-select", help="exact and baseline keep the target's distribution (baseline: transformers' "
                                    "algorithm); sigmoid is Wagner et al.'s faster approximation")
    # The CLI has no decoding switch: its --temperature 0 (its default, reproducible output) means greedy.
    decoding: str = _setting(
        "sample", label="Decoding", control="radio", choices=(("sample", "sample"), ("greedy", "greedy")),
        elem_id="decoding-select", flag=None, help="sampling by default, so that p, q and the uniforms mean something")
    temperature: float = _setting(
        0.8, label="Temperature", control="slider", low=0.0, high=10.0, page_range=(0.05, 2.0), cli_default=0.0,
        help="sampling temperature, applied identically to draft and target; 0 = greedy (the CLI's default)")
    top_k: int = _setting(0, label="Top-k (0 = off)", control="number", low=0, high=1 << 20,
                          help="keep the k most probable tokens (0 = off)")
    top_p: float = _setting(1.0, label="Top-p", control="slider", low=1e-6, high=1.0, page_range=(0.05, 1.0),
                            help="keep the smallest set of tokens holding this probability (1 = off)")
    seed: int = _setting(0, label="Seed", control="number", low=0, high=1 << 53, help="seeds every draw of the run")
    gamma_policy: str = _setting(
        AUTO, label="γ policy: how many tokens to draft next", control="dropdown", choices=POLICY_CHOICES,
        help="auto: cost, the γ with the best expected tokens/s from this machine's measured call costs, 0 (a "
             "plain target step) when none pays; γ then follows measured time, and a trace decodes again exactly "
             "on its own γ schedule (--gamma-schedule TRACE; the page's “Run the loaded trace again exactly”)")
    gamma_init: int = _setting(0, label="Initial γ (0 = the policy's)", control="number", low=0, high=64,
                               flag="--gamma", help="the first γ (0: the policy's own start)")
    # A page run should finish while someone watches; the CLI may decode long outputs.
    max_new_tokens: int = _setting(96, label="Max new tokens", control="slider", low=1, high=8192,
                                   page_range=(8, 256), step=8, cli_default=128, help="per sequence")
    sigmoid_alpha: float | None = _setting(
        None, label="sigmoid range low (Wagner's α; 0: −10⁴ text, −10³ speech)", control="number", low=-1e12,
        high=1e12, zero_is_auto=True, help="sigmoid's range low (0 or unset: −1e4 for text, −1e3 for speech)")
    sigmoid_beta: float | None = _setting(
        None, label="sigmoid range high (Wagner's β; 0: 10⁴ text, 10³ speech)", control="number", low=-1e12,
        high=1e12, zero_is_auto=True, help="sigmoid's range high (0 or unset: 1e4 for text, 1e3 for speech)")
    lenience: float = _setting(1.0, label="Lenience l (1 = exact)", control="slider", low=1e-3, high=1.0,
                               page_range=(0.05, 1.0), help="Leviathan A.5; 1 = exact")
    draft_confidence: float = _setting(
        0.0, label="Stop drafting below this draft probability (0 = off)", control="slider", low=0.0, high=0.99,
        page_range=(0.0, 0.95), step=0.05,
        help="stop drafting when the draft's probability of its token is below this (0 = off)")
    draft: str = _setting(DEFAULT, label="Draft (default, hub id, local path; speech: layers:0,1,2,4,5)",
                          control="text", elem_id="draft-model",
                          help="hub id, local directory, .gguf file, or 'default' (embedded); speech also takes "
                               "'layers:0,1,2,4,5' (a draft made of the target's own decoder layers)")
    target: str = _setting(DEFAULT, label="Target (default, hub id, local path)", control="text",
                           elem_id="target-model", help="hub id, local directory, .gguf file, or 'default' (embedded)")
    sequences: int = _setting(
        1, label="Sequences (samples decoded together as one batch)", control="slider", low=1, high=64,
        page_range=(1, 8), step=1, tasks=(TEXT,), flag="--num-sequences", elem_id="num-sequences",
        help="samples drawn per article (BASS: several responses to one prompt; needs a temperature > 0)")
    draft_kind: str = _setting(
        AUTO, label="Who drafts", control="dropdown", choices=DRAFT_KIND_CHOICES,
        help="the draft model, prompt lookup (n-gram match on prompt and output, no draft model), or lookup "
             "where an n-gram matches and the model elsewhere (auto: measured per task)")
    draft_vocab: str = _setting(
        AUTO, label="Draft head vocabulary (q = 0 elsewhere; stays exact)", control="dropdown",
        choices=DRAFT_VOCAB_CHOICES,
        help="tokens the draft model's head scores (the first K ids, specials and the prompt's tokens; 0 = all); "
             "the target keeps its full head, so output stays exact (auto: measured per task)")
    lookup_ngram: int = _setting(0, label="Prompt lookup: shortest match before the model (0 = auto)",
                                 control="slider", low=0, high=8, page_range=(0, 5), step=1,
                                 help="with lookup+model: the shortest suffix match that replaces the model's draft "
                                      "(0: the task's default)")
    # Only the CLI forces a path; the page shows which one ran (device_summary).
    verify_backend: str = _setting(
        AUTO, label="Verification path", control="none", choices=((AUTO, AUTO), ("torch", "torch"), ("cuda", "cuda")),
        help="auto: CuPy kernels for exact/sigmoid on CUDA when they work, exact's full-vocabulary passes in C++ on "
             "the CPU; torch: torch only; cuda: the CuPy kernels or an error")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))

    @property
    def greedy(self) -> bool:
        return self.decoding == "greedy" or self.temperature == 0

    def batch(self, task: "str | Task") -> int:
        task = task.name if isinstance(task, Task) else task
        return TASKS[task].batch(self.sequences) if isinstance(task, str) and task in TASKS else 1

    def spec(self, task: "str | Task") -> SpecConfig:
        """The SpecConfig these settings mean for `task` (its name, or the Task): "auto" and 0 resolved to the
        task's measured defaults (the γ policy: gamma.DEFAULT_POLICY)."""
        task = task.name if isinstance(task, Task) else task
        if not isinstance(task, str) or task not in TASKS:
            raise SettingError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        scale, drafts = TASKS[task].sigmoid_range, TASKS[task].draft_defaults
        sampling = SamplingConfig() if self.greedy else SamplingConfig(self.temperature, self.top_k, self.top_p)
        policy = DEFAULT_POLICY if self.gamma_policy == AUTO else self.gamma_policy
        return SpecConfig(
            mode=self.mode, sampling=sampling, gamma_policy=policy, gamma_init=self.gamma_init or None,
            max_new_tokens=self.max_new_tokens, seed=self.seed, lenience=self.lenience,
            draft_confidence=self.draft_confidence,
            sigmoid_alpha=-scale if self.sigmoid_alpha is None else self.sigmoid_alpha,
            sigmoid_beta=scale if self.sigmoid_beta is None else self.sigmoid_beta,
            draft_kind=drafts.draft_kind if self.draft_kind == AUTO else self.draft_kind,
            draft_vocab=drafts.draft_vocab if self.draft_vocab == AUTO else int(self.draft_vocab),
            lookup_ngram=self.lookup_ngram or drafts.lookup_ngram, verify_backend=self.verify_backend,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "Settings":
        """From the page's controls (or any mapping of raw values): numbers coerced to the field's type,
        empty boxes to the default; a value the setting cannot hold raises SettingError naming it."""
        return cls(**{name: parse(name, raw) for name, raw in values.items()})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        """From the CLI's flags (those `add_flags` added); the CLI has no decoding switch: temperature 0 is
        greedy."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values["decoding"] = "greedy" if values.get("temperature", 0) == 0 else "sample"
        return cls.from_values(values)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "Settings":
        """The settings a trace was made with (meta["page_settings"], written by the page); for a trace of
        another origin, what its config says. A trace is untrusted: a value that the page's control could
        not hold (wrong type, unknown choice, outside the page's range) is replaced by the default."""
        saved = meta.get("page_settings")
        if not isinstance(saved, dict):
            saved = _from_config(meta)
        kept = {}
        for f in dataclasses.fields(cls):
            if f.name in saved and page_holds(f.name, saved[f.name]):
                kept[f.name] = saved[f.name]
        return cls(**kept)


def _from_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a CLI trace's config says about the settings the page has."""
    config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    sampling = config.get("sampling") if isinstance(config.get("sampling"), dict) else {}
    greedy = sampling.get("temperature") == 0
    return {"mode": meta.get("mode"), "max_new_tokens": config.get("max_new_tokens"), "seed": config.get("seed"),
            "gamma_policy": config.get("gamma_policy"), "decoding": "greedy" if greedy else "sample",
            "temperature": None if greedy else sampling.get("temperature"), "top_k": sampling.get("top_k"),
            "top_p": sampling.get("top_p"), "lenience": config.get("lenience")}


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Settings)}


def declaration(name: str) -> Setting:
    return FIELDS[name].metadata["setting"]


def elem_id(name: str) -> str:
    return declaration(name).elem_id or name.replace("_", "-")


def page_names() -> list[str]:
    """The settings the page has a control for, in declaration order."""
    return [name for name in FIELDS if declaration(name).control != "none"]


def _kind(f: dataclasses.Field) -> type:
    return {"str": str, "int": int, "float": float, "float | None": float}[str(f.type)]


def _check(f: dataclasses.Field, value: Any) -> None:
    s: Setting = f.metadata["setting"]
    kind = _kind(f)
    if value is None and f.default is None:
        return
    if kind is str:
        ok = isinstance(value, str) and 0 < len(value) <= 500
        if ok and f.name == "draft_vocab":
            ok = value == AUTO or (value.isdigit() and int(value) <= 1 << 24)
        elif ok and s.choices:
            ok = value in s.values
        if not ok:
            shown = ", ".join(map(str, s.values)) if s.choices else "a non-empty name"
            if f.name == "draft_vocab":
                shown = "auto or a token count (0 = all)"
            raise SettingError(f"{f.name}: {value!r} is not a choice; choose {shown}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise SettingError(f"{f.name}: {value!r} is not {'an integer' if kind is int else 'a number'}")
    if not (math.isfinite(value) and s.low <= value <= s.high):
        raise SettingError(f"{f.name}: {value!r} is outside {s.low:g} to {s.high:g}")


def parse(name: str, raw: Any) -> Any:
    """A raw value (a page control's, a CLI flag's) as the setting's type; None or "" is the default."""
    if name not in FIELDS:
        raise SettingError(f"unknown setting {name!r}")
    f = FIELDS[name]
    s: Setting = f.metadata["setting"]
    kind = _kind(f)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return f.default
    if kind is str:
        return str(raw).strip()
    if s.zero_is_auto and raw == 0:
        return None
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raise SettingError(f"{name}: {raw!r} is not a number") from None
    if kind is int and isinstance(raw, float) and raw.is_integer():
        return int(raw)  # Gradio's Number returns floats even with precision=0
    return raw


def page_holds(name: str, value: Any) -> bool:
    """Whether the page's control for `name` can show `value` (a restored trace's settings)."""
    f = FIELDS[name]
    s: Setting = f.metadata["setting"]
    try:
        _check(f, value)
    except SettingError:
        return False
    if f.name == "draft_vocab" and value not in s.values:
        return False  # a CLI size the page's list does not offer
    if s.page_range is not None and value is not None:
        return s.page_range[0] <= value <= s.page_range[1]
    return True


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: list[str]) -> None:
    """The CLI flags of `names`, from their declarations."""
    for name in names:
        f = FIELDS[name]
        s: Setting = f.metadata["setting"]
        if s.flag is None:
            raise SettingError(f"{name} is a page-only setting")
        default = f.default if s.cli_default is _SAME else s.cli_default
        parser.add_argument(s.flag or "--" + name.replace("_", "-"), dest=name, default=default, type=_kind(f),
                            choices=s.values if s.choices and f.name != "draft_vocab" else None,
                            help=s.help + (f" (default: {default})" if default not in (None, "") else ""))
