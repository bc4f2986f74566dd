"""Settings shared by the engine, the verifier, the CLI and the page."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MODES = ("baseline", "exact", "sigmoid")
GAMMA_POLICIES = ("constant", "hf", "bass", "optimal")


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
    verify_backend: str = "auto"  # "torch" forces the torch path where the CUDA kernels would run

    def __post_init__(self) -> None:
        if not 0 <= self.draft_confidence < 1:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {self.draft_confidence}")
        if self.mode not in MODES:
            raise ValueError(f"unknown verification mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.gamma_policy not in GAMMA_POLICIES:
            raise ValueError(
                f"unknown γ policy {self.gamma_policy!r}; choose one of {', '.join(GAMMA_POLICIES)}"
            )
        if self.gamma_init is not None and self.gamma_init < 1:
            raise ValueError(f"initial γ must be >= 1, got {self.gamma_init}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 < self.lenience <= 1:
            raise ValueError(f"lenience must be in (0, 1], got {self.lenience}")
        if not self.sigmoid_alpha < self.sigmoid_beta:
            raise ValueError("sigmoid α must be smaller than β")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SpecConfig":
        d = dict(d)
        d["sampling"] = SamplingConfig(**d.get("sampling", {}))
        return cls(**d)
