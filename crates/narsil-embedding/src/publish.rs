//! Publishing by rename, as every `narsil tables` command that writes a
//! model's files does, and the server when it creates a model's push log:
//! what is written goes under a temporary name it
//! claimed exclusively ([`Claimed`]: one that exists is another run's, or
//! one a crash left, and is refused, named and left as it is), is synced,
//! then renamed into place and its directory synced ([`rename_into_place`]),
//! so that whoever reads the model (a load, a power cut) finds the old file
//! or the new one, never a part of one. What a run claimed and did not
//! publish is removed when it stops (an error, a panic); only a crash leaves
//! it behind.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// A file or directory this run created under a temporary name: removed
/// if the run stops before [`Claimed::publish`].
pub struct Claimed {
    path: PathBuf,
    directory: bool,
    published: bool,
}

impl Claimed {
    /// Creates the empty file `path`, exclusively; `writer` names the
    /// command that writes it, in the error that refuses one that exists.
    pub fn file(path: &Path, writer: &str) -> anyhow::Result<Self> {
        let created = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map(drop);
        Self::claim(path, false, writer, created)
    }

    /// Creates the directory `path`, exclusively (see [`Claimed::file`]).
    pub fn directory(path: &Path, writer: &str) -> anyhow::Result<Self> {
        Self::claim(path, true, writer, std::fs::create_dir(path))
    }

    fn claim(
        path: &Path,
        directory: bool,
        writer: &str,
        created: std::io::Result<()>,
    ) -> anyhow::Result<Self> {
        match created {
            Ok(()) => Ok(Self { path: path.to_owned(), directory, published: false }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => anyhow::bail!(
                "{} exists: another {writer} is writing it, or one was stopped by a crash or power cut and left \
                 it (it is not served, and it is left as it is). Once no run is writing it, remove it (`rm {}{}`) \
                 and run again",
                path.display(),
                if directory { "-r " } else { "" },
                path.display()
            ),
            Err(e) => Err(e).with_context(|| format!("creating {}", path.display())),
        }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames it to `to` ([`rename_into_place`]), a directory once every
    /// directory in it is synced (its files are synced as they are
    /// written).
    pub fn publish(mut self, to: &Path) -> anyhow::Result<()> {
        if self.directory {
            sync_directories(&self.path)?;
        }
        let renamed = rename_into_place(&self.path, to);
        // Renamed, even if the directory's sync then failed: not ours to
        // remove any more.
        self.published = !self.path.exists();
        renamed
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if !self.published {
            let _ = if self.directory {
                std::fs::remove_dir_all(&self.path)
            } else {
                std::fs::remove_file(&self.path)
            };
        }
    }
}

/// Renames `from` (synced) over `to` and syncs `to`'s directory: once it
/// returns, `to` is the new file (or directory) whatever happens next.
pub fn rename_into_place(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))?;
    sync_directory(to.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
}

/// `fsync`s the directory `dir` (its entries: names created, renamed,
/// removed).
pub fn sync_directory(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing the directory {}", dir.display()))
}

/// [`sync_directory`] on `dir` and every directory under it, deepest first.
fn sync_directories(dir: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            sync_directories(&entry.path())?;
        }
    }
    sync_directory(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_name_is_refused_to_a_second_claim_removed_unless_published_and_published_by_rename() {
        let dir = tempfile::tempdir().unwrap();
        let (partial, to) = (dir.path().join("f.tmp"), dir.path().join("f"));
        let claimed = Claimed::file(&partial, "`writer one`").unwrap();
        let error = format!("{:#}", Claimed::file(&partial, "`writer two`").err().unwrap());
        assert!(error.contains("f.tmp exists: another `writer two`") && error.contains("(`rm "), "{error}");
        drop(claimed);
        assert!(!partial.exists(), "removed, never published");
        let claimed = Claimed::file(&partial, "`writer`").unwrap();
        std::fs::write(claimed.path(), b"whole").unwrap();
        claimed.publish(&to).unwrap();
        assert_eq!((std::fs::read(&to).unwrap(), partial.exists()), (b"whole".to_vec(), false));

        let (partial, to) = (dir.path().join("d.partial"), dir.path().join("d"));
        let claimed = Claimed::directory(&partial, "`writer`").unwrap();
        std::fs::create_dir(partial.join("sub")).unwrap();
        std::fs::write(partial.join("sub/x"), b"x").unwrap();
        let error = format!("{:#}", Claimed::directory(&partial, "`other`").err().unwrap());
        assert!(error.contains("(`rm -r "), "{error}");
        claimed.publish(&to).unwrap();
        assert_eq!(std::fs::read(to.join("sub/x")).unwrap(), b"x");
        let claimed = Claimed::directory(&partial, "`writer`").unwrap();
        std::fs::write(partial.join("y"), b"y").unwrap();
        drop(claimed);
        assert!(!partial.exists(), "removed with what it held");
    }
}
