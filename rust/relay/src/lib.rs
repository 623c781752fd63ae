//! The gateway's data path: an HTTP/1.1 relay in front of the engines.
//!
//! The relay owns the client connections and the engine connections; a *host* (the
//! Python gateway) owns every decision. For a POST to a *hot* path (the OpenAI
//! completion endpoints) the relay reads the body and hands it to the host as an
//! [`Event::Request`]; the host answers with a [`Reply`]: forward it to an engine, answer
//! it directly (an error), or delegate it to the host's own HTTP app. Everything else
//! (models, health, metrics, admin) is proxied to that app unchanged.
//!
//! A forwarded answer is relayed frame by frame as the engine sends it; the host hears
//! about it through events (first byte, a usage chunk, the end and how it ended), never
//! on the byte path. A client that goes away drops the engine connection, which is how
//! an engine learns to abort. The relay never calls into the host: events wait in an
//! [`Inbox`] whose file descriptor becomes readable when there is something to take, so
//! the host can watch it from its own event loop.

mod body;
mod conn;
mod exchange;
mod inbox;
mod server;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;

pub use conn::HALF_CLOSE_GRACE;
pub use inbox::Inbox;

/// Identifies one hot request between the relay and its host.
pub type RequestId = u64;

/// Header name and value, as received or to send.
pub type Header = (String, Bytes);

/// The client's IP address, on a request passed to the backend app (a client's own
/// header of that name is replaced).
pub const PEER_HEADER: &str = "x-quillcache-peer";
/// [`RelayConfig::backend_key`], on a request passed to the backend app.
pub const PEER_KEY_HEADER: &str = "x-quillcache-relay-key";

#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Where clients connect (port 0: any free port, see [`Relay::local_addr`]).
    pub listen: SocketAddr,
    /// The host's own HTTP app: every request that is not hot, and delegated ones.
    pub backend: SocketAddr,
    /// POSTs to these paths are decided by the host.
    pub hot_paths: Vec<String>,
    /// A larger hot request body gets a 413 without reaching the host.
    pub max_body_bytes: usize,
    /// Sent to the backend app with each request it passes on, beside the client's
    /// address ([`PEER_HEADER`]): the app believes the address only with this key.
    pub backend_key: String,
    /// TCP connect to an engine or the backend.
    pub connect_timeout: Duration,
    /// A whole forwarded exchange, from the upstream request to the answer's last byte.
    pub request_timeout: Duration,
    /// The longest wait for an engine's next body frame once its answer started: a hung
    /// engine's stream ends with an SSE error (a whole answer gets a 502) instead of
    /// holding the client for `request_timeout`.
    pub stall_timeout: Duration,
}

/// What the relay tells its host.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A hot request to decide: answer with [`Relay::reply`].
    Request {
        id: RequestId,
        path: String,
        /// Names in lower case, in the order received.
        headers: Vec<Header>,
        body: Bytes,
        /// Time since the request's head arrived (reading the body, the inbox).
        waited: Duration,
        /// The client's address (the host decides whom to trust by it).
        peer: SocketAddr,
    },
    /// The engine a [`Reply::Forward`] named could not be reached or failed before its
    /// answer's head: reply again (forward elsewhere, or answer).
    UpstreamFailed {
        id: RequestId,
        /// The TCP connect failed (the engine is down), as opposed to a later failure.
        connect: bool,
        /// No answer head (for a stream: no first body frame) within the forward's
        /// `first_byte_timeout`: the engine hangs. Nothing reached the client.
        timed_out: bool,
        message: String,
    },
    /// The first byte of a forwarded answer's body arrived from the engine.
    FirstByte { id: RequestId, elapsed: Duration },
    /// A body chunk of a forwarded answer that mentions `"cached_tokens"` (the usage).
    Usage { id: RequestId, chunk: Bytes },
    /// A forwarded exchange is over (sent once per forwarded request).
    End {
        id: RequestId,
        /// The status the client got.
        status: u16,
        /// Whether the answer was an SSE stream relayed frame by frame.
        streamed: bool,
        outcome: Outcome,
        /// Since the request's head arrived.
        elapsed: Duration,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The whole answer was relayed.
    Complete,
    /// The engine failed after its answer's head (a stream got an SSE error event, a
    /// whole answer a 502).
    UpstreamFailed(String),
    /// The client went away first; the engine connection was dropped.
    ClientLeft,
}

/// The host's answer to [`Event::Request`] or [`Event::UpstreamFailed`].
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// Send `body` to `url` (`http://host:port/path`) and relay the answer, adding
    /// `response_headers` to it.
    Forward {
        url: String,
        headers: Vec<Header>,
        body: Bytes,
        response_headers: Vec<Header>,
        /// The answer's head, and for an SSE stream its first body frame, must come
        /// within this (the host scales it with the request's expected prefill); else
        /// [`Event::UpstreamFailed`] with `timed_out`, before the client got anything.
        first_byte_timeout: Duration,
    },
    /// Answer the client with this (no engine involved).
    Respond {
        status: u16,
        headers: Vec<Header>,
        body: Bytes,
    },
    /// Let the backend app serve the request as it came.
    Delegate,
}

/// A running relay: a thread with its own single-threaded runtime.
pub struct Relay {
    inbox: Arc<Inbox>,
    local_addr: SocketAddr,
    shutdown: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Relay {
    /// Binds `config.listen` and starts serving.
    pub fn start(config: RelayConfig) -> std::io::Result<Self> {
        let inbox = Arc::new(Inbox::new()?);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let listener = runtime.block_on(async { listen(config.listen) })?;
        let local_addr = listener.local_addr()?;
        let (shutdown, stopped) = tokio::sync::oneshot::channel();
        let state = server::State::new(config, Arc::clone(&inbox));
        let thread = std::thread::Builder::new()
            .name("quillcache-relay".into())
            .spawn(move || runtime.block_on(server::serve(listener, state, stopped)))?;
        Ok(Self {
            inbox,
            local_addr,
            shutdown: Mutex::new(Some(shutdown)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// Answers a request (or an upstream failure). False when the relay no longer waits
    /// for it: the client went away, or it was answered already.
    pub fn reply(&self, id: RequestId, reply: Reply) -> bool {
        self.inbox.reply(id, reply)
    }

    /// Stops accepting and drops every open connection; waits for the thread.
    /// Requests still waiting for a reply get a 503.
    pub fn stop(&self) {
        let stop = self
            .shutdown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(tx) = stop {
            let _ = tx.send(());
        }
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// Binds with a backlog as deep as uvicorn's: a burst of connections waits, not refused.
fn listen(address: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if address.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(2048)
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop();
    }
}
