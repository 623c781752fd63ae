//! Persistent index backends for the ART-vs-LSM study (`docs/persistence.md`).
//!
//! [`kv_index::KvIndex`] implements the residency index's semantics (`docs/index.md`,
//! the same rules as `crate::index::Index`) over any ordered key-value store
//! ([`KvStore`]): one write batch per event batch, a prefix-friendly key layout
//! ([`layout`]) and one multi-get per match. Stores: [`mem_kv::MemKv`] (a `BTreeMap`,
//! for the property tests that need no C++ build), RocksDB (feature `rocksdb`) and
//! Holt (feature `holt`).

#[cfg(feature = "holt")]
pub mod holt_kv;
pub mod kv_index;
pub mod layout;
pub mod mem_kv;
#[cfg(feature = "rocksdb")]
pub mod rocks;

pub use kv_index::KvIndex;

/// A key and its value.
pub type KvPair = (Vec<u8>, Vec<u8>);
/// A put (`Some`) or a delete (`None`).
pub type KvOp = (Vec<u8>, Option<Vec<u8>>);

/// What kind of failure a [`KvError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvErrorKind {
    /// The store reported an error; it stays usable.
    Engine,
    /// The store refuses this and every later call (a failed write may have left
    /// it inconsistent in memory); reopening recovers the acknowledged state.
    Refused,
}

/// An error of the underlying store, with its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{store} error: {message}")]
pub struct KvError {
    pub store: &'static str,
    pub message: String,
    pub kind: KvErrorKind,
}

impl KvError {
    pub fn new(store: &'static str, message: impl Into<String>) -> Self {
        KvError {
            store,
            message: message.into(),
            kind: KvErrorKind::Engine,
        }
    }

    pub fn refused(store: &'static str, message: impl Into<String>) -> Self {
        KvError {
            store,
            message: message.into(),
            kind: KvErrorKind::Refused,
        }
    }
}

/// The few operations the index needs from an ordered key-value store.
pub trait KvStore: Send + Sync {
    /// Values of `keys`, in order (one round trip where the store allows it).
    fn multi_get(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError>;
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.multi_get(&[key.to_vec()])?.pop().flatten())
    }
    /// Every (key, value) whose key starts with `prefix`, in key order.
    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<KvPair>, KvError>;
    /// Applies puts (`Some`) and deletes (`None`) atomically.
    fn write(&mut self, ops: Vec<KvOp>) -> Result<(), KvError>;
    /// Bytes of the store's files (0 for an in-memory store).
    fn disk_bytes(&self) -> u64 {
        0
    }
    /// The store's own estimate of its memory use.
    fn memory_bytes(&self) -> u64 {
        0
    }
    /// Makes everything written durable (flush memtables / fsync).
    fn flush(&mut self) -> Result<(), KvError> {
        Ok(())
    }
}

impl<T: KvStore + ?Sized> KvStore for Box<T> {
    fn multi_get(&self, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        (**self).multi_get(keys)
    }
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        (**self).get(key)
    }
    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<KvPair>, KvError> {
        (**self).scan_prefix(prefix)
    }
    fn write(&mut self, ops: Vec<KvOp>) -> Result<(), KvError> {
        (**self).write(ops)
    }
    fn disk_bytes(&self) -> u64 {
        (**self).disk_bytes()
    }
    fn memory_bytes(&self) -> u64 {
        (**self).memory_bytes()
    }
    fn flush(&mut self) -> Result<(), KvError> {
        (**self).flush()
    }
}

/// Opens a store by name: `memory`, `rocksdb` (feature) or `holt` (feature).
pub fn open_store(
    kind: &str,
    path: Option<&std::path::Path>,
    sync: bool,
) -> Result<Box<dyn KvStore>, KvError> {
    let need_path =
        |store: &'static str| path.ok_or(KvError::new(store, "a directory is required"));
    let _ = (&need_path, sync);
    match kind {
        "memory" => Ok(Box::new(mem_kv::MemKv::new())),
        #[cfg(feature = "rocksdb")]
        "rocksdb" => Ok(Box::new(rocks::RocksKv::open(need_path("rocksdb")?, sync)?)),
        #[cfg(feature = "holt")]
        "holt" => Ok(Box::new(holt_kv::HoltKv::open(need_path("holt")?, sync)?)),
        other => Err(KvError::new(
            "backend",
            format!(
                "store {other:?} is not available in this build (known: memory{}); \
                 rebuild with `maturin develop --release --features {other}`",
                if cfg!(feature = "holt") { ", holt" } else { "" }
            ),
        )),
    }
}
