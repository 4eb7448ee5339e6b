//! What tch lacks on CUDA (per-lane streams, events between them, CUDA
//! graphs), through `libnarsil_cuda_shim.so` (`csrc/cuda_shim.cpp`), a
//! library of its own that build.rs compiles where the libtorch has CUDA
//! headers, opened with `dlopen` the first time a lane asks for it. The
//! binary links no CUDA library: on a CPU machine, or a build whose libtorch
//! has no CUDA headers, [`shim`] answers why the API is unavailable and
//! nothing else changes.
//!
//! The library is looked for at `NARSIL_CUDA_SHIM` (a file), beside the
//! running executable (how `scripts/build_for_libtorch.sh` carries it), then
//! where build.rs wrote it.
//!
//! Lanes draw their two streams from c10's pool, which hands out its 32
//! streams per pool per device round-robin, whoever holds them: a lane that
//! got a stream another live lane holds would share it (and one lane's work
//! could be recorded into the other's graph). [`LaneStreams::new`] mirrors
//! the pool's order and never hands out a held stream: it skips held pairs
//! and refuses a 17th lane on a device ([`LANES_PER_DEVICE`]).
//!
//! In unit tests, `fake` is a recording [`CudaShim`] made of Rust
//! functions: the device lane runs on the CPU device with it, and the order
//! of its stream, event and graph calls is checked (`device_lane/tests.rs`).

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};

use tch::Tensor;

use crate::script_module::take_string;

type RawTensor = torch_sys::C_tensor;

/// The shim's file name.
pub const SHIM_FILE: &str = "libnarsil_cuda_shim.so";
/// Environment variable naming the shim's file.
pub const SHIM_ENV: &str = "NARSIL_CUDA_SHIM";
/// The interface version this code calls.
const ABI: c_int = 2;

/// The forward a graph captures: the caller's closure, run on the capture
/// stream; returns a new heap tensor or null with a malloc'd message.
type ForwardFn = unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> *mut RawTensor;

#[cfg(test)]
pub(crate) mod fake;

/// Streams c10 keeps per pool per device (`kStreamsPerPool`), handed out
/// round-robin by `getStreamFromPool`, whoever still holds them.
pub const STREAMS_PER_POOL: usize = 32;

/// Lanes (two streams each) one CUDA device holds without two of them
/// sharing a stream: every model's lanes on that device count.
pub const LANES_PER_DEVICE: usize = STREAMS_PER_POOL / 2;

/// c10's stream pool on one device as this process's lanes draw from it:
/// how many streams were drawn (the pool's counter, which only the shim's
/// `narsil_cuda_streams_new` advances: nothing else in a Narsil process
/// draws from the low-priority pool) and which of its slots a live lane
/// holds.
#[derive(Default)]
struct PoolMirror {
    drawn: usize,
    held: [bool; STREAMS_PER_POOL],
}

impl PoolMirror {
    /// The pool slots the draw after `skip` more pairs hands out.
    fn slots(&self, skip: usize) -> [usize; 2] {
        let first = (self.drawn + 2 * skip) % STREAMS_PER_POOL;
        [first, (first + 1) % STREAMS_PER_POOL]
    }

    fn live_lanes(&self) -> usize {
        self.held.iter().filter(|&&h| h).count() / 2
    }
}

/// The shim's functions.
#[allow(clippy::type_complexity)]
pub struct CudaShim {
    device_count: unsafe extern "C" fn() -> c_int,
    streams_new: unsafe extern "C" fn(c_int, *mut *mut c_char) -> *mut c_void,
    streams_free: unsafe extern "C" fn(*mut c_void),
    use_stream: unsafe extern "C" fn(*mut c_void, c_int, *mut *mut c_char) -> c_int,
    stream_synchronize: unsafe extern "C" fn(*mut c_void, c_int, *mut *mut c_char) -> c_int,
    event_new: unsafe extern "C" fn(*mut *mut c_char) -> *mut c_void,
    event_free: unsafe extern "C" fn(*mut c_void),
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, *mut *mut c_char) -> c_int,
    event_block: unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, *mut *mut c_char) -> c_int,
    event_synchronize: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> c_int,
    graph_capture: unsafe extern "C" fn(
        *mut c_void,
        ForwardFn,
        *mut c_void,
        c_int,
        *mut c_void,
        *mut *mut c_char,
    ) -> *mut c_void,
    graph_output: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> *mut RawTensor,
    graph_replay: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> c_int,
    graph_free: unsafe extern "C" fn(*mut c_void),
    /// Per CUDA device index: its stream pool as lanes drew from it.
    pools: Mutex<Vec<PoolMirror>>,
}

