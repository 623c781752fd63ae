//! The block tree: nodes in a slab, found by content key through a hash table.
//!
//! Content keys are chained (one key names a whole prefix), so a flat table
//! `key → node` *is* a radix tree over block paths whose edge labels are the keys.
//! Links are kept only for garbage collection and subtree scans: a parent id and a
//! first child per node, and a side set for the few nodes with more children.
//!
//! A node is split in two slabs with the same ids: [`Hot`] (key and holders, the
//! only fields `match` reads: 16 bytes, four per cache line) and [`Node`] (links,
//! depth, pins, primary engine hash). A request's blocks are mostly runs of
//! consecutive ids, so `match` streams 16 bytes per block instead of 40.

use hashbrown::{HashMap, HashSet};

use super::keytable::{KeyTable, Slab};

use super::holders::{HolderSet, Spills};
use super::hugepages;
use super::sources::MixBuild;

/// "No node" in parent links and the free list.
pub const NIL: u32 = u32::MAX;

/// Bit of `Node::depth_flags` saying that `ehash` is set (and in the ehash table).
pub(super) const HAS_EHASH: u32 = 1 << 31;

/// What `match` reads of a node: its content key and its holders.
#[derive(Debug, Clone, Copy)]
pub struct Hot {
    pub key: u64,
    /// [`HolderSet::FREED`] in a freed slot (no live node has it), so that a slot
    /// can be trusted without asking the table (`Tree::live_node_with_key`).
    pub holders: HolderSet,
}

/// The rest of a node (same id as its [`Hot`] part).
#[derive(Debug, Clone)]
pub struct Node {
    /// The block's *primary* engine hash (`engine_map_key(group, hash)` of the store
    /// that created it), indexed by the tree's second table, so that every source
    /// publishing that same hash (vLLM engines with the same hash seed do) needs no
    /// engine-map entry of its own: a claim bit on its holders says so.
    pub ehash: u64,
    /// The parent node, or NIL for a root. Doubles as the free-list link of a freed slot.
    pub parent_id: u32,
    /// Depth (low 31 bits) and HAS_EHASH.
    pub depth_flags: u32,
    /// One child (NIL if none); any further children are in `Tree::more_children`.
    pub first_child: u32,
    pub pins: u32,
}

impl Node {
    #[inline]
    pub fn depth(&self) -> u32 {
        self.depth_flags & !HAS_EHASH
    }

    #[inline]
    pub fn ehash(&self) -> Option<u64> {
        (self.depth_flags & HAS_EHASH != 0).then_some(self.ehash)
    }
}

/// The key table indexes the hot slab by content key; a freed slot is not indexed.
impl Slab for [Hot] {
    #[inline]
    fn key_at(&self, id: u32) -> u64 {
        self[id as usize].key
    }

    #[inline]
    fn indexed(&self, id: u32) -> bool {
        !self[id as usize].holders.is_freed()
    }

    #[inline]
    fn entry(&self, id: u32) -> *const u8 {
        &self[id as usize] as *const Hot as *const u8
    }

    fn slab_len(&self) -> usize {
        self.len()
    }
}

/// The primary-hash table indexes the node slab by `ehash`, exactly while HAS_EHASH is set.
impl Slab for [Node] {
    #[inline]
    fn key_at(&self, id: u32) -> u64 {
        self[id as usize].ehash
    }

    #[inline]
    fn indexed(&self, id: u32) -> bool {
        self[id as usize].depth_flags & HAS_EHASH != 0
    }

    #[inline]
    fn entry(&self, id: u32) -> *const u8 {
        &self[id as usize] as *const Node as *const u8
    }

    fn slab_len(&self) -> usize {
        self.len()
    }
}

/// From this many nodes on, a full slab grows by an eighth instead of doubling.
const GENTLE_GROWTH_FROM: usize = 1 << 20;

