//! `narsil tables push-ids`: adds the raw ids a new vocabulary holds and
//! the served model's id maps lack to the served model, each with its row,
//! while it serves (`memory` and `mmap` stores): no new model version.
//!
//! For each table of MODEL (the version being served) that declares an id
//! map, the entries of NEW's map for that table (`--from`, a split model of
//! the same tables: a copy with the new vocabulary, as `narsil tables map`
//! writes it) whose raw ids MODEL's map does not hold are sent, each with
//! its row read from NEW's table, to `POST
//! /v1/models/{model}/tables/{table}/ids` on each server's admin address,
//! in bodies of at most `--chunk-bytes`. A server adds each body to every
//! ready version of the model at once (all of its ids servable from the
//! next batch, or none); an id a version already holds with the same row is
//! left as it is, so running the command again after a failure finishes
//! what it started. Each body is one push: the server writes it to the
//! model's push log before it answers, so versions loaded later get it too.
//!
//! `https://` addresses (or `--tls-ca`) speak TLS, as `narsil load` does:
//! for servers whose admin address serves TLS (`--tls-cert`, and with
//! `--tls-client-ca` a client certificate: `--tls-cert`/`--tls-key`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use narsil_embedding::schema::TableIds;
use narsil_embedding::{IdMap, SplitSchema};

use super::in_id_order;
use crate::lifecycle::control::MAX_PUSH_BODY_BYTES;
use crate::load::tls::{ClientTlsArgs, HttpsClient};

/// `narsil tables push-ids`.
#[derive(Debug, Args)]
pub struct PushIdsArgs {
    /// The split model directory being served (its schema.json and id
    /// maps: the ids the server already holds).
    model: PathBuf,
    /// A split model directory with the new vocabulary: tables of the same
    /// names, row sizes and storage, whose id maps hold the new raw ids
    /// (its tables hold their rows; they may have more rows than MODEL's).
    #[arg(long)]
    from: PathBuf,
    /// Admin addresses of the servers to push to (`--metrics-addr`):
    /// `http://HOST:PORT[,http://HOST:PORT...]`, every replica that serves
    /// the model; `https://` for an admin address that serves TLS (needs
    /// --tls-ca).
    #[arg(long, value_delimiter = ',', required = true)]
    server: Vec<String>,
    /// The model's name on the servers (its repository directory); default:
    /// the name of MODEL's parent directory when MODEL is a repository
    /// version (`REPO/NAME/N`), else schema.json's name.
    #[arg(long)]
    name: Option<String>,
    /// Push to this table only (default: every table of MODEL with an id
    /// map).
    #[arg(long)]
    table: Option<String>,
    /// A file holding the servers' model-control token
    /// (`--control-token-file` of `narsil serve`).
    #[arg(long, env = "NARSIL_CONTROL_TOKEN_FILE")]
    control_token_file: Option<PathBuf>,
    /// Bytes per request body (at most 16 MiB, the server's limit): each
    /// body is one atomic push.
    #[arg(long, default_value_t = 4 << 20)]
    chunk_bytes: usize,
    #[command(flatten)]
    tls: ClientTlsArgs,
}

/// One table's entries to push.
struct TableEntries {
    name: String,
    entry_bytes: usize,
    body: Vec<u8>,
    /// Raw ids of NEW's map that MODEL's already holds (not sent).
    held: u64,
}

