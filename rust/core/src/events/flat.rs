//! Decoded batches in flat, reusable buffers, and borrowed views of events.
//!
//! [`decode_batch_into`](super::decode_batch_into) appends a batch's events to a
//! [`FlatEvents`]: the hashes and token ids of every event go to two shared arrays,
//! and an event records where its own lie. Reused across payloads, the buffers stop
//! allocating once they have grown, where an [`EventBatch`] costs three allocations
//! per event (the event list, its hashes, its tokens) and as many frees. Ingest reads
//! the events through the borrowed views ([`EventRef`]), which an [`Event`] gives as
//! well, so the index has one code path for both.

use std::ops::Range;

use super::types::{
    BlockRemoved, BlockStored, EngineHash, Event, EventBatch, ExtraKey, Medium, StoredIdentity,
};

/// Events of one or more decoded batches, their hashes and tokens in shared arrays.
#[derive(Debug, Clone, Default)]
pub struct FlatEvents {
    pub hashes: Vec<EngineHash>,
    pub tokens: Vec<u32>,
    pub events: Vec<FlatEvent>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FlatEvent {
    BlockStored(FlatStored),
    BlockRemoved {
        hashes: Range<usize>,
        medium: Medium,
        group_idx: u32,
    },
    AllBlocksCleared,
}

/// A BlockStored whose hashes and tokens are ranges of [`FlatEvents`]' arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatStored {
    pub hashes: Range<usize>,
    pub parent_block_hash: Option<EngineHash>,
    pub tokens: Range<usize>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Medium,
    pub lora_name: Option<String>,
    pub extra_keys: Vec<Option<Vec<ExtraKey>>>,
    pub group_idx: u32,
    pub cache_salt: Option<String>,
}

/// What a batch carries besides its events: `events` indexes `FlatEvents::events`.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchHeader {
    pub ts: f64,
    pub dp_rank: Option<i64>,
    pub events: Range<usize>,
}

/// A BlockStored, borrowed from an [`Event`] or from [`FlatEvents`].
#[derive(Debug, Clone, Copy)]
pub struct StoredRef<'a> {
    pub block_hashes: &'a [EngineHash],
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: &'a [u32],
    pub block_size: u32,
    pub medium: &'a Medium,
    pub lora_name: Option<&'a str>,
    pub extra_keys: &'a [Option<Vec<ExtraKey>>],
    pub group_idx: u32,
    pub cache_salt: Option<&'a str>,
}

impl<'a> StoredRef<'a> {
    /// The pieces that decide its namespace and its blocks' multimodal items.
    pub fn identity(&self) -> StoredIdentity<'a> {
        StoredIdentity {
            cache_salt: self.cache_salt,
            lora_name: self.lora_name,
            extra_keys: self.extra_keys,
        }
    }
}

/// A BlockRemoved, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct RemovedRef<'a> {
    pub block_hashes: &'a [EngineHash],
    pub medium: &'a Medium,
    pub group_idx: u32,
}

/// An event, borrowed.
#[derive(Debug, Clone, Copy)]
pub enum EventRef<'a> {
    BlockStored(StoredRef<'a>),
    BlockRemoved(RemovedRef<'a>),
    AllBlocksCleared,
}

impl BlockStored {
    pub fn as_ref(&self) -> StoredRef<'_> {
        StoredRef {
            block_hashes: &self.block_hashes,
            parent_block_hash: self.parent_block_hash,
            token_ids: &self.token_ids,
            block_size: self.block_size,
            medium: &self.medium,
            lora_name: self.lora_name.as_deref(),
            extra_keys: &self.extra_keys,
            group_idx: self.group_idx,
            cache_salt: self.cache_salt.as_deref(),
        }
    }
}

impl Event {
    pub fn as_ref(&self) -> EventRef<'_> {
        match self {
            Event::BlockStored(ev) => EventRef::BlockStored(ev.as_ref()),
            Event::BlockRemoved(ev) => EventRef::BlockRemoved(RemovedRef {
                block_hashes: &ev.block_hashes,
                medium: &ev.medium,
                group_idx: ev.group_idx,
            }),
            Event::AllBlocksCleared => EventRef::AllBlocksCleared,
        }
    }
}

impl FlatEvents {
    pub fn clear(&mut self) {
        self.hashes.clear();
        self.tokens.clear();
        self.events.clear();
    }

    /// Event `i`, borrowed.
    pub fn get(&self, i: usize) -> EventRef<'_> {
        match &self.events[i] {
            FlatEvent::BlockStored(s) => EventRef::BlockStored(StoredRef {
                block_hashes: &self.hashes[s.hashes.clone()],
                parent_block_hash: s.parent_block_hash,
                token_ids: &self.tokens[s.tokens.clone()],
                block_size: s.block_size,
                medium: &s.medium,
                lora_name: s.lora_name.as_deref(),
                extra_keys: &s.extra_keys,
                group_idx: s.group_idx,
                cache_salt: s.cache_salt.as_deref(),
            }),
            FlatEvent::BlockRemoved {
                hashes,
                medium,
                group_idx,
            } => EventRef::BlockRemoved(RemovedRef {
                block_hashes: &self.hashes[hashes.clone()],
                medium,
                group_idx: *group_idx,
            }),
            FlatEvent::AllBlocksCleared => EventRef::AllBlocksCleared,
        }
    }

    /// Drops everything after the given lengths (undoes a partly decoded batch).
    pub(super) fn truncate(&mut self, hashes: usize, tokens: usize, events: usize) {
        self.hashes.truncate(hashes);
        self.tokens.truncate(tokens);
        self.events.truncate(events);
    }

    /// The batch of `header` as an owned [`EventBatch`] (its events are drained).
    pub(super) fn take_batch(&mut self, header: BatchHeader) -> EventBatch {
        let events = self
            .events
            .drain(header.events)
            .map(|e| match e {
                FlatEvent::BlockStored(s) => Event::BlockStored(BlockStored {
                    block_hashes: self.hashes[s.hashes].to_vec(),
                    parent_block_hash: s.parent_block_hash,
                    token_ids: self.tokens[s.tokens].to_vec(),
                    block_size: s.block_size,
                    lora_id: s.lora_id,
                    medium: s.medium,
                    lora_name: s.lora_name,
                    extra_keys: s.extra_keys,
                    group_idx: s.group_idx,
                    cache_salt: s.cache_salt,
                }),
                FlatEvent::BlockRemoved {
                    hashes,
                    medium,
                    group_idx,
                } => Event::BlockRemoved(BlockRemoved {
                    block_hashes: self.hashes[hashes].to_vec(),
                    medium,
                    group_idx,
                }),
                FlatEvent::AllBlocksCleared => Event::AllBlocksCleared,
            })
            .collect();
        EventBatch {
            ts: header.ts,
            events,
            dp_rank: header.dp_rank,
        }
    }
}