/// Makes room for one more element: beyond [`GENTLE_GROWTH_FROM`], by an eighth of
/// the capacity rather than `Vec`'s doubling, so that the slab's unused capacity is
/// at most an eighth of it instead of up to half (at fleet size a doubled slab leaves
/// a large share of the index's memory unused; docs/results/residency-index.md).
/// The slab is that large only in its own mmap, which glibc's `realloc` moves with
/// `mremap` (no copy), so the extra growths cost page-table updates, not copies.
#[inline]
fn grow_gently<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() && v.capacity() >= GENTLE_GROWTH_FROM {
        v.reserve_exact(v.capacity() / 8);
    }
}

#[derive(Debug, Clone, Default)]
pub struct Tree {
    /// Key and holders of each node, by id.
    pub(super) hot: Vec<Hot>,
    /// The other fields of each node, by id.
    pub(super) nodes: Vec<Node>,
    pub(super) table: KeyTable,
    /// Nodes by primary engine hash.
    pub(super) by_ehash: KeyTable,
    /// Children beyond `Node::first_child`, for the few nodes with several (a shared
    /// prompt's last block, branch points): chains, the common case, cost nothing.
    more_children: HashMap<u32, HashSet<u32, MixBuild>, MixBuild>,
    /// Parent key of each root: the namespace id (absent = 0, a pinned root).
    root_parent: HashMap<u32, u64, MixBuild>,
    free_head: Option<u32>,
    pub spills: Spills,
}

impl Tree {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    #[inline]
    pub fn find(&self, key: u64) -> Option<u32> {
        self.table.find(key, self.hot.as_slice())
    }

    /// Starts loading the ehash-table slots of `ehashes`.
    #[inline]
    pub fn prefetch_ehash(&self, ehashes: impl Iterator<Item = u64>) {
        for e in ehashes {
            self.by_ehash.prefetch_slot(e);
        }
    }

    /// Makes room for `blocks` nodes in all (slab and both tables).
    pub fn reserve(&mut self, blocks: usize) -> Result<(), std::collections::TryReserveError> {
        self.hot
            .try_reserve_exact(blocks.saturating_sub(self.hot.len()))?;
        self.nodes
            .try_reserve_exact(blocks.saturating_sub(self.nodes.len()))?;
        hugepages::advise(&self.hot);
        hugepages::advise(&self.nodes);
        self.table.reserve(blocks, self.hot.as_slice())?;
        self.by_ehash.reserve(blocks, self.nodes.as_slice())
    }

    /// Starts loading the key-table slot of `key`.
    #[inline]
    pub fn prefetch_slot(&self, key: u64) {
        self.table.prefetch_slot(key);
    }

    /// Starts loading the ehash-table slot of `ehash`.
    #[inline]
    pub fn prefetch_ehash_slot(&self, ehash: u64) {
        self.by_ehash.prefetch_slot(ehash);
    }

    /// The node whose primary engine hash is `ehash`.
    #[inline]
    pub fn find_ehash(&self, ehash: u64) -> Option<u32> {
        self.by_ehash.find(ehash, self.nodes.as_slice())
    }

    /// Makes `ehash` the primary engine hash of `id`, if the node has none and no
    /// other node has it. Returns whether it did.
    pub fn try_set_ehash(&mut self, id: u32, ehash: u64) -> bool {
        if self.nodes[id as usize].ehash().is_some() || self.find_ehash(ehash).is_some() {
            return false;
        }
        let n = &mut self.nodes[id as usize];
        n.ehash = ehash;
        n.depth_flags |= HAS_EHASH;
        self.by_ehash.insert(id, self.nodes.as_slice());
        true
    }

    /// Starts loading the table slots of `keys` only (ingest: most keys are new,
    /// so reading a slot to prefetch a node would only stall on it).
    #[inline]
    pub fn prefetch_slots(&self, keys: &[u64]) {
        for &k in keys {
            self.table.prefetch_slot(k);
        }
    }

    /// Starts loading the table slots of `keys` into the L2 cache only (`match`: a
    /// path of runs needs few of them, and L1 prefetches would hold the miss buffers
    /// that the runs' node stream needs).
    #[inline]
    pub fn prefetch_slots_to_l2(&self, keys: &[u64]) {
        for &k in keys {
            self.table.prefetch_slot_to_l2(k);
        }
    }

