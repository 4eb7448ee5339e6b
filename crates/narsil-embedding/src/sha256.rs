//! SHA-256 as `schema.json` names it: 64 hex digits (lowercase when
//! written; either case when read). The one check of that format
//! ([`is_sha256`]), the one way a finished hash is written ([`hex`]), and
//! hashing a file's or a buffer's bytes: what the table files, slot
//! indexes and id maps are checked against at load, and what `narsil
//! tables` writes.

use std::io::Read;

use sha2::{Digest, Sha256};

/// Whether `text` is a SHA-256 in hex (64 hex digits).
pub fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A finished hash as the schema writes it: lowercase hex digits
/// (`hex(sha.finalize())`, `hex(Sha256::digest(bytes))`).
pub fn hex(digest: impl AsRef<[u8]>) -> String {
    digest.as_ref().iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The SHA-256 (hex, lowercase) of everything `read` yields, read through
/// a 1 MiB buffer.
pub fn sha256_of(mut read: impl Read) -> std::io::Result<String> {
    let mut sha = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        match read.read(&mut buffer) {
            Ok(0) => return Ok(hex(sha.finalize())),
            Ok(n) => sha.update(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The SHA-256 (hex, lowercase) of `bytes`.
pub fn sha256_of_bytes(bytes: &[u8]) -> String {
    hex(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sha256_is_64_hex_digits_of_either_case_and_nothing_else() {
        // SHA-256 of "abc" (FIPS 180-2's example).
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_of_bytes(b"abc"), abc);
        assert_eq!(sha256_of(&b"abc"[..]).unwrap(), abc);
        assert!(is_sha256(abc) && is_sha256(&abc.to_uppercase()));
        for not in ["", "00", &abc[1..], &format!("{abc}0"), &format!("sha256:{abc}"), &"xy".repeat(32)] {
            assert!(!is_sha256(not), "{not:?}");
        }
    }
}
