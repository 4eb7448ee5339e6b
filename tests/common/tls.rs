//! TLS for the end-to-end tests: a CA and the certificates it signs, made
//! in the test (rcgen), written to files for `narsil serve`; tonic's client
//! configuration trusting a CA; and a small HTTPS/TLS client over
//! tokio-rustls that returns the status and body of one HTTP/1.1 call, or
//! the certificate a server presents.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use narsil::proto::predictor_client::PredictorClient;
use narsil::server::tls::ServerTls;
use narsil::server::{Listen, Server};
use narsil_core::mock::{MockConfig, MockFactory};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// A CA, which signs certificates.
pub struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM, and the certificate as DER.
pub struct Leaf {
    pub cert: String,
    pub key: String,
    pub der: Vec<u8>,
}

impl Authority {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Self { issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate for `names` (DNS names or IP addresses).
    pub fn sign(&self, names: &[&str]) -> Leaf {
        self.sign_named(names, "narsil")
    }

    /// A certificate for `names` with `common_name` as its subject.
    pub fn sign_named(&self, names: &[&str], common_name: &str) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, common_name);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf { cert: cert.pem(), key: key.serialize_pem(), der: cert.der().to_vec() }
    }

    /// tonic's client configuration trusting this CA, for `localhost`.
    pub fn trusted_by_client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(self.pem())).domain_name("localhost")
    }
}

impl Leaf {
    /// tonic's client identity.
    pub fn identity(&self) -> Identity {
        Identity::from_pem(&self.cert, &self.key)
    }

    /// Writes the certificate and key to `cert` and `key`, each through a
    /// temporary file renamed into place (as a certificate renewal does).
    pub fn install(&self, cert: &Path, key: &Path) {
        for (path, text) in [(key, &self.key), (cert, &self.cert)] {
            let staging = path.with_extension("staging");
            std::fs::write(&staging, text).unwrap();
            std::fs::rename(&staging, path).unwrap();
        }
    }
}

/// The files of a server's TLS: `tls.crt`, `tls.key` and `clients-ca.crt`
/// in a temporary directory.
pub struct TlsFiles {
    pub dir: tempfile::TempDir,
}

impl TlsFiles {
    pub fn new(leaf: &Leaf) -> Self {
        let files = Self { dir: tempfile::tempdir().unwrap() };
        leaf.install(&files.cert(), &files.key());
        files
    }

