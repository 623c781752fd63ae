//! Sources (worker, dp rank): their namespace base, their engine-hash maps, and the
//! interned media names.

use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashMap;

use crate::events::{Medium, MAX_CUSTOM_MEDIA};

/// A publisher of KV events: an engine and its data-parallel rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceKey {
    pub worker: u64,
    pub dp_rank: u32,
}

/// Multiply-fold hasher for integer keys (engine hashes may be small test integers,
/// so a pure pass-through would cluster).
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(x as u64);
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(26) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 29)
    }
}

pub type MixBuild = BuildHasherDefault<MixHasher>;

/// `engine_map_key(group_idx, engine hash)` → content key.
pub type EngineMap = HashMap<u64, u64, MixBuild>;

/// One u64 for `(group_idx, hash)`: the hash itself in group 0 (every non-hybrid
/// model), else the hash xor a strong mix of the group. Two pairs share a value
/// only by a 64-bit collision, the same odds as the engine hashes themselves.
#[inline]
pub fn engine_map_key(group: u32, hash: u64) -> u64 {
    if group == 0 {
        return hash;
    }
    let mut x = (group as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ x ^ (x >> 31)
}

#[derive(Debug, Clone, Default)]
pub struct Source {
    pub key: SourceKey,
    pub model: String,
    pub tokenizer: String,
    pub engine: EngineMap,
    /// Resident (block, medium) pairs this source holds.
    pub pairs: u64,
    /// The nodes this source holds, so that removing it visits them and nothing
    /// else (`Index::clear_slot`; docs/index.md, "Removing a source"). A node is
    /// appended when the source gains its first holder on it; it is not taken out
    /// when the source lets go (that would need its place stored per holder), so
    /// the list may also name nodes the source no longer holds, freed slots and
    /// duplicates. It is compacted when it is full and at least 1.5 × `pairs` long
    /// (`Index::note_held`), so it stays within a small factor of `pairs` and each
    /// append costs O(1) amortised. Derived state: not in snapshots, rebuilt from
    /// the holders when one is read.
    pub blocks: Vec<u32>,
}

impl Source {
    fn heap_bytes(&self) -> usize {
        self.model.capacity()
            + self.tokenizer.capacity()
            + self.engine.allocation_size()
            + self.blocks.capacity() * 4
    }
}

/// Sources by slot (the slot goes into holder ids); freed slots are reused.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub slots: Vec<Option<Source>>,
    by_key: HashMap<SourceKey, u32, MixBuild>,
    free: Vec<u32>,
    /// Live sources in key order, with their slots; `rank[slot]` is a slot's place
    /// here. `match` orders its hits by it without a comparison sort (at 1,024
    /// engines every request matches every engine on the system prompt). Kept on
    /// every add and removal: O(sources) each, rare events.
    ordered: Vec<(SourceKey, u32)>,
    rank: Vec<u32>,
}

impl Sources {
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn slot(&self, key: SourceKey) -> Option<u32> {
        self.by_key.get(&key).copied()
    }

    /// The slot of `key`, created if absent; None if `max_slot` would be exceeded.
    pub fn slot_or_create(&mut self, key: SourceKey, max_slot: u32) -> Option<u32> {
        if let Some(&s) = self.by_key.get(&key) {
            return Some(s);
        }
        let source = Source {
            key,
            ..Default::default()
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(source);
                s
            }
            None => {
                if self.slots.len() as u64 > max_slot as u64 {
                    return None;
                }
                self.slots.push(Some(source));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_key.insert(key, slot);
        self.ordered_insert(key, slot);
        Some(slot)
    }

    fn ordered_insert(&mut self, key: SourceKey, slot: u32) {
        let at = self.ordered.partition_point(|(k, _)| *k < key);
        self.ordered.insert(at, (key, slot));
        if self.rank.len() <= slot as usize {
            self.rank.resize(slot as usize + 1, u32::MAX);
        }
        for (r, &(_, s)) in self.ordered.iter().enumerate().skip(at) {
            self.rank[s as usize] = r as u32;
        }
    }

    fn ordered_remove(&mut self, key: SourceKey) {
        let at = self.ordered.partition_point(|(k, _)| *k < key);
        if self.ordered.get(at).is_some_and(|(k, _)| *k == key) {
            let (_, slot) = self.ordered.remove(at);
            self.rank[slot as usize] = u32::MAX;
            for (r, &(_, s)) in self.ordered.iter().enumerate().skip(at) {
                self.rank[s as usize] = r as u32;
            }
        }
    }

    /// The place of a live slot's key among the live sources' keys.
    #[inline]
    pub fn rank(&self, slot: u32) -> u32 {
        self.rank[slot as usize]
    }

    /// The live sources in key order, with their slots (`rank` indexes it).
    #[inline]
    pub fn ordered(&self) -> &[(SourceKey, u32)] {
        &self.ordered
    }

    /// Puts a source at a given slot (snapshot restore).
    pub fn restore(&mut self, slot: u32, source: Source) {
        let s = slot as usize;
        if self.slots.len() <= s {
            self.slots.resize_with(s + 1, || None);
        }
        if let Some(old) = self.slots[s].take() {
            self.by_key.remove(&old.key);
            self.ordered_remove(old.key);
        }
        self.by_key.insert(source.key, slot);
        self.ordered_insert(source.key, slot);
        self.slots[s] = Some(source);
    }

    /// Rebuilds the free list after `restore` calls.
    pub fn finish_restore(&mut self) {
        self.free = (0..self.slots.len() as u32)
            .rev()
            .filter(|&s| self.slots[s as usize].is_none())
            .collect();
    }

    #[inline]
    pub fn get(&self, slot: u32) -> &Source {
        self.slots[slot as usize]
            .as_ref()
            .expect("holder refers to a live source slot")
    }

    #[inline]
    pub fn get_mut(&mut self, slot: u32) -> &mut Source {
        self.slots[slot as usize]
            .as_mut()
            .expect("holder refers to a live source slot")
    }

    pub fn remove(&mut self, slot: u32) {
        if let Some(src) = self.slots[slot as usize].take() {
            self.by_key.remove(&src.key);
            self.ordered_remove(src.key);
            self.free.push(slot);
        }
    }

    pub fn slots_of_worker(&self, worker: u64) -> Vec<u32> {
        let mut slots: Vec<u32> = self
            .by_key
            .iter()
            .filter(|(k, _)| k.worker == worker)
            .map(|(_, &s)| s)
            .collect();
        slots.sort_unstable();
        slots
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &Source)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Option<Source>>()
            + self.by_key.allocation_size()
            + self.free.capacity() * 4
            + self.ordered.capacity() * std::mem::size_of::<(SourceKey, u32)>()
            + self.rank.capacity() * 4
            + self.iter().map(|(_, s)| s.heap_bytes()).sum::<usize>()
    }
}

