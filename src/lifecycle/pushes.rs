//! Pushed ids follow the model: every id push to a model (`POST
//! /v1/models/{model}/tables/{table}/ids`) is checked against every ready
//! version, logged ([`super::push_log`]) and then applied to each, one push
//! of the model at a time; and a version that loads (a new version, a
//! restart, a replica started later) is given the logged pushes before it
//! turns ready.
//!
//! A push goes to the model's ready versions all or none: each checks it
//! first ([`PushMode::Check`]); if one refuses, none takes it and the
//! answer says why; so does every version where they hold the table with
//! rows of different formats (one body reads as other entries in each, and
//! only one format's log would record it). Once all would take it, the body is appended to the
//! table's log and fsynced (if it adds an id to some version), and only
//! then applied: an answered push is on disk.
//!
//! A loading version replays each of its mapped tables' log (the one of
//! its rows' format; [`PushMode::Replay`]: an id it holds already, in its
//! own map or replayed before, keeps that row) while it loads and warms,
//! then, under the model's push lock, replays what was logged meanwhile and
//! turns ready before the lock is released: no push lands between the two,
//! so a version is ready with every push answered before it. The catch-up
//! reads on in the file the replay read (its device and inode, and no
//! shorter than what was replayed): a log removed or replaced meanwhile is
//! replayed again from its start, with a warning. A log of
//! another row format (a table retrained with another dim) is not
//! replayed, and is named in a warning with the ids it holds. A version
//! whose table takes no pushes (its rows on a device or outside the
//! process) serves without the logged ids, and a warning says how many.
//! Replaying past the bound on a table's pushed bytes fails the version's
//! load, naming the bound; so does a damaged log (naming it and the byte
//! offset: [`super::push_log`] cuts only the torn tail of an unfinished
//! append, and waits for an append in flight, another replica's included).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use narsil_core::{IdMapTable, IdPush, IdsPushed, PushMode};

use super::push_log::{self, Position, Read, Tail};
use super::registry::LiveVersion;

/// The flag that bounds a table's pushed bytes, named in refusals.
pub const BOUND_FLAG: &str = "--max-pushed-bytes";

/// Every model's pushes.
pub struct PushBook {
    max_bytes: u64,
    models: Mutex<HashMap<String, Arc<ModelPushes>>>,
}

/// One model's pushes: its logs' directory (none for a model whose
/// versions do not come from a local repository: pushes then live in
/// memory only), and the lock one push, or one version turning ready,
/// holds at a time.
pub struct ModelPushes {
    model: String,
    dir: OnceLock<PathBuf>,
    max_bytes: u64,
    lock: Arc<tokio::sync::Mutex<()>>,
    /// Where this process last left each log (a catch-up's read, or its
    /// own append): an append scans only what others wrote after it.
    known: Mutex<HashMap<PathBuf, Position>>,
}

impl PushBook {
    /// Pushes bounded at `max_bytes` a table and version.
    pub fn new(max_bytes: u64) -> Self {
        Self { max_bytes, models: Mutex::default() }
    }

    /// `model`'s pushes, logged in `model_dir` (its directory in the
    /// repository), which the first call that names one sets.
    pub fn model(&self, model: &str, model_dir: Option<&Path>) -> Arc<ModelPushes> {
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let entry = models.entry(model.to_owned()).or_insert_with(|| {
            Arc::new(ModelPushes {
                model: model.to_owned(),
                dir: OnceLock::new(),
                max_bytes: self.max_bytes,
                lock: Arc::new(tokio::sync::Mutex::new(())),
                known: Mutex::default(),
            })
        });
        if let Some(dir) = model_dir {
            // Set before any version of it is ready, so before any push.
            let _ = entry.dir.set(dir.to_path_buf());
        }
        Arc::clone(entry)
    }
}

