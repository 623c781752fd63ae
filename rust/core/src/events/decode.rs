//! msgpack → [`EventBatch`], for every wire shape in `docs/kv-events.md`.
//!
//! The grammar (mirrored by the Python reference `quillcache/events/pyref.py`):
//! a batch is `[ts, events, dp_rank?]`; an event is a map with a `"type"` key
//! (vLLM >= 0.24, SGLang >= 0.5.20) or an array `[type, field, ...]` (vLLM <= 0.23,
//! SGLang <= 0.5.19, whose salted stores put a metadata map at `lora_name`). Known
//! field names are validated whatever the event type; unknown keys and trailing
//! positional fields are skipped (depth-bounded). Duplicate keys: the last one wins.

use std::cell::RefCell;
use std::ops::Range;

use super::flat::{BatchHeader, FlatEvent, FlatEvents, FlatStored};
use super::reader::{Path, Reader, WireInt};
use super::types::{EngineHash, EventBatch, ExtraKey, Medium};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} (at byte {offset})")]
pub struct DecodeError {
    /// What was wrong, prefixed with where: `batch.ts: ...`, `events[2].token_ids[5]: ...`.
    pub message: String,
    /// Byte offset in the payload of the offending value.
    pub offset: usize,
}

const I64_MIN: WireInt = i64::MIN as WireInt;
const I64_MAX: WireInt = i64::MAX as WireInt;
const U32_MAX: WireInt = u32::MAX as WireInt;

/// Depths of the values we read (the batch array is depth 1).
const FIELD_DEPTH: usize = 4; // batch > events > event > field value
const EXTRA_ITEM_DEPTH: usize = 6; // ... > extra_keys > one block's keys > item

/// Field order of the positional (vLLM <= 0.23, SGLang <= 0.5.19) forms, and how many are required.
const STORED_POSITIONAL: [&str; 16] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "cache_salt",
];
const REMOVED_POSITIONAL: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn parse(name: &str) -> Option<Kind> {
        Self::parse_bytes(name.as_bytes())
    }

    fn parse_bytes(name: &[u8]) -> Option<Kind> {
        match name {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Stored => "BlockStored",
            Kind::Removed => "BlockRemoved",
            Kind::Cleared => "AllBlocksCleared",
        }
    }

    /// (positional field names, minimum number of positional fields)
    fn positional(self) -> (&'static [&'static str], usize) {
        match self {
            Kind::Stored => (&STORED_POSITIONAL, 4),
            Kind::Removed => (&REMOVED_POSITIONAL, 1),
            Kind::Cleared => (&[], 0),
        }
    }
}

/// Every field we interpret, whichever event it came from. `None` = absent or nil.
#[derive(Default)]
struct Fields {
    /// Ranges of the output's `hashes` / `tokens` (a duplicate key appends again;
    /// the last range wins, as the last value does).
    block_hashes: Option<Range<usize>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Range<usize>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<u32>,
    cache_salt: Option<String>,
}

thread_local! {
    /// `decode_batch`'s flat buffers, reused: it then allocates only what it returns.
    static SCRATCH: RefCell<FlatEvents> = RefCell::new(FlatEvents::default());
}

/// Decodes one event batch. Never panics; allocations are bounded by the input size.
pub fn decode_batch(bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    SCRATCH.with(|scratch| {
        let mut flat = scratch.borrow_mut();
        flat.clear();
        let header = decode_batch_into(bytes, &mut flat)?;
        Ok(flat.take_batch(header))
    })
}

/// Decodes one event batch and appends its events to `out` (the same grammar and
/// errors as [`decode_batch`]). On an error `out` is left as it was.
pub fn decode_batch_into(bytes: &[u8], out: &mut FlatEvents) -> Result<BatchHeader, DecodeError> {
    let lens = (out.hashes.len(), out.tokens.len(), out.events.len());
    let result = decode_flat(bytes, out);
    if result.is_err() {
        out.truncate(lens.0, lens.1, lens.2);
    }
    result
}

fn decode_flat(bytes: &[u8], out: &mut FlatEvents) -> Result<BatchHeader, DecodeError> {
    let mut r = Reader::new(bytes);
    let n = r.array_len("the batch")?;
    if !(2..=3).contains(&n) {
        return Err(r.error_at(
            0,
            format_args!("batch has {n} elements, expected 2 or 3 ([ts, events, dp_rank])"),
        ));
    }
    r.path = Path::BatchField("ts");
    let ts = r.number("a timestamp")?;
    r.path = Path::BatchField("events");
    let count = r.array_len("the event list")?;
    let first = out.events.len();
    out.events.reserve(count);
    for index in 0..count {
        let event = decode_event(&mut r, index, out)?;
        out.events.push(event);
    }
    let mut dp_rank = None;
    if n == 3 {
        r.path = Path::BatchField("dp_rank");
        if !r.eat_nil()? {
            dp_rank = Some(r.int_in("dp_rank", I64_MIN, I64_MAX)? as i64);
        }
    }
    r.path = Path::Batch;
    if r.remaining() != 0 {
        return Err(r.error(format_args!(
            "{} trailing bytes after the batch",
            r.remaining()
        )));
    }
    Ok(BatchHeader {
        ts,
        dp_rank,
        events: first..out.events.len(),
    })
}

