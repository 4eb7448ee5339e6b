//! TLS on both listeners (`--tls-cert`, `--tls-key`, `--tls-client-ca`),
//! with rustls (ring): every protocol on `--addr` (narsil.v1, TorchRec's,
//! KServe v2, grpc.health, reflection) is served over TLS only, and so is
//! the admin address (`--metrics-addr`) unless `--metrics-tls` says
//! otherwise; a plaintext client fails. With a client CA, a client must
//! present a certificate signed by it (mutual TLS) or is refused at the
//! handshake.
//!
//! The handshakes are narsil's own ([`accept`]), not tonic's, so that the
//! configuration can change under a running server: certificates read from
//! files are reloaded when the files change ([`reload`], on a thread of its
//! own), and each new connection gets the configuration in service when it
//! arrives; so that a flood of connections that never finish theirs cannot
//! keep other clients out ([`in_flight`], [`shedding`]); and so that every connection
//! ends with its age ([`aged`]: `--tls-max-connection-age-secs`), after
//! which it is checked again against the files in service. What happens at
//! the door is counted ([`metrics`]). The key is never printed (this type's
//! `Debug` names only how TLS is set up).

pub mod accept;
pub mod aged;
pub mod in_flight;
mod material;
pub mod metrics;
mod reload;
mod shedding;

use std::path::Path;
use std::sync::Arc;

pub use self::accept::{TlsConnection, TlsIncoming, CLIENT_HELLO_TIMEOUT, HANDSHAKE_TIMEOUT};
pub use self::aged::ConnectionAge;
pub use self::in_flight::{MAX_HANDSHAKES, MAX_HANDSHAKES_PER_PEER};
pub use self::metrics::TlsMetrics;
pub use self::reload::CHECK_EVERY;
pub use self::shedding::STALLED_AFTER;
use tokio::net::TcpListener;
use tokio_rustls::rustls::ServerConfig;

use self::accept::Door;
use self::material::{Configs, Material, Names};
use self::reload::{Files, Reloading};

/// TLS on the admin address (`--metrics-tls`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AdminTls {
    /// As on --addr: the same certificate, and with --tls-client-ca the
    /// same client certificates required.
    #[default]
    Same,
    /// The same certificate, but no client certificate asked (for scrapers
    /// and probes that have none).
    NoClientCert,
    /// Plain HTTP.
    Off,
}

/// A checked TLS configuration for the server's listeners.
#[derive(Clone)]
pub struct ServerTls {
    reloading: Arc<Reloading>,
    /// Whether gRPC clients must present a certificate (`--tls-client-ca`).
    pub mutual: bool,
    admin: AdminTls,
    age: Option<ConnectionAge>,
    metrics: Arc<TlsMetrics>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.mutual)
            .field("admin", &self.admin)
            .field("reloads", &self.reloading.follows_files())
            .field("age", &self.age)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// From PEM text: the certificate chain, its private key and, for
    /// mutual TLS, the CA certificates client certificates must be signed
    /// by. Fails when they do not make a usable configuration (no
    /// certificate, a key that is not one, or one that does not fit). Never
    /// reloaded.
    pub fn from_pem(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> anyhow::Result<Self> {
        let material =
            Material::parse(cert, key, client_ca, &Names::flags()).map_err(refused(client_ca.is_some()))?;
        let configs = material.configs().map_err(refused(client_ca.is_some()))?;
        let metrics = Arc::new(TlsMetrics::new());
        Ok(Self::new(Reloading::fixed(configs, Arc::clone(&metrics)), material.mutual(), metrics))
    }

    /// Reads the PEM files and checks them ([`Self::from_pem`]); errors
    /// name the flag and the file, never the content. The files are
    /// followed: new connections get their new content within about a
    /// second of a change ([`reload`]).
    pub fn read(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<Self> {
        let files = Files { cert: cert.into(), key: key.into(), client_ca: client_ca.map(Into::into) };
        let metrics = Arc::new(TlsMetrics::new());
        let reloading =
            Reloading::follow(files, Arc::clone(&metrics)).map_err(refused(client_ca.is_some()))?;
        Ok(Self::new(reloading, client_ca.is_some(), metrics))
    }

    /// Both listeners as [`AdminTls::Same`], connections aged as
    /// [`ConnectionAge::default`] says.
    fn new(reloading: Arc<Reloading>, mutual: bool, metrics: Arc<TlsMetrics>) -> Self {
        Self { reloading, mutual, admin: AdminTls::Same, age: Some(ConnectionAge::default()), metrics }
    }

    /// How long connections live (`--tls-max-connection-age-secs`, with
    /// its grace); none: as long as their clients keep them.
    pub fn with_connection_age(mut self, age: Option<ConnectionAge>) -> Self {
        self.age = age;
        self
    }

    /// How long connections live.
    pub fn connection_age(&self) -> Option<ConnectionAge> {
        self.age
    }

    /// What the door counted: handshakes by outcome, reloads.
    pub fn metrics(&self) -> Arc<TlsMetrics> {
        Arc::clone(&self.metrics)
    }

    /// How the admin address serves (default: [`AdminTls::Same`]).
    pub fn with_admin(mut self, admin: AdminTls) -> Self {
        self.admin = admin;
        self
    }

    /// How the admin address serves.
    pub fn admin(&self) -> AdminTls {
        self.admin
    }

    /// What the `listening` log lines say of a listener: `mutual`, `on` or `off`.
    pub fn describe(&self, admin: bool) -> &'static str {
        match (admin, self.admin) {
            (true, AdminTls::Off) => "off",
            (true, AdminTls::NoClientCert) => "on",
            _ if self.mutual => "mutual",
            _ => "on",
        }
    }

    /// Serves gRPC's TLS on `listener`.
    pub fn grpc_incoming(&self, listener: TcpListener) -> std::io::Result<TlsIncoming> {
        // HTTP/2: tonic's `max_connection_age` sends the GOAWAY at the age.
        TlsIncoming::spawn(listener, self.door("grpc", |configs| Arc::clone(&configs.grpc), false))
    }

    fn door(&self, name: &'static str, pick: fn(&Configs) -> Arc<ServerConfig>, soft_close: bool) -> Door {
        let (reloading, metrics) = (Arc::clone(&self.reloading), Arc::clone(&self.metrics));
        Door { name, reloading, pick, metrics, age: self.age, soft_close }
    }

    /// The admin address's listener under [`Self::admin`]: TLS, or plain
    /// HTTP with [`AdminTls::Off`].
    pub fn admin_listener(&self, listener: TcpListener) -> std::io::Result<AdminListener> {
        let pick = match self.admin {
            AdminTls::Off => return Ok(AdminListener::Plain(listener)),
            AdminTls::Same => |configs: &Configs| Arc::clone(&configs.admin_same),
            AdminTls::NoClientCert => |configs: &Configs| Arc::clone(&configs.admin_no_client_cert),
        };
        TlsIncoming::spawn(listener, self.door("admin", pick, true)).map(AdminListener::Tls)
    }
}

/// The admin address's listener: plain HTTP or HTTPS.
pub enum AdminListener {
    Plain(TcpListener),
    Tls(TlsIncoming),
}

/// The error of a configuration that cannot serve, naming the flags.
fn refused(mutual: bool) -> impl Fn(anyhow::Error) -> anyhow::Error {
    move |e| {
        let flags =
            if mutual { "--tls-cert, --tls-key and --tls-client-ca" } else { "--tls-cert, --tls-key" };
        anyhow::anyhow!("cannot serve TLS with {flags}: {e:#}")
    }
}
