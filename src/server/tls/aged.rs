//! A maximum age for TLS connections, so that what the handshake checked
//! (the client CA of `--tls-client-ca`, the certificate served) is checked
//! again within a stated time: a connection older than its age is told to
//! go, and one that has not gone a grace period later is closed.
//!
//! On gRPC, tonic's `max_connection_age` tells the client (an HTTP/2
//! GOAWAY: the calls in flight finish, new ones go to a new connection,
//! and a client reconnects without failing a call); on the admin address
//! (HTTP/1.1) the connection reads end of file from its age on, so it
//! closes after the response it is writing, if any. Either way [`Aged`]
//! closes the connection at age + grace, whatever is in flight: reads and
//! writes fail from then on.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{sleep_until, Instant, Sleep};

/// `--tls-max-connection-age-secs`'s default: an hour.
pub const DEFAULT_MAX_CONNECTION_AGE: Duration = Duration::from_secs(3600);

/// `--tls-connection-age-grace-secs`'s default: 30 s.
pub const DEFAULT_CONNECTION_AGE_GRACE: Duration = Duration::from_secs(30);

/// The longest `--tls-max-connection-age-secs` and
/// `--tls-connection-age-grace-secs` take: 30 days.
pub const MAX_CONNECTION_AGE_SECS: u64 = 30 * 24 * 3600;

/// How long a TLS connection lives: told to go at `max`, closed at
/// `max + grace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionAge {
    pub max: Duration,
    pub grace: Duration,
}

impl Default for ConnectionAge {
    fn default() -> Self {
        Self { max: DEFAULT_MAX_CONNECTION_AGE, grace: DEFAULT_CONNECTION_AGE_GRACE }
    }
}

/// A connection that ends with its age: with `soft`, reads give end of
/// file from then on; from `hard`, reads and writes fail.
pub struct Aged<S> {
    inner: S,
    soft: Option<Pin<Box<Sleep>>>,
    hard: Option<Pin<Box<Sleep>>>,
}

impl<S> Aged<S> {
    /// `inner`, made at `born`, living as `age` says (none: forever); with
    /// `soft_close`, reads end at `age.max` (HTTP/1.1: the server closes
    /// the connection as a client that went away), else only at the hard
    /// close.
    pub fn new(inner: S, born: Instant, age: Option<ConnectionAge>, soft_close: bool) -> Self {
        // An age too far to tell (past the clock's range) is none.
        let at = |after: Option<Duration>| after.and_then(|after| born.checked_add(after));
        let soft = at(age.filter(|_| soft_close).map(|age| age.max));
        let hard = at(age.and_then(|age| age.max.checked_add(age.grace)));
        let sleep = |deadline: Instant| Box::pin(sleep_until(deadline));
        Self { inner, soft: soft.map(sleep), hard: hard.map(sleep) }
    }

    /// The connection underneath.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Whether the hard close is due; polling registers the wake-up.
    fn past(deadline: &mut Option<Pin<Box<Sleep>>>, cx: &mut Context<'_>) -> bool {
        deadline.as_mut().is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready())
    }
}

fn too_old() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "TLS connection past its maximum age and grace")
}

impl<S: AsyncRead + Unpin> AsyncRead for Aged<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if Self::past(&mut this.hard, cx) {
            return Poll::Ready(Err(too_old()));
        }
        if Self::past(&mut this.soft, cx) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Aged<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if Self::past(&mut this.hard, cx) {
            return Poll::Ready(Err(too_old()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if Self::past(&mut this.hard, cx) {
            return Poll::Ready(Err(too_old()));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Aged<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const AGE: ConnectionAge =
        ConnectionAge { max: Duration::from_millis(300), grace: Duration::from_millis(300) };

    #[tokio::test]
    async fn an_idle_http1_connection_reads_its_end_at_its_age_and_fails_after_the_grace() {
        let (server, mut client) = tokio::io::duplex(64);
        let mut aged = Aged::new(server, Instant::now(), Some(AGE), true);
        client.write_all(b"hi").await.unwrap();
        let mut two = [0u8; 2];
        aged.read_exact(&mut two).await.unwrap();
        let started = Instant::now();
        let mut rest = Vec::new();
        assert_eq!(aged.read_to_end(&mut rest).await.unwrap(), 0, "end of file at the age");
        assert!(started.elapsed() >= AGE.max - Duration::from_millis(50), "{:?}", started.elapsed());
        aged.write_all(b"the answer being written").await.unwrap();
        tokio::time::sleep(AGE.grace).await;
        assert_eq!(aged.write_all(b"late").await.unwrap_err().kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn a_grpc_connection_reads_on_through_the_grace_then_fails() {
        let (server, _client) = tokio::io::duplex(64);
        let mut aged = Aged::new(server, Instant::now(), Some(AGE), false);
        let started = Instant::now();
        let mut byte = [0u8; 1];
        assert_eq!(aged.read(&mut byte).await.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= AGE.max + AGE.grace, "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn without_an_age_a_connection_lives_on() {
        let (server, mut client) = tokio::io::duplex(64);
        let mut aged = Aged::new(server, Instant::now(), None, true);
        tokio::time::sleep(AGE.max + AGE.grace * 2).await;
        client.write_all(b"x").await.unwrap();
        let mut byte = [0u8; 1];
        aged.read_exact(&mut byte).await.unwrap();
        aged.write_all(b"y").await.unwrap();
    }
}
