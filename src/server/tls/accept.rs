//! A TLS listener: one task accepts TCP connections, always, and each
//! connection's handshake runs in a task of its own, so a slow or silent
//! client holds no one else up. A client has [`CLIENT_HELLO_TIMEOUT`] to
//! send its whole ClientHello and [`HANDSHAKE_TIMEOUT`] (from the accept)
//! to finish; the handshakes in flight are bounded by shedding those that
//! have gone longest without progress ([`super::in_flight`]), never by
//! leaving new connections in the kernel's backlog. Each handshake gets
//! the configuration in service when
//! its ClientHello arrived ([`super::reload`]: no file is read here); the
//! connections that complete theirs are handed to the server with their
//! maximum age ([`super::aged`]), as a stream (tonic's
//! `serve_with_incoming`) or an [`axum::serve::Listener`]. Every
//! handshake's outcome is counted ([`super::metrics`]). Dropping it stops
//! accepting and closes the socket.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};
use tokio_rustls::rustls::server::Acceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::LazyConfigAcceptor;

use super::aged::{Aged, ConnectionAge};
use super::in_flight::{InFlight, Place, Ticket};
use super::material::Configs;
use super::metrics::{Outcome, TlsMetrics};
use super::reload::Reloading;
use super::shedding::Cap;

/// How long a client has, from the accept, to send its whole ClientHello.
pub const CLIENT_HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a client has, from the accept, to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections handshaken but not yet taken by the server.
const READY_QUEUE: usize = 64;

/// A connection that completed its handshake, ending with its age.
pub type TlsConnection = Aged<TlsStream<TcpStream>>;

/// What one TLS listener serves with.
pub(crate) struct Door {
    /// The listener's name in the metrics: `grpc` or `admin`.
    pub name: &'static str,
    pub reloading: Arc<Reloading>,
    /// This listener's configuration among those in service.
    pub pick: fn(&Configs) -> Arc<ServerConfig>,
    pub metrics: Arc<TlsMetrics>,
    pub age: Option<ConnectionAge>,
    /// Whether reads end at the age (HTTP/1.1, which has no GOAWAY).
    pub soft_close: bool,
}

/// Accepted TLS connections of one listener.
pub struct TlsIncoming {
    ready: mpsc::Receiver<(TlsConnection, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl TlsIncoming {
    /// Accepts on `listener` and handshakes as `door` says.
    pub(crate) fn spawn(listener: TcpListener, door: Door) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (handshaken, ready) = mpsc::channel(READY_QUEUE);
        door.metrics.listener(door.name);
        let in_flight = InFlight::new(door.metrics.in_flight(door.name));
        let door = Arc::new(door);
        let accepting = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: pause, as hyper does.
                        tracing::debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let accepted = Instant::now();
                let _ = tcp.set_nodelay(true);
                let (ticket, shed) = in_flight.admit(peer.ip(), accepted.into_std());
                for shed in shed {
                    let outcome = match shed.cap {
                        Cap::Listener => Outcome::ShedOldest,
                        Cap::Peer => Outcome::ShedPeer,
                    };
                    door.metrics.handshake(door.name, outcome);
                    // Past the listener's cap, anyone's: past a peer's, only its own.
                    if shed.cap == Cap::Listener && !shed.stalled {
                        door.metrics.shed_progressing(door.name);
                    }
                    tracing::debug!(
                        listener = door.name,
                        ?outcome,
                        stalled = shed.stalled,
                        "TLS handshake shed for a newer one"
                    );
                }
                let (door, handshaken) = (Arc::clone(&door), handshaken.clone());
                tokio::spawn(async move {
                    let Some(stream) = door.admit(tcp, peer, accepted, ticket).await else { return };
                    let _ = handshaken.send((stream, peer)).await;
                });
            }
        });
        Ok(Self { ready, local, accepting })
    }
}

impl Door {
    /// The connection once handshaken, unless it was shed, failed or ran
    /// out of time (each counted).
    async fn admit(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
        accepted: Instant,
        ticket: Ticket,
    ) -> Option<TlsConnection> {
        let Ticket { place, mut shed } = ticket;
        let outcome = tokio::select! {
            // Counted by the admission that shed it.
            _ = &mut shed => return None,
            outcome = self.handshake(tcp, accepted, &place) => outcome,
        };
        drop(place);
        match outcome {
            Ok(stream) => {
                self.metrics.handshake(self.name, Outcome::Ok);
                Some(Aged::new(stream, accepted, self.age, self.soft_close))
            }
            Err((outcome, why)) => {
                self.metrics.handshake(self.name, outcome);
                tracing::debug!(%peer, listener = self.name, ?outcome, why, "TLS handshake did not complete");
                None
            }
        }
    }

    async fn handshake(
        &self,
        tcp: TcpStream,
        accepted: Instant,
        place: &Place,
    ) -> Result<TlsStream<TcpStream>, (Outcome, String)> {
        let failed = |e: std::io::Error| (Outcome::Failed, e.to_string());
        let hello = LazyConfigAcceptor::new(Acceptor::default(), tcp);
        let start = match timeout_at(accepted + CLIENT_HELLO_TIMEOUT, hello).await {
            Ok(started) => started.map_err(failed)?,
            Err(_) => return Err((Outcome::HelloTimeout, "no ClientHello in time".into())),
        };
        place.hello_received(std::time::Instant::now());
        let config = (self.pick)(&self.reloading.current());
        match timeout_at(accepted + HANDSHAKE_TIMEOUT, start.into_stream(config)).await {
            Ok(stream) => stream.map_err(failed),
            Err(_) => Err((Outcome::Timeout, "handshake not finished in time".into())),
        }
    }
}

impl tokio_stream::Stream for TlsIncoming {
    type Item = std::io::Result<TlsConnection>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.ready.poll_recv(cx).map(|next| next.map(|(stream, _)| Ok(stream)))
    }
}

impl axum::serve::Listener for TlsIncoming {
    type Io = TlsConnection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(next) => next,
            // The accepting task holds the sender until this is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
