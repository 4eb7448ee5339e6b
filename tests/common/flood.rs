//! Floods at the TLS door, and real clients that must get through them:
//! sockets that send nothing, half a ClientHello, or a whole one and then
//! nothing, each connecting again as soon as the server drops it
//! ([`Flood`]); a gRPC client on a path that delays everything it sends
//! ([`health_on_a_delayed_path`]); and a /64 routed to the loopback so that
//! a flood can come from many of its addresses ([`LocalPrefix`]).

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, ClientConnection, RootCertStore};
use tonic::transport::{Channel, ClientTlsConfig, Uri};

/// What one socket of a flood sends after each connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sends {
    Nothing,
    /// The first bytes of a ClientHello: a record announcing 512 bytes, of
    /// which only the header arrives.
    HalfHello,
    /// A whole ClientHello ([`whole_hello`]), then nothing: the server
    /// answers it and waits for a Finished that never comes.
    WholeHello,
}

/// The first bytes of a TLS 1.2 ClientHello ([`Sends::HalfHello`]).
pub const PARTIAL_HELLO: [u8; 11] = [0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];

/// A whole ClientHello for `localhost` offering `h2`, as a rustls client
/// writes it: made once and replayed on every connection, which costs a
/// flood nothing.
pub fn whole_hello() -> &'static [u8] {
    static HELLO: OnceLock<Vec<u8>> = OnceLock::new();
    HELLO.get_or_init(|| {
        let mut config =
            ClientConfig::builder().with_root_certificates(RootCertStore::empty()).with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let name = ServerName::try_from("localhost").unwrap();
        let mut client = ClientConnection::new(Arc::new(config), name).unwrap();
        let mut hello = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut hello).unwrap();
        }
        hello
    })
}

/// Makes room for `needed` open files: the soft limit raised toward the
/// hard one. Whether there is room, or why not.
pub fn room_for_files(needed: u64) -> Result<(), String> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the limit into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(format!("getrlimit: {}", std::io::Error::last_os_error()));
    }
    if limit.rlim_cur >= needed {
        return Ok(());
    }
    if limit.rlim_max < needed {
        return Err(format!("ulimit -n is {} (hard {}), {needed} needed", limit.rlim_cur, limit.rlim_max));
    }
    let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
    // SAFETY: setrlimit reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(format!("setrlimit to {}: {}", limit.rlim_max, std::io::Error::last_os_error()));
    }
    eprintln!("ulimit -n raised from {} to {}", limit.rlim_cur, limit.rlim_max);
    Ok(())
}

