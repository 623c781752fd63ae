//! [`KvStore`] on Holt 0.9.2 (a persistent adaptive radix tree, the engine the
//! original study used): the "ART" side of the ART-vs-LSM study.
//!
//! Built with `default-features = false` (no io_uring: the plain file backend), Holt's
//! own WAL with `sync: false` unless asked (the same guarantee as the native index's
//! `none`: survives a process crash), one `atomic` batch per write.
//!
//! **A failed write poisons the store** (`docs/persistence.md`, "Holt's blob slot
//! limit"). Holt 0.9.2 applies an `atomic` batch to its in-memory tree op by op and
//! logs it only when every op succeeded, so an op that fails in the middle (in
//! practice: `blob slot table exhausted (10240 slots)`, which its spillover cannot
//! get out of) leaves the earlier ops of the batch visible in memory but not in the
//! log. Holt's background checkpointer (and its final round on drop) would then write
//! that half batch into the blob files. So this store runs with the checkpointer off
//! and checkpoints itself between batches only (every 500 ms or 8 MiB written);
//! after a failed write it refuses every call ([`KvErrorKind::Refused`]), and
//! dropping it writes no blob frame, so a reopen recovers exactly the logged batches
//! (checkpoint + WAL replay): with `sync`, every acknowledged batch.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use holt::{CheckpointConfig, Durability, RangeEntry, Tree, TreeBuilder};

use super::{KvError, KvOp, KvPair, KvStore};

/// Holt's per-blob slot table size (`MAX_SLOTS` in `holt-0.9.2/src/layout/header.rs`).
pub const HOLT_MAX_SLOTS: u32 = 10_240;

/// Checkpoint (write dirty blob frames, truncate the WAL) once this many key and
/// value bytes were written since the last one, or this much time passed (the
/// cadence of Holt's own checkpointer, `CheckpointConfig::idle_interval`): bounds
/// the WAL replayed at open.
const CHECKPOINT_EVERY_BYTES: usize = 8 << 20;
const CHECKPOINT_EVERY: Duration = Duration::from_millis(500);

fn engine_err(e: holt::Error) -> KvError {
    KvError::new("holt", e.to_string())
}

pub struct HoltKv {
    tree: Tree,
    path: PathBuf,
    /// Holt's WAL is fsynced on every write.
    sync: bool,
    /// Key and value bytes written since the last checkpoint, and when it was.
    since_checkpoint: usize,
    last_checkpoint: Instant,
    /// Why the store refuses every call, after a failed write.
    poisoned: Option<String>,
}

impl HoltKv {
    pub fn open(path: &Path, sync: bool) -> Result<HoltKv, KvError> {
        let checkpoint = CheckpointConfig {
            enabled: false,
            ..CheckpointConfig::default()
        };
        let tree = TreeBuilder::new(path)
            .durability(Durability::Wal { sync })
            .checkpoint(checkpoint)
            .open()
            .map_err(engine_err)?;
        Ok(HoltKv {
            tree,
            path: path.to_path_buf(),
            sync,
            since_checkpoint: 0,
            last_checkpoint: Instant::now(),
            poisoned: None,
        })
    }

    /// Why this store refuses calls (after a failed write), if it does.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    fn check_usable(&self) -> Result<(), KvError> {
        match &self.poisoned {
            None => Ok(()),
            Some(why) => Err(KvError::refused(
                "holt",
                format!(
                    "store refused: an earlier write failed ({why}); {}",
                    self.reopen_advice()
                ),
            )),
        }
    }

    fn reopen_advice(&self) -> &'static str {
        if self.sync {
            "reopen the directory to recover the acknowledged state"
        } else {
            // Holt has no call that only drains its WAL buffer, and a checkpoint
            // would write the half-applied batch: the unsynced tail is lost, as
            // after a crash (docs/persistence.md, "Holt and SIGKILL").
            "reopen the directory to recover the logged state (without sync, up to \
             64 KB of the last acknowledged records are lost, as after a crash)"
        }
    }

    fn poison(&mut self, cause: String) -> KvError {
        let hint = if cause.contains("slot table exhausted") {
            format!(
                " — a limit of holt 0.9.2: a blob frame holds at most {HOLT_MAX_SLOTS} nodes and \
                 its spillover cannot split a frame whose slot table is full \
                 (docs/persistence.md, \"Holt's blob slot limit\")"
            )
        } else {
            String::new()
        };
        let message = format!(
            "{cause}{hint}; the batch was not stored, and as holt may hold part of it in \
             memory, this store now refuses every call: {}",
            self.reopen_advice()
        );
        self.poisoned = Some(cause);
        KvError::refused("holt", message)
    }

    fn apply(&self, ops: &[KvOp]) -> Result<(), String> {
        let committed = self
            .tree
            .atomic(|b| {
                for (k, v) in ops {
                    match v {
                        Some(v) => b.put(k, v),
                        None => b.delete(k),
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        if committed {
            Ok(())
        } else {
            Err("atomic batch was not committed".into())
        }
    }
}

fn tree_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::metadata(path) else {
        return 0;
    };
    if meta.is_file() {
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| tree_bytes(&e.path()))
                .sum()
        })
        .unwrap_or(0)
}

impl KvStore for HoltKv {
    fn multi_get(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        self.check_usable()?;
        keys.iter()
            .map(|k| self.tree.get(k).map_err(engine_err))
            .collect()
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.check_usable()?;
        self.tree.get(key).map_err(engine_err)
    }

    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<KvPair>, KvError> {
        self.check_usable()?;
        let mut out = Vec::new();
        for entry in self.tree.scan(prefix) {
            if let RangeEntry::Key { key, value, .. } = entry.map_err(engine_err)? {
                out.push((key, value));
            }
        }
        Ok(out)
    }

    fn write(&mut self, ops: Vec<KvOp>) -> Result<(), KvError> {
        self.check_usable()?;
        if let Err(cause) = self.apply(&ops) {
            return Err(self.poison(cause));
        }
        self.since_checkpoint += ops
            .iter()
            .map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        if self.since_checkpoint >= CHECKPOINT_EVERY_BYTES
            || self.last_checkpoint.elapsed() >= CHECKPOINT_EVERY
        {
            if let Err(e) = self.flush() {
                // The batch is in the WAL, but the caller will take it as failed:
                // refuse everything until a reopen reads the true state back.
                return Err(self.poison(format!(
                    "checkpoint after a stored batch failed: {}",
                    e.message
                )));
            }
        }
        Ok(())
    }

    fn disk_bytes(&self) -> u64 {
        tree_bytes(&self.path)
    }

    fn flush(&mut self) -> Result<(), KvError> {
        self.check_usable()?;
        self.tree.checkpoint().map_err(engine_err)?;
        self.since_checkpoint = 0;
        self.last_checkpoint = Instant::now();
        Ok(())
    }
}

#[cfg(test)]
#[path = "holt_kv_tests.rs"]
mod tests;
