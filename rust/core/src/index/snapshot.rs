//! A compact binary image of the complete index state, for the persistence layer.
//!
//! Layout (little-endian): magic `QCIDXSNP`, u32 version, the media names, the
//! sources (slot, worker, dp rank, model, tokenizer, engine-hash map keyed by
//! `engine_map_key(group, hash)`), the capacities of the two hash tables, then the
//! nodes, then a CRC-32 of every byte before it. Any corruption is an error, never a
//! silently different index.
//!
//! The nodes are in slab order (live ids ascending) with their parent as an
//! *ordinal* in that order. The loader puts record k in slot k (a request's path,
//! stored block after block, stays a run of consecutive slots that `match` walks
//! without the table), fills the key table in one pass with the slots prefetched
//! ahead, sized as the writer's was (no growth, no rehash, no probe clusters from
//! inserting into a smaller table, which made the v3 loader seconds slow at 1 M
//! nodes), and links parents by ordinal (no lookups).
//!
//! Version 5 (written) stores what cannot be derived, in few bytes: the image is
//! written as it is built, in chunks, and its size is most of the cost of writing
//! and reading a snapshot. Node record: u8 flags, key u64, then only what the flags
//! call for: `ROOT` its parent key u64 (no parent ordinal); `FAR_PARENT` the parent
//! ordinal as a zigzag varint of `ordinal - 1 - parent` (without it the parent is
//! the previous record: a stored run); `DEPTH` the depth as a varint (without it a
//! root's depth is 0 and another node's is its parent's + 1, the parent being the
//! previous record: no random read of a parent to write or to load a record); `PINS` the pin count as a varint; `EHASH` the primary engine
//! hash u64; the holder count in the top three bits (7: a varint follows). Each
//! holder: its id as a varint of the difference to the previous holder's (the
//! first: to 0; ids ascend), then `refcount << 1 | claim` as a varint.
//!
//! Version 4 (read only): the same sections, node records of fixed fields: key u64,
//! parent ordinal u32 (`u32::MAX` for a root, then its parent key u64), depth u32,
//! pins u32, u8 flags (1 = primary engine hash, then it as u64), u32 holder count,
//! packed holders (u64, with claim bits). Images from writers before it have the
//! nodes in key-table slot order; they load the same way (any order does), but a
//! restored index then has a path's nodes scattered over the slab (`match` several
//! times slower until it turns over).
//!
//! Version 3 (read only): nodes in any order with their parent key and a linked flag;
//! loaded by lookups and checked with `check_invariants`.

use std::io::{Read, Write};

use crate::events::Medium;

use super::holders::{
    self, claimed, id_of, medium_of, pack, refcount_of, slot_of, Holder, MAX_REFCOUNT,
};
use super::hugepages;
use super::keytable::prefetch;
use super::sources::{Source, SourceKey};
use super::tree::{Tree, HAS_EHASH, NIL};
use super::Index;

const MAGIC: &[u8; 8] = b"QCIDXSNP";
const VERSION: u32 = 5;
/// The previous versions, still read.
const VERSION_V4: u32 = 4;
const VERSION_V3: u32 = 3;

/// Version 5 node record flags (module docs).
const ROOT: u8 = 1;
const FAR_PARENT: u8 = 2;
const DEPTH: u8 = 4;
const PINS: u8 = 8;
const EHASH: u8 = 16;
const COUNT_SHIFT: u32 = 5;
/// Holder count field value saying that the count follows as a varint.
const COUNT_FOLLOWS: u8 = 7;

/// The writer hands its output on in chunks of about this size.
const CHUNK: usize = 1 << 20;
/// Below this many nodes the cycle check runs inline (a thread costs more).
pub(super) const PARALLEL_CHECK_MIN_NODES: usize = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not an index snapshot (bad magic)")]
    BadMagic,
    #[error(
        "index snapshot version {0} is not supported (this build reads versions {VERSION_V3} to {VERSION})"
    )]
    UnsupportedVersion(u32),
    #[error("index snapshot checksum mismatch: the file is corrupt or truncated")]
    Checksum,
    #[error("index snapshot is corrupt: {0}")]
    Corrupt(String),
}

