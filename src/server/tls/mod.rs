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
//! files are reloaded when the files change ([`reload`]), and each new
//! connection gets the configuration in service when it arrives. The key
//! is never printed (this type's `Debug` names only how TLS is set up).

pub mod accept;
mod material;
mod reload;

use std::path::Path;
use std::sync::Arc;

pub use self::accept::{TlsIncoming, HANDSHAKE_TIMEOUT};
pub use self::reload::CHECK_EVERY;
use tokio::net::TcpListener;

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
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.mutual)
            .field("admin", &self.admin)
            .field("reloads", &self.reloading.follows_files())
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
        Ok(Self {
            reloading: Arc::new(Reloading::fixed(configs)),
            mutual: material.mutual(),
            admin: AdminTls::Same,
        })
    }

    /// Reads the PEM files and checks them ([`Self::from_pem`]); errors
    /// name the flag and the file, never the content. The files are
    /// followed: new connections get their new content within about a
    /// second of a change ([`reload`]).
    pub fn read(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<Self> {
        let files = Files { cert: cert.into(), key: key.into(), client_ca: client_ca.map(Into::into) };
        let reloading = Reloading::follow(files).map_err(refused(client_ca.is_some()))?;
        Ok(Self { reloading: Arc::new(reloading), mutual: client_ca.is_some(), admin: AdminTls::Same })
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
        TlsIncoming::spawn(listener, Arc::clone(&self.reloading), |configs| Arc::clone(&configs.grpc))
    }

    /// The admin address's listener under [`Self::admin`]: TLS, or plain
    /// HTTP with [`AdminTls::Off`].
    pub fn admin_listener(&self, listener: TcpListener) -> std::io::Result<AdminListener> {
        let pick = match self.admin {
            AdminTls::Off => return Ok(AdminListener::Plain(listener)),
            AdminTls::Same => |configs: &Configs| Arc::clone(&configs.admin_same),
            AdminTls::NoClientCert => |configs: &Configs| Arc::clone(&configs.admin_no_client_cert),
        };
        TlsIncoming::spawn(listener, Arc::clone(&self.reloading), pick).map(AdminListener::Tls)
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
