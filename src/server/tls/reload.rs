//! Certificates that follow their files: every second a thread of their
//! own looks at the files of `--tls-cert`, `--tls-key` and
//! `--tls-client-ca` (device, inode, length, modification time, through
//! symlinks: a Kubernetes Secret's swap of `..data` counts); when any
//! changed, it reads and checks them again and puts the new configurations
//! in service. The accept path never touches a file: a new connection only
//! takes the configurations in service. Connections already made keep
//! theirs (until their maximum age, [`super::aged`]). A new version that
//! cannot be read or used (a half-written file, a key that is not the new
//! certificate's) is refused with one warning naming the file and why, and
//! counted (`narsil_tls_reloads_total{outcome="failed"}`); the previous
//! certificate stays in service until the files change again.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::{Duration, SystemTime};

use anyhow::Context;

use super::material::{Configs, Material, Names};
use super::metrics::TlsMetrics;

/// How often the files are looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The files a configuration was read from.
#[derive(Debug, Clone)]
pub(crate) struct Files {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// What tells that a file changed; none: it cannot be looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

impl Files {
    fn paths(&self) -> impl Iterator<Item = &Path> {
        [Some(self.cert.as_path()), Some(self.key.as_path()), self.client_ca.as_deref()].into_iter().flatten()
    }

    fn stamps(&self) -> Vec<Option<Stamp>> {
        self.paths()
            .map(|path| {
                let meta = std::fs::metadata(path).ok()?;
                Some(Stamp {
                    dev: meta.dev(),
                    ino: meta.ino(),
                    len: meta.len(),
                    modified: meta.modified().ok(),
                })
            })
            .collect()
    }

    /// Reads and checks the files; errors name the flag and the file.
    pub fn read(&self) -> anyhow::Result<Material> {
        let read = |path: &Path, flag: &str| {
            std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
        };
        let ca = self.client_ca.as_deref().map(|path| read(path, "--tls-client-ca")).transpose()?;
        let names = Names {
            cert: format!("--tls-cert {}", self.cert.display()),
            key: format!("--tls-key {}", self.key.display()),
            client_ca: self
                .client_ca
                .as_ref()
                .map(|p| format!("--tls-client-ca {}", p.display()))
                .unwrap_or_default(),
        };
        Material::parse(
            &read(&self.cert, "--tls-cert")?,
            &read(&self.key, "--tls-key")?,
            ca.as_deref(),
            &names,
        )
    }
}

/// The configurations in service, and the files they follow (none: given
/// in memory, never reloaded).
pub(crate) struct Reloading {
    files: Option<Files>,
    configs: RwLock<Configs>,
    metrics: Arc<TlsMetrics>,
}

/// What the checking thread remembers between two looks at the files.
struct Seen {
    /// The files as they were when the configurations in service were read.
    served: Vec<Option<Stamp>>,
    /// The files as they were when a version was refused (warned once).
    refused: Option<Vec<Option<Stamp>>>,
}

impl Reloading {
    /// Configurations that never change.
    pub fn fixed(configs: Configs, metrics: Arc<TlsMetrics>) -> Arc<Self> {
        Arc::new(Self { files: None, configs: RwLock::new(configs), metrics })
    }

    /// Reads `files` now, and starts the thread that reads them again
    /// whenever they change (it ends once the configurations are dropped).
    pub fn follow(files: Files, metrics: Arc<TlsMetrics>) -> anyhow::Result<Arc<Self>> {
        let served = files.stamps();
        let configs = files.read()?.configs()?;
        let reloading = Arc::new(Self { files: Some(files), configs: RwLock::new(configs), metrics });
        let following = Arc::downgrade(&reloading);
        let seen = Seen { served, refused: None };
        std::thread::Builder::new()
            .name("narsil-tls-reload".into())
            .spawn(move || follow(&following, seen))
            .context("cannot start the thread that follows the TLS files")?;
        Ok(reloading)
    }

    /// Whether the files are followed.
    pub fn follows_files(&self) -> bool {
        self.files.is_some()
    }

    /// The configurations in service, for a new connection: no file is
    /// looked at here.
    pub fn current(&self) -> Configs {
        self.configs.read().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// Looks at the files every [`CHECK_EVERY`] while `reloading` is in use.
fn follow(reloading: &Weak<Reloading>, mut seen: Seen) {
    loop {
        std::thread::sleep(CHECK_EVERY);
        let Some(reloading) = reloading.upgrade() else { return };
        if let Some(files) = &reloading.files {
            reload_if_changed(files, &reloading, &mut seen);
        }
    }
}

fn reload_if_changed(files: &Files, reloading: &Reloading, seen: &mut Seen) {
    let stamps = files.stamps();
    if stamps == seen.served || seen.refused.as_ref() == Some(&stamps) {
        return;
    }
    match files.read().and_then(|material| material.configs()) {
        Ok(configs) => {
            *reloading.configs.write().unwrap_or_else(PoisonError::into_inner) = configs;
            seen.served = stamps;
            seen.refused = None;
            reloading.metrics.reload(true);
            tracing::info!(cert = %files.cert.display(), "TLS certificate reloaded: new connections get it");
        }
        Err(e) => {
            seen.refused = Some(stamps);
            reloading.metrics.reload(false);
            tracing::warn!(
                error = format!("{e:#}"),
                "cannot reload TLS from the changed files; new connections still get the certificate read before"
            );
        }
    }
}
