//! The certificate chain, private key and client CA of `--tls-cert`,
//! `--tls-key` and `--tls-client-ca`, parsed from PEM and checked (the key
//! is the certificate's; the CA file holds a CA rustls can use), and made
//! into one rustls server configuration per listener ([`Configs`]): gRPC
//! (ALPN `h2`) and the admin address (ALPN `http/1.1`), with and without
//! client certificates. Errors name the flag (and the file, when read from
//! one), never the content; nothing here prints the key.

use std::sync::Arc;

use tokio_rustls::rustls::crypto::{ring, CryptoProvider};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::sign::{CertifiedKey, SingleCertAndKey};
use tokio_rustls::rustls::{Error as RustlsError, InconsistentKeys, RootCertStore, ServerConfig};

/// How the errors name each input: the flag, and its file when there is one.
pub(crate) struct Names {
    pub cert: String,
    pub key: String,
    pub client_ca: String,
}

impl Names {
    /// For PEM given in memory: the flags alone.
    pub fn flags() -> Self {
        Self { cert: "--tls-cert".into(), key: "--tls-key".into(), client_ca: "--tls-client-ca".into() }
    }
}

/// A checked certificate and key, and the client CA if any.
pub(crate) struct Material {
    certified: Arc<CertifiedKey>,
    client_roots: Option<Arc<RootCertStore>>,
}

/// The server configuration of each listener, built from one [`Material`].
#[derive(Clone)]
pub(crate) struct Configs {
    pub grpc: Arc<ServerConfig>,
    /// The admin address asking client certificates as gRPC does.
    pub admin_same: Arc<ServerConfig>,
    /// The admin address asking none.
    pub admin_no_client_cert: Arc<ServerConfig>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

impl Material {
    /// Parses and checks PEM text; `names` say what the errors call each
    /// input. The key's content never reaches an error.
    pub fn parse(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>, names: &Names) -> anyhow::Result<Self> {
        let chain = certificates(cert, &names.cert)?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|_| {
            anyhow::anyhow!("{} holds no PEM private key (PKCS#8, PKCS#1 or SEC1)", names.key)
        })?;
        let certified = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| match e {
            RustlsError::InconsistentKeys(InconsistentKeys::KeyMismatch) => {
                anyhow::anyhow!("{} is not the private key of {}", names.key, names.cert)
            }
            other => anyhow::anyhow!("{} and {} make no usable identity: {other}", names.cert, names.key),
        })?;
        let client_roots = match client_ca {
            None => None,
            Some(pem) => {
                let mut roots = RootCertStore::empty();
                for ca in certificates(pem, &names.client_ca)? {
                    roots.add(ca).map_err(|e| {
                        anyhow::anyhow!("{} holds a certificate that is no usable CA: {e}", names.client_ca)
                    })?;
                }
                Some(Arc::new(roots))
            }
        };
        Ok(Self { certified: Arc::new(certified), client_roots })
    }

    /// Whether clients must present a certificate (a client CA is set).
    pub fn mutual(&self) -> bool {
        self.client_roots.is_some()
    }

    /// The configurations of both listeners.
    pub fn configs(&self) -> anyhow::Result<Configs> {
        Ok(Configs {
            grpc: self.config(true, b"h2")?,
            admin_same: self.config(true, b"http/1.1")?,
            admin_no_client_cert: self.config(false, b"http/1.1")?,
        })
    }

    fn config(&self, client_auth: bool, alpn: &[u8]) -> anyhow::Result<Arc<ServerConfig>> {
        let builder =
            ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
        let builder = match (&self.client_roots, client_auth) {
            (Some(roots), true) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::clone(roots), provider()).build()?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config =
            builder.with_cert_resolver(Arc::new(SingleCertAndKey::from(Arc::clone(&self.certified))));
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(config))
    }
}

/// Every certificate of a PEM file; at least one.
fn certificates(pem: &[u8], name: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{name} is not a PEM certificate file: {e}"))?;
    if chain.is_empty() {
        anyhow::bail!("{name} holds no PEM certificate");
    }
    Ok(chain)
}
