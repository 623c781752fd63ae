//! One request: a hot one decided by the host and forwarded to an engine, or any other
//! proxied to the host's backend app.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::http::request::Parts;
use hyper::{HeaderMap, Method, Request, Response, StatusCode, Uri};

use crate::body::{error_response, full, mentions_usage, Body, EndReport, RelayStream};
use crate::server::State;
use crate::{Event, Header, Inbox, Outcome, Reply, RequestId, PEER_HEADER, PEER_KEY_HEADER};

pub async fn handle(
    request: Request<Incoming>,
    state: Arc<State>,
    peer: SocketAddr,
) -> Response<Body> {
    if request.method() == Method::POST && state.is_hot(request.uri().path()) {
        hot(request, state, peer).await
    } else {
        // Read whole first: a body cut short gets a 400 here, not a backend failure.
        let (parts, body) = request.into_parts();
        match crate::conn::read_whole(body, state.config.max_body_bytes).await {
            Ok(body) => to_backend(&state, parts, full(body), peer).await,
            Err(refused) => refused,
        }
    }
}

/// A hot request's body must arrive within this (a stalled client frees its slot).
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Forgets a request's pending reply when its handler is dropped (the client left).
struct Waiting<'a> {
    inbox: &'a Inbox,
    id: RequestId,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.inbox.forget(self.id);
    }
}

async fn hot(request: Request<Incoming>, state: Arc<State>, peer: SocketAddr) -> Response<Body> {
    let arrived = Instant::now();
    let (parts, body) = request.into_parts();
    let limit = state.config.max_body_bytes;
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_big(limit);
    }
    let read = tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, limit).collect());
    let body = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(err)) if err.is::<http_body_util::LengthLimitError>() => return too_big(limit),
        Ok(Err(err)) => {
            let message = format!("could not read the request body: {err}");
            return error_response(400, &message, "BadRequestError");
        }
        Err(_) => {
            let message = format!(
                "the request body did not arrive within {} s",
                BODY_TIMEOUT.as_secs()
            );
            return error_response(408, &message, "RequestTimeout");
        }
    };
    let inbox = &*state.inbox;
    let id = inbox.new_id();
    let _waiting = Waiting { inbox, id };
    let mut reply = inbox.expect_reply(id);
    inbox.push(Event::Request {
        id,
        path: parts.uri.path().to_owned(),
        headers: header_list(&parts.headers),
        body: body.clone(),
        waited: arrived.elapsed(),
        peer,
    });
    loop {
        let Ok(decided) = reply.await else {
            return error_response(
                503,
                "the gateway is shutting down",
                "ServiceUnavailableError",
            );
        };
        match decided {
            Reply::Respond {
                status,
                headers,
                body,
            } => return respond(status, &headers, body),
            Reply::Delegate => return to_backend(&state, parts, full(body), peer).await,
            Reply::Forward {
                url,
                headers,
                body,
                response_headers,
                first_byte_timeout,
            } => {
                // From here on the host expects one End, even if the client leaves
                // before the engine's answer starts (a whole answer can take minutes).
                let mut report = EndReport::new(id, Arc::clone(&state.inbox), arrived);
                let request_deadline =
                    tokio::time::Instant::from_std(arrived) + state.config.request_timeout;
                let first_byte_by =
                    (tokio::time::Instant::now() + first_byte_timeout).min(request_deadline);
                let started = forward(&state, &url, &headers, body, first_byte_by).await;
                let failure = match started {
                    Ok(answer) => match first_frame(answer, first_byte_by).await {
                        Ok(start) => {
                            return relay_answer(&state, report, arrived, start, &response_headers)
                                .await
                        }
                        Err(failure) => failure,
                    },
                    Err(failure) => failure,
                };
                report.disarm(); // the host hears this instead, and replies again
                reply = inbox.expect_reply(id);
                inbox.push(Event::UpstreamFailed {
                    id,
                    connect: failure.connect,
                    timed_out: failure.timed_out,
                    message: failure.message,
                });
            }
        }
    }
}

/// Why no answer started: nothing was sent to the client yet.
struct Failure {
    connect: bool,
    timed_out: bool,
    message: String,
}

impl Failure {
    fn other(message: String) -> Self {
        Self {
            connect: false,
            timed_out: false,
            message,
        }
    }

    fn timed_out(what: &str, by: tokio::time::Instant, sent: tokio::time::Instant) -> Self {
        Self {
            connect: false,
            timed_out: true,
            message: format!(
                "no {what} within {:.1} s (first byte timeout)",
                by.saturating_duration_since(sent).as_secs_f64()
            ),
        }
    }
}

/// An engine's answer once it started: its head, and for an SSE stream its first
/// body frame (a stream's head comes before the prefill, so only a frame shows the
/// engine is computing).
struct Started {
    parts: hyper::http::response::Parts,
    body: Incoming,
    streamed: bool,
    /// A stream's first data frame (None: the stream ended without one).
    first: Option<Bytes>,
}

/// Waits (until `by`) for a stream's first data frame; a whole answer starts with its head.
async fn first_frame(
    answer: Response<Incoming>,
    by: tokio::time::Instant,
) -> Result<Started, Failure> {
    let (parts, mut body) = answer.into_parts();
    let streamed = parts.status == StatusCode::OK
        && parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/event-stream"));
    let mut first = None;
    if streamed {
        let sent = tokio::time::Instant::now();
        loop {
            match tokio::time::timeout_at(by, body.frame()).await {
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        first = Some(data);
                        break;
                    } // trailers: keep waiting for data or the end
                }
                Ok(None) => break,
                Ok(Some(Err(err))) => return Err(Failure::other(describe(&err))),
                Err(_) => return Err(Failure::timed_out("first stream frame", by, sent)),
            }
        }
    }
    Ok(Started {
        parts,
        body,
        streamed,
        first,
    })
}