/// The shim, opened once; or why it is unavailable.
pub fn shim() -> Result<&'static CudaShim, String> {
    static SHIM: OnceLock<Result<CudaShim, String>> = OnceLock::new();
    SHIM.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// Where the shim is looked for, in order.
pub fn shim_candidates() -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let Some(path) = std::env::var_os(SHIM_ENV) {
        paths.push(PathBuf::from(path));
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|exe| exe.parent().map(PathBuf::from)) {
        paths.push(dir.join(SHIM_FILE));
    }
    let built = env!("NARSIL_CUDA_SHIM_BUILT");
    if !built.is_empty() {
        paths.push(built.into());
    }
    paths
}

// Each `load!` transmutes to the type of the field it initialises (named
// there, once), which is the annotation.
#[allow(clippy::missing_transmute_annotations)]
fn open() -> Result<CudaShim, String> {
    let candidates = shim_candidates();
    let Some(path) = candidates.iter().find(|p| p.is_file()) else {
        return Err(if env!("NARSIL_CUDA_SHIM_BUILT").is_empty() {
            "unavailable: this build's libtorch has no CUDA headers, so no CUDA shim was built".into()
        } else {
            format!("unavailable: no {SHIM_FILE} at {candidates:?}")
        });
    };
    // libtorch.so pulls in libtorch_cuda and the CUDA libraries the shim
    // needs (and registers CUDA with libtorch).
    crate::fbgemm::open_global(&crate::libtorch_lib_dir().join("libtorch.so"))?;
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| "a path with a NUL byte".to_string())?;
    // SAFETY: a valid C string; dlopen runs the library's initialisers,
    // which for this shim are libtorch's static registrations only.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a NUL-terminated string.
        let message = unsafe { libc::dlerror() };
        let message = if message.is_null() {
            "unknown dlopen error".into()
        } else {
            // SAFETY: non-null: a NUL-terminated string owned by libc.
            unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned()
        };
        return Err(format!("unavailable: cannot open {}: {message}", path.display()));
    }
    let symbol = |name: &str| -> Result<*mut c_void, String> {
        let c_name = CString::new(name).expect("no NUL in a symbol name");
        // SAFETY: a live handle and a valid C string.
        let found = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
        if found.is_null() {
            Err(format!("unavailable: {} lacks {name}", path.display()))
        } else {
            Ok(found)
        }
    };
    macro_rules! load {
        ($name:literal) => {
            // SAFETY: the symbol is the shim's extern "C" function of this
            // name, whose signature csrc/cuda_shim.cpp declares as the field's
            // type (the ABI version is checked below).
            unsafe { std::mem::transmute::<*mut c_void, _>(symbol($name)?) }
        };
    }
    let abi: unsafe extern "C" fn() -> c_int = load!("narsil_cuda_shim_abi");
    // SAFETY: takes nothing, throws nothing.
    let found = unsafe { abi() };
    if found != ABI {
        return Err(format!(
            "unavailable: {} has interface {found}, this binary calls {ABI}",
            path.display()
        ));
    }
    Ok(CudaShim {
        device_count: load!("narsil_cuda_device_count"),
        streams_new: load!("narsil_cuda_streams_new"),
        streams_free: load!("narsil_cuda_streams_free"),
        use_stream: load!("narsil_cuda_use_stream"),
        stream_synchronize: load!("narsil_cuda_stream_synchronize"),
        event_new: load!("narsil_cuda_event_new"),
        event_free: load!("narsil_cuda_event_free"),
        event_record: load!("narsil_cuda_event_record"),
        event_block: load!("narsil_cuda_event_block"),
        event_synchronize: load!("narsil_cuda_event_synchronize"),
        graph_capture: load!("narsil_cuda_graph_capture"),
        graph_output: load!("narsil_cuda_graph_output"),
        graph_replay: load!("narsil_cuda_graph_replay"),
        graph_free: load!("narsil_cuda_graph_free"),
        pools: Mutex::new(Vec::new()),
    })
}

fn status(code: c_int, error: *mut c_char) -> Result<(), String> {
    if code == 0 {
        Ok(())
    } else {
        Err(take_string(error).unwrap_or_else(|| "unknown error".into()))
    }
}