/// The image writer: bytes go to `w` in chunks of about [`CHUNK`] as the image is
/// built (no buffer of the image's size: that was two copies of it, and their page
/// faults, per snapshot), and the CRC is computed as they go.
struct Out<'w, W: Write> {
    buf: Vec<u8>,
    w: &'w mut W,
    crc: crc32fast::Hasher,
}

impl<'w, W: Write> Out<'w, W> {
    fn new(w: &'w mut W) -> Self {
        Self {
            buf: Vec::with_capacity(CHUNK + (1 << 16)),
            w,
            crc: crc32fast::Hasher::new(),
        }
    }
    fn u8(&mut self, x: u8) {
        self.buf.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.buf.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.buf.extend_from_slice(&x.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.buf.extend_from_slice(s.as_bytes());
    }
    /// LEB128: 7 bits a byte, low bits first.
    #[inline]
    fn varint(&mut self, mut x: u64) {
        while x >= 0x80 {
            self.buf.push(x as u8 | 0x80);
            x >>= 7;
        }
        self.buf.push(x as u8);
    }
    /// Hands on what is buffered once it is a chunk.
    #[inline]
    fn spill(&mut self) -> std::io::Result<()> {
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.crc.update(&self.buf);
        self.w.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
    /// Writes the rest and the CRC of every byte before it.
    fn finish(mut self) -> std::io::Result<()> {
        self.flush()?;
        let crc = self.crc.clone().finalize();
        self.w.write_all(&crc.to_le_bytes())
    }
}

#[inline]
fn zigzag(x: i64) -> u64 {
    ((x << 1) ^ (x >> 63)) as u64
}

#[inline]
fn unzigzag(x: u64) -> i64 {
    (x >> 1) as i64 ^ -((x & 1) as i64)
}

struct In<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> In<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| SnapshotError::Corrupt(format!("truncated at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// A LEB128 varint (at most 10 bytes, no bits beyond 64).
    #[inline]
    fn varint(&mut self) -> Result<u64, SnapshotError> {
        match self.buf.get(self.pos) {
            Some(&b) if b < 0x80 => {
                self.pos += 1;
                Ok(b as u64)
            }
            _ => self.varint_long(),
        }
    }
    fn varint_long(&mut self) -> Result<u64, SnapshotError> {
        let at = self.pos;
        let mut x = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            if shift == 63 && b > 1 {
                break;
            }
            x |= ((b & 0x7f) as u64) << shift;
            if b < 0x80 {
                return Ok(x);
            }
        }
        Err(corrupt(format!("a number at byte {at} is too long")))
    }
    fn varint_u32(&mut self) -> Result<u32, SnapshotError> {
        let at = self.pos;
        u32::try_from(self.varint()?)
            .map_err(|_| corrupt(format!("a number at byte {at} is out of range")))
    }
    fn str(&mut self) -> Result<String, SnapshotError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| SnapshotError::Corrupt("a string is not UTF-8".into()))
    }
    /// A count that cannot exceed what the remaining bytes could hold.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, SnapshotError> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_item_bytes as u64) > left {
            return Err(SnapshotError::Corrupt(format!(
                "count {n} exceeds the data"
            )));
        }
        Ok(n as usize)
    }
}

fn corrupt(msg: impl Into<String>) -> SnapshotError {
    SnapshotError::Corrupt(msg.into())
}

