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

/// A holder with its refcount, packed `id << 32 | refcount`, so that sorting the
/// packed values sorts by id.
pub type Holder = u64;

#[inline]
pub fn pack(id: HolderId, refcount: u32) -> Holder {
    ((id as u64) << 32) | refcount as u64
}

#[inline]
pub fn id_of(h: Holder) -> HolderId {
    (h >> 32) as HolderId
}

#[inline]
pub fn refcount_of(h: Holder) -> u32 {
    h as u32
}

/// Holder lists of nodes with more than one holder; freed lists are recycled.
#[derive(Debug, Default, Clone)]
pub struct Spills {
    lists: Vec<Vec<Holder>>,
    free: Vec<u32>,
}

impl Spills {
    fn alloc(&mut self, list: Vec<Holder>) -> u32 {
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
    #[inline]
    fn spill_index(self) -> Option<u32> {
        (self.0 != 0 && id_of(self.0) == SPILL_ID).then_some(refcount_of(self.0))
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

    /// Adds `n` references of `id`; returns true if the pair is new.
    pub fn add(&mut self, spills: &mut Spills, id: HolderId, n: u32) -> bool {
        debug_assert!(id != SPILL_ID && n > 0);
        if self.0 == 0 {
            self.0 = pack(id, n);
            return true;
        }
        if let Some(i) = self.spill_index() {
            let list = &mut spills.lists[i as usize];
            return match list.binary_search_by_key(&id, |&h| id_of(h)) {
                Ok(pos) => {
                    // Saturates at u32::MAX references (4 billion stores without a removal).
                    list[pos] = pack(id, refcount_of(list[pos]).saturating_add(n));
                    false
                }
                Err(pos) => {
                    list.insert(pos, pack(id, n));
                    true
                }
            };
        }
        let current = self.0;
        if id_of(current) == id {
            self.0 = pack(id, refcount_of(current).saturating_add(n));
            return false;
        }
        let new = pack(id, n);
        let list = if current < new {
            vec![current, new]
        } else {
            vec![new, current]
        };
        self.0 = pack(SPILL_ID, spills.alloc(list));
        true
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
                list[pos] = pack(id, rc - 1);
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
            self.0 = pack(id, rc - 1);
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
}
