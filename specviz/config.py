"""Settings shared by the engine, the verifier, the CLI and the page."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MODES = ("baseline", "exact", "sigmoid")
# Who drafts (specviz.decoding.proposers) and the γ policies a user chooses (specviz.decoding.gamma), each with
# the words the page and the CLI show: declared once, here.
DRAFT_KINDS = {"model": "draft model", "lookup": "prompt lookup (no draft model)",
               "lookup+model": "prompt lookup, else the draft model",
               "priced": "each iteration the one with the best expected tokens/s: prompt lookup, the draft model, "
                         "lookup else model, or none (with the cost policy)"}
PRICED = "priced"
LOOKUP_THEN_MODEL = "lookup+model"
# What a priced run chooses among at each iteration besides a plain step: the kinds that draft.
PRICED_KINDS = ("model", "lookup", LOOKUP_THEN_MODEL)
GAMMA_POLICIES = {
    "constant": "always the initial γ",
    "hf": "+2 after all accepted, −1 otherwise (transformers)",
    "bass": "grows when any sequence kept all, shrinks on misses (BASS)",
    "optimal": "the γ that maximizes Leviathan's predicted speedup from measured α and c",
    "cost": "the γ with the best expected tokens/s from this machine's measured call costs; 0 (a plain target step) "
            "when no γ pays",
}
# γ read from a schedule (SpecConfig.gamma_schedule): a trace decoded again exactly, whatever its policy was
REPLAY = "replay"
MAX_EXPLAIN_TOP = 100  # bounds the trace's size (specviz.decoding.explain)


@dataclass(frozen=True)
class SamplingConfig:
    """Leviathan et al. §2.2 standardization, applied identically to draft and target.

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def temperature_only(self) -> bool:
        """True when standardization is a plain rescale that a tiled pass can fuse."""
        return not self.greedy and self.top_k == 0 and self.top_p == 1.0


def default_sigmoid_range(speech: bool) -> float:
    """Wagner et al.'s |α| = β: 10³ for speech, 10⁴ for text."""
    return 1e3 if speech else 1e4


@dataclass(frozen=True)
class DraftDefaults:
    """The fastest exact draft configuration measured per task (docs/benchmarks.md, "Drafts that pay")."""

    draft_kind: str
    draft_vocab: int
    lookup_ngram: int


# text: the draft's head over the 32,768 first token ids (+ specials and the prompt's tokens): on the 4-bit CPU
# draft the full head is ~4 of its ~22 ms; measured 1.16× → 1.21-1.23× end to end (docs/benchmarks.md). Who
# drafts is priced each iteration: against the draft model alone it measured 1.50 → 1.90×, 1.90 → 2.31× and
# 1.11 → 1.23× greedy on three articles, 1.27 → 1.36×, 1.20 → 1.58× and 1.20 → 1.19× at T = 0.8.
TEXT_DRAFT = DraftDefaults(draft_kind=PRICED, draft_vocab=32768, lookup_ngram=2)
SPEECH_DRAFT = DraftDefaults(draft_kind="model", draft_vocab=0, lookup_ngram=2)


def draft_defaults(speech: bool) -> DraftDefaults:
    return SPEECH_DRAFT if speech else TEXT_DRAFT


