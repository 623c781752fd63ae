//! Who holds a block: a compact set of `(source slot, medium)` holders with refcounts.
//!
//! Most blocks have exactly one holder, so a node stores one holder inline in a
//! single `u64`; a block with more holders (a shared system prompt, a GPU copy plus
//! a CPU offload) moves them to a sorted list in the [`Spills`] arena. Sorted lists
//! let `match` intersect holder sets with a linear merge.

/// `(source slot << 8) | medium index`: one (source, medium) pair.
pub type HolderId = u32;

/// Reserved id: marks a [`HolderSet`] whose holders live in the spill arena.
const SPILL_ID: HolderId = u32::MAX;

/// The largest source slot a [`HolderId`] can carry (`SPILL_ID` is reserved).
pub const MAX_SLOT: u32 = (u32::MAX >> 8) - 1;

#[inline]
pub fn holder_id(slot: u32, medium: u8) -> HolderId {
    (slot << 8) | medium as u32
}

#[inline]
pub fn slot_of(id: HolderId) -> u32 {
    id >> 8
}

#[inline]
pub fn medium_of(id: HolderId) -> u8 {
    (id & 0xff) as u8
}

/// A holder with its refcount, packed `id << 32 | claim << 31 | refcount`, so that
/// sorting the packed values sorts by id. The claim bit says that the source's
/// engine-hash map holds the block's primary hash (see `tree::Node::ehash`); it is
/// kept equal on every holder of one source on one block.
pub type Holder = u64;

const CLAIM: u32 = 1 << 31;
/// Refcounts saturate here (2 billion stores of one block without a removal).
pub const MAX_REFCOUNT: u32 = CLAIM - 1;

#[inline]
pub fn pack(id: HolderId, refcount: u32) -> Holder {
    ((id as u64) << 32) | (refcount & MAX_REFCOUNT) as u64
}

#[inline]
fn with_claim(h: Holder, claim: bool) -> Holder {
    if claim {
        h | CLAIM as u64
    } else {
        h & !(CLAIM as u64)
    }
}

#[inline]
pub fn id_of(h: Holder) -> HolderId {
    (h >> 32) as HolderId
}

#[inline]
pub fn refcount_of(h: Holder) -> u32 {
    h as u32 & MAX_REFCOUNT
}

#[inline]
pub fn claimed(h: Holder) -> bool {
    h as u32 & CLAIM != 0
}

/// Holder lists of nodes with more than one holder, in one flat array of words.
///
/// A list at offset `o` is a header word (`len << 32 | capacity`) followed by
/// `capacity` holder words; capacities are powers of two (at least 2), and freed
/// blocks are recycled per capacity. One array rather than a `Vec` per list: reading
/// a list is one cache miss instead of two (the `Vec`'s header, then its buffer),
/// and lists spilled together (a shared prompt's blocks, stored by one event) are
/// neighbours, so `match` reads them in a few lines.
#[derive(Debug, Default, Clone)]
pub struct Spills {
    words: Vec<u64>,
    /// The first free block of each capacity (by log2 of the capacity), as its
    /// offset + 1 (0: none). The free blocks of one capacity form a list threaded
    /// through the arena itself: a free block's first holder word holds the next
    /// one's offset + 1.
    /// So the free lists take no memory of their own, and an arena that served a
    /// fleet serves the next one of the same size with the same bytes (a `Vec` of
    /// offsets per capacity kept the capacity it reached when a fleet left:
    /// `index/churn_tests.rs`).
    free: [u32; 32],
    in_use: usize,
}

impl Spills {
    #[inline]
    fn header(&self, at: u32) -> (usize, usize) {
        let h = self.words[at as usize];
        ((h >> 32) as usize, h as u32 as usize)
    }

    #[inline]
    fn set_len(&mut self, at: u32, len: usize) {
        let w = &mut self.words[at as usize];
        *w = (len as u64) << 32 | (*w as u32 as u64);
    }

