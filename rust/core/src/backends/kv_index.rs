//! The residency index over an ordered key-value store.
//!
//! Same rules as `crate::index::Index` (`docs/index.md`): blocks keyed by QuillCache
//! content keys chained from `BlockStored.token_ids`, engine hashes kept per source
//! only as ids for removal, refcounts per (source, medium), pins, holder-less nodes
//! collected with their empty ancestors. Each call reads what it needs (cached for
//! the call), then commits one atomic write batch; a failed write changes nothing.

use std::collections::{BTreeMap, HashMap};

use crate::content_key::chain_block;
use crate::events::{
    decode_batch, BlockRemoved, BlockStored, Event, EventBatch, Medium, MAX_CUSTOM_MEDIA,
    OTHER_MEDIUM,
};
use crate::index::sources::engine_map_key;
use crate::index::{
    ApplyStats, EntryOut, HolderOut, IndexRead, IndexStats, LogicalState, NamedHit, SourceKey,
};
use crate::namespace::Namespace;

use super::layout::{self, Meta, Node, Source};
use super::{KvError, KvStore};

/// An error of a KvIndex call: the batch could not be decoded, or the store failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvIndexError {
    #[error("{0}")]
    Decode(String),
    #[error(transparent)]
    Store(#[from] KvError),
    #[error("corrupt {what} record in the store")]
    Corrupt { what: &'static str },
}

type Result<T> = std::result::Result<T, KvIndexError>;

/// Pending state of one call: read cache + dirty records.
#[derive(Default)]
struct Txn {
    nodes: HashMap<u64, (Option<Node>, bool)>,
    sources: HashMap<SourceKey, (Option<Source>, bool)>,
    engine: HashMap<(SourceKey, u32, u64), (Option<u64>, bool)>,
    children: Vec<(u64, u64, bool)>,
}

pub struct KvIndex<S: KvStore> {
    store: S,
    meta: Meta,
    txn: Txn,
    /// `meta` before the call, restored if the commit fails.
    saved: Meta,
    /// Unknown medium names kept so far: bounded as in the in-memory index
    /// (`Media`). In memory only: after a reopen, names are admitted anew as they come.
    custom_media: Vec<String>,
    /// Stored events whose medium went to `OTHER` (a counter since open).
    media_folded: u64,
}

/// A match: (worker, dp rank, medium, blocks), sorted by (worker, dp rank, medium).
pub type KvMatch = (u64, u32, String, u32);

impl<S: KvStore> KvIndex<S> {
    /// Opens the index kept in `store` (empty or written by a previous KvIndex).
    pub fn open(store: S) -> Result<Self> {
        let meta = match store.get(layout::META)? {
            Some(b) => layout::decode_meta(&b).ok_or(KvIndexError::Corrupt { what: "meta" })?,
            None => Meta::default(),
        };
        Ok(KvIndex {
            store,
            meta,
            txn: Txn::default(),
            saved: meta,
            custom_media: Vec::new(),
            media_folded: 0,
        })
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Stored events whose medium name was beyond the limits (see `Media`).
    pub fn media_folded(&self) -> u64 {
        self.media_folded
    }

    /// The name holders of `m` are kept under: its own, or [`OTHER_MEDIUM`] beyond the
    /// limits (the same mapping as the in-memory index). A store admits a new name; a
    /// removal only looks (a name it has never seen holds nothing).
    fn medium_name<'a>(&mut self, m: &'a Medium, storing: bool) -> &'a str {
        let name = m.as_str();
        if m.is_known() || self.custom_media.iter().any(|c| c == name) {
            return name;
        }
        if m.fits() && self.custom_media.len() < MAX_CUSTOM_MEDIA {
            if storing {
                self.custom_media.push(name.to_owned());
            }
            return name;
        }
        if storing {
            self.media_folded += 1;
        }
        OTHER_MEDIUM
    }

    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    // --- transaction plumbing --------------------------------------------------

    fn node(&mut self, key: u64) -> Result<Option<Node>> {
        if let Some((n, _)) = self.txn.nodes.get(&key) {
            return Ok(n.clone());
        }
        let n = match self.store.get(&layout::node_key(key))? {
            Some(b) => Some(layout::decode_node(&b).ok_or(KvIndexError::Corrupt { what: "node" })?),
            None => None,
        };
        self.txn.nodes.insert(key, (n.clone(), false));
        Ok(n)
    }

    fn set_node(&mut self, key: u64, n: Option<Node>) {
        self.txn.nodes.insert(key, (n, true));
    }

    fn source(&mut self, s: SourceKey) -> Result<Option<Source>> {
        if let Some((v, _)) = self.txn.sources.get(&s) {
            return Ok(v.clone());
        }
        let v = match self.store.get(&layout::source_key(s.worker, s.dp_rank))? {
            Some(b) => {
                Some(layout::decode_source(&b).ok_or(KvIndexError::Corrupt { what: "source" })?)
            }
            None => None,
        };
        self.txn.sources.insert(s, (v.clone(), false));
        Ok(v)
    }

    fn set_source(&mut self, s: SourceKey, v: Option<Source>) {
        self.txn.sources.insert(s, (v, true));
    }

    fn engine(&mut self, s: SourceKey, group: u32, hash: u64) -> Result<Option<u64>> {
        if let Some((v, _)) = self.txn.engine.get(&(s, group, hash)) {
            return Ok(*v);
        }
        let v = self
            .store
            .get(&layout::engine_key(s.worker, s.dp_rank, group, hash))?
            .and_then(|b| layout::u64_of(&b));
        self.txn.engine.insert((s, group, hash), (v, false));
        Ok(v)
    }

    fn set_engine(&mut self, s: SourceKey, group: u32, hash: u64, v: Option<u64>) {
        self.txn.engine.insert((s, group, hash), (v, true));
    }

    fn begin(&mut self) {
        self.txn = Txn::default();
        self.saved = self.meta;
    }

    fn commit(&mut self) -> Result<()> {
        let txn = std::mem::take(&mut self.txn);
        let mut ops = Vec::new();
        for (k, (n, dirty)) in txn.nodes {
            if dirty {
                ops.push((layout::node_key(k), n.as_ref().map(layout::encode_node)));
            }
        }
        for (s, (v, dirty)) in txn.sources {
            if dirty {
                ops.push((
                    layout::source_key(s.worker, s.dp_rank),
                    v.as_ref().map(layout::encode_source),
                ));
            }
        }
        for ((s, g, h), (v, dirty)) in txn.engine {
            if dirty {
                ops.push((
                    layout::engine_key(s.worker, s.dp_rank, g, h),
                    v.map(|k| k.to_le_bytes().to_vec()),
                ));
            }
        }
        for (p, c, add) in txn.children {
            ops.push((layout::child_key(p, c), add.then(Vec::new)));
        }
        if self.meta != self.saved {
            ops.push((layout::META.to_vec(), Some(layout::encode_meta(&self.meta))));
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.store.write(ops).map_err(|e| {
            self.meta = self.saved;
            KvIndexError::from(e)
        })
    }

    fn abort(&mut self) {
        self.txn = Txn::default();
        self.meta = self.saved;
    }

    /// Runs `f` as one transaction: committed on success, dropped on error.
    fn transact<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.begin();
        match f(self) {
            Ok(v) => {
                self.commit()?;
                Ok(v)
            }
            Err(e) => {
                self.abort();
                Err(e)
            }
        }
    }

    // --- tree rules (as in crate::index) ----------------------------------------

    fn ensure_source(&mut self, s: SourceKey) -> Result<Source> {
        match self.source(s)? {
            Some(v) => Ok(v),
            None => {
                let v = Source::default();
                self.set_source(s, Some(v.clone()));
                Ok(v)
            }
        }
    }

    fn get_or_insert(&mut self, key: u64, parent: u64, linked: bool, depth: u32) -> Result<Node> {
        if let Some(n) = self.node(key)? {
            return Ok(n);
        }
        let n = Node {
            parent,
            depth,
            linked,
            ..Default::default()
        };
        if linked {
            let mut p = self
                .node(parent)?
                .ok_or(KvIndexError::Corrupt { what: "parent" })?;
            p.children += 1;
            self.set_node(parent, Some(p));
            self.txn.children.push((parent, key, true));
        }
        self.set_node(key, Some(n.clone()));
        self.meta.nodes += 1;
        Ok(n)
    }

    /// Frees `key` and then its ancestors while they have no holder, pin or child.
    fn collect(&mut self, mut key: u64) -> Result<()> {
        while let Some(n) = self.node(key)? {
            if n.visible() || n.children > 0 {
                break;
            }
            self.set_node(key, None);
            self.meta.nodes -= 1;
            if !n.linked {
                break;
            }
            self.txn.children.push((n.parent, key, false));
            let mut p = self
                .node(n.parent)?
                .ok_or(KvIndexError::Corrupt { what: "parent" })?;
            p.children -= 1;
            self.set_node(n.parent, Some(p));
            key = n.parent;
        }
        Ok(())
    }

    fn add_holder(&mut self, key: u64, mut n: Node, s: SourceKey, medium: &str) -> Result<Node> {
        let was_visible = n.visible();
        let pos = n.holders.binary_search_by(|(w, d, m, _)| {
            (*w, *d, m.as_str()).cmp(&(s.worker, s.dp_rank, medium))
        });
        match pos {
            Ok(i) => n.holders[i].3 = n.holders[i].3.saturating_add(1),
            Err(i) => {
                n.holders
                    .insert(i, (s.worker, s.dp_rank, medium.to_string(), 1));
                self.meta.pairs += 1;
                let mut src = self.ensure_source(s)?;
                src.pairs += 1;
                self.set_source(s, Some(src));
            }
        }
        if !was_visible {
            self.meta.blocks += 1;
        }
        self.set_node(key, Some(n.clone()));
        Ok(n)
    }

    fn apply_batch_inner(&mut self, s: SourceKey, batch: &EventBatch) -> Result<ApplyStats> {
        let mut stats = ApplyStats {
            batches: 1,
            events: batch.events.len() as u64,
            ..Default::default()
        };
        self.ensure_source(s)?;
        for event in &batch.events {
            match event {
                Event::BlockStored(ev) => self.store_blocks(s, ev, &mut stats)?,
                Event::BlockRemoved(ev) => self.remove_blocks(s, ev, &mut stats)?,
                Event::AllBlocksCleared => {
                    stats.clears += 1;
                    self.clear_inner(s)?;
                }
            }
        }
        Ok(stats)
    }

    fn store_blocks(
        &mut self,
        s: SourceKey,
        ev: &BlockStored,
        stats: &mut ApplyStats,
    ) -> Result<()> {
        let n = ev.block_hashes.len();
        if n == 0 {
            return Ok(());
        }
        let medium = self.medium_name(&ev.medium, true);
        let group = ev.group_idx;
        if ev.token_ids.is_empty() {
            for &h in &ev.block_hashes {
                let known = self.engine(s, group, h)?;
                match known {
                    Some(key) => match self.node(key)? {
                        Some(node) => {
                            self.add_holder(key, node, s, medium)?;
                            stats.blocks_stored += 1;
                        }
                        None => stats.orphan_blocks += 1,
                    },
                    None => stats.orphan_blocks += 1,
                }
            }
            return Ok(());
        }
        let bs = ev.block_size as usize;
        if bs == 0 || (ev.token_ids.len() as u64) < (n as u64).saturating_mul(bs as u64) {
            stats.invalid_events += 1;
            return Ok(());
        }
        let (mut parent_key, mut linked, mut depth) = match ev.parent_block_hash {
            None => (self.namespace_of(s, ev)?.id(), false, 0u32),
            Some(ph) => {
                let parent = match self.engine(s, group, ph)? {
                    Some(k) => self.node(k)?.map(|p| (k, p)),
                    None => None,
                };
                match parent {
                    Some((k, p)) => (k, true, p.depth.saturating_add(1)),
                    None => {
                        stats.orphan_blocks += n as u64;
                        return Ok(());
                    }
                }
            }
        };
        let identity = ev.as_ref().identity();
        for (i, (&h, tokens)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(bs))
            .enumerate()
        {
            let mm = identity.mm_items(i);
            let key = chain_block(parent_key, tokens, mm.as_deref());
            let node = self.get_or_insert(key, parent_key, linked, depth)?;
            self.add_holder(key, node, s, medium)?;
            self.set_engine(s, group, h, Some(key));
            stats.blocks_stored += 1;
            parent_key = key;
            linked = true;
            depth = depth.saturating_add(1);
        }
        Ok(())
    }

    fn namespace_of(&mut self, s: SourceKey, ev: &BlockStored) -> Result<Namespace> {
        let src = self.source(s)?.unwrap_or_default();
        Ok(ev
            .as_ref()
            .identity()
            .namespace(src.model, src.tokenizer, ev.block_size))
    }

    fn remove_blocks(
        &mut self,
        s: SourceKey,
        ev: &BlockRemoved,
        stats: &mut ApplyStats,
    ) -> Result<()> {
        let medium = self.medium_name(&ev.medium, false);
        for &h in &ev.block_hashes {
            let Some(key) = self.engine(s, ev.group_idx, h)? else {
                stats.unknown_removals += 1;
                continue;
            };
            let Some(mut n) = self.node(key)? else {
                stats.unknown_removals += 1;
                self.set_engine(s, ev.group_idx, h, None);
                continue;
            };
            let was_visible = n.visible();
            let pos = n
                .holders
                .iter()
                .position(|(w, d, m, _)| *w == s.worker && *d == s.dp_rank && m == medium);
            match pos {
                None => stats.unknown_removals += 1,
                Some(i) if n.holders[i].3 > 1 => {
                    n.holders[i].3 -= 1;
                    stats.blocks_removed += 1;
                }
                Some(i) => {
                    n.holders.remove(i);
                    stats.blocks_removed += 1;
                    self.meta.pairs -= 1;
                    let mut src = self.ensure_source(s)?;
                    src.pairs -= 1;
                    self.set_source(s, Some(src));
                }
            }
            if !n
                .holders
                .iter()
                .any(|(w, d, _, _)| *w == s.worker && *d == s.dp_rank)
            {
                self.set_engine(s, ev.group_idx, h, None);
            }
            if was_visible && !n.visible() {
                self.meta.blocks -= 1;
            }
            self.set_node(key, Some(n));
            self.collect(key)?;
        }
        Ok(())
    }

    /// Drops every residency of `s` and its engine map; returns the pairs dropped.
    fn clear_inner(&mut self, s: SourceKey) -> Result<u64> {
        let Some(mut src) = self.source(s)? else {
            return Ok(0);
        };
        let before = src.pairs;
        let mut candidates: Vec<u64> = Vec::new();
        for (group, hash, key) in self.engine_entries(s)? {
            candidates.extend(key);
            self.set_engine(s, group, hash, None);
        }
        candidates.sort_unstable();
        candidates.dedup();
        let mut remaining = before;
        let mut emptied = Vec::new();
        for key in candidates {
            remaining -= self.drop_source_from(key, s, &mut emptied)?;
        }
        if remaining > 0 {
            // Residency whose hash was re-stored under another key: a full pass.
            for key in self.all_node_keys()? {
                remaining -= self.drop_source_from(key, s, &mut emptied)?;
                if remaining == 0 {
                    break;
                }
            }
        }
        for key in emptied {
            self.collect(key)?;
        }
        src.pairs = 0;
        self.set_source(s, Some(src));
        Ok(before)
    }

    /// `Index::clear_medium` on the store: one pass over the nodes (an admin action:
    /// the store keeps no per-source list), then the source's engine entries of the
    /// blocks it no longer holds.
    fn clear_medium_inner(&mut self, s: SourceKey, medium: &Medium) -> Result<u64> {
        let Some(mut src) = self.source(s)? else {
            return Ok(0);
        };
        let medium = self.medium_name(medium, false).to_owned();
        let mut dropped = 0;
        let mut let_go: Vec<u64> = Vec::new();
        for key in self.all_node_keys()? {
            let Some(mut n) = self.node(key)? else {
                continue;
            };
            let Some(i) = n
                .holders
                .iter()
                .position(|(w, d, m, _)| *w == s.worker && *d == s.dp_rank && *m == medium)
            else {
                continue;
            };
            let was_visible = n.visible();
            n.holders.remove(i);
            dropped += 1;
            if !n
                .holders
                .iter()
                .any(|(w, d, _, _)| *w == s.worker && *d == s.dp_rank)
            {
                let_go.push(key);
            }
            if was_visible && !n.visible() {
                self.meta.blocks -= 1;
            }
            self.set_node(key, Some(n));
            self.collect(key)?;
        }
        if !let_go.is_empty() {
            let_go.sort_unstable();
            for (group, hash, key) in self.engine_entries(s)? {
                if key.is_some_and(|k| let_go.binary_search(&k).is_ok()) {
                    self.set_engine(s, group, hash, None);
                }
            }
        }
        self.meta.pairs -= dropped;
        src.pairs -= dropped;
        self.set_source(s, Some(src));
        Ok(dropped)
    }

    /// The engine map of `s` as `(group, hash, key)`: this call's pending entries (None:
    /// deleted in it), then the stored ones it has not touched.
    fn engine_entries(&self, s: SourceKey) -> Result<Vec<(u32, u64, Option<u64>)>> {
        let mut out: Vec<(u32, u64, Option<u64>)> = self
            .txn
            .engine
            .iter()
            .filter(|((es, _, _), _)| *es == s)
            .map(|((_, group, hash), (v, _))| (*group, *hash, *v))
            .collect();
        for (k, v) in self
            .store
            .scan_prefix(&layout::engine_prefix(s.worker, s.dp_rank))?
        {
            let (group, hash) = (
                u32::from_be_bytes(k[13..17].try_into().expect("4 bytes")),
                layout::tail_u64(&k),
            );
            if !self.txn.engine.contains_key(&(s, group, hash)) {
                out.push((group, hash, layout::u64_of(&v)));
            }
        }
        Ok(out)
    }

    fn drop_source_from(&mut self, key: u64, s: SourceKey, emptied: &mut Vec<u64>) -> Result<u64> {
        let Some(mut n) = self.node(key)? else {
            return Ok(0);
        };
        let was_visible = n.visible();
        let before = n.holders.len();
        n.holders
            .retain(|(w, d, _, _)| !(*w == s.worker && *d == s.dp_rank));
        let gone = (before - n.holders.len()) as u64;
        if gone == 0 {
            return Ok(0);
        }
        self.meta.pairs -= gone;
        if was_visible && !n.visible() {
            self.meta.blocks -= 1;
            emptied.push(key);
        }
        self.set_node(key, Some(n));
        Ok(gone)
    }

    /// Node keys in the store merged with this call's pending changes.
    fn all_node_keys(&mut self) -> Result<Vec<u64>> {
        let mut keys: Vec<u64> = self
            .store
            .scan_prefix(&[layout::NODE])?
            .into_iter()
            .map(|(k, _)| layout::tail_u64(&k))
            .collect();
        for (k, (n, _)) in &self.txn.nodes {
            if n.is_some() {
                keys.push(*k);
            }
        }
        keys.sort_unstable();
        keys.dedup();
        let mut live = Vec::with_capacity(keys.len());
        for k in keys {
            if self.node(k)?.is_some() {
                live.push(k);
            }
        }
        Ok(live)
    }

    // --- public API (same as crate::index::Index, fallible) ----------------------

    /// Decodes one raw batch and applies it atomically (one write batch).
    pub fn apply_payload(&mut self, source: SourceKey, payload: &[u8]) -> Result<ApplyStats> {
        let batch = decode_batch(payload).map_err(|e| KvIndexError::Decode(e.to_string()))?;
        let source = match batch.dp_rank {
            None => source,
            Some(r) => SourceKey {
                dp_rank: u32::try_from(r).map_err(|_| {
                    KvIndexError::Decode(format!(
                        "batch dp_rank {r} is not a valid rank (0 ..= 4294967295)"
                    ))
                })?,
                ..source
            },
        };
        self.apply_batch(source, &batch)
    }

    pub fn apply_batch(&mut self, source: SourceKey, batch: &EventBatch) -> Result<ApplyStats> {
        self.transact(|ix| ix.apply_batch_inner(source, batch))
    }

    pub fn register_source(&mut self, s: SourceKey, model: &str, tokenizer: &str) -> Result<()> {
        self.transact(|ix| {
            let mut src = ix.ensure_source(s)?;
            src.model = model.to_string();
            src.tokenizer = tokenizer.to_string();
            ix.set_source(s, Some(src));
            Ok(())
        })
    }

    pub fn clear_source(&mut self, s: SourceKey) -> Result<u64> {
        self.transact(|ix| ix.clear_inner(s))
    }

    /// Every residency of `s` in `medium` dropped (`Index::clear_medium`).
    pub fn clear_medium(&mut self, s: SourceKey, medium: &Medium) -> Result<u64> {
        self.transact(|ix| ix.clear_medium_inner(s, medium))
    }

    pub fn remove_worker(&mut self, worker: u64) -> Result<u64> {
        self.transact(|ix| {
            let mut dropped = 0;
            for (k, _) in ix
                .store
                .scan_prefix(&layout::worker_sources_prefix(worker))?
            {
                let dp_rank = u32::from_be_bytes(k[9..13].try_into().expect("4 bytes"));
                let s = SourceKey { worker, dp_rank };
                dropped += ix.clear_inner(s)?;
                ix.set_source(s, None);
            }
            Ok(dropped)
        })
    }

    pub fn pin(&mut self, keys: &[u64]) -> Result<()> {
        self.transact(|ix| {
            let (mut parent, mut linked) = (0u64, false);
            for (pos, &key) in keys.iter().enumerate() {
                let mut n = ix.get_or_insert(key, parent, linked, pos as u32)?;
                if !n.visible() {
                    ix.meta.blocks += 1;
                }
                if n.pins == 0 {
                    ix.meta.pinned += 1;
                }
                n.pins = n.pins.saturating_add(1);
                ix.set_node(key, Some(n));
                parent = key;
                linked = true;
            }
            Ok(())
        })
    }

    pub fn unpin(&mut self, keys: &[u64]) -> Result<()> {
        self.transact(|ix| {
            for &key in keys.iter().rev() {
                let Some(mut n) = ix.node(key)? else { continue };
                if n.pins == 0 {
                    continue;
                }
                let was_visible = n.visible();
                n.pins -= 1;
                if n.pins == 0 {
                    ix.meta.pinned -= 1;
                }
                if was_visible && !n.visible() {
                    ix.meta.blocks -= 1;
                }
                ix.set_node(key, Some(n));
                ix.collect(key)?;
            }
            Ok(())
        })
    }

    /// Longest cached prefix per (source, medium): one multi-get for the request.
    pub fn match_keys(&self, keys: &[u64]) -> Result<Vec<KvMatch>> {
        if keys.is_empty() {
            return Ok(vec![]);
        }
        let raw = self.store.multi_get(
            &keys
                .iter()
                .map(|&k| layout::node_key(k))
                .collect::<Vec<_>>(),
        )?;
        let mut done: Vec<KvMatch> = Vec::new();
        let mut alive: Vec<(u64, u32, String)> = Vec::new();
        for (i, v) in raw.iter().enumerate() {
            let holders: Vec<(u64, u32, String)> = match v {
                Some(b) => layout::decode_node(b)
                    .ok_or(KvIndexError::Corrupt { what: "node" })?
                    .holders
                    .into_iter()
                    .map(|(w, d, m, _)| (w, d, m))
                    .collect(),
                None => vec![],
            };
            if i == 0 {
                alive = holders;
            } else {
                let mut next = Vec::with_capacity(alive.len());
                for a in alive {
                    if holders.binary_search(&a).is_ok() {
                        next.push(a);
                    } else {
                        done.push((a.0, a.1, a.2, i as u32));
                    }
                }
                alive = next;
            }
            if alive.is_empty() {
                break;
            }
        }
        let n = keys.len() as u32;
        done.extend(alive.into_iter().map(|(w, d, m)| (w, d, m, n)));
        done.sort();
        Ok(done)
    }

    fn entry_of(key: u64, n: &Node) -> EntryOut {
        EntryOut {
            key,
            parent: n.parent,
            depth: n.depth,
            holders: n
                .holders
                .iter()
                .map(|(w, d, m, rc)| HolderOut {
                    worker: *w,
                    dp_rank: *d,
                    medium: m.clone(),
                    refcount: *rc,
                })
                .collect(),
            pinned: n.pins > 0,
        }
    }

    fn stored_node(&self, key: u64) -> Result<Option<Node>> {
        match self.store.get(&layout::node_key(key))? {
            Some(b) => Ok(Some(
                layout::decode_node(&b).ok_or(KvIndexError::Corrupt { what: "node" })?,
            )),
            None => Ok(None),
        }
    }

    /// Every visible block under `prefix.last()` (itself included), sorted by key;
    /// everything for an empty prefix. Walks the `C` ranges: one prefix scan per node.
    pub fn scan(&self, prefix: &[u64]) -> Result<Vec<EntryOut>> {
        let Some(&root) = prefix.last() else {
            return self.entries();
        };
        let mut out = Vec::new();
        let mut stack = vec![root];
        while let Some(key) = stack.pop() {
            let Some(n) = self.stored_node(key)? else {
                continue;
            };
            if n.visible() {
                out.push(Self::entry_of(key, &n));
            }
            if n.children > 0 {
                for (k, _) in self.store.scan_prefix(&layout::children_prefix(key))? {
                    stack.push(layout::tail_u64(&k));
                }
            }
        }
        out.sort_unstable_by_key(|e| e.key);
        Ok(out)
    }

    /// Every visible block, sorted by key.
    pub fn entries(&self) -> Result<Vec<EntryOut>> {
        let mut out = Vec::new();
        for (k, v) in self.store.scan_prefix(&[layout::NODE])? {
            let n = layout::decode_node(&v).ok_or(KvIndexError::Corrupt { what: "node" })?;
            if n.visible() {
                out.push(Self::entry_of(layout::tail_u64(&k), &n));
            }
        }
        Ok(out)
    }

    /// (blocks, nodes, resident pairs, sources, pinned).
    pub fn counts(&self) -> Result<(u64, u64, u64, u64, u64)> {
        let sources = self.store.scan_prefix(&[layout::SOURCE])?.len() as u64;
        let m = self.meta;
        Ok((m.blocks, m.nodes, m.pairs, sources, m.pinned))
    }

    /// The complete logical state, comparable with `Index::logical_state`.
    pub fn logical_state(&self) -> Result<LogicalState> {
        let mut state = LogicalState::default();
        for (k, v) in self.store.scan_prefix(&[layout::NODE])? {
            let n = layout::decode_node(&v).ok_or(KvIndexError::Corrupt { what: "node" })?;
            let e = Self::entry_of(layout::tail_u64(&k), &n);
            state
                .nodes
                .insert(e.key, (n.parent, n.depth, n.pins, e.holders));
        }
        for (k, v) in self.store.scan_prefix(&[layout::SOURCE])? {
            let s = layout::decode_source(&v).ok_or(KvIndexError::Corrupt { what: "source" })?;
            let worker = u64::from_be_bytes(k[1..9].try_into().expect("8 bytes"));
            let dp_rank = u32::from_be_bytes(k[9..13].try_into().expect("4 bytes"));
            let mut engine = BTreeMap::new();
            for (ek, ev) in self
                .store
                .scan_prefix(&layout::engine_prefix(worker, dp_rank))?
            {
                let group = u32::from_be_bytes(ek[13..17].try_into().expect("4 bytes"));
                engine.insert(
                    engine_map_key(group, layout::tail_u64(&ek)),
                    layout::u64_of(&ev).unwrap_or(0),
                );
            }
            state.sources.insert(
                SourceKey { worker, dp_rank },
                (s.model, s.tokenizer, engine),
            );
        }
        Ok(state)
    }
}

