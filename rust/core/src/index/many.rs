//! Ingest of many sources' payloads in one call, decoding on a second thread.
//!
//! Decoding is about a third of ingest. For a call large enough to pay for a thread
//! (`PIPELINE_MIN_BYTES`), one thread decodes the payloads into windows of about
//! `PIPELINE_WINDOW_BLOCKS` blocks (the first ones smaller, so that the caller's
//! thread starts soon) while the caller's thread plans and applies the previous
//! window: wall time drops when the second core is free, CPU time does not. Windows
//! go back to the decoder for reuse, so decoding allocates nothing after the first
//! two. The caller's `lock` is taken per window, not for the whole call, so readers
//! (a request's `match`) wait for one window at most. The result is that of
//! `apply_payloads` item by item (the plan of a window is checked against the index
//! when each event is applied, see `batch`).

use std::ops::DerefMut;
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender};

use crate::events::DecodeError;

use super::batch::Window;
use super::keytable::prefetch;
use super::{ApplyStats, Index, SourceKey};

/// Below this many payload bytes in all, the thread costs more than it saves
/// (1 in tests, so that the pipeline runs on small inputs too).
const PIPELINE_MIN_BYTES: usize = if cfg!(test) { 1 } else { 64 * 1024 };

/// Blocks per window handed between the threads: each hand-off may wake a thread
/// (a syscall and a scheduler round trip), so windows are larger than
/// `apply_payloads`' ones; the caller's lock is held for one window at a time.
const PIPELINE_WINDOW_BLOCKS: usize = if cfg!(test) { 6 } else { 8192 };

/// Blocks in a call's first window; each next one doubles, up to
/// `PIPELINE_WINDOW_BLOCKS`. The caller's thread idles until the first window is
/// decoded, so a small first window lets it start applying sooner.
const FIRST_WINDOW_BLOCKS: usize = if cfg!(test) { 2 } else { 1024 };

/// How many payloads ahead of the one being decoded the decoder prefetches.
const PREFETCH_AHEAD: usize = 2;
/// Bytes prefetched of each payload (a vLLM batch of a few blocks is ~200-600 B).
const PREFETCH_BYTES: usize = 512;

/// Starts loading the first `PREFETCH_BYTES` of `bytes`.
#[inline]
fn prefetch_bytes(bytes: &[u8]) {
    for line in bytes[..bytes.len().min(PREFETCH_BYTES)].chunks(64) {
        prefetch(line.as_ptr());
    }
}

/// A payload of an `apply_many` call failed to decode: everything before it (earlier
/// items, and the earlier payloads of its item) is applied (`applied`), nothing after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManyError {
    pub item: usize,
    pub payload: usize,
    pub error: DecodeError,
    pub applied: ApplyStats,
}

/// A decoded window, and where decoding stopped if a payload failed.
struct Decoded {
    window: Window,
    failure: Option<(usize, usize, DecodeError)>,
}

impl Index {
    /// Applies each item's raw payloads for its source, items in order, as
    /// `apply_payloads` on each would; `lock` gives the index (e.g. a write guard)
    /// and is called once per window.
    pub fn apply_many<P, G, L>(
        items: &[(SourceKey, Vec<P>)],
        mut lock: L,
    ) -> Result<ApplyStats, ManyError>
    where
        P: AsRef<[u8]> + Sync,
        G: DerefMut<Target = Index>,
        L: FnMut() -> G,
    {
        let bytes: usize = items
            .iter()
            .flat_map(|(_, payloads)| payloads.iter())
            .map(|p| p.as_ref().len())
            .sum();
        let mut total = ApplyStats::default();
        if bytes < PIPELINE_MIN_BYTES || items.is_empty() {
            for (item, (source, payloads)) in items.iter().enumerate() {
                match lock().apply_payloads(*source, payloads) {
                    Ok(stats) => total += stats,
                    Err(e) => {
                        total += e.applied;
                        return Err(ManyError {
                            item,
                            payload: e.index,
                            error: e.error,
                            applied: total,
                        });
                    }
                }
            }
            return Ok(total);
        }
        std::thread::scope(|scope| {
            // One window being applied, one decoded ahead, one being decoded.
            let (full_tx, full_rx) = sync_channel::<Decoded>(1);
            let (empty_tx, empty_rx) = channel::<Window>();
            for _ in 0..2 {
                let _ = empty_tx.send(Window::default());
            }
            scope.spawn(move || decode_all(items, &full_tx, &empty_rx));
            for decoded in full_rx.iter() {
                total += lock().apply_window(&decoded.window);
                if let Some((item, payload, error)) = decoded.failure {
                    return Err(ManyError {
                        item,
                        payload,
                        error,
                        applied: total,
                    });
                }
                // The decoder may be done: then nobody takes it back.
                let _ = empty_tx.send(decoded.window);
            }
            Ok(total)
        })
    }
}