/// Table capacity (slots) for at most `n` entries: the writer's (from its stored
/// log2), so that inserting in its slot order walks the table front to back, unless
/// that is implausible for `n` (a damaged or hostile file must not make us allocate
/// gigabytes; a table left large by mass removals is not worth copying); then the
/// smallest that holds `n`. Either way the table never grows during the load: a
/// growing table fed keys in hash order builds long probe clusters.
fn table_slots(log2: u8, n: usize) -> usize {
    let minimal = (n.saturating_mul(4) / 3 + 1).next_power_of_two().max(16);
    match 1usize.checked_shl(log2.into()) {
        Some(slots)
            if log2 < 32 && slots >= minimal && slots <= n.saturating_mul(8).max(1 << 16) =>
        {
            slots
        }
        _ => minimal,
    }
}

fn log2_of(slots: usize) -> u8 {
    slots.max(1).trailing_zeros() as u8
}

impl Tree {
    /// Sizes an empty tree's slab and tables for a snapshot's nodes.
    fn presize(&mut self, nodes: usize, key_slots: usize, ehash_slots: usize) {
        debug_assert!(self.len() == 0);
        self.hot.reserve_exact(nodes);
        self.nodes.reserve_exact(nodes);
        hugepages::advise(&self.hot);
        hugepages::advise(&self.nodes);
        self.table.slots = hugepages::filled(key_slots, NIL);
        self.by_ehash.slots = hugepages::filled(ehash_slots, NIL);
    }
}

/// Rejects parent links that form a cycle (a forest is what the index builds): a
/// breadth-first walk down from the roots must reach every node. The children lists
/// are built as one flat array (counting sort by parent), so every pass is a sweep
/// or independent random accesses, never a chain of dependent cache misses.
fn check_acyclic(parents: &[u32]) -> Result<(), SnapshotError> {
    let n = parents.len();
    let mut start = vec![0u32; n + 1];
    for &p in parents.iter().filter(|&&p| p != NIL) {
        start[p as usize + 1] += 1;
    }
    for i in 0..n {
        start[i + 1] += start[i];
    }
    let mut fill = start.clone();
    let mut kids = vec![0u32; start[n] as usize];
    for (child, &p) in parents.iter().enumerate() {
        if p != NIL {
            kids[fill[p as usize] as usize] = child as u32;
            fill[p as usize] += 1;
        }
    }
    let mut reached: Vec<u32> = (0..n as u32)
        .filter(|&i| parents[i as usize] == NIL)
        .collect();
    let mut head = 0;
    while let Some(&v) = reached.get(head) {
        head += 1;
        reached
            .extend_from_slice(&kids[start[v as usize] as usize..start[v as usize + 1] as usize]);
    }
    if reached.len() != n {
        return Err(corrupt(format!(
            "{} nodes are not below a root (their parent links form a cycle)",
            n - reached.len()
        )));
    }
    Ok(())
}

impl Index {
    /// Writes the image (the current version) to `w`, in chunks as it is built.
    pub fn write_snapshot<W: Write>(&self, w: &mut W) -> std::io::Result<()> {
        let mut o = Out::new(w);
        self.write_head(&mut o, VERSION);
        let hot = &self.tree.hot;
        // The ordinal of a node is its id when no slot is free (a grown index that
        // lost nothing), else its place among the live ids.
        let ordinals: Option<Vec<u32>> = (self.tree.len() != hot.len()).then(|| {
            let mut next = 0;
            hot.iter()
                .map(|h| {
                    if h.holders.is_freed() {
                        NIL
                    } else {
                        next += 1;
                        next - 1
                    }
                })
                .collect()
        });
        let ordinal = |id: u32| ordinals.as_ref().map_or(id, |o| o[id as usize]);
        let mut ord = 0u32;
        let mut previous_depth = 0u32;
        for (id, h) in hot.iter().enumerate() {
            if h.holders.is_freed() {
                continue;
            }
            let id = id as u32;
            let n = self.tree.node(id);
            let mut parent = NIL;
            let implicit_depth = if n.parent_id == NIL {
                n.depth() == 0
            } else {
                parent = ordinal(n.parent_id);
                parent.wrapping_add(1) == ord && previous_depth.checked_add(1) == Some(n.depth())
            };
            previous_depth = n.depth();
            let record = NodeRecord {
                key: h.key,
                parent,
                root_parent: if parent == NIL {
                    self.tree.parent_key(id)
                } else {
                    0
                },
                depth: n.depth(),
                pins: n.pins,
                ehash: n.ehash(),
            };
            put_node_v5(
                &mut o,
                ord,
                &record,
                implicit_depth,
                h.holders.as_slice(&self.tree.spills),
            );
            ord += 1;
            o.spill()?;
        }
        o.finish()
    }

