//! The read methods the three index classes share (`match`, `match_many`, `scan`,
//! `entries`, `stats`), written once over `quillcache_core::index::IndexRead`. Each
//! class's `#[pymethods]` converts its arguments and calls these.
//!
//! Lock discipline: a lock is taken and released entirely inside `py.detach`. A
//! thread that held the lock while waiting to get the GIL back would deadlock with a
//! thread that holds the GIL while waiting for the lock (seen: the gateway's ingest
//! thread applying while its event loop matched). Reads share the lock (an `RwLock`
//! read); every class takes it the same way, through [`Locked`].

use std::sync::RwLock;

use pyo3::prelude::*;
use pyo3::types::PyList;

use numpy::PyArray1;

use quillcache_core::events::Medium;
use quillcache_core::index::{Index, IndexRead, NamedHit};

use crate::convert::{entries_list, index_stats_tuple, IndexStatsTuple};
use crate::errors::{closed, CoreError, OrRaise, QuillCacheError};
use crate::matches::match_list;

/// An index behind a class's lock.
pub(crate) trait Locked: Sync {
    type Index: IndexRead<Error: Into<CoreError> + Send>;

    /// Runs `f` on the index under the read lock; None once the index is closed.
    /// Only with the GIL released (see the module docs).
    fn read_with<T>(&self, f: impl FnOnce(&Self::Index) -> T) -> Option<T>;
}

/// `NativeIndex`'s: never closed.
impl Locked for RwLock<Index> {
    type Index = Index;

    fn read_with<T>(&self, f: impl FnOnce(&Index) -> T) -> Option<T> {
        // A poisoned lock means a panic mid-update; the index is still memory-safe.
        Some(f(&self.read().unwrap_or_else(|e| e.into_inner())))
    }
}

/// `DurableIndex`'s and `KvIndex`'s: None once `close` took the index.
impl<I> Locked for RwLock<Option<I>>
where
    I: IndexRead<Error: Into<CoreError> + Send> + Send + Sync,
{
    type Index = I;

    fn read_with<T>(&self, f: impl FnOnce(&I) -> T) -> Option<T> {
        self.read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(f)
    }
}

/// `f` on the index under its read lock, the GIL released for both.
pub(crate) fn read<L: Locked, T: Send>(
    py: Python<'_>,
    lock: &L,
    f: impl FnOnce(&L::Index) -> T + Send,
) -> PyResult<T> {
    py.detach(|| lock.read_with(f)).ok_or_else(closed)
}

/// `match`: `[Match, ...]` sorted by (worker, dp_rank, medium).
pub(crate) fn match_keys<'py, L: Locked>(
    py: Python<'py>,
    lock: &L,
    keys: &[u64],
) -> PyResult<Bound<'py, PyList>> {
    let hits = read(py, lock, |ix| ix.matches(keys))?.or_raise()?;
    match_list(py, &hits)
}

/// `match_columns`: `(worker u64[], dp_rank u32[], medium u16[], blocks u32[],
/// other_media)`, one entry per hit in `match`'s order. A medium is 0 (GPU), 1 (CPU),
/// 2 (DISK) or `3 + i` for `other_media[i]`: a router reads a fleet's hits as arrays
/// without one Python object per hit.
pub(crate) fn match_columns<'py, L: Locked>(
    py: Python<'py>,
    lock: &L,
    keys: &[u64],
) -> PyResult<MatchColumns<'py>> {
    let hits = read(py, lock, |ix| ix.matches(keys))?.or_raise()?;
    Ok(HitColumns::of(&hits).into_py(py))
}

