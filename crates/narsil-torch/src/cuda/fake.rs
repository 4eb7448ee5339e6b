//! A recording fake of the CUDA shim, for unit tests: a [`CudaShim`] whose
//! functions are Rust `extern "C"` functions that log each call (with the
//! calling thread) instead of touching a GPU, so that the order of a device
//! lane's stream, event and graph calls can be checked on the CPU.
//!
//! It models what the order depends on: c10's stream pool (32 streams per
//! device, handed out round-robin), each thread's current stream, a graph
//! capture (the warm-up forwards, then the captured one, through the given
//! trampoline, on the compute stream; a handle whose output is the captured
//! forward's) and replay on the capturing stream. It computes nothing: a
//! replay leaves the output as captured.
//!
//! The log is one per process: a test that uses the fake holds a
//! [`Session`] (one at a time), which starts from an empty log and a fresh
//! pool. Staging's host writes are logged too (a `cfg(test)` line in
//! `StagedBuffer::upload`), from threads that made one of the fake's
//! streams current only.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use tch::Tensor;

use super::{CudaShim, ForwardFn, LaneStreams, RawTensor, STREAMS_PER_POOL};

/// A stream of the fake's pool: device and slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Stream {
    pub(crate) device: usize,
    pub(crate) slot: usize,
}

/// One call the fake saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    StreamsNew {
        compute: Stream,
        copy: Stream,
    },
    StreamsFree {
        compute: Stream,
        copy: Stream,
    },
    UseStream(Stream),
    StreamSynchronize(Stream),
    EventNew(usize),
    EventRecord {
        event: usize,
        stream: Stream,
    },
    EventBlock {
        event: usize,
        stream: Stream,
    },
    EventSynchronize(usize),
    /// A warm-up forward of a capture, on the thread's current stream.
    Warmup {
        stream: Option<Stream>,
    },
    /// The captured forward starts, on the thread's current stream.
    CaptureBegin {
        graph: usize,
        stream: Option<Stream>,
        /// The graph whose memory pool it allocates from (its own: a new pool).
        pool: usize,
    },
    CaptureEnd {
        graph: usize,
    },
    /// `stream`: the graph's (captured on); `current`: the thread's.
    Replay {
        graph: usize,
        stream: Stream,
        current: Option<Stream>,
    },
    GraphFree(usize),
    /// Staging wrote into the host buffer at `address`, `fresh`ly allocated
    /// for this write (no copy read it before) or not.
    HostWrite {
        address: usize,
        fresh: bool,
    },
    /// A test's own marker.
    Note(String),
}

/// A call and the thread that made it.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) thread: ThreadId,
    pub(crate) call: Call,
}

#[derive(Default)]
struct State {
    log: Vec<Entry>,
    /// Per device: streams drawn (c10's counter).
    drawn: Vec<usize>,
    events: usize,
    graphs: usize,
}

static STATE: Mutex<State> = Mutex::new(State { log: Vec::new(), drawn: Vec::new(), events: 0, graphs: 0 });
static SESSION: Mutex<()> = Mutex::new(());

thread_local! {
    static CURRENT: Cell<Option<Stream>> = const { Cell::new(None) };
}

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn log(call: Call) {
    state().log.push(Entry { thread: std::thread::current().id(), call });
}

fn fail(error: *mut *mut c_char, message: &str) {
    let message = CString::new(message).expect("no NUL");
    // SAFETY: `error` is the caller's out-pointer; strdup returns a
    // malloc'd copy, freed by `take_string`.
    unsafe { *error = libc::strdup(message.as_ptr()) };
}

struct FakeStreams {
    compute: Stream,
    copy: Stream,
}

struct FakeEvent(usize);

struct FakeGraph {
    id: usize,
    /// The graph whose memory pool it allocates from.
    pool: usize,
    stream: Stream,
    output: Tensor,
}

// Every handle the functions below are given is the fake's own, made by
// its `*_new` or capture functions and not yet freed: the shim's contract.

fn streams<'a>(raw: *mut c_void) -> &'a FakeStreams {
    // SAFETY: the fake's own live handle (above).
    unsafe { &*raw.cast::<FakeStreams>() }
}

