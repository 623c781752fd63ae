//! Decoded event types. Field names follow vLLM's `kv_events.py` so that the
//! wire format stays visible in the type definitions.

use crate::content_key::MmItem;
use crate::namespace::Namespace;

/// An engine's block hash, reduced to 64 bits.
///
/// vLLM sends a uint64 (the last 8 bytes, big-endian, of the digest) or, with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, the raw digest as bytes; SGLang sends a
/// signed int64. All three become the same `u64`: ints by their two's-complement
/// bits, digests by their last 8 bytes big-endian (exactly what vLLM's int mode
/// sends), so a consumer sees one value whichever mode the engine runs in.
/// QuillCache treats it as an opaque id, never as content.
pub type EngineHash = u64;

/// A medium name longer than this is not kept: it becomes [`OTHER_MEDIUM`] (a name is
/// a tier's label; every engine's fits in a few bytes).
pub const MAX_MEDIUM_NAME_BYTES: usize = 64;

/// How many distinct unknown medium names (beyond GPU/CPU/DISK and [`KNOWN_MEDIA`]) an
/// index keeps; later ones become [`OTHER_MEDIUM`]. Names are kept for good (holder
/// ids carry a medium index), so without a bound a publisher inventing names grows the
/// index without limit.
pub const MAX_CUSTOM_MEDIA: usize = 16;

/// The one tier every name beyond the limits maps to (counted: `media_folded`).
pub const OTHER_MEDIUM: &str = "OTHER";

/// Names always kept as sent, whatever the limits (compared case-insensitively):
/// vLLM's and SGLang's tiers not already folded into GPU/CPU/DISK, the fold target
/// itself, and LMCache's storage locations: the names its `CreateStorageBackends`
/// (`lmcache/v1/storage_backend/__init__.py`) gives the backends, which LMCache uses as
/// a block's location.
pub const KNOWN_MEDIA: &[&str] = &[
    "EXTERNAL",
    OTHER_MEDIUM,
    "LocalCPUBackend",
    "LocalDiskBackend",
    "RemoteBackend",
    "GdsBackend",
    "WekaGdsBackend",
    "NixlBackend",
    "NixlStorageBackend",
];

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

    /// [`OTHER_MEDIUM`], where names beyond the limits go.
    pub fn other() -> Medium {
        Medium::Other(OTHER_MEDIUM.to_owned())
    }

    /// GPU, CPU, DISK or one of [`KNOWN_MEDIA`]: kept whatever the limits.
    pub fn is_known(&self) -> bool {
        match self {
            Medium::Other(s) => KNOWN_MEDIA.iter().any(|k| s.eq_ignore_ascii_case(k)),
            _ => true,
        }
    }

    /// Whether the name is short enough to be kept ([`MAX_MEDIUM_NAME_BYTES`]).
    pub fn fits(&self) -> bool {
        self.as_str().len() <= MAX_MEDIUM_NAME_BYTES
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

/// What a BlockStored says about the identity of its blocks beyond its source's model
/// and tokenizer (`docs/index.md`): the LoRA and tenant of its namespace, and each
/// block's multimodal items. Written once, over borrowed pieces, so that the in-memory
/// index, the key-value index and (through the binding) the Python reference index all
/// read an event the same way.
#[derive(Debug, Clone, Copy)]
pub struct StoredIdentity<'a> {
    pub cache_salt: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub extra_keys: &'a [Option<Vec<ExtraKey>>],
}

impl<'a> StoredIdentity<'a> {
    /// The namespace's LoRA: the event's LoRA name, "" without one.
    pub fn lora(&self) -> &'a str {
        self.lora_name.unwrap_or_default()
    }

    /// The namespace's tenant: the `cache_salt` field (SGLang), else vLLM's salt, the
    /// first string in block 0's extra keys that is not the LoRA name (vLLM publishes
    /// it untagged); "" without either.
    pub fn tenant(&self) -> &'a str {
        self.cache_salt
            .or_else(|| {
                let first = self.extra_keys.first()?.as_ref()?;
                first.iter().find_map(|k| match k {
                    ExtraKey::Str(s) if Some(s.as_str()) != self.lora_name => Some(s.as_str()),
                    _ => None,
                })
            })
            .unwrap_or_default()
    }

    /// The multimodal items of block `block`, in the engine's order; None if it has
    /// none (a block without extra keys, or whose keys hold no item).
    pub fn mm_items(&self, block: usize) -> Option<Vec<MmItem>> {
        let keys = self.extra_keys.get(block)?.as_ref()?;
        let items: Vec<MmItem> = keys
            .iter()
            .filter_map(|k| match k {
                ExtraKey::Mm { hash, offset } => Some((hash.clone(), *offset)),
                _ => None,
            })
            .collect();
        (!items.is_empty()).then_some(items)
    }

    /// The namespace of the event's blocks, on its source's `model` and `tokenizer`.
    pub fn namespace(&self, model: String, tokenizer: String, block_size: u32) -> Namespace {
        Namespace {
            model,
            tokenizer,
            lora: self.lora().to_owned(),
            tenant: self.tenant().to_owned(),
            block_size,
            extra: vec![],
        }
    }
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
