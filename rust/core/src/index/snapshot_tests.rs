//! The snapshot image: round trips against the index state, the previous versions,
//! and damaged images that pass the checksum (a writer bug) or do not.

use proptest::prelude::*;

use crate::index::{Index, SourceKey};
use crate::persist::durable_tests::{encode, ev_strategy, Ev};

use super::{
    put_node_v5, NodeRecord, Out, SnapshotError, MAGIC, NIL, PARALLEL_CHECK_MIN_NODES, VERSION,
    VERSION_V3,
};

#[derive(Debug, Clone)]
enum Op {
    Apply { worker: u64, events: Vec<Ev> },
    Pin(Vec<u64>),
    Unpin(Vec<u64>),
    RemoveWorker(u64),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let keys = prop::collection::vec(1u64..40, 1..4);
    prop_oneof![
        10 => (0u64..4, prop::collection::vec(ev_strategy(), 1..4))
            .prop_map(|(worker, events)| Op::Apply { worker, events }),
        1 => keys.clone().prop_map(Op::Pin),
        1 => keys.prop_map(Op::Unpin),
        1 => (0u64..4).prop_map(Op::RemoveWorker),
    ]
}

fn run(index: &mut Index, ops: &[Op]) {
    for op in ops {
        match op {
            Op::Apply { worker, events } => {
                let src = SourceKey {
                    worker: *worker,
                    dp_rank: 0,
                };
                index.register_source(src, "m", "t");
                index.apply_payload(src, &encode(events, None)).unwrap();
            }
            Op::Pin(keys) => index.pin(keys),
            Op::Unpin(keys) => index.unpin(keys),
            Op::RemoveWorker(w) => {
                index.remove_worker(*w);
            }
        }
    }
}

fn image(index: &Index) -> Vec<u8> {
    let mut out = Vec::new();
    index.write_snapshot(&mut out).unwrap();
    out
}

/// The live node ids in slab order (the order of the records of versions 4 and 5).
fn slab_order(index: &Index) -> Vec<u32> {
    (0..index.tree.nodes.len() as u32)
        .filter(|&id| index.tree.is_live(id))
        .collect()
}

/// A version 4 image, as its writer wrote it (slab order).
fn v4_image(index: &Index) -> Vec<u8> {
    index.v4_image_in_order(&slab_order(index))
}

/// A version 5 image of `index` with the node records (slab order) edited by
/// `edit`, which sees each record with its ordinal and may change anything; depths
/// are written explicitly when edited records may no longer imply them.
fn v5_image_with(index: &Index, edit: impl Fn(u32, &mut NodeRecord)) -> Vec<u8> {
    let mut out = Vec::new();
    let mut o = Out::new(&mut out);
    index.write_head(&mut o, VERSION);
    let order = slab_order(index);
    let ordinal = |id: u32| order.iter().position(|&x| x == id).unwrap() as u32;
    for (ord, &id) in order.iter().enumerate() {
        let n = index.tree.node(id);
        let mut record = NodeRecord {
            key: index.tree.key(id),
            parent: if n.parent_id == NIL {
                NIL
            } else {
                ordinal(n.parent_id)
            },
            root_parent: index.tree.parent_key(id),
            depth: n.depth(),
            pins: n.pins,
            ehash: n.ehash(),
        };
        edit(ord as u32, &mut record);
        let holders = index.tree.holders(id);
        put_node_v5(
            &mut o,
            ord as u32,
            &record,
            false,
            holders.as_slice(&index.tree.spills),
        );
    }
    o.finish().unwrap();
    out
}

