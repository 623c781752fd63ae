//! The durable index against a plain in-memory `Index` fed the same operations:
//! random operation sequences with clean reopens and crashes (drop without close)
//! in between must always recover exactly the reference state and sequence numbers.

use std::collections::BTreeMap;
use std::fs;

use proptest::prelude::*;

use crate::events::Medium;
use crate::index::{Index, IndexRead, SourceKey};

use super::durable::{ApplyError, DurableIndex, DurableOptions};
use super::wal::{Durability, WalOptions};
use super::wal_tests::TestDir;

/// A test event, encoded in vLLM's map wire form.
#[derive(Debug, Clone)]
pub(crate) enum Ev {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        medium: &'static str,
    },
    Removed {
        hashes: Vec<u64>,
        medium: &'static str,
    },
    Cleared,
}

pub(crate) const BS: u32 = 2;

fn str_(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).unwrap();
}

/// `[ts, [events...], dp_rank]` with map-form events, as vLLM >= 0.24 sends.
pub(crate) fn encode(events: &[Ev], dp_rank: Option<u32>) -> Vec<u8> {
    let mut o = Vec::new();
    rmp::encode::write_array_len(&mut o, 3).unwrap();
    rmp::encode::write_f64(&mut o, 1.5).unwrap();
    rmp::encode::write_array_len(&mut o, events.len() as u32).unwrap();
    for e in events {
        match e {
            Ev::Stored {
                hashes,
                parent,
                tokens,
                medium,
            } => {
                rmp::encode::write_map_len(&mut o, 7).unwrap();
                str_(&mut o, "type");
                str_(&mut o, "BlockStored");
                str_(&mut o, "block_hashes");
                rmp::encode::write_array_len(&mut o, hashes.len() as u32).unwrap();
                for h in hashes {
                    rmp::encode::write_uint(&mut o, *h).unwrap();
                }
                str_(&mut o, "parent_block_hash");
                match parent {
                    Some(p) => drop(rmp::encode::write_uint(&mut o, *p).unwrap()),
                    None => rmp::encode::write_nil(&mut o).unwrap(),
                }
                str_(&mut o, "token_ids");
                rmp::encode::write_array_len(&mut o, tokens.len() as u32).unwrap();
                for t in tokens {
                    rmp::encode::write_uint(&mut o, *t as u64).unwrap();
                }
                str_(&mut o, "block_size");
                rmp::encode::write_uint(&mut o, BS as u64).unwrap();
                str_(&mut o, "lora_id");
                rmp::encode::write_nil(&mut o).unwrap();
                str_(&mut o, "medium");
                str_(&mut o, medium);
            }
            Ev::Removed { hashes, medium } => {
                rmp::encode::write_map_len(&mut o, 3).unwrap();
                str_(&mut o, "type");
                str_(&mut o, "BlockRemoved");
                str_(&mut o, "block_hashes");
                rmp::encode::write_array_len(&mut o, hashes.len() as u32).unwrap();
                for h in hashes {
                    rmp::encode::write_uint(&mut o, *h).unwrap();
                }
                str_(&mut o, "medium");
                str_(&mut o, medium);
            }
            Ev::Cleared => {
                rmp::encode::write_map_len(&mut o, 1).unwrap();
                str_(&mut o, "type");
                str_(&mut o, "AllBlocksCleared");
            }
        }
    }
    match dp_rank {
        Some(r) => drop(rmp::encode::write_uint(&mut o, r as u64).unwrap()),
        None => rmp::encode::write_nil(&mut o).unwrap(),
    }
    o
}

#[derive(Debug, Clone)]
enum Op {
    Apply {
        worker: u64,
        dp: u32,
        events: Vec<Ev>,
        seq: Option<u64>,
    },
    Register {
        worker: u64,
        model: String,
    },
    Pin(Vec<u64>),
    Unpin(Vec<u64>),
    Clear {
        worker: u64,
        dp: u32,
    },
    ClearMedium {
        worker: u64,
        dp: u32,
        medium: &'static str,
    },
    RemoveWorker(u64),
    Snapshot,
    Reopen,
    Crash,
}

