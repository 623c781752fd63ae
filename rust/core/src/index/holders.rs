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

/// Holder lists of nodes with more than one holder; freed lists are recycled.
#[derive(Debug, Default, Clone)]
pub struct Spills {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl Spills {
    fn alloc(&mut self, list: Vec<Holder>) -> u32 {
        // Index u32::MAX would read as `HolderSet::FREED` (4 G lists: never reached).
        assert!(self.lists.len() < u32::MAX as usize, "spill arena full");
        match self.free.pop() {
            Some(i) => {
                self.lists[i as usize] = list;
                i
            }
            None => {
                self.lists.push(list);
                (self.lists.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, i: u32) -> Vec<Holder> {
        self.free.push(i);
        std::mem::take(&mut self.lists[i as usize])
    }

    pub fn in_use(&self) -> usize {
        self.lists.len() - self.free.len()
    }

    /// Heap bytes held by the arena and its lists.
    pub fn heap_bytes(&self) -> usize {
        self.lists.capacity() * std::mem::size_of::<Vec<Holder>>()
            + self.free.capacity() * 4
            + self
                .lists
                .iter()
                .map(|l| l.capacity() * std::mem::size_of::<Holder>())
                .sum::<usize>()
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

    /// The holders, sorted by id.
    #[inline]
    pub fn as_slice<'a>(&'a self, spills: &'a Spills) -> &'a [Holder] {
        if self.0 == 0 {
            &[]
        } else if let Some(i) = self.spill_index() {
            &spills.lists[i as usize]
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
            let list = &mut spills.lists[i as usize];
            return match list.binary_search_by_key(&id, |&h| id_of(h)) {
                Ok(pos) => {
                    list[pos] = bump(list[pos]);
                    false
                }
                Err(pos) => {
                    list.insert(pos, with_claim(pack(id, n), claim));
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
            vec![current, new]
        } else {
            vec![new, current]
        };
        self.0 = ((SPILL_ID as u64) << 32) | spills.alloc(list) as u64;
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
            for h in spills.lists[i as usize].iter_mut() {
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
            let list = &mut spills.lists[i as usize];
            let Ok(pos) = list.binary_search_by_key(&id, |&h| id_of(h)) else {
                return Removed::NotHeld;
            };
            let rc = refcount_of(list[pos]);
            if rc > 1 && !all {
                list[pos] = with_claim(pack(id, rc - 1), claimed(list[pos]));
                return Removed::Decremented;
            }
            list.remove(pos);
            if list.len() == 1 {
                let last = list[0];
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
    pub fn has_slot(&self, spills: &Spills, slot: u32) -> bool {
        self.as_slice(spills)
            .iter()
            .any(|&h| slot_of(id_of(h)) == slot)
    }

    /// Removes every holder of source `slot`; returns how many pairs went.
    pub fn remove_slot(&mut self, spills: &mut Spills, slot: u32) -> usize {
        let ids: Vec<HolderId> = self
            .as_slice(spills)
            .iter()
            .map(|&h| id_of(h))
            .filter(|&id| slot_of(id) == slot)
            .collect();
        for &id in &ids {
            self.remove_all(spills, id);
        }
        ids.len()
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
}