/// The reads, for code written once over every index. A store keeps a medium by the
/// name a parsed `Medium` gives, so parsing it again is exact.
impl<S: KvStore> IndexRead for KvIndex<S> {
    type Error = KvIndexError;

    fn matches(&self, keys: &[u64]) -> Result<Vec<NamedHit>> {
        Ok(self
            .match_keys(keys)?
            .into_iter()
            .map(|(worker, dp_rank, medium, blocks)| NamedHit {
                worker,
                dp_rank,
                medium: Medium::parse(Some(&medium)),
                blocks,
            })
            .collect())
    }

    fn scan(&self, prefix: &[u64]) -> Result<Vec<EntryOut>> {
        KvIndex::scan(self, prefix)
    }

    fn entries(&self) -> Result<Vec<EntryOut>> {
        KvIndex::entries(self)
    }

    /// Nothing spills (`spilled` is 0); `memory_bytes` is the store's own estimate
    /// (memtables, block cache, table readers).
    fn stats(&self) -> Result<IndexStats> {
        let (blocks, nodes, resident_pairs, sources, pinned) = self.counts()?;
        Ok(IndexStats {
            blocks,
            nodes,
            resident_pairs,
            sources,
            pinned,
            spilled: 0,
            memory_bytes: self.store.memory_bytes(),
            media_folded: self.media_folded,
        })
    }
}

#[cfg(test)]
mod tests;
