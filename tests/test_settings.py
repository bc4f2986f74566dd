"""One declaration of every setting: the page's controls, the CLI's flags and a trace's restore agree with it,
and "auto" resolves the same way from the page and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import random

import gradio as gr
import pytest

from specviz.page import app
from specviz.cli import commands as cli
from specviz.runs import settings
from specviz.config import SamplingConfig, SpecConfig
from specviz.runs.settings import SPEECH, TEXT, Settings, SettingError


def _page_controls() -> dict[str, gr.components.Component]:
    with gr.Blocks():
        components = app.layout()
    return {name: components[name] for name in settings.page_names()}


def test_every_page_control_is_its_declaration():
    controls = _page_controls()
    assert set(controls) == {n for n in settings.FIELDS if settings.declaration(n).control != "none"}
    for name, component in controls.items():
        s = settings.declaration(name)
        default = settings.FIELDS[name].default
        assert component.elem_id == settings.elem_id(name)
        assert component.label == s.label
        assert component.value == default, name
        if s.choices:
            assert [tuple(c) for c in component.choices] == [(label, value) for label, value in s.choices], name
        if s.control == "slider":
            assert (component.minimum, component.maximum) == (s.page_range or (s.low, s.high)), name


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


@pytest.mark.parametrize("command", ["generate", "transcribe", "compare", "bench-batch", "bench-drafts"])
def test_every_cli_flag_is_its_declaration(command):
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = _actions(sub.choices[command])
    declared = [n for n in settings.FIELDS if settings.declaration(n).flag is not None]
    for name in declared:
        s = settings.declaration(name)
        if name not in actions:
            # only what a command cannot use is missing: several sequences of an audio clip, one mode in compare
            assert (name, command) in {("sequences", "transcribe"), ("mode", "compare"), ("mode", "bench-drafts")}
            continue
        action = actions[name]
        expected_default = settings.FIELDS[name].default if s.cli_default is settings._SAME else s.cli_default
        assert action.default == expected_default, name
        assert (s.flag or "--" + name.replace("_", "-")) in action.option_strings
        if s.choices and name != "draft_vocab":
            assert tuple(action.choices) == s.values


def test_settings_cover_every_user_facing_config_field():
    resolved = {f.name for f in dataclasses.fields(SpecConfig)} - {"sampling", "explain_top", "gamma_schedule",
                                                                    "drafter_schedule"}
    assert resolved <= set(settings.FIELDS)
    assert {"temperature", "top_k", "top_p", "decoding"} <= set(settings.FIELDS)  # what `sampling` is made of


def test_cli_defaults_resolve_as_documented():
    args = cli.build_parser().parse_args(["generate"])
    text = Settings.from_args(args).spec(TEXT)
    assert text == SpecConfig(mode="exact", sampling=SamplingConfig(), gamma_policy="cost", gamma_init=None,
                              max_new_tokens=128, seed=0, lenience=1.0, draft_confidence=0.0,
                              sigmoid_alpha=-1e4, sigmoid_beta=1e4, draft_kind="priced", lookup_ngram=2, draft_vocab=32768)
    speech = Settings.from_args(cli.build_parser().parse_args(["transcribe", "x.wav"])).spec(SPEECH)
    assert (speech.sigmoid_alpha, speech.sigmoid_beta, speech.gamma_policy) == (-1e3, 1e3, "cost")


def test_page_and_cli_resolve_the_same_settings_to_the_same_config():
    args = cli.build_parser().parse_args(
        ["generate", "--temperature", "0.7", "--top-k", "40", "--seed", "9", "--gamma-policy", "cost", "--gamma", "3",
         "--draft-vocab", "4096", "--draft-kind", "lookup+model", "--lookup-ngram", "3", "--sigmoid-alpha", "-50",
         "--max-new-tokens", "64", "--mode", "sigmoid"])
    from_cli = Settings.from_args(args)
    page_values = {name: getattr(from_cli, name) for name in settings.page_names()}
    # what Gradio hands the page's handlers: floats from Number boxes, an empty box for "auto"
    page_values.update(top_k=40.0, seed=9.0, gamma_init=3.0, sigmoid_beta=None)
    from_page = Settings.from_values(page_values)
    assert from_page.spec(TEXT) == from_cli.spec(TEXT)
    cfg = from_page.spec(TEXT)
    assert (cfg.sampling, cfg.gamma_policy, cfg.gamma_init, cfg.draft_vocab, cfg.lookup_ngram) == (
        SamplingConfig(0.7, 40, 1.0), "cost", 3, 4096, 3)
    assert (cfg.sigmoid_alpha, cfg.sigmoid_beta, cfg.mode) == (-50, 1e4, "sigmoid")


def test_greedy_on_the_page_ignores_its_temperature():
    cfg = Settings(decoding="greedy", temperature=1.5).spec(TEXT)
    assert cfg.sampling.greedy


@pytest.mark.parametrize("name, raw, message", [
    ("mode", "fastest", "mode: 'fastest' is not a choice"),
    ("temperature", 11.0, "temperature: 11.0 is outside 0 to 10"),
    ("top_k", 2.5, "top_k: 2.5 is not an integer"),
    ("seed", "soon", "seed: 'soon' is not a number"),
    ("draft_vocab", "-3", "draft_vocab: '-3' is not a choice; choose auto or a token count"),
    ("gamma_init", 65, "gamma_init: 65 is outside 0 to 64"),
    ("top_p", float("nan"), "top_p: nan is outside"),
    ("sequences", 0, "sequences: 0 is outside 1 to 64"),
])
def test_a_value_a_setting_cannot_hold_is_refused_by_name(name, raw, message):
    with pytest.raises(SettingError, match=message):
        Settings.from_values({name: raw})


def test_the_cli_reports_a_bad_setting_and_exits_2(capsys):
    assert cli.main(["generate", "--draft-vocab", "lots"]) == 2
    assert "draft_vocab: 'lots' is not a choice" in capsys.readouterr().err


def test_empty_boxes_mean_the_default():
    assert Settings.from_values({"seed": None, "draft": "  ", "sigmoid_alpha": 0, "top_k": ""}) == Settings()


def test_random_page_settings_survive_a_trace_round_trip():
    rng = random.Random(0)
    for _ in range(200):
        values = {}
        for name in settings.page_names():
            s = settings.declaration(name)
            default = settings.FIELDS[name].default
            if s.choices:
                values[name] = rng.choice(s.values)
            elif isinstance(default, str):
                values[name] = rng.choice(["default", "Qwen/Qwen2.5-0.5B-Instruct", "/models/draft"])
            elif s.page_range or s.low is not None:
                low, high = s.page_range or (s.low, s.high)
                if isinstance(default, int):
                    values[name] = rng.randint(int(low), min(int(high), 10 ** 6))
                else:
                    values[name] = rng.uniform(low, high)
        chosen = Settings.from_values(values)
        assert Settings.from_meta({"page_settings": chosen.to_dict()}) == chosen