/// The decoding thread: fills windows and sends them on, in order; stops at the
/// first payload that does not decode (that window carries the failure), or when
/// the applier has gone (it returned an error).
fn decode_all<P: AsRef<[u8]>>(
    items: &[(SourceKey, Vec<P>)],
    full: &SyncSender<Decoded>,
    empty: &Receiver<Window>,
) {
    let Ok(mut window) = empty.recv() else {
        return;
    };
    window.clear();
    let mut blocks = 0;
    let mut limit = FIRST_WINDOW_BLOCKS;
    // The payloads' bytes are scattered (each one its own allocation, e.g. a Python
    // bytes object): the ones `PREFETCH_AHEAD` payloads on start loading now.
    let mut ahead = items
        .iter()
        .flat_map(|(_, payloads)| payloads.iter())
        .skip(PREFETCH_AHEAD);
    for (item, (source, payloads)) in items.iter().enumerate() {
        for (at, payload) in payloads.iter().enumerate() {
            if let Some(next) = ahead.next() {
                prefetch_bytes(next.as_ref());
            }
            match window.decode(*source, payload.as_ref()) {
                Ok(n) => blocks += n,
                Err(error) => {
                    let failure = Some((item, at, error));
                    let _ = full.send(Decoded { window, failure });
                    return;
                }
            }
            if blocks >= limit {
                if full
                    .send(Decoded {
                        window,
                        failure: None,
                    })
                    .is_err()
                {
                    return;
                }
                let Ok(next) = empty.recv() else {
                    return;
                };
                window = next;
                window.clear();
                blocks = 0;
                limit = (limit * 2).min(PIPELINE_WINDOW_BLOCKS);
            }
        }
    }
    let _ = full.send(Decoded {
        window,
        failure: None,
    });
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use std::sync::RwLock;

    use super::*;
    use crate::persist::durable_tests::{encode, ev_strategy};

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The pipeline (windows of 6 blocks here, spanning items) gives the state
        /// and stats of `apply_payload` on every payload in order, and stops at the
        /// first undecodable one exactly where they would.
        #[test]
        fn equals_one_payload_at_a_time(
            items in prop::collection::vec(
                (0u64..3, prop::collection::vec(
                    prop::collection::vec(ev_strategy(), 1..4), 0..4)),
                0..8,
            ),
            bad in prop::option::of((any::<prop::sample::Index>(), any::<prop::sample::Index>())),
        ) {
            let mut items: Vec<(SourceKey, Vec<Vec<u8>>)> = items
                .iter()
                .map(|(w, batches)| {
                    let source = SourceKey { worker: *w, dp_rank: 0 };
                    (source, batches.iter().map(|evs| encode(evs, None)).collect())
                })
                .collect();
            let mut bad_at = None;
            if let Some((i, p)) = bad {
                if !items.is_empty() {
                    let i = i.index(items.len());
                    if !items[i].1.is_empty() {
                        let p = p.index(items[i].1.len());
                        items[i].1[p] = b"\xc1 not msgpack".to_vec();
                        bad_at = Some((i, p));
                    }
                }
            }
            let mut want = Index::new();
            let mut want_stats = ApplyStats::default();
            let mut stopped = None;
            'outer: for (i, (source, payloads)) in items.iter().enumerate() {
                for (p, payload) in payloads.iter().enumerate() {
                    match want.apply_payload(*source, payload) {
                        Ok(s) => want_stats += s,
                        Err(_) => {
                            stopped = Some((i, p));
                            break 'outer;
                        }
                    }
                }
            }
            prop_assert_eq!(stopped, bad_at);
            let got = RwLock::new(Index::new());
            let result = Index::apply_many(&items, || got.write().unwrap());
            match result {
                Ok(stats) => {
                    prop_assert!(stopped.is_none());
                    prop_assert_eq!(stats, want_stats);
                }
                Err(e) => {
                    prop_assert_eq!(Some((e.item, e.payload)), stopped);
                    prop_assert_eq!(e.applied, want_stats);
                }
            }
            prop_assert!(got.read().unwrap().state_eq(&want));
        }
    }
}