fn decode_event(
    r: &mut Reader<'_>,
    index: usize,
    out: &mut FlatEvents,
) -> Result<FlatEvent, DecodeError> {
    use rmp::Marker;
    let start = r.pos();
    r.path = Path::Event(index);
    let mut fields = Fields::default();
    match r.peek()? {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let mut kind_name: Option<&str> = None;
            let mut type_at = start;
            for _ in 0..r.map_len()? {
                r.path = Path::Event(index);
                // Names are compared as bytes; only one that matches no known name
                // is checked for UTF-8 (the same error, at the same point).
                let name_at = r.pos();
                let name = r.str_raw("a field name")?;
                if name == b"type" {
                    r.path = Path::EventField(index, "type");
                    type_at = r.pos();
                    let raw = r.str_raw("the event type")?;
                    kind_name = Some(match Kind::parse_bytes(raw) {
                        Some(kind) => kind.name(),
                        None => r.utf8(raw, type_at, "the event type")?,
                    });
                } else {
                    let known = match known_field(name) {
                        Some(known) => Some(known),
                        None => {
                            r.utf8(name, name_at, "a field name")?;
                            None
                        }
                    };
                    read_field(r, index, known, &mut fields, out)?;
                }
            }
            r.path = Path::Event(index);
            let Some(kind_name) = kind_name else {
                return Err(r.error_at(start, "event map has no 'type' key"));
            };
            let kind = parse_kind(r, kind_name, type_at)?;
            build(r, kind, fields, start)
        }
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let n = r.array_len("an event")?;
            if n == 0 {
                return Err(r.error_at(start, "empty event array (expected the type name first)"));
            }
            let type_at = r.pos();
            let kind_name = r.str("the event type")?;
            let kind = parse_kind(r, kind_name, type_at)?;
            let (names, minimum) = kind.positional();
            if n - 1 < minimum {
                return Err(r.error_at(
                    start,
                    format_args!(
                        "{} array has {} fields, needs at least {minimum}",
                        kind.name(),
                        n - 1
                    ),
                ));
            }
            for i in 0..n - 1 {
                match names.get(i) {
                    Some(&"lora_name") if kind == Kind::Stored && is_map(r.peek()?) => {
                        r.path = Path::EventField(index, "metadata");
                        sglang_metadata(r, &mut fields)?;
                    }
                    Some(name) => read_field(r, index, Some(name), &mut fields, out)?,
                    None => {
                        r.path = Path::EventField(index, "<extra positional field>");
                        r.skip(FIELD_DEPTH)?;
                    }
                }
            }
            r.path = Path::Event(index);
            build(r, kind, fields, start)
        }
        _ => {
            let m = r.peek()?;
            Err(r.error(format_args!(
                "expected an event (a map or an array), found marker 0x{:02x}",
                m.to_u8()
            )))
        }
    }
}

fn is_map(m: rmp::Marker) -> bool {
    matches!(
        m,
        rmp::Marker::FixMap(_) | rmp::Marker::Map16 | rmp::Marker::Map32
    )
}

/// SGLang 0.5.18-0.5.19 (`BlockStoredWithMetadata`): a salted store appends, after
/// `medium`, the map `{"cache_salt": str}` where vLLM's positional form has
/// `lora_name` (a str or nil, so the two are told apart by type). Other keys are
/// skipped, as in an event map.
fn sglang_metadata(r: &mut Reader<'_>, f: &mut Fields) -> Result<(), DecodeError> {
    for _ in 0..r.map_len()? {
        let start = r.pos();
        let key = r.str_raw("a metadata key")?;
        if key == b"cache_salt" {
            f.cache_salt = nil_or(r, |r| Ok(r.str("cache_salt")?.to_owned()))?;
        } else {
            r.utf8(key, start, "a metadata key")?;
            r.skip(FIELD_DEPTH + 1)?; // batch > events > event > metadata > value
        }
    }
    Ok(())
}

fn parse_kind(r: &Reader<'_>, name: &str, at: usize) -> Result<Kind, DecodeError> {
    Kind::parse(name).ok_or_else(|| {
        let shown: String = name.chars().take(60).collect();
        r.error_at(at, format_args!("unknown event type {shown:?}"))
    })
}