pub(crate) fn ev_strategy() -> impl Strategy<Value = Ev> {
    let medium = prop::sample::select(vec!["GPU", "CPU"]);
    prop_oneof![
        6 => (1u64..12, prop::option::of(1u64..12), 1usize..4, medium.clone(), 0u32..3).prop_map(
            |(h, parent, n, medium, salt)| Ev::Stored {
                hashes: (0..n as u64).map(|i| h * 16 + i).collect(),
                parent: parent.map(|p| p * 16),
                tokens: (0..n as u32 * BS).map(|t| t % 5 + salt).collect(),
                medium,
            }
        ),
        3 => (prop::collection::vec(0u64..200, 1..3), medium).prop_map(|(hashes, medium)| Ev::Removed { hashes, medium }),
        1 => Just(Ev::Cleared),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (0u64..3, 0u32..2, prop::collection::vec(ev_strategy(), 0..4), prop::option::of(0u64..1000))
            .prop_map(|(worker, dp, events, seq)| Op::Apply { worker, dp, events, seq }),
        1 => (0u64..3, prop::sample::select(vec!["m1", "m2"])).prop_map(|(worker, m)| Op::Register { worker, model: m.into() }),
        1 => prop::collection::vec(0u64..u64::MAX, 1..3).prop_map(Op::Pin),
        1 => prop::collection::vec(0u64..u64::MAX, 1..3).prop_map(Op::Unpin),
        1 => (0u64..3, 0u32..2).prop_map(|(worker, dp)| Op::Clear { worker, dp }),
        1 => (0u64..3, 0u32..2, prop::sample::select(vec!["CPU", "GPU", "DISK"]))
            .prop_map(|(worker, dp, medium)| Op::ClearMedium { worker, dp, medium }),
        1 => (0u64..3).prop_map(Op::RemoveWorker),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
    ]
}

