"""An evaluation sweep's grid: which variants (verification mode, γ policy, sigmoid range) run on which
examples at which temperatures and seeds, each cell a Settings value (specviz.runs.settings) — the same
contract the page and the CLI use."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specviz.config import GAMMA_POLICIES, MODES
from specviz.evaluation.examples import Example
from specviz.runs.settings import AUTO, SettingError, Settings

TARGET_ONLY = "target-only"
MAX_CELLS = 100_000  # a grid bigger than this is a typo, not a sweep


class GridError(ValueError):
    """A grid that cannot run; the message names the setting."""


@dataclass(frozen=True)
class Variant:
    """What differs between the rows of Wagner's tables: the mode, the γ policy, sigmoid's range."""

    mode: str  # TARGET_ONLY or one of MODES
    gamma_policy: str = AUTO
    gamma_init: int = 0  # 0: the policy's own start
    sigmoid_alpha: float | None = None  # None: Wagner's default for the task
    sigmoid_beta: float | None = None

    @property
    def name(self) -> str:
        if self.mode == TARGET_ONLY:
            return TARGET_ONLY
        policy = self.gamma_policy + (f":{self.gamma_init}" if self.gamma_init else "")
        name = f"{self.mode} · γ {policy}"
        if self.mode == "sigmoid" and (self.sigmoid_alpha is not None or self.sigmoid_beta is not None):
            name += f" · α={_g(self.sigmoid_alpha)} β={_g(self.sigmoid_beta)}"
        return name


def _g(x: float | None) -> str:
    return "default" if x is None else f"{x:g}"


@dataclass(frozen=True)
class Grid:
    """The sweep: every example × temperature × seed runs target-only once (the reference) and every variant."""

    modes: tuple[str, ...] = MODES
    policies: tuple[str, ...] = (AUTO,)  # POLICY or POLICY:γ
    sigmoid_ranges: tuple[tuple[float | None, float | None], ...] = ((None, None),)  # (α, β); sigmoid rows only
    temperatures: tuple[float, ...] = (0.0,)
    seeds: tuple[int, ...] = (0,)
    base: Settings = Settings(max_new_tokens=64)  # everything the grid does not vary (models, drafts, tokens)

    def __post_init__(self) -> None:
        for field in ("modes", "policies", "sigmoid_ranges", "temperatures", "seeds"):
            if not getattr(self, field):
                raise GridError(f"the grid's {field} are empty")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise GridError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
        for low, high in self.sigmoid_ranges:
            if low is not None and high is not None and not low < high:
                raise GridError(f"a sigmoid range needs α < β, got α={low:g}, β={high:g}")
        for variant in self.variants():
            for t in self.temperatures:
                self.settings(variant, t, self.seeds[0])  # every setting is checked before anything runs

    def variants(self) -> list[Variant]:
        out = [Variant(TARGET_ONLY)]
        for mode in self.modes:
            for policy in self.policies:
                name, gamma = parse_policy(policy)
                ranges = self.sigmoid_ranges if mode == "sigmoid" else ((None, None),)
                out += [Variant(mode, name, gamma, low, high) for low, high in ranges]
        return out

    def settings(self, variant: Variant, temperature: float, seed: int) -> Settings:
        """A cell's settings: the base with what the grid varies (target-only ignores the verification ones)."""
        try:
            return dataclasses.replace(
                self.base, mode=self.base.mode if variant.mode == TARGET_ONLY else variant.mode,
                gamma_policy=variant.gamma_policy, gamma_init=variant.gamma_init, sigmoid_alpha=variant.sigmoid_alpha,
                sigmoid_beta=variant.sigmoid_beta, temperature=temperature,
                decoding="greedy" if temperature == 0 else "sample", seed=seed)
        except SettingError as e:
            raise GridError(str(e)) from None

    def cells(self, examples: list[Example]) -> list["Cell"]:
        count = len(examples) * len(self.temperatures) * len(self.seeds) * len(self.variants())
        if count > MAX_CELLS:
            raise GridError(f"the grid has {count:,} cells; at most {MAX_CELLS:,} run in one sweep")
        return [Cell(example, variant, t, seed) for example in examples for t in self.temperatures
                for seed in self.seeds for variant in self.variants()]

    def to_dict(self) -> dict[str, Any]:
        return {"modes": list(self.modes), "policies": list(self.policies),
                "sigmoid_ranges": [list(r) for r in self.sigmoid_ranges], "temperatures": list(self.temperatures),
                "seeds": list(self.seeds), "base": self.base.to_dict()}


