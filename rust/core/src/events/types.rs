//! Decoded event types. Field names follow vLLM's `kv_events.py` so that the
//! wire format stays visible in the type definitions.

/// An engine's block hash, reduced to 64 bits.
///
/// vLLM sends a uint64 (the last 8 bytes, big-endian, of the digest) or, with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, the raw digest as bytes; SGLang sends a
/// signed int64. All three become the same `u64`: ints by their two's-complement
/// bits, digests by their last 8 bytes big-endian (exactly what vLLM's int mode
/// sends), so a consumer sees one value whichever mode the engine runs in.
/// QuillCache treats it as an opaque id, never as content.
pub type EngineHash = u64;

/// Where a block lives. The common names are interned; anything else is kept.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    Cpu,
    Disk,
    Other(String),
}

impl Medium {
    /// Parses an engine's medium string. `None` (not sent) means GPU, as in vLLM.
    pub fn parse(s: Option<&str>) -> Medium {
        match s {
            None => Medium::Gpu,
            // Case-insensitive without building an uppercase copy (one per event).
            Some(s) => {
                let is = |name: &str| s.eq_ignore_ascii_case(name);
                if is("GPU") {
                    Medium::Gpu
                } else if is("CPU") || is("CPU_PINNED") {
                    Medium::Cpu
                } else if is("DISK") || is("STORAGE") {
                    Medium::Disk
                } else {
                    Medium::Other(s.to_string())
                }
            }
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Disk => "DISK",
            Medium::Other(s) => s,
        }
    }
}

/// One element of a block's `extra_keys` as vLLM publishes them (untagged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string: the LoRA name, or the cache salt (block 0 only).
    Str(String),
    /// A multimodal item: `[mm_hash, offset_in_block]`.
    Mm { hash: String, offset: i64 },
    /// Anything else we do not interpret, kept as raw msgpack bytes.
    Raw(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    pub lora_name: Option<String>,
    /// One entry per block (None = no extra keys for that block), or empty if not sent.
    pub extra_keys: Vec<Option<Vec<ExtraKey>>>,
    pub group_idx: u32,
    /// SGLang sends the salt as its own field; vLLM puts it in block 0's extra keys.
    pub cache_salt: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    pub medium: Medium,
    pub group_idx: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<Event>,
    pub dp_rank: Option<i64>,
}