/// Reads the value of a known field (`known_field`), or skips an unknown one (None).
fn read_field(
    r: &mut Reader<'_>,
    index: usize,
    known: Option<&'static str>,
    f: &mut Fields,
    out: &mut FlatEvents,
) -> Result<(), DecodeError> {
    let Some(known) = known else {
        r.path = Path::EventField(index, "<unknown field>");
        return r.skip(FIELD_DEPTH);
    };
    r.path = Path::EventField(index, known);
    match known {
        "block_hashes" => f.block_hashes = Some(hash_list(r, &mut out.hashes)?),
        "parent_block_hash" => {
            f.parent_block_hash = if r.eat_nil()? {
                None
            } else {
                Some(engine_hash(r, None)?)
            }
        }
        "token_ids" => f.token_ids = Some(token_list(r, &mut out.tokens)?),
        "block_size" => f.block_size = Some(r.int_in("block_size", 1, U32_MAX)? as u32),
        "lora_id" => f.lora_id = nil_or(r, |r| Ok(r.int_in("lora_id", I64_MIN, I64_MAX)? as i64))?,
        "medium" => f.medium = nil_or(r, medium)?,
        "lora_name" => f.lora_name = nil_or(r, |r| Ok(r.str("lora_name")?.to_owned()))?,
        "extra_keys" => f.extra_keys = nil_or(r, extra_keys)?,
        "group_idx" => f.group_idx = nil_or(r, |r| Ok(r.int_in("group_idx", 0, U32_MAX)? as u32))?,
        "cache_salt" => f.cache_salt = nil_or(r, |r| Ok(r.str("cache_salt")?.to_owned()))?,
        _ => r.skip(FIELD_DEPTH)?, // known to exist, not interpreted (session_id, ...)
    }
    Ok(())
}

/// The field names we know (`STORED_POSITIONAL` ∪ `REMOVED_POSITIONAL`), as a match
/// on the raw bytes (compiled to length + byte comparisons; a linear scan was a hot
/// spot, and so was checking every name for UTF-8 first).
fn known_field(name: &[u8]) -> Option<&'static str> {
    Some(match name {
        b"block_hashes" => "block_hashes",
        b"parent_block_hash" => "parent_block_hash",
        b"token_ids" => "token_ids",
        b"block_size" => "block_size",
        b"lora_id" => "lora_id",
        b"medium" => "medium",
        b"lora_name" => "lora_name",
        b"extra_keys" => "extra_keys",
        b"group_idx" => "group_idx",
        b"kv_cache_spec_kind" => "kv_cache_spec_kind",
        b"kv_cache_spec_sliding_window" => "kv_cache_spec_sliding_window",
        b"locality" => "locality",
        b"ownership" => "ownership",
        b"session_id" => "session_id",
        b"lookahead_token_ids" => "lookahead_token_ids",
        b"cache_salt" => "cache_salt",
        _ => return None,
    })
}

/// A medium string; the names engines send all the time skip the UTF-8 check.
fn medium(r: &mut Reader<'_>) -> Result<Medium, DecodeError> {
    let start = r.pos();
    Ok(match r.str_raw("medium")? {
        b"GPU" => Medium::Gpu,
        b"CPU" => Medium::Cpu,
        b"DISK" => Medium::Disk,
        raw => Medium::parse(Some(r.utf8(raw, start, "medium")?)),
    })
}

fn nil_or<'a, T>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<Option<T>, DecodeError> {
    if r.eat_nil()? {
        Ok(None)
    } else {
        read(r).map(Some)
    }
}

/// One engine hash: uint64 as is, int64 by its bits, a digest by its last 8 bytes BE.
fn engine_hash(r: &mut Reader<'_>, element: Option<usize>) -> Result<EngineHash, DecodeError> {
    if let Some(v) = r.fast_u64() {
        return Ok(v); // uint64 or positive fixint: the common wire forms
    }
    let start = r.pos();
    let at = |i: Option<usize>| i.map(|i| format!("[{i}]")).unwrap_or_default();
    if let Some(v) = r.try_int()? {
        if !(I64_MIN..=u64::MAX as WireInt).contains(&v) {
            return Err(r.error_at(start, "int hash outside int64/uint64"));
        }
        // The low 64 bits: uint64 unchanged, int64 by its two's-complement bits.
        return Ok(v as u64);
    }
    if let Some(bytes) = r.try_bin()? {
        if bytes.len() < 8 {
            return Err(r.error_at(
                start,
                format_args!(
                    "{}: digest of {} bytes, need at least 8",
                    at(element),
                    bytes.len()
                ),
            ));
        }
        let mut last = [0u8; 8];
        last.copy_from_slice(&bytes[bytes.len() - 8..]);
        return Ok(u64::from_be_bytes(last));
    }
    let m = r.peek()?;
    Err(r.error_at(
        start,
        format_args!(
            "block_hashes{}: expected an int or bytes hash, found marker 0x{:02x}",
            at(element),
            m.to_u8()
        ),
    ))
}

