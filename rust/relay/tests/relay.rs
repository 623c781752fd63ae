//! The relay end to end on 127.0.0.1: raw-socket clients and engines (so the bytes on
//! the wire are what the test says), a host thread answering the inbox.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use bytes::Bytes;
use quillcache_relay::{Event, Outcome, Relay, RelayConfig, Reply, RequestId, HALF_CLOSE_GRACE};

const HOT: &str = "/v1/completions";

fn relay(backend: SocketAddr, max_body_bytes: usize) -> Relay {
    relay_stalling_after(backend, max_body_bytes, Duration::from_secs(10))
}

fn relay_stalling_after(backend: SocketAddr, max_body_bytes: usize, stall: Duration) -> Relay {
    Relay::start(RelayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        backend,
        hot_paths: vec![HOT.into()],
        max_body_bytes,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(20),
        stall_timeout: stall,
        backend_key: "test-key".into(),
    })
    .unwrap()
}

/// Waits for the next event (the relay's thread pushes them).
fn next_event(relay: &Relay, pending: &mut Vec<Event>) -> Event {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if !pending.is_empty() {
            return pending.remove(0);
        }
        pending.extend(relay.inbox().take());
        assert!(Instant::now() < deadline, "no event from the relay");
        thread::sleep(Duration::from_millis(1));
    }
}

/// The id of the next event, which must be a request.
fn next_request(relay: &Relay, pending: &mut Vec<Event>) -> RequestId {
    match next_event(relay, pending) {
        Event::Request { id, .. } => id,
        other => panic!("expected a request, got {other:?}"),
    }
}

/// A client posting `{}` to a hot path, the events seen so far and its request's id.
fn hot_request(relay: &Relay) -> (TcpStream, Vec<Event>, RequestId) {
    let client = post(relay.local_addr(), HOT, "{}");
    let mut events = Vec::new();
    let id = next_request(relay, &mut events);
    (client, events, id)
}

fn post(addr: SocketAddr, path: &str, body: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-tenant-id: t1\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}

fn read_all(mut stream: TcpStream) -> String {
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text
}

/// Reads until `needle` has arrived; returns everything read.
fn read_until(reader: &mut BufReader<TcpStream>, needle: &str) -> String {
    let mut seen = String::new();
    while !seen.contains(needle) {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("connection closed before {needle:?}; got {seen:?}");
        }
        seen.push_str(&line);
    }
    seen
}

/// A one-connection engine on a raw socket: reads one request, then runs `script` on
/// the connection. Returns its address and the request it read.
fn engine(
    script: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> (SocketAddr, mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let _ = tx.send(read_request(&mut conn)); // (a test may ignore it)
        script(&mut conn);
    });
    (addr, rx)
}

fn read_request(conn: &mut TcpStream) -> String {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut head = String::new();
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    head + &String::from_utf8(body).unwrap()
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                        transfer-encoding: chunked\r\n\r\n";

fn chunk(conn: &mut TcpStream, data: &str) {
    write!(conn, "{:x}\r\n{data}\r\n", data.len()).unwrap();
    conn.flush().unwrap();
}

fn forward_to(engine: SocketAddr) -> Reply {
    forward_within(engine, Duration::from_secs(10))
}

fn forward_within(engine: SocketAddr, first_byte_timeout: Duration) -> Reply {
    Reply::Forward {
        url: format!("http://{engine}{HOT}"),
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from_static(b"{\"routed\":true}"),
        response_headers: vec![("x-quillcache-worker".into(), Bytes::from_static(b"7"))],
        first_byte_timeout,
    }
}

fn no_backend() -> SocketAddr {
    "127.0.0.1:9".parse().unwrap()
}

#[test]
fn a_stream_is_relayed_chunk_by_chunk_and_reported() {
    let (go_on, gate) = mpsc::channel::<()>();
    let (engine_addr, engine_saw) = engine(move |conn| {
        conn.write_all(SSE_HEAD.as_bytes()).unwrap();
        chunk(conn, "data: one\n\n");
        gate.recv().unwrap(); // the client has the first chunk before the second exists
        chunk(
            conn,
            "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n",
        );
        chunk(conn, "");
    });
    let relay = relay(no_backend(), 1 << 20);
    let client = post(relay.local_addr(), HOT, "{\"prompt\":\"hi\"}");
    let mut events = Vec::new();
    let Event::Request {
        id,
        path,
        headers,
        body,
        ..
    } = next_event(&relay, &mut events)
    else {
        panic!("expected a request first");
    };
    assert_eq!(path, HOT);
    assert_eq!(body, Bytes::from_static(b"{\"prompt\":\"hi\"}"));
    assert!(headers.contains(&("x-tenant-id".into(), Bytes::from_static(b"t1"))));
    assert!(relay.reply(id, forward_to(engine_addr)));
    assert!(
        !relay.reply(id, Reply::Delegate),
        "a request is answered once"
    );

    let mut reader = BufReader::new(client);
    let head = read_until(&mut reader, "data: one");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("x-quillcache-worker: 7"), "{head}");
    assert!(head.contains("cache-control: no-cache"), "{head}");
    go_on.send(()).unwrap();
    read_until(&mut reader, "cached_tokens");
    assert!(engine_saw.recv().unwrap().ends_with("{\"routed\":true}"));

    assert!(matches!(next_event(&relay, &mut events), Event::FirstByte { id: i, .. } if i == id));
    assert!(
        matches!(next_event(&relay, &mut events), Event::Usage { id: i, chunk } if i == id && chunk.ends_with(b"}}}\n\n"))
    );
    match next_event(&relay, &mut events) {
        Event::End {
            id: i,
            status,
            streamed,
            outcome,
            ..
        } => {
            assert_eq!(
                (i, status, streamed, outcome),
                (id, 200, true, Outcome::Complete)
            );
        }
        other => panic!("expected the end, got {other:?}"),
    }
}

