//! A TLS listener: one task accepts TCP connections, and each connection's
//! handshake runs in a task of its own (a slow or silent client holds no
//! one else up, and is dropped after [`HANDSHAKE_TIMEOUT`]; at most
//! [`MAX_HANDSHAKES`] at once, beyond which connections wait in the
//! kernel's backlog) with the
//! configuration in service when it arrived ([`super::reload`]); the
//! connections that complete their handshake are handed to the server, as
//! a stream (tonic's `serve_with_incoming`) or an [`axum::serve::Listener`].
//! Dropping it stops accepting and closes the socket.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::material::Configs;
use super::reload::Reloading;

/// How long a client has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at once, per listener: a flood of clients that
/// never finish theirs holds this many tasks, no more.
pub const MAX_HANDSHAKES: usize = 1024;

/// Connections handshaken but not yet taken by the server.
const READY_QUEUE: usize = 64;

/// Accepted TLS connections of one listener.
pub struct TlsIncoming {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl TlsIncoming {
    /// Accepts on `listener`, handshaking with the configuration `pick`
    /// chooses among those in service.
    pub(crate) fn spawn(
        listener: TcpListener,
        reloading: Arc<Reloading>,
        pick: fn(&Configs) -> Arc<ServerConfig>,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (handshaken, ready) = mpsc::channel(READY_QUEUE);
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let accepting = tokio::spawn(async move {
            loop {
                let Ok(permit) = Arc::clone(&handshakes).acquire_owned().await else { return };
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: pause, as hyper does.
                        tracing::debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = TlsAcceptor::from(pick(&reloading.current()));
                let handshaken = handshaken.clone();
                tokio::spawn(async move {
                    let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                    drop(permit);
                    match handshake {
                        Ok(Ok(stream)) => {
                            let _ = handshaken.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { ready, local, accepting })
    }
}

impl tokio_stream::Stream for TlsIncoming {
    type Item = std::io::Result<TlsStream<TcpStream>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.ready.poll_recv(cx).map(|next| next.map(|(stream, _)| Ok(stream)))
    }
}

impl axum::serve::Listener for TlsIncoming {
    type Io = TlsStream<TcpStream>;
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
