"""specdecode: lossless, measured speculative decoding.

    import specdecode

    sd = specdecode.load(drafter="ngram+w4a16")
    print(sd.generate("Name three colours.", chat=True).text)
"""

from specdecode.api import GenerateResult, Specdecode, load
from specdecode.errors import SpecDecodeError
from specdecode.version import __version__

__all__ = ["GenerateResult", "SpecDecodeError", "Specdecode", "__version__", "load"]
