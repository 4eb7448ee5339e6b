//! Tests that cannot run on every machine (no exported test model, no INT8
//! instructions, a file system without direct I/O) say so and return, or
//! fail where the machine must run them: CI sets a `NARSIL_REQUIRE_*`
//! switch to `1` where it can (`.ci/run`), so that no such test passes
//! there by not running.

/// For a test that cannot run here: prints `skipped: TEST: WHY` and the
/// caller returns; or, where the environment sets `switch` to `1`, fails
/// the test instead.
pub fn skip_or_fail(switch: &str, test: &str, why: &str) {
    skip_or_fail_as(std::env::var(switch).ok().as_deref(), switch, test, why);
}

/// [`skip_or_fail`] given the switch's value.
pub fn skip_or_fail_as(value: Option<&str>, switch: &str, test: &str, why: &str) {
    if value == Some("1") {
        panic!("{test}: {why}, and {switch}=1 forbids skipping it");
    }
    eprintln!("skipped: {test}: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_fails_where_its_switch_says_the_test_must_run() {
        let skip =
            |value| std::panic::catch_unwind(|| skip_or_fail_as(value, "NARSIL_REQUIRE_X", "t", "no x here"));
        assert!(skip(None).is_ok(), "unset: a skip");
        assert!(skip(Some("0")).is_ok(), "not 1: a skip");
        let failed = skip(Some("1")).expect_err("set: a failure");
        let message = failed.downcast_ref::<String>().cloned().unwrap_or_default();
        assert_eq!(message, "t: no x here, and NARSIL_REQUIRE_X=1 forbids skipping it");
    }
}
