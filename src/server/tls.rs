//! TLS on the gRPC listener (`--tls-cert`, `--tls-key`, `--tls-client-ca`),
//! through tonic's rustls support (ring): every protocol on `--addr`
//! (narsil.v1, TorchRec's, KServe v2, grpc.health, reflection) is then
//! served over TLS only, and a plaintext client fails. With a client CA,
//! a client must present a certificate signed by it (mutual TLS) or is
//! refused at the handshake. The files are read once, at start; the key is
//! never printed (tonic's configuration prints as `ServerTlsConfig`, and
//! this type's `Debug` names only whether TLS is mutual).

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A checked TLS configuration for the gRPC listener.
#[derive(Clone)]
pub struct GrpcTls {
    pub(crate) config: ServerTlsConfig,
    /// Whether clients must present a certificate (`--tls-client-ca`).
    pub mutual: bool,
}

impl std::fmt::Debug for GrpcTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcTls").field("mutual", &self.mutual).finish_non_exhaustive()
    }
}

impl GrpcTls {
    /// From PEM text: the certificate chain, its private key and, for
    /// mutual TLS, the CA certificates client certificates must be signed
    /// by. Fails when they do not make a usable configuration (no
    /// certificate, a key that is not one, or one that does not fit).
    pub fn from_pem(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> anyhow::Result<Self> {
        let mut config =
            ServerTlsConfig::new().identity(Identity::from_pem(cert, key)).timeout(HANDSHAKE_TIMEOUT);
        if let Some(ca) = client_ca {
            config = config.client_ca_root(Certificate::from_pem(ca));
        }
        tonic::transport::Server::builder().tls_config(config.clone()).map_err(|e| {
            anyhow::anyhow!(
                "cannot serve TLS with --tls-cert, --tls-key{}: {e}",
                if client_ca.is_some() { " and --tls-client-ca" } else { "" }
            )
        })?;
        Ok(Self { config, mutual: client_ca.is_some() })
    }

    /// Reads the PEM files and checks them ([`Self::from_pem`]); errors
    /// name the flag and the file, never the content.
    pub fn read(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<Self> {
        let read = |path: &Path, flag: &str| {
            std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
        };
        let ca = client_ca.map(|path| read(path, "--tls-client-ca")).transpose()?;
        Self::from_pem(&read(cert, "--tls-cert")?, &read(key, "--tls-key")?, ca.as_deref())
    }
}
