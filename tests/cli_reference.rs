//! The reference pages that are checked against the code:
//!
//! * `docs/reference/cli.md` is the binary's own `--help`, for `narsil` and
//!   every command under it. The commands are read from the `Commands:`
//!   section of each help text (nested ones such as `narsil tables load`
//!   included), so a new command is picked up by itself. clap is built
//!   without its `wrap_help` feature, so no line depends on the terminal's
//!   width; the `NARSIL_…` variables are removed (clap prints an
//!   environment variable's value beside its flag) and colour is off. The
//!   page documents the binary `scripts/serve.sh` builds (`--features
//!   torch`), so it is compared in that build only. When it differs,
//!   regenerate it with
//!   `NARSIL_BLESS=1 cargo test --features torch --test cli_reference`.
//! * `docs/reference/metrics.md` names every metric the code registers.
//!   The metrics are prometheus-client families registered as
//!   `registry.register("NAME", help, metric)` or
//!   `registry.register_with_unit("NAME", help, Unit::U, metric)` on
//!   registries made with `Registry::with_prefix("narsil")` (or
//!   `with_prefix_and_labels`), so the code holds no full metric name: the
//!   test scans every `.rs` file under `src/` and `crates/*/src/` for those
//!   calls with a string literal as their first argument, and composes
//!   `narsil_NAME` (`narsil_NAME_UNIT` with a unit) as the exposition does.
//!   Counters are exposed with `_total` appended; the page may name either.
//!   It fails if a registry is made with another prefix or a unit it does
//!   not know, rather than guess, and the other way round if the page's
//!   tables name a metric the code no longer registers.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const CLI_PAGE: &str = "docs/reference/cli.md";
const METRICS_PAGE: &str = "docs/reference/metrics.md";
const BLESS: &str = "NARSIL_BLESS=1 cargo test --features torch --test cli_reference";

fn repo_file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// `narsil ARGS --help`, as a user with no `NARSIL_…` variables set sees it
/// through a pipe, with trailing spaces removed from every line.
fn help(args: &[&str]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_narsil"));
    command.args(args).arg("--help");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NARSIL_") {
            command.env_remove(key);
        }
    }
    command.env_remove("CLICOLOR_FORCE").env("NO_COLOR", "1").env_remove("COLUMNS");
    let output = command.output().expect("run the narsil binary");
    assert!(
        output.status.success(),
        "narsil {} --help failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("help is UTF-8");
    let mut lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    while lines.last().is_some_and(|line| line.is_empty()) {
        lines.pop();
    }
    lines.join("\n")
}

/// The commands a help text lists under `Commands:` (one per line, the name
/// first), `help` left out.
fn subcommands(help: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_section = false;
    for line in help.lines() {
        if line == "Commands:" {
            in_section = true;
        } else if in_section {
            if line.is_empty() || !line.starts_with("  ") {
                break;
            }
            let entry = &line[2..];
            if entry.starts_with(' ') {
                continue; // a continuation of the line above
            }
            let name = entry.split_whitespace().next().unwrap_or_default();
            if name != "help" {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// `narsil` and every command under it, parents before children, each with
/// its help text.
fn every_command() -> Vec<(Vec<String>, String)> {
    let mut found = Vec::new();
    let mut pending = vec![Vec::<String>::new()];
    while let Some(path) = pending.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        // Children in the order the help lists them (the stack reverses).
        for name in subcommands(&text).into_iter().rev() {
            let mut child = path.clone();
            child.push(name);
            pending.push(child);
        }
        found.push((path, text));
    }
    found
}

/// The page: every command's help in a code block, in the order `narsil
/// --help` lists them.
fn cli_page() -> String {
    let commands = every_command();
    let title = |path: &[String]| {
        std::iter::once("narsil").chain(path.iter().map(String::as_str)).collect::<Vec<_>>().join(" ")
    };
    let mut page = String::new();
    page.push_str("# Command-line reference\n\n");
    page.push_str(
        "<!-- Generated from the binary's --help by tests/cli_reference.rs, which fails when this \
         page differs; do not edit it by hand. Regenerate: ",
    );
    page.push_str(BLESS);
    page.push_str(" -->\n\n");
    page.push_str(
        "Every command of `narsil` (built with `--features torch`, as `scripts/serve.sh` builds \
         it) and every flag, as `--help` prints them: the default, the allowed values and the \
         environment variable each flag also reads, if any. The user guide explains what they \
         are for.\n\n",
    );
    for (path, _) in &commands {
        let name = title(path);
        let anchor = name.replace(' ', "-");
        page.push_str(&format!("* [`{name}`](#{anchor})\n"));
    }
    for (path, text) in &commands {
        page.push_str(&format!("\n## {}\n\n```text\n{text}\n```\n", title(path)));
    }
    page
}

#[test]
fn cli_reference_matches_help() {
    if !cfg!(feature = "torch") {
        common::skip("cli_reference_matches_help", "the page documents the --features torch build");
        return;
    }
    let fresh = cli_page();
    let path = repo_file(CLI_PAGE);
    if std::env::var_os("NARSIL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &fresh).expect("write the CLI reference");
        println!("wrote {}", path.display());
        return;
    }
    let stored = std::fs::read_to_string(&path).unwrap_or_default().replace("\r\n", "\n");
    if stored != fresh {
        let line = stored
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| stored.lines().count().min(fresh.lines().count()));
        panic!(
            "{CLI_PAGE} is not what the binary's --help prints (first difference at line {}):\n  \
             page:   {:?}\n  binary: {:?}\nRegenerate it with: {BLESS}",
            line + 1,
            stored.lines().nth(line).unwrap_or("<end of page>"),
            fresh.lines().nth(line).unwrap_or("<end of help>"),
        );
    }
}

#[test]
fn subcommands_are_read_from_the_commands_section() {
    let text = "Usage: narsil [OPTIONS] <COMMAND>\n\nCommands:\n  serve          Serve a model\n  \
                tables         Manage tables\n  help           Print this message\n\nOptions:\n  \
                -h, --help\n";
    assert_eq!(subcommands(text), ["serve", "tables"]);
    assert!(subcommands("Usage: narsil load [OPTIONS]\n\nOptions:\n  -h, --help\n").is_empty());
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries {
        let path = entry.expect("read a source directory").path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// The source files the metrics are registered in: `src/` and every
/// workspace crate's `src/`.
fn source_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&repo_file("src"), &mut files);
    let crates = std::fs::read_dir(repo_file("crates")).expect("crates/");
    for krate in crates {
        rust_files(&krate.expect("a crate directory").path().join("src"), &mut files);
    }
    files.sort();
    files
}

/// The string literal `text` starts with (after whitespace), if it does.
fn leading_literal(text: &str) -> Option<&str> {
    let rest = text.trim_start().strip_prefix('"')?;
    rest.find('"').map(|end| &rest[..end])
}

/// The arguments of the call whose `(` was just before `text` (brackets
/// inside string literals not counted).
fn call_arguments(text: &str) -> &str {
    let mut depth = 1usize;
    let (mut in_string, mut escaped) = (false, false);
    for (at, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    return &text[..at];
                }
            }
            _ => {}
        }
    }
    text
}