/// A socket bound to `source` (any port). IPv6 sources may be addresses of
/// a [`LocalPrefix`], which the kernel binds only with `IPV6_FREEBIND`.
fn socket_from(source: IpAddr) -> std::io::Result<TcpSocket> {
    let socket = match source {
        IpAddr::V4(_) => TcpSocket::new_v4()?,
        IpAddr::V6(_) => {
            let socket = TcpSocket::new_v6()?;
            let on: libc::c_int = 1;
            // SAFETY: the descriptor is the socket's own, open; setsockopt
            // reads `size_of::<c_int>()` bytes from `on`, which lives across the call.
            let set = unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::IPPROTO_IPV6,
                    libc::IPV6_FREEBIND,
                    (&on as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if set != 0 {
                return Err(std::io::Error::last_os_error());
            }
            socket
        }
    };
    socket.bind(SocketAddr::new(source, 0))?;
    Ok(socket)
}

/// One socket of a flood from `source`: connects, sends what `sends` says,
/// holds the connection (reading what the server sends) until the server
/// drops it, and connects again; `opened` counts its connections.
async fn flood_socket(target: SocketAddr, source: IpAddr, sends: Sends, opened: Arc<AtomicUsize>) {
    loop {
        let connected = match socket_from(source) {
            Ok(socket) => socket.connect(target).await,
            Err(e) => Err(e),
        };
        let Ok(mut stream) = connected else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        opened.fetch_add(1, Ordering::Relaxed);
        let first: &[u8] = match sends {
            Sends::Nothing => &[],
            Sends::HalfHello => &PARTIAL_HELLO,
            Sends::WholeHello => whole_hello(),
        };
        if stream.write_all(first).await.is_err() {
            continue;
        }
        let mut answer = [0u8; 4096];
        while matches!(stream.read(&mut answer).await, Ok(n) if n > 0) {}
    }
}

/// A flood's sockets, stopped when it is dropped.
pub struct Flood {
    sockets: Vec<tokio::task::JoinHandle<()>>,
    opened: Arc<AtomicUsize>,
}

impl Flood {
    /// `sockets` sockets on `target`, the i-th from `sources[i % len]`
    /// sending `sends(i)`, once all have connected.
    pub async fn start(
        target: SocketAddr,
        sockets: usize,
        sources: &[IpAddr],
        sends: impl Fn(usize) -> Sends,
    ) -> Self {
        let opened = Arc::new(AtomicUsize::new(0));
        let sockets = (0..sockets)
            .map(|i| {
                let (source, opened) = (sources[i % sources.len()], Arc::clone(&opened));
                tokio::spawn(flood_socket(target, source, sends(i), opened))
            })
            .collect::<Vec<_>>();
        let flood = Self { opened, sockets };
        let count = flood.sockets.len();
        super::wait_until("the flood's sockets to connect", super::PATIENCE, || flood.connects() >= count)
            .await;
        flood
    }

    /// Connections the flood has opened so far.
    pub fn connects(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        for socket in &self.sockets {
            socket.abort();
        }
    }
}

/// A connection to `addr` on a path that delivers everything the client
/// sends `delay` late (in order, as a longer path does) and what the
/// server sends at once: the client's end.
async fn delayed_connection(addr: SocketAddr, delay: Duration) -> std::io::Result<DuplexStream> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (client_end, path_end) = tokio::io::duplex(64 * 1024);
    let (mut from_client, mut to_client) = tokio::io::split(path_end);
    let (mut from_server, mut to_server) = tcp.into_split();
    let (sent, mut in_transit) = mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    tokio::spawn(async move {
        let mut bytes = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = from_client.read(&mut bytes).await {
            if sent.send((tokio::time::Instant::now() + delay, bytes[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    tokio::spawn(async move {
        while let Some((due, bytes)) = in_transit.recv().await {
            tokio::time::sleep_until(due).await;
            if to_server.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to_server.shutdown().await;
    });
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
        let _ = to_client.shutdown().await;
    });
    Ok(client_end)
}

/// A fresh gRPC connection to `addr` with `tls` on a path that delays what
/// the client sends by `delay` ([`delayed_connection`]), and a grpc.health
/// check over it: how long both took, or why they failed (`deadline` past
/// included).
pub async fn health_on_a_delayed_path(
    addr: SocketAddr,
    tls: ClientTlsConfig,
    delay: Duration,
    deadline: Duration,
) -> Result<Duration, String> {
    let started = Instant::now();
    let endpoint = Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap();
    let call = async {
        let connector = tower::service_fn(move |_: Uri| async move {
            delayed_connection(addr, delay).await.map(TokioIo::new)
        });
        let channel =
            endpoint.connect_with_connector(connector).await.map_err(|e| format!("connect: {e:?}"))?;
        super::health_status(channel).await.map_err(|s| format!("health: {s:?}"))
    };
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(1)) => Ok(started.elapsed()),
        Ok(Ok(status)) => Err(format!("health status {status}")),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("no answer within its {deadline:?} deadline")),
    }
}

/// What real clients came to while a flood went on.
#[derive(Debug, Default)]
pub struct Served {
    /// How long each answered one took, fastest first.
    pub latencies: Vec<Duration>,
    pub failures: Vec<String>,
}

impl Served {
    /// The `p`-quantile (0 to 1) of the latencies.
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p * self.latencies.len() as f64).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[rank - 1]
    }

    /// One line: how many, p50, p99, the slowest and the failures' count.
    pub fn summary(&self) -> String {
        let slowest = self.latencies.last().copied().unwrap_or_default();
        format!(
            "{} real clients answered: p50 {:?}, p99 {:?}, slowest {slowest:?}; {} failed",
            self.latencies.len(),
            self.percentile(0.50),
            self.percentile(0.99),
            self.failures.len()
        )
    }
}

/// `clients` real clients, each calling [`health_on_a_delayed_path`] over
/// and over, a fresh connection each time, for `window`.
pub async fn real_clients(
    addr: SocketAddr,
    tls: ClientTlsConfig,
    clients: usize,
    delay: Duration,
    deadline: Duration,
    window: Duration,
) -> Served {
    let started = Instant::now();
    let calling = (0..clients).map(|_| {
        let tls = tls.clone();
        tokio::spawn(async move {
            let mut served = Served::default();
            while started.elapsed() < window {
                match health_on_a_delayed_path(addr, tls.clone(), delay, deadline).await {
                    Ok(took) => served.latencies.push(took),
                    Err(why) => served.failures.push(why),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            served
        })
    });
    let mut served = Served::default();
    for one in futures_util::future::join_all(calling).await {
        let one = one.unwrap();
        served.latencies.extend(one.latencies);
        served.failures.extend(one.failures);
    }
    served.latencies.sort();
    served
}

/// An IPv6 /64 routed to the loopback (`ip -6 route replace local PREFIX
/// dev lo`), so that sockets bound to any of its addresses connect to a
/// server on `::1`; the route is removed when it is dropped. Needs
/// CAP_NET_ADMIN (root): without it, why not.
pub struct LocalPrefix {
    prefix: &'static str,
}

impl LocalPrefix {
    pub fn add(prefix: &'static str) -> Result<Self, String> {
        let route = |verb: &str| {
            std::process::Command::new("ip")
                .args(["-6", "route", verb, "local", prefix, "dev", "lo"])
                .output()
        };
        match route("replace") {
            Ok(out) if out.status.success() => Ok(Self { prefix }),
            Ok(out) => Err(format!(
                "`ip -6 route replace local {prefix} dev lo` failed (needs root): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Err(format!("cannot run `ip`: {e}")),
        }
    }
}

impl Drop for LocalPrefix {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["-6", "route", "del", "local", self.prefix, "dev", "lo"])
            .output();
    }
}
