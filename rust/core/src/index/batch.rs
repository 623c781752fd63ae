//! Ingest of many payloads in one call (`Index::apply_payloads`).
//!
//! Applying one BlockStored costs a few random cache misses per new block (its key's
//! table slot, its engine hash's slot); within one event they overlap, but an event
//! holds only a handful of blocks. Here a window of payloads is decoded first and the
//! key chain of every BlockStored computed ahead (the parent key of an event that
//! continues the previous one is that event's last key; otherwise it is looked up
//! now). While an event is applied, the slots of the next `AHEAD` blocks are already
//! being loaded. A planned chain is used only if the event's parent key, as found
//! when it is applied, is the one it was computed from, so the result is exactly
//! that of applying the payloads one by one (tested against it).
//!
//! The window is decoded into flat buffers ([`FlatEvents`]) that live as long as
//! the thread: after the first calls, decoding a payload allocates nothing (an
//! [`EventBatch`](crate::events::EventBatch) costs an allocation and a free for
//! the event list and for each event's hashes and tokens).

use std::cell::RefCell;
use std::ops::Range;

use crate::events::{decode_batch_into, DecodeError, EventRef, FlatEvent, FlatEvents};

use super::apply::{chain_keys, has_key_chain, rank_of};
use super::sources::engine_map_key;
use super::tree::Tree;
use super::{ApplyStats, Index, SourceKey};

/// Blocks decoded and planned at a time (bounds the memory of a large call; tiny in
/// tests, so that calls span several windows).
pub(super) const WINDOW_BLOCKS: usize = if cfg!(test) { 6 } else { 1024 };
/// How many blocks ahead of the one being applied the table slots are prefetched.
const AHEAD: usize = 24;

thread_local! {
    /// The decoded window of `apply_payloads`, kept for the thread's next calls.
    static WINDOW: RefCell<Window> = RefCell::new(Window::default());
}

/// Decoded payloads of a window: the batches' sources and their events' ranges.
#[derive(Debug, Default)]
pub(super) struct Window {
    pub(super) flat: FlatEvents,
    pub(super) batches: Vec<(SourceKey, Range<usize>)>,
}

impl Window {
    pub(super) fn clear(&mut self) {
        self.flat.clear();
        self.batches.clear();
    }

    /// Decodes one payload of `source` into the window; returns the blocks it adds
    /// (hashes of stored and removed blocks, + 1 per clear). On an error the window
    /// holds exactly the batches decoded before.
    pub(super) fn decode(
        &mut self,
        source: SourceKey,
        payload: &[u8],
    ) -> Result<usize, DecodeError> {
        let hashes_before = self.flat.hashes.len();
        let decoded = decode_batch_into(payload, &mut self.flat)
            .and_then(|h| Ok((rank_of(source, h.dp_rank)?, h)));
        match decoded {
            Ok((src, header)) => {
                let blocks = self.flat.hashes.len() - hashes_before
                    + self.flat.events[header.events.clone()]
                        .iter()
                        .filter(|e| matches!(e, FlatEvent::AllBlocksCleared))
                        .count();
                self.batches.push((src, header.events));
                Ok(blocks)
            }
            Err(error) => {
                // A batch whose dp rank is bad was decoded: drop its events.
                let keep = self.batches.last().map_or(0, |(_, last)| last.end);
                self.flat.events.truncate(keep);
                Err(error)
            }
        }
    }
}

/// A payload of an `apply_payloads` call failed to decode: the ones before it are
/// applied (`applied`), it and the later ones are not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadsError {
    pub index: usize,
    pub error: DecodeError,
    pub applied: ApplyStats,
}

/// The key chain of one planned BlockStored: `keys[start..end]`, computed from `parent`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Chain {
    pub parent: u64,
    pub start: usize,
    pub end: usize,
}

/// Key chains computed ahead for a window of events, and a prefetch cursor.
#[derive(Debug, Default)]
pub(super) struct Plan {
    /// Per event of the window, in order (empty: nothing planned).
    chains: Vec<Option<Chain>>,
    pub keys: Vec<u64>,
    /// `engine_map_key` of each block of `keys`, aligned with it.
    map_keys: Vec<u64>,
    next: usize,
    prefetched: usize,
}

impl Plan {
    pub fn none() -> Self {
        Self::default()
    }