/// Every metric name registered in `source` (a file's text), as exposed.
fn registered_in(source: &str, file: &Path) -> Vec<String> {
    for constructor in ["with_prefix(", "with_prefix_and_labels("] {
        for (at, _) in source.match_indices(constructor) {
            let prefix = leading_literal(&source[at + constructor.len()..]);
            assert_eq!(
                prefix,
                Some("narsil"),
                "{}: a metrics registry with another prefix than `narsil`; teach tests/cli_reference.rs \
                 its names",
                file.display()
            );
        }
    }
    let mut names = Vec::new();
    for (call, with_unit) in [(".register(", false), (".register_with_unit(", true)] {
        for (at, _) in source.match_indices(call) {
            let arguments = call_arguments(&source[at + call.len()..]);
            let Some(name) = leading_literal(arguments) else { continue };
            let mut metric = format!("narsil_{name}");
            if with_unit {
                let unit = arguments
                    .split("Unit::")
                    .nth(1)
                    .map(|rest| rest.chars().take_while(|c| c.is_alphanumeric()).collect::<String>())
                    .unwrap_or_default();
                assert!(
                    !unit.is_empty() && unit != "Other",
                    "{}: metric `{name}` has a unit tests/cli_reference.rs does not know",
                    file.display()
                );
                metric = format!("{metric}_{}", unit.to_ascii_lowercase());
            }
            names.push(metric);
        }
    }
    names
}

fn registered_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in source_files() {
        let source = std::fs::read_to_string(&file).expect("read a source file");
        names.extend(registered_in(&source, &file));
    }
    names
}

/// Whether `page` names `metric` as a metric: in backticks, alone, with
/// `_total`, or with labels.
fn names_metric(page: &str, metric: &str) -> bool {
    ["`", "{", "_total`", "_total{"].iter().any(|end| page.contains(&format!("`{metric}{end}")))
}

#[test]
fn every_registered_metric_is_in_the_metrics_reference() {
    let names = registered_metrics();
    // The scan itself must keep finding the registrations: a change in how
    // metrics are registered should fail here, not pass with nothing found.
    for expected in ["narsil_requests", "narsil_request_seconds", "narsil_table_ids", "narsil_model_loads"] {
        assert!(names.contains(expected), "the scan no longer finds `{expected}`; found {names:?}");
    }
    let page = std::fs::read_to_string(repo_file(METRICS_PAGE)).expect("docs/reference/metrics.md");
    let missing: Vec<&String> = names.iter().filter(|name| !names_metric(&page, name)).collect();
    assert!(missing.is_empty(), "{METRICS_PAGE} does not document {missing:?} (registered in the code)");
}

#[test]
fn the_metrics_reference_names_only_registered_metrics() {
    let names = registered_metrics();
    let page = std::fs::read_to_string(repo_file(METRICS_PAGE)).expect("docs/reference/metrics.md");
    let mut stale = Vec::new();
    for row in page.lines().filter(|line| line.starts_with("| `narsil_")) {
        let first_cell = row.split('|').nth(1).unwrap_or_default();
        for quoted in first_cell.split('`').skip(1).step_by(2) {
            let metric = quoted.split('{').next().unwrap_or_default();
            let base = metric.strip_suffix("_total").unwrap_or(metric);
            if !names.contains(metric) && !names.contains(base) {
                stale.push(metric.to_string());
            }
        }
    }
    assert!(stale.is_empty(), "{METRICS_PAGE} names metrics the code does not register: {stale:?}");
}

#[test]
fn registrations_are_read_with_their_prefix_and_unit() {
    let source = r#"
        let mut registry = Registry::with_prefix("narsil");
        registry.register("forwards", "Forward passes run", self.forwards.clone());
        registry.register_with_unit(
            "queue",
            "Time from admission (a bracket in a string: ) to the start",
            Unit::Seconds,
            self.queue_seconds.clone(),
        );
        stage.metrics().register(&mut registry);
    "#;
    assert_eq!(registered_in(source, Path::new("x.rs")), ["narsil_forwards", "narsil_queue_seconds"]);
}