    /// A block for `holders` (sorted): the smallest power-of-two capacity.
    fn alloc(&mut self, holders: &[Holder]) -> u32 {
        let capacity = holders.len().next_power_of_two().max(2);
        let class = capacity.trailing_zeros() as usize;
        let at = match self.free[class] {
            0 => None,
            head => Some(head - 1),
        };
        let at = match at {
            Some(at) => {
                self.free[class] = self.words[at as usize + 1] as u32;
                at
            }
            None => {
                let at = self.words.len();
                // Offset u32::MAX would read as `HolderSet::FREED`.
                assert!(
                    at + 1 + capacity < u32::MAX as usize,
                    "spill arena full (32 GiB of holder lists)"
                );
                self.words.resize(at + 1 + capacity, 0);
                at as u32
            }
        };
        let o = at as usize;
        self.words[o] = (holders.len() as u64) << 32 | capacity as u64;
        self.words[o + 1..o + 1 + holders.len()].copy_from_slice(holders);
        self.in_use += 1;
        at
    }

    fn release(&mut self, at: u32) {
        let (_, capacity) = self.header(at);
        let class = capacity.trailing_zeros() as usize;
        // Every capacity is at least 2: the first holder word is there.
        self.words[at as usize + 1] = self.free[class] as u64;
        self.free[class] = at + 1;
        self.in_use -= 1;
    }

    #[inline]
    fn list(&self, at: u32) -> &[Holder] {
        let (len, _) = self.header(at);
        let o = at as usize + 1;
        &self.words[o..o + len]
    }

    #[inline]
    fn list_mut(&mut self, at: u32) -> &mut [Holder] {
        let (len, _) = self.header(at);
        let o = at as usize + 1;
        &mut self.words[o..o + len]
    }

    /// Inserts `h` at `pos` of list `at`; returns the list's offset (it moves when full).
    fn insert(&mut self, at: u32, pos: usize, h: Holder) -> u32 {
        let (len, capacity) = self.header(at);
        if len == capacity {
            let mut grown = Vec::with_capacity(len + 1);
            grown.extend_from_slice(self.list(at));
            grown.insert(pos, h);
            self.release(at);
            return self.alloc(&grown);
        }
        let o = at as usize + 1;
        self.words.copy_within(o + pos..o + len, o + pos + 1);
        self.words[o + pos] = h;
        self.set_len(at, len + 1);
        at
    }

    /// Removes the holder at `pos` of list `at`.
    fn remove(&mut self, at: u32, pos: usize) {
        let (len, _) = self.header(at);
        let o = at as usize + 1;
        self.words.copy_within(o + pos + 1..o + len, o + pos);
        self.set_len(at, len - 1);
    }

    /// Starts loading list `at` (its header and first holders).
    #[inline]
    fn prefetch(&self, at: u32) {
        if let Some(w) = self.words.get(at as usize) {
            super::keytable::prefetch(w);
        }
    }

    pub fn in_use(&self) -> usize {
        self.in_use
    }

    /// Heap bytes held by the arena.
    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * 8
    }
}

/// What removing one reference did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// The (source, medium) did not hold the block.
    NotHeld,
    /// One reference less; the pair is still resident.
    Decremented,
    /// The last reference went: the pair is no longer resident.
    Gone,
}

/// 0 = no holder; `pack(SPILL_ID, i)` = list `i` of the arena; else one inline holder.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HolderSet(u64);

impl HolderSet {
    /// Marks a freed slab slot (`tree::Hot`): spill list `u32::MAX`, which no live
    /// set names (`Spills::alloc` stops before it). Never passed to other methods.
    pub const FREED: HolderSet = HolderSet(u64::MAX);

    #[inline]
    pub fn is_freed(self) -> bool {
        self.0 == Self::FREED.0
    }

    #[inline]
    fn spill_index(self) -> Option<u32> {
        (self.0 != 0 && id_of(self.0) == SPILL_ID).then_some(self.0 as u32)
    }