impl CudaShim {
    /// CUDA devices libtorch sees.
    pub fn device_count(&self) -> usize {
        // SAFETY: takes nothing, throws nothing.
        unsafe { (self.device_count)() }.max(0) as usize
    }
}

/// Which of a lane's streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// The forwards' stream (graphs are captured and replayed on it).
    Compute = 0,
    /// The stage's host-to-device copies.
    Copy = 1,
}

/// A lane's compute and copy streams.
pub struct LaneStreams {
    shim: &'static CudaShim,
    raw: *mut c_void,
    device: usize,
    /// The pool slots its two streams are (compute, copy).
    slots: [usize; 2],
}

// SAFETY: the streams are plain handles any thread may use; freed by Drop once.
unsafe impl Send for LaneStreams {}
// SAFETY: no method mutates the handle; the shim's calls are thread-safe.
unsafe impl Sync for LaneStreams {}

impl LaneStreams {
    /// Two streams from libtorch's pool on CUDA device `device`, neither
    /// held by another live lane: pairs a live lane holds are drawn and put
    /// back (the pool's counter moves past them); with [`LANES_PER_DEVICE`]
    /// lanes live on the device, refused.
    pub fn new(shim: &'static CudaShim, device: usize) -> Result<Self, StreamsError> {
        let mut pools = shim.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if pools.len() <= device {
            pools.resize_with(device + 1, PoolMirror::default);
        }
        let pool = &mut pools[device];
        let free = |skip: usize| pool.slots(skip).iter().all(|&slot| !pool.held[slot]);
        let Some(skip) = (0..LANES_PER_DEVICE).find(|&skip| free(skip)) else {
            return Err(StreamsError::Full { device, lanes: pool.live_lanes() });
        };
        let draw = || {
            let mut error = std::ptr::null_mut();
            // SAFETY: an out-pointer that outlives the call; the shim throws nothing.
            let raw = unsafe { (shim.streams_new)(device as c_int, &mut error) };
            if raw.is_null() {
                Err(StreamsError::Shim(take_string(error).unwrap_or_else(|| "unknown error".into())))
            } else {
                Ok(raw)
            }
        };
        for _ in 0..skip {
            // A pair a live lane holds: drawn (the pool's counter moves on)
            // and put back at once (the pool's streams outlive their handles).
            let held = draw()?;
            pool.drawn += 2;
            // SAFETY: a handle drawn above, freed once, here.
            unsafe { (shim.streams_free)(held) };
        }
        let raw = draw()?;
        let slots = pool.slots(0);
        pool.drawn += 2;
        for slot in slots {
            pool.held[slot] = true;
        }
        Ok(Self { shim, raw, device, slots })
    }

    /// The shim these streams came from (their events come from it too).
    pub fn shim(&self) -> &'static CudaShim {
        self.shim
    }

    /// Makes `which` the calling thread's current stream.
    pub fn use_on_this_thread(&self, which: Which) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: a live handle (freed only by Drop), an out-pointer.
        status(unsafe { (self.shim.use_stream)(self.raw, which as c_int, &mut error) }, error)
    }

    /// Waits on the host for everything issued to `which`.
    pub fn synchronize(&self, which: Which) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: as above.
        status(unsafe { (self.shim.stream_synchronize)(self.raw, which as c_int, &mut error) }, error)
    }

    /// Captures `forward` (which runs the dense network over inputs it
    /// holds) as a graph on the compute stream, after `warmups` eager runs,
    /// in the memory pool of `share` (a graph this lane captured before: a
    /// lane replays one graph at a time, so its graphs may reuse each
    /// other's intermediates' memory), or in a new pool.
    pub fn capture<F: FnMut() -> Result<Tensor, String>>(
        &self,
        mut forward: F,
        warmups: usize,
        share: Option<&Graph>,
    ) -> Result<Graph, String> {
        unsafe extern "C" fn trampoline<F: FnMut() -> Result<Tensor, String>>(
            context: *mut c_void,
            error: *mut *mut c_char,
        ) -> *mut RawTensor {
            // SAFETY: `context` is the `&mut F` passed below, alive for the
            // whole capture call that runs this.
            let forward = unsafe { &mut *context.cast::<F>() };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(forward))
                .unwrap_or_else(|_| Err("the forward panicked".into()));
            match result {
                Ok(tensor) => {
                    // Ownership of the at::Tensor passes to the shim, which
                    // deletes it; tch's handle is forgotten, not freed.
                    let raw = tensor.as_ptr() as *mut RawTensor;
                    std::mem::forget(tensor);
                    raw
                }
                Err(message) => {
                    let message = CString::new(message.replace('\0', " ")).expect("no NUL");
                    // SAFETY: strdup returns a malloc'd copy, or null.
                    unsafe { *error = libc::strdup(message.as_ptr()) };
                    std::ptr::null_mut()
                }
            }
        }
        let mut error = std::ptr::null_mut();
        let share = share.map_or(std::ptr::null_mut(), |graph| graph.raw);
        // SAFETY: a live handle; `forward` outlives the call (the shim calls
        // it only during it); the trampoline matches `ForwardFn`; `share` is
        // null or a live graph (borrowed for the call).
        let raw = unsafe {
            (self.shim.graph_capture)(
                self.raw,
                trampoline::<F>,
                (&mut forward as *mut F).cast(),
                warmups as c_int,
                share,
                &mut error,
            )
        };
        if raw.is_null() {
            return Err(take_string(error).unwrap_or_else(|| "unknown error".into()));
        }
        let mut graph = Graph { shim: self.shim, raw, output: None };
        let mut error = std::ptr::null_mut();
        // SAFETY: a live graph; an out-pointer.
        let output = unsafe { (self.shim.graph_output)(graph.raw, &mut error) };
        if output.is_null() {
            return Err(take_string(error).unwrap_or_else(|| "unknown error".into()));
        }
        // SAFETY: a new heap at::Tensor whose ownership passes here.
        graph.output = Some(unsafe { Tensor::from_ptr(output) });
        Ok(graph)
    }
}