fn too_big(limit: usize) -> Response<Body> {
    let message = format!("request body larger than {limit} bytes");
    error_response(413, &message, "PayloadTooLarge")
}

fn header_list(headers: &HeaderMap) -> Vec<Header> {
    headers
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
        .collect()
}

fn respond(status: u16, headers: &[Header], body: Bytes) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() =
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    add_headers(response.headers_mut(), headers);
    response
}

fn add_headers(map: &mut HeaderMap, headers: &[Header]) {
    for (name, value) in headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            map.insert(name, value);
        }
    }
}

/// Sends the request; `Err` when no answer head came by `first_byte_by`.
async fn forward(
    state: &State,
    url: &str,
    headers: &[Header],
    body: Bytes,
    first_byte_by: tokio::time::Instant,
) -> Result<Response<Incoming>, Failure> {
    let uri: Uri = url
        .parse()
        .map_err(|e| Failure::other(format!("bad upstream url {url:?}: {e}")))?;
    let mut request = Request::post(uri)
        .body(full(body))
        .map_err(|e| Failure::other(e.to_string()))?;
    add_headers(request.headers_mut(), headers);
    let sent = tokio::time::Instant::now();
    match tokio::time::timeout_at(first_byte_by, state.client.request(request)).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(err)) => Err(Failure {
            connect: err.is_connect(),
            timed_out: false,
            message: describe(&err),
        }),
        Err(_) => Err(Failure::timed_out("answer head", first_byte_by, sent)),
    }
}

/// The error and its causes in one line ("client error (Connect): ... refused").
fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Reads a whole answer's body; each frame must come within `stall` of the last one.
async fn collect(
    body: &mut Incoming,
    stall: Duration,
    deadline: tokio::time::Instant,
) -> Result<Bytes, String> {
    let mut content = bytes::BytesMut::new();
    loop {
        let by = (tokio::time::Instant::now() + stall).min(deadline);
        match tokio::time::timeout_at(by, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    content.extend_from_slice(&data);
                }
            }
            Ok(None) => return Ok(content.freeze()),
            Ok(Some(Err(err))) => return Err(describe(&err)),
            Err(_) if by < deadline => {
                return Err(format!(
                    "no data for {:.1} s (stall timeout)",
                    stall.as_secs_f64()
                ))
            }
            Err(_) => return Err("request timeout".to_owned()),
        }
    }
}

async fn relay_answer(
    state: &State,
    mut report: EndReport,
    arrived: Instant,
    start: Started,
    extra: &[Header],
) -> Response<Body> {
    let Started {
        parts,
        mut body,
        streamed,
        first,
    } = start;
    let status = parts.status;
    let content_type = parts.headers.get(CONTENT_TYPE).cloned();
    report.status = status.as_u16();
    report.streamed = streamed;
    let deadline = tokio::time::Instant::from_std(arrived) + state.config.request_timeout;
    let stall = state.config.stall_timeout;
    let mut response = if streamed {
        let stream = RelayStream::new(body, first, deadline, stall, report);
        let mut response = Response::new(stream.boxed_unsync());
        response
            .headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        response
    } else {
        // Dropped here if the client leaves: `report` says so, the engine connection closes.
        match collect(&mut body, stall, deadline).await {
            Ok(content) => {
                report.first_byte();
                if status == StatusCode::OK && mentions_usage(&content) {
                    report.usage(content.clone());
                }
                report.finish(Outcome::Complete);
                let mut response = Response::new(full(content));
                *response.status_mut() = status;
                response
            }
            Err(message) => {
                report.status = 502;
                report.finish(Outcome::UpstreamFailed(message.clone()));
                let message = format!("engine failed mid-response: {message}");
                let mut response = error_response(502, &message, "APIError");
                // Which engine failed, as on every answer it gave.
                add_headers(response.headers_mut(), extra);
                return response;
            }
        }
    };
    let default_type = if streamed {
        "text/event-stream"
    } else {
        "application/json"
    };
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static(default_type)),
    );
    add_headers(headers, extra);
    response
}

/// Headers that belong to one connection, not to the message (RFC 9110, 7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Tells the backend app who the client is: the app's own peer is the relay. A client's
/// headers of these names are dropped first, so it cannot claim an address.
fn name_the_peer(headers: &mut HeaderMap, peer: SocketAddr, key: &str) {
    headers.remove(PEER_HEADER);
    headers.remove(PEER_KEY_HEADER);
    if let Ok(ip) = HeaderValue::from_str(&peer.ip().to_canonical().to_string()) {
        headers.insert(PEER_HEADER, ip);
    }
    if let Ok(key) = HeaderValue::from_str(key) {
        headers.insert(PEER_KEY_HEADER, key);
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

async fn to_backend(
    state: &State,
    mut parts: Parts,
    body: Body,
    peer: SocketAddr,
) -> Response<Body> {
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("http://{}{target}", state.config.backend).parse::<Uri>() else {
        return error_response(400, "invalid request target", "BadRequestError");
    };
    parts.uri = uri;
    strip_hop_by_hop(&mut parts.headers);
    name_the_peer(&mut parts.headers, peer, &state.config.backend_key);
    let request = Request::from_parts(parts, body);
    match state.client.request(request).await {
        Ok(answer) => {
            let (mut parts, body) = answer.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body.map_err(Into::into).boxed_unsync())
        }
        Err(err) => {
            let message = format!("the gateway's backend app failed: {}", describe(&err));
            error_response(502, &message, "APIError")
        }
    }
}
