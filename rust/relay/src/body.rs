//! Response bodies: whole ones, OpenAI-shaped errors, and an engine's stream relayed
//! frame by frame while the host hears about its first byte, usage and end.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use tokio::time::Sleep;

use crate::{Event, Inbox, Outcome, RequestId};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// OpenAI's error shape, as the gateway's Python endpoints write it.
pub fn error_response(status: u16, message: &str, kind: &str) -> Response<Body> {
    let json = format!(
        r#"{{"error":{{"message":"{}","type":"{}","param":null,"code":{status}}}}}"#,
        json_escape(message),
        json_escape(kind)
    );
    let mut response = Response::new(full(json));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The SSE event a stream gets when its engine fails mid-way (the `openai` client raises
/// it as an APIError), instead of a silent truncation.
pub fn sse_error(message: &str) -> Bytes {
    Bytes::from(format!(
        "data: {{\"error\":{{\"message\":\"{}\",\"type\":\"UpstreamError\",\"code\":502}}}}\n\n",
        json_escape(message)
    ))
}

fn json_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

pub fn mentions_usage(chunk: &[u8]) -> bool {
    const NEEDLE: &[u8] = b"\"cached_tokens\"";
    chunk.windows(NEEDLE.len()).any(|w| w == NEEDLE)
}

/// Sends the one `Event::End` of a forwarded request: explicitly, or on drop (the
/// client went away while its answer was being read or relayed).
pub struct EndReport {
    id: RequestId,
    inbox: Arc<Inbox>,
    arrived: Instant,
    /// What the client got; 499 (nginx's "client closed request") until an answer starts.
    pub status: u16,
    pub streamed: bool,
    sent: bool,
}

impl EndReport {
    pub fn new(id: RequestId, inbox: Arc<Inbox>, arrived: Instant) -> Self {
        Self {
            id,
            inbox,
            arrived,
            status: 499,
            streamed: false,
            sent: false,
        }
    }

    /// No End after all (the exchange failed before its answer; the host hears that).
    pub fn disarm(&mut self) {
        self.sent = true;
    }

    pub fn first_byte(&self) {
        self.inbox.push(Event::FirstByte {
            id: self.id,
            elapsed: self.arrived.elapsed(),
        });
    }

    pub fn usage(&self, chunk: Bytes) {
        self.inbox.push(Event::Usage { id: self.id, chunk });
    }

    pub fn finish(&mut self, outcome: Outcome) {
        if std::mem::replace(&mut self.sent, true) {
            return;
        }
        self.inbox.push(Event::End {
            id: self.id,
            status: self.status,
            streamed: self.streamed,
            outcome,
            elapsed: self.arrived.elapsed(),
        });
    }
}

impl Drop for EndReport {
    fn drop(&mut self) {
        self.finish(Outcome::ClientLeft);
    }
}

/// An engine's SSE answer, relayed frame by frame. Dropping it before the end (the
/// client left) drops the engine connection. It fails with an SSE error event when the
/// whole exchange outlasts `deadline`, or when the engine sends nothing for `stall`.
pub struct RelayStream {
    upstream: Option<Incoming>,
    /// The first data frame, read before the answer's head was sent to the client.
    pending: Option<Bytes>,
    deadline: Pin<Box<Sleep>>,
    stall: Duration,
    /// Reset to `stall` from each frame.
    quiet: Pin<Box<Sleep>>,
    report: EndReport,
    first: bool,
}

impl RelayStream {
    pub fn new(
        upstream: Incoming,
        pending: Option<Bytes>,
        deadline: tokio::time::Instant,
        stall: Duration,
        report: EndReport,
    ) -> Self {
        Self {
            upstream: Some(upstream),
            pending,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            stall,
            quiet: Box::pin(tokio::time::sleep(stall)),
            report,
            first: true,
        }
    }

    fn fail(&mut self, message: String) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.upstream = None; // closes the engine connection
        let event = sse_error(&format!("upstream engine failed mid-stream: {message}"));
        self.report.finish(Outcome::UpstreamFailed(message));
        Poll::Ready(Some(Ok(Frame::data(event))))
    }

    fn relay(&mut self, data: Bytes) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.first {
            self.first = false;
            self.report.first_byte();
        }
        if mentions_usage(&data) {
            self.report.usage(data.clone());
        }
        let next = tokio::time::Instant::now() + self.stall;
        self.quiet.as_mut().reset(next);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }
}

impl hyper::body::Body for RelayStream {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(data) = this.pending.take() {
            return this.relay(data);
        }
        loop {
            let Some(upstream) = this.upstream.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: an SSE answer has none worth relaying
                    };
                    return this.relay(data);
                }
                Poll::Ready(Some(Err(err))) => return this.fail(err.to_string()),
                Poll::Ready(None) => {
                    this.upstream = None; // complete: the connection goes back to the pool
                    this.report.finish(Outcome::Complete);
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if this.deadline.as_mut().poll(cx).is_ready() {
                        return this.fail("request timeout".into());
                    }
                    if this.quiet.as_mut().poll(cx).is_ready() {
                        let stall = this.stall.as_secs_f64();
                        return this.fail(format!("no data for {stall:.1} s (stall timeout)"));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.upstream.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_valid_json_whatever_the_message() {
        let response = error_response(502, "engine \"a\\b\"\n\u{1} failed", "APIError");
        assert_eq!(response.status(), 502);
        let sse = sse_error("x\"y");
        assert!(sse.starts_with(b"data: {"));
        assert!(sse.ends_with(b"}}\n\n"));
        assert_eq!(json_escape("a\"b\\c\n\u{1}"), "a\\\"b\\\\c\\n\\u0001");
    }

    #[test]
    fn usage_is_spotted_anywhere_in_a_chunk() {
        assert!(mentions_usage(
            b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n"
        ));
        assert!(!mentions_usage(b"data: {\"choices\":[]}\n\n"));
        assert!(!mentions_usage(b""));
    }
}
