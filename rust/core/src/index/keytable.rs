//! `content key → node id`: an open-addressing table of 4-byte slots.
//!
//! Linear probing over a power-of-two array, at most 3/4 full. A slot holds the node
//! id in its low `id_bits` and, above them, a **tag**: high bits of the key's hash.
//! A probe compares the tag first and reads the node (to compare the full key) only
//! when the tags agree, so probing past other keys, and above all a *miss* (every
//! insert of a new block probes to the end of its cluster), costs no dependent cache
//! miss per occupied slot: at 3/4 load that was ~8 random node reads per insert.
//! The tag shrinks (to nothing) only when the slab outgrows the id bits
//! (`INITIAL_ID_BITS`: 16 M nodes keep an 8-bit tag). Unlike a general-purpose map
//! it exposes a prefetch of a key's home slot and its tag-matching node, so `match`
//! and ingest can issue the cache misses of all of a request's keys at once.

use super::hugepages;
use super::tree::NIL;

/// Ids below 2^24 - 1 (16 M nodes) leave 8 bits of tag: 1 false node read per 256
/// occupied slots probed.
const INITIAL_ID_BITS: u32 = 24;

/// Keys are xxh3 outputs; one multiply-fold keeps arbitrary caller keys (pins,
/// matches with small integers) from clustering. The low bits pick the home slot,
/// the high 32 bits give the tag.
#[inline]
fn table_hash(key: u64) -> u64 {
    let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 29)
}

/// Starts loading the line of `p` into L1 (a hint: it never faults).
#[inline]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    prefetch_with::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(p);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Starts loading the line of `p` into L2 only.
#[inline]
fn prefetch_to_l2<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    prefetch_with::<{ std::arch::x86_64::_MM_HINT_T1 }, T>(p);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_with<const HINT: i32, T>(p: *const T) {
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p as *const i8) }
}

/// The slab a table indexes: entry `id` has a key. The table stores only ids and
/// reads keys from here (the tree's two tables index two different slabs).
pub trait Slab {
    fn key_at(&self, id: u32) -> u64;
    /// Whether entry `id` is in the table by the tree's conventions (a freed slot or
    /// a node without primary hash is not): lets a rebuild read the slab in order.
    fn indexed(&self, id: u32) -> bool;
    /// Where entry `id` is, to prefetch it.
    fn entry(&self, id: u32) -> *const u8;
    /// Entries in the slab (ids `0..slab_len()`).
    fn slab_len(&self) -> usize;
}

#[derive(Debug, Clone)]
pub struct KeyTable {
    pub(super) slots: Vec<u32>,
    len: usize,
    /// Low bits of a slot that hold the id; every id stored is < `id_mask`, so that
    /// no slot ever equals NIL (u32::MAX, the empty slot).
    id_mask: u32,
}

impl Default for KeyTable {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            len: 0,
            id_mask: (1 << INITIAL_ID_BITS) - 1,
        }
    }
}