impl Drop for LaneStreams {
    fn drop(&mut self) {
        {
            let mut pools = self.shim.pools.lock().unwrap_or_else(PoisonError::into_inner);
            for slot in self.slots {
                pools[self.device].held[slot] = false;
            }
        }
        // SAFETY: freed once, here.
        unsafe { (self.shim.streams_free)(self.raw) }
    }
}

/// Why a lane got no streams.
#[derive(Debug, thiserror::Error)]
pub enum StreamsError {
    /// Every stream of the device's pool is held by a live lane.
    #[error(
        "cuda:{device} already has {lanes} lanes, and a CUDA device takes at most {LANES_PER_DEVICE} \
         (c10 hands out {STREAMS_PER_POOL} streams per pool per device and each lane takes two: \
         one more lane would share a stream with a live lane, and its work could be recorded \
         into that lane's CUDA graph); serve with fewer lanes (--lanes), counting every model \
         on this device and a version being replaced, or on more devices"
    )]
    Full {
        /// The CUDA device index.
        device: usize,
        /// Its live lanes.
        lanes: usize,
    },
    /// The shim's own error.
    #[error("{0}")]
    Shim(String),
}

/// A CUDA event.
pub struct Event {
    shim: &'static CudaShim,
    raw: *mut c_void,
}

// SAFETY: a plain handle; freed by Drop once.
unsafe impl Send for Event {}

impl Event {
    /// A new (complete) event.
    pub fn new(shim: &'static CudaShim) -> Result<Self, String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: an out-pointer that outlives the call.
        let raw = unsafe { (shim.event_new)(&mut error) };
        if raw.is_null() {
            return Err(take_string(error).unwrap_or_else(|| "unknown error".into()));
        }
        Ok(Self { shim, raw })
    }

    /// Records the event on `which` of `streams`.
    pub fn record(&self, streams: &LaneStreams, which: Which) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: live handles; an out-pointer.
        status(unsafe { (self.shim.event_record)(self.raw, streams.raw, which as c_int, &mut error) }, error)
    }

    /// Makes `which` of `streams` wait for the event on the device.
    pub fn block(&self, streams: &LaneStreams, which: Which) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: live handles; an out-pointer.
        status(unsafe { (self.shim.event_block)(self.raw, streams.raw, which as c_int, &mut error) }, error)
    }

    /// Waits on the host for the event.
    pub fn synchronize(&self) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: a live handle; an out-pointer.
        status(unsafe { (self.shim.event_synchronize)(self.raw, &mut error) }, error)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: freed once, here.
        unsafe { (self.shim.event_free)(self.raw) }
    }
}

/// A captured CUDA graph and its output (rewritten by each replay).
pub struct Graph {
    shim: &'static CudaShim,
    raw: *mut c_void,
    output: Option<Tensor>,
}

