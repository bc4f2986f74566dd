"""A seeded sampled run decodes again bit for bit on its own γ schedule, whatever the machine's measured costs
say: the cost policy (the default) picks γ from measured time, so only the schedule in the trace repeats it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specviz.config import SamplingConfig, SpecConfig
from specviz.decoding import engine
from specviz.decoding.cost import CostModel
from specviz.runs.replay import Schedule, replaying, rerun_request, schedule, schedule_file
from specviz.runs.settings import Settings
from specviz.text.prompts import InputError

from conftest import decode

# explain_top=0: the why-panel's distributions are not what is under test, and recording them is most of the time
SAMPLED = SpecConfig(mode="exact", sampling=SamplingConfig(temperature=0.8), gamma_policy="cost", max_new_tokens=24,
                     seed=11, explain_top=0)


def _table(draft_s: float, target_s: float):
    """A calibration that writes a fixed cost table instead of timing calls (another machine's, in effect)."""
    def calibrate(costs: CostModel, identity, batch, target_step, draft_step, plain_step) -> None:
        for m in (1, 2, 3, 4, 6, 8, 12, 16):
            costs.set_target(batch, m, target_s * (1 + 0.1 * (m - 1)))
        costs.set_plain(batch, target_s)
        costs.set_draft(batch, draft_s)
    return calibrate


def _decisions(trace) -> list[tuple]:
    return [(d.step, d.sequence, d.draft_ids, d.uniform, d.outcome, d.next_id) for s in trace.sequences
            for d in s.decisions]


def test_a_sampled_cost_run_repeats_on_its_schedule_under_another_cost_table(tiny_pair, prompt_ids, monkeypatch):
    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.001, target_s=0.01))  # drafting is cheap here
    original = decode(tiny_pair, [prompt_ids], SAMPLED)
    gammas = schedule(original)
    assert len(set(gammas.gammas)) > 1 or gammas.gammas[0] > 0, gammas  # the policy drafted

    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.05, target_s=0.01))  # and dear on "another machine"
    again = decode(tiny_pair, [prompt_ids], replaying(SAMPLED, gammas))
    assert again.config["gamma_policy"] == "replay" and tuple(again.config["gamma_schedule"]) == gammas.gammas
    assert schedule(again) == gammas
    assert again.outputs == original.outputs
    assert _decisions(again) == _decisions(original)

    # the schedule is what repeats it: the same seed on another schedule draws and decides otherwise
    other = Schedule(tuple(min(8, g + 1) for g in gammas.gammas))
    moved = decode(tiny_pair, [prompt_ids], replaying(SAMPLED, other))
    assert _decisions(moved) != _decisions(original)


def test_replay_in_a_batch_and_from_a_trace_file(tiny_pair, batch_prompts, tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.001, target_s=0.01))
    cfg = dataclasses.replace(SAMPLED, max_new_tokens=12)
    original = decode(tiny_pair, batch_prompts, cfg)
    path = tmp_path / "run.json"
    original.save(path)
    gammas = schedule_file(path)
    assert gammas == schedule(original)
    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.2, target_s=0.01))
    again = decode(tiny_pair, batch_prompts, replaying(cfg, gammas))
    assert again.outputs == original.outputs and _decisions(again) == _decisions(original)
    assert json.loads(path.read_text())["meta"]["config"]["gamma_policy"] == "cost"


def test_what_cannot_be_replayed_is_refused(tiny_pair, prompt_ids, tmp_path):
    target_only = decode(tiny_pair, [prompt_ids], SAMPLED, target_only=True)
    with pytest.raises(InputError, match="no speculative iterations"):
        schedule(target_only)
    with pytest.raises(InputError, match="no such trace file"):
        schedule_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="schedule"):
        SpecConfig(gamma_policy="replay")
    with pytest.raises(ValueError, match="schedule"):
        SpecConfig(gamma_policy="cost", gamma_schedule=(1, 2))
    speculative = decode(tiny_pair, [prompt_ids], dataclasses.replace(SAMPLED, max_new_tokens=8))
    with pytest.raises(InputError, match="holds its input"):
        rerun_request(speculative)  # decoded from raw ids: no article in the trace
    settings, article, gammas = rerun_request(dataclasses.replace(
        speculative, meta={**speculative.meta, "task": "summarize", "input": "an article",
                           "page_settings": Settings(max_new_tokens=8).to_dict()}))
    assert (settings.max_new_tokens, article, gammas) == (8, "an article", schedule(speculative))


def test_a_priced_run_repeats_who_drafted_under_another_cost_table(tiny_pair, monkeypatch):
    """Draft kind "priced": the cost policy chose lookup, the model or both at each iteration from measured
    time; the trace's schedule carries those choices and the run repeats decision for decision."""
    prompts = [[5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9], [3, 4, 8, 3, 4, 8, 3, 4]]
    cfg = dataclasses.replace(SAMPLED, draft_kind="priced", max_new_tokens=20)
    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.004, target_s=0.01))
    original = decode(tiny_pair, prompts, cfg)
    plan = schedule(original)
    assert len(plan.drafters) == len(plan.gammas) == len(original.steps)
    assert {"lookup", "model"} & set(plan.drafters), plan  # it drafted, by more than plain steps

    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.05, target_s=0.01))
    again = decode(tiny_pair, prompts, replaying(cfg, plan))
    assert again.config["drafter_schedule"] == list(plan.drafters)
    assert again.outputs == original.outputs and _decisions(again) == _decisions(original)
    assert [d.drafter for d in again.decisions()] == [d.drafter for d in original.decisions()]
    with pytest.raises(ValueError, match="drafter schedule"):
        SpecConfig(draft_kind="model", gamma_policy="replay", gamma_schedule=(1,), drafter_schedule=("lookup",))


def test_a_trace_replays_with_its_own_draft_kind_whatever_the_defaults_are_now(tiny_pair, prompt_ids, monkeypatch):
    """A trace made when the draft model drafted every iteration replays as such under a priced default."""
    monkeypatch.setattr(engine, "calibrate", _table(draft_s=0.001, target_s=0.01))
    original = decode(tiny_pair, [prompt_ids], dataclasses.replace(SAMPLED, draft_kind="model"))
    plan = schedule(original)
    assert plan.draft_kind == "model" and plan.drafters == ()
    again = decode(tiny_pair, [prompt_ids], replaying(dataclasses.replace(SAMPLED, draft_kind="priced"), plan))
    assert again.config["draft_kind"] == "model" and _decisions(again) == _decisions(original)


def test_a_drafter_schedule_must_fit_its_gamma_schedule():
    base = dict(draft_kind="priced", gamma_policy="replay", gamma_schedule=(2, 0))
    SpecConfig(**base, drafter_schedule=("lookup", ""))
    for bad in (("", ""), ("lookup", "model"), ("lookup",), ("ngram", "")):
        with pytest.raises(ValueError, match="drafter schedule"):
            SpecConfig(**base, drafter_schedule=bad)
    with pytest.raises(ValueError, match="replayed with its drafter schedule"):
        SpecConfig(**base)