    /// The chain planned for the next event, if any.
    pub fn next_event(&mut self) -> Option<Chain> {
        let c = self.chains.get(self.next).copied().flatten();
        self.next += 1;
        c
    }

    pub fn skip(&mut self, events: usize) {
        self.next += events;
    }

    /// Starts loading the slots of every planned block up to `end + AHEAD`.
    pub fn prefetch_through(&mut self, tree: &Tree, end: usize) {
        let to = (end + AHEAD).min(self.keys.len());
        for i in self.prefetched..to {
            tree.prefetch_slot(self.keys[i]);
            tree.prefetch_ehash_slot(self.map_keys[i]);
        }
        self.prefetched = self.prefetched.max(to);
    }
}

impl Index {
    /// Decodes and applies raw msgpack batches in order, like `apply_payload` on each,
    /// with the table probes overlapped across events (module docs). Each batch's
    /// own dp rank wins over `source.dp_rank`.
    pub fn apply_payloads<P: AsRef<[u8]>>(
        &mut self,
        source: SourceKey,
        payloads: &[P],
    ) -> Result<ApplyStats, PayloadsError> {
        WINDOW.with(|w| match w.try_borrow_mut() {
            Ok(mut window) => self.apply_payloads_in(source, payloads, &mut window),
            // Only if a caller re-entered from inside a call: a window of its own.
            Err(_) => self.apply_payloads_in(source, payloads, &mut Window::default()),
        })
    }

    fn apply_payloads_in<P: AsRef<[u8]>>(
        &mut self,
        source: SourceKey,
        payloads: &[P],
        window: &mut Window,
    ) -> Result<ApplyStats, PayloadsError> {
        let mut applied = ApplyStats::default();
        let mut start = 0;
        while start < payloads.len() {
            window.clear();
            let mut blocks = 0;
            let mut failure = None;
            let mut end = start;
            while end < payloads.len() && blocks < WINDOW_BLOCKS {
                match window.decode(source, payloads[end].as_ref()) {
                    Ok(n) => {
                        blocks += n;
                        end += 1;
                    }
                    Err(error) => {
                        failure = Some(error);
                        break;
                    }
                }
            }
            applied += self.apply_window(window);
            if let Some(error) = failure {
                return Err(PayloadsError {
                    index: end,
                    error,
                    applied,
                });
            }
            start = end;
        }
        Ok(applied)
    }

    /// Plans and applies a decoded window, batch by batch in order.
    pub(super) fn apply_window(&mut self, window: &Window) -> ApplyStats {
        let mut applied = ApplyStats::default();
        let mut plan = self.plan(window);
        for (src, events) in &window.batches {
            let flat = &window.flat;
            let count = events.len();
            let refs = events.clone().map(|i| flat.get(i));
            applied += self.apply_events_planned(*src, count, refs, &mut plan);
        }
        applied
    }

    /// The key chains of the window's BlockStored events, as far as they can be
    /// guessed before applying anything.
    fn plan(&self, window: &Window) -> Plan {
        let mut plan = Plan::default();
        // (slot, engine-map key, content key) of the last block planned.
        let mut last: Option<(u32, u64, u64)> = None;
        for (src, events) in &window.batches {
            let slot = self.sources.slot(*src);
            for i in events.clone() {
                let chain = match (slot, window.flat.get(i)) {
                    (Some(slot), EventRef::BlockStored(ev)) if has_key_chain(&ev) => {
                        let group = ev.group_idx;
                        let parent = match ev.parent_block_hash {
                            None => Some(self.namespace_of(slot, &ev).id()),
                            Some(ph) => {
                                let mk = engine_map_key(group, ph);
                                match last {
                                    Some((s, m, key)) if s == slot && m == mk => Some(key),
                                    _ => self.resolve(slot, mk),
                                }
                            }
                        };
                        parent.map(|parent| {
                            let start = plan.keys.len();
                            chain_keys(&ev, parent, &mut plan.keys);
                            plan.map_keys
                                .extend(ev.block_hashes.iter().map(|&h| engine_map_key(group, h)));
                            last = Some((
                                slot,
                                plan.map_keys[plan.map_keys.len() - 1],
                                plan.keys[plan.keys.len() - 1],
                            ));
                            Chain {
                                parent,
                                start,
                                end: plan.keys.len(),
                            }
                        })
                    }
                    _ => None,
                };
                plan.chains.push(chain);
            }
        }
        plan
    }
}
