//! `Relay`: the gateway's Rust data path (`quillcache-relay`), driven from asyncio.
//! Events come out as tuples (see `_native.pyi`); replies go in by request id.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use quillcache_relay::{Event, Header, Outcome, Relay, RelayConfig, Reply, RequestId};

#[pyclass(module = "quillcache._native", name = "Relay", frozen)]
pub struct PyRelay {
    relay: Relay,
}

/// Header names and `bytes` values (copied once into the relay's buffers).
type PyHeaders = Vec<(String, PyBackedBytes)>;

fn headers(list: PyHeaders) -> Vec<Header> {
    list.into_iter()
        .map(|(k, v)| (k, Bytes::copy_from_slice(&v)))
        .collect()
}

fn address(host: &str, port: u16) -> PyResult<SocketAddr> {
    let ip: IpAddr = host
        .parse()
        .map_err(|_| PyValueError::new_err(format!("not an IP address: {host:?}")))?;
    Ok(SocketAddr::new(ip, port))
}

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| PyValueError::new_err(format!("{what} must be a positive number of seconds")))
}

#[pymethods]
impl PyRelay {
    #[new]
    #[pyo3(signature = (host, port, backend_port, hot_paths, *, max_body_bytes, connect_timeout_s, request_timeout_s, stall_timeout_s, backend_key))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: &str,
        port: u16,
        backend_port: u16,
        hot_paths: Vec<String>,
        max_body_bytes: usize,
        connect_timeout_s: f64,
        request_timeout_s: f64,
        stall_timeout_s: f64,
        backend_key: String,
    ) -> PyResult<Self> {
        let config = RelayConfig {
            listen: address(host, port)?,
            backend: SocketAddr::from(([127, 0, 0, 1], backend_port)),
            hot_paths,
            max_body_bytes,
            connect_timeout: seconds(connect_timeout_s, "connect_timeout_s")?,
            request_timeout: seconds(request_timeout_s, "request_timeout_s")?,
            stall_timeout: seconds(stall_timeout_s, "stall_timeout_s")?,
            backend_key,
        };
        let relay = py.detach(|| Relay::start(config)).map_err(|e| {
            PyOSError::new_err(format!("cannot start the relay on {host}:{port}: {e}"))
        })?;
        Ok(Self { relay })
    }

    #[getter]
    fn port(&self) -> u16 {
        self.relay.local_addr().port()
    }

    /// Readable when `take` has events.
    fn fileno(&self) -> i32 {
        self.relay.inbox().fd()
    }

    /// Every event so far, oldest first.
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let bytes = |b: &Bytes| PyBytes::new(py, b);
        self.relay
            .inbox()
            .take()
            .into_iter()
            .map(|event| match event {
                Event::Request {
                    id,
                    path,
                    headers,
                    body,
                    waited,
                    peer,
                } => {
                    let headers: Vec<_> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), bytes(v)))
                        .collect();
                    (
                        "request",
                        id,
                        path,
                        headers,
                        bytes(&body),
                        waited.as_secs_f64(),
                        peer.ip().to_canonical().to_string(),
                    )
                        .into_pyobject(py)
                        .map(|t| t.into_any())
                }
                Event::UpstreamFailed {
                    id,
                    connect,
                    timed_out,
                    message,
                } => ("upstream_failed", id, connect, message, timed_out)
                    .into_pyobject(py)
                    .map(|t| t.into_any()),
                Event::FirstByte { id, elapsed } => ("first_byte", id, elapsed.as_secs_f64())
                    .into_pyobject(py)
                    .map(|t| t.into_any()),
                Event::Usage { id, chunk } => ("usage", id, bytes(&chunk))
                    .into_pyobject(py)
                    .map(|t| t.into_any()),
                Event::End {
                    id,
                    status,
                    streamed,
                    outcome,
                    elapsed,
                } => {
                    let (outcome, detail) = match outcome {
                        Outcome::Complete => ("complete", String::new()),
                        Outcome::UpstreamFailed(message) => ("upstream_failed", message),
                        Outcome::ClientLeft => ("client_left", String::new()),
                    };
                    (
                        "end",
                        id,
                        status,
                        streamed,
                        outcome,
                        detail,
                        elapsed.as_secs_f64(),
                    )
                        .into_pyobject(py)
                        .map(|t| t.into_any())
                }
            })
            .collect()
    }

    /// Send the request to `url` and relay the answer; False if nobody waits for it.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        id: RequestId,
        url: String,
        headers: PyHeaders,
        body: &[u8],
        response_headers: PyHeaders,
        first_byte_timeout_s: f64,
    ) -> PyResult<bool> {
        let reply = Reply::Forward {
            url,
            headers: self::headers(headers),
            body: Bytes::copy_from_slice(body),
            response_headers: self::headers(response_headers),
            first_byte_timeout: seconds(first_byte_timeout_s, "first_byte_timeout_s")?,
        };
        // Waking the relay's parked thread is a syscall, slow enough that other Python
        // threads should run meanwhile.
        Ok(py.detach(|| self.relay.reply(id, reply)))
    }

    /// Answer the client directly; False if nobody waits for it.
    fn respond(
        &self,
        py: Python<'_>,
        id: RequestId,
        status: u16,
        headers: PyHeaders,
        body: &[u8],
    ) -> bool {
        let reply = Reply::Respond {
            status,
            headers: self::headers(headers),
            body: Bytes::copy_from_slice(body),
        };
        py.detach(|| self.relay.reply(id, reply))
    }

    /// Let the backend app serve it; False if nobody waits for it.
    fn delegate(&self, py: Python<'_>, id: RequestId) -> bool {
        py.detach(|| self.relay.reply(id, Reply::Delegate))
    }

    /// Stop accepting and close every connection.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.relay.stop());
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRelay>()
}