@dataclass(frozen=True)
class SpecConfig:
    """Everything that decides one speculative run besides the models and the input."""

    mode: str = "exact"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    gamma_policy: str = "hf"
    gamma_init: int | None = None  # None: the policy's own start (5; 7 for bass)
    max_new_tokens: int = 128
    seed: int = 0
    lenience: float = 1.0
    sigmoid_alpha: float = -1e4
    sigmoid_beta: float = 1e4
    # Stop drafting early when the draft's own probability of its token falls below this (0 = off), as
    # transformers' assistant_confidence_threshold does; γ is then the most the draft may propose.
    draft_confidence: float = 0.0
    # "auto": the CUDA kernels on CUDA tensors, exact's C++ passes on the CPU; "torch": torch only; "cuda": the kernels
    verify_backend: str = "auto"
    # Who drafts: the draft model; prompt lookup alone (no draft model); or prompt lookup where the sequence's
    # last `lookup_ngram` tokens recur earlier, the draft model elsewhere.
    draft_kind: str = "model"
    lookup_ngram: int = 2
    # Tokens the draft model's head scores (the first ids in merge order, plus specials and the prompt's
    # tokens); 0 = the whole vocabulary. q = 0 elsewhere; verification stays exact.
    draft_vocab: int = 0
    # Top tokens of p, q and the residual recorded per examined position for the page's why-panel
    # (specviz.decoding.explain); 0 records none. The clock stops while they are recorded.
    explain_top: int = 20
    # γ of each iteration in order, for gamma_policy "replay": a trace's own schedule (specviz.runs.replay).
    # The cost policy's γ follows measured time, so a seeded run repeats bit for bit only on its schedule.
    gamma_schedule: tuple[int, ...] = ()
    # Who drafted at each iteration of a replayed priced run (one of PRICED_KINDS; "" at a plain step): with
    # draft_kind "priced", the choice follows measured time too.
    drafter_schedule: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.draft_confidence < 1:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {self.draft_confidence}")
        if self.mode not in MODES:
            raise ValueError(f"unknown verification mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"unknown draft kind {self.draft_kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
        if not 1 <= self.lookup_ngram <= 8:
            raise ValueError(f"the prompt-lookup n-gram must be between 1 and 8 tokens, got {self.lookup_ngram}")
        if not 0 <= self.explain_top <= MAX_EXPLAIN_TOP:
            raise ValueError(f"explain_top must be between 0 and {MAX_EXPLAIN_TOP} tokens, got {self.explain_top}")
        if self.draft_vocab < 0:
            raise ValueError(f"the draft vocabulary size must be >= 0 (0: all tokens), got {self.draft_vocab}")
        if self.gamma_policy not in (*GAMMA_POLICIES, REPLAY):
            raise ValueError(
                f"unknown γ policy {self.gamma_policy!r}; choose one of {', '.join(GAMMA_POLICIES)}"
            )
        if (self.gamma_policy == REPLAY) != bool(self.gamma_schedule):
            raise ValueError("a γ schedule goes with the replay policy, and the replay policy needs one")
        if any(not isinstance(g, int) or not 0 <= g <= 64 for g in self.gamma_schedule):
            raise ValueError("a γ schedule holds whole numbers from 0 to 64, one per iteration")
        if self.gamma_policy == REPLAY and self.draft_kind == PRICED and not self.drafter_schedule:
            raise ValueError("a priced run is replayed with its drafter schedule (who drafted at each iteration)")
        if self.drafter_schedule and (
                self.draft_kind != PRICED or len(self.drafter_schedule) != len(self.gamma_schedule)
                or any((k == "") != (g == 0) or k not in ("", *PRICED_KINDS)
                       for k, g in zip(self.drafter_schedule, self.gamma_schedule))):
            raise ValueError("a drafter schedule goes with a priced run's γ schedule: one of "
                             f"{', '.join(PRICED_KINDS)} per iteration that drafted, nothing at a plain step")
        if self.gamma_init is not None and self.gamma_init < 1:
            raise ValueError(f"initial γ must be >= 1, got {self.gamma_init}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 < self.lenience <= 1:
            raise ValueError(f"lenience must be in (0, 1], got {self.lenience}")
        if not self.sigmoid_alpha < self.sigmoid_beta:
            raise ValueError("sigmoid α must be smaller than β")
        if self.verify_backend == "cuda" and self.sampling.greedy and self.mode != "baseline":
            raise ValueError("the CUDA kernels verify sampled runs (temperature > 0); greedy verification "
                             "compares argmaxes on torch: use the verify backend 'auto' or 'torch'")

    def to_dict(self) -> dict:
        """Plain JSON values (the schedule a list), so a trace's config reads back equal."""
        return {**asdict(self), "gamma_schedule": list(self.gamma_schedule),
                "drafter_schedule": list(self.drafter_schedule)}

    @classmethod
    def from_dict(cls, d: dict) -> "SpecConfig":
        d = dict(d)
        d["sampling"] = SamplingConfig(**d.get("sampling", {}))
        d["gamma_schedule"] = tuple(d.get("gamma_schedule", ()))  # a list once it has been JSON
        d["drafter_schedule"] = tuple(d.get("drafter_schedule", ()))
        return cls(**d)