    /// Starts loading the table slots of `keys` (then their nodes), so that the
    /// lookups that follow find them in cache: the misses overlap.
    #[inline]
    pub fn prefetch(&self, keys: &[u64]) {
        for &k in keys {
            self.table.prefetch_slot(k);
        }
        for &k in keys {
            let id = self.table.candidate(k);
            if id != NIL {
                super::keytable::prefetch(&self.hot[id as usize]);
            }
        }
    }

    /// `id` if it is a live node whose key is `key`: the table's answer for `key`
    /// (live keys are unique), found without probing the table. Used to try the
    /// slot after the previous block of a path first: a stored run of blocks gets
    /// consecutive slots.
    #[inline]
    pub fn live_node_with_key(&self, id: u32, key: u64) -> Option<u32> {
        let h = self.hot.get(id as usize)?;
        (h.key == key && !h.holders.is_freed()).then_some(id)
    }

    /// Starts loading node `id`'s hot and cold parts (nothing beyond the slab).
    #[inline]
    pub fn prefetch_node(&self, id: u32) {
        if let (Some(h), Some(n)) = (self.hot.get(id as usize), self.nodes.get(id as usize)) {
            super::keytable::prefetch(h);
            super::keytable::prefetch(n);
        }
    }

    /// Starts loading what collecting node `id` touches first: its key's and its
    /// primary hash's table slots and its parent (nothing for a freed slot).
    #[inline]
    pub fn prefetch_collect(&self, id: u32) {
        let Some(h) = self.hot.get(id as usize) else {
            return;
        };
        if h.holders.is_freed() {
            return;
        }
        self.table.prefetch_slot(h.key);
        let n = &self.nodes[id as usize];
        if let Some(e) = n.ehash() {
            self.by_ehash.prefetch_slot(e);
        }
        if let Some(p) = self.nodes.get(n.parent_id as usize) {
            super::keytable::prefetch(p);
        }
    }

    /// The second step after [`Tree::prefetch_collect`], once the table slots are
    /// in cache: the nodes of the clusters that the removal of `id`'s key and primary
    /// hash will shift back (each a random line of the slab).
    #[inline]
    pub fn prefetch_collect_clusters(&self, id: u32) {
        let Some(h) = self.hot.get(id as usize) else {
            return;
        };
        if h.holders.is_freed() {
            return;
        }
        self.table.prefetch_cluster(h.key, self.hot.as_slice(), 4);
        if let Some(e) = self.nodes[id as usize].ehash() {
            self.by_ehash.prefetch_cluster(e, self.nodes.as_slice(), 4);
        }
    }

    /// Starts loading the hot parts of nodes `first .. first + count` (clamped to
    /// the slab): every cache line they span.
    #[inline]
    pub fn prefetch_hot(&self, first: u32, count: usize) {
        let lo = (first as usize).min(self.hot.len());
        let hi = lo.saturating_add(count).min(self.hot.len());
        let bytes = (hi - lo) * std::mem::size_of::<Hot>();
        let base = self.hot[lo..hi].as_ptr() as *const u8;
        for off in (0..bytes).step_by(64) {
            // wrapping_add: stays inside the slice; a prefetch never faults anyway.
            super::keytable::prefetch(base.wrapping_add(off));
        }
    }

    #[inline]
    pub fn key(&self, id: u32) -> u64 {
        self.hot[id as usize].key
    }

    #[inline]
    pub fn holders(&self, id: u32) -> HolderSet {
        self.hot[id as usize].holders
    }

    #[inline]
    pub fn set_holders(&mut self, id: u32, holders: HolderSet) {
        self.hot[id as usize].holders = holders;
    }

    #[inline]
    pub fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    #[inline]
    pub fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// The parent's content key; the namespace id for a root (0 if unknown).
    pub fn parent_key(&self, id: u32) -> u64 {
        match self.nodes[id as usize].parent_id {
            NIL => self.root_parent.get(&id).copied().unwrap_or(0),
            p => self.hot[p as usize].key,
        }
    }

