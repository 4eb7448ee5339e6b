//! What the libtorch backend's integration tests share.

/// For a test that cannot run here (no exported test model, no INT8
/// instructions): prints `skipped: TEST: WHY` and the caller returns; or,
/// where the environment sets `switch` to `1` (CI sets it where its machine
/// can run the test: `.ci/run`), fails the test instead, so that it never
/// passes by not running there.
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