/// Interned media names: holder ids carry an 8-bit index. Bounded: GPU/CPU/DISK and
/// the known names, plus at most [`MAX_CUSTOM_MEDIA`] others of at most
/// [`crate::events::MAX_MEDIUM_NAME_BYTES`]; any other name is stored as
/// [`crate::events::OTHER_MEDIUM`].
#[derive(Debug, Clone, Default)]
pub struct Media {
    names: Vec<Medium>,
    /// Each medium's place in name order, so that `match` sorts its hits by medium
    /// name with integer compares (string compares were 4 % of a match).
    rank: Vec<u8>,
    /// Interned names that are not known ones.
    custom: usize,
}

impl Media {
    pub fn find(&self, m: &Medium) -> Option<u8> {
        self.names.iter().position(|x| x == m).map(|i| i as u8)
    }

    /// Whether `m` may get its own index (known, or unknown within the limits).
    fn admits(&self, m: &Medium) -> bool {
        m.is_known() || (m.fits() && self.custom < MAX_CUSTOM_MEDIA)
    }

    /// The index a store of `m` goes to, interned if new, and whether `m` was folded
    /// into [`crate::events::OTHER_MEDIUM`]; None once 256 distinct media exist (only a snapshot can
    /// bring that many).
    pub fn intern(&mut self, m: &Medium) -> Option<(u8, bool)> {
        if let Some(i) = self.find(m) {
            return Some((i, false));
        }
        if self.admits(m) {
            return self.insert(m).map(|i| (i, false));
        }
        let other = Medium::other();
        let i = match self.find(&other) {
            Some(i) => i,
            None => self.insert(&other)?,
        };
        Some((i, true))
    }

    /// The index a removal of `m` refers to: the same mapping as [`Media::intern`],
    /// without interning (None: nothing was ever stored under it).
    pub fn resolve(&self, m: &Medium) -> Option<u8> {
        match self.find(m) {
            Some(i) => Some(i),
            None if self.admits(m) => None,
            None => self.find(&Medium::other()),
        }
    }

    /// Appends `m` whatever the limits (a snapshot's media); None once 256 exist.
    pub fn insert(&mut self, m: &Medium) -> Option<u8> {
        if self.names.len() >= 256 {
            return None;
        }
        if !m.is_known() {
            self.custom += 1;
        }
        self.names.push(m.clone());
        let mut order: Vec<u8> = (0..self.names.len() as u16).map(|i| i as u8).collect();
        order.sort_unstable_by_key(|&i| self.names[i as usize].as_str());
        self.rank = vec![0; order.len()];
        for (place, &i) in order.iter().enumerate() {
            self.rank[i as usize] = place as u8;
        }
        Some((self.names.len() - 1) as u8)
    }

    /// The place of medium `i` in name order (`a < b` iff `name(a) < name(b)`).
    #[inline]
    pub fn rank(&self, i: u8) -> u8 {
        self.rank[i as usize]
    }

    #[inline]
    pub fn name(&self, i: u8) -> &str {
        self.names[i as usize].as_str()
    }

    pub fn all(&self) -> &[Medium] {
        &self.names
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn heap_bytes(&self) -> usize {
        self.names.capacity() * std::mem::size_of::<Medium>()
            + self.rank.capacity()
            + self
                .names
                .iter()
                .map(|m| match m {
                    Medium::Other(s) => s.capacity(),
                    _ => 0,
                })
                .sum::<usize>()
    }
}
