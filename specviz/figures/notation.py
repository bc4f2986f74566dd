"""The acceptance test in words: the softmax p, q or the sigmoid's p̂, q̂, lenience l, and 'u ≤ a' verdicts.

Shared by the token view's tooltips and the why-panel, so both write a trace's test the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from specviz.decoding.records import Decision
from specviz.traces.trace import Trace, json_number


@dataclass(frozen=True)
class Notation:
    """How this trace's verifier wrote its test: the sigmoid's p̂, q̂ or the softmax p, q, and lenience l."""

    sigmoid: bool
    lenience: float

    @property
    def p(self) -> str:
        return "p̂" if self.sigmoid else "p"

    @property
    def q(self) -> str:
        return "q̂" if self.sigmoid else "q"

    @property
    def ratio(self) -> str:
        if self.lenience == 1:
            return f"{self.p}(x)/{self.q}(x)"
        return f"{self.p}(x)/(l·{self.q}(x))"

    @property
    def residual(self) -> str:
        return f"max(0, {self.p} − {'l·' if self.lenience != 1 else ''}{self.q})"


def notation(trace: Trace) -> Notation:
    """How this trace's verifier wrote its test, from its recorded mode, sampling and lenience."""
    # Greedy sigmoid compares one-hot argmaxes like exact, so only sampled sigmoid runs record p̂ and q̂.
    sigmoid = trace.mode == "sigmoid" and trace.temperature != 0
    lenience = json_number(trace.config.get("lenience"))
    return Notation(sigmoid, lenience if lenience is not None and 0 < lenience <= 1 else 1.0)


def _pair(u: float, a: float) -> tuple[str, str]:
    """u and a with enough decimals that the printed values order as the numbers do."""
    for digits in range(2, 7):
        us, as_ = f"{u:.{digits}f}", f"{a:.{digits}f}"
        if (us == as_) == (u == a):
            break
    return us, as_


def verdict(u: float, a: float, outcome: str, n: Notation) -> str:
    """'u = 0.51 > p(x)/q(x) = 0.16: rejected' (u ≤ a accepts; a = min(1, ratio), so a < 1 shows the ratio)."""
    us, as_ = _pair(u, a)
    test = f"min(1, {n.ratio})" if u <= a else n.ratio
    return f"u = {us} {'≤' if u <= a else '>'} {test} = {as_}: {outcome}"


def passes_own_test(d: Decision, k: int) -> bool:
    """Draft k's own test, u ≤ accept prob (what a discarded draft would have got had it been examined)."""
    return d.uniform[k] <= d.accept_prob[k]