    /// Everything before the nodes, the same in versions 4 and 5: magic, version,
    /// media, sources, table capacities, node count.
    fn write_head<W: Write>(&self, o: &mut Out<'_, W>, version: u32) {
        o.buf.extend_from_slice(MAGIC);
        o.u32(version);
        o.u64(self.media.all().len() as u64);
        for m in self.media.all() {
            o.str(m.as_str());
        }
        o.u64(self.sources.len() as u64);
        for (slot, s) in self.sources.iter() {
            o.u32(slot);
            o.u64(s.key.worker);
            o.u32(s.key.dp_rank);
            o.str(&s.model);
            o.str(&s.tokenizer);
            o.u64(s.engine.len() as u64);
            for (&folded, &key) in &s.engine {
                o.u64(folded);
                o.u64(key);
            }
        }
        o.u8(log2_of(self.tree.table.slots.len()));
        o.u8(log2_of(self.tree.by_ehash.slots.len()));
        o.u64(self.tree.len() as u64);
    }

    /// A version 4 image with the node records in `order` (every live id once): slab
    /// order as the version 4 writer wrote them, or key-table order as older writers
    /// did (tests of their load).
    #[cfg(test)]
    fn v4_image_in_order(&self, order: &[u32]) -> Vec<u8> {
        let mut image = Vec::new();
        let mut o = Out::new(&mut image);
        self.write_head(&mut o, VERSION_V4);
        // Ordinal of each live node in `order`, by node id.
        let mut ordinal = vec![NIL; self.tree.nodes.len()];
        for (ord, &id) in order.iter().enumerate() {
            ordinal[id as usize] = ord as u32;
        }
        for &id in order {
            let n = self.tree.node(id);
            o.u64(self.tree.key(id));
            if n.parent_id == NIL {
                o.u32(NIL);
                o.u64(self.tree.parent_key(id));
            } else {
                o.u32(ordinal[n.parent_id as usize]);
            }
            o.u32(n.depth());
            o.u32(n.pins);
            match n.ehash() {
                Some(e) => {
                    o.u8(1);
                    o.u64(e);
                }
                None => o.u8(0),
            }
            let hs = self.tree.holders(id);
            let hs = hs.as_slice(&self.tree.spills);
            o.u32(hs.len() as u32);
            for &h in hs {
                o.u64(h);
            }
        }
        o.finish().expect("writing to a Vec");
        image
    }

    pub fn read_snapshot<R: Read>(r: &mut R) -> Result<Self, SnapshotError> {
        let mut buf = Vec::new();
        r.read_to_end(&mut buf)?;
        Self::from_snapshot_bytes(&buf)
    }

    /// [`Index::read_snapshot`] of an image already in memory (no copy).
    pub fn from_snapshot_bytes(buf: &[u8]) -> Result<Self, SnapshotError> {
        if buf.len() < MAGIC.len() + 8 || &buf[..MAGIC.len()] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let (body, crc) = buf.split_at(buf.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().unwrap()) {
            return Err(SnapshotError::Checksum);
        }
        let mut i = In {
            buf: body,
            pos: MAGIC.len(),
        };
        let version = i.u32()?;
        if ![VERSION_V3, VERSION_V4, VERSION].contains(&version) {
            return Err(SnapshotError::UnsupportedVersion(version));
        }
        let mut index = Index::new();
        let n_media = index.read_media_and_sources(&mut i)?;
        if version == VERSION_V3 {
            index.read_nodes_v3(&mut i, n_media)?;
        } else {
            index.read_nodes(&mut i, n_media, version)?;
        }
        if i.pos != body.len() {
            return Err(corrupt("trailing bytes after the nodes"));
        }
        Ok(index)
    }

