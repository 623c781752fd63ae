//! Persistence of the residency index: a write-ahead log of applied batches
//! ([`wal`]), snapshots ([`snapshot`]) and the crash-safe native index built on both
//! ([`durable`]). See `docs/persistence.md`.

pub mod durable;
pub mod error;
pub mod frame;
pub mod snapshot;
pub mod ticker;
pub mod wal;

pub use durable::{
    ApplyError, DurableIndex, DurableOptions, RecoveryInfo, DEFAULT_SNAPSHOT_LOG_RATIO,
    DEFAULT_SNAPSHOT_MIN_BYTES,
};
pub use error::PersistError;
pub use frame::{LoggedRecord, Record};
pub use ticker::{SharedDurable, SnapshotTicker};
pub use wal::{Durability, RecoveryReport, TornTail, Wal, WalOptions};

#[cfg(test)]
pub(crate) mod durable_tests;
#[cfg(test)]
pub(crate) mod wal_tests;
