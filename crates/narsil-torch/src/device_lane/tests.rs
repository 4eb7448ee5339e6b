//! The order of a device lane's stream, event and graph calls, on the CPU
//! device, through the recording fake of the CUDA shim
//! ([`crate::cuda::fake`]): graphs captured after their warm-ups on the
//! lane's compute stream and replayed there; a host staging buffer
//! rewritten only after the event recorded after its previous copy was
//! waited for; with stage ahead, the compute stream made to wait for the
//! copy stream's event of the batch before the forward that reads it. The
//! scores are not checked here (a fake replay computes nothing; the scores
//! are `tests/device_path.rs`'s).

use std::collections::HashSet;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::thread::ThreadId;

use narsil_core::golden::{test_model_dir, Golden};
use narsil_core::request::IdPolicy;
use narsil_core::{assemble, KeyedBatch, ModelBackend};
use narsil_embedding::{EmbeddingStage, SplitSchema, TableStore};
use tch::Device;

use super::DeviceLane;
use crate::buckets::Buckets;
use crate::cuda::fake::{self, Call, Entry, Session, Stream};
use crate::precision::DensePrecision;
use crate::split::dense_network::{DenseForm, DenseNetwork};
use crate::split::model::SplitModel;
use crate::tensor_stage::TensorTables;

/// Warm-up forwards before each capture (graphs.rs passes 3).
const WARMUPS: usize = 3;

/// The test model's split form on the CPU device (as `SplitFactory::load`
/// builds it), tables on the device or not, with these buckets.
fn model(tables_on_device: bool, buckets: &[usize]) -> Arc<SplitModel> {
    let dir = test_model_dir().join("split");
    let split = SplitSchema::read(&dir).unwrap();
    let (stores, _) = TableStore::Memory.open(&dir, &split).unwrap();
    let device_tables =
        tables_on_device.then(|| TensorTables::upload(&split, &stores, Device::Cpu, u64::MAX).unwrap());
    let dense_network =
        DenseNetwork::load(&dir, &split, DenseForm::TorchScript, DensePrecision::Fp32, 2, Device::Cpu)
            .unwrap();
    Arc::new(SplitModel {
        schema: split.model_schema("torch", "cpu"),
        stage: EmbeddingStage::new(&split, stores),
        dense_network,
        dense_cut: None,
        precision: DensePrecision::Fp32,
        device: Device::Cpu,
        device_path: true,
        device_tables,
        buckets: Buckets::new(buckets.to_vec()),
        dense_flops_per_sample: None,
    })
}

/// Batches of 1 to 4 of the golden requests (1 to a few hundred rows).
fn batches(model: &SplitModel, count: usize) -> Vec<KeyedBatch> {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let requests: Vec<_> =
        golden.requests.iter().map(|g| g.validated(&model.schema, IdPolicy::Reject).unwrap()).collect();
    (0..count)
        .map(|i| {
            let picked = (0..1 + i % 4).map(|j| &requests[(i + j) % requests.len()]);
            assemble(model.schema.num_dense, model.schema.num_sparse(), picked)
        })
        .collect()
}

/// A lane's streams as the fake knows them: (compute, copy).
fn streams(lane: &DeviceLane) -> (Stream, Stream) {
    fake::streams_of(lane.streams.as_ref().expect("the fake's streams"))
}

fn of_thread(log: &[Entry], thread: ThreadId) -> Vec<(usize, &Call)> {
    log.iter().enumerate().filter(|(_, e)| e.thread == thread).map(|(i, e)| (i, &e.call)).collect()
}

/// On the lane's thread: every capture begins after `WARMUPS` warm-ups,
/// all on the lane's compute stream, every graph in the memory pool of the
/// lane's first (one pool per lane); every replay is of one of its own
/// graphs, on that stream (the thread's current stream too). Returns its
/// graphs and how many replays ran.
fn check_graphs(log: &[Entry], thread: ThreadId, compute: Stream) -> (HashSet<usize>, usize) {
    let (mut graphs, mut warmups, mut replays) = (HashSet::new(), 0, 0);
    let mut first_pool = None;
    for (i, call) in of_thread(log, thread) {
        match call {
            Call::Warmup { stream } => {
                assert_eq!(*stream, Some(compute), "entry {i}: a warm-up off the compute stream");
                warmups += 1;
            }
            Call::CaptureBegin { graph, stream, pool } => {
                // The lane's first graph makes a new pool (never another
                // lane's); every later one allocates from it.
                let lane_pool = *first_pool.get_or_insert(*graph);
                assert_eq!(
                    *pool, lane_pool,
                    "entry {i}: graph {graph} in pool {pool}, not the lane's {lane_pool}"
                );
                assert_eq!(
                    *stream,
                    Some(compute),
                    "entry {i}: graph {graph} captured off the compute stream"
                );
                assert_eq!(warmups, WARMUPS, "entry {i}: graph {graph} captured after {warmups} warm-ups");
                graphs.insert(*graph);
            }
            Call::CaptureEnd { .. } => warmups = 0,
            Call::Replay { graph, stream, current } => {
                assert!(graphs.contains(graph), "entry {i}: replayed graph {graph} is not this lane's");
                assert_eq!(
                    *stream, compute,
                    "entry {i}: graph {graph} replayed off the stream it was captured on"
                );
                assert_eq!(
                    *current,
                    Some(compute),
                    "entry {i}: the lane thread's stream is not its compute stream"
                );
                replays += 1;
            }
            _ => {}
        }
    }
    (graphs, replays)
}

