//! One client connection's bytes, below hyper: half-closing clients, clients that leave,
//! and hyper's own answers to requests it cannot parse.
//!
//! hyper runs with `half_close(true)`: a client may shut its sending side once its
//! request is out (`shutdown(SHUT_WR)`) and still read the answer. The same end of input
//! is also what a client that gives up sends, and no socket call tells the two apart, so
//! the time decides: an end of input within [`HALF_CLOSE_GRACE`] of the request's last
//! byte, before any answer to it, is a half-close; a later one, while a request is in
//! flight, means the client left, and the connection is dropped (and with it the engine
//! request). A half-closing client shuts its side right behind its request, so before
//! an answer can have reached it; one that closes after its streamed answer started has
//! left. (A whole answer is written the moment it exists: nothing is saved by dropping
//! it, and a client shutting its side a little late still gets it.)
//!
//! hyper answers a request it cannot parse with an empty 400, 414 or 431 of its own;
//! [`ClientIo`] rewrites that head into the OpenAI error shape every other answer has.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Frame, SizeHint};
use hyper::header::{HeaderValue, CONNECTION, CONTENT_LENGTH};
use hyper::Response;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::body::{error_response, Body};

/// How soon after its request's last byte a client's end of input counts as a
/// half-close (the Python path's `h1.HALF_CLOSE_GRACE_S` is the same).
pub const HALF_CLOSE_GRACE: Duration = Duration::from_millis(500);
/// The largest request head (request line and headers); larger gets a 431.
pub const MAX_HEAD_BYTES: usize = 128 << 10;
/// More header fields than this get a 431.
pub const MAX_HEADERS: usize = 100;
/// A request body (non-hot paths) must arrive within this.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// What the connection's reader, its requests and its leave watcher share.
pub struct Watch {
    state: Mutex<WatchState>,
    changed: Notify,
}

struct WatchState {
    /// Requests whose answer is not yet wholly handed to hyper.
    in_flight: usize,
    /// One of them is being answered with a stream (hyper is writing it).
    streaming: bool,
    last_data: Instant,
}

impl Watch {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(WatchState {
                in_flight: 0,
                streaming: false,
                last_data: Instant::now(),
            }),
            changed: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request reached the service; see [`Watch::answered`].
    pub fn started(self: &Arc<Self>) {
        self.lock().in_flight += 1;
        self.changed.notify_one();
    }

    /// `response`, counted in flight until its body is done (or dropped).
    pub fn answered(self: &Arc<Self>, response: Response<Body>) -> Response<Body> {
        if hyper::body::Body::size_hint(response.body())
            .exact()
            .is_none()
        {
            self.lock().streaming = true;
        }
        let guard = Answering(Arc::clone(self));
        response.map(|body| {
            Tracked {
                body,
                _guard: guard,
            }
            .boxed_unsync()
        })
    }

    /// Resolves when the client has left while a request was in flight: its end of input
    /// came later than [`HALF_CLOSE_GRACE`] after its last byte, or after a streamed
    /// answer started. Never resolves for a half-closing client (hyper closes that connection
    /// once the answer is out).
    pub async fn left(&self, stream: &TcpStream) {
        let mut probe = [0u8; 1];
        loop {
            // Only an in-flight request has anything to cancel.
            loop {
                let notified = self.changed.notified();
                if self.lock().in_flight > 0 {
                    break;
                }
                notified.await;
            }
            match stream.peek(&mut probe).await {
                Ok(0) => {
                    let gone = {
                        let state = self.lock();
                        state.streaming || state.last_data.elapsed() > HALF_CLOSE_GRACE
                    };
                    if gone {
                        return;
                    }
                    // A half-close: the answer still goes out; nothing more can come.
                    std::future::pending::<()>().await;
                }
                // Bytes hyper has not read yet (a body still arriving, a pipelined
                // request): look again a little later instead of spinning on them.
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(_) => return, // reset
            }
        }
    }
}

struct Answering(Arc<Watch>);

impl Drop for Answering {
    fn drop(&mut self) {
        let watch = &self.0;
        let mut state = watch.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        state.streaming = state.in_flight > 0 && state.streaming;
        drop(state);
        watch.changed.notify_one();
    }
}

/// An answer's body that keeps its request counted in flight until it is dropped.
struct Tracked {
    body: Body,
    _guard: Answering,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body read whole (for the backend app), or the answer that refuses it.
pub async fn read_whole<B>(body: B, limit: usize) -> Result<Bytes, Response<Body>>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(too_big(limit));
    }
    match tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(err)) if err.is::<http_body_util::LengthLimitError>() => Err(too_big(limit)),
        Ok(Err(err)) => Err(error_response(
            400,
            &format!("could not read the request body: {err}"),
            "BadRequestError",
        )),
        Err(_) => Err(error_response(
            408,
            &format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            ),
            "RequestTimeout",
        )),
    }
}

