//! KV-cache event batches as vLLM, SGLang and LMCache publish them
//! (see `docs/kv-events.md`). Decoding never panics and never allocates more
//! than the input can justify.

mod decode;
mod flat;
mod reader;
mod types;

#[cfg(test)]
mod tests;

pub use decode::{decode_batch, decode_batch_into, DecodeError};
pub use flat::{BatchHeader, EventRef, FlatEvent, FlatEvents, FlatStored, RemovedRef, StoredRef};
pub use reader::MAX_DEPTH;
pub use types::{
    BlockRemoved, BlockStored, EngineHash, Event, EventBatch, ExtraKey, Medium, StoredIdentity,
    KNOWN_MEDIA, MAX_CUSTOM_MEDIA, MAX_MEDIUM_NAME_BYTES, OTHER_MEDIUM,
};