fn options(snapshot_every_bytes: u64, segment_bytes: u64, background: bool) -> DurableOptions {
    DurableOptions {
        wal: WalOptions {
            durability: Durability::None,
            segment_bytes,
        },
        snapshot_every_bytes,
        snapshot_log_ratio: 0.0,
        snapshot_every: None,
        snapshot_in_background: background,
        snapshot_on_close: true,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn recovers_exactly_the_reference_state(
        ops in prop::collection::vec(op_strategy(), 1..60),
        snapshot_every_bytes in prop::sample::select(vec![0u64, 300, 5000]),
        segment_bytes in prop::sample::select(vec![128u64, 1 << 20]),
        background in any::<bool>(),
        snapshot_log_ratio in prop::sample::select(vec![0.0f64, 0.5]),
    ) {
        let d = TestDir::new("durable-prop");
        let opts = DurableOptions {
            snapshot_log_ratio,
            ..options(snapshot_every_bytes, segment_bytes, background)
        };
        let mut dur = Some(DurableIndex::open(&d.0, opts.clone()).unwrap());
        let mut reference = Index::new();
        let mut ref_seqs: BTreeMap<SourceKey, u64> = BTreeMap::new();
        for op in ops {
            let di = dur.as_mut().unwrap();
            match op {
                Op::Apply { worker, dp, events, seq } => {
                    let src = SourceKey { worker, dp_rank: dp };
                    let payload = encode(&events, Some(dp));
                    let seqs = seq.map(|s| vec![s]);
                    di.apply(src, &[&payload], seqs.as_deref()).unwrap();
                    reference.apply_payload(src, &payload).unwrap();
                    if let Some(s) = seq { ref_seqs.insert(src, s); }
                }
                Op::Register { worker, model } => {
                    let src = SourceKey { worker, dp_rank: 0 };
                    di.register_source(src, &model, "tok").unwrap();
                    reference.register_source(src, &model, "tok");
                }
                Op::Pin(keys) => { di.pin(&keys).unwrap(); reference.pin(&keys); }
                Op::Unpin(keys) => { di.unpin(&keys).unwrap(); reference.unpin(&keys); }
                Op::Clear { worker, dp } => {
                    let src = SourceKey { worker, dp_rank: dp };
                    prop_assert_eq!(di.clear_source(src).unwrap(), reference.clear_source(src));
                }
                Op::ClearMedium { worker, dp, medium } => {
                    let src = SourceKey { worker, dp_rank: dp };
                    let m = Medium::parse(Some(medium));
                    prop_assert_eq!(di.clear_medium(src, &m).unwrap(), reference.clear_medium(src, &m));
                }
                Op::RemoveWorker(w) => {
                    prop_assert_eq!(di.remove_worker(w).unwrap(), reference.remove_worker(w));
                    ref_seqs.retain(|s, _| s.worker != w);
                }
                Op::Snapshot => { di.snapshot().unwrap(); }
                Op::Reopen => {
                    dur.take().unwrap().close().unwrap();
                    dur = Some(DurableIndex::open(&d.0, opts.clone()).unwrap());
                }
                Op::Crash => {
                    drop(dur.take());
                    dur = Some(DurableIndex::open(&d.0, opts.clone()).unwrap());
                }
            }
            let di = dur.as_ref().unwrap();
            prop_assert!(di.index().state_eq(&reference));
            prop_assert_eq!(di.last_seqs(), &ref_seqs);
        }
        // And once more from disk alone.
        drop(dur.take());
        let di = DurableIndex::open(&d.0, opts).unwrap();
        prop_assert!(di.index().state_eq(&reference));
        prop_assert_eq!(di.last_seqs(), &ref_seqs);
    }
}

fn stored(h: u64, parent: Option<u64>, t: u32) -> Ev {
    Ev::Stored {
        hashes: vec![h],
        parent,
        tokens: vec![t, t + 1],
        medium: "GPU",
    }
}

#[test]
fn a_bad_batch_stops_the_call_and_nothing_after_it_is_logged() {
    let d = TestDir::new("durable-bad");
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    let good1 = encode(&[stored(1, None, 0)], None);
    let good2 = encode(&[stored(2, Some(1), 5)], None);
    let mut di = DurableIndex::open(&d.0, options(0, 1 << 20, false)).unwrap();
    let err = di
        .apply(src, &[&good1, b"\x93garbage", &good2], Some(&[10, 11, 12]))
        .unwrap_err();
    match err {
        ApplyError::Decode { index, applied, .. } => {
            assert_eq!(index, 1);
            assert_eq!(applied.blocks_stored, 1);
        }
        other => panic!("expected a decode error, got {other}"),
    }
    let mut reference = Index::new();
    reference.apply_payload(src, &good1).unwrap();
    assert!(di.index().state_eq(&reference));
    assert_eq!(di.last_seqs().get(&src), Some(&10));
    drop(di);
    let di = DurableIndex::open(&d.0, options(0, 1 << 20, false)).unwrap();
    assert!(di.index().state_eq(&reference));
    assert_eq!(di.last_seqs().get(&src), Some(&10));
    assert_eq!(di.recovery().wal.records_replayed, 1);
}

#[test]
fn its_reads_are_those_of_the_index_it_keeps() {
    let d = TestDir::new("durable-reads");
    let src = SourceKey {
        worker: 4,
        dp_rank: 1,
    };
    let mut di = DurableIndex::open(&d.0, options(0, 1 << 20, false)).unwrap();
    let payload = encode(&[stored(1, None, 0), stored(2, Some(1), 5)], Some(1));
    di.apply(src, &[&payload], None).unwrap();
    let keys: Vec<u64> = di.index().scan(&[]).iter().map(|e| e.key).collect();
    assert_eq!(keys.len(), 2);
    let path = if di.index().scan(&keys[..1]).len() == 2 {
        keys.clone()
    } else {
        vec![keys[1], keys[0]]
    };
    let hits = IndexRead::matches(&di, &path).unwrap();
    assert_eq!(hits, IndexRead::matches(di.index(), &path).unwrap());
    assert_eq!((hits.len(), hits[0].blocks, hits[0].dp_rank), (1, 2, 1));
    assert_eq!(
        IndexRead::scan(&di, &path[..1]).unwrap(),
        di.index().scan(&path[..1])
    );
    assert_eq!(
        IndexRead::entries(&di).unwrap(),
        di.index().entries().collect::<Vec<_>>()
    );
    assert_eq!(IndexRead::stats(&di).unwrap(), di.index().stats());
}

#[test]
fn snapshot_prunes_the_log_and_recovery_uses_it() {
    let d = TestDir::new("durable-snap");
    let src = SourceKey {
        worker: 3,
        dp_rank: 0,
    };
    let mut di = DurableIndex::open(&d.0, options(0, 256, false)).unwrap();
    for i in 0..50u64 {
        let p = encode(&[stored(i + 1, (i > 0).then_some(i), i as u32)], None);
        di.apply(src, &[&p], Some(&[i])).unwrap();
    }
    let segments_before = fs::read_dir(d.0.join("wal")).unwrap().count();
    let lsn = di.snapshot().unwrap();
    assert_eq!(lsn, 50);
    let segments_after = fs::read_dir(d.0.join("wal")).unwrap().count();
    assert!(
        segments_after < segments_before,
        "{segments_after} >= {segments_before}"
    );
    let p = encode(&[stored(99, Some(50), 7)], None);
    di.apply(src, &[&p], Some(&[50])).unwrap();
    let expected = di.index().logical_state();
    drop(di); // crash: the last batch is only in the log
    let di = DurableIndex::open(&d.0, options(0, 256, false)).unwrap();
    assert_eq!(di.recovery().snapshot_lsn, Some(50));
    assert_eq!(di.recovery().wal.records_replayed, 1);
    assert_eq!(di.index().logical_state(), expected);
    assert_eq!(di.last_seqs().get(&src), Some(&50));
}

#[test]
fn a_damaged_snapshot_is_a_clear_error() {
    let d = TestDir::new("durable-badsnap");
    let mut di = DurableIndex::open(&d.0, options(0, 1 << 20, false)).unwrap();
    let p = encode(&[stored(1, None, 0)], None);
    di.apply(
        SourceKey {
            worker: 1,
            dp_rank: 0,
        },
        &[&p],
        None,
    )
    .unwrap();
    di.close().unwrap();
    let snap = fs::read_dir(&d.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "qcsnap"))
        .unwrap();
    let mut bytes = fs::read(&snap).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    fs::write(&snap, bytes).unwrap();
    match DurableIndex::open(&d.0, options(0, 1 << 20, false)) {
        Err(super::PersistError::CorruptSnapshot { reason, .. }) => {
            assert!(reason.contains("checksum"), "{reason}")
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("a damaged snapshot was accepted"),
    }
}

/// A snapshot file of the previous layout (version 1: the image's length before
/// it) still opens, to the same index.
#[test]
fn a_version_1_snapshot_file_still_opens() {
    let d = TestDir::new("durable-v1snap");
    let mut di = DurableIndex::open(&d.0, options(0, 1 << 20, false)).unwrap();
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    let p = encode(&[stored(1, None, 0)], None);
    di.apply(src, &[&p], Some(&[7])).unwrap();
    let want = di.index().clone();
    di.close().unwrap();
    let snap = fs::read_dir(&d.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "qcsnap"))
        .unwrap();
    let v2 = fs::read(&snap).unwrap();
    // magic, version, lsn, one (worker, dp, seq), then the image up to the CRC.
    let head = 8 + 4 + 8 + 8 + 20;
    assert_eq!(&v2[8..12], &2u32.to_le_bytes());
    let image = &v2[head..v2.len() - 4];
    let mut v1 = v2[..head].to_vec();
    v1[8..12].copy_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&(image.len() as u64).to_le_bytes());
    v1.extend_from_slice(image);
    let crc = crc32fast::hash(&v1);
    v1.extend_from_slice(&crc.to_le_bytes());
    fs::write(&snap, v1).unwrap();
    let di = DurableIndex::open(&d.0, options(0, 1 << 20, false)).unwrap();
    assert!(di.index().state_eq(&want));
    assert_eq!(di.last_seqs().get(&src), Some(&7));
}

