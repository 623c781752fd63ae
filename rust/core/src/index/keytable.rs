//! `content key → node id`: an open-addressing table of 4-byte node ids.
//!
//! Linear probing over a power-of-two array, at most 3/4 full, compared through the
//! node slab (a slot holds only the id). Unlike a general-purpose map it exposes a
//! prefetch of a key's home slot, so `match` and ingest can issue the cache misses
//! of all of a request's keys at once before reading any of them.

use super::tree::{Node, NIL};

/// Keys are xxh3 outputs; one multiply-fold keeps arbitrary caller keys (pins,
/// matches with small integers) from clustering.
#[inline]
fn table_hash(key: u64) -> u64 {
    let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 29)
}

#[inline]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Which field of a node a table is keyed by.
#[derive(Debug, Default, Clone, Copy)]
pub enum KeyField {
    #[default]
    Key,
    EHash,
}

#[derive(Debug, Default, Clone)]
pub struct KeyTable {
    slots: Vec<u32>,
    len: usize,
    field: KeyField,
}

impl KeyTable {
    pub fn new(field: KeyField) -> Self {
        Self {
            field,
            ..Self::default()
        }
    }

    #[inline]
    fn key_of(&self, n: &Node) -> u64 {
        match self.field {
            KeyField::Key => n.key,
            KeyField::EHash => n.ehash,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        table_hash(key) as usize & self.mask()
    }

    /// Starts loading the line of `key`'s home slot.
    #[inline]
    pub fn prefetch_slot(&self, key: u64) {
        if !self.slots.is_empty() {
            prefetch(&self.slots[self.home(key)]);
        }
    }

    /// The ids in `key`'s home slot and the next one (candidates, not checked), to
    /// prefetch their nodes: with linear probing a key is in one of the two about
    /// 85 % of the time at the loads we run at.
    #[inline]
    pub fn candidates(&self, key: u64) -> [u32; 2] {
        if self.slots.is_empty() {
            return [NIL; 2];
        }
        let i = self.home(key);
        [self.slots[i], self.slots[(i + 1) & self.mask()]]
    }

    #[inline]
    pub fn find(&self, key: u64, nodes: &[Node]) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let id = self.slots[i];
            if id == NIL {
                return None;
            }
            if self.key_of(&nodes[id as usize]) == key {
                return Some(id);
            }
            i = (i + 1) & mask;
        }
    }

    /// Inserts `id` (whose node, with its key, is already in `nodes`); the key must be absent.
    pub fn insert(&mut self, id: u32, nodes: &[Node]) {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow(nodes);
        }
        self.place(id, self.key_of(&nodes[id as usize]));
        self.len += 1;
    }

    fn place(&mut self, id: u32, key: u64) {
        let mask = self.mask();
        let mut i = self.home(key);
        while self.slots[i] != NIL {
            i = (i + 1) & mask;
        }
        self.slots[i] = id;
    }

    fn grow(&mut self, nodes: &[Node]) {
        let cap = (self.slots.len() * 2).max(16);
        let old = std::mem::replace(&mut self.slots, vec![NIL; cap]);
        for id in old.into_iter().filter(|&id| id != NIL) {
            self.place(id, self.key_of(&nodes[id as usize]));
        }
    }

    /// Removes `key`; returns whether it was there. Backward-shift deletion keeps
    /// every remaining key reachable from its home slot without tombstones.
    pub fn remove(&mut self, key: u64, nodes: &[Node]) -> bool {
        if self.slots.is_empty() {
            return false;
        }
        let mask = self.mask();
        let mut hole = self.home(key);
        loop {
            let id = self.slots[hole];
            if id == NIL {
                return false;
            }
            if self.key_of(&nodes[id as usize]) == key {
                break;
            }
            hole = (hole + 1) & mask;
        }
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let id = self.slots[j];
            if id == NIL {
                break;
            }
            let home = self.home(self.key_of(&nodes[id as usize]));
            // The entry at j may fill the hole if the hole lies on its probe path
            // (cyclically between its home and j).
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = id;
                hole = j;
            }
        }
        self.slots[hole] = NIL;
        self.len -= 1;
        true
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots.iter().copied().filter(|&id| id != NIL)
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(key: u64) -> Node {
        Node {
            key,
            ehash: 0,
            holders: Default::default(),
            parent_id: NIL,
            depth_flags: 0,
            first_child: NIL,
            pins: 0,
        }
    }

    proptest! {
        /// Against a HashMap, with small keys (many collisions) and interleaved removes.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((any::<bool>(), 0..64u64), 1..400)) {
            let mut nodes: Vec<Node> = vec![];
            let mut table = KeyTable::default();
            let mut model = std::collections::HashMap::new();
            for (insert, key) in ops {
                if insert {
                    if table.find(key, &nodes).is_none() {
                        nodes.push(node(key));
                        let id = (nodes.len() - 1) as u32;
                        table.insert(id, &nodes);
                        model.insert(key, id);
                    }
                } else {
                    prop_assert_eq!(table.remove(key, &nodes), model.remove(&key).is_some());
                }
                prop_assert_eq!(table.len(), model.len());
                for k in 0..64u64 {
                    prop_assert_eq!(table.find(k, &nodes), model.get(&k).copied());
                }
            }
        }
    }
}
