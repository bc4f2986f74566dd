"""specviz: speculative decoding you can watch.

models → decoding → traces → runs → figures → page / cli, one way (tests/test_layout.py checks it).
`verify` is the public verification interface; `runs.run.run` decodes a source (text or speech, one
sequence or a batch) into a trace. Module paths from before the subpackages (`specviz.engine`,
`specviz.trace`, …) still import, as the same module objects (specviz._moved).
"""

from specviz import _moved
from specviz.config import SamplingConfig, SpecConfig
from specviz.verify import VerifyResult, verify

_moved.install()

__all__ = ["SamplingConfig", "SpecConfig", "VerifyResult", "verify"]