impl KeyTable {
    /// A table whose ids start with `bits` bits (tests: exercise `widen_ids`).
    #[cfg(test)]
    fn with_id_bits(bits: u32) -> Self {
        Self {
            id_mask: (1 << bits) - 1,
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// (home slot, tag bits in place) of a key.
    #[inline]
    fn locate(&self, key: u64) -> (usize, u32) {
        let h = table_hash(key);
        (h as usize & self.mask(), (h >> 32) as u32 & !self.id_mask)
    }

    #[inline]
    fn tag_matches(&self, slot: u32, tag: u32) -> bool {
        (slot ^ tag) & !self.id_mask == 0
    }

    /// Starts loading the line of `key`'s home slot into the L2 cache only.
    #[inline]
    pub fn prefetch_slot_to_l2(&self, key: u64) {
        if !self.slots.is_empty() {
            prefetch_to_l2(&self.slots[self.locate(key).0]);
        }
    }

    /// Starts loading the line of `key`'s home slot.
    #[inline]
    pub fn prefetch_slot(&self, key: u64) {
        if !self.slots.is_empty() {
            prefetch(&self.slots[self.locate(key).0]);
        }
    }

    /// Starts loading the slab entries of the slots from `key`'s home slot up to the
    /// first empty one (at most `max`): what removing `key` reads to shift its
    /// cluster back. Worth it once the slots' line is in cache.
    #[inline]
    pub fn prefetch_cluster<S: Slab + ?Sized>(&self, key: u64, nodes: &S, max: usize) {
        if self.slots.is_empty() {
            return;
        }
        let mask = self.mask();
        let home = self.locate(key).0;
        for step in 0..max {
            let s = self.slots[(home + step) & mask];
            if s == NIL {
                return;
            }
            prefetch(nodes.entry(s & self.id_mask));
        }
    }

    /// The id in the first of `key`'s first four probe slots whose tag matches (NIL if
    /// none): a candidate to prefetch the node of, not checked. With linear probing a
    /// present key is almost always there at the loads we run at.
    #[inline]
    pub fn candidate(&self, key: u64) -> u32 {
        if self.slots.is_empty() {
            return NIL;
        }
        let (home, tag) = self.locate(key);
        let mask = self.mask();
        for step in 0..4 {
            let s = self.slots[(home + step) & mask];
            if s == NIL {
                return NIL;
            }
            if self.tag_matches(s, tag) {
                return s & self.id_mask;
            }
        }
        NIL
    }

    #[inline]
    pub fn find<S: Slab + ?Sized>(&self, key: u64, nodes: &S) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let (mut i, tag) = self.locate(key);
        loop {
            let s = self.slots[i];
            if s == NIL {
                return None;
            }
            if self.tag_matches(s, tag) {
                let id = s & self.id_mask;
                if nodes.key_at(id) == key {
                    return Some(id);
                }
            }
            i = (i + 1) & mask;
        }
    }

    /// Inserts `id` (whose node, with its key, is already in `nodes`); the key must be absent.
    pub fn insert<S: Slab + ?Sized>(&mut self, id: u32, nodes: &S) {
        if id >= self.id_mask {
            self.widen_ids(id);
        }
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow(nodes, id);
        }
        self.place(id, nodes.key_at(id));
        self.len += 1;
    }

    /// Gives the id more bits (the tag fewer) so that `id` fits. Home slots do not
    /// change and the new tag is a subset of the old one: done in place.
    fn widen_ids(&mut self, id: u32) {
        let old = self.id_mask;
        let mut mask = old;
        while id >= mask {
            mask = (mask << 1) | 1;
        }
        for s in self.slots.iter_mut().filter(|s| **s != NIL) {
            *s = (*s & old) | (*s & !mask);
        }
        self.id_mask = mask;
    }

    fn place(&mut self, id: u32, key: u64) {
        let mask = self.mask();
        let (mut i, tag) = self.locate(key);
        while self.slots[i] != NIL {
            i = (i + 1) & mask;
        }
        self.slots[i] = id | tag;
    }

    /// Doubles the table while `pending` (in `nodes`, not yet in the table) waits.
    fn grow<S: Slab + ?Sized>(&mut self, nodes: &S, pending: u32) {
        let cap = (self.slots.len() * 2).max(16);
        self.rebuild(hugepages::filled(cap, NIL), nodes, pending);
    }

    /// Makes room for `entries` entries in all, so that inserts up to that many
    /// never grow the table. `Err` (nothing changed) if the memory is not there.
    pub fn reserve<S: Slab + ?Sized>(
        &mut self,
        entries: usize,
        nodes: &S,
    ) -> Result<(), std::collections::TryReserveError> {
        // The smallest power of two that keeps `entries` at most 3/4 full.
        let cap = (entries.saturating_mul(4).div_ceil(3) + 1)
            .next_power_of_two()
            .max(16);
        if cap <= self.slots.len() {
            return Ok(());
        }
        let mut slots = Vec::new();
        slots.try_reserve_exact(cap)?;
        hugepages::advise(&slots);
        slots.resize(cap, NIL);
        self.rebuild(slots, nodes, NIL);
        Ok(())
    }

