//! A timer thread for a shared [`DurableIndex`]: periodic snapshots by time must
//! also happen when ingest goes idle (the log tail since the last snapshot would
//! otherwise wait for the next `apply` to be bounded), and a finished background
//! snapshot should be adopted (its log pruned) without waiting for one.
//!
//! The thread calls [`DurableIndex::tick`] under the write lock that every mutation
//! takes, so a tick and an `apply` never interleave. It holds only a weak reference:
//! dropping the index's owner ends it, and so does [`SnapshotTicker::stop`].

use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use super::durable::DurableIndex;

/// How the owner of a durable index shares it (None once closed).
pub type SharedDurable = RwLock<Option<DurableIndex>>;

pub struct SnapshotTicker {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl SnapshotTicker {
    /// Starts a thread that ticks `index` every `period` until stopped or dropped.
    pub fn spawn(index: Weak<SharedDurable>, period: Duration) -> std::io::Result<SnapshotTicker> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("quillcache-snapshot-timer".into())
            .spawn(move || run(&index, &flag, period))?;
        Ok(SnapshotTicker {
            stop,
            handle: Some(handle),
        })
    }

    /// Stops the thread and waits for it (a tick in progress finishes first).
    /// Idempotent.
    pub fn stop(&mut self) {
        let (lock, cvar) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cvar.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for SnapshotTicker {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(index: &Weak<SharedDurable>, stop: &(Mutex<bool>, Condvar), period: Duration) {
    let (lock, cvar) = stop;
    loop {
        let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (stopped, _) = cvar
            .wait_timeout_while(stopped, period, |s| !*s)
            .unwrap_or_else(|e| e.into_inner());
        if *stopped {
            return;
        }
        drop(stopped);
        let Some(shared) = index.upgrade() else {
            return;
        };
        let mut guard = shared.write().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = guard.as_mut() {
            d.tick();
        }
    }
}
