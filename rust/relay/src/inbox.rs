//! Where the relay leaves events for its host, and where the host's replies wait.
//!
//! The host is an event loop in another thread (Python's asyncio): it watches
//! [`Inbox::fd`] and calls [`Inbox::take`] when it is readable. One wake byte is written
//! per empty -> non-empty transition, so a burst of events costs one wake-up.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::sync::oneshot;

use crate::{Event, Reply, RequestId};

pub struct Inbox {
    events: Mutex<Vec<Event>>,
    /// A wake byte is written and not yet consumed by `take`.
    armed: AtomicBool,
    wake_tx: UnixStream,
    wake_rx: UnixStream,
    waiting: Mutex<HashMap<RequestId, oneshot::Sender<Reply>>>,
    next_id: AtomicU64,
}

impl Inbox {
    pub(crate) fn new() -> std::io::Result<Self> {
        let (wake_tx, wake_rx) = UnixStream::pair()?;
        wake_tx.set_nonblocking(true)?;
        wake_rx.set_nonblocking(true)?;
        Ok(Self {
            events: Mutex::new(Vec::new()),
            armed: AtomicBool::new(false),
            wake_tx,
            wake_rx,
            waiting: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        })
    }

    /// Readable when `take` has something.
    pub fn fd(&self) -> RawFd {
        self.wake_rx.as_raw_fd()
    }

    /// Every event so far, oldest first.
    pub fn take(&self) -> Vec<Event> {
        // Drain, then disarm, then take. A push that saw the inbox armed happened before
        // the disarm, so its event is taken below; a push after the disarm writes a new
        // byte (at worst a spurious wake-up). Disarming *before* draining could eat that
        // new byte and leave the inbox armed with no byte: the host would sleep forever.
        let mut sink = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut sink), Ok(n) if n > 0) {}
        self.armed.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn push(&self, event: Event) {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(event);
        if !self.armed.swap(true, Ordering::SeqCst) {
            // WouldBlock means the socket already holds unread bytes: a wake is pending.
            match (&self.wake_tx).write(&[1]) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => {} // the host's end is gone: nobody to wake
            }
        }
    }

    pub(crate) fn new_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers interest in the host's reply for `id`; push the event after this.
    pub(crate) fn expect_reply(&self, id: RequestId) -> oneshot::Receiver<Reply> {
        let (tx, rx) = oneshot::channel();
        self.lock_waiting().insert(id, tx);
        rx
    }

    /// The request stopped waiting (its client went away).
    pub(crate) fn forget(&self, id: RequestId) {
        self.lock_waiting().remove(&id);
    }

    pub(crate) fn reply(&self, id: RequestId, reply: Reply) -> bool {
        let waiter = self.lock_waiting().remove(&id);
        waiter.is_some_and(|tx| tx.send(reply).is_ok())
    }

    /// Requests waiting for a reply (for tests and stats).
    pub fn waiting(&self) -> usize {
        self.lock_waiting().len()
    }

    fn lock_waiting(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<RequestId, oneshot::Sender<Reply>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// Waits until the inbox's fd is readable, as the host's event loop does.
    fn wait_readable(inbox: &Inbox, timeout: Duration) -> bool {
        let mut poll = libc::pollfd {
            fd: inbox.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut poll, 1, timeout.as_millis() as i32) > 0 }
    }

    fn event(id: RequestId) -> Event {
        Event::FirstByte {
            id,
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn a_host_that_sleeps_until_woken_gets_every_event() {
        // Producers race the host's take(): no interleaving may leave an event behind
        // with the fd quiet (the host would never look again).
        let inbox = Arc::new(Inbox::new().unwrap());
        const PER_PRODUCER: u64 = 20_000;
        let producers: Vec<_> = (0..3)
            .map(|p| {
                let inbox = Arc::clone(&inbox);
                std::thread::spawn(move || {
                    for i in 0..PER_PRODUCER {
                        inbox.push(event(p * PER_PRODUCER + i));
                        if i % 64 == 0 {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut seen = 0;
        while seen < 3 * PER_PRODUCER {
            assert!(
                wait_readable(&inbox, Duration::from_secs(5)),
                "events left behind with the fd quiet after {seen}"
            );
            seen += inbox.take().len() as u64;
        }
        for p in producers {
            p.join().unwrap();
        }
        assert!(inbox.take().is_empty());
    }

    #[test]
    fn replies_reach_only_a_waiting_request() {
        let inbox = Inbox::new().unwrap();
        let id = inbox.new_id();
        let mut rx = inbox.expect_reply(id);
        assert!(inbox.reply(id, Reply::Delegate));
        assert_eq!(rx.try_recv().unwrap(), Reply::Delegate);
        assert!(!inbox.reply(id, Reply::Delegate), "answered once");
        let other = inbox.new_id();
        drop(inbox.expect_reply(other));
        assert!(!inbox.reply(other, Reply::Delegate), "its client left");
        inbox.forget(other);
        assert_eq!(inbox.waiting(), 0);
    }
}