    #[inline]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Starts loading a spilled set's list (nothing for an inline one).
    #[inline]
    pub fn prefetch(self, spills: &Spills) {
        if let Some(i) = self.spill_index() {
            spills.prefetch(i);
        }
    }

    /// The holders, sorted by id.
    #[inline]
    pub fn as_slice<'a>(&'a self, spills: &'a Spills) -> &'a [Holder] {
        if self.0 == 0 {
            &[]
        } else if let Some(i) = self.spill_index() {
            spills.list(i)
        } else {
            std::slice::from_ref(&self.0)
        }
    }

    /// Adds `n` references of `id`; returns true if the pair is new. A new pair takes
    /// the claim bit of the source's other holders of this block.
    pub fn add(&mut self, spills: &mut Spills, id: HolderId, n: u32) -> bool {
        debug_assert!(id != SPILL_ID && n > 0);
        let bump = |h: Holder| {
            with_claim(
                pack(id_of(h), refcount_of(h).saturating_add(n).min(MAX_REFCOUNT)),
                claimed(h),
            )
        };
        if self.0 == 0 {
            self.0 = pack(id, n);
            return true;
        }
        let claim = self.claimed_by(spills, slot_of(id));
        if let Some(i) = self.spill_index() {
            let list = spills.list_mut(i);
            return match list.binary_search_by_key(&id, |&h| id_of(h)) {
                Ok(pos) => {
                    list[pos] = bump(list[pos]);
                    false
                }
                Err(pos) => {
                    let at = spills.insert(i, pos, with_claim(pack(id, n), claim));
                    self.0 = ((SPILL_ID as u64) << 32) | at as u64;
                    true
                }
            };
        }
        let current = self.0;
        if id_of(current) == id {
            self.0 = bump(current);
            return false;
        }
        let new = with_claim(pack(id, n), claim);
        let list = if current < new {
            [current, new]
        } else {
            [new, current]
        };
        self.0 = ((SPILL_ID as u64) << 32) | spills.alloc(&list) as u64;
        true
    }

    /// Whether source `slot` claims this block's primary engine hash.
    pub fn claimed_by(&self, spills: &Spills, slot: u32) -> bool {
        self.as_slice(spills)
            .iter()
            .any(|&h| slot_of(id_of(h)) == slot && claimed(h))
    }

    /// Sets or clears the claim bit on every holder of source `slot`.
    pub fn set_claim(&mut self, spills: &mut Spills, slot: u32, claim: bool) {
        if self.0 == 0 {
            return;
        }
        if let Some(i) = self.spill_index() {
            for h in spills.list_mut(i).iter_mut() {
                if slot_of(id_of(*h)) == slot {
                    *h = with_claim(*h, claim);
                }
            }
        } else if slot_of(id_of(self.0)) == slot {
            self.0 = with_claim(self.0, claim);
        }
    }

    /// Removes one reference of `id`.
    pub fn remove_one(&mut self, spills: &mut Spills, id: HolderId) -> Removed {
        self.remove(spills, id, false)
    }

    /// Removes every reference of `id`; returns whether it was held.
    pub fn remove_all(&mut self, spills: &mut Spills, id: HolderId) -> bool {
        self.remove(spills, id, true) != Removed::NotHeld
    }

    fn remove(&mut self, spills: &mut Spills, id: HolderId, all: bool) -> Removed {
        if self.0 == 0 {
            return Removed::NotHeld;
        }
        if let Some(i) = self.spill_index() {
            let list = spills.list_mut(i);
            let Ok(pos) = list.binary_search_by_key(&id, |&h| id_of(h)) else {
                return Removed::NotHeld;
            };
            let rc = refcount_of(list[pos]);
            if rc > 1 && !all {
                list[pos] = with_claim(pack(id, rc - 1), claimed(list[pos]));
                return Removed::Decremented;
            }
            spills.remove(i, pos);
            if let [last] = *spills.list(i) {
                spills.release(i);
                self.0 = last;
            }
            return Removed::Gone;
        }
        if id_of(self.0) != id {
            return Removed::NotHeld;
        }
        let rc = refcount_of(self.0);
        if rc > 1 && !all {
            self.0 = with_claim(pack(id, rc - 1), claimed(self.0));
            Removed::Decremented
        } else {
            self.0 = 0;
            Removed::Gone
        }
    }

