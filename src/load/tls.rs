//! TLS for the clients `narsil load`, `narsil verify` and `narsil tables
//! push-ids`: `--tls-ca` (the CA that signed the server's certificate),
//! `--tls-cert`/`--tls-key` (a client certificate, for servers with mutual
//! TLS) and `--tls-domain` (the name to check the server's certificate
//! against, instead of the address's host). An `https://` address or any
//! of these flags turns TLS on; narsil carries no list of public CAs, so
//! TLS needs `--tls-ca`. gRPC clients get a tonic endpoint
//! ([`ClientTlsArgs::endpoint`]), HTTP/1.1 clients a rustls configuration
//! ([`ClientTlsArgs::https`]).

use std::path::{Path, PathBuf};

use std::sync::Arc;

use anyhow::Context;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// The TLS flags of a client.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ClientTlsArgs {
    /// PEM CA certificate(s) the server's certificate must be signed by:
    /// speak TLS (also turned on by an `https://` address, which needs this).
    #[arg(long, env = "NARSIL_CLIENT_TLS_CA", value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate to present, for a server with mutual TLS
    /// (`narsil serve --tls-client-ca`); needs --tls-key.
    #[arg(long, env = "NARSIL_CLIENT_TLS_CERT", value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "NARSIL_CLIENT_TLS_KEY", value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The name the server's certificate must carry (and the name sent to
    /// it, SNI), instead of the address's host.
    #[arg(long, env = "NARSIL_CLIENT_TLS_DOMAIN", value_name = "NAME")]
    pub tls_domain: Option<String>,
}

impl ClientTlsArgs {
    /// Whether any TLS flag is given.
    fn any(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some() || self.tls_domain.is_some()
    }

    /// The endpoint of `addr` (the flag's value, `--addr`), speaking TLS if
    /// the address is `https://` or a TLS flag is given (an `http://`
    /// address then becomes `https://`). Files are read now; errors name
    /// the flag and the file.
    pub fn endpoint(&self, addr: &str) -> anyhow::Result<Endpoint> {
        let https = addr.starts_with("https://");
        let url = match addr.strip_prefix("http://") {
            Some(rest) if self.any() => format!("https://{rest}"),
            _ => addr.to_owned(),
        };
        let endpoint = Endpoint::from_shared(url).with_context(|| format!("bad --addr {addr}"))?;
        if !https && !self.any() {
            return Ok(endpoint);
        }
        let Some(ca) = &self.tls_ca else {
            anyhow::bail!(
                "--addr {addr} speaks TLS, which needs --tls-ca: the PEM certificate of the CA that signed \
                 the server's certificate (narsil has no built-in list of public CAs)"
            );
        };
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca, "--tls-ca")?));
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            config = config.identity(Identity::from_pem(read(cert, "--tls-cert")?, read(key, "--tls-key")?));
        }
        if let Some(domain) = &self.tls_domain {
            config = config.domain_name(domain.clone());
        }
        endpoint.tls_config(config).with_context(|| format!("cannot speak TLS to {addr}"))
    }
}

/// What an HTTP/1.1 client speaks TLS to a server with: its rustls
/// configuration and the name the server's certificate must carry.
#[derive(Clone)]
pub struct HttpsClient {
    /// The configuration (the CA, the client certificate, ALPN `http/1.1`).
    pub config: Arc<ClientConfig>,
    /// `--tls-domain`, or the address's host.
    pub name: ServerName<'static>,
}

