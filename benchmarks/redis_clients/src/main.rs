//! The `redis` table store's read pattern, with each of the two async
//! Redis Cluster clients for Rust: `redis` (cluster-async) and `fred`.
//!
//! ```text
//! narsil-redis-clients fill SEEDS [--tables 26] [--rows 20000] [--buckets 16]
//! narsil-redis-clients read SEEDS --client redis|fred [--in-flight 32]
//!     [--distinct 100] [--seconds 10] [--timeout-ms 250]
//!     [--kill-pid PID --kill-at SECONDS [--signal kill|stop]]
//! ```
//!
//! `fill` writes rows as `narsil tables load` does (`{PREFIX/BUCKET}ID`,
//! 80 bytes each), each row's bytes derived from its table and id so that
//! a read can be checked. `read` is one lane of the store: a plain thread
//! that blocks on a one-worker runtime for each batch; a batch is
//! `--distinct` ids of each table, one `MGET` per (table, bucket) with ids,
//! `--in-flight` of them at once, the batch bounded by `--timeout-ms`. It
//! prints one JSON line: batches, their p50/p99, the process's CPU time
//! per batch, failed batches, rows that came back wrong, and with
//! `--kill-pid` (a master, SIGKILLed, or SIGSTOPped with `--signal stop`,
//! `--kill-at` seconds in) the window of failed batches after it.

use std::time::{Duration, Instant};

use fred::prelude::*;
use futures_util::{StreamExt, TryStreamExt};

const ROW_BYTES: usize = 80;

struct Args {
    seeds: Vec<(String, u16)>,
    tables: u64,
    rows: u64,
    buckets: u64,
    client: String,
    in_flight: usize,
    distinct: usize,
    seconds: f64,
    timeout: Duration,
    kill_pid: Option<i32>,
    kill_at: f64,
    signal: i32,
}

fn parse() -> (String, Args) {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let usage = || -> ! {
        eprintln!("usage: narsil-redis-clients fill|read redis://H:P,... [--flag value ...]");
        std::process::exit(2)
    };
    if argv.len() < 2 {
        usage()
    }
    let seeds = argv[1]
        .trim_start_matches("redis://")
        .split(',')
        .map(|s| {
            let (h, p) = s.trim_start_matches("redis://").rsplit_once(':').unwrap_or_else(|| usage());
            (h.to_string(), p.parse().unwrap_or_else(|_| usage()))
        })
        .collect();
    let mut args = Args {
        seeds,
        tables: 26,
        rows: 20_000,
        buckets: 16,
        client: "redis".into(),
        in_flight: 32,
        distinct: 100,
        seconds: 10.0,
        timeout: Duration::from_millis(250),
        kill_pid: None,
        kill_at: 0.0,
        signal: libc::SIGKILL,
    };
    for pair in argv[2..].chunks(2) {
        let [flag, value] = pair else { usage() };
        let number = || value.parse::<f64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--tables" => args.tables = number() as u64,
            "--rows" => args.rows = number() as u64,
            "--buckets" => args.buckets = number() as u64,
            "--client" => args.client = value.clone(),
            "--in-flight" => args.in_flight = number() as usize,
            "--distinct" => args.distinct = number() as usize,
            "--seconds" => args.seconds = number(),
            "--timeout-ms" => args.timeout = Duration::from_millis(number() as u64),
            "--kill-pid" => args.kill_pid = Some(number() as i32),
            "--kill-at" => args.kill_at = number(),
            "--signal" => args.signal = if value == "stop" { libc::SIGSTOP } else { libc::SIGKILL },
            _ => usage(),
        }
    }
    (argv[0].clone(), args)
}

fn key(table: u64, id: u64, buckets: u64) -> String {
    format!("{{narsil/clients/1/t_cat_{table}/{}}}{id}", id % buckets)
}

fn row(table: u64, id: u64) -> [u8; ROW_BYTES] {
    let mut row = [0u8; ROW_BYTES];
    let mut x = (table << 40) ^ id ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in row.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    row
}

