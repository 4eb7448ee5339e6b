//! Certificates that follow their files: at most once a second, when a
//! connection arrives, the files of `--tls-cert`, `--tls-key` and
//! `--tls-client-ca` are looked at (device, inode, length, modification
//! time, through symlinks: a Kubernetes Secret's swap of `..data` counts);
//! when any changed, they are read and checked again and new connections
//! get the new configurations. Connections already made keep theirs. A new
//! version that cannot be read or used (a half-written file, a key that is
//! not the new certificate's) is refused with one warning naming the file
//! and why, and the previous certificate stays in service until the files
//! change again.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use super::material::{Configs, Material, Names};

/// How often, at most, the files are looked at.
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
    state: Mutex<State>,
}

struct State {
    configs: Configs,
    /// The files as they were when `configs` was read.
    served: Vec<Option<Stamp>>,
    /// The files as they were when a version was refused (warned once).
    refused: Option<Vec<Option<Stamp>>>,
    checked: Instant,
}

impl Reloading {
    /// Configurations that never change.
    pub fn fixed(configs: Configs) -> Self {
        Self::new(None, configs, Vec::new())
    }

    /// Reads `files` now, and again whenever they change.
    pub fn follow(files: Files) -> anyhow::Result<Self> {
        let served = files.stamps();
        let configs = files.read()?.configs()?;
        Ok(Self::new(Some(files), configs, served))
    }

    fn new(files: Option<Files>, configs: Configs, served: Vec<Option<Stamp>>) -> Self {
        let state = State { configs, served, refused: None, checked: Instant::now() };
        Self { files, state: Mutex::new(state) }
    }

    /// Whether the files are followed.
    pub fn follows_files(&self) -> bool {
        self.files.is_some()
    }

    /// The configurations for a new connection: the files' current ones
    /// if they changed (looked at no more than every [`CHECK_EVERY`]).
    pub fn current(&self) -> Configs {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(files) = &self.files {
            if state.checked.elapsed() >= CHECK_EVERY {
                state.checked = Instant::now();
                reload_if_changed(files, &mut state);
            }
        }
        state.configs.clone()
    }
}

fn reload_if_changed(files: &Files, state: &mut State) {
    let stamps = files.stamps();
    if stamps == state.served || state.refused.as_ref() == Some(&stamps) {
        return;
    }
    match files.read().and_then(|material| material.configs()) {
        Ok(configs) => {
            state.configs = configs;
            state.served = stamps;
            state.refused = None;
            tracing::info!(cert = %files.cert.display(), "TLS certificate reloaded: new connections get it");
        }
        Err(e) => {
            state.refused = Some(stamps);
            tracing::warn!(
                error = format!("{e:#}"),
                "cannot reload TLS from the changed files; new connections still get the certificate read before"
            );
        }
    }
}