    /// Moves every entry into `slots` (all empty, a larger power of two).
    ///
    /// Re-placing needs every entry's key. Taken from the old slots, the ids come in
    /// hash order and each key is a random node read (a 2^21-slot grow reads 1.5 M
    /// nodes at random); taken from the slab front to back, they are a sequential
    /// read. The slab pass trusts the tree's conventions (`Slab::indexed`), so it
    /// is used only if it finds exactly `len` entries; else (a caller mid-way
    /// through restoring, or tests with other conventions) the old slots are the truth.
    fn rebuild<S: Slab + ?Sized>(&mut self, slots: Vec<u32>, nodes: &S, pending: u32) {
        let mut ids: Vec<u32> = Vec::with_capacity(self.len);
        for id in 0..nodes.slab_len() as u32 {
            if id != pending && nodes.indexed(id) {
                ids.push(id);
            }
        }
        if ids.len() != self.len {
            ids.clear();
            ids.extend(self.iter());
        }
        self.slots = slots;
        // The writes land at random in the new table: prefetch each entry's node
        // 2 x AHEAD entries ahead (a sequential stream in the common case), then
        // its new slot AHEAD entries ahead, so that those misses overlap.
        const AHEAD: usize = 16;
        for &id in ids.iter().take(2 * AHEAD) {
            prefetch(nodes.entry(id));
        }
        for (i, &id) in ids.iter().enumerate() {
            if let Some(&far) = ids.get(i + 2 * AHEAD) {
                prefetch(nodes.entry(far));
            }
            if let Some(&next) = ids.get(i + AHEAD) {
                prefetch(&self.slots[self.locate(nodes.key_at(next)).0]);
            }
            self.place(id, nodes.key_at(id));
        }
    }

    /// Removes `key`; returns whether it was there. Backward-shift deletion keeps
    /// every remaining key reachable from its home slot without tombstones.
    pub fn remove<S: Slab + ?Sized>(&mut self, key: u64, nodes: &S) -> bool {
        if self.slots.is_empty() {
            return false;
        }
        let mask = self.mask();
        let (mut hole, tag) = self.locate(key);
        loop {
            let s = self.slots[hole];
            if s == NIL {
                return false;
            }
            if self.tag_matches(s, tag) && nodes.key_at(s & self.id_mask) == key {
                break;
            }
            hole = (hole + 1) & mask;
        }
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s == NIL {
                break;
            }
            let home = self.locate(nodes.key_at(s & self.id_mask)).0;
            // The entry at j may fill the hole if the hole lies on its probe path
            // (cyclically between its home and j).
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = NIL;
        self.len -= 1;
        true
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let id_mask = self.id_mask;
        self.slots
            .iter()
            .filter(|&&s| s != NIL)
            .map(move |&s| s & id_mask)
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A slab of keys; `freed` entries are not indexed (as the tree marks them).
    #[derive(Default)]
    struct Keys {
        keys: Vec<u64>,
        freed: Vec<bool>,
    }

    impl Slab for Keys {
        fn key_at(&self, id: u32) -> u64 {
            self.keys[id as usize]
        }
        fn indexed(&self, id: u32) -> bool {
            !self.freed[id as usize]
        }
        fn entry(&self, id: u32) -> *const u8 {
            &self.keys[id as usize] as *const u64 as *const u8
        }
        fn slab_len(&self) -> usize {
            self.keys.len()
        }
    }

    proptest! {
        /// Against a HashMap, with small keys (many collisions) and interleaved removes;
        /// starting from 3 id bits, ids outgrow them, so `widen_ids` runs mid-stream;
        /// a `reserve` at a random step re-places everything. With `tree_marks`, a
        /// removed entry is marked freed as `Tree::collect` does, so that rebuilds
        /// take the slab pass; without, they must fall back to the old slots.
        #[test]
        fn behaves_like_a_map(
            ops in proptest::collection::vec((any::<bool>(), 0..64u64), 1..400),
            id_bits in prop_oneof![Just(3u32), Just(24u32)],
            reserve_at in 0..400usize,
            reserve_to in 0..200usize,
            tree_marks in any::<bool>(),
        ) {
            let mut slab = Keys::default();
            let mut table = KeyTable::with_id_bits(id_bits);
            let mut model = std::collections::HashMap::new();
            for (step, (insert, key)) in ops.into_iter().enumerate() {
                if step == reserve_at {
                    table.reserve(reserve_to, &slab).unwrap();
                }
                if insert {
                    if table.find(key, &slab).is_none() {
                        slab.keys.push(key);
                        slab.freed.push(false);
                        let id = (slab.keys.len() - 1) as u32;
                        table.insert(id, &slab);
                        model.insert(key, id);
                    }
                } else {
                    let removed = model.remove(&key);
                    prop_assert_eq!(table.remove(key, &slab), removed.is_some());
                    if let (Some(id), true) = (removed, tree_marks) {
                        slab.freed[id as usize] = true;
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                let mut ids: Vec<u32> = table.iter().collect();
                let mut want: Vec<u32> = model.values().copied().collect();
                ids.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(ids, want);
                for k in 0..64u64 {
                    prop_assert_eq!(table.find(k, &slab), model.get(&k).copied());
                }
            }
        }
    }
}