    pub fn cert(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    pub fn key(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    pub fn client_ca(&self) -> PathBuf {
        self.dir.path().join("clients-ca.crt")
    }

    /// Writes `pem` to a file of the directory; its path.
    pub fn write(&self, name: &str, pem: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path
    }
}

impl TlsFiles {
    /// `narsil serve`'s flags for these files: `--tls-cert`, `--tls-key`
    /// and, if `mutual`, `--tls-client-ca`.
    pub fn serve_args(&self, mutual: bool) -> Vec<OsString> {
        let mut args: Vec<OsString> =
            vec!["--tls-cert".into(), self.cert().into(), "--tls-key".into(), self.key().into()];
        if mutual {
            args.extend(["--tls-client-ca".into(), self.client_ca().into()]);
        }
        args
    }
}

/// Waits until the server at `grpc` reports SERVING on grpc.health to a
/// client with `tls`; a channel to it.
pub async fn wait_serving(grpc: SocketAddr, tls: ClientTlsConfig, timeout: Duration) -> Channel {
    super::poll_until("SERVING over TLS", timeout, || {
        let endpoint =
            Channel::from_shared(format!("https://{grpc}")).unwrap().tls_config(tls.clone()).unwrap();
        async move {
            let channel = endpoint.connect().await.ok()?;
            (super::health_status(channel.clone()).await.ok() == Some(1)).then_some(channel)
        }
    })
    .await
}

/// One Predict of 2 samples over a fresh gRPC connection to `addr` with
/// `tls`: the scores' count, or why there is none.
pub async fn predict(addr: SocketAddr, tls: ClientTlsConfig) -> Result<usize, String> {
    let endpoint = Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap();
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let response = PredictorClient::new(channel).predict(super::request(1, 2)).await;
    response.map(|r| r.into_inner().scores.len()).map_err(|s| format!("{s:?}"))
}

/// The mock backend's server in the test's runtime over `tls`.
pub struct MockTlsServer {
    pub grpc: SocketAddr,
    /// The admin address, if it was asked for.
    pub metrics: Option<SocketAddr>,
    running: super::Running,
}

impl MockTlsServer {
    /// Starts it, with the admin address too if `admin`.
    pub async fn start(tls: ServerTls, admin: bool) -> Self {
        Self::start_slow(tls, admin, Duration::ZERO).await
    }

    /// [`Self::start`] with `latency` per forward.
    pub async fn start_slow(tls: ServerTls, admin: bool, latency: Duration) -> Self {
        Self::start_listening(tls, super::listen(admin), latency).await
    }

    /// [`Self::start`] with gRPC on `grpc` (`[::1]:0`, say) and the admin
    /// address on 127.0.0.1.
    pub async fn start_on(tls: ServerTls, grpc: SocketAddr) -> Self {
        let listen = Listen { addr: grpc, ..super::listen(true) };
        Self::start_listening(tls, listen, Duration::ZERO).await
    }

    async fn start_listening(tls: ServerTls, listen: Listen, latency: Duration) -> Self {
        let factory =
            Arc::new(MockFactory::new(super::schema(), MockConfig { latency, per_row: Duration::ZERO }));
        let server = Server::start(listen, factory, super::batch_mode(1, 8)).await.unwrap();
        let server = server.with_tls(tls);
        let (grpc, metrics) = (server.local_addr(), server.metrics_addr());
        Self { grpc, metrics, running: super::Running::spawn(server) }
    }

    /// The admin address.
    pub fn admin(&self) -> SocketAddr {
        self.metrics.expect("the server was started with the admin address")
    }

    /// Stops accepting and drains; panics if the server failed.
    pub async fn stop(self) {
        self.running.stop().await
    }
}

/// A rustls client trusting `ca`, presenting `identity` if any, offering
/// `alpn` (none: no ALPN).
pub fn client_config(ca: &Authority, identity: Option<&Leaf>, alpn: &[&[u8]]) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap()).unwrap();
    let builder = ClientConfig::builder().with_root_certificates(roots);
    let mut config = match identity {
        Some(leaf) => {
            let chain = vec![CertificateDer::from_pem_slice(leaf.cert.as_bytes()).unwrap()];
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap())
                .unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

async fn connect(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    let name = ServerName::try_from("localhost").unwrap();
    let handshake = tokio_rustls::TlsConnector::from(config).connect(name, tcp);
    match tokio::time::timeout(Duration::from_secs(10), handshake).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(format!("handshake: {e}")),
        Err(_) => Err("handshake: timed out".into()),
    }
}

/// The certificate (DER) the TLS server at `addr` presents to a client
/// trusting `ca`, on a fresh connection offering no ALPN.
pub async fn served_certificate(
    addr: SocketAddr,
    ca: &Authority,
    identity: Option<&Leaf>,
) -> Result<Vec<u8>, String> {
    let stream = connect(addr, client_config(ca, identity, &[])).await?;
    let (_, connection) = stream.get_ref();
    let chain = connection.peer_certificates().ok_or("no certificate presented")?;
    Ok(chain[0].to_vec())
}

/// One HTTP/1.1 `request` (a whole message, `Connection: close`) over TLS
/// with `config`: the status code and body, or why there is none.
pub async fn https_exchange(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    request: &[u8],
) -> Result<(u16, String), String> {
    let mut stream = connect(addr, config).await?;
    stream.write_all(request).await.map_err(|e| format!("write: {e}"))?;
    let mut response = Vec::new();
    let read = stream.read_to_end(&mut response).await;
    let response = String::from_utf8_lossy(&response).into_owned();
    let Some((head, body)) = response.split_once("\r\n\r\n") else {
        return Err(format!("no response ({read:?}): {response:?}"));
    };
    let code =
        head.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("bad head {head:?}"))?;
    Ok((code, body.to_string()))
}

/// `METHOD path` without a body, with `authorization` if any, over TLS.
pub async fn https(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    authorization: Option<&str>,
) -> Result<(u16, String), String> {
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(value) = authorization {
        request.push_str(&format!("Authorization: {value}\r\n"));
    }
    request.push_str("Content-Length: 0\r\n\r\n");
    https_exchange(addr, config, request.as_bytes()).await
}

/// A plain HTTP/1.1 `GET path` to a TLS port: what came back, if anything
/// (a TLS server answers no HTTP).
pub async fn plaintext_get(addr: SocketAddr, path: &str) -> String {
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else { return String::new() };
    let request = format!("GET {path} HTTP/1.1\r\nHost: narsil\r\nConnection: close\r\n\r\n");
    let _ = stream.write_all(request.as_bytes()).await;
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), stream.read_to_end(&mut response)).await;
    String::from_utf8_lossy(&response).into_owned()
}
