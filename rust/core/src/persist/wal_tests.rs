//! Tests of the write-ahead log: round trips, torn tails at every kind of cut,
//! corruption in the middle, missing segments, group-commit fsync bookkeeping.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::frame::{frame_len, Record};
use super::wal::{Durability, Wal, WalOptions};
use super::PersistError;

/// A fresh directory under the system temp dir, removed on drop.
pub(crate) struct TestDir(pub PathBuf);

impl TestDir {
    pub fn new(tag: &str) -> TestDir {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "qc-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TestDir(p)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

type Owned = (u8, u64, u32, u64, Vec<u8>);

fn opts(segment_bytes: u64, durability: Durability) -> WalOptions {
    WalOptions {
        durability,
        segment_bytes,
    }
}

fn write_all(dir: &Path, o: WalOptions, groups: &[Vec<Owned>]) {
    let (mut wal, _) = Wal::open(dir, o, 1, |_| Ok(())).unwrap();
    for g in groups {
        let recs: Vec<Record<'_>> = g
            .iter()
            .map(|(kind, worker, dp_rank, seq, p)| Record {
                kind: *kind,
                worker: *worker,
                dp_rank: *dp_rank,
                seq: *seq,
                payload: p,
            })
            .collect();
        wal.append(&recs).unwrap();
    }
    wal.close().unwrap();
}

fn read_all(
    dir: &Path,
    from: u64,
) -> Result<(Vec<(u64, Owned)>, super::RecoveryReport), PersistError> {
    let mut got = Vec::new();
    let (wal, report) = Wal::open(dir, opts(1 << 20, Durability::None), from, |r| {
        let x = r.record;
        got.push((
            r.lsn,
            (x.kind, x.worker, x.dp_rank, x.seq, x.payload.to_vec()),
        ));
        Ok(())
    })?;
    drop(wal);
    Ok((got, report))
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    v.sort();
    v
}

fn base_of(p: &Path) -> u64 {
    p.file_stem().unwrap().to_str().unwrap().parse().unwrap()
}

fn owned(i: u64, len: usize) -> Owned {
    (1, i % 3, (i % 2) as u32, i, vec![i as u8; len])
}

#[test]
fn round_trip_across_segments_and_replay_from_an_lsn() {
    let d = TestDir::new("wal-rt");
    let groups: Vec<Vec<Owned>> = (0..40)
        .map(|g| (0..3).map(|j| owned(g * 3 + j, 50)).collect())
        .collect();
    write_all(&d.0, opts(400, Durability::PerBatch), &groups);
    assert!(segments(&d.0).len() > 5, "small segments must rotate");
    let flat: Vec<Owned> = groups.concat();
    let (got, report) = read_all(&d.0, 1).unwrap();
    assert_eq!(report.torn_tail, None);
    assert_eq!(report.last_lsn, flat.len() as u64);
    assert_eq!(got.len(), flat.len());
    for (i, (lsn, r)) in got.iter().enumerate() {
        assert_eq!(*lsn, i as u64 + 1);
        assert_eq!(r, &flat[i]);
    }
    let (tail, report) = read_all(&d.0, 100).unwrap();
    assert_eq!(report.records_replayed, 21);
    assert_eq!(tail.first().unwrap().0, 100);
}

#[test]
fn appending_continues_after_reopen() {
    let d = TestDir::new("wal-cont");
    write_all(
        &d.0,
        opts(300, Durability::None),
        &[vec![owned(1, 10), owned(2, 10)]],
    );
    write_all(&d.0, opts(300, Durability::None), &[vec![owned(3, 10)]]);
    let (got, _) = read_all(&d.0, 1).unwrap();
    let lsns: Vec<u64> = got.iter().map(|g| g.0).collect();
    assert_eq!(lsns, vec![1, 2, 3]);
    assert_eq!(got[2].1, owned(3, 10));
}

#[test]
fn damage_in_the_middle_is_an_error_never_a_skip() {
    let d = TestDir::new("wal-mid");
    write_all(
        &d.0,
        opts(1 << 20, Durability::None),
        &[(0..10).map(|i| owned(i, 20)).collect()],
    );
    let seg = &segments(&d.0)[0];
    let mut bytes = fs::read(seg).unwrap();
    let third_frame = 16 + 2 * frame_len(20);
    bytes[third_frame + 20] ^= 0xff;
    fs::write(seg, &bytes).unwrap();
    match read_all(&d.0, 1) {
        Err(PersistError::CorruptLog { offset, reason, .. }) => {
            assert_eq!(offset as usize, third_frame);
            assert!(reason.contains("followed by a valid record"), "{reason}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

#[test]
fn damage_in_an_earlier_segment_is_an_error() {
    let d = TestDir::new("wal-seg");
    let groups: Vec<Vec<Owned>> = (0..20).map(|i| vec![owned(i, 60)]).collect();
    write_all(&d.0, opts(200, Durability::None), &groups);
    let segs = segments(&d.0);
    assert!(segs.len() >= 3);
    // Cut the first segment's last frame in half: torn, but not at the log's tail.
    let len = fs::metadata(&segs[0]).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&segs[0])
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    assert!(matches!(
        read_all(&d.0, 1),
        Err(PersistError::CorruptLog { .. })
    ));
}

#[test]
fn a_missing_segment_is_an_error() {
    let d = TestDir::new("wal-gap");
    let groups: Vec<Vec<Owned>> = (0..20).map(|i| vec![owned(i, 60)]).collect();
    write_all(&d.0, opts(200, Durability::None), &groups);
    let segs = segments(&d.0);
    fs::remove_file(&segs[1]).unwrap();
    match read_all(&d.0, 1) {
        Err(PersistError::CorruptLog { reason, .. }) => {
            assert!(reason.contains("expected"), "{reason}")
        }
        other => panic!("expected corruption, got {other:?}"),
    }
    // A log that starts after the records a snapshot needs is missing data too.
    fs::remove_file(&segs[0]).unwrap();
    assert!(matches!(
        read_all(&d.0, 1),
        Err(PersistError::CorruptLog { .. })
    ));
}

#[test]
fn pruning_drops_whole_covered_segments_only() {
    let d = TestDir::new("wal-prune");
    let (mut wal, _) = Wal::open(&d.0, opts(200, Durability::None), 1, |_| Ok(())).unwrap();
    for i in 0..20 {
        let o = owned(i, 60);
        wal.append(&[Record {
            kind: o.0,
            worker: o.1,
            dp_rank: o.2,
            seq: o.3,
            payload: &o.4,
        }])
        .unwrap();
    }
    wal.rotate().unwrap();
    let before = segments(&d.0).len();
    let removed = wal.prune_through(10).unwrap();
    assert!(removed > 0 && removed < before);
    // Every remaining record after lsn 10 is still there.
    drop(wal);
    let (got, _) = read_all(&d.0, 11).unwrap();
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        (11..=20).collect::<Vec<_>>()
    );
    // Replaying from before the first kept segment is an error (records are gone).
    assert!(matches!(
        read_all(&d.0, 1),
        Err(PersistError::CorruptLog { .. })
    ));
}

#[test]
fn a_second_writer_is_refused() {
    let d = TestDir::new("wal-lock");
    let (wal, _) = Wal::open(&d.0, WalOptions::default(), 1, |_| Ok(())).unwrap();
    assert!(matches!(
        Wal::open(&d.0, WalOptions::default(), 1, |_| Ok(())),
        Err(PersistError::Locked { .. })
    ));
    wal.close().unwrap();
    assert!(Wal::open(&d.0, WalOptions::default(), 1, |_| Ok(())).is_ok());
}

#[test]
fn per_batch_syncs_before_returning_and_interval_catches_up() {
    let d = TestDir::new("wal-sync");
    let rec = Record {
        kind: 1,
        worker: 1,
        dp_rank: 0,
        seq: 1,
        payload: b"x",
    };
    let (mut wal, _) = Wal::open(&d.0, opts(1 << 20, Durability::PerBatch), 1, |_| Ok(())).unwrap();
    let lsn = wal.append(&[rec, rec]).unwrap();
    assert_eq!(wal.synced_lsn(), lsn);
    wal.close().unwrap();

    let d = TestDir::new("wal-interval");
    let every = Durability::Interval(Duration::from_millis(5));
    let (mut wal, _) = Wal::open(&d.0, opts(1 << 20, every), 1, |_| Ok(())).unwrap();
    let lsn = wal.append(&[rec]).unwrap();
    let start = Instant::now();
    while wal.synced_lsn() < lsn {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "background fsync never ran"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    wal.close().unwrap();

    let d = TestDir::new("wal-none");
    let (mut wal, _) = Wal::open(&d.0, opts(1 << 20, Durability::None), 1, |_| Ok(())).unwrap();
    wal.append(&[rec]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(wal.synced_lsn(), 0, "durability none must not fsync");
}

#[test]
fn durability_parses() {
    assert_eq!(Durability::parse("none").unwrap(), Durability::None);
    assert_eq!(
        Durability::parse("per-batch").unwrap(),
        Durability::PerBatch
    );
    assert_eq!(
        Durability::parse("interval").unwrap(),
        Durability::default()
    );
    assert_eq!(
        Durability::parse("interval:25").unwrap(),
        Durability::Interval(Duration::from_millis(25))
    );
    assert_eq!(
        Durability::parse("7ms").unwrap(),
        Durability::Interval(Duration::from_millis(7))
    );
    assert!(Durability::parse("sometimes").is_err());
    assert_eq!(
        Durability::parse(&Durability::default().describe()).unwrap(),
        Durability::default()
    );
}

fn payloads() -> impl Strategy<Value = Vec<Vec<Vec<u8>>>> {
    prop::collection::vec(
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..120), 1..5),
        1..25,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Cut the log's last segment anywhere: recovery yields exactly the records whose
    /// frames lie wholly before the cut, reports the torn bytes, and appends after them.
    #[test]
    fn any_truncation_recovers_exactly_a_prefix(
        groups in payloads(),
        segment_bytes in 64u64..1500,
        cut_frac in 0.0f64..=1.0,
    ) {
        let d = TestDir::new("wal-prop");
        let groups: Vec<Vec<Owned>> = groups
            .into_iter()
            .enumerate()
            .map(|(g, ps)| ps.into_iter().enumerate()
                .map(|(j, p)| (2, g as u64, j as u32, (g * 10 + j) as u64, p)).collect())
            .collect();
        write_all(&d.0, opts(segment_bytes, Durability::None), &groups);
        let flat: Vec<Owned> = groups.concat();
        let segs = segments(&d.0);
        let last = segs.last().unwrap();
        let base = base_of(last);
        let len = fs::metadata(last).unwrap().len();
        let cut = (len as f64 * cut_frac) as u64;
        fs::OpenOptions::new().write(true).open(last).unwrap().set_len(cut).unwrap();

        // Frames in the last segment, in order, and how many end before the cut.
        let mut end = 16u64;
        let mut kept = base - 1;
        let mut boundaries = vec![end];
        for r in &flat[(base - 1) as usize..] {
            end += frame_len(r.4.len()) as u64;
            boundaries.push(end);
            if end <= cut { kept += 1; }
        }
        let (got, report) = read_all(&d.0, 1).unwrap();
        prop_assert_eq!(got.len() as u64, kept);
        for (i, (lsn, r)) in got.iter().enumerate() {
            prop_assert_eq!(*lsn, i as u64 + 1);
            prop_assert_eq!(r, &flat[i]);
        }
        // Torn iff the cut is not exactly at a frame boundary.
        prop_assert_eq!(report.torn_tail.is_some(), !boundaries.contains(&cut));

        // The log goes on after the cut, with consecutive lsns.
        let extra: Owned = (3, 9, 9, 9, b"after".to_vec());
        write_all(&d.0, opts(segment_bytes, Durability::None), &[vec![extra.clone()]]);
        let (got, report) = read_all(&d.0, 1).unwrap();
        prop_assert_eq!(report.torn_tail, None);
        prop_assert_eq!(got.len() as u64, kept + 1);
        prop_assert_eq!(got.last().unwrap(), &(kept + 1, extra));
    }

    /// Flip one byte anywhere in a frame: recovery either refuses (corruption) or, if
    /// the damaged frame is the very last one, drops just that frame. Never anything else.
    #[test]
    fn any_byte_flip_is_refused_or_cuts_only_the_last_frame(
        groups in payloads(),
        pos_frac in 0.0f64..1.0,
        xor in 1u8..=255,
    ) {
        let d = TestDir::new("wal-flip");
        let groups: Vec<Vec<Owned>> = groups
            .into_iter()
            .map(|ps| ps.into_iter().map(|p| (1, 1, 0, 1, p)).collect())
            .collect();
        write_all(&d.0, opts(1 << 20, Durability::None), &groups);
        let flat: Vec<Owned> = groups.concat();
        let seg = &segments(&d.0)[0];
        let mut bytes = fs::read(seg).unwrap();
        let pos = 16 + ((bytes.len() - 16) as f64 * pos_frac) as usize;
        bytes[pos] ^= xor;
        fs::write(seg, &bytes).unwrap();
        let last_frame_start = bytes.len() - frame_len(flat.last().unwrap().4.len());
        match read_all(&d.0, 1) {
            Ok((got, report)) => {
                prop_assert!(pos >= last_frame_start, "flip at {} silently accepted", pos);
                prop_assert!(report.torn_tail.is_some());
                prop_assert_eq!(got.len(), flat.len() - 1);
            }
            Err(PersistError::CorruptLog { .. }) => prop_assert!(pos < last_frame_start),
            Err(e) => prop_assert!(false, "unexpected error {}", e),
        }
    }
}