/// Every rewrite of a host buffer comes after the host waited for the
/// event recorded (on the same thread) after that buffer's previous copy.
fn check_host_writes(log: &[Entry]) -> usize {
    let mut checked = 0;
    for (p, entry) in log.iter().enumerate() {
        let Call::HostWrite { address, fresh: false } = entry.call else { continue };
        let Some(q) = log[..p]
            .iter()
            .rposition(|e| matches!(e.call, Call::HostWrite { address: a, .. } if a == address))
        else {
            panic!("entry {p}: host buffer {address:#x} rewritten, never written before")
        };
        let thread = log[q].thread;
        let Some((r, event)) = log[q + 1..p].iter().enumerate().find_map(|(i, e)| match e.call {
            Call::EventRecord { event, .. } if e.thread == thread => Some((q + 1 + i, event)),
            _ => None,
        }) else {
            panic!(
                "entry {p}: host buffer {address:#x} rewritten, but no event was recorded after its \
                 copy (entry {q})"
            )
        };
        assert!(
            log[r + 1..p].iter().any(|e| e.call == Call::EventSynchronize(event)),
            "entry {p}: host buffer {address:#x} rewritten before the host waited for event {event} \
             (recorded at entry {r} after its copy at entry {q})"
        );
        checked += 1;
    }
    checked
}

