//! [`KvStore`] on Holt 0.9.2 (a persistent adaptive radix tree, the engine the
//! original study used): the "ART" side of the ART-vs-LSM study.
//!
//! Built with `default-features = false` (no io_uring: the plain file backend), Holt's
//! own WAL with `sync: false` unless asked (the same guarantee as the native index's
//! `none`: survives a process crash), one `atomic` batch per write.

use std::path::{Path, PathBuf};

use holt::{Durability, RangeEntry, Tree, TreeBuilder};

use super::{KvError, KvOp, KvPair, KvStore};

fn err(e: holt::Error) -> KvError {
    KvError {
        store: "holt",
        message: e.to_string(),
    }
}

pub struct HoltKv {
    tree: Tree,
    path: PathBuf,
}

impl HoltKv {
    pub fn open(path: &Path, sync: bool) -> Result<HoltKv, KvError> {
        let tree = TreeBuilder::new(path)
            .durability(Durability::Wal { sync })
            .open()
            .map_err(err)?;
        Ok(HoltKv {
            tree,
            path: path.to_path_buf(),
        })
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
        keys.iter().map(|k| self.tree.get(k).map_err(err)).collect()
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.tree.get(key).map_err(err)
    }

    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<KvPair>, KvError> {
        let mut out = Vec::new();
        for entry in self.tree.scan(prefix) {
            if let RangeEntry::Key { key, value, .. } = entry.map_err(err)? {
                out.push((key, value));
            }
        }
        Ok(out)
    }

    fn write(&mut self, ops: Vec<KvOp>) -> Result<(), KvError> {
        self.tree
            .atomic(|b| {
                for (k, v) in &ops {
                    match v {
                        Some(v) => b.put(k, v),
                        None => b.delete(k),
                    }
                }
            })
            .map_err(err)
            .and_then(|ok| {
                if ok {
                    Ok(())
                } else {
                    Err(KvError {
                        store: "holt",
                        message: "atomic batch was not committed".into(),
                    })
                }
            })
    }

    fn disk_bytes(&self) -> u64 {
        tree_bytes(&self.path)
    }

    fn flush(&mut self) -> Result<(), KvError> {
        self.tree.checkpoint().map_err(err)
    }
}
