//! Accepting client connections and serving HTTP/1.1 on each.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::body::Body;
use crate::conn::{self, ClientIo, Watch};
use crate::{exchange, Inbox, RelayConfig};

pub struct State {
    pub config: RelayConfig,
    pub inbox: Arc<Inbox>,
    /// Engines and the backend app, pooled keep-alive connections.
    pub client: Client<HttpConnector, Body>,
}

impl State {
    pub fn new(config: RelayConfig, inbox: Arc<Inbox>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Self {
            config,
            inbox,
            client,
        }
    }

    pub fn is_hot(&self, path: &str) -> bool {
        self.config.hot_paths.iter().any(|p| p == path)
    }
}

pub async fn serve(listener: TcpListener, state: State, mut stop: oneshot::Receiver<()>) {
    let state = Arc::new(state);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stop => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(_) => {
                // Out of file descriptors or similar: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let stream = Arc::new(stream);
            let watch = Watch::new();
            let io = ClientIo::new(Arc::clone(&stream), Arc::clone(&watch));
            let service = service_fn({
                let watch = Arc::clone(&watch);
                move |request: Request<Incoming>| {
                    let state = Arc::clone(&state);
                    let watch = Arc::clone(&watch);
                    watch.started();
                    async move {
                        let response = match conn::refuse_target(request.uri().path()) {
                            Some(refused) => refused,
                            None => exchange::handle(request, state, peer).await,
                        };
                        Ok::<_, Infallible>(watch.answered(response))
                    }
                }
            });
            // A connection error (reset, malformed request line) only ends that connection.
            let serving = http1::Builder::new()
                .timer(TokioTimer::new())
                // A client that never finishes its head (slowloris) loses its connection.
                .header_read_timeout(Duration::from_secs(30))
                // A client may shut its sending side and still read its answer (`conn`).
                .half_close(true)
                .max_header_size(conn::MAX_HEAD_BYTES)
                .max_headers(conn::MAX_HEADERS)
                .serve_connection(TokioIo::new(io), service);
            // A client that leaves mid-request drops the connection, and with it the
            // request (so the engine stops).
            tokio::select! {
                _ = serving => {}
                _ = watch.left(&stream) => {}
            }
        });
    }
}
