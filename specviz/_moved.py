"""Old module paths, from before specviz had subpackages, kept importable: `import specviz.engine` gives
the module object `specviz.decoding.engine` itself (not a copy), so patches and isinstance checks agree.
Where an old module's name is now a package's (`specviz.models`, `specviz.runs`, …), the package forwards
the old module's names (`specviz.models.load_pair` is `specviz.models.loading.load_pair`) through `forward`.

New code imports the new paths; this table is the record of what moved where (README, "Layout").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED: dict[str, str] = {
    "asr": "speech.asr",
    "audio": "speech.audio",
    "bench": "bench.measure",
    "bench_drafts": "bench.drafts",
    "bench_models": "bench.steps",
    "cli": "cli.commands",
    "cli_bench": "cli.bench",
    "cli_common": "cli.common",
    "cli_eval": "cli.evaluate",
    "clock": "decoding.clock",
    "compare": "runs.compare",
    "cost": "decoding.cost",
    "cpu_attention": "models.cpu_attention",
    "cpu_kernels": "models.cpu_kernels",
    "ct2_format": "speech.ct2_format",
    "decoder": "decoding.decoder",
    "drafts": "decoding.drafts",
    "engine": "decoding.engine",
    "eval_data": "evaluation.data",
    "eval_datasets": "evaluation.datasets",
    "eval_figures": "evaluation.figures",
    "eval_ray": "evaluation.on_ray",
    "eval_results": "evaluation.results",
    "eval_run": "evaluation.run",
    "explain": "decoding.explain",
    "figures": "figures.plots",
    "gamma": "decoding.gamma",
    "gguf_pack": "models.gguf_pack",
    "handlers": "page.handlers",
    "hub": "models.hub",
    "models": "models.loading",
    "notation": "figures.notation",
    "packed": "models.packed",
    "page": "page.actions",
    "prediction": "traces.prediction",
    "prompt_cache": "models.prompt_cache",
    "prompts": "text.prompts",
    "proposers": "decoding.proposers",
    "quant": "models.quant",
    "records": "decoding.records",
    "report": "figures.report",
    "runs": "runs.decode",
    "sessions": "page.sessions",
    "settings": "runs.settings",
    "shelf": "page.shelf",
    "source": "decoding.source",
    "sweep": "evaluation.sweep",
    "text": "text.source",
    "token_view": "figures.token_view",
    "trace": "traces.trace",
    "trace_json": "traces.json_format",
    "whisper_ct2": "speech.whisper_ct2",
    "whisper_loader": "speech.whisper_loader",
    "whisper_tokenizer": "speech.whisper_tokenizer",
    "why_panel": "figures.why_panel",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `specviz.<old>` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("specviz.")
        if fullname.startswith("specviz.") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module("specviz." + MOVED[spec.name.removeprefix("specviz.")])

    def exec_module(self, module) -> None:
        pass  # the new module ran when it was imported


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())


def forward(package: str, name: str) -> object:
    """`name` from the module that `package` was before it became a package (for its `__getattr__`)."""
    # Dunder names are introspection's (copy, pickle, inspect); a submodule's name is the import system asking
    # before it loads that submodule: neither is the old module's.
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module("specviz." + MOVED[package.removeprefix("specviz.")])
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
