"""Token ids of a request, in one package for every part that needs them.

`local`: tokenizers that run in this process (the engine simulator's byte tokenizer, a
Hugging Face tokenizer.json with its chat template), used by the engine simulator and
by a gateway configured to tokenize itself. `request`: how the gateway gets a request's
token ids, locally or from an engine's `/tokenize`, with its typed errors.
"""

from quillcache.tokenization.local import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from quillcache.tokenization.request import (
    EngineUnreachable,
    RequestTokenizer,
    TokenizationError,
)

__all__ = [
    "ByteTokenizer",
    "EngineUnreachable",
    "HFTokenizer",
    "RequestTokenizer",
    "TokenizationError",
    "Tokenizer",
    "load_tokenizer",
]