    /// True if any holder belongs to source `slot`.
    #[inline]
    pub fn has_slot(&self, spills: &Spills, slot: u32) -> bool {
        self.slot_count(spills, slot) > 0
    }

    /// How many holders (media) source `slot` has here. A source's holders are
    /// neighbours in the sorted list (the slot is the id's high bits): a binary
    /// search, not a pass over a shared prompt's ~1,024 holders.
    #[inline]
    pub fn slot_count(&self, spills: &Spills, slot: u32) -> usize {
        let list = self.as_slice(spills);
        let from = list.partition_point(|&h| slot_of(id_of(h)) < slot);
        list[from..]
            .iter()
            .take_while(|&&h| slot_of(id_of(h)) == slot)
            .count()
    }

    /// Removes every holder of source `slot`; returns how many pairs went.
    pub fn remove_slot(&mut self, spills: &mut Spills, slot: u32) -> usize {
        if self.0 == 0 {
            return 0;
        }
        if self.spill_index().is_none() {
            // One inline holder (most blocks): no allocation, no search.
            if slot_of(id_of(self.0)) != slot {
                return 0;
            }
            self.0 = 0;
            return 1;
        }
        let mut gone = 0;
        // A source has at most 256 media: its ids, collected without allocating.
        while let Some(&h) = {
            let list = self.as_slice(spills);
            let from = list.partition_point(|&h| slot_of(id_of(h)) < slot);
            list.get(from).filter(|&&h| slot_of(id_of(h)) == slot)
        } {
            self.remove_all(spills, id_of(h));
            gone += 1;
        }
        gone
    }