impl ClientTlsArgs {
    /// How to speak TLS to `host` (of an address given as `flag`), if the
    /// address is `https://` (`https`) or a TLS flag is given; none for
    /// plain HTTP. Files are read now; errors name the flag and the file.
    pub fn https(
        &self,
        flag: &str,
        address: &str,
        host: &str,
        https: bool,
    ) -> anyhow::Result<Option<HttpsClient>> {
        if !https && !self.any() {
            return Ok(None);
        }
        let Some(ca) = &self.tls_ca else {
            anyhow::bail!(
                "{flag} {address} speaks TLS, which needs --tls-ca: the PEM certificate of the CA that signed \
                 the server's certificate (narsil has no built-in list of public CAs)"
            );
        };
        let mut roots = RootCertStore::empty();
        let pem = read(ca, "--tls-ca")?;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert =
                cert.map_err(|e| anyhow::anyhow!("--tls-ca {}: not PEM certificates: {e}", ca.display()))?;
            roots
                .add(cert)
                .with_context(|| format!("--tls-ca {}: a certificate rustls refuses", ca.display()))?;
        }
        if roots.is_empty() {
            anyhow::bail!("--tls-ca {} holds no certificate", ca.display());
        }
        let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .context("TLS client configuration")?
            .with_root_certificates(roots);
        let mut config = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let chain: Vec<CertificateDer<'static>> =
                    CertificateDer::pem_slice_iter(&read(cert, "--tls-cert")?)
                        .collect::<Result<_, _>>()
                        .map_err(|e| {
                            anyhow::anyhow!("--tls-cert {}: not PEM certificates: {e}", cert.display())
                        })?;
                let key_der = PrivateKeyDer::from_pem_slice(&read(key, "--tls-key")?).map_err(|e| {
                    anyhow::anyhow!("--tls-key {}: not a PEM private key: {e}", key.display())
                })?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .context("--tls-cert and --tls-key do not go together")?
            }
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let name = self.tls_domain.as_deref().unwrap_or(host).trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(name.to_owned()).map_err(|e| {
            anyhow::anyhow!("{name:?} is not a name a certificate can carry (--tls-domain): {e}")
        })?;
        Ok(Some(HttpsClient { config: Arc::new(config), name }))
    }
}

/// An error and its causes, each once: tonic's own message is "transport
/// error", and the reason (a TLS handshake refused, a certificate not valid
/// for the name) is among its causes, some repeated.
pub fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut said: Vec<String> = Vec::new();
    for cause in std::iter::successors(Some(error), |e| e.source()) {
        let text = cause.to_string();
        if !said.iter().any(|earlier| earlier.contains(&text)) {
            said.push(text);
        }
    }
    said.join(": ")
}

fn read(path: &Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_addresses_stay_plain_and_https_without_a_ca_is_refused_naming_the_flag() {
        let none = ClientTlsArgs::default();
        assert_eq!(none.endpoint("http://127.0.0.1:1").unwrap().uri().scheme_str(), Some("http"));
        let err = none.endpoint("https://127.0.0.1:1").unwrap_err();
        assert!(err.to_string().contains("needs --tls-ca"), "{err}");
        let domain_only = ClientTlsArgs { tls_domain: Some("narsil".into()), ..Default::default() };
        assert!(domain_only
            .endpoint("http://127.0.0.1:1")
            .unwrap_err()
            .to_string()
            .contains("needs --tls-ca"));
    }

    #[test]
    fn causes_are_said_once_each_outermost_first() {
        #[derive(Debug)]
        struct Chain(&'static str, Option<Box<Chain>>);
        impl std::fmt::Display for Chain {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Chain {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
            }
        }
        let why = "invalid peer certificate: UnknownIssuer";
        let error = Chain("transport error", Some(Box::new(Chain(why, Some(Box::new(Chain(why, None)))))));
        assert_eq!(causes(&error), format!("transport error: {why}"));
    }

    #[test]
    fn a_ca_turns_an_http_address_into_https_and_a_missing_file_is_named() {
        let ca = tempfile::NamedTempFile::new().unwrap();
        let args = ClientTlsArgs { tls_ca: Some(ca.path().into()), ..Default::default() };
        assert_eq!(args.endpoint("http://127.0.0.1:1").unwrap().uri().scheme_str(), Some("https"));
        let missing = ClientTlsArgs { tls_ca: Some("/nonexistent/ca.pem".into()), ..Default::default() };
        let err = missing.endpoint("https://127.0.0.1:1").unwrap_err();
        assert!(err.to_string().contains("cannot read --tls-ca /nonexistent/ca.pem"), "{err}");
    }
}
