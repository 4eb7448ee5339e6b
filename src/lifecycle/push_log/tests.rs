//! The push log's reader and writer rules: records read back from any
//! record, only a torn tail cut, damage refused naming the file and the
//! offset, a log replaced noticed, and appends and creations by several
//! writers (threads here, as replicas are processes) all kept.

use std::io::Write;

use super::*;

const FORMAT: &str = "fp32-4-16";

fn records(path: &Path, from: Position) -> (Vec<Vec<u8>>, ReadTo) {
    let mut read_back = Vec::new();
    let read = read(path, FORMAT, from, |payload| {
        read_back.push(payload.to_vec());
        Ok(())
    });
    match read.unwrap() {
        Read::To(to) => (read_back, to),
        Read::Replaced(why) => panic!("replaced: {why}"),
    }
}

fn append_all(path: &Path, payloads: &[&[u8]]) -> Position {
    let mut known = Position::START;
    for payload in payloads {
        append(path, FORMAT, payload, &mut known).unwrap();
    }
    known
}

fn len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

#[test]
fn appended_records_read_back_in_order_from_any_record_and_a_missing_log_is_empty() {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "cat_3", "int8_rowwise-64-80");
    assert_eq!(log, dir.path().join(".pushed-ids/cat_3.int8_rowwise-64-80.log"));
    let missing = path(dir.path(), "t", FORMAT);
    assert_eq!(records(&missing, Position::START).1.records, 0);
    let log = missing;
    let known = append_all(&log, &[b"first push", b"", b"third"]);
    let (all, to) = records(&log, Position::START);
    assert_eq!(all, [b"first push".to_vec(), Vec::new(), b"third".to_vec()]);
    assert_eq!((to.records, to.tail, to.at), (3, Tail::Clean, known));
    assert_eq!(to.at.end, len(&log));
    let after_first = Position { end: HEADER_BYTES + 32 + 10, identity: to.at.identity };
    assert_eq!(records(&log, after_first).0, [Vec::new(), b"third".to_vec()]);
    assert_eq!(payload_bytes(&log).unwrap(), 15);
    // Another format's reader refuses the file, naming it.
    let error = read(&log, "fp32-16-64", Position::START, |_| Ok(())).unwrap_err();
    assert!(error.contains("t.fp32-4-16.log") && error.contains("header differs"), "{error}");
    assert_eq!(logs_of(dir.path(), "t"), [(FORMAT.to_owned(), log.clone())]);
    let staging: Vec<_> =
        std::fs::read_dir(log.parent().unwrap()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(staging.len(), 1, "no staging file left: {staging:?}");
}

#[test]
fn only_a_final_record_the_file_ends_inside_of_is_torn_left_by_a_read_and_cut_by_the_next_append() {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "t", FORMAT);
    append_all(&log, &[b"whole"]);
    let whole = len(&log);
    let mut known = append_all(&log, &[b"cut short by a crash"]);
    let full = std::fs::read(&log).unwrap();
    for cut_at in [whole + 3, whole + 32, whole + 32 + 4, full.len() as u64 - 1] {
        std::fs::write(&log, &full[..cut_at as usize]).unwrap();
        let (read_back, to) = records(&log, Position::START);
        assert_eq!(read_back, [b"whole".to_vec()], "cut at {cut_at}");
        assert_eq!((to.at.end, to.tail), (whole, Tail::Torn { bytes: cut_at - whole }));
        assert_eq!(len(&log), cut_at, "a read cuts nothing");
    }
    // The next append (of a writer that knew the longer log) cuts it first.
    append(&log, FORMAT, b"after the cut", &mut known).unwrap();
    let (read_back, to) = records(&log, Position::START);
    assert_eq!(read_back, [b"whole".to_vec(), b"after the cut".to_vec()]);
    assert_eq!((to.tail, to.at), (Tail::Clean, known));
    // A cutting read cuts a torn tail too.
    std::fs::OpenOptions::new().append(true).open(&log).unwrap().write_all(&[9; 20]).unwrap();
    let Read::To(to) = read_and_cut(&log, FORMAT, Position::START, |_| Ok(())).unwrap() else { panic!() };
    assert_eq!((to.records, to.tail, len(&log)), (2, Tail::Torn { bytes: 20 }, to.at.end));
}

