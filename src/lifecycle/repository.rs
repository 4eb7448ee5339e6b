//! The model repository on disk: `DIR/<model name>/<version number>/`, and
//! which of its versions the version policy serves.
//!
//! A version directory holds one model file, `model.pt` (TorchScript, served
//! by libtorch, with a `model.json` beside it when it has TorchRec's
//! signature), `model.safetensors` (Burn) or `schema.json` (a split model:
//! the version directory is the model, its tables in `tables/`), plus
//! whatever that model needs.
//! Only directories named by a number are versions; anything else, and every
//! name starting with a dot, is ignored, so a version is published by writing
//! it under a dot-name (or outside the repository) and renaming it into place.
//! Each version's [`Fingerprint`] (its files' names, sizes and times) lets a
//! version that failed to load be tried again once its files change.
//!
//! Where the versions come from is a [`RepositorySource`] (scan, then
//! localize a version into a local directory the loader reads), as Triton's
//! `FileSystem` and `LocalizePath`: a local directory ([`LocalDirectory`])
//! today. A new source (an object store) is one implementation in a file
//! of its own, declared here and chosen in [`open`].

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The model file names a version directory may hold, in the order looked for.
pub const MODEL_FILES: [&str; 3] = ["model.pt", "model.safetensors", SPLIT_SCHEMA];

/// The file that makes a version directory a split model.
pub const SPLIT_SCHEMA: &str = "schema.json";

/// A version directory as found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionDir {
    /// The directory.
    pub path: PathBuf,
    /// Its model file, if it has one.
    pub model_file: Option<PathBuf>,
    /// Changes whenever a file in it changes.
    pub fingerprint: Fingerprint,
}

/// A digest of a version directory's file names, sizes and modification times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Fingerprint(u64);

/// Every model of the repository and its versions, by number.
pub type Scan = BTreeMap<String, BTreeMap<u64, VersionDir>>;

/// Where a repository's models and versions come from.
pub trait RepositorySource: Send + Sync {
    /// Every model and its versions, each with a fingerprint. Called on
    /// every poll, so it should be cheap.
    fn scan(&self) -> std::io::Result<Scan>;

    /// A local directory holding the files of `version` (one of
    /// [`RepositorySource::scan`]'s), valid while the answer lives: a remote
    /// source downloads into a temporary directory that goes with it.
    fn localize(&self, version: &VersionDir) -> std::io::Result<Localized>;

    /// Where it is, for logs and errors.
    fn describe(&self) -> String;
}

/// A version's files in a local directory.
pub struct Localized {
    /// The directory.
    pub dir: PathBuf,
    /// Whatever keeps the directory (a temporary download) until dropped.
    pub keep: Option<Box<dyn Send + Sync>>,
}

impl Localized {
    /// The version's model file in it (see [`MODEL_FILES`]).
    pub fn model_file(&self) -> Option<PathBuf> {
        MODEL_FILES.iter().map(|f| self.dir.join(f)).find(|f| f.is_file())
    }
}

/// The repository at `location`: a local directory (the only source today).
pub fn open(location: &Path) -> Arc<dyn RepositorySource> {
    Arc::new(LocalDirectory::new(location.to_path_buf()))
}

/// A repository in a local directory; versions are read where they are.
#[derive(Debug, Clone)]
pub struct LocalDirectory {
    dir: PathBuf,
}

impl LocalDirectory {
    /// The repository at `dir`.
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }
}

impl RepositorySource for LocalDirectory {
    fn scan(&self) -> std::io::Result<Scan> {
        scan(&self.dir)
    }

    fn localize(&self, version: &VersionDir) -> std::io::Result<Localized> {
        Ok(Localized { dir: version.path.clone(), keep: None })
    }

    fn describe(&self) -> String {
        self.dir.display().to_string()
    }
}

/// Reads the repository at `dir`.
pub fn scan(dir: &Path) -> std::io::Result<Scan> {
    let mut models = Scan::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Some(name) = visible_dir_name(&entry) else { continue };
        let mut versions = BTreeMap::new();
        // A model directory removed mid-scan simply has no versions.
        if let Ok(entries) = std::fs::read_dir(entry.path()) {
            for version in entries.flatten() {
                let Some(number) = visible_dir_name(&version).and_then(|n| version_number(&n)) else {
                    continue;
                };
                versions.insert(number, read_version(version.path()));
            }
        }
        models.insert(name, versions);
    }
    Ok(models)
}

/// A version number: a directory name of ASCII digits only.
pub fn version_number(name: &str) -> Option<u64> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok()
}

fn visible_dir_name(entry: &std::fs::DirEntry) -> Option<String> {
    let name = entry.file_name().into_string().ok()?;
    // Follows symbolic links, so a version may link to an export elsewhere.
    let is_dir = std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir());
    (!name.starts_with('.') && is_dir).then_some(name)
}