def parse_policy(spec: str) -> tuple[str, int]:
    """'cost' -> ('cost', 0); 'constant:3' -> ('constant', 3)."""
    name, _, gamma = spec.partition(":")
    if name not in (AUTO, *GAMMA_POLICIES) or (gamma and not (gamma.isdigit() and 1 <= int(gamma) <= 64)):
        raise GridError(f"a γ policy is POLICY[:γ] with POLICY one of {', '.join((AUTO, *GAMMA_POLICIES))} and "
                        f"1 ≤ γ ≤ 64, got {spec!r}")
    return name, int(gamma or 0)


def parse_range(spec: str) -> tuple[float | None, float | None]:
    """'-1e4:1e4' -> (-1e4, 1e4); 'default' -> (None, None)."""
    if spec == "default":
        return None, None
    low, sep, high = spec.partition(":")
    try:
        pair = (float(low), float(high)) if sep else None
    except ValueError:
        pair = None
    if pair is None or not all(math.isfinite(x) for x in pair):
        raise GridError(f"a sigmoid range is ALPHA:BETA (e.g. -1e3:1e3) or 'default', got {spec!r}")
    return pair


@dataclass(frozen=True)
class Cell:
    """One run of the sweep."""

    example: Example
    variant: Variant
    temperature: float
    seed: int

    @property
    def target_only(self) -> bool:
        return self.variant.mode == TARGET_ONLY

    def key(self, models: str) -> str:
        """Names this cell in a results file: what was run, on what, with which models."""
        what = json.dumps([models, self.example.id, dataclasses.asdict(self.variant), self.temperature, self.seed],
                          sort_keys=True)
        return hashlib.sha256(what.encode()).hexdigest()[:24]


_GRID_KEYS = {"modes", "policies", "sigmoid", "temperatures", "seeds", "max_new_tokens"}


def grid_file(path: str | Path) -> dict[str, Any]:
    """A TOML grid: modes, policies, sigmoid (["ALPHA:BETA", ...]), temperatures, seeds, max_new_tokens."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise GridError(f"cannot read the grid file {path}: {e}") from None
    unknown = set(data) - _GRID_KEYS
    if unknown:
        raise GridError(f"{path}: unknown grid key {sorted(unknown)[0]!r}; the keys are {', '.join(sorted(_GRID_KEYS))}")
    for key, value in data.items():
        if key != "max_new_tokens" and not (isinstance(value, list) and value):
            raise GridError(f"{path}: {key} must be a non-empty list")
    return data


def make_grid(base: Settings, *, modes: list[str] | None = None, policies: list[str] | None = None,
              sigmoid: list[str] | None = None, temperatures: list[float] | None = None,
              seeds: list[int] | None = None, file: str | Path | None = None) -> Grid:
    """From CLI flags, a TOML file, or both (flags win)."""
    data = grid_file(file) if file else {}
    if "max_new_tokens" in data:
        try:
            base = dataclasses.replace(base, max_new_tokens=data["max_new_tokens"])
        except SettingError as e:
            raise GridError(f"{file}: {e}") from None
    ranges = sigmoid or data.get("sigmoid")
    return Grid(modes=tuple(modes or data.get("modes") or MODES),
                policies=tuple(policies or data.get("policies") or (AUTO,)),
                sigmoid_ranges=tuple(parse_range(str(r)) for r in ranges) if ranges else ((None, None),),
                temperatures=tuple(float(t) for t in temperatures or data.get("temperatures") or (0.0,)),
                seeds=tuple(int(s) for s in seeds or data.get("seeds") or (0,)), base=base)

