"""specviz: speculative decoding you can watch.

models → decoding → traces → runs → figures → page / cli, one way (tests/test_layout.py checks it).
`verify` is the public verification interface; `runs.decode.run` decodes a source (text or speech, one
sequence or a batch) into a trace. Every module is imported by its one path (`specviz.decoding.engine`,
`specviz.traces.trace`, …); the packages' docstrings say what each holds.
"""

from specviz.config import SamplingConfig, SpecConfig
from specviz.verify import VerifyResult, verify

__all__ = ["SamplingConfig", "SpecConfig", "VerifyResult", "verify"]
