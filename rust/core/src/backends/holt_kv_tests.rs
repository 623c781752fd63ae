//! Holt 0.9.2's blob slot limit, and what `HoltKv` does about it: the failing write
//! is refused with a typed error, nothing of it becomes visible or durable, and a
//! reopen recovers exactly the acknowledged writes.

use std::collections::BTreeMap;

use holt::{Durability, TreeBuilder};

use super::HoltKv;
use crate::backends::{KvErrorKind, KvOp, KvStore};
use crate::persist::wal_tests::TestDir;

/// Keys shaped like the index's child links (`C` parent child, empty value: a
/// 40-byte leaf), all under one parent: small nodes fill a blob frame's 10,240
/// slots before its data area.
fn child_links(rng: &mut u64, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|_| {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            let mut k = vec![b'C'];
            k.extend_from_slice(&7u64.to_be_bytes());
            k.extend_from_slice(&rng.to_be_bytes());
            k
        })
        .collect()
}

/// Writes batches of `batch` child links plus a counter record until a write fails
/// (or `max_keys`); returns the acknowledged state and the error of the failed write.
fn fill_until_refused(
    store: &mut HoltKv,
    batch: usize,
    max_keys: usize,
) -> (BTreeMap<Vec<u8>, Vec<u8>>, Option<crate::backends::KvError>) {
    let mut acked = BTreeMap::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut written = 0usize;
    let mut round = 0u64;
    while written < max_keys {
        round += 1;
        let mut ops: Vec<KvOp> = child_links(&mut rng, batch)
            .into_iter()
            .map(|k| (k, Some(Vec::new())))
            .collect();
        ops.push((b"M".to_vec(), Some(round.to_le_bytes().to_vec())));
        match store.write(ops.clone()) {
            Ok(()) => {
                for (k, v) in ops {
                    acked.insert(k, v.expect("puts only"));
                }
                written += batch;
            }
            Err(e) => return (acked, Some(e)),
        }
    }
    (acked, None)
}

#[test]
fn the_slot_limit_refuses_the_write_and_a_reopen_recovers_the_acknowledged_state() {
    let d = TestDir::new("holt-slots");
    let path = d.0.join("tree");
    // sync: Holt drops its unsynced WAL buffer when a tree is dropped unflushed.
    let mut store = HoltKv::open(&path, true).unwrap();
    let (acked, err) = fill_until_refused(&mut store, 64, 40_000);
    let err = err.expect("holt 0.9.2 runs out of blob slots near 10,240 small keys");
    assert_eq!(err.kind, KvErrorKind::Refused, "{err}");
    assert!(err.message.contains("slot table exhausted"), "{err}");
    assert!(err.message.contains("10240 nodes"), "{err}");
    assert!(err.message.contains("reopen"), "{err}");
    // Between 9 k and 11 k acknowledged links: the limit is per frame, not a leak.
    assert!((9_000..11_000).contains(&acked.len()), "{}", acked.len());

    // Every later call is refused: the tree may hold part of the failed batch.
    assert!(store.poisoned().unwrap().contains("slot table exhausted"));
    for e in [
        store.get(b"M").unwrap_err(),
        store.scan_prefix(b"C").unwrap_err(),
        store.write(vec![(b"x".to_vec(), None)]).unwrap_err(),
        store.flush().unwrap_err(),
    ] {
        assert_eq!(e.kind, KvErrorKind::Refused, "{e}");
    }
    drop(store);

    let reopened = HoltKv::open(&path, true).unwrap();
    let got: BTreeMap<Vec<u8>, Vec<u8>> = reopened.scan_prefix(b"").unwrap().into_iter().collect();
    assert_eq!(got.len(), acked.len());
    assert!(
        got == acked,
        "reopened state differs from the acknowledged writes"
    );
}

/// Why `HoltKv` poisons itself: Holt 0.9.2 applies an atomic batch op by op and
/// does not undo the ops before a failing one. If this canary fails, Holt changed
/// (docs/persistence.md, "Holt's blob slot limit", needs a re-check).
#[test]
fn holt_0_9_2_keeps_part_of_a_failed_atomic_batch_in_memory() {
    let d = TestDir::new("holt-partial");
    let tree = TreeBuilder::new(d.0.join("tree"))
        .durability(Durability::Wal { sync: false })
        .open()
        .unwrap();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..1_000 {
        let keys = child_links(&mut rng, 64);
        let result = tree.atomic(|b| {
            for k in &keys {
                b.put(k, b"");
            }
        });
        if let Err(e) = result {
            assert!(e.to_string().contains("slot table exhausted"), "{e}");
            let visible = keys
                .iter()
                .filter(|k| tree.get(k).unwrap().is_some())
                .count();
            assert!(
                visible > 0 && visible < keys.len(),
                "round {round}: {visible} of {} keys of the failed batch visible",
                keys.len()
            );
            return;
        }
    }
    panic!("no write failed within 64,000 keys");
}