fn which(s: &FakeStreams, which: c_int) -> Stream {
    if which == 0 {
        s.compute
    } else {
        s.copy
    }
}

fn event(raw: *mut c_void) -> usize {
    // SAFETY: the fake's own live handle (above).
    unsafe { &*raw.cast::<FakeEvent>() }.0
}

unsafe extern "C" fn device_count() -> c_int {
    2
}

unsafe extern "C" fn streams_new(device: c_int, error: *mut *mut c_char) -> *mut c_void {
    if device < 0 {
        fail(error, "no such device");
        return std::ptr::null_mut();
    }
    let device = device as usize;
    let (compute, copy) = {
        let mut state = state();
        if state.drawn.len() <= device {
            state.drawn.resize(device + 1, 0);
        }
        // c10's getStreamFromPool: `counter++ % kStreamsPerPool`, twice.
        let first = state.drawn[device];
        state.drawn[device] += 2;
        (
            Stream { device, slot: first % STREAMS_PER_POOL },
            Stream { device, slot: (first + 1) % STREAMS_PER_POOL },
        )
    };
    log(Call::StreamsNew { compute, copy });
    Box::into_raw(Box::new(FakeStreams { compute, copy })).cast()
}

unsafe extern "C" fn streams_free(raw: *mut c_void) {
    // SAFETY: made by `streams_new`, freed once.
    let s = unsafe { Box::from_raw(raw.cast::<FakeStreams>()) };
    log(Call::StreamsFree { compute: s.compute, copy: s.copy });
}

unsafe extern "C" fn use_stream(raw: *mut c_void, w: c_int, _error: *mut *mut c_char) -> c_int {
    let stream = which(streams(raw), w);
    CURRENT.with(|c| c.set(Some(stream)));
    log(Call::UseStream(stream));
    0
}

unsafe extern "C" fn stream_synchronize(raw: *mut c_void, w: c_int, _error: *mut *mut c_char) -> c_int {
    log(Call::StreamSynchronize(which(streams(raw), w)));
    0
}

unsafe extern "C" fn event_new(_error: *mut *mut c_char) -> *mut c_void {
    let id = {
        let mut state = state();
        state.events += 1;
        state.events
    };
    log(Call::EventNew(id));
    Box::into_raw(Box::new(FakeEvent(id))).cast()
}

unsafe extern "C" fn event_free(raw: *mut c_void) {
    // SAFETY: made by `event_new`, freed once.
    drop(unsafe { Box::from_raw(raw.cast::<FakeEvent>()) });
}

unsafe extern "C" fn event_record(
    e: *mut c_void,
    s: *mut c_void,
    w: c_int,
    _error: *mut *mut c_char,
) -> c_int {
    log(Call::EventRecord { event: event(e), stream: which(streams(s), w) });
    0
}

unsafe extern "C" fn event_block(
    e: *mut c_void,
    s: *mut c_void,
    w: c_int,
    _error: *mut *mut c_char,
) -> c_int {
    log(Call::EventBlock { event: event(e), stream: which(streams(s), w) });
    0
}

unsafe extern "C" fn event_synchronize(e: *mut c_void, _error: *mut *mut c_char) -> c_int {
    log(Call::EventSynchronize(event(e)));
    0
}

/// Runs the caller's forward once: its tensor, or its error copied into
/// `error`.
fn run(forward: ForwardFn, context: *mut c_void, error: *mut *mut c_char) -> Option<Tensor> {
    let mut message = std::ptr::null_mut();
    // SAFETY: the trampoline and context the caller passed, during its call.
    let out = unsafe { forward(context, &mut message) };
    if out.is_null() {
        let text = crate::script_module::take_string(message).unwrap_or_else(|| "the forward failed".into());
        fail(error, &text);
        return None;
    }
    // SAFETY: a new heap at::Tensor whose ownership passes here (the shim
    // deletes it; so does this handle's drop).
    Some(unsafe { Tensor::from_ptr(out) })
}

