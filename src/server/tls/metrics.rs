//! What the TLS door counts, exposed with the server's metrics on the admin
//! address: every handshake by listener and outcome (completed, failed,
//! timed out waiting for the ClientHello or for the rest, shed to make room
//! for newer ones), those shed at the listener's cap before they had
//! stalled, the handshakes in flight, and the certificate reloads by outcome. One set per [`super::ServerTls`], shared by its listeners.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// How a handshake ended (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Completed: the connection went to the server.
    Ok,
    /// Refused by rustls: not TLS, no common protocol, a client
    /// certificate missing or not signed by the client CA, and the like.
    Failed,
    /// No whole ClientHello within [`super::CLIENT_HELLO_TIMEOUT`].
    HelloTimeout,
    /// Not finished within [`super::HANDSHAKE_TIMEOUT`].
    Timeout,
    /// Dropped, the one longest without progress, when a new connection
    /// found [`super::MAX_HANDSHAKES`] in flight on its listener.
    ShedOldest,
    /// Dropped, the one of its peer longest without progress, when a new
    /// connection from the same peer (IPv4 address, IPv6 /64) found
    /// [`super::MAX_HANDSHAKES_PER_PEER`] of the peer's in flight.
    ShedPeer,
}

impl Outcome {
    const ALL: [Self; 6] =
        [Self::Ok, Self::Failed, Self::HelloTimeout, Self::Timeout, Self::ShedOldest, Self::ShedPeer];

    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Failed => "failed",
            Self::HelloTimeout => "hello_timeout",
            Self::Timeout => "timeout",
            Self::ShedOldest => "shed_oldest",
            Self::ShedPeer => "shed_peer",
        }
    }
}

/// The TLS metrics of one server.
pub struct TlsMetrics {
    registry: Registry,
    handshakes: Family<Labels, Counter>,
    in_flight: Family<Labels, Gauge>,
    shed_progressing: Family<Labels, Counter>,
    reloads: Family<Labels, Counter>,
}

impl std::fmt::Debug for TlsMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMetrics").finish_non_exhaustive()
    }
}

impl TlsMetrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("narsil");
        let (handshakes, in_flight, reloads) = (Family::default(), Family::default(), Family::default());
        let shed_progressing = Family::default();
        registry.register(
            "tls_handshakes",
            "TLS handshakes by listener (grpc, admin) and outcome (ok, failed, hello_timeout, timeout, \
             shed_oldest, shed_peer)",
            handshakes.clone(),
        );
        registry.register(
            "tls_handshakes_in_flight",
            "TLS handshakes accepted and not yet finished, by listener",
            in_flight.clone(),
        );
        registry.register(
            "tls_shed_progressing",
            "TLS handshakes shed at the listener's cap though they had progressed within the last \
             second, by listener: more connects than the cap holds for a real client's few round trips",
            shed_progressing.clone(),
        );
        registry.register(
            "tls_reloads",
            "Changes of the TLS files taken (ok) or refused, the previous certificate kept (failed)",
            reloads.clone(),
        );
        for outcome in ["ok", "failed"] {
            let _ = reloads.get_or_create(&vec![("outcome".into(), outcome.into())]);
        }
        Self { registry, handshakes, in_flight, shed_progressing, reloads }
    }

    fn handshake_labels(listener: &str, outcome: Outcome) -> Labels {
        vec![("listener".into(), listener.into()), ("outcome".into(), outcome.label().into())]
    }

    /// Makes `listener`'s series, at 0, so that each outcome is there to
    /// watch before it first happens.
    pub(crate) fn listener(&self, listener: &str) {
        for outcome in Outcome::ALL {
            let _ = self.handshakes.get_or_create(&Self::handshake_labels(listener, outcome));
        }
        self.in_flight(listener);
        let _ = self.shed_progressing.get_or_create(&Self::listener_labels(listener));
    }

    fn listener_labels(listener: &str) -> Labels {
        vec![("listener".into(), listener.into())]
    }

    /// Counts a handshake on `listener` shed at the listener's cap though it
    /// had not stalled.
    pub(crate) fn shed_progressing(&self, listener: &str) {
        self.shed_progressing.get_or_create(&Self::listener_labels(listener)).inc();
    }

    /// Counts a handshake on `listener` that ended as `outcome`.
    pub(crate) fn handshake(&self, listener: &str, outcome: Outcome) {
        self.handshakes.get_or_create(&Self::handshake_labels(listener, outcome)).inc();
    }

    /// The gauge of `listener`'s handshakes in flight.
    pub(crate) fn in_flight(&self, listener: &str) -> Gauge {
        self.in_flight.get_or_create(&Self::listener_labels(listener)).clone()
    }

    /// Counts a change of the files, taken if `ok`.
    pub(crate) fn reload(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "failed" };
        self.reloads.get_or_create(&vec![("outcome".into(), outcome.into())]).inc();
    }

    /// These metrics as OpenMetrics text.
    pub fn text(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}
