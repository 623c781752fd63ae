//! Speculative residency: the prefixes being computed on workers right now.
//!
//! Between routing a request and its engine publishing BlockStored, the request's
//! blocks are being computed on the chosen worker. The control plane records them here
//! (`add`) until the prefill is done or the request ends (`remove`), and a routing
//! view asks, per worker, how long a prefix of a new request's keys is already on its
//! way there (`prefixes`). The residency index is never changed by this: only events
//! change it.
//!
//! Kept by key, so a view costs the workers that are computing the request's first
//! blocks, not every worker with something in flight.

use hashbrown::HashMap;

/// Content key -> (worker, how many recorded requests are computing it there).
#[derive(Debug, Default)]
pub struct Pending {
    by_key: HashMap<u64, Vec<(u64, u32)>>,
    entries: usize,
}

impl Pending {
    pub fn new() -> Self {
        Self::default()
    }

    /// One more request computing `keys` on `worker`.
    pub fn add(&mut self, worker: u64, keys: &[u64]) {
        for &key in keys {
            let holders = self.by_key.entry(key).or_default();
            match holders.iter_mut().find(|(w, _)| *w == worker) {
                Some((_, count)) => *count += 1,
                None => {
                    holders.push((worker, 1));
                    self.entries += 1;
                }
            }
        }
    }

    /// One request fewer computing `keys` on `worker` (what `add` recorded; keys never
    /// added are ignored).
    pub fn remove(&mut self, worker: u64, keys: &[u64]) {
        for &key in keys {
            let Some(holders) = self.by_key.get_mut(&key) else {
                continue;
            };
            if let Some(at) = holders.iter().position(|(w, _)| *w == worker) {
                holders[at].1 -= 1;
                if holders[at].1 == 0 {
                    holders.swap_remove(at);
                    self.entries -= 1;
                    if holders.is_empty() {
                        self.by_key.remove(&key);
                    }
                }
            }
        }
    }

    /// Forget everything recorded for `worker` (it left the fleet).
    pub fn remove_worker(&mut self, worker: u64) {
        let mut dropped = 0;
        self.by_key.retain(|_, holders| {
            let before = holders.len();
            holders.retain(|(w, _)| *w != worker);
            dropped += before - holders.len();
            !holders.is_empty()
        });
        self.entries -= dropped;
    }

    /// Per worker, how many of `keys` from the first one are being computed there
    /// (workers with none omitted), in no particular order.
    pub fn prefixes(&self, keys: &[u64]) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        let Some(first) = keys.first().and_then(|k| self.by_key.get(k)) else {
            return out;
        };
        let mut alive: Vec<u64> = first.iter().map(|&(w, _)| w).collect();
        let mut depth: u32 = 1;
        for key in &keys[1..] {
            let Some(holders) = self.by_key.get(key) else {
                break;
            };
            alive.retain(|w| {
                let kept = holders.iter().any(|(h, _)| h == w);
                if !kept {
                    out.push((*w, depth));
                }
                kept
            });
            if alive.is_empty() {
                break;
            }
            depth += 1;
        }
        out.extend(alive.into_iter().map(|w| (w, depth)));
        out
    }

    /// (worker, key) pairs recorded.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap as StdMap;

    /// The plainest model: per worker, a multiset of keys.
    #[derive(Default)]
    struct Model(StdMap<u64, StdMap<u64, u32>>);

    impl Model {
        fn prefixes(&self, keys: &[u64]) -> Vec<(u64, u32)> {
            let mut out: Vec<(u64, u32)> = self
                .0
                .iter()
                .map(|(&w, set)| {
                    let n = keys
                        .iter()
                        .take_while(|k| set.get(k).copied().unwrap_or(0) > 0);
                    (w, n.count() as u32)
                })
                .filter(|&(_, n)| n > 0)
                .collect();
            out.sort_unstable();
            out
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u64, Vec<u64>),
        Remove(usize),
        RemoveWorker(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let keys = prop::collection::vec(0u64..12, 0..8);
        prop_oneof![
            4 => (0u64..5, keys).prop_map(|(w, k)| Op::Add(w, k)),
            3 => any::<usize>().prop_map(Op::Remove),
            1 => (0u64..5).prop_map(Op::RemoveWorker),
        ]
    }

    proptest! {
        #[test]
        fn prefixes_are_the_models(ops in prop::collection::vec(op(), 0..40),
                                   query in prop::collection::vec(0u64..12, 0..8)) {
            let (mut p, mut m) = (Pending::new(), Model::default());
            let mut added: Vec<(u64, Vec<u64>)> = Vec::new();
            for op in ops {
                match op {
                    Op::Add(w, keys) => {
                        p.add(w, &keys);
                        let set = m.0.entry(w).or_default();
                        for k in &keys { *set.entry(*k).or_default() += 1; }
                        added.push((w, keys));
                    }
                    Op::Remove(i) if !added.is_empty() => {
                        let (w, keys) = added.swap_remove(i % added.len());
                        p.remove(w, &keys);
                        if let Some(set) = m.0.get_mut(&w) {
                            for k in &keys {
                                if let Some(c) = set.get_mut(k) { *c = c.saturating_sub(1); }
                            }
                        }
                    }
                    Op::Remove(_) => {}
                    Op::RemoveWorker(w) => {
                        p.remove_worker(w);
                        m.0.remove(&w);
                        added.retain(|(x, _)| *x != w);
                    }
                }
                let mut got = p.prefixes(&query);
                got.sort_unstable();
                prop_assert_eq!(got, m.prefixes(&query));
                let pairs: usize = m.0.values().map(|s| s.values().filter(|&&c| c > 0).count()).sum();
                prop_assert_eq!(p.len(), pairs);
            }
            for (w, keys) in added { p.remove(w, &keys); }
            prop_assert!(p.is_empty() && p.by_key.is_empty());
        }
    }
}
