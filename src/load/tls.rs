//! TLS for the clients `narsil load` and `narsil verify`: `--tls-ca` (the
//! CA that signed the server's certificate), `--tls-cert`/`--tls-key` (a
//! client certificate, for servers with mutual TLS) and `--tls-domain`
//! (the name to check the server's certificate against, instead of
//! `--addr`'s host). An `https://` address or any of these flags turns TLS
//! on; narsil carries no list of public CAs, so TLS needs `--tls-ca`.

use std::path::{Path, PathBuf};

use anyhow::Context;
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