/// `match_tiers`: per candidate, its longest prefix per tier as a flat `[gpu.., cpu..,
/// disk..]` array of `3 * candidates`, and the match compacted: the floors (`(medium
/// code, blocks)`: every live source holds that many leading blocks in that medium)
/// and the columns of the hits above them. `position[worker]` is the place of a
/// worker's rank 0 among the candidates (negative, or past the table's end: not a
/// candidate); its rank `r` is at `position[worker] + r` when `rank_counts` (per
/// position: the ranks of the worker there) says it has that rank, and no rank but 0
/// is a candidate without `rank_counts`. A medium beyond GPU and CPU counts as disk.
///
/// `all_live`: the caller vouches that every position below `candidates` is a live
/// source of this index (the control plane's candidates are its registered workers'
/// ranks), so the floors go to every position without a walk over the sources.
pub(crate) fn match_tiers<'py, L: Locked>(
    py: Python<'py>,
    lock: &L,
    keys: &[u64],
    position: &[isize],
    candidates: usize,
    rank_counts: Option<&[isize]>,
    all_live: bool,
) -> PyResult<MatchTiers<'py>> {
    if let Some(counts) = rank_counts {
        if counts.len() < candidates {
            return Err(QuillCacheError::new_err(format!(
                "rank_counts has {} entries for {candidates} candidates",
                counts.len()
            )));
        }
    }
    let place = |worker: u64, rank: u32| {
        let at = usize::try_from(worker)
            .ok()
            .and_then(|w| position.get(w))
            .and_then(|&p| usize::try_from(p).ok())
            .filter(|&p| p < candidates)?;
        if rank == 0 {
            return Some(at);
        }
        let ranks = rank_counts.and_then(|c| usize::try_from(c[at]).ok())?;
        let rank = rank as usize;
        (rank < ranks)
            .then_some(at + rank)
            .filter(|&p| p < candidates)
    };
    let mut tiers = vec![0i64; 3 * candidates];
    let compact = read(py, lock, |ix| {
        let compact = ix.matches_compact(keys)?;
        if !compact.floors.is_empty() {
            // the floors stand for every live source: those among the candidates get
            // them (the tiers are all zero until here, so a floor is set, not maxed)
            let floor = tier_floor(&compact.floors);
            if all_live {
                for (tier, &blocks) in floor.iter().enumerate() {
                    if blocks > 0 {
                        tiers[tier * candidates..(tier + 1) * candidates].fill(blocks);
                    }
                }
            } else {
                ix.floor_holders(&mut |worker, rank| {
                    if let Some(at) = place(worker, rank) {
                        for (tier, &blocks) in floor.iter().enumerate() {
                            if blocks > 0 {
                                tiers[tier * candidates + at] = blocks;
                            }
                        }
                    }
                });
            }
        }
        Ok::<_, <L::Index as IndexRead>::Error>(compact)
    })?
    .or_raise()?;
    let mut columns = HitColumns::of(&compact.hits);
    let floors: Vec<(u16, u32)> = compact
        .floors
        .iter()
        .map(|(medium, blocks)| (columns.code(medium), *blocks))
        .collect();
    let mut positions = Vec::with_capacity(columns.workers.len());
    for (i, &worker) in columns.workers.iter().enumerate() {
        let at = place(worker, columns.ranks[i]);
        if let Some(at) = at {
            let tier = usize::from(columns.media[i].min(2));
            let slot = &mut tiers[tier * candidates + at];
            *slot = (*slot).max(i64::from(columns.blocks[i]));
        }
        positions.push(at.map_or(-1, |p| p as isize));
    }
    Ok((
        PyArray1::from_vec(py, tiers),
        columns.into_py(py),
        floors,
        positions,
    ))
}

/// The floors per tier (gpu, cpu, disk; a medium beyond GPU and CPU counts as disk).
fn tier_floor(floors: &[(Medium, u32)]) -> [i64; 3] {
    let mut out = [0i64; 3];
    for (medium, blocks) in floors {
        let tier = match medium {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
            _ => 2,
        };
        out[tier] = out[tier].max(i64::from(*blocks));
    }
    out
}

/// `match_tiers`' flat tier array, the columns of the hits above the floors, the
/// floors as `(medium code, blocks)`, and each hit's candidate position (-1: none).
pub(crate) type MatchTiers<'py> = (
    Bound<'py, PyArray1<i64>>,
    MatchColumns<'py>,
    Vec<(u16, u32)>,
    Vec<isize>,
);

