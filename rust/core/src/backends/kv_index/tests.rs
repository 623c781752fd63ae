//! KvIndex (over the in-memory store) against `crate::index::Index` on random
//! operation streams: same stats, same logical state, same matches and scans.

use proptest::prelude::*;

use crate::backends::mem_kv::MemKv;
use crate::events::Medium;
use crate::index::{Index, IndexRead, SourceKey};
use crate::persist::durable_tests::{encode, Ev, BS};

use super::KvIndex;
use crate::backends::KvStore;

#[derive(Debug, Clone)]
enum Op {
    Apply {
        worker: u64,
        dp: u32,
        events: Vec<Ev>,
    },
    Register {
        worker: u64,
        model: &'static str,
    },
    Pin(usize),
    Unpin(usize),
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
}

fn ev() -> impl Strategy<Value = Ev> {
    let medium = prop::sample::select(vec!["GPU", "CPU"]);
    prop_oneof![
        6 => (1u64..10, prop::option::of(1u64..10), 1usize..4, medium.clone(), 0u32..3, prop::bool::weighted(0.1)).prop_map(
            |(h, parent, n, medium, salt, no_tokens)| Ev::Stored {
                hashes: (0..n as u64).map(|i| h * 16 + i).collect(),
                parent: parent.map(|p| p * 16 + 1),
                tokens: if no_tokens { vec![] } else { (0..n as u32 * BS).map(|t| t % 3 + salt).collect() },
                medium,
            }
        ),
        3 => (prop::collection::vec(0u64..170, 1..3), medium).prop_map(|(hashes, medium)| Ev::Removed { hashes, medium }),
        1 => Just(Ev::Cleared),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (0u64..3, 0u32..2, prop::collection::vec(ev(), 0..4))
            .prop_map(|(worker, dp, events)| Op::Apply { worker, dp, events }),
        1 => (0u64..3, prop::sample::select(vec!["m1", "m2"])).prop_map(|(worker, model)| Op::Register { worker, model }),
        1 => (0usize..50).prop_map(Op::Pin),
        1 => (0usize..50).prop_map(Op::Unpin),
        1 => (0u64..3, 0u32..2).prop_map(|(worker, dp)| Op::Clear { worker, dp }),
        2 => (0u64..3, 0u32..2, prop::sample::select(vec!["CPU", "GPU", "DISK"]))
            .prop_map(|(worker, dp, medium)| Op::ClearMedium { worker, dp, medium }),
        1 => (0u64..3).prop_map(Op::RemoveWorker),
    ]
}

/// A path of keys ending at an existing node (walking parents up), for pins/matches.
fn path_to(reference: &Index, pick: usize) -> Vec<u64> {
    let state = reference.logical_state();
    let Some((&key, _)) = state.nodes.iter().nth(pick % state.nodes.len().max(1)) else {
        return vec![pick as u64 + 1];
    };
    let mut path = vec![key];
    let mut cur = key;
    while let Some((parent, _, _, _)) = state.nodes.get(&cur) {
        if !state.nodes.contains_key(parent) || path.len() > 64 {
            break;
        }
        path.push(*parent);
        cur = *parent;
    }
    path.reverse();
    path
}