/// Periodic snapshots, by log bytes and by time, written in the background: after
/// a crash (drop without close) recovery starts from one and replays only the tail.
#[test]
fn periodic_background_snapshots_bound_the_replayed_tail() {
    let src = SourceKey {
        worker: 2,
        dp_rank: 0,
    };
    let by_bytes = options(2000, 1 << 20, true);
    let by_time = DurableOptions {
        snapshot_every_bytes: 0,
        snapshot_every: Some(std::time::Duration::ZERO),
        ..options(0, 1 << 20, true)
    };
    for (name, opts) in [("bytes", by_bytes), ("time", by_time)] {
        let d = TestDir::new(&format!("durable-periodic-{name}"));
        let mut di = DurableIndex::open(&d.0, opts.clone()).unwrap();
        for i in 0..200u64 {
            let p = encode(&[stored(i + 1, (i > 0).then_some(i), i as u32)], None);
            di.apply(src, &[&p], Some(&[i])).unwrap();
        }
        let expected = di.index().logical_state();
        assert!(di.snapshot_error().is_none());
        drop(di); // a crash: no snapshot on close
        let di = DurableIndex::open(&d.0, opts).unwrap();
        let r = di.recovery();
        let snap = r.snapshot_lsn.expect("a periodic snapshot was taken");
        assert!(snap > 0, "{name}");
        assert_eq!(r.wal.records_replayed, 200 - snap, "{name}");
        assert!(r.wal.records_replayed < 200, "{name}: replayed everything");
        assert_eq!(di.index().logical_state(), expected, "{name}");
        assert_eq!(di.last_seqs().get(&src), Some(&199), "{name}");
    }
}