/// Runs `narsil tables push-ids`.
pub fn push_ids(args: &PushIdsArgs) -> anyhow::Result<()> {
    if args.chunk_bytes == 0 || args.chunk_bytes > MAX_PUSH_BODY_BYTES {
        anyhow::bail!("--chunk-bytes must be 1 to {MAX_PUSH_BODY_BYTES} (the server's limit)");
    }
    let schema = SplitSchema::read(&args.model).with_context(|| format!("{}", args.model.display()))?;
    let new_schema =
        SplitSchema::read(&args.from).with_context(|| format!("--from {}", args.from.display()))?;
    let name = args.name.clone().unwrap_or_else(|| model_name(&args.model, &schema.name));
    let token = match &args.control_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading --control-token-file {}", path.display()))?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let servers: Vec<Server> =
        args.server.iter().map(|s| Server::parse(s, &args.tls)).collect::<anyhow::Result<_>>()?;
    let mut tables = Vec::new();
    for spec in &schema.tables {
        if args.table.as_ref().is_some_and(|only| *only != spec.name) {
            continue;
        }
        let TableIds::Map(map_spec) = &spec.ids else {
            if args.table.is_some() {
                anyhow::bail!("table {:?} of {} declares no id map", spec.name, args.model.display());
            }
            continue;
        };
        let new_spec =
            new_schema.table(&spec.name).with_context(|| format!("--from has no table {:?}", spec.name))?;
        if (new_spec.row_bytes, new_spec.storage, new_spec.dim) != (spec.row_bytes, spec.storage, spec.dim) {
            anyhow::bail!("table {:?}: --from's rows differ (row bytes, storage, dim)", spec.name);
        }
        let TableIds::Map(new_map_spec) = &new_spec.ids else {
            anyhow::bail!("table {:?} of --from declares no id map: no new ids to push", spec.name);
        };
        let served = open_map(&args.model, &spec.name, &map_spec.file, spec.rows)?;
        let new_map = open_map(&args.from, &spec.name, &new_map_spec.file, new_spec.rows)?;
        let new_rows = in_id_order(&args.from, new_spec)?;
        let entry_bytes = 8 + spec.row_bytes;
        let (mut body, mut held) = (Vec::new(), 0u64);
        for (raw, row) in new_map.iter() {
            if served.row(raw).is_some() {
                held += 1;
                continue;
            }
            let at = row as usize * spec.row_bytes;
            body.extend_from_slice(&raw.to_le_bytes());
            body.extend_from_slice(&new_rows.bytes()[at..at + spec.row_bytes]);
        }
        tables.push(TableEntries { name: spec.name.clone(), entry_bytes, body, held });
    }
    if tables.is_empty() {
        anyhow::bail!("{} has no table with an id map to push to", args.model.display());
    }
    let started = Instant::now();
    let mut sent = 0u64;
    for server in &servers {
        for table in &tables {
            let ids = (table.body.len() / table.entry_bytes) as u64;
            let per_body = (args.chunk_bytes / table.entry_bytes).max(1) * table.entry_bytes;
            let path = format!("/v1/models/{name}/tables/{}/ids", table.name);
            let mut done = 0u64;
            for body in table.body.chunks(per_body) {
                let call = Instant::now();
                let answer = server.post(&path, token.as_deref(), body)?;
                done += (body.len() / table.entry_bytes) as u64;
                eprintln!(
                    "{server} {}: {done}/{ids} ids ({:.0} ms){}",
                    table.name,
                    call.elapsed().as_secs_f64() * 1e3,
                    summary(&answer)
                );
            }
            if ids == 0 {
                eprintln!("{server} {}: no new ids ({} held already)", table.name, table.held);
            }
            sent += ids;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "pushed {sent} new ids of {} tables of {name} to {} servers in {seconds:.2} s ({:.0} ids/s); each servable once its push was answered",
        tables.len(),
        servers.len(),
        sent as f64 / seconds.max(1e-9)
    );
    Ok(())
}

/// The model's name on the servers: MODEL's parent directory's for a
/// repository version (`REPO/NAME/N`), else `schema_name`.
fn model_name(model: &Path, schema_name: &str) -> String {
    let model = model.canonicalize().unwrap_or_else(|_| model.to_path_buf());
    let version = model.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.parse::<u64>().is_ok());
    match model.parent().and_then(Path::file_name).and_then(|n| n.to_str()) {
        Some(parent) if version => parent.to_owned(),
        _ => schema_name.to_owned(),
    }
}

