//! The block tree: nodes in a slab, found by content key through a hash table.
//!
//! Content keys are chained (one key names a whole prefix), so a flat table
//! `key → node` *is* a radix tree over block paths whose edge labels are the keys;
//! parent/child links are kept only for subtree scans and garbage collection.

use hashbrown::HashTable;

use super::holders::{HolderSet, Spills};

/// "No node" in parent/child/sibling links.
pub const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct Node {
    pub key: u64,
    /// The parent's content key; the namespace id at depth 0 (0 if unknown: a pinned root).
    pub parent: u64,
    pub holders: HolderSet,
    pub depth: u32,
    pub pins: u32,
    /// The parent node, or NIL for a root. Doubles as the free-list link of a freed slot.
    pub parent_id: u32,
    pub first_child: u32,
    pub next_sibling: u32,
    pub prev_sibling: u32,
}

/// Keys are xxh3 outputs; one multiply-fold keeps arbitrary caller keys (pins,
/// matches with small integers) from degrading the table.
#[inline]
fn table_hash(key: u64) -> u64 {
    let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 29)
}

#[derive(Debug, Default, Clone)]
pub struct Tree {
    nodes: Vec<Node>,
    table: HashTable<u32>,
    free_head: Option<u32>,
    pub spills: Spills,
}

impl Tree {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    #[inline]
    pub fn find(&self, key: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.table
            .find(table_hash(key), |&id| nodes[id as usize].key == key)
            .copied()
    }

    #[inline]
    pub fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    #[inline]
    pub fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// The node for `key`, created (linked under `parent_id`) if absent. An existing
    /// node keeps its parent and depth.
    pub fn get_or_insert(&mut self, key: u64, parent: u64, parent_id: u32, depth: u32) -> u32 {
        if let Some(id) = self.find(key) {
            return id;
        }
        let node = Node {
            key,
            parent,
            holders: HolderSet::default(),
            depth,
            pins: 0,
            parent_id,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
        };
        let id = match self.free_head {
            Some(id) => {
                let next = self.nodes[id as usize].parent_id;
                self.free_head = (next != NIL).then_some(next);
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if parent_id != NIL {
            self.link(id, parent_id);
        }
        let nodes = &self.nodes;
        self.table
            .insert_unique(table_hash(key), id, |&i| table_hash(nodes[i as usize].key));
        id
    }

    /// Links a root-created node under `parent_id` (snapshot restore).
    pub fn link(&mut self, id: u32, parent_id: u32) {
        let old_first = self.nodes[parent_id as usize].first_child;
        let n = &mut self.nodes[id as usize];
        n.parent_id = parent_id;
        n.next_sibling = old_first;
        if old_first != NIL {
            self.nodes[old_first as usize].prev_sibling = id;
        }
        self.nodes[parent_id as usize].first_child = id;
    }

    #[inline]
    fn collectable(&self, id: u32) -> bool {
        let n = &self.nodes[id as usize];
        n.holders.is_empty() && n.pins == 0 && n.first_child == NIL
    }

    /// True if `id` names a live node (not a freed slot).
    pub fn is_live(&self, id: u32) -> bool {
        (id as usize) < self.nodes.len() && self.find(self.nodes[id as usize].key) == Some(id)
    }

    /// Frees `id` and then its ancestors while they have no holder, pin or child.
    /// Returns how many nodes went.
    pub fn collect(&mut self, mut id: u32) -> usize {
        let mut freed = 0;
        while id != NIL && self.collectable(id) {
            let Node {
                key,
                parent_id,
                prev_sibling,
                next_sibling,
                ..
            } = self.nodes[id as usize];
            if prev_sibling != NIL {
                self.nodes[prev_sibling as usize].next_sibling = next_sibling;
            } else if parent_id != NIL {
                self.nodes[parent_id as usize].first_child = next_sibling;
            }
            if next_sibling != NIL {
                self.nodes[next_sibling as usize].prev_sibling = prev_sibling;
            }
            let nodes = &self.nodes;
            if let Ok(entry) = self
                .table
                .find_entry(table_hash(key), |&i| nodes[i as usize].key == key)
            {
                entry.remove();
            }
            let mut holders = self.nodes[id as usize].holders;
            holders.release(&mut self.spills);
            let n = &mut self.nodes[id as usize];
            n.holders = holders;
            n.parent_id = self.free_head.unwrap_or(NIL);
            self.free_head = Some(id);
            freed += 1;
            id = parent_id;
        }
        freed
    }

    /// Live node ids, in slab order.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter().copied()
    }

    /// The ids of the subtree rooted at `root` (itself included).
    pub fn subtree(&self, root: u32) -> Vec<u32> {
        let mut out = vec![];
        let mut stack = vec![root];
        while let Some(id) = stack.pop() {
            out.push(id);
            let mut child = self.nodes[id as usize].first_child;
            while child != NIL {
                stack.push(child);
                child = self.nodes[child as usize].next_sibling;
            }
        }
        out
    }

    /// Heap bytes of the slab, the table and the spill arena.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.table.allocation_size()
            + self.spills.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_stays_compact() {
        assert_eq!(std::mem::size_of::<Node>(), 48);
    }

    #[test]
    fn collect_walks_up_and_reuses_slots() {
        let mut t = Tree::default();
        let a = t.get_or_insert(10, 1, NIL, 0);
        let b = t.get_or_insert(11, 10, a, 1);
        let c = t.get_or_insert(12, 10, a, 1);
        assert_eq!(t.len(), 3);
        assert_eq!(t.collect(a), 0, "a has children");
        assert_eq!(t.collect(b), 1);
        assert_eq!(t.subtree(a), vec![a, c]);
        assert_eq!(t.collect(c), 2, "c, then a");
        assert!(t.is_empty());
        let d = t.get_or_insert(13, 1, NIL, 0);
        assert!(d == a || d == b || d == c, "slot reused");
        assert_eq!(t.find(13), Some(d));
        assert_eq!(t.find(10), None);
    }
}
