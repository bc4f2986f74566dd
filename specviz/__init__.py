"""specviz: speculative decoding you can watch.

models → engine → trace → figures → page. `verify` is the public verification interface.
"""

from .config import SamplingConfig, SpecConfig
from .verify import VerifyResult, verify

__all__ = ["SamplingConfig", "SpecConfig", "VerifyResult", "verify"]
