//! The model-control token (`--control-token-file`): read once at start
//! from a file (so it is never on a command line), kept only as its SHA-256
//! digest, never printed (its `Debug` says `<redacted>`), and compared with
//! what a call presents in constant time: the presented token is hashed
//! and the two digests compared with `subtle`, so neither the token's
//! content nor its length shows in how long a refusal takes.

use std::path::Path;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The bearer token the control calls must present.
#[derive(Clone)]
pub struct ControlToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for ControlToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlToken(<redacted>)")
    }
}

/// Why a token file was refused; names the file, never its content.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    #[error("cannot read --control-token-file {path}: {source}")]
    Unreadable { path: String, source: std::io::Error },
    #[error("--control-token-file {path} is empty")]
    Empty { path: String },
    #[error(
        "--control-token-file {path} holds characters other than printable ASCII (no spaces): \
         a token a client cannot send in an `Authorization: Bearer` header"
    )]
    Unsendable { path: String },
}

impl ControlToken {
    /// Reads the token from `path`: its content less trailing line ends
    /// (`\n`, `\r\n`). Refuses a file that cannot be read, is empty, or
    /// holds a token no HTTP header can carry.
    pub fn read(path: &Path) -> Result<Self, TokenFileError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path)
            .map_err(|source| TokenFileError::Unreadable { path: shown.clone(), source })?;
        let mut secret = bytes.as_slice();
        while let [rest @ .., b'\n' | b'\r'] = secret {
            secret = rest;
        }
        if secret.is_empty() {
            return Err(TokenFileError::Empty { path: shown });
        }
        if !secret.iter().all(|b| b.is_ascii_graphic()) {
            return Err(TokenFileError::Unsendable { path: shown });
        }
        Ok(Self::from_secret(secret))
    }

    /// The token `secret` (for tests and embedding).
    pub fn from_secret(secret: &[u8]) -> Self {
        Self { digest: Sha256::digest(secret).into() }
    }

    /// Whether `presented` is the token, in time independent of both.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        digest.ct_eq(&self.digest).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(content: &[u8]) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), content).unwrap();
        file
    }

    #[test]
    fn a_token_file_s_trailing_newline_is_not_part_of_the_token() {
        let token = ControlToken::read(file(b"s3cret-token\r\n").path()).unwrap();
        assert!(token.matches(b"s3cret-token"));
        assert!(!token.matches(b"s3cret-token\r\n"));
        assert!(!token.matches(b"s3cret-toke"));
        assert!(!token.matches(b""));
    }

    #[test]
    fn empty_unreadable_or_unsendable_token_files_are_refused_naming_the_file_not_the_content() {
        let empty = file(b"\n");
        let err = ControlToken::read(empty.path()).unwrap_err().to_string();
        assert!(err.contains("--control-token-file") && err.contains("is empty"), "{err}");
        assert!(err.contains(&empty.path().display().to_string()), "{err}");
        let err = ControlToken::read(Path::new("/nonexistent/narsil-token")).unwrap_err().to_string();
        assert!(err.starts_with("cannot read --control-token-file /nonexistent/narsil-token"), "{err}");
        let spaced = file(b"two words\n");
        let err = ControlToken::read(spaced.path()).unwrap_err().to_string();
        assert!(err.contains("printable ASCII") && !err.contains("two words"), "{err}");
    }

    #[test]
    fn the_token_never_shows_in_debug_output() {
        let token = ControlToken::from_secret(b"hunter2-hunter2");
        let shown = format!("{token:?} {:?}", Some(&token));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }
}
