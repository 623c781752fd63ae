//! `LoadOrder`: a fleet's rows kept in order of their load, so that a router that
//! prunes reads the least loaded rows in O(k log n) instead of scanning every row.
//!
//! A row is keyed by a few load values compared in order (e.g. requests in flight, then
//! queued prefill tokens), then by its worker id and data-parallel rank: the order a
//! router's "first among equals" uses, since views list rows by id then rank. Values
//! compare as `f64::total_cmp` does (-0.0 before 0.0, NaN after every number), so the
//! order is total whatever a load report says; -0.0 is placed as 0.0, since numpy's
//! comparisons, which the routers' unpruned paths use, do not tell them apart.
//!
//! The control plane updates a row whenever its load changes (one `set` per booking,
//! release or report); a fleet of 1,000 rows costs a few tree nodes per update.

use std::collections::BTreeSet;

/// An `f64` mapped to a `u64` whose unsigned order is `f64::total_cmp`'s.
fn ordered_bits(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

/// The inverse of `ordered_bits`.
fn from_ordered_bits(bits: u64) -> f64 {
    if bits >> 63 == 1 {
        f64::from_bits(bits & !(1 << 63))
    } else {
        f64::from_bits(!bits)
    }
}

/// Most keys a `LoadOrder` compares.
pub const MAX_KEYS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    keys: [u64; MAX_KEYS],
    worker: u64,
    rank: u32,
    row: u32,
}

/// Why a `LoadOrder` call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrderError {
    #[error("a load order compares 1 to {MAX_KEYS} values, not {0}")]
    Width(usize),
    #[error("row {row} was given {got} values; this order compares {want}")]
    Values { row: u32, got: usize, want: usize },
}

/// Rows ordered by (keys..., worker, rank); at most one entry per row.
#[derive(Debug, Clone)]
pub struct LoadOrder {
    width: usize,
    set: BTreeSet<Entry>,
    by_row: Vec<Option<Entry>>,
}

impl LoadOrder {
    pub fn new(width: usize) -> Result<Self, OrderError> {
        if width == 0 || width > MAX_KEYS {
            return Err(OrderError::Width(width));
        }
        Ok(Self {
            width,
            set: BTreeSet::new(),
            by_row: Vec::new(),
        })
    }

    pub fn width(&self) -> usize {
        self.width
    }

    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Place `row` (of `worker`, rank `rank`) by `values`, moving it if it was placed.
    pub fn set(
        &mut self,
        row: u32,
        values: &[f64],
        worker: u64,
        rank: u32,
    ) -> Result<(), OrderError> {
        if values.len() != self.width {
            return Err(OrderError::Values {
                row,
                got: values.len(),
                want: self.width,
            });
        }
        let mut keys = [0u64; MAX_KEYS];
        for (k, &v) in keys.iter_mut().zip(values) {
            // + 0.0 turns -0.0 into 0.0: a load compares as numpy compares it
            *k = ordered_bits(v + 0.0);
        }
        let entry = Entry {
            keys,
            worker,
            rank,
            row,
        };
        let at = row as usize;
        if at >= self.by_row.len() {
            self.by_row.resize(at + 1, None);
        }
        if let Some(old) = self.by_row[at] {
            if old == entry {
                return Ok(());
            }
            self.set.remove(&old);
        }
        self.set.insert(entry);
        self.by_row[at] = Some(entry);
        Ok(())
    }

    /// Forget `row`; false when it was not placed.
    pub fn remove(&mut self, row: u32) -> bool {
        match self.by_row.get_mut(row as usize).and_then(Option::take) {
            Some(old) => self.set.remove(&old),
            None => false,
        }
    }

    /// The values `row` is placed by, None when it is not placed.
    pub fn values(&self, row: u32) -> Option<Vec<f64>> {
        let entry = self.by_row.get(row as usize).copied().flatten()?;
        Some(
            entry.keys[..self.width]
                .iter()
                .map(|&b| from_ordered_bits(b))
                .collect(),
        )
    }

    /// Rows in order, from the least loaded.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.set.iter().map(|e| e.row)
    }

    /// Up to `k` rows in order for which `keep` holds, from the least loaded.
    pub fn first(&self, k: usize, mut keep: impl FnMut(u32) -> bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(k.min(self.set.len()));
        if k == 0 {
            return out;
        }
        for e in &self.set {
            if keep(e.row) {
                out.push(e.row);
                if out.len() == k {
                    break;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ordered_bits_follow_total_cmp() {
        let xs = [
            f64::NEG_INFINITY,
            -1.5,
            -0.0,
            0.0,
            1e-300,
            2.0,
            f64::INFINITY,
            f64::NAN,
        ];
        for a in xs {
            assert_eq!(from_ordered_bits(ordered_bits(a)).to_bits(), a.to_bits());
            for b in xs {
                assert_eq!(
                    ordered_bits(a).cmp(&ordered_bits(b)),
                    a.total_cmp(&b),
                    "{a} {b}"
                );
            }
        }
    }

    #[test]
    fn widths_and_value_counts_are_checked() {
        assert_eq!(LoadOrder::new(0).unwrap_err(), OrderError::Width(0));
        assert!(LoadOrder::new(MAX_KEYS + 1).is_err());
        let mut o = LoadOrder::new(2).unwrap();
        assert!(matches!(
            o.set(0, &[1.0], 0, 0),
            Err(OrderError::Values { .. })
        ));
        assert!(o.is_empty());
    }

    proptest! {
        /// After any sequence of sets and removes, the order is the sort of the rows'
        /// latest values, ties by worker then rank.
        #[test]
        fn the_order_is_the_sort_of_the_latest_values(
            ops in proptest::collection::vec(
                (0u32..24, proptest::option::of((0u8..6, 0u8..6)), 0u64..8, 0u32..3),
                0..200,
            ),
            k in 0usize..30,
        ) {
            let mut o = LoadOrder::new(2).unwrap();
            let mut latest: std::collections::HashMap<u32, (f64, f64, u64, u32)> = Default::default();
            for (row, values, worker, rank) in ops {
                match values {
                    Some((a, b)) => {
                        let (a, b) = (f64::from(a) / 2.0, f64::from(b));
                        o.set(row, &[a, b], worker, rank).unwrap();
                        latest.insert(row, (a, b, worker, rank));
                    }
                    None => {
                        prop_assert_eq!(o.remove(row), latest.remove(&row).is_some());
                    }
                }
            }
            let mut want: Vec<_> = latest.iter().map(|(&r, &v)| (v, r)).collect();
            want.sort_by(|(x, r), (y, s)| {
                x.0.total_cmp(&y.0)
                    .then(x.1.total_cmp(&y.1))
                    .then(x.2.cmp(&y.2))
                    .then(x.3.cmp(&y.3))
                    .then(r.cmp(s))
            });
            let rows: Vec<u32> = want.iter().map(|&(_, r)| r).collect();
            prop_assert_eq!(o.iter().collect::<Vec<_>>(), rows.clone());
            prop_assert_eq!(o.len(), rows.len());
            let even: Vec<u32> = rows.iter().copied().filter(|r| r % 2 == 0).take(k).collect();
            prop_assert_eq!(o.first(k, |r| r % 2 == 0), even);
            for (&r, &(a, b, _, _)) in &latest {
                prop_assert_eq!(o.values(r), Some(vec![a, b]));
            }
        }
    }
}
