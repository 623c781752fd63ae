//! vLLM `sha256_cbor` block-hash parity. (Being written.)
