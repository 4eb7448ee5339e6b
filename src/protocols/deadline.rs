//! Reads the caller's deadline from the `grpc-timeout` header.

use std::time::{Duration, Instant};

/// Parses a `grpc-timeout` value: up to 8 digits and a unit
/// (H, M, S, m, u, n). `None` when absent or malformed.
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// How much earlier than the caller's deadline Narsil gives up. tonic's
/// transport also times calls out from `grpc-timeout`, answering CANCELLED;
/// with 1 ms timer ticks, answering 2 ms early makes sure the caller gets
/// Narsil's DEADLINE_EXCEEDED instead.
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(2);

/// The instant Narsil stops working on the call: the caller's deadline,
/// counted from `received`, less [`DEADLINE_MARGIN`].
pub fn deadline_of<T>(request: &tonic::Request<T>, received: Instant) -> Option<Instant> {
    let header = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    parse_grpc_timeout(header).map(|timeout| received + timeout.saturating_sub(DEADLINE_MARGIN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_parses() {
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("4S"), Some(Duration::from_secs(4)));
        assert_eq!(parse_grpc_timeout("500m"), Some(Duration::from_millis(500)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
    }

    #[test]
    fn malformed_values_are_ignored() {
        for bad in ["", "m", "10", "10x", "-1S", "123456789S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
    }
}