/// Two lanes, each on its own thread (as the engine runs them): each
/// captures a graph per bucket after the warm-ups on its own compute
/// stream, and replays only its own graphs, on that stream.
#[test]
fn each_lane_captures_its_graphs_after_the_warmups_and_replays_them_on_its_compute_stream() {
    let model = model(true, &[8, 64, 256]);
    let batches = batches(&model, 8);
    let session = Session::start();
    let lanes: Vec<(ThreadId, Stream, Stream, usize)> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..2)
            .map(|_| {
                let (model, batches, shim) = (Arc::clone(&model), &batches, session.shim());
                scope.spawn(move || {
                    let mut lane = DeviceLane::with_fake(model, true, shim).unwrap();
                    let (compute, copy) = streams(&lane);
                    let in_buckets = batches.iter().filter(|b| b.rows <= 256).count();
                    for batch in batches {
                        lane.forward(batch).unwrap();
                    }
                    (std::thread::current().id(), compute, copy, in_buckets)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let log = session.log();
    let mut all_graphs = HashSet::new();
    for &(thread, compute, copy, in_buckets) in &lanes {
        assert_ne!(compute, copy);
        let (graphs, replays) = check_graphs(&log, thread, compute);
        assert_eq!(graphs.len(), 3, "a graph per bucket");
        assert_eq!(replays, in_buckets, "a replay per batch in a bucket");
        assert!(all_graphs.is_disjoint(&graphs));
        all_graphs.extend(graphs);
    }
    let streams: HashSet<_> = lanes.iter().flat_map(|&(_, compute, copy, _)| [compute, copy]).collect();
    assert_eq!(streams.len(), 4, "two lanes share no stream");
}

/// Without stage ahead a lane stages each batch into its own set on its
/// compute stream: the host waits for the event recorded after the set's
/// previous copies before rewriting its host buffers.
#[test]
fn a_lanes_own_staging_buffers_are_rewritten_only_after_their_copies_event() {
    for tables_on_device in [false, true] {
        let model = model(tables_on_device, &[64]);
        // The largest first: later batches rewrite the buffers it allocated.
        let mut batches = batches(&model, 8);
        batches.sort_by_key(|b| std::cmp::Reverse(b.ids.len()));
        let session = Session::start();
        let mut lane = DeviceLane::with_fake(Arc::clone(&model), false, session.shim()).unwrap();
        let (compute, _) = streams(&lane);
        for batch in &batches {
            lane.forward(batch).unwrap();
        }
        let log = session.log();
        let checked = check_host_writes(&log);
        // Dense features and the pooled block, or dense, rows and bags: at
        // least two buffers rewritten per batch after the first.
        assert!(
            checked >= 2 * (batches.len() - 1),
            "tables on device {tables_on_device}: {checked} rewrites"
        );
        for entry in &log {
            if let Call::EventRecord { stream, .. } = entry.call {
                assert_eq!(stream, compute, "the lane's own set copies on its compute stream");
            }
        }
    }
}

/// Stage ahead as the engine runs it, on two lanes at once (each a lane
/// thread and a stage thread handing batches over through a rendezvous;
/// some batches dropped untouched, some losing a request after staging):
/// the stage thread's copies and events are on the lane's copy stream, its
/// host buffers rewritten only after their previous copies' event, and
/// before each forward of a staged batch the compute stream waits for the
/// event recorded after that batch's copies.
#[test]
fn with_stage_ahead_the_compute_stream_waits_for_each_batchs_copy_event_before_its_forward() {
    let model = model(true, &[8, 64, 256]);
    let batches = batches(&model, 24);
    let session = Session::start();
    let session = &session;
    struct Run {
        lane: ThreadId,
        stage: ThreadId,
        compute: Stream,
        copy: Stream,
        forwards: usize,
    }
    let runs: Vec<Run> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..2)
            .map(|_| {
                let (model, batches) = (Arc::clone(&model), &batches);
                scope.spawn(move || {
                    let mut lane = DeviceLane::with_fake(model, true, session.shim()).unwrap();
                    let (compute, copy) = streams(&lane);
                    let mut stage = lane.take_stage().expect("the device lane has a stage");
                    let (to_lane, from_stage) = sync_channel(0);
                    std::thread::scope(|inner| {
                        let stager = inner.spawn(move || {
                            for (i, batch) in batches.iter().enumerate() {
                                session.note(format!("stage {i}"));
                                let staged = stage.stage(batch).unwrap();
                                if to_lane.send((i, staged)).is_err() {
                                    break;
                                }
                            }
                            std::thread::current().id()
                        });
                        let mut forwards = 0;
                        for (i, staged) in from_stage {
                            match i % 5 {
                                3 => continue, // dropped: every caller stopped waiting
                                4 if batches[i].request_rows.len() > 1 => {
                                    // A request dropped after staging: staged
                                    // again by the lane, into its own set.
                                    let kept = batches[i].retain_requests(|r| r > 0);
                                    let mut shorter = staged;
                                    shorter.retain_requests(&batches[i].request_rows, |r| r > 0);
                                    session.note(format!("restaged {i}"));
                                    lane.forward_staged(&kept, shorter).unwrap();
                                }
                                _ => {
                                    session.note(format!("forward {i}"));
                                    lane.forward_staged(&batches[i], staged).unwrap();
                                    forwards += 1;
                                }
                            }
                        }
                        let stage = stager.join().unwrap();
                        Run { lane: std::thread::current().id(), stage, compute, copy, forwards }
                    })
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let log = session.log();
    assert!(check_host_writes(&log) > 0);
    let note = |thread: ThreadId, text: &str| {
        log.iter().position(|e| e.thread == thread && e.call == Call::Note(text.into()))
    };
    for run in &runs {
        assert!(run.forwards >= 12, "{} forwards of staged batches", run.forwards);
        check_graphs(&log, run.lane, run.compute);
        // The stage thread works on the copy stream only.
        for (i, call) in of_thread(&log, run.stage) {
            match call {
                Call::UseStream(stream) | Call::EventRecord { stream, .. } => {
                    assert_eq!(*stream, run.copy, "entry {i}: the stage thread off the copy stream")
                }
                Call::EventBlock { .. } | Call::Replay { .. } | Call::CaptureBegin { .. } => {
                    panic!("entry {i}: {call:?} on the stage thread")
                }
                _ => {}
            }
        }
        let lane_calls = of_thread(&log, run.lane);
        let mut checked = 0;
        for i in 0..batches.len() {
            let Some(forward) = note(run.lane, &format!("forward {i}")) else { continue };
            // The event recorded on the copy stream after batch i's copies.
            let staged_at = note(run.stage, &format!("stage {i}")).expect("staged");
            let (recorded_at, event) = of_thread(&log, run.stage)
                .into_iter()
                .filter(|&(at, _)| at > staged_at)
                .take_while(|(_, call)| !matches!(call, Call::Note(_)))
                .filter_map(|(at, call)| match call {
                    Call::EventRecord { event, stream } if *stream == run.copy => Some((at, *event)),
                    _ => None,
                })
                .last()
                .expect("an event recorded after the batch's copies");
            // The lane's calls for this forward, up to its next marker.
            let calls: Vec<(usize, &Call)> = lane_calls
                .iter()
                .copied()
                .filter(|&(at, _)| at > forward)
                .take_while(|(_, call)| !matches!(call, Call::Note(_)))
                .collect();
            let blocked_at = calls
                .iter()
                .find(|(_, call)| **call == Call::EventBlock { event, stream: run.compute })
                .map(|&(at, _)| at)
                .unwrap_or_else(|| {
                    panic!("batch {i}: the compute stream never waited for its copy event {event}: {calls:?}")
                });
            assert!(recorded_at < blocked_at, "batch {i}: waited for before its copies were recorded");
            if let Some(&(replayed_at, _)) =
                calls.iter().find(|(_, call)| matches!(call, Call::Replay { .. }))
            {
                assert!(blocked_at < replayed_at, "batch {i}: its graph replayed before the wait");
            }
            checked += 1;
        }
        assert_eq!(checked, run.forwards);
    }
    assert_ne!(runs[0].compute, runs[1].compute);
    assert_ne!(runs[0].copy, runs[1].copy);
}