// SAFETY: a plain handle used by one lane at a time; freed by Drop once.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph on the stream it was captured on.
    pub fn replay(&self) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: a live graph; an out-pointer.
        status(unsafe { (self.shim.graph_replay)(self.raw, &mut error) }, error)
    }

    /// The output tensor.
    pub fn output(&self) -> &Tensor {
        self.output.as_ref().expect("set at capture")
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // The output handle first (the graph's pool holds its memory).
        self.output.take();
        // SAFETY: freed once, here.
        unsafe { (self.shim.graph_free)(self.raw) }
    }
}

/// One line on whether CUDA graphs can be used in this process, for logs and
/// the GPU check.
pub fn availability() -> String {
    match shim() {
        Err(why) => why,
        Ok(shim) => match shim.device_count() {
            0 => "unavailable: no CUDA device".into(),
            n => format!("available: {n} CUDA device(s)"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_cuda_device_the_graph_api_says_why_it_is_unavailable() {
        let line = availability();
        eprintln!("CUDA graphs: {line}");
        if tch::Cuda::device_count() > 0 {
            eprintln!("skipped: without_a_cuda_device_the_graph_api_says_why_it_is_unavailable: a CUDA device is present");
            return;
        }
        assert!(line.starts_with("unavailable"), "{line}");
    }

    /// A lane's streams' pool slots (compute, copy), as the fake's pool
    /// handed them out.
    fn slots(lane: &LaneStreams) -> [fake::Stream; 2] {
        let (compute, copy) = fake::streams_of(lane);
        [compute, copy]
    }

    fn assert_no_stream_shared(lanes: &[LaneStreams]) {
        let mut seen = std::collections::HashSet::new();
        for lane in lanes {
            for stream in slots(lane) {
                assert!(seen.insert(stream), "{stream:?} held by two live lanes");
            }
        }
    }

    /// c10 hands out its 32 streams per device round-robin: 16 lanes take
    /// them all, a 17th on that device is refused naming the limit (not
    /// given a live lane's stream); another device is not affected.
    #[test]
    fn a_17th_lane_on_a_cuda_device_is_refused_rather_than_given_a_live_lanes_stream() {
        let session = fake::Session::start();
        let lanes: Vec<LaneStreams> =
            (0..LANES_PER_DEVICE).map(|_| LaneStreams::new(session.shim(), 0).unwrap()).collect();
        assert_no_stream_shared(&lanes);
        let error = LaneStreams::new(session.shim(), 0).err().expect("a 17th lane is refused");
        assert!(matches!(error, StreamsError::Full { device: 0, lanes: 16 }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains("cuda:0") && message.contains("at most 16") && message.contains("--lanes"),
            "{message}"
        );
        let other_device = LaneStreams::new(session.shim(), 1).unwrap();
        assert_eq!(slots(&other_device).map(|s| s.device), [1, 1]);
    }

    /// Lanes come and go (model versions replaced, lanes of several models
    /// on one device): a new lane's streams are never a live lane's, the
    /// pool's counter moving past held pairs, and a dropped lane's streams
    /// are free again.
    #[test]
    fn lanes_that_come_and_go_never_share_a_stream_with_a_live_lane() {
        let session = fake::Session::start();
        let mut lanes: Vec<LaneStreams> =
            (0..10).map(|_| LaneStreams::new(session.shim(), 0).unwrap()).collect();
        let mut state = 12345u64;
        for round in 0..300 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let pick = (state >> 33) as usize;
            // Now and then up to the limit, and one more refused.
            if round % 37 == 0 {
                while lanes.len() < LANES_PER_DEVICE {
                    lanes.push(LaneStreams::new(session.shim(), 0).unwrap());
                }
                assert!(LaneStreams::new(session.shim(), 0).is_err(), "round {round}: a 17th lane");
            }
            // Drop one or two lanes anywhere, then create lanes up to 4 to 15.
            for drop in 0..1 + pick % 2 {
                if !lanes.is_empty() {
                    lanes.swap_remove((pick >> (4 * drop)) % lanes.len());
                }
            }
            while lanes.len() < 4 + (pick >> 8) % 12 {
                lanes.push(LaneStreams::new(session.shim(), 0).unwrap());
            }
            assert_no_stream_shared(&lanes);
        }
    }

    #[test]
    fn the_shim_is_looked_for_in_the_environment_first() {
        let candidates = shim_candidates();
        assert!(candidates.iter().any(|p| p.ends_with(SHIM_FILE)), "{candidates:?}");
    }
}