fn read_version(path: PathBuf) -> VersionDir {
    let model_file = MODEL_FILES.iter().map(|f| path.join(f)).find(|f| f.is_file());
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let mut files: Vec<_> = std::fs::read_dir(&path)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let meta = std::fs::metadata(e.path()).ok()?;
            Some((e.file_name(), meta.len(), meta.modified().ok()))
        })
        .collect();
    files.sort();
    files.hash(&mut hasher);
    VersionDir { path, model_file, fingerprint: Fingerprint(hasher.finish()) }
}

/// Which versions of a model are served (`--version-policy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionPolicy {
    /// The `n` highest-numbered versions (`latest` is `latest:1`).
    Latest(usize),
    /// Exactly these versions, when present.
    Specific(Vec<u64>),
}

impl VersionPolicy {
    /// The versions to serve, out of those `available`.
    pub fn select(&self, available: impl DoubleEndedIterator<Item = u64>) -> Vec<u64> {
        match self {
            Self::Latest(n) => {
                let mut picked: Vec<u64> = available.rev().take(*n).collect();
                picked.reverse();
                picked
            }
            Self::Specific(wanted) => available.filter(|v| wanted.contains(v)).collect(),
        }
    }
}

impl std::str::FromStr for VersionPolicy {
    type Err = String;

    /// `latest`, `latest:N` or `specific:V1,V2,…`.
    fn from_str(text: &str) -> Result<Self, String> {
        let invalid =
            || format!("`{text}` is not a version policy: use `latest`, `latest:N` or `specific:V1,V2`");
        match text.split_once(':') {
            None if text == "latest" => Ok(Self::Latest(1)),
            Some(("latest", n)) => match n.parse() {
                Ok(n) if n > 0 => Ok(Self::Latest(n)),
                _ => Err(invalid()),
            },
            Some(("specific", list)) => {
                let versions: Option<Vec<u64>> = list.split(',').map(|v| version_number(v.trim())).collect();
                versions.filter(|v| !v.is_empty()).map(Self::Specific).ok_or_else(invalid)
            }
            _ => Err(invalid()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"model").unwrap();
    }

    #[test]
    fn only_numbered_visible_directories_are_versions() {
        let repo = tempfile::tempdir().unwrap();
        let root = repo.path();
        touch(&root.join("dlrm/1/model.pt"));
        touch(&root.join("dlrm/12/model.safetensors"));
        touch(&root.join("dlrm/.3/model.pt")); // being published
        touch(&root.join("dlrm/4.tmp/model.pt"));
        touch(&root.join("dlrm/5/notes.txt")); // no model file
        touch(&root.join("dlrm/6")); // a file, not a directory
        touch(&root.join(".hidden/1/model.pt"));
        touch(&root.join("ranker/2/model.pt"));
        touch(&root.join("ranker/3/schema.json"));
        let found = scan(root).unwrap();
        assert_eq!(found.keys().collect::<Vec<_>>(), ["dlrm", "ranker"]);
        let dlrm = &found["dlrm"];
        assert_eq!(dlrm.keys().copied().collect::<Vec<_>>(), [1, 5, 12]);
        assert_eq!(dlrm[&1].model_file, Some(root.join("dlrm/1/model.pt")));
        assert_eq!(dlrm[&12].model_file, Some(root.join("dlrm/12/model.safetensors")));
        assert_eq!(dlrm[&5].model_file, None);
        assert_eq!(found["ranker"][&3].model_file, Some(root.join("ranker/3/schema.json")));
    }

    #[test]
    fn a_fingerprint_changes_when_a_file_does() {
        let repo = tempfile::tempdir().unwrap();
        let model = repo.path().join("m/1/model.pt");
        touch(&model);
        let before = scan(repo.path()).unwrap()["m"][&1].fingerprint;
        assert_eq!(scan(repo.path()).unwrap()["m"][&1].fingerprint, before);
        std::fs::write(&model, b"a longer model").unwrap();
        assert_ne!(scan(repo.path()).unwrap()["m"][&1].fingerprint, before);
    }

    #[test]
    fn policies_pick_the_latest_or_the_named_versions() {
        let available = [1u64, 2, 5, 9];
        assert_eq!(VersionPolicy::Latest(1).select(available.into_iter()), [9]);
        assert_eq!(VersionPolicy::Latest(2).select(available.into_iter()), [5, 9]);
        assert_eq!(VersionPolicy::Latest(10).select(available.into_iter()), available);
        assert_eq!(VersionPolicy::Specific(vec![2, 7]).select(available.into_iter()), [2]);
    }

    #[test]
    fn policies_parse_and_bad_ones_say_what_is_accepted() {
        assert_eq!("latest".parse(), Ok(VersionPolicy::Latest(1)));
        assert_eq!("latest:3".parse(), Ok(VersionPolicy::Latest(3)));
        assert_eq!("specific:3, 5".parse(), Ok(VersionPolicy::Specific(vec![3, 5])));
        for bad in ["", "newest", "latest:0", "latest:x", "specific:", "specific:a"] {
            let error = bad.parse::<VersionPolicy>().unwrap_err();
            assert!(error.contains("latest:N"), "{bad}: {error}");
        }
    }
}