    /// The node for `key`, created if absent: under `parent_id`, or as a root whose
    /// parent key is `parent` when `parent_id` is NIL. An existing node keeps its
    /// parent and depth.
    pub fn get_or_insert(&mut self, key: u64, parent: u64, parent_id: u32, depth: u32) -> u32 {
        if let Some(id) = self.find(key) {
            return id;
        }
        let hot = Hot {
            key,
            holders: HolderSet::default(),
        };
        let node = Node {
            ehash: 0,
            parent_id,
            depth_flags: depth.min(!HAS_EHASH),
            first_child: NIL,
            pins: 0,
        };
        let id = match self.free_head {
            Some(id) => {
                let next = self.nodes[id as usize].parent_id;
                self.free_head = (next != NIL).then_some(next);
                self.hot[id as usize] = hot;
                self.nodes[id as usize] = node;
                id
            }
            None => self.push(hot, node),
        };
        self.table.insert(id, self.hot.as_slice());
        if parent_id != NIL {
            self.add_child(parent_id, id);
        } else if parent != 0 {
            self.root_parent.insert(id, parent);
        }
        id
    }

    /// Appends to both slabs and returns the new id; a slab that grew gets huge
    /// pages (`hugepages`).
    #[inline]
    fn push(&mut self, hot: Hot, node: Node) -> u32 {
        grow_gently(&mut self.hot);
        grow_gently(&mut self.nodes);
        let capacities = (self.hot.capacity(), self.nodes.capacity());
        self.hot.push(hot);
        self.nodes.push(node);
        if self.hot.capacity() != capacities.0 {
            hugepages::advise(&self.hot);
        }
        if self.nodes.capacity() != capacities.1 {
            hugepages::advise(&self.nodes);
        }
        (self.nodes.len() - 1) as u32
    }

    /// Snapshot restore: appends a node (no holders, no links, not yet in the key
    /// table: `index_loaded_keys` does that for all at once). Returns its id.
    pub(super) fn push_loaded(&mut self, key: u64, root_parent: u64, depth: u32) -> u32 {
        let id = self.push(
            Hot {
                key,
                holders: HolderSet::default(),
            },
            Node {
                ehash: 0,
                parent_id: NIL,
                depth_flags: depth.min(!HAS_EHASH),
                first_child: NIL,
                pins: 0,
            },
        );
        if root_parent != 0 {
            self.root_parent.insert(id, root_parent);
        }
        id
    }

    /// Snapshot restore: puts every node of the slab into the (presized, empty) key
    /// table, the slots of the nodes a few ahead prefetched: in slab order the keys'
    /// slots are random, and without it each insert would wait for its own miss.
    /// `Err(key)` if a key is there twice.
    pub(super) fn index_loaded_keys(&mut self) -> Result<(), u64> {
        const AHEAD: usize = 16;
        debug_assert!(self.table.len() == 0);
        for id in 0..self.hot.len() {
            if let Some(next) = self.hot.get(id + AHEAD) {
                self.table.prefetch_slot(next.key);
            }
            let key = self.hot[id].key;
            if self.find(key).is_some() {
                return Err(key);
            }
            self.table.insert(id as u32, self.hot.as_slice());
        }
        Ok(())
    }

    /// Re-parents a node created as a root (snapshot restore).
    pub fn link(&mut self, id: u32, parent_id: u32) {
        self.root_parent.remove(&id);
        self.nodes[id as usize].parent_id = parent_id;
        self.add_child(parent_id, id);
    }

    fn add_child(&mut self, parent: u32, child: u32) {
        let p = &mut self.nodes[parent as usize];
        if p.first_child == NIL {
            p.first_child = child;
        } else {
            self.more_children.entry(parent).or_default().insert(child);
        }
    }

    fn remove_child(&mut self, parent: u32, child: u32) {
        if self.nodes[parent as usize].first_child == child {
            // Promote another child, if any, to first.
            let next = match self.more_children.get_mut(&parent) {
                Some(set) => {
                    let c = *set.iter().next().expect("sets are never left empty");
                    set.remove(&c);
                    if set.is_empty() {
                        self.more_children.remove(&parent);
                    }
                    c
                }
                None => NIL,
            };
            self.nodes[parent as usize].first_child = next;
        } else if let Some(set) = self.more_children.get_mut(&parent) {
            set.remove(&child);
            if set.is_empty() {
                self.more_children.remove(&parent);
            }
        }
    }