    /// The media and sources sections (the same in every version); returns the
    /// number of media.
    fn read_media_and_sources(&mut self, i: &mut In<'_>) -> Result<usize, SnapshotError> {
        let n_media = i.count(4)?;
        for _ in 0..n_media {
            let name = i.str()?;
            let m = Medium::parse(Some(&name));
            if self.media.find(&m).is_some() || self.media.insert(&m).is_none() {
                return Err(corrupt(format!(
                    "medium {name:?} repeated or too many media"
                )));
            }
        }
        let n_sources = i.count(28)?;
        for _ in 0..n_sources {
            let slot = i.u32()?;
            let key = SourceKey {
                worker: i.u64()?,
                dp_rank: i.u32()?,
            };
            if slot > holders::MAX_SLOT || self.sources.slot(key).is_some() {
                return Err(corrupt(format!("source {key:?} at slot {slot} is invalid")));
            }
            let mut src = Source {
                key,
                model: i.str()?,
                tokenizer: i.str()?,
                ..Default::default()
            };
            let n_engine = i.count(16)?;
            for _ in 0..n_engine {
                let k = i.u64()?;
                src.engine.insert(k, i.u64()?);
            }
            if self.slot_live(slot) {
                return Err(corrupt(format!("slot {slot} used twice")));
            }
            self.sources.restore(slot, src);
        }
        self.sources.finish_restore();
        Ok(n_media)
    }

    fn slot_live(&self, slot: u32) -> bool {
        self.sources
            .slots
            .get(slot as usize)
            .is_some_and(|s| s.is_some())
    }

    /// Reads a version 3 or 4 node's holders (a count, packed u64s) into `out`.
    fn read_packed_holders(i: &mut In<'_>, out: &mut Vec<Holder>) -> Result<(), SnapshotError> {
        let n = i.u32()?;
        out.clear();
        for _ in 0..n {
            out.push(i.u64()?);
        }
        Ok(())
    }

    /// Reads a version 5 node's holders (module docs) into `out`, packed.
    fn read_varint_holders(
        i: &mut In<'_>,
        flags: u8,
        out: &mut Vec<Holder>,
    ) -> Result<(), SnapshotError> {
        let mut n = (flags >> COUNT_SHIFT) as u64;
        if n == COUNT_FOLLOWS as u64 {
            n = i.varint()?;
        }
        out.clear();
        let mut id = 0u32;
        for _ in 0..n {
            let at = i.pos;
            id = u32::try_from(i.varint()?)
                .ok()
                .and_then(|d| id.checked_add(d))
                .ok_or_else(|| corrupt(format!("a holder at byte {at} is out of range")))?;
            let rc_claim = i.varint()?;
            let refcount = rc_claim >> 1;
            if refcount == 0 || refcount > MAX_REFCOUNT as u64 {
                return Err(corrupt(format!(
                    "a holder at byte {at} has refcount {refcount}"
                )));
            }
            let claim = if rc_claim & 1 != 0 { 1 << 31 } else { 0 };
            out.push(pack(id, refcount as u32) | claim);
        }
        Ok(())
    }

