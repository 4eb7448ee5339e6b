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

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use tch::Tensor;

use crate::script_module::take_string;

type RawTensor = torch_sys::C_tensor;

/// The shim's file name.
pub const SHIM_FILE: &str = "libnarsil_cuda_shim.so";
/// Environment variable naming the shim's file.
pub const SHIM_ENV: &str = "NARSIL_CUDA_SHIM";
/// The interface version this code calls.
const ABI: c_int = 1;

/// The forward a graph captures: the caller's closure, run on the capture
/// stream; returns a new heap tensor or null with a malloc'd message.
type ForwardFn = unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> *mut RawTensor;

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
    graph_capture:
        unsafe extern "C" fn(*mut c_void, ForwardFn, *mut c_void, c_int, *mut *mut c_char) -> *mut c_void,
    graph_output: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> *mut RawTensor,
    graph_replay: unsafe extern "C" fn(*mut c_void, *mut *mut c_char) -> c_int,
    graph_free: unsafe extern "C" fn(*mut c_void),
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
}

// SAFETY: the streams are plain handles any thread may use; freed by Drop once.
unsafe impl Send for LaneStreams {}
// SAFETY: no method mutates the handle; the shim's calls are thread-safe.
unsafe impl Sync for LaneStreams {}

impl LaneStreams {
    /// Two streams from libtorch's pool on CUDA device `device`.
    pub fn new(shim: &'static CudaShim, device: usize) -> Result<Self, String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: an out-pointer that outlives the call; the shim throws nothing.
        let raw = unsafe { (shim.streams_new)(device as c_int, &mut error) };
        if raw.is_null() {
            return Err(take_string(error).unwrap_or_else(|| "unknown error".into()));
        }
        Ok(Self { shim, raw })
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
    /// holds) as a graph on the compute stream, after `warmups` eager runs.
    pub fn capture<F: FnMut() -> Result<Tensor, String>>(
        &self,
        mut forward: F,
        warmups: usize,
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
        // SAFETY: a live handle; `forward` outlives the call (the shim calls
        // it only during it); the trampoline matches `ForwardFn`.
        let raw = unsafe {
            (self.shim.graph_capture)(
                self.raw,
                trampoline::<F>,
                (&mut forward as *mut F).cast(),
                warmups as c_int,
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
        // SAFETY: freed once, here.
        unsafe { (self.shim.streams_free)(self.raw) }
    }
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

    #[test]
    fn the_shim_is_looked_for_in_the_environment_first() {
        let candidates = shim_candidates();
        assert!(candidates.iter().any(|p| p.ends_with(SHIM_FILE)), "{candidates:?}");
    }
}