fn snapshot_file_len(dir: &std::path::Path) -> u64 {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcsnap"))
        .map(|p| fs::metadata(p).unwrap().len())
        .sum()
}

/// The size trigger is `max(min bytes, ratio x the last snapshot's size)`: each
/// inline snapshot comes with the first call that crosses it, not before, not later.
#[test]
fn the_size_trigger_scales_with_the_last_snapshot() {
    let src = SourceKey {
        worker: 4,
        dp_rank: 0,
    };
    for (min, ratio) in [(600u64, 0.0), (600, 0.5), (200, 2.0)] {
        let d = TestDir::new("durable-ratio");
        let opts = DurableOptions {
            snapshot_log_ratio: ratio,
            ..options(min, 1 << 20, false)
        };
        let mut di = DurableIndex::open(&d.0, opts).unwrap();
        let (mut since, mut snapshots) = (0u64, 0);
        for i in 0..400u64 {
            let p = encode(&[stored(i + 1, (i > 0).then_some(i), i as u32)], None);
            let trigger = min.max((ratio * snapshot_file_len(&d.0) as f64) as u64);
            assert_eq!(di.snapshot_trigger_bytes(), trigger);
            let before = di.snapshot_lsn();
            di.apply(src, &[&p], Some(&[i])).unwrap();
            let frame = super::frame::frame_len(p.len()) as u64;
            since += frame;
            if di.snapshot_lsn() != before {
                snapshots += 1;
                assert!(since >= trigger, "{min} {ratio}: {since} < {trigger}");
                assert!(since < trigger + frame, "{min} {ratio}: {since} too late");
                since = 0;
            } else {
                assert!(
                    since < trigger,
                    "{min} {ratio}: {since} >= {trigger}, no snapshot"
                );
            }
        }
        assert!(snapshots >= 2, "{min} {ratio}: {snapshots} snapshots");
    }
}

fn shared(dir: &std::path::Path, opts: DurableOptions) -> std::sync::Arc<super::SharedDurable> {
    std::sync::Arc::new(std::sync::RwLock::new(Some(
        DurableIndex::open(dir, opts).unwrap(),
    )))
}