    /// Gives node `id` its holders (packed, with their claim bits) and counts them.
    fn add_holders(
        &mut self,
        id: u32,
        holders: &[Holder],
        n_media: usize,
    ) -> Result<(), SnapshotError> {
        let key = self.tree.key(id);
        let has_ehash = self.tree.node(id).ehash().is_some();
        let mut set = self.tree.holders(id);
        let mut previous_slot = None;
        for &h in holders {
            let hid = id_of(h);
            let slot = slot_of(hid);
            if refcount_of(h) == 0
                || !self.slot_live(slot)
                || medium_of(hid) as usize >= n_media
                || (claimed(h) && !has_ehash)
            {
                return Err(corrupt(format!("node {key:#x} has an invalid holder")));
            }
            if !set.add(&mut self.tree.spills, hid, refcount_of(h)) {
                return Err(corrupt(format!("node {key:#x} lists a holder twice")));
            }
            if claimed(h) {
                set.set_claim(&mut self.tree.spills, slot, true);
            }
            let src = self.sources.get_mut(slot);
            src.pairs += 1;
            // Each source's node list (`Source::blocks`), rebuilt: once per source
            // per node, whatever its media.
            if previous_slot != Some(slot) {
                src.blocks.push(id);
                previous_slot = Some(slot);
            }
            self.resident_pairs += 1;
        }
        self.tree.set_holders(id, set);
        Ok(())
    }