/// Replaces the trailing CRC so that a deliberate edit passes the checksum.
fn reseal(buf: &mut [u8]) {
    let body = buf.len() - 4;
    let crc = crc32fast::hash(&buf[..body]);
    buf[body..].copy_from_slice(&crc.to_le_bytes());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The loaded index equals the original, and keeps behaving like it: the same
    /// further operations on both give equal states (tables, free slots and child
    /// links were rebuilt correctly, not just the visible state).
    #[test]
    fn round_trip_equals_the_index(
        before in prop::collection::vec(op_strategy(), 0..40),
        after in prop::collection::vec(op_strategy(), 0..20),
    ) {
        let mut original = Index::new();
        run(&mut original, &before);
        let mut loaded = Index::from_snapshot_bytes(&image(&original)).unwrap();
        prop_assert!(loaded.state_eq(&original));
        prop_assert_eq!(loaded.check_invariants(), Ok(()));
        prop_assert_eq!(loaded.stats().blocks, original.stats().blocks);
        run(&mut original, &after);
        run(&mut loaded, &after);
        prop_assert!(loaded.state_eq(&original));
        prop_assert_eq!(loaded.check_invariants(), Ok(()));
        // Writing the loaded index gives a loadable image of the same state.
        let again = Index::from_snapshot_bytes(&image(&loaded)).unwrap();
        prop_assert!(again.state_eq(&original));
    }

    /// The loaded slab is the writer's, freed slots squeezed out: a path stored block
    /// after block is still a run of consecutive slots for `match`.
    #[test]
    fn the_loaded_slab_keeps_the_writers_order(
        ops in prop::collection::vec(op_strategy(), 0..40),
    ) {
        let mut original = Index::new();
        run(&mut original, &ops);
        let loaded = Index::from_snapshot_bytes(&image(&original)).unwrap();
        let live: Vec<u64> = (0..original.tree.nodes.len() as u32)
            .filter(|&id| original.tree.is_live(id))
            .map(|id| original.tree.key(id))
            .collect();
        let slab: Vec<u64> = loaded.tree.hot.iter().map(|n| n.key).collect();
        prop_assert_eq!(slab, live);
    }

    /// Images of older writers (records in key-table order) load to the
    /// same state and keep behaving like it.
    #[test]
    fn images_in_table_order_still_load(
        before in prop::collection::vec(op_strategy(), 0..40),
        after in prop::collection::vec(op_strategy(), 0..20),
    ) {
        let mut original = Index::new();
        run(&mut original, &before);
        let table_order: Vec<u32> = original.tree.ids().collect();
        let old = original.v4_image_in_order(&table_order);
        let mut loaded = Index::from_snapshot_bytes(&old).unwrap();
        prop_assert!(loaded.state_eq(&original));
        prop_assert_eq!(loaded.check_invariants(), Ok(()));
        run(&mut original, &after);
        run(&mut loaded, &after);
        prop_assert!(loaded.state_eq(&original));
    }

    /// The previous version (v4) still loads, to the same state, and keeps behaving
    /// like it.
    #[test]
    fn version_4_images_still_load(
        before in prop::collection::vec(op_strategy(), 0..40),
        after in prop::collection::vec(op_strategy(), 0..20),
    ) {
        let mut original = Index::new();
        run(&mut original, &before);
        let mut loaded = Index::from_snapshot_bytes(&v4_image(&original)).unwrap();
        prop_assert!(loaded.state_eq(&original));
        prop_assert_eq!(loaded.check_invariants(), Ok(()));
        run(&mut original, &after);
        run(&mut loaded, &after);
        prop_assert!(loaded.state_eq(&original));
    }

    /// A version 5 image with every depth written out loads to the same state as
    /// the writer's (which leaves out the depths it can): the reader derives them
    /// right.
    #[test]
    fn implied_depths_are_the_written_ones(ops in prop::collection::vec(op_strategy(), 0..40)) {
        let mut original = Index::new();
        run(&mut original, &ops);
        let explicit = Index::from_snapshot_bytes(&v5_image_with(&original, |_, _| {})).unwrap();
        prop_assert!(explicit.state_eq(&original));
        prop_assert!(Index::from_snapshot_bytes(&image(&original)).unwrap().state_eq(&explicit));
    }

    /// The oldest version still read (v3) loads, to the same state.
    #[test]
    fn version_3_images_still_load(ops in prop::collection::vec(op_strategy(), 0..40)) {
        let mut original = Index::new();
        run(&mut original, &ops);
        let loaded = Index::from_snapshot_bytes(&v3_image(&original)).unwrap();
        prop_assert!(loaded.state_eq(&original));
    }

    /// Any single flipped bit or truncation is refused, never loaded differently.
    #[test]
    fn damage_is_refused(ops in prop::collection::vec(op_strategy(), 1..20), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut original = Index::new();
        run(&mut original, &ops);
        let good = image(&original);
        let mut bad = good.clone();
        let i = at.index(bad.len());
        bad[i] ^= 1 << bit;
        prop_assert!(Index::from_snapshot_bytes(&bad).is_err());
        prop_assert!(Index::from_snapshot_bytes(&good[..i]).is_err());
    }
}