/// A log of 1,000 records, the offset of record `k` (from 0) and the
/// offset of its payload.
fn thousand_records(dir: &Path) -> (PathBuf, Vec<u64>) {
    let log = path(dir, "t", FORMAT);
    let mut known = Position::START;
    let mut offsets = Vec::new();
    for k in 0..1000u32 {
        offsets.push(known.end);
        append(&log, FORMAT, format!("push number {k}").as_bytes(), &mut known).unwrap();
    }
    (log, offsets)
}

fn flip(log: &Path, at: u64, bit: u8) {
    let file = File::options().read(true).write(true).open(log).unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    byte[0] ^= 1 << bit;
    file.write_all_at(&byte, at).unwrap();
}

#[test]
fn a_flipped_bit_in_record_3_of_1000_refuses_reads_and_appends_naming_the_file_and_offset_and_cuts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (log, offsets) = thousand_records(dir.path());
    let whole = len(&log);
    let record_3 = offsets[2];
    // In its payload, in its checksum, in its length (a low bit: a record
    // that seems shorter; a high bit: one that seems to run past the end),
    // in the length's guard.
    for (at, bit) in
        [(record_3 + 40, 0), (record_3 + 20, 5), (record_3, 0), (record_3 + 2, 7), (record_3 + 9, 3)]
    {
        flip(&log, at, bit);
        let mut read_back = 0;
        for cut in [false, true] {
            let read = read_with(&log, FORMAT, Position::START, cut, &mut |_| {
                read_back += 1;
                Ok(())
            });
            let error = read.unwrap_err();
            assert!(error.contains(&log.display().to_string()), "{error}");
            assert!(error.contains(&format!("damaged at byte {record_3}:")), "flip at {at}: {error}");
            assert!(error.contains(&format!("truncate -s {record_3} ")), "{error}");
        }
        assert_eq!(read_back, 2 * 2, "the two records before it, read by each read");
        let error = append(&log, FORMAT, b"one more", &mut { Position::START }).unwrap_err();
        assert!(error.contains(&format!("damaged at byte {record_3}:")), "{error}");
        assert_eq!(len(&log), whole, "nothing cut, nothing appended");
        flip(&log, at, bit);
        assert_eq!(records(&log, Position::START).1.records, 1000);
    }
}

#[test]
fn a_whole_length_final_record_whose_checksum_differs_is_damage_not_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (log, offsets) = thousand_records(dir.path());
    let last = offsets[999];
    flip(&log, len(&log) - 1, 0);
    let error = read_and_cut(&log, FORMAT, Position::START, |_| Ok(())).unwrap_err();
    assert!(
        error.contains(&format!("damaged at byte {last}:")) && error.contains("0 bytes follow"),
        "{error}"
    );
    assert_eq!(len(&log), last + 32 + "push number 999".len() as u64, "not cut");
}

#[test]
fn zeros_from_a_record_start_to_the_end_are_a_torn_tail_and_zeros_with_data_after_are_damage() {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "t", FORMAT);
    append_all(&log, &[b"whole"]);
    let whole = len(&log);
    // What a file system may show of an append a power cut stopped.
    File::options().write(true).open(&log).unwrap().set_len(whole + 500).unwrap();
    let Read::To(to) = read_and_cut(&log, FORMAT, Position::START, |_| Ok(())).unwrap() else { panic!() };
    assert_eq!((to.records, to.tail, len(&log)), (1, Tail::Torn { bytes: 500 }, whole));
    File::options().write(true).open(&log).unwrap().set_len(whole + 40).unwrap();
    append_all(&log, &[b"after zeros"]);
    // (the append cut the zeros first)
    assert_eq!(records(&log, Position::START).1.records, 2);
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.splice(whole as usize..whole as usize, [0u8; 40]);
    std::fs::write(&log, &bytes).unwrap();
    let error = read(&log, FORMAT, Position::START, |_| Ok(())).unwrap_err();
    assert!(error.contains(&format!("damaged at byte {whole}:")), "{error}");
}

#[test]
fn a_log_of_the_first_layout_is_read_and_appended_to_in_its_layout() {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "t", FORMAT);
    std::fs::create_dir_all(log.parent().unwrap()).unwrap();
    let mut bytes = format::header(FORMAT, Layout::Unguarded, [0; 16]).unwrap().to_vec();
    bytes.extend(format::record(Layout::Unguarded, b"old"));
    std::fs::write(&log, &bytes).unwrap();
    append_all(&log, &[b"new"]);
    assert_eq!(records(&log, Position::START).0, [b"old".to_vec(), b"new".to_vec()]);
    assert_eq!(len(&log), HEADER_BYTES + 2 * 24 + 6);
}