    /// Version 4 and 5 nodes: record k in slot k, into tables of the writer's
    /// capacity.
    fn read_nodes(
        &mut self,
        i: &mut In<'_>,
        n_media: usize,
        version: u32,
    ) -> Result<(), SnapshotError> {
        debug_assert!(version == VERSION || version == VERSION_V4);
        let v5 = version == VERSION;
        let key_log2 = i.u8()?;
        let ehash_log2 = i.u8()?;
        let n_nodes = i.count(if v5 { 9 } else { 25 })?;
        if n_nodes >= NIL as usize {
            return Err(corrupt(format!("{n_nodes} nodes is too many")));
        }
        self.tree.presize(
            n_nodes,
            table_slots(key_log2, n_nodes),
            table_slots(ehash_log2, n_nodes),
        );
        let mut parents = Vec::with_capacity(n_nodes);
        let mut ehashes = Vec::new();
        let mut holders = Vec::new();
        let mut previous_depth = 0;
        for ord in 0..n_nodes as u32 {
            let node = if v5 {
                Self::read_node_v5(i, ord, previous_depth, &mut holders)?
            } else {
                read_node_v4(i, &mut holders)?
            };
            previous_depth = node.depth;
            let NodeRecord {
                key,
                parent,
                root_parent,
                depth,
                pins,
                ehash,
            } = node;
            if parent != NIL && (parent as usize >= n_nodes || parent == ord) {
                return Err(corrupt(format!(
                    "node {key:#x}: parent #{parent} is invalid"
                )));
            }
            // Record k goes to slot k; its key is indexed after the loop.
            let id = self.tree.push_loaded(key, root_parent, depth);
            debug_assert_eq!(id, ord);
            parents.push(parent);
            self.tree.node_mut(id).pins = pins;
            if pins > 0 {
                self.pinned += 1;
            }
            if let Some(e) = ehash {
                // Set with the claim flag now (holders check it), indexed below.
                let n = self.tree.node_mut(id);
                n.ehash = e;
                n.depth_flags |= HAS_EHASH;
                ehashes.push(id);
            }
            self.add_holders(id, &holders, n_media)?;
            if self.visible(id) {
                self.blocks += 1;
            }
        }
        if let Err(key) = self.tree.index_loaded_keys() {
            return Err(corrupt(format!("node {key:#x} appears twice")));
        }
        // The cycle check needs only `parents`: on a large image it runs on a second
        // thread while this one indexes the engine hashes and links the children.
        let (acyclic, linked) = std::thread::scope(|s| {
            let check =
                (n_nodes >= PARALLEL_CHECK_MIN_NODES).then(|| s.spawn(|| check_acyclic(&parents)));
            let linked = self.index_ehashes_and_link(&ehashes, &parents);
            let acyclic = match check {
                Some(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                None => check_acyclic(&parents),
            };
            (acyclic, linked)
        });
        acyclic?;
        linked?;
        // What `collect` would have freed cannot be in a snapshot of a live index.
        for id in 0..n_nodes as u32 {
            let n = self.tree.node(id);
            if self.tree.holders(id).is_empty() && n.pins == 0 && n.first_child == NIL {
                return Err(corrupt(format!(
                    "node {:#x} has no holder, pin or child",
                    self.tree.key(id)
                )));
            }
        }
        Ok(())
    }

    /// The engine-hash table and the child links of freshly read nodes (linking
    /// only sets pointers, so it is harmless on an image that turns out cyclic).
    fn index_ehashes_and_link(
        &mut self,
        ehashes: &[u32],
        parents: &[u32],
    ) -> Result<(), SnapshotError> {
        // Both passes below touch one random line per node (an ehash-table slot, a
        // parent node): prefetching a window ahead overlaps those cache misses.
        const AHEAD: usize = 16;
        for (at, &id) in ehashes.iter().enumerate() {
            if let Some(&next) = ehashes.get(at + AHEAD) {
                self.tree
                    .prefetch_ehash(std::iter::once(self.tree.node(next).ehash));
            }
            let e = self.tree.node(id).ehash;
            if self.tree.find_ehash(e).is_some() {
                return Err(corrupt(format!("primary hash {e:#x} appears twice")));
            }
            self.tree.by_ehash.insert(id, self.tree.nodes.as_slice());
        }
        for (id, &parent) in parents.iter().enumerate() {
            if let Some(&next) = parents.get(id + AHEAD).filter(|&&p| p != NIL) {
                prefetch(self.tree.node(next));
            }
            if parent != NIL {
                self.tree.link(id as u32, parent);
            }
        }
        Ok(())
    }

    /// Version 3 nodes: any order, parents by key, a linked flag.
    fn read_nodes_v3(&mut self, i: &mut In<'_>, n_media: usize) -> Result<(), SnapshotError> {
        let n_nodes = i.count(30)?;
        let mut linked = Vec::with_capacity(n_nodes);
        let mut holders = Vec::new();
        for _ in 0..n_nodes {
            let key = i.u64()?;
            let parent = i.u64()?;
            let is_linked = i.u8()? != 0;
            let depth = i.u32()?;
            let pins = i.u32()?;
            let ehash = match i.u8()? {
                0 => None,
                _ => Some(i.u64()?),
            };
            if self.tree.find(key).is_some() {
                return Err(corrupt(format!("node {key:#x} appears twice")));
            }
            let id = self.tree.get_or_insert(key, parent, NIL, depth);
            self.tree.node_mut(id).pins = pins;
            if let Some(e) = ehash {
                if !self.tree.try_set_ehash(id, e) {
                    return Err(corrupt(format!("primary hash {e:#x} appears twice")));
                }
            }
            if pins > 0 {
                self.pinned += 1;
            }
            Self::read_packed_holders(i, &mut holders)?;
            self.add_holders(id, &holders, n_media)?;
            if self.visible(id) {
                self.blocks += 1;
            }
            if is_linked {
                linked.push((id, parent));
            }
        }
        for (id, parent) in linked {
            let pid = self
                .tree
                .find(parent)
                .filter(|&pid| pid != id)
                .ok_or_else(|| corrupt(format!("parent {parent:#x} is missing")))?;
            self.tree.link(id, pid);
        }
        self.check_invariants().map_err(SnapshotError::Corrupt)
    }
}

/// Writes a version 5 node record (module docs). `implicit_depth`: the depth is
/// the parent's + 1 (the parent the previous record), or 0 for a root.
fn put_node_v5<W: Write>(
    o: &mut Out<'_, W>,
    ord: u32,
    node: &NodeRecord,
    implicit_depth: bool,
    holders: &[Holder],
) {
    let mut flags = 0;
    if node.parent == NIL {
        flags |= ROOT;
    } else if node.parent.wrapping_add(1) != ord {
        flags |= FAR_PARENT;
    }
    if !implicit_depth {
        flags |= DEPTH;
    }
    if node.pins > 0 {
        flags |= PINS;
    }
    if node.ehash.is_some() {
        flags |= EHASH;
    }
    flags |= (holders.len().min(COUNT_FOLLOWS as usize) as u8) << COUNT_SHIFT;
    o.u8(flags);
    o.u64(node.key);
    if flags & ROOT != 0 {
        o.u64(node.root_parent);
    }
    if flags & FAR_PARENT != 0 {
        o.varint(zigzag(ord as i64 - 1 - node.parent as i64));
    }
    if flags & DEPTH != 0 {
        o.varint(node.depth as u64);
    }
    if flags & PINS != 0 {
        o.varint(node.pins as u64);
    }
    if let Some(e) = node.ehash {
        o.u64(e);
    }
    if holders.len() >= COUNT_FOLLOWS as usize {
        o.varint(holders.len() as u64);
    }
    let mut previous = 0;
    for &h in holders {
        let id = id_of(h);
        o.varint((id - previous) as u64);
        o.varint((refcount_of(h) as u64) << 1 | claimed(h) as u64);
        previous = id;
    }
}

/// A node record as read, before it is placed (versions 4 and 5).
struct NodeRecord {
    key: u64,
    /// Parent ordinal, NIL for a root.
    parent: u32,
    /// A root's parent key.
    root_parent: u64,
    depth: u32,
    pins: u32,
    ehash: Option<u64>,
}

fn read_node_v4(i: &mut In<'_>, holders: &mut Vec<Holder>) -> Result<NodeRecord, SnapshotError> {
    let key = i.u64()?;
    let parent = i.u32()?;
    let root_parent = if parent == NIL { i.u64()? } else { 0 };
    let depth = i.u32()?;
    let pins = i.u32()?;
    let ehash = match i.u8()? {
        0 => None,
        1 => Some(i.u64()?),
        f => return Err(corrupt(format!("node {key:#x}: unknown flags {f}"))),
    };
    Index::read_packed_holders(i, holders)?;
    Ok(NodeRecord {
        key,
        parent,
        root_parent,
        depth,
        pins,
        ehash,
    })
}

impl Index {
    /// A version 5 node record (module docs); `ord` is its place in the image,
    /// `previous_depth` the depth of the record before it.
    fn read_node_v5(
        i: &mut In<'_>,
        ord: u32,
        previous_depth: u32,
        holders: &mut Vec<Holder>,
    ) -> Result<NodeRecord, SnapshotError> {
        let flags = i.u8()?;
        let key = i.u64()?;
        let (parent, root_parent) = if flags & ROOT != 0 {
            if flags & FAR_PARENT != 0 {
                return Err(corrupt(format!("node {key:#x}: a root with a parent")));
            }
            (NIL, i.u64()?)
        } else if flags & FAR_PARENT != 0 {
            let parent = (ord as i64 - 1).checked_sub(unzigzag(i.varint()?));
            let parent = parent
                .and_then(|p| u32::try_from(p).ok())
                .filter(|&p| p != NIL)
                .ok_or_else(|| corrupt(format!("node {key:#x}: its parent is invalid")))?;
            (parent, 0)
        } else {
            let parent = ord
                .checked_sub(1)
                .ok_or_else(|| corrupt(format!("node {key:#x}: parent #-1 is invalid")))?;
            (parent, 0)
        };
        let depth = if flags & DEPTH != 0 {
            i.varint_u32()?
        } else if parent == NIL {
            0
        } else if flags & FAR_PARENT == 0 {
            previous_depth.saturating_add(1)
        } else {
            return Err(corrupt(format!(
                "node {key:#x}: no depth, and its parent is not the previous record"
            )));
        };
        let pins = if flags & PINS != 0 {
            i.varint_u32()?
        } else {
            0
        };
        let ehash = if flags & EHASH != 0 {
            Some(i.u64()?)
        } else {
            None
        };
        Self::read_varint_holders(i, flags, holders)?;
        Ok(NodeRecord {
            key,
            parent,
            root_parent,
            depth,
            pins,
            ehash,
        })
    }
}

impl PartialEq for Index {
    fn eq(&self, other: &Self) -> bool {
        self.state_eq(other)
    }
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