/// A chain root → a → b stored by one source; returns its version 4 image (fixed
/// fields, easy to edit in place: the checks after the records are read are the
/// same for versions 4 and 5) and the byte offset of each node record's key, in
/// record order.
fn chain_image() -> (Vec<u8>, Vec<(u64, usize)>) {
    let mut index = Index::new();
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    let ev = Ev::Stored {
        hashes: vec![11, 12, 13],
        parent: None,
        tokens: vec![1, 2, 3, 4, 5, 6],
        medium: "GPU",
    };
    index.apply_payload(src, &encode(&[ev], None)).unwrap();
    let buf = v4_image(&index);
    let keys: Vec<u64> = index.entries().map(|e| e.key).collect();
    let mut at: Vec<(u64, usize)> = keys
        .iter()
        .map(|&k| {
            let pos = buf
                .windows(8)
                .position(|w| w == k.to_le_bytes())
                .expect("every key is in the image");
            (k, pos)
        })
        .collect();
    at.sort_by_key(|&(_, pos)| pos);
    (buf, at)
}

fn parent_field(buf: &[u8], key_at: usize) -> u32 {
    u32::from_le_bytes(buf[key_at + 8..key_at + 12].try_into().unwrap())
}

fn corrupt_reason(buf: &[u8]) -> String {
    match Index::from_snapshot_bytes(buf) {
        Err(SnapshotError::Corrupt(reason)) => reason,
        Err(e) => panic!("expected a corrupt-image error, got {e}"),
        Ok(_) => panic!("a damaged image was loaded"),
    }
}

#[test]
fn a_parent_cycle_is_refused() {
    let (mut buf, at) = chain_image();
    // The two non-root records point at each other.
    let linked: Vec<usize> = at
        .iter()
        .map(|&(_, pos)| pos)
        .filter(|&pos| parent_field(&buf, pos) != u32::MAX)
        .collect();
    assert_eq!(linked.len(), 2);
    let ordinal = |pos: usize| at.iter().position(|&(_, p)| p == pos).unwrap() as u32;
    let (x, y) = (linked[0], linked[1]);
    let (ox, oy) = (ordinal(x), ordinal(y));
    buf[x + 8..x + 12].copy_from_slice(&oy.to_le_bytes());
    buf[y + 8..y + 12].copy_from_slice(&ox.to_le_bytes());
    reseal(&mut buf);
    assert!(corrupt_reason(&buf).contains("cycle"));
}

#[test]
fn an_out_of_range_or_self_parent_is_refused() {
    let (good, at) = chain_image();
    let child = at
        .iter()
        .map(|&(_, pos)| pos)
        .find(|&pos| parent_field(&good, pos) != u32::MAX)
        .unwrap();
    let own = at.iter().position(|&(_, p)| p == child).unwrap() as u32;
    for parent in [3u32, 1000, own] {
        let mut buf = good.clone();
        buf[child + 8..child + 12].copy_from_slice(&parent.to_le_bytes());
        reseal(&mut buf);
        assert!(corrupt_reason(&buf).contains("parent"), "parent {parent}");
    }
}