#[test]
fn a_read_that_goes_on_from_a_log_removed_or_replaced_shorter_or_longer_says_so_and_a_writer_scans_the_new_one(
) {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "t", FORMAT);
    let mut writer = append_all(&log, &[b"one", b"two", b"three"]);
    let (_, to) = records(&log, Position::START);
    std::fs::remove_file(&log).unwrap();
    assert_eq!(read(&log, FORMAT, to.at, |_| Ok(())).unwrap(), Read::Replaced("it was removed".into()));
    for payloads in [&[b"new".as_slice()][..], &[b"new one", b"new two", b"new three", b"new four"]] {
        let _ = std::fs::remove_file(&log);
        append_all(&log, payloads);
        let read = read(&log, FORMAT, to.at, |_| panic!("nothing read from the new file")).unwrap();
        assert!(matches!(read, Read::Replaced(ref why) if why.contains("nonce")), "{read:?}");
        // A writer that knew the old file appends after the new one's records.
        append(&log, FORMAT, b"appended", &mut writer).unwrap();
        let (read_back, to) = records(&log, Position::START);
        assert_eq!(read_back.len(), payloads.len() + 1);
        assert_eq!((to.tail, to.at), (Tail::Clean, writer));
    }
    // The same file cut shorter than what was read (by hand).
    let (_, to) = records(&log, Position::START);
    File::options().write(true).open(&log).unwrap().set_len(HEADER_BYTES).unwrap();
    let read = read(&log, FORMAT, to.at, |_| Ok(())).unwrap();
    assert!(matches!(read, Read::Replaced(ref why) if why.contains("shorter")), "{read:?}");
}

#[test]
fn writers_that_create_and_append_to_one_log_at_once_keep_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "t", FORMAT);
    let writers = 8;
    let each = 25;
    std::thread::scope(|scope| {
        for w in 0..writers {
            let log = &log;
            scope.spawn(move || {
                let mut known = Position::START;
                for k in 0..each {
                    append(log, FORMAT, format!("writer {w} push {k}").as_bytes(), &mut known).unwrap();
                }
            });
        }
    });
    let (read_back, to) = records(&log, Position::START);
    assert_eq!((to.records, to.tail), (writers * each, Tail::Clean));
    let mut read_back: Vec<String> = read_back.into_iter().map(|r| String::from_utf8(r).unwrap()).collect();
    read_back.sort();
    let mut want: Vec<String> =
        (0..writers).flat_map(|w| (0..each).map(move |k| format!("writer {w} push {k}"))).collect();
    want.sort();
    assert_eq!(read_back, want);
    assert_eq!(std::fs::read_dir(log.parent().unwrap()).unwrap().count(), 1, "no staging file left");
}

#[test]
fn a_read_waits_for_a_failed_append_being_rolled_back_and_reads_the_whole_records() {
    let dir = tempfile::tempdir().unwrap();
    let log = path(dir.path(), "t", FORMAT);
    append_all(&log, &[b"answered"]);
    let before = len(&log);
    // A writer mid-way through a failed append: locked, half a record
    // written, about to cut it back.
    let writer = locked::open(&log, Lock::Exclusive).unwrap().unwrap();
    let half = format::record(Layout::Guarded, b"never answered, rolled back");
    (&writer.file).write_all(&half[..40]).unwrap();
    let reader = std::thread::spawn({
        let log = log.clone();
        move || records(&log, Position::START)
    });
    // Give the reader time to reach the lock (the outcome is the same if
    // it does not).
    std::thread::sleep(std::time::Duration::from_millis(100));
    writer.file.set_len(before).unwrap();
    drop(writer);
    let (read_back, to) = reader.join().unwrap();
    assert_eq!((read_back, to.tail, to.at.end), (vec![b"answered".to_vec()], Tail::Clean, before));
}

#[test]
fn table_names_become_file_names_without_separators_or_dots() {
    assert_eq!(file_stem("cat_3-x"), "cat_3-x");
    assert_eq!(file_stem("../a.b"), "%2E%2E%2Fa%2Eb");
    let dir = tempfile::tempdir().unwrap();
    append(&path(dir.path(), "a.b", "fp32-1-4"), "fp32-1-4", b"x", &mut { Position::START }).unwrap();
    assert!(logs_of(dir.path(), "a").is_empty(), "table a.b is not table a");
    assert_eq!(logs_of(dir.path(), "a.b").len(), 1);
}