/// One batch's commands: per (table, bucket), the (table, id)s of one MGET.
fn batch(args: &Args, rng: &mut u64) -> Vec<Vec<(u64, u64)>> {
    let mut groups = Vec::new();
    for table in 0..args.tables {
        let mut by_bucket = vec![Vec::new(); args.buckets as usize];
        let mut seen = std::collections::HashSet::new();
        while seen.len() < args.distinct.min(args.rows as usize) {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            let id = *rng % args.rows;
            if seen.insert(id) {
                by_bucket[(id % args.buckets) as usize].push((table, id));
            }
        }
        groups.extend(by_bucket.into_iter().filter(|g| !g.is_empty()));
    }
    groups
}

enum Reader {
    Redis(redis::cluster_async::ClusterConnection),
    Fred(Client),
}

impl Reader {
    async fn connect(args: &Args) -> Self {
        let timeout = args.timeout;
        match args.client.as_str() {
            "redis" => {
                let urls: Vec<String> = args.seeds.iter().map(|(h, p)| format!("redis://{h}:{p}")).collect();
                // As the store builds it (crates/narsil-embedding/src/redis/client.rs).
                let client = redis::cluster::ClusterClientBuilder::new(urls)
                    .connection_timeout(timeout.max(Duration::from_secs(5)))
                    .response_timeout(timeout)
                    .retries(2)
                    .build()
                    .expect("seeds");
                Self::Redis(client.get_async_connection().await.expect("connect (redis)"))
            }
            "fred" => {
                let config =
                    Config { server: ServerConfig::new_clustered(args.seeds.clone()), ..Config::default() };
                let client = Builder::from_config(config)
                    .with_connection_config(|c| {
                        // As the store builds it (crates/narsil-embedding/src/redis/client.rs).
                        c.connection_timeout = timeout;
                        c.internal_command_timeout = timeout;
                        c.max_command_attempts = 3;
                        c.unresponsive = fred::types::config::UnresponsiveConfig {
                            max_timeout: Some(Duration::from_secs(1)),
                            interval: Duration::from_millis(250),
                        };
                    })
                    .with_performance_config(|p| p.default_command_timeout = timeout)
                    .set_policy(ReconnectPolicy::new_constant(0, 100))
                    .build()
                    .expect("config");
                client.init().await.expect("connect (fred)");
                Self::Fred(client)
            }
            other => panic!("unknown client {other}"),
        }
    }

    async fn mget(&self, keys: Vec<String>) -> Result<Vec<Option<Vec<u8>>>, String> {
        match self {
            Self::Redis(connection) => {
                let mut connection = connection.clone();
                let mut command = redis::cmd("MGET");
                for key in keys {
                    command.arg(key);
                }
                command.query_async(&mut connection).await.map_err(|e| e.to_string())
            }
            Self::Fred(client) => {
                let values: Vec<Value> = client.mget(keys).await.map_err(|e| e.to_string())?;
                Ok(values.into_iter().map(|v| v.as_bytes().map(<[u8]>::to_vec)).collect())
            }
        }
    }

    async fn mset(&self, pairs: Vec<(String, Vec<u8>)>) -> Result<(), String> {
        match self {
            Self::Redis(connection) => {
                let mut connection = connection.clone();
                let mut command = redis::cmd("MSET");
                for (key, value) in pairs {
                    command.arg(key).arg(value);
                }
                command.query_async(&mut connection).await.map_err(|e| e.to_string())
            }
            Self::Fred(client) => {
                let pairs: Vec<(String, Value)> =
                    pairs.into_iter().map(|(k, v)| (k, Value::Bytes(v.into()))).collect();
                client.mset(pairs).await.map_err(|e| e.to_string())
            }
        }
    }
}

fn cpu_seconds() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(usage.ru_utime) + t(usage.ru_stime)
}

fn main() {
    let (command, args) = parse();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let reader = runtime.block_on(Reader::connect(&args));
    match command.as_str() {
        "fill" => fill(&runtime, &reader, &args),
        "read" => read(&runtime, &reader, &args),
        _ => panic!("fill or read"),
    }
}