#[test]
fn other_paths_are_proxied_to_the_backend_unchanged() {
    let (backend, backend_saw) = engine(|conn| {
        let body = "backend says hi";
        write!(
            conn,
            "HTTP/1.1 418 I'm a teapot\r\nx-from: backend\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let relay = relay(backend, 1 << 20);
    let mut client = TcpStream::connect(relay.local_addr()).unwrap();
    client
        .write_all(b"GET /admin/index?verbose=1 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\nconnection: close\r\n\r\n")
        .unwrap();
    let answer = read_all(client);
    assert!(answer.starts_with("HTTP/1.1 418"), "{answer}");
    assert!(answer.contains("x-from: backend"), "{answer}");
    assert!(answer.ends_with("backend says hi"), "{answer}");
    let seen = backend_saw.recv().unwrap();
    assert!(
        seen.starts_with("GET /admin/index?verbose=1 HTTP/1.1"),
        "{seen}"
    );
    assert!(seen.contains("authorization: Bearer k"), "{seen}");
    assert!(
        relay.inbox().take().is_empty(),
        "the host never hears of it"
    );
}

#[test]
fn the_backend_and_the_host_learn_the_clients_address_which_a_client_cannot_forge() {
    let (backend, backend_saw) = engine(|conn| {
        write!(conn, "HTTP/1.1 204 No Content\r\n\r\n").unwrap();
    });
    let relay = relay(backend, 1 << 20);
    // a client on another loopback address, claiming to be someone else
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&"127.0.0.3:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    socket.connect(&relay.local_addr().into()).unwrap();
    let mut client: TcpStream = socket.into();
    client
        .write_all(
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-quillcache-peer: 10.9.9.9\r\n\
              x-quillcache-relay-key: guessed\r\nconnection: close\r\n\r\n",
        )
        .unwrap();
    assert!(read_all(client).starts_with("HTTP/1.1 204"));
    let seen = backend_saw.recv().unwrap().to_ascii_lowercase();
    assert!(seen.contains("x-quillcache-peer: 127.0.0.3\r\n"), "{seen}");
    assert!(
        seen.contains("x-quillcache-relay-key: test-key\r\n"),
        "{seen}"
    );
    assert!(
        !seen.contains("10.9.9.9") && !seen.contains("guessed"),
        "{seen}"
    );

    let (_client, mut events) = (post(relay.local_addr(), HOT, "{}"), Vec::new());
    match next_event(&relay, &mut events) {
        Event::Request { peer, .. } => assert_eq!(peer.ip().to_string(), "127.0.0.1"),
        other => panic!("expected a request, got {other:?}"),
    }
}

#[test]
fn the_host_can_answer_itself_and_big_bodies_never_reach_it() {
    let relay = relay(no_backend(), 64);
    let (client, _, id) = hot_request(&relay);
    let error = Bytes::from_static(b"{\"error\":{\"message\":\"no key\"}}");
    relay.reply(
        id,
        Reply::Respond {
            status: 401,
            headers: vec![(
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            )],
            body: error,
        },
    );
    let answer = read_all(client);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(
        answer.ends_with("{\"error\":{\"message\":\"no key\"}}"),
        "{answer}"
    );

    let answer = read_all(post(relay.local_addr(), HOT, &"x".repeat(65)));
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("\"type\":\"PayloadTooLarge\""), "{answer}");
    thread::sleep(Duration::from_millis(50));
    assert!(relay.inbox().take().is_empty());
}

#[test]
fn a_failed_connect_is_reported_and_the_host_can_send_it_elsewhere() {
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap(); // closed now
    let (engine_addr, _) = engine(|conn| {
        let body = "{\"ok\":1}";
        write!(
            conn,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_to(dead));
    match next_event(&relay, &mut events) {
        Event::UpstreamFailed { id: i, connect, .. } => assert!(i == id && connect),
        other => panic!("expected a failed connect, got {other:?}"),
    }
    assert!(relay.reply(id, forward_to(engine_addr)));
    let answer = read_all(client);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("{\"ok\":1}"), "{answer}");
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::FirstByte { .. }
    ));
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::End {
            outcome: Outcome::Complete,
            streamed: false,
            status: 200,
            ..
        }
    ));
}

