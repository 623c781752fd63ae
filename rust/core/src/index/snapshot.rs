//! A compact binary image of the complete index state, for the persistence layer.
//!
//! Layout (little-endian): magic `QCIDXSNP`, u32 version, the media names, the
//! sources (slot, worker, dp rank, model, tokenizer, engine-hash map keyed by
//! `engine_map_key(group, hash)`), the nodes
//! (key, parent, linked flag, depth, pins, primary engine hash if any, packed holders
//! with their claim bits), then a CRC-32 of every
//! byte before it. Any corruption is an error, never a silently different index.

use std::io::{Read, Write};

use crate::events::Medium;

use super::holders::{self, claimed, id_of, medium_of, refcount_of, slot_of};
use super::sources::{Source, SourceKey};
use super::tree::NIL;
use super::Index;

const MAGIC: &[u8; 8] = b"QCIDXSNP";
const VERSION: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not an index snapshot (bad magic)")]
    BadMagic,
    #[error("index snapshot version {0} is not supported (this build reads version {VERSION})")]
    UnsupportedVersion(u32),
    #[error("index snapshot checksum mismatch: the file is corrupt or truncated")]
    Checksum,
    #[error("index snapshot is corrupt: {0}")]
    Corrupt(String),
}

struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
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

impl Index {
    pub fn write_snapshot<W: Write>(&self, w: &mut W) -> std::io::Result<()> {
        let mut o = Out(Vec::with_capacity(64 + self.tree.len() * 48));
        o.0.extend_from_slice(MAGIC);
        o.u32(VERSION);
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
        o.u64(self.tree.len() as u64);
        for id in self.tree.ids() {
            let n = self.tree.node(id);
            o.u64(n.key);
            o.u64(self.tree.parent_key(id));
            o.u8((n.parent_id != NIL) as u8);
            o.u32(n.depth());
            o.u32(n.pins);
            match n.ehash() {
                Some(e) => {
                    o.u8(1);
                    o.u64(e);
                }
                None => o.u8(0),
            }
            let hs = n.holders.as_slice(&self.tree.spills);
            o.u32(hs.len() as u32);
            for &h in hs {
                o.u64(h);
            }
        }
        let crc = crc32fast::hash(&o.0);
        o.u32(crc);
        w.write_all(&o.0)
    }

    pub fn read_snapshot<R: Read>(r: &mut R) -> Result<Self, SnapshotError> {
        let mut buf = Vec::new();
        r.read_to_end(&mut buf)?;
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
        if version != VERSION {
            return Err(SnapshotError::UnsupportedVersion(version));
        }
        let mut index = Index::new();
        let n_media = i.count(4)?;
        for _ in 0..n_media {
            let name = i.str()?;
            let m = Medium::parse(Some(&name));
            if index.media.find(&m).is_some() || index.media.intern(&m).is_none() {
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
            if slot > holders::MAX_SLOT || index.sources.slot(key).is_some() {
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
            if index
                .sources
                .slots
                .get(slot as usize)
                .is_some_and(|s| s.is_some())
            {
                return Err(corrupt(format!("slot {slot} used twice")));
            }
            index.sources.restore(slot, src);
        }
        index.sources.finish_restore();
        let n_nodes = i.count(30)?;
        let mut linked = Vec::with_capacity(n_nodes);
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
            if index.tree.find(key).is_some() {
                return Err(corrupt(format!("node {key:#x} appears twice")));
            }
            let id = index.tree.get_or_insert(key, parent, NIL, depth);
            index.tree.node_mut(id).pins = pins;
            if let Some(e) = ehash {
                if !index.tree.try_set_ehash(id, e) {
                    return Err(corrupt(format!("primary hash {e:#x} appears twice")));
                }
            }
            if pins > 0 {
                index.pinned += 1;
            }
            let n_holders = i.u32()?;
            let mut set = index.tree.node(id).holders;
            for _ in 0..n_holders {
                let h = i.u64()?;
                let hid = id_of(h);
                let slot = slot_of(hid);
                let live = index
                    .sources
                    .slots
                    .get(slot as usize)
                    .is_some_and(|s| s.is_some());
                if refcount_of(h) == 0 || !live || medium_of(hid) as usize >= n_media {
                    return Err(corrupt(format!("node {key:#x} has an invalid holder")));
                }
                if !set.add(&mut index.tree.spills, hid, refcount_of(h)) {
                    return Err(corrupt(format!("node {key:#x} lists a holder twice")));
                }
                if claimed(h) {
                    set.set_claim(&mut index.tree.spills, slot, true);
                }
                index.sources.get_mut(slot).pairs += 1;
                index.resident_pairs += 1;
            }
            index.tree.node_mut(id).holders = set;
            if index.visible(id) {
                index.blocks += 1;
            }
            if is_linked {
                linked.push((id, parent));
            }
        }
        if i.pos != body.len() {
            return Err(corrupt("trailing bytes after the nodes"));
        }
        for (id, parent) in linked {
            let pid = index
                .tree
                .find(parent)
                .filter(|&pid| pid != id)
                .ok_or_else(|| corrupt(format!("parent {parent:#x} is missing")))?;
            index.tree.link(id, pid);
        }
        index.check_invariants().map_err(SnapshotError::Corrupt)?;
        Ok(index)
    }
}

impl PartialEq for Index {
    fn eq(&self, other: &Self) -> bool {
        self.state_eq(other)
    }
}