/// How a push reaches one version: its engine's [`narsil_core::BackendFactory::push_ids`].
pub type PushFn<'a> = &'a (dyn Fn(&IdPush<'_>) -> Result<IdsPushed, String> + Sync);

/// One table's log as a loading version replayed it.
#[derive(Debug, Clone)]
struct TableReplay {
    table: String,
    format: String,
    path: PathBuf,
    /// Where the replay got to, in which file.
    at: Position,
    pushed: IdsPushed,
}

/// What a loading version replayed: where it goes on under the lock.
#[derive(Debug, Default)]
pub struct Replayed {
    tables: Vec<TableReplay>,
}

/// One version's part in a push.
#[derive(Debug, serde::Serialize)]
pub struct VersionPush {
    /// The version.
    pub version: String,
    /// What it took.
    #[serde(flatten)]
    pub pushed: Option<IdsPushed>,
    /// Why it refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A push's outcome.
#[derive(Debug)]
pub enum PushAnswer {
    /// Every version took it (or held it already).
    Pushed(Vec<VersionPush>),
    /// A version refused it: nothing was pushed to any (the refusals).
    Refused(Vec<VersionPush>),
    /// It could not be logged, or a version failed to apply what it had
    /// checked: the versions' outcomes, and why.
    Failed(Vec<VersionPush>, String),
}

impl ModelPushes {
    /// Holds off pushes to the model (and other versions turning ready)
    /// until the guard is dropped: a guard a blocking task can own, so that
    /// a push whose caller went away still finishes under it.
    pub async fn lock(&self) -> tokio::sync::OwnedMutexGuard<()> {
        Arc::clone(&self.lock).lock_owned().await
    }

    fn push(
        &self,
        table: &str,
        entries: &[u8],
        mode: PushMode,
        push: PushFn<'_>,
    ) -> Result<IdsPushed, String> {
        push(&IdPush { table, entries, mode, max_bytes: self.max_bytes, bound_name: BOUND_FLAG })
    }

    /// Replays the logs of version `version`'s mapped tables (`tables`)
    /// through `push`, as far as they go now; what is logged meanwhile is
    /// [`Self::catch_up`]'s. Fails naming the log when a replayed push is
    /// refused (past the bound, or a log that is not one).
    pub fn replay(&self, version: u64, tables: &[IdMapTable], push: PushFn<'_>) -> Result<Replayed, String> {
        let Some(dir) = self.dir.get() else { return Ok(Replayed::default()) };
        let model = &self.model;
        let mut replayed = Replayed::default();
        for table in tables {
            for (format, other) in push_log::logs_of(dir, &table.name) {
                if format != table.row_format {
                    warn_not_replayed(
                        model,
                        version,
                        &table.name,
                        &other,
                        &format,
                        format!(
                            "its rows are of another format than the version's table ({})",
                            table.row_format
                        ),
                    );
                }
            }
            let path = push_log::path(dir, &table.name, &table.row_format);
            if let Some(why) = &table.refused {
                warn_not_replayed(model, version, &table.name, &path, &table.row_format, why.clone());
                continue;
            }
            let mut state = TableReplay {
                table: table.name.clone(),
                format: table.row_format.clone(),
                path,
                at: Position::START,
                pushed: IdsPushed::default(),
            };
            self.replay_from(version, &mut state, false, push)?;
            replayed.tables.push(state);
        }
        Ok(replayed)
    }

    /// Replays `state`'s log from where it stopped (a torn tail cut if
    /// `cut`); its tail. A log removed or replaced since is replayed
    /// again from its start.
    fn replay_from(
        &self,
        version: u64,
        state: &mut TableReplay,
        cut: bool,
        push: PushFn<'_>,
    ) -> Result<Tail, String> {
        loop {
            let mut each = |entries: &[u8]| {
                let pushed = self.push(&state.table, entries, PushMode::Replay, push)?;
                state.pushed.added += pushed.added;
                state.pushed.already_held += pushed.already_held;
                state.pushed.superseded += pushed.superseded;
                (state.pushed.pushed, state.pushed.bytes) = (pushed.pushed, pushed.bytes);
                Ok(())
            };
            let read = if cut {
                push_log::read_and_cut(&state.path, &state.format, state.at, &mut each)
            } else {
                push_log::read(&state.path, &state.format, state.at, &mut each)
            };
            match read.map_err(|why| format!("replaying the push log {}: {why}", state.path.display()))? {
                Read::To(to) => {
                    state.at = to.at;
                    return Ok(to.tail);
                }
                Read::Replaced(why) => {
                    tracing::warn!(
                        model = %self.model, version, table = %state.table, log = %state.path.display(),
                        "the push log was removed or replaced while the version loaded ({why}): replaying \
                         the file now at its path from its start (ids replayed from the one it replaced stay \
                         in this version until it reloads)"
                    );
                    state.at = Position::START;
                }
            }
        }
    }

    /// Under the model's push lock ([`Self::lock`]): replays what was
    /// logged since [`Self::replay`] (a torn tail, an append that never
    /// finished, cut with a warning), and says what the version was given.
    pub fn catch_up(&self, version: u64, replayed: &mut Replayed, push: PushFn<'_>) -> Result<(), String> {
        for state in &mut replayed.tables {
            self.replay_from(version, state, true, push)?;
            if state.at.identity.is_some() {
                self.known.lock().unwrap_or_else(|e| e.into_inner()).insert(state.path.clone(), state.at);
            }
            let p = &state.pushed;
            if p.added + p.already_held + p.superseded > 0 {
                tracing::info!(
                    model = %self.model, version, table = %state.table, added = p.added,
                    already_held = p.already_held, superseded_by_own_rows = p.superseded,
                    pushed = p.pushed, bytes = p.bytes, "pushed ids replayed from the push log"
                );
            }
        }
        Ok(())
    }

    /// Under the model's push lock: pushes `entries` to table `table` of
    /// every version of `versions` (the model's ready ones) as the module
    /// says: checked by all, logged, applied to all.
    pub fn push_to(&self, versions: &[Arc<LiveVersion>], table: &str, entries: &[u8]) -> PushAnswer {
        let push_of = |live: &LiveVersion| {
            let engine = live.engine.clone();
            move |push: &IdPush<'_>| engine.push_ids(push)
        };
        let formats: Vec<(String, String)> = versions
            .iter()
            .filter_map(|live| {
                let tables = live.engine.id_map_tables();
                let format = tables.into_iter().find(|t| t.name == table)?.row_format;
                Some((live.number.to_string(), format))
            })
            .collect();
        if let Some(refusals) = formats_disagree(table, &formats) {
            return PushAnswer::Refused(refusals);
        }
        let mut refusals = Vec::new();
        let mut adds = None;
        for live in versions {
            match self.push(table, entries, PushMode::Check, &push_of(live)) {
                Err(why) => refusals.push(VersionPush {
                    version: live.number.to_string(),
                    pushed: None,
                    error: Some(why),
                }),
                Ok(checked) if checked.added > 0 && adds.is_none() => adds = Some(live),
                Ok(_) => {}
            }
        }
        if !refusals.is_empty() {
            return PushAnswer::Refused(refusals);
        }
        if let (Some(dir), Some(live)) = (self.dir.get(), adds) {
            let format =
                live.engine.id_map_tables().into_iter().find(|t| t.name == table).map(|t| t.row_format);
            let Some(format) = format else {
                return PushAnswer::Failed(
                    Vec::new(),
                    format!("version {} lists no mapped table {table:?}", live.number),
                );
            };
            let path = push_log::path(dir, table, &format);
            let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
            let at = known.entry(path.clone()).or_insert(Position::START);
            if let Err(e) = push_log::append(&path, &format, entries, at) {
                return PushAnswer::Failed(Vec::new(), format!("nothing pushed: {e}"));
            }
        }
        let mut outcomes = Vec::new();
        let mut failure = None;
        for live in versions {
            let version = live.number.to_string();
            match self.push(table, entries, PushMode::Apply, &push_of(live)) {
                Ok(pushed) => outcomes.push(VersionPush { version, pushed: Some(pushed), error: None }),
                Err(why) => {
                    failure.get_or_insert_with(|| {
                        format!("version {version} refused a push it had taken when checked: {why}")
                    });
                    outcomes.push(VersionPush { version, pushed: None, error: Some(why) });
                }
            }
        }
        match failure {
            None => PushAnswer::Pushed(outcomes),
            Some(why) => PushAnswer::Failed(outcomes, why),
        }
    }
}

/// Where the ready versions' tables `table` hold rows of different
/// formats (`formats`: each version's; a table retrained with another dim
/// beside the old one), a refusal for each: one push body reads as other
/// entries in each format, and only one format's log would record it.
fn formats_disagree(table: &str, formats: &[(String, String)]) -> Option<Vec<VersionPush>> {
    let (_, first) = formats.first()?;
    if formats.iter().all(|(_, format)| format == first) {
        return None;
    }
    let each: Vec<String> =
        formats.iter().map(|(version, format)| format!("version {version}: {format}")).collect();
    let why = format!(
        "the ready versions hold table {table:?} with rows of different formats ({}): a push's body reads \
         as different entries in each, so none takes it; push once one format serves (retire the other \
         versions, or push after the switch)",
        each.join(", ")
    );
    Some(
        formats
            .iter()
            .map(|(version, _)| VersionPush {
                version: version.clone(),
                pushed: None,
                error: Some(why.clone()),
            })
            .collect(),
    )
}

/// Warns that version `version` does not serve the ids of the log at
/// `path` (of rows in `format`), and why.
fn warn_not_replayed(model: &str, version: u64, table: &str, path: &Path, format: &str, why: String) {
    let Ok(bytes) = push_log::payload_bytes(path) else { return };
    let row_bytes: u64 = format.rsplit('-').next().and_then(|b| b.parse().ok()).unwrap_or(0);
    let ids = bytes / (8 + row_bytes);
    if ids == 0 {
        return;
    }
    tracing::warn!(
        model, version, table, log = %path.display(), ids,
        reason = %why,
        "pushed ids of the push log not replayed into this version: it serves them from its default row"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMAT: &str = "fp32-4-16";

    /// A model's pushes logged in `dir`, its one table `t`, and a version
    /// that takes every push (what it was given, in order).
    fn model(dir: &Path) -> (Arc<ModelPushes>, Vec<IdMapTable>) {
        let pushes = PushBook::new(1 << 30).model("m", Some(dir));
        let table = IdMapTable { name: "t".into(), row_format: FORMAT.into(), refused: None };
        (pushes, vec![table])
    }

    fn taking(given: &Mutex<Vec<Vec<u8>>>) -> impl Fn(&IdPush<'_>) -> Result<IdsPushed, String> + Sync + '_ {
        move |push: &IdPush<'_>| {
            given.lock().unwrap().push(push.entries.to_vec());
            Ok(IdsPushed { added: 1, ..IdsPushed::default() })
        }
    }

    fn log_with(log: &Path, payloads: &[&str]) {
        let _ = std::fs::remove_file(log);
        for payload in payloads {
            push_log::append(log, FORMAT, payload.as_bytes(), &mut { Position::START }).unwrap();
        }
    }

    fn given(given: &Mutex<Vec<Vec<u8>>>) -> Vec<String> {
        given.lock().unwrap().drain(..).map(|p| String::from_utf8(p).unwrap()).collect()
    }

    #[test]
    fn a_push_is_refused_by_every_version_where_their_tables_row_formats_differ() {
        let formats = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter().map(|(v, f)| (v.to_string(), f.to_string())).collect()
        };
        assert!(super::formats_disagree("t", &formats(&[("1", FORMAT), ("2", FORMAT)])).is_none());
        assert!(super::formats_disagree("t", &[]).is_none());
        let refused =
            super::formats_disagree("t", &formats(&[("1", FORMAT), ("2", "int8_rowwise-128-168")])).unwrap();
        assert_eq!(refused.iter().map(|r| r.version.as_str()).collect::<Vec<_>>(), ["1", "2"]);
        let why = refused[0].error.as_deref().unwrap();
        assert!(
            why.contains("\"t\"") && why.contains(FORMAT) && why.contains("int8_rowwise-128-168"),
            "{why}"
        );
    }

    #[test]
    fn a_log_replaced_shorter_or_longer_between_replay_and_catch_up_is_replayed_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let (pushes, tables) = model(dir.path());
        let log = push_log::path(dir.path(), "t", FORMAT);
        for new in [&["new"][..], &["new 1", "new 2", "new 3", "new 4", "new 5", "new 6"]] {
            log_with(&log, &["old 1", "old 2", "old 3"]);
            let seen = Mutex::default();
            let mut replayed = pushes.replay(1, &tables, &taking(&seen)).unwrap();
            assert_eq!(given(&seen), ["old 1", "old 2", "old 3"]);
            // Removed and written again while the version warms.
            log_with(&log, new);
            pushes.catch_up(1, &mut replayed, &taking(&seen)).unwrap();
            assert_eq!(given(&seen), *new, "the new log's pushes, whole, once");
            // A push after it lands after the new log's records.
            push_log::append(&log, FORMAT, b"pushed", &mut { Position::START }).unwrap();
            let mut again = pushes.replay(2, &tables, &taking(&seen)).unwrap();
            pushes.catch_up(2, &mut again, &taking(&seen)).unwrap();
            assert_eq!(given(&seen).last().map(String::as_str), Some("pushed"));
        }
    }

    #[test]
    fn a_catch_up_cuts_a_torn_tail_and_a_damaged_log_fails_the_load_naming_it_and_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let (pushes, tables) = model(dir.path());
        let log = push_log::path(dir.path(), "t", FORMAT);
        log_with(&log, &["one", "two"]);
        let whole = std::fs::metadata(&log).unwrap().len();
        // An append of 100 bytes, its header and 8 bytes written.
        let mut torn = 100u64.to_le_bytes().to_vec();
        torn.extend((!100u64).to_le_bytes());
        torn.extend([7; 24]);
        std::io::Write::write_all(&mut std::fs::OpenOptions::new().append(true).open(&log).unwrap(), &torn)
            .unwrap();
        let seen = Mutex::default();
        let mut replayed = pushes.replay(1, &tables, &taking(&seen)).unwrap();
        assert_eq!(std::fs::metadata(&log).unwrap().len(), whole + 40, "a replay cuts nothing");
        pushes.catch_up(1, &mut replayed, &taking(&seen)).unwrap();
        assert_eq!(
            (given(&seen), std::fs::metadata(&log).unwrap().len()),
            (vec!["one".into(), "two".into()], whole)
        );
        // A flipped bit in the first record.
        let mut bytes = std::fs::read(&log).unwrap();
        bytes[push_log::HEADER_BYTES as usize + 32] ^= 4;
        std::fs::write(&log, &bytes).unwrap();
        let error = pushes.replay(2, &tables, &taking(&seen)).unwrap_err();
        assert!(error.contains(&log.display().to_string()), "{error}");
        assert!(error.contains(&format!("damaged at byte {}:", push_log::HEADER_BYTES)), "{error}");
        assert_eq!(std::fs::read(&log).unwrap(), bytes, "left as it is");
    }
}