#[test]
fn an_engine_dying_mid_stream_gives_the_client_an_sse_error() {
    let (engine_addr, _) = engine(|conn| {
        conn.write_all(SSE_HEAD.as_bytes()).unwrap();
        chunk(conn, "data: one\n\n");
        // dropped without the last chunk
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_to(engine_addr));
    let answer = read_all(client);
    assert!(answer.contains("data: one"), "{answer}");
    assert!(answer.contains("\"type\":\"UpstreamError\""), "{answer}");
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::FirstByte { .. }
    ));
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::End {
            outcome: Outcome::UpstreamFailed(_),
            streamed: true,
            ..
        }
    ));
}

/// Whether the engine saw its connection close within a few seconds.
fn sees_close(conn: &mut TcpStream) -> bool {
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    matches!(conn.read(&mut buf), Ok(0) | Err(_)) && conn.read(&mut buf).map_or(true, |n| n == 0)
}

#[test]
fn a_client_leaving_mid_stream_closes_the_engine_connection() {
    let (closed_tx, closed) = mpsc::channel();
    let (engine_addr, _) = engine(move |conn| {
        conn.write_all(SSE_HEAD.as_bytes()).unwrap();
        chunk(conn, "data: one\n\n");
        closed_tx.send(sees_close(conn)).unwrap();
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_to(engine_addr));
    let mut reader = BufReader::new(client);
    read_until(&mut reader, "data: one");
    drop(reader);
    assert!(
        closed.recv().unwrap(),
        "the engine must see the client's leave"
    );
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::FirstByte { .. }
    ));
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::End {
            outcome: Outcome::ClientLeft,
            ..
        }
    ));
}

#[test]
fn a_client_leaving_before_a_whole_answer_closes_the_engine_connection() {
    let (closed_tx, closed) = mpsc::channel();
    let (engine_addr, _) = engine(move |conn| {
        closed_tx.send(sees_close(conn)).unwrap(); // computing; never answers
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_to(engine_addr));
    // (an end of input right behind the request would be a half-close)
    thread::sleep(HALF_CLOSE_GRACE + Duration::from_millis(100));
    drop(client);
    assert!(
        closed.recv().unwrap(),
        "the engine must see the client's leave"
    );
    match next_event(&relay, &mut events) {
        Event::End {
            outcome, status, ..
        } => assert_eq!((outcome, status), (Outcome::ClientLeft, 499)),
        other => panic!("expected the end, got {other:?}"),
    }
}

#[test]
fn a_half_closing_client_still_gets_its_answer() {
    let relay = relay(no_backend(), 1 << 20);
    let (client, _, id) = hot_request(&relay);
    client.shutdown(std::net::Shutdown::Write).unwrap();
    thread::sleep(Duration::from_millis(50)); // the relay sees the end of input first
    let answered = relay.reply(
        id,
        Reply::Respond {
            status: 200,
            headers: vec![],
            body: Bytes::from_static(b"done"),
        },
    );
    assert!(answered, "the relay must still wait for the answer");
    let text = read_all(client);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("done"),
        "{text}"
    );
}