    /// Frees the spill list, if any (the node is being collected).
    pub fn release(&mut self, spills: &mut Spills) {
        if let Some(i) = self.spill_index() {
            spills.release(i);
        }
        self.0 = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_spill_and_back() {
        let mut s = Spills::default();
        let mut h = HolderSet::default();
        assert!(h.add(&mut s, holder_id(3, 0), 1));
        assert!(!h.add(&mut s, holder_id(3, 0), 1));
        assert!(h.add(&mut s, holder_id(1, 2), 1));
        assert_eq!(s.in_use(), 1);
        let ids: Vec<_> = h.as_slice(&s).iter().map(|&x| id_of(x)).collect();
        assert_eq!(ids, vec![holder_id(1, 2), holder_id(3, 0)]);
        assert_eq!(h.remove_one(&mut s, holder_id(3, 0)), Removed::Decremented);
        assert_eq!(h.remove_one(&mut s, holder_id(3, 0)), Removed::Gone);
        assert_eq!(s.in_use(), 0);
        assert_eq!(h.as_slice(&s).len(), 1);
        assert_eq!(h.remove_one(&mut s, holder_id(9, 0)), Removed::NotHeld);
        assert_eq!(h.remove_one(&mut s, holder_id(1, 2)), Removed::Gone);
        assert!(h.is_empty());
    }

    #[test]
    fn remove_slot_takes_every_medium() {
        let mut s = Spills::default();
        let mut h = HolderSet::default();
        for m in 0..3 {
            h.add(&mut s, holder_id(5, m), 2);
        }
        h.add(&mut s, holder_id(6, 0), 1);
        assert!(h.has_slot(&s, 5));
        assert_eq!(h.remove_slot(&mut s, 5), 3);
        assert!(!h.has_slot(&s, 5));
        assert_eq!(h.as_slice(&s), &[pack(holder_id(6, 0), 1)]);
        assert_eq!(s.in_use(), 0);
    }

    #[test]
    fn claim_bits_follow_the_source() {
        let mut s = Spills::default();
        let mut h = HolderSet::default();
        h.add(&mut s, holder_id(5, 0), 1);
        h.set_claim(&mut s, 5, true);
        h.add(&mut s, holder_id(5, 1), 1); // a new medium inherits the claim
        h.add(&mut s, holder_id(6, 0), 1);
        assert!(h.claimed_by(&s, 5) && !h.claimed_by(&s, 6));
        h.add(&mut s, holder_id(5, 0), 3);
        assert_eq!(h.remove_one(&mut s, holder_id(5, 0)), Removed::Decremented);
        let rcs: Vec<(u32, bool)> = h
            .as_slice(&s)
            .iter()
            .map(|&x| (refcount_of(x), claimed(x)))
            .collect();
        assert_eq!(rcs, vec![(3, true), (1, true), (1, false)]);
        h.set_claim(&mut s, 5, false);
        assert!(!h.claimed_by(&s, 5));
    }

    /// What a set should hold: holder id → (refcount, claim), kept by plain rules.
    type Model = std::collections::BTreeMap<HolderId, (u32, bool)>;

    fn model_list(m: &Model) -> Vec<Holder> {
        m.iter()
            .map(|(&id, &(rc, claim))| with_claim(pack(id, rc), claim))
            .collect()
    }

    proptest::proptest! {
        /// Several sets sharing one arena (so that lists grow, move, shrink back inline
        /// and get recycled) against a model: after every operation each set lists
        /// exactly the model's holders, and the arena counts exactly the spilled sets.
        #[test]
        fn sets_sharing_an_arena_behave_like_maps(
            ops in proptest::collection::vec(
                (0..6usize, 0..6u8, 0..5u32, 0..3u8, 1..4u32),
                1..300,
            ),
        ) {
            let mut spills = Spills::default();
            let mut sets = [HolderSet::default(); 6];
            let mut models: [Model; 6] = Default::default();
            for (set, op, slot, medium, n) in ops {
                let id = holder_id(slot, medium);
                let (h, m) = (&mut sets[set], &mut models[set]);
                match op {
                    0 | 1 => {
                        // A new pair takes the claim of the source's other holders.
                        let claim = m.iter().any(|(&k, &(_, c))| slot_of(k) == slot && c);
                        let new = !m.contains_key(&id);
                        let e = m.entry(id).or_insert((0, claim));
                        e.0 = (e.0 + n).min(MAX_REFCOUNT);
                        proptest::prop_assert_eq!(h.add(&mut spills, id, n), new);
                    }
                    2 => {
                        let want = match m.get_mut(&id) {
                            None => Removed::NotHeld,
                            Some(e) if e.0 > 1 => {
                                e.0 -= 1;
                                Removed::Decremented
                            }
                            Some(_) => {
                                m.remove(&id);
                                Removed::Gone
                            }
                        };
                        proptest::prop_assert_eq!(h.remove_one(&mut spills, id), want);
                    }
                    3 => {
                        let claim = n % 2 == 1;
                        for (k, e) in m.iter_mut() {
                            if slot_of(*k) == slot {
                                e.1 = claim;
                            }
                        }
                        h.set_claim(&mut spills, slot, claim);
                    }
                    4 => {
                        let before = m.len();
                        m.retain(|&k, _| slot_of(k) != slot);
                        proptest::prop_assert_eq!(h.remove_slot(&mut spills, slot), before - m.len());
                    }
                    _ => {
                        m.clear();
                        h.release(&mut spills);
                    }
                }
                for (h, m) in sets.iter().zip(&models) {
                    let want = model_list(m);
                    proptest::prop_assert_eq!(h.as_slice(&spills), want.as_slice());
                    proptest::prop_assert!(!h.is_freed());
                }
                let spilled = models.iter().filter(|m| m.len() > 1).count();
                proptest::prop_assert_eq!(spills.in_use(), spilled);
            }
        }
    }
}
