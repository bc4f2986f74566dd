"""bench-steps' measurement (specviz/bench/steps.py) on a tiny model: what a call is timed over, the bytes and
multiply-adds a step is credited with, and a reduced draft head counted as a run's draft scores it."""

import pytest
import torch

from specviz.bench import steps
from specviz.bench.steps import linear_params, step_costs, weight_bytes
from specviz.decoding.drafts import subset_head
from specviz.models import cpu_kernels, lean
from specviz.models.quant import quantize_draft_q4

from conftest import tiny_qwen


@pytest.fixture(scope="module")
def tiny_4bit():
    if not cpu_kernels.available() or not cpu_kernels.has_int8_activations():
        pytest.skip("the 4-bit draft needs the AVX2 build of the CPU kernels")
    return lean.attach(quantize_draft_q4(tiny_qwen(3, vocab_size=512)))


def test_steps_are_timed_per_token_count_and_leave_the_cache_as_they_found_it(tiny_4bit):
    prompt = list(range(5, 45))
    costs = step_costs(tiny_4bit, 512, prompt, [1, 2, 4], repeat=2, warmup=1)
    assert costs["prompt_tokens"] == 40 and costs["prefill_s"] > 0
    assert [s["tokens"] for s in costs["steps"]] == [1, 2, 4]
    assert costs["steps"][0]["ratio"] == 1.0
    for s in costs["steps"]:
        assert s["seconds"] > 0 and 0 < s["linear_share"] <= 1
        assert s["ratio"] == pytest.approx(s["seconds"] / costs["steps"][0]["seconds"])


def test_a_reduced_head_is_credited_with_its_rows_only(tiny_4bit, monkeypatch):
    head = subset_head(tiny_4bit, 512, 64, {511, 300})  # the first 64 ids, EOS and one more
    assert head.size == 66
    full = tiny_4bit.get_output_embeddings()
    assert weight_bytes(tiny_4bit, head) == weight_bytes(tiny_4bit) - full.nbytes + head.linear.nbytes
    assert head.linear.nbytes < full.nbytes
    assert linear_params(tiny_4bit, head) == linear_params(tiny_4bit) - 64 * (512 - 66)
    scored = []  # and it is the head the steps are timed through (the 32K row once timed the full head)
    counting = type(head).__call__
    head.__class__ = type("CountingHead", (type(head),),
                          {"__call__": lambda self, hidden: scored.append(hidden.shape) or counting(self, hidden)})
    timed = []  # its matmul counted inside the linear layers, not as "other" (it sits outside the model)
    real_linear_time = steps.linear_time
    monkeypatch.setattr(steps, "linear_time", lambda model, extra=(): timed.append(list(extra))
                        or real_linear_time(model, extra))
    costs = step_costs(tiny_4bit, 512, list(range(5, 45)), [1, 3], repeat=2, warmup=1, head=head)
    assert [s["tokens"] for s in costs["steps"]] == [1, 3]
    assert scored and {shape[1] for shape in scored} >= {1, 3}
    assert timed == [[head.linear]] * 2


def test_dense_weights_count_their_own_bytes():
    model = tiny_qwen(4, vocab_size=256)
    expected = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert weight_bytes(model) == expected
    assert linear_params(model) == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_kernel_variant_takes_turns_with_the_project_library(tmp_path):
    """kernel_ab's ground: a copy of kernels/cpu/ loads as a library of its own declarations (here unchanged, so
    the cached build), `using` routes every kernel call in its block there and back after (after an error too),
    and `alternate` times each (library, tokens) once a round, the libraries' order flipping round by round."""
    import shutil

    from specviz import native
    from specviz.bench.kernel_ab import WARMUP_ROUNDS, alternate

    if not cpu_kernels.available():
        pytest.skip("the CPU kernels do not build here")
    shutil.copytree(native.SOURCES[0].parent, tmp_path / "cpu")
    own = native.library()
    variant = native.load_variant(tmp_path / "cpu")
    assert variant.specviz_max_rows() == native.max_rows() and variant is not own
    with pytest.raises(RuntimeError, match="inside"):
        with native.using(variant):
            assert native.library() is variant and cpu_kernels.library() is variant
            raise RuntimeError("inside")
    assert native.library() is own
    seen = []
    ms = alternate({"project": own, "variant": variant}, lambda m: seen.append((native.library(), m)), [1, 4], 3)
    assert set(ms) == {"project", "variant"} and all(set(v) == {1, 4} and min(v.values()) >= 0 for v in ms.values())
    names = {id(own): "project", id(variant): "variant"}
    order = [(names[id(lib)], m) for lib, m in seen]
    assert len(order) == 2 * 2 * (WARMUP_ROUNDS + 3)
    assert order[:4] == [("project", 1), ("variant", 1), ("project", 4), ("variant", 4)]
    assert order[4:8] == [("variant", 1), ("project", 1), ("variant", 4), ("project", 4)]
    (tmp_path / "cpu" / "qmatmul_cpu.cpp").write_text("this does not compile")
    with pytest.raises(native.KernelBuildError):
        native.load_variant(tmp_path / "cpu")
    assert native.library() is own


def test_the_read_ceiling_is_measured_on_the_pages_the_weights_live_on(monkeypatch):
    """The roofline's bandwidth reads 2 MB-page memory, as the packed weights are placed (models/arena.py), and is
    a rate a memory system can give: above a slow disk's, below any DRAM's."""
    from specviz.bench import roofline

    placed, real = [], roofline.arena.huge_page_bytes
    monkeypatch.setattr(roofline.arena, "huge_page_bytes", lambda nbytes: placed.append(nbytes) or real(nbytes))
    rate = roofline.read_bandwidth(gib=0.25, repeat=3)
    assert placed == [2**28]
    assert 1e9 < rate < 2e12
