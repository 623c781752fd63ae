//! [`KvStore`] on RocksDB (an LSM tree): the "LSM" side of the ART-vs-LSM study.
//!
//! Settings chosen for this workload (documented in `docs/persistence.md`): RocksDB's
//! own WAL on, no fsync per write (the same guarantee as the native index's `none`:
//! survives a process crash), whole-key Bloom filters (10 bits/key) and a 64 MiB
//! block cache for the point lookups of `match`, no compression (the values are small
//! and the crate is built without compression libraries to keep the C++ build short).

use std::path::{Path, PathBuf};

use rocksdb::{
    BlockBasedOptions, Cache, DBCompressionType, Direction, IteratorMode, Options, WriteBatch,
    WriteOptions, DB,
};

use super::{KvError, KvOp, KvPair, KvStore};

fn err(e: rocksdb::Error) -> KvError {
    KvError::new("rocksdb", e.into_string())
}

pub struct RocksKv {
    db: DB,
    path: PathBuf,
    write_opts: WriteOptions,
}

impl RocksKv {
    /// Opens (creating if needed) the database in `path`. `sync`: fsync RocksDB's WAL on
    /// every write batch (the native index's `per-batch`).
    pub fn open(path: &Path, sync: bool) -> Result<RocksKv, KvError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(DBCompressionType::None);
        let mut table = BlockBasedOptions::default();
        table.set_bloom_filter(10.0, false);
        table.set_block_cache(&Cache::new_lru_cache(64 << 20));
        opts.set_block_based_table_factory(&table);
        let db = DB::open(&opts, path).map_err(err)?;
        let mut write_opts = WriteOptions::default();
        write_opts.set_sync(sync);
        Ok(RocksKv {
            db,
            path: path.to_path_buf(),
            write_opts,
        })
    }
}

fn dir_bytes(path: &Path) -> u64 {
    std::fs::read_dir(path)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

impl KvStore for RocksKv {
    fn multi_get(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        self.db
            .multi_get(keys)
            .into_iter()
            .map(|r| r.map_err(err))
            .collect()
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.db.get(key).map_err(err)
    }

    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<KvPair>, KvError> {
        let mut out = Vec::new();
        for item in self
            .db
            .iterator(IteratorMode::From(prefix, Direction::Forward))
        {
            let (k, v) = item.map_err(err)?;
            if !k.starts_with(prefix) {
                break;
            }
            out.push((k.into_vec(), v.into_vec()));
        }
        Ok(out)
    }

    fn write(&mut self, ops: Vec<KvOp>) -> Result<(), KvError> {
        let mut batch = WriteBatch::default();
        for (k, v) in ops {
            match v {
                Some(v) => batch.put(k, v),
                None => batch.delete(k),
            }
        }
        self.db.write_opt(batch, &self.write_opts).map_err(err)
    }

    fn disk_bytes(&self) -> u64 {
        dir_bytes(&self.path)
    }

    fn memory_bytes(&self) -> u64 {
        [
            "rocksdb.cur-size-all-mem-tables",
            "rocksdb.block-cache-usage",
            "rocksdb.estimate-table-readers-mem",
        ]
        .iter()
        .filter_map(|p| self.db.property_int_value(*p).ok().flatten())
        .sum()
    }

    fn flush(&mut self) -> Result<(), KvError> {
        self.db.flush().map_err(err)?;
        self.db.flush_wal(true).map_err(err)
    }
}