fn too_big(limit: usize) -> Response<Body> {
    let message = format!("request body larger than {limit} bytes");
    error_response(413, &message, "PayloadTooLarge")
}

/// The answer to a request whose target is not a path (`OPTIONS *`, `GET *`): nothing
/// here serves the server as a whole, and the backend app only takes paths.
pub fn refuse_target(path: &str) -> Option<Response<Body>> {
    if path.starts_with('/') {
        return None;
    }
    let mut response = error_response(
        400,
        &format!(
            "request target {path:?} is not a path; only origin-form targets (/...) are served"
        ),
        "BadRequestError",
    );
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    Some(response)
}

/// The client socket as hyper sees it. Shared with [`Watch::left`], which peeks at it
/// while hyper does not read (a request in flight).
pub struct ClientIo {
    stream: Arc<TcpStream>,
    watch: Arc<Watch>,
    /// hyper's own error head, rewritten: the bytes still to send, and how many of
    /// hyper's bytes they stand for.
    rewriting: Option<(Bytes, usize)>,
}

impl ClientIo {
    pub fn new(stream: Arc<TcpStream>, watch: Arc<Watch>) -> Self {
        Self {
            stream,
            watch,
            rewriting: None,
        }
    }

    /// Sends the rest of a rewritten head; Ready(n) once it is all out, n being the
    /// length of hyper's head it replaced.
    fn poll_rewritten(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        while let Some((rest, replaced)) = &mut self.rewriting {
            if rest.is_empty() {
                let replaced = *replaced;
                self.rewriting = None;
                return Poll::Ready(Ok(replaced));
            }
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write(rest) {
                Ok(n) => {
                    let _ = rest.split_to(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        Poll::Ready(Ok(0))
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            match self.stream.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    if n > 0 {
                        buf.advance(n);
                        self.watch.lock().last_data = Instant::now();
                    }
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.rewriting.is_none() {
            if let Some(answer) = rewrite_error_head(buf) {
                self.rewriting = Some((answer, buf.len()));
            }
        }
        if self.rewriting.is_some() {
            return self.poll_rewritten(cx);
        }
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                done => return Poll::Ready(done),
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let first = bufs.iter().find(|b| !b.is_empty());
        if self.rewriting.is_some() || first.is_some_and(|b| rewrite_error_head(b).is_some()) {
            return self.poll_write(cx, first.map_or(&[][..], |b| &b[..]));
        }
        loop {
            ready!(self.stream.poll_write_ready(cx))?;
            match self.stream.try_write_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                done => return Poll::Ready(done),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(())) // nothing is buffered here
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The socket closes when the connection's task ends and drops its last handle.
        Poll::Ready(Ok(()))
    }
}

/// When `head` is hyper's automatic answer to an unparsable request (a whole head, a
/// 400, 414 or 431, no body, no content type: every answer of the relay's own has one),
/// the same status with an OpenAI error body.
fn rewrite_error_head(head: &[u8]) -> Option<Bytes> {
    let (status, kind, message) = match head.get(..13)? {
        b"HTTP/1.1 400 " => (400, "BadRequestError", "malformed HTTP request".to_owned()),
        b"HTTP/1.1 414 " => (
            414,
            "URITooLong",
            "request target longer than 65534 bytes".to_owned(),
        ),
        b"HTTP/1.1 431 " => (
            431,
            "RequestHeaderFieldsTooLarge",
            format!(
                "request head larger than {MAX_HEAD_BYTES} bytes or with more than {MAX_HEADERS} header fields"
            ),
        ),
        _ => return None,
    };
    let text = std::str::from_utf8(head).ok()?;
    let lower = text.to_ascii_lowercase();
    if !lower.ends_with("\r\n\r\n")
        || lower.contains("content-type:")
        || !lower.contains(&format!("{}: 0\r\n", CONTENT_LENGTH.as_str()))
    {
        return None;
    }
    let status_line = &text[..text.find("\r\n")?];
    // (the messages above need no JSON escaping)
    let body = format!(
        r#"{{"error":{{"message":"{message}","type":"{kind}","param":null,"code":{status}}}}}"#
    );
    let answer = format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    Some(Bytes::from(answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_own_error_heads_get_a_json_body() {
        let head =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let answer = rewrite_error_head(head).expect("rewritten");
        let text = std::str::from_utf8(&answer).unwrap();
        assert!(text.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(text.contains("content-type: application/json\r\n"));
        assert!(text.contains(r#""code":431"#), "{text}");
        // answers of the relay's own carry a content type and are left alone
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n";
        assert!(rewrite_error_head(own).is_none());
        assert!(rewrite_error_head(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
    }
}