#[test]
fn bad_http_gets_a_json_4xx() {
    let relay = relay(no_backend(), 1 << 20);
    for (request, status) in [
        ("OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n".to_owned(), "400"),
        ("GARBAGE\r\n\r\n".to_owned(), "400"),
        (
            format!("GET /{} HTTP/1.1\r\n\r\n", "u".repeat(70_000)),
            "414",
        ),
        (
            format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "h".repeat(200_000)),
            "431",
        ),
        (
            "POST /admin/x HTTP/1.1\r\ncontent-length: 100\r\n\r\n{".to_owned(),
            "400",
        ),
    ] {
        let mut client = TcpStream::connect(relay.local_addr()).unwrap();
        client.write_all(request.as_bytes()).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let text = read_all(client);
        assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
        assert!(text.contains("content-type: application/json"), "{text}");
        assert!(text.contains(r#"{"error":{"message":"#), "{text}");
    }
}

#[test]
fn a_client_leaving_before_the_decision_is_not_forwarded() {
    let relay = relay(no_backend(), 1 << 20);
    let (client, _, id) = hot_request(&relay);
    thread::sleep(HALF_CLOSE_GRACE + Duration::from_millis(100));
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(5);
    while relay.inbox().waiting() > 0 {
        assert!(
            Instant::now() < deadline,
            "the relay did not notice the client leave"
        );
        thread::sleep(Duration::from_millis(5));
    }
    assert!(!relay.reply(id, Reply::Delegate));
}

/// An engine that answers a whole JSON body at once.
fn answering_engine() -> SocketAddr {
    engine(|conn| {
        let body = "{\"ok\":1}";
        write!(
            conn,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    })
    .0
}

/// The host's retry after a hung engine: the client gets the other engine's answer.
fn expect_timeout_then_retry(relay: &Relay, client: TcpStream, events: &mut Vec<Event>, id: u64) {
    let started = Instant::now();
    match next_event(relay, events) {
        Event::UpstreamFailed {
            id: i,
            connect,
            timed_out,
            message,
        } => {
            assert!(i == id && timed_out && !connect, "{message}");
            assert!(message.contains("first byte timeout"), "{message}");
        }
        other => panic!("expected a first byte timeout, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(relay.reply(id, forward_to(answering_engine())));
    let answer = read_all(client);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("{\"ok\":1}"), "{answer}");
}

#[test]
fn an_engine_that_never_answers_times_out_before_the_client_got_anything() {
    let (hold, held) = mpsc::channel::<()>();
    let (engine_addr, _) = engine(move |_conn| {
        let _ = held.recv(); // hung: reads the request, never answers
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_within(engine_addr, Duration::from_millis(300)));
    expect_timeout_then_retry(&relay, client, &mut events, id);
    drop(hold);
}

#[test]
fn a_stream_whose_first_frame_never_comes_times_out_before_the_client_got_anything() {
    let (hold, held) = mpsc::channel::<()>();
    let (engine_addr, _) = engine(move |conn| {
        conn.write_all(SSE_HEAD.as_bytes()).unwrap(); // a stream's head comes at once
        let _ = held.recv(); // then the prefill never ends
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_within(engine_addr, Duration::from_millis(300)));
    expect_timeout_then_retry(&relay, client, &mut events, id);
    drop(hold);
}

#[test]
fn a_stream_that_stalls_ends_with_an_sse_error_after_the_stall_timeout() {
    let (hold, held) = mpsc::channel::<()>();
    let (engine_addr, _) = engine(move |conn| {
        conn.write_all(SSE_HEAD.as_bytes()).unwrap();
        chunk(conn, "data: one\n\n");
        let _ = held.recv(); // hung mid-stream
    });
    let relay = relay_stalling_after(no_backend(), 1 << 20, Duration::from_millis(300));
    let (client, mut events, id) = hot_request(&relay);
    let started = Instant::now();
    relay.reply(id, forward_to(engine_addr));
    let answer = read_all(client);
    let waited = started.elapsed();
    assert!(answer.contains("data: one"), "{answer}");
    assert!(answer.contains("stall timeout"), "{answer}");
    assert!(answer.contains("\"type\":\"UpstreamError\""), "{answer}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::FirstByte { .. }
    ));
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::End {
            outcome: Outcome::UpstreamFailed(_),
            streamed: true,
            ..
        }
    ));
    drop(hold);
}

#[test]
fn a_whole_answer_failing_mid_body_is_a_502_naming_the_engine() {
    let (engine_addr, _) = engine(|conn| {
        conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"par",
        )
        .unwrap();
        // dropped before the rest of the body
    });
    let relay = relay(no_backend(), 1 << 20);
    let (client, mut events, id) = hot_request(&relay);
    relay.reply(id, forward_to(engine_addr));
    let answer = read_all(client);
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(answer.contains("x-quillcache-worker: 7"), "{answer}");
    assert!(answer.contains("engine failed mid-response"), "{answer}");
    assert!(matches!(
        next_event(&relay, &mut events),
        Event::End {
            outcome: Outcome::UpstreamFailed(_),
            status: 502,
            ..
        }
    ));
}