/// A match's hits as columns, before they become numpy arrays.
struct HitColumns {
    workers: Vec<u64>,
    ranks: Vec<u32>,
    media: Vec<u16>,
    blocks: Vec<u32>,
    others: Vec<String>,
}

impl HitColumns {
    fn of(hits: &[NamedHit]) -> Self {
        let mut c = HitColumns {
            workers: Vec::with_capacity(hits.len()),
            ranks: Vec::with_capacity(hits.len()),
            media: Vec::with_capacity(hits.len()),
            blocks: Vec::with_capacity(hits.len()),
            others: Vec::new(),
        };
        for hit in hits {
            c.workers.push(hit.worker);
            c.ranks.push(hit.dp_rank);
            c.blocks.push(hit.blocks);
            let code = c.code(&hit.medium);
            c.media.push(code);
        }
        c
    }

    /// A medium's code: 0 GPU, 1 CPU, 2 DISK, `3 + i` for `others[i]` (added on first use).
    fn code(&mut self, medium: &Medium) -> u16 {
        match medium {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
            Medium::Disk => 2,
            Medium::Other(name) => {
                let others = &mut self.others;
                let at = others.iter().position(|o| o == name).unwrap_or_else(|| {
                    others.push(name.clone());
                    others.len() - 1
                });
                // The index keeps at most MAX_CUSTOM_MEDIA + 1 other names.
                3 + u16::try_from(at).unwrap_or(u16::MAX - 3)
            }
        }
    }

    fn into_py(self, py: Python<'_>) -> MatchColumns<'_> {
        (
            PyArray1::from_vec(py, self.workers),
            PyArray1::from_vec(py, self.ranks),
            PyArray1::from_vec(py, self.media),
            PyArray1::from_vec(py, self.blocks),
            self.others,
        )
    }
}

/// `match_columns`' arrays and the names of the media beyond GPU / CPU / DISK.
pub(crate) type MatchColumns<'py> = (
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u16>>,
    Bound<'py, PyArray1<u32>>,
    Vec<String>,
);

/// `match_many`: one `match` per request, the GIL released once for the whole list
/// and the lock taken per request (an ingest waits behind one match, not the list).
pub(crate) fn match_many<'py, L: Locked, K: AsRef<[u64]> + Sync>(
    py: Python<'py>,
    lock: &L,
    requests: &[K],
) -> PyResult<Bound<'py, PyList>> {
    // Err(None): the index is closed.
    let all = py.detach(|| {
        requests
            .iter()
            .map(|k| match lock.read_with(|ix| ix.matches(k.as_ref())) {
                Some(hits) => hits.map_err(Some),
                None => Err(None),
            })
            .collect::<Result<Vec<Vec<NamedHit>>, Option<_>>>()
    });
    let all = match all {
        Ok(all) => all,
        Err(Some(e)) => return Err(PyErr::from(e.into())),
        Err(None) => return Err(closed()),
    };
    let out = PyList::empty(py);
    for hits in &all {
        out.append(match_list(py, hits)?)?;
    }
    Ok(out)
}

/// `scan`: the entries under `prefix`, sorted by key.
pub(crate) fn scan<'py, L: Locked>(
    py: Python<'py>,
    lock: &L,
    prefix: &[u64],
) -> PyResult<Bound<'py, PyList>> {
    let entries = read(py, lock, |ix| ix.scan(prefix))?.or_raise()?;
    entries_list(py, &entries)
}

/// `entries`: every block with a holder or a pin.
pub(crate) fn entries<'py, L: Locked>(py: Python<'py>, lock: &L) -> PyResult<Bound<'py, PyList>> {
    let entries = read(py, lock, |ix| ix.entries())?.or_raise()?;
    entries_list(py, &entries)
}

/// `stats`: `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
/// media_folded)`.
pub(crate) fn stats<L: Locked>(py: Python<'_>, lock: &L) -> PyResult<IndexStatsTuple> {
    let s = read(py, lock, |ix| ix.stats())?.or_raise()?;
    Ok(index_stats_tuple(&s))
}