fn check_against_native<S: KvStore>(
    store: S,
    ops: Vec<Op>,
    probe: usize,
) -> Result<(), TestCaseError> {
    let mut reference = Index::new();
    let mut kv = KvIndex::open(store).unwrap();

    for op in ops {
        match op {
            Op::Apply { worker, dp, events } => {
                let src = SourceKey {
                    worker,
                    dp_rank: dp,
                };
                let p = encode(&events, Some(dp));
                prop_assert_eq!(
                    kv.apply_payload(src, &p).unwrap(),
                    reference.apply_payload(src, &p).unwrap()
                );
            }
            Op::Register { worker, model } => {
                let src = SourceKey { worker, dp_rank: 0 };
                kv.register_source(src, model, "t").unwrap();
                reference.register_source(src, model, "t");
            }
            Op::Pin(i) => {
                let path = path_to(&reference, i);
                kv.pin(&path).unwrap();
                reference.pin(&path);
            }
            Op::Unpin(i) => {
                let path = path_to(&reference, i);
                kv.unpin(&path).unwrap();
                reference.unpin(&path);
            }
            Op::Clear { worker, dp } => {
                let src = SourceKey {
                    worker,
                    dp_rank: dp,
                };
                prop_assert_eq!(kv.clear_source(src).unwrap(), reference.clear_source(src));
            }
            Op::ClearMedium { worker, dp, medium } => {
                let src = SourceKey {
                    worker,
                    dp_rank: dp,
                };
                let m = Medium::parse(Some(medium));
                prop_assert_eq!(
                    kv.clear_medium(src, &m).unwrap(),
                    reference.clear_medium(src, &m)
                );
                reference.check_invariants().map_err(TestCaseError::fail)?;
            }
            Op::RemoveWorker(w) => {
                prop_assert_eq!(kv.remove_worker(w).unwrap(), reference.remove_worker(w));
            }
        }
        prop_assert_eq!(kv.logical_state().unwrap(), reference.logical_state());
        let s = reference.stats();
        prop_assert_eq!(
            kv.counts().unwrap(),
            (s.blocks, s.nodes, s.resident_pairs, s.sources, s.pinned)
        );
    }
    let path = path_to(&reference, probe);
    let want: Vec<(u64, u32, String, u32)> = reference
        .match_keys(&path)
        .into_iter()
        .map(|h| {
            (
                h.worker,
                h.dp_rank,
                reference.medium_name(h.medium).to_string(),
                h.blocks,
            )
        })
        .collect();
    prop_assert_eq!(kv.match_keys(&path).unwrap(), want);
    for cut in [0, 1, path.len()] {
        prop_assert_eq!(
            kv.scan(&path[..cut.min(path.len())]).unwrap(),
            reference.scan(&path[..cut.min(path.len())])
        );
    }
    check_reads_agree(&kv, &reference, &path)
}

/// The shared reads (`IndexRead`, what the Python classes call) agree too; the stats
/// that describe storage rather than state (spills, memory) are the index's own.
fn check_reads_agree<S: KvStore>(
    kv: &KvIndex<S>,
    reference: &Index,
    path: &[u64],
) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        IndexRead::matches(kv, path).unwrap(),
        IndexRead::matches(reference, path).unwrap()
    );
    for cut in [0, 1, path.len()] {
        let prefix = &path[..cut.min(path.len())];
        prop_assert_eq!(
            IndexRead::scan(kv, prefix).unwrap(),
            IndexRead::scan(reference, prefix).unwrap()
        );
    }
    let mut entries = IndexRead::entries(reference).unwrap();
    entries.sort_by_key(|e| e.key);
    prop_assert_eq!(IndexRead::entries(kv).unwrap(), entries);
    let (k, r) = (
        IndexRead::stats(kv).unwrap(),
        IndexRead::stats(reference).unwrap(),
    );
    prop_assert_eq!(
        (k.blocks, k.nodes, k.resident_pairs, k.sources, k.pinned),
        (r.blocks, r.nodes, r.resident_pairs, r.sources, r.pinned)
    );
    prop_assert_eq!((k.spilled, k.media_folded), (0, r.media_folded));
    prop_assert_eq!(k.memory_bytes, kv.store().memory_bytes());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn kv_index_equals_the_native_index(ops in prop::collection::vec(op(), 1..50), probe in 0usize..1000) {
        check_against_native(MemKv::new(), ops, probe)?;
    }
}

#[cfg(feature = "holt")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn holt_kv_index_equals_the_native_index(ops in prop::collection::vec(op(), 1..40), probe in 0usize..1000) {
        let d = crate::persist::wal_tests::TestDir::new("holt-prop");
        let store = crate::backends::holt_kv::HoltKv::open(&d.0.join("tree"), false).unwrap();
        check_against_native(store, ops, probe)?;
    }
}

#[cfg(feature = "rocksdb")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn rocksdb_kv_index_equals_the_native_index(ops in prop::collection::vec(op(), 1..40), probe in 0usize..1000) {
        let d = crate::persist::wal_tests::TestDir::new("rocks-prop");
        let store = crate::backends::rocks::RocksKv::open(&d.0.join("db"), false).unwrap();
        check_against_native(store, ops, probe)?;
    }
}