/// Appends the hashes to `out`; returns where they are.
fn hash_list(r: &mut Reader<'_>, out: &mut Vec<EngineHash>) -> Result<Range<usize>, DecodeError> {
    let n = r.array_len("block_hashes")?;
    let start = out.len();
    out.reserve(n);
    for i in 0..n {
        out.push(engine_hash(r, Some(i))?);
    }
    Ok(start..out.len())
}

/// Appends the token ids to `out`; returns where they are.
fn token_list(r: &mut Reader<'_>, out: &mut Vec<u32>) -> Result<Range<usize>, DecodeError> {
    let n = r.array_len("token_ids")?;
    let first = out.len();
    let end = first + n;
    loop {
        r.fast_u32_run(end, out);
        let i = out.len() - first;
        if i == n {
            break;
        }
        let start = r.pos();
        match r.try_int()? {
            Some(v) if (0..=U32_MAX).contains(&v) => out.push(v as u32),
            other => {
                let got = match other {
                    Some(v) => v.to_string(),
                    None => format!("marker 0x{:02x}", r.peek()?.to_u8()),
                };
                return Err(r.error_at(
                    start,
                    format_args!("token_ids[{i}]: expected an int in 0..2^32-1, got {got}"),
                ));
            }
        }
    }
    Ok(first..end)
}

fn extra_keys(r: &mut Reader<'_>) -> Result<Vec<Option<Vec<ExtraKey>>>, DecodeError> {
    let blocks = r.array_len("extra_keys")?;
    let mut out = Vec::with_capacity(blocks);
    for _ in 0..blocks {
        if r.eat_nil()? {
            out.push(None);
            continue;
        }
        let n = r.array_len("a block's extra keys")?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            let start = r.pos();
            r.skip(EXTRA_ITEM_DEPTH)?;
            items.push(classify_extra_key(r.slice(start, r.pos())));
        }
        out.push(Some(items));
    }
    Ok(out)
}

/// A str is a LoRA name / cache salt, `[str, int64]` an mm item, anything else raw.
fn classify_extra_key(raw: &[u8]) -> ExtraKey {
    let mut r = Reader::new(raw);
    if let Some(s) = r.try_str() {
        return ExtraKey::Str(s.to_owned());
    }
    let mut r = Reader::new(raw);
    if let Ok(2) = r.array_len("") {
        if let Some(hash) = r.try_str() {
            if let Ok(Some(offset)) = r.try_int() {
                if (I64_MIN..=I64_MAX).contains(&offset) {
                    return ExtraKey::Mm {
                        hash: hash.to_owned(),
                        offset: offset as i64,
                    };
                }
            }
        }
    }
    ExtraKey::Raw(raw.to_vec())
}

fn build(r: &Reader<'_>, kind: Kind, f: Fields, start: usize) -> Result<FlatEvent, DecodeError> {
    let missing = |name: &str| {
        r.error_at(
            start,
            format_args!("{} is missing the required field '{name}'", kind.name()),
        )
    };
    Ok(match kind {
        Kind::Stored => FlatEvent::BlockStored(FlatStored {
            hashes: f.block_hashes.ok_or_else(|| missing("block_hashes"))?,
            parent_block_hash: f.parent_block_hash,
            tokens: f.token_ids.ok_or_else(|| missing("token_ids"))?,
            block_size: f.block_size.ok_or_else(|| missing("block_size"))?,
            lora_id: f.lora_id,
            medium: f.medium.unwrap_or(Medium::Gpu),
            lora_name: f.lora_name,
            extra_keys: f.extra_keys.unwrap_or_default(),
            group_idx: f.group_idx.unwrap_or(0),
            cache_salt: f.cache_salt,
        }),
        Kind::Removed => FlatEvent::BlockRemoved {
            hashes: f.block_hashes.ok_or_else(|| missing("block_hashes"))?,
            medium: f.medium.unwrap_or(Medium::Gpu),
            group_idx: f.group_idx.unwrap_or(0),
        },
        Kind::Cleared => FlatEvent::AllBlocksCleared,
    })
}

#[cfg(test)]
mod field_name_tests {
    use super::*;

    #[test]
    fn every_positional_name_is_known() {
        for name in STORED_POSITIONAL.iter().chain(REMOVED_POSITIONAL.iter()) {
            assert_eq!(known_field(name.as_bytes()), Some(*name));
        }
        assert_eq!(known_field(b"type"), None);
        assert_eq!(known_field(b"block_hashes "), None);
    }
}
