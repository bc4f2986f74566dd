"""specviz: speculative decoding you can watch.

models → engine → records → trace → figures → page. `verify` is the public verification interface;
`runs.run` decodes a source (text or speech, one sequence or a batch) into a trace.
"""

from .config import SamplingConfig, SpecConfig
from .verify import VerifyResult, verify

__all__ = ["SamplingConfig", "SpecConfig", "VerifyResult", "verify"]
