//! `--bound-addresses-file`: once every listener is bound, the address each
//! one actually got (the port the kernel chose for port 0 included), one
//! `NAME=HOST:PORT` line per listener:
//!
//! ```text
//! grpc=127.0.0.1:41873
//! metrics=127.0.0.1:36511
//! ```
//!
//! `grpc` is `--addr` (every gRPC service); `metrics` is `--metrics-addr`
//! (metrics, `/healthz`, the model calls), present only when it is set.
//! The file is written to a temporary name beside it and renamed into
//! place, so a reader polling for it sees all of it or nothing.

use std::ffi::OsString;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;

/// The listener name of `--addr`.
pub const GRPC: &str = "grpc";
/// The listener name of `--metrics-addr`.
pub const METRICS: &str = "metrics";

/// The file's text for `listeners` (name, address).
pub fn render(listeners: &[(&str, SocketAddr)]) -> String {
    listeners.iter().map(|(name, addr)| format!("{name}={addr}\n")).collect()
}

/// The listeners a file written by [`write`] names, in its order.
pub fn parse(text: &str) -> anyhow::Result<Vec<(String, SocketAddr)>> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let (name, addr) = line.split_once('=').with_context(|| format!("not NAME=ADDRESS: {line:?}"))?;
            let addr = addr.trim().parse().with_context(|| format!("not an address: {line:?}"))?;
            Ok((name.trim().to_string(), addr))
        })
        .collect()
}

/// Removes a file an earlier run left at `path`, so that a reader never
/// takes its addresses for this run's (missing is fine).
pub fn remove_stale(path: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e)
            .with_context(|| format!("cannot remove the old {} (--bound-addresses-file)", path.display())),
        _ => Ok(()),
    }
}

/// Writes `listeners` to `path` atomically: to `.NAME.PID.tmp` beside it,
/// flushed, then renamed onto it.
pub fn write(path: &Path, listeners: &[(&str, SocketAddr)]) -> anyhow::Result<()> {
    let context =
        || format!("cannot write the bound addresses to {} (--bound-addresses-file)", path.display());
    let name = path.file_name().with_context(context)?;
    let mut temp_name = OsString::from(".");
    temp_name.push(name);
    temp_name.push(format!(".{}.tmp", std::process::id()));
    let temp = path.with_file_name(temp_name);
    let written = std::fs::File::create(&temp)
        .and_then(|mut file| {
            file.write_all(render(listeners).as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written.with_context(context)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_addresses_read_back_and_replace_the_old_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bound");
        std::fs::write(&path, "grpc=127.0.0.1:1\n").unwrap();
        remove_stale(&path).unwrap();
        assert!(!path.exists());
        remove_stale(&path).unwrap();
        let listeners =
            [(GRPC, "127.0.0.1:41873".parse().unwrap()), (METRICS, "[::1]:9100".parse().unwrap())];
        write(&path, &listeners).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "grpc=127.0.0.1:41873\nmetrics=[::1]:9100\n");
        let read = parse(&text).unwrap();
        assert_eq!(read, listeners.map(|(name, addr)| (name.to_string(), addr)));
        // Nothing but the file is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["bound"]);
        assert!(parse("grpc 127.0.0.1:1").is_err());
    }

    #[test]
    fn an_unwritable_path_names_the_flag() {
        let err = write(Path::new("/nonexistent-dir/bound"), &[]).unwrap_err();
        assert!(format!("{err:#}").contains("--bound-addresses-file"), "{err:#}");
    }
}