#[test]
fn a_repeated_key_is_refused() {
    let (mut buf, at) = chain_image();
    let (first_key, _) = at[0];
    let second = at[1].1;
    buf[second..second + 8].copy_from_slice(&first_key.to_le_bytes());
    reseal(&mut buf);
    assert!(corrupt_reason(&buf).contains("twice"));
}

#[test]
fn an_unknown_version_names_the_supported_ones() {
    let (mut buf, _) = chain_image();
    buf[MAGIC.len()..MAGIC.len() + 4].copy_from_slice(&9u32.to_le_bytes());
    reseal(&mut buf);
    match Index::from_snapshot_bytes(&buf) {
        Err(e @ SnapshotError::UnsupportedVersion(9)) => {
            assert!(e.to_string().contains("versions 3 to 5"), "{e}")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// The version 3 writer (the format before this one), kept to test its reader.
fn v3_image(index: &Index) -> Vec<u8> {
    let mut o: Vec<u8> = Vec::new();
    let u32_ = |o: &mut Vec<u8>, x: u32| o.extend_from_slice(&x.to_le_bytes());
    let u64_ = |o: &mut Vec<u8>, x: u64| o.extend_from_slice(&x.to_le_bytes());
    let str_ = |o: &mut Vec<u8>, s: &str| {
        o.extend_from_slice(&(s.len() as u32).to_le_bytes());
        o.extend_from_slice(s.as_bytes());
    };
    o.extend_from_slice(MAGIC);
    u32_(&mut o, VERSION_V3);
    u64_(&mut o, index.media.all().len() as u64);
    for m in index.media.all() {
        str_(&mut o, m.as_str());
    }
    u64_(&mut o, index.sources.len() as u64);
    for (slot, s) in index.sources.iter() {
        u32_(&mut o, slot);
        u64_(&mut o, s.key.worker);
        u32_(&mut o, s.key.dp_rank);
        str_(&mut o, &s.model);
        str_(&mut o, &s.tokenizer);
        u64_(&mut o, s.engine.len() as u64);
        for (&folded, &key) in &s.engine {
            u64_(&mut o, folded);
            u64_(&mut o, key);
        }
    }
    u64_(&mut o, index.tree.len() as u64);
    for id in index.tree.ids() {
        let n = index.tree.node(id);
        u64_(&mut o, index.tree.key(id));
        u64_(&mut o, index.tree.parent_key(id));
        o.push((n.parent_id != super::NIL) as u8);
        u32_(&mut o, n.depth());
        u32_(&mut o, n.pins);
        match n.ehash() {
            Some(e) => {
                o.push(1);
                u64_(&mut o, e);
            }
            None => o.push(0),
        }
        let hs = index.tree.holders(id);
        let hs = hs.as_slice(&index.tree.spills);
        u32_(&mut o, hs.len() as u32);
        for &h in hs {
            u64_(&mut o, h);
        }
    }
    let crc = crc32fast::hash(&o);
    u32_(&mut o, crc);
    o
}

/// An image large enough that the cycle check runs on its own thread: a cycle is
/// still refused (and reported before anything else).
#[test]
fn a_parent_cycle_in_a_large_image_is_refused() {
    let n = PARALLEL_CHECK_MIN_NODES as u64 + 8;
    let mut index = Index::new();
    let ev = Ev::Stored {
        hashes: (1..=n).collect(),
        parent: None,
        tokens: (0..2 * n as u32).collect(),
        medium: "GPU",
    };
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    index.apply_payload(src, &encode(&[ev], None)).unwrap();
    let mut buf = v4_image(&index);
    // Two linked nodes in the middle of the chain, by their record ordinals (the
    // records are in slab order).
    let order: Vec<(u64, u32)> = (0..index.tree.nodes.len() as u32)
        .filter(|&id| index.tree.is_live(id))
        .map(|id| (index.tree.key(id), index.tree.node(id).parent_id))
        .collect();
    let linked: Vec<usize> = (0..order.len())
        .filter(|&o| order[o].1 != u32::MAX)
        .take(2)
        .collect();
    let at = |key: u64| {
        buf.windows(8)
            .position(|w| w == key.to_le_bytes())
            .expect("the key is in the image")
    };
    let (x, y) = (at(order[linked[0]].0), at(order[linked[1]].0));
    buf[x + 8..x + 12].copy_from_slice(&(linked[1] as u32).to_le_bytes());
    buf[y + 8..y + 12].copy_from_slice(&(linked[0] as u32).to_le_bytes());
    reseal(&mut buf);
    assert!(Index::from_snapshot_bytes(&image(&index)).is_ok());
    assert!(corrupt_reason(&buf).contains("cycle"));
}

/// The chain root → a → b of `chain_image`, as an index.
fn chain_index() -> Index {
    let mut index = Index::new();
    let ev = Ev::Stored {
        hashes: vec![11, 12, 13],
        parent: None,
        tokens: vec![1, 2, 3, 4, 5, 6],
        medium: "GPU",
    };
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    index.apply_payload(src, &encode(&[ev], None)).unwrap();
    index
}

/// Version 5 records that pass the checksum but describe no index the writer
/// could have written are refused, each with its reason.
#[test]
fn damaged_version_5_records_are_refused() {
    let index = chain_index();
    assert!(Index::from_snapshot_bytes(&v5_image_with(&index, |_, _| {})).is_ok());
    // Records 1 and 2 (a, b) point at each other.
    let cycle = v5_image_with(&index, |ord, r| match ord {
        1 => r.parent = 2,
        2 => r.parent = 1,
        _ => {}
    });
    assert!(corrupt_reason(&cycle).contains("cycle"));
    for parent in [3u32, 1000, 2] {
        let bad = v5_image_with(&index, |ord, r| {
            if ord == 2 {
                r.parent = parent;
            }
        });
        assert!(corrupt_reason(&bad).contains("parent"), "parent {parent}");
    }
    let twice = v5_image_with(&index, |ord, r| {
        if ord == 1 {
            r.key = index.tree.key(0);
        }
    });
    assert!(corrupt_reason(&twice).contains("twice"));
    // A depth left to a parent that is not the previous record.
    let mut far = v5_image_with(&index, |ord, r| {
        if ord == 2 {
            r.parent = 0;
        }
    });
    let last = far.len() - 4 - (1 + 8 + 1 + 1 + 8 + 1 + 1);
    assert_eq!(
        far[last] & (super::FAR_PARENT | super::DEPTH),
        super::FAR_PARENT | super::DEPTH
    );
    far[last] &= !super::DEPTH;
    far.remove(last + 1 + 8 + 1);
    reseal(&mut far);
    assert!(corrupt_reason(&far).contains("no depth"));
}

/// The writer leaves out what it can: a stored chain's records are flags, key,
/// primary hash and one small holder, far less than the fixed fields of version 4.
#[test]
fn version_5_records_are_small() {
    let mut index = Index::new();
    let n = 1000u64;
    let ev = Ev::Stored {
        hashes: (1..=n).collect(),
        parent: None,
        tokens: (0..2 * n as u32).collect(),
        medium: "GPU",
    };
    let src = SourceKey {
        worker: 1,
        dp_rank: 0,
    };
    index.apply_payload(src, &encode(&[ev], None)).unwrap();
    let (v5, v4) = (image(&index), v4_image(&index));
    // flags 1 + key 8 + primary hash 8 + holder id 2 + refcount 1.
    assert!(v5.len() < 21 * n as usize + 200, "{} bytes", v5.len());
    assert!(v4.len() > 41 * n as usize, "{} bytes", v4.len());
}