unsafe extern "C" fn graph_capture(
    s: *mut c_void,
    forward: ForwardFn,
    context: *mut c_void,
    warmups: c_int,
    share: *mut c_void,
    error: *mut *mut c_char,
) -> *mut c_void {
    let compute = streams(s).compute;
    let shared_pool = (!share.is_null()).then(|| graph(share).pool);
    // The shim's CUDAStreamGuard: the compute stream is current meanwhile.
    let previous = CURRENT.with(|c| c.replace(Some(compute)));
    let captured = (|| {
        for _ in 0..warmups {
            log(Call::Warmup { stream: CURRENT.with(Cell::get) });
            drop(run(forward, context, error)?);
        }
        let id = {
            let mut state = state();
            state.graphs += 1;
            state.graphs
        };
        let pool = shared_pool.unwrap_or(id);
        log(Call::CaptureBegin { graph: id, stream: CURRENT.with(Cell::get), pool });
        let output = run(forward, context, error);
        log(Call::CaptureEnd { graph: id });
        Some(FakeGraph { id, pool, stream: compute, output: output? })
    })();
    CURRENT.with(|c| c.set(previous));
    match captured {
        Some(graph) => Box::into_raw(Box::new(graph)).cast(),
        None => std::ptr::null_mut(),
    }
}

fn graph<'a>(raw: *mut c_void) -> &'a FakeGraph {
    // SAFETY: the fake's own live handle (above `streams`).
    unsafe { &*raw.cast::<FakeGraph>() }
}

unsafe extern "C" fn graph_output(g: *mut c_void, _error: *mut *mut c_char) -> *mut RawTensor {
    let output = graph(g).output.shallow_clone();
    let raw = output.as_ptr() as *mut RawTensor;
    // Ownership of the new at::Tensor passes to the caller.
    std::mem::forget(output);
    raw
}

unsafe extern "C" fn graph_replay(g: *mut c_void, _error: *mut *mut c_char) -> c_int {
    let graph = graph(g);
    log(Call::Replay { graph: graph.id, stream: graph.stream, current: CURRENT.with(Cell::get) });
    0
}

unsafe extern "C" fn graph_free(g: *mut c_void) {
    // SAFETY: made by `graph_capture`, freed once.
    let graph = unsafe { Box::from_raw(g.cast::<FakeGraph>()) };
    log(Call::GraphFree(graph.id));
}

static FAKE: CudaShim = CudaShim {
    device_count,
    streams_new,
    streams_free,
    use_stream,
    stream_synchronize,
    event_new,
    event_free,
    event_record,
    event_block,
    event_synchronize,
    graph_capture,
    graph_output,
    graph_replay,
    graph_free,
    pools: Mutex::new(Vec::new()),
};

/// A test's use of the fake: one at a time; the log and both views of the
/// pool (the fake's counter, the lanes' mirror) start empty.
pub(crate) struct Session {
    _one_at_a_time: MutexGuard<'static, ()>,
}

impl Session {
    pub(crate) fn start() -> Self {
        let guard = SESSION.lock().unwrap_or_else(PoisonError::into_inner);
        *state() = State::default();
        FAKE.pools.lock().unwrap_or_else(PoisonError::into_inner).clear();
        Self { _one_at_a_time: guard }
    }

    /// The fake shim.
    pub(crate) fn shim(&self) -> &'static CudaShim {
        &FAKE
    }

    /// The log so far.
    pub(crate) fn log(&self) -> Vec<Entry> {
        state().log.clone()
    }

    /// Adds a test's marker to the log.
    pub(crate) fn note(&self, text: impl Into<String>) {
        log(Call::Note(text.into()));
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(None));
    }
}

/// A lane's streams as the fake knows them: (compute, copy).
pub(crate) fn streams_of(lane: &LaneStreams) -> (Stream, Stream) {
    let s = streams(lane.raw);
    (s.compute, s.copy)
}

/// Logs a write into the host buffer at `address` (`fresh`: just
/// allocated), from a thread that made one of the fake's streams current
/// (other tests' staging is not logged).
pub(crate) fn host_write(address: usize, fresh: bool) {
    if CURRENT.with(Cell::get).is_some() {
        log(Call::HostWrite { address, fresh });
    }
}