/// With ingest idle, the timer takes the time-triggered snapshot (and adopts it),
/// so a crash afterwards replays nothing.
#[test]
fn the_timer_snapshots_an_idle_index() {
    let d = TestDir::new("durable-idle");
    let opts = DurableOptions {
        snapshot_every: Some(std::time::Duration::from_millis(40)),
        ..options(0, 1 << 20, true)
    };
    let ix = shared(&d.0, opts.clone());
    let period = ix.read().unwrap().as_ref().unwrap().tick_period();
    assert_eq!(period, std::time::Duration::from_millis(10));
    let _ticker = super::SnapshotTicker::spawn(std::sync::Arc::downgrade(&ix), period).unwrap();
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    {
        let mut g = ix.write().unwrap();
        let di = g.as_mut().unwrap();
        for i in 0..10u64 {
            let p = encode(&[stored(i + 1, (i > 0).then_some(i), i as u32)], None);
            di.apply(src, &[&p], Some(&[i])).unwrap();
        }
        assert_eq!(di.snapshot_lsn(), 0, "snapshotted before the period passed");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while ix.read().unwrap().as_ref().unwrap().snapshot_lsn() != 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "no snapshot while idle"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let expected = ix.read().unwrap().as_ref().unwrap().index().logical_state();
    drop(ix.write().unwrap().take()); // a crash
    let di = DurableIndex::open(&d.0, opts).unwrap();
    assert_eq!(di.recovery().snapshot_lsn, Some(10));
    assert_eq!(di.recovery().wal.records_replayed, 0);
    assert_eq!(di.index().logical_state(), expected);
}

/// A timer snapshotting at every tick (1 ms) while two threads apply and one reads:
/// no call is lost or half-applied, and a crash recovers exactly the reference.
#[test]
fn the_timer_and_concurrent_applies_do_not_race() {
    for background in [true, false] {
        let d = TestDir::new("durable-race");
        let opts = DurableOptions {
            snapshot_every: Some(std::time::Duration::ZERO),
            ..options(0, 4096, background)
        };
        let ix = shared(&d.0, opts.clone());
        let mut ticker = super::SnapshotTicker::spawn(
            std::sync::Arc::downgrade(&ix),
            std::time::Duration::from_millis(1),
        )
        .unwrap();
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let ix = std::sync::Arc::clone(&ix);
                std::thread::spawn(move || {
                    let src = SourceKey {
                        worker: w,
                        dp_rank: 0,
                    };
                    for i in 0..300u64 {
                        let h = w * 1_000_000 + i + 1;
                        let p = encode(&[stored(h, (i > 0).then_some(h - 1), i as u32)], None);
                        let mut g = ix.write().unwrap();
                        g.as_mut().unwrap().apply(src, &[&p], Some(&[i])).unwrap();
                    }
                })
            })
            .collect();
        let reader = {
            let ix = std::sync::Arc::clone(&ix);
            std::thread::spawn(move || {
                for _ in 0..300 {
                    let g = ix.read().unwrap();
                    let _ = g.as_ref().unwrap().index().logical_state();
                }
            })
        };
        for t in writers {
            t.join().unwrap();
        }
        reader.join().unwrap();
        // On a fast release build the writers can finish before the 1 ms timer ever
        // wins the lock: give it a bounded while to take (and, in the background
        // mode, adopt) a snapshot before it is stopped.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ix.read().unwrap().as_ref().unwrap().snapshot_lsn() == 0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        ticker.stop();
        let mut reference = Index::new();
        for w in 0..2u64 {
            for i in 0..300u64 {
                let h = w * 1_000_000 + i + 1;
                let p = encode(&[stored(h, (i > 0).then_some(h - 1), i as u32)], None);
                let src = SourceKey {
                    worker: w,
                    dp_rank: 0,
                };
                reference.apply_payload(src, &p).unwrap();
            }
        }
        let di = ix.write().unwrap().take().unwrap();
        assert!(di.index().state_eq(&reference));
        assert!(di.snapshot_error().is_none(), "{:?}", di.snapshot_error());
        assert!(di.snapshot_lsn() > 0, "the timer never snapshotted");
        drop(di); // a crash
        let di = DurableIndex::open(&d.0, opts).unwrap();
        assert!(di.index().state_eq(&reference), "background={background}");
        for w in 0..2u64 {
            let src = SourceKey {
                worker: w,
                dp_rank: 0,
            };
            assert_eq!(di.last_seqs().get(&src), Some(&299));
        }
    }
}