    /// The children of `id`, in no order.
    pub fn children(&self, id: u32) -> impl Iterator<Item = u32> + '_ {
        let first = self.nodes[id as usize].first_child;
        (first != NIL)
            .then_some(first)
            .into_iter()
            .chain(self.more_children.get(&id).into_iter().flatten().copied())
    }

    #[inline]
    fn collectable(&self, id: u32) -> bool {
        let n = &self.nodes[id as usize];
        self.hot[id as usize].holders.is_empty() && n.pins == 0 && n.first_child == NIL
    }

    /// True if `id` names a live node (not a freed slot).
    #[cfg(test)]
    pub fn is_live(&self, id: u32) -> bool {
        (id as usize) < self.hot.len() && self.find(self.hot[id as usize].key) == Some(id)
    }

    /// Frees `id` and then its ancestors while they have no holder, pin or child.
    /// Returns how many nodes went.
    pub fn collect(&mut self, mut id: u32) -> usize {
        let mut freed = 0;
        while id != NIL && self.collectable(id) {
            let key = self.hot[id as usize].key;
            let parent_id = self.nodes[id as usize].parent_id;
            if parent_id != NIL {
                self.remove_child(parent_id, id);
            } else {
                self.root_parent.remove(&id);
            }
            self.table.remove(key, self.hot.as_slice());
            if let Some(e) = self.nodes[id as usize].ehash() {
                self.by_ehash.remove(e, self.nodes.as_slice());
                self.nodes[id as usize].depth_flags &= !HAS_EHASH;
            }
            let hot = &mut self.hot[id as usize];
            hot.holders.release(&mut self.spills);
            hot.holders = HolderSet::FREED;
            self.nodes[id as usize].parent_id = self.free_head.unwrap_or(NIL);
            self.free_head = Some(id);
            freed += 1;
            id = parent_id;
        }
        freed
    }

    /// Live node ids, in table order.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter()
    }

    /// The ids of the subtree rooted at `root` (itself included), in no order:
    /// a depth-first walk, O(subtree).
    pub fn subtree(&self, root: u32) -> Vec<u32> {
        let mut out = vec![];
        let mut stack = vec![root];
        while let Some(id) = stack.pop() {
            out.push(id);
            stack.extend(self.children(id));
        }
        out
    }

    /// Heap bytes of the slab, the tables and the spill arena.
    pub fn heap_bytes(&self) -> usize {
        self.hot.capacity() * std::mem::size_of::<Hot>()
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.table.heap_bytes()
            + self.by_ehash.heap_bytes()
            + self.root_parent.allocation_size()
            + self.more_children.allocation_size()
            + self
                .more_children
                .values()
                .map(|c| c.allocation_size())
                .sum::<usize>()
            + self.spills.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_stays_compact() {
        assert_eq!(std::mem::size_of::<Hot>(), 16);
        assert_eq!(std::mem::size_of::<Node>(), 24);
    }

    #[test]
    fn collect_walks_up_and_reuses_slots() {
        let mut t = Tree::default();
        let a = t.get_or_insert(10, 1, NIL, 0);
        let b = t.get_or_insert(11, 10, a, 1);
        let c = t.get_or_insert(12, 10, a, 1);
        assert_eq!(t.parent_key(a), 1);
        assert_eq!(t.parent_key(c), 10);
        assert_eq!(t.len(), 3);
        assert_eq!(t.collect(a), 0, "a has children");
        assert_eq!(t.collect(b), 1);
        let mut sub = t.subtree(a);
        sub.sort();
        assert_eq!(sub, vec![a, c]);
        assert_eq!(t.collect(c), 2, "c, then a");
        assert_eq!(t.len(), 0);
        let d = t.get_or_insert(13, 1, NIL, 0);
        assert!(d == a || d == b || d == c, "slot reused");
        assert_eq!(t.find(13), Some(d));
        assert_eq!(t.find(10), None);
    }
}