fn fill(runtime: &tokio::runtime::Runtime, reader: &Reader, args: &Args) {
    let mut commands = Vec::new();
    for table in 0..args.tables {
        for bucket in 0..args.buckets {
            let ids: Vec<u64> = (bucket..args.rows).step_by(args.buckets as usize).collect();
            for chunk in ids.chunks(512) {
                commands.push(
                    chunk.iter().map(|&id| (key(table, id, args.buckets), row(table, id).to_vec())).collect(),
                );
            }
        }
    }
    let n = commands.len();
    runtime
        .block_on(
            futures_util::stream::iter(commands.into_iter().map(|pairs| reader.mset(pairs)))
                .buffer_unordered(32)
                .try_collect::<Vec<()>>(),
        )
        .expect("fill");
    println!("{{\"rows\": {}, \"commands\": {n}}}", args.tables * args.rows);
}

fn read(runtime: &tokio::runtime::Runtime, reader: &Reader, args: &Args) {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let start = Instant::now();
    let cpu_start = cpu_seconds();
    let mut killed_at: Option<f64> = None;
    let (mut latencies, mut failed, mut wrong) = (Vec::new(), 0u64, 0u64);
    let (mut first_failure_after_kill, mut last_failure_after_kill) = (None::<f64>, None::<f64>);
    let mut errors = std::collections::BTreeMap::<String, u64>::new();
    let mut rows = 0u64;
    while start.elapsed().as_secs_f64() < args.seconds {
        if let (Some(pid), None) = (args.kill_pid, killed_at) {
            if start.elapsed().as_secs_f64() >= args.kill_at {
                unsafe { libc::kill(pid, args.signal) };
                killed_at = Some(start.elapsed().as_secs_f64());
            }
        }
        let groups = batch(args, &mut rng);
        let began = Instant::now();
        let fetch = futures_util::stream::iter(groups.iter().map(|group| {
            let keys = group.iter().map(|&(t, id)| key(t, id, args.buckets)).collect();
            reader.mget(keys)
        }))
        .buffered(args.in_flight)
        .try_collect::<Vec<_>>();
        let outcome = runtime.block_on(async { tokio::time::timeout(args.timeout, fetch).await });
        let ended = start.elapsed().as_secs_f64();
        match outcome {
            Ok(Ok(replies)) => {
                latencies.push(began.elapsed().as_secs_f64() * 1e3);
                for (group, values) in groups.iter().zip(replies) {
                    for (&(t, id), value) in group.iter().zip(values) {
                        rows += 1;
                        if value.as_deref() != Some(&row(t, id)[..]) {
                            wrong += 1;
                        }
                    }
                }
            }
            failure => {
                failed += 1;
                let what = match failure {
                    Ok(Err(e)) => e.chars().take(60).collect(),
                    _ => "timed out".to_string(),
                };
                *errors.entry(what).or_default() += 1;
                if let Some(at) = killed_at {
                    first_failure_after_kill.get_or_insert(ended - at);
                    last_failure_after_kill = Some(ended - at);
                }
                if killed_at.is_none() || args.kill_pid.is_none() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    let cpu = cpu_seconds() - cpu_start;
    let wall = start.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let q =
        |p: f64| latencies.get(((latencies.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(f64::NAN);
    let batches = latencies.len() as u64 + failed;
    let errors: Vec<String> = errors.iter().map(|(e, n)| format!("{:?}: {n}", e)).collect();
    println!(
        "{{\"client\": \"{}\", \"in_flight\": {}, \"distinct\": {}, \"ok_batches\": {}, \"failed_batches\": {failed}, \
         \"batches_per_s\": {:.1}, \"p50_ms\": {:.2}, \"p99_ms\": {:.2}, \"cpu_ms_per_batch\": {:.3}, \
         \"rows_per_batch\": {:.0}, \"wrong_rows\": {wrong}, \"killed_at_s\": {}, \"first_failure_after_kill_s\": {}, \
         \"last_failure_after_kill_s\": {}, \"errors\": [{}]}}",
        args.client,
        args.in_flight,
        args.distinct,
        latencies.len(),
        batches as f64 / wall,
        q(0.5),
        q(0.99),
        cpu * 1e3 / batches.max(1) as f64,
        rows as f64 / latencies.len().max(1) as f64,
        json(killed_at),
        json(first_failure_after_kill),
        json(last_failure_after_kill),
        errors.iter().map(|e| format!("{e:?}")).collect::<Vec<_>>().join(", "),
    );
}

fn json(value: Option<f64>) -> String {
    value.map_or("null".into(), |v| format!("{v:.2}"))
}