fn open_map(dir: &Path, table: &str, file: &Path, rows: u64) -> anyhow::Result<IdMap> {
    let path = dir.join(file);
    let (map, _) = IdMap::open(&path, rows)
        .map_err(|e| anyhow::anyhow!("table {table:?}: id map {}: {e}", path.display()))?;
    Ok(map)
}

/// Per version of a push's answer: ids added and pushed in all.
fn summary(answer: &serde_json::Value) -> String {
    let versions = answer["versions"].as_array().map(Vec::as_slice).unwrap_or_default();
    versions
        .iter()
        .map(|v| {
            format!(
                "; version {}: +{} ({} held), {} pushed",
                v["version"].as_str().unwrap_or("?"),
                v["added"],
                v["already_held"],
                v["pushed"]
            )
        })
        .collect()
}

/// An admin address, spoken to in HTTP/1.1, over TLS for `https://`.
struct Server {
    url: String,
    authority: String,
    tls: Option<HttpsClient>,
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

/// A connection to a server: plain TCP or TLS over it.
trait Connection: Read + Write {}
impl<T: Read + Write> Connection for T {}

impl Server {
    fn parse(url: &str, tls: &ClientTlsArgs) -> anyhow::Result<Self> {
        let url = url.trim().trim_end_matches('/');
        let (https, authority) = match (url.strip_prefix("https://"), url.strip_prefix("http://")) {
            (Some(rest), _) => (true, rest),
            (None, Some(rest)) => (false, rest),
            (None, None) => (false, url),
        };
        let host = authority.rsplit_once(':').map(|(host, _)| host);
        let (Some(host), false) = (host.filter(|h| !h.is_empty()), authority.contains('/')) else {
            anyhow::bail!("--server {url}: expected http://HOST:PORT or https://HOST:PORT (the server's --metrics-addr)");
        };
        let tls = tls.https("--server", url, host, https)?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        Ok(Self { url: format!("{scheme}://{authority}"), authority: authority.to_owned(), tls })
    }

    fn connect(&self) -> anyhow::Result<Box<dyn Connection>> {
        let stream = TcpStream::connect(&self.authority)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        let Some(tls) = &self.tls else { return Ok(Box::new(stream)) };
        let session = tokio_rustls::rustls::ClientConnection::new(Arc::clone(&tls.config), tls.name.clone())?;
        Ok(Box::new(tokio_rustls::rustls::StreamOwned::new(session, stream)))
    }

    /// `POST path` with `body`: the answer's JSON, or the server's refusal
    /// as the error.
    fn post(&self, path: &str, token: Option<&str>, body: &[u8]) -> anyhow::Result<serde_json::Value> {
        let context = || format!("POST {}{path}", self.url);
        let mut stream = self.connect().with_context(context)?;
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.authority,
            body.len()
        );
        if let Some(token) = token {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).with_context(context)?;
        stream.write_all(body).with_context(context)?;
        stream.flush().with_context(context)?;
        let mut reader = BufReader::new(stream);
        let mut status = String::new();
        reader.read_line(&mut status).with_context(context)?;
        let code: u16 = status
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("{}: not an HTTP answer: {status:?}", context()))?;
        let mut length = None;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).with_context(context)? == 0 || line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse::<u64>().ok();
                }
            }
        }
        let mut text = String::new();
        match length {
            // Read to the length: a TLS peer may close without a word.
            Some(length) => reader.take(length).read_to_string(&mut text),
            None => reader.read_to_string(&mut text),
        }
        .with_context(context)?;
        let answer: serde_json::Value =
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        if code != 200 {
            let why = answer["error"].as_str().map(str::to_owned).unwrap_or_else(|| answer.to_string());
            anyhow::bail!("{}: {code}: {why}", context());
        }
        Ok(answer)
    }
}
