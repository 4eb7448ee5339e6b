//! The TorchScript module as Narsil runs it: loaded, cast to the dense
//! precision, frozen, and called, through the C++ shim in
//! `csrc/script_module.cpp` (tch binds neither `torch::jit::freeze` nor
//! graph edits). Tensors cross the boundary as tch's own `at::Tensor*`.
//!
//! The shim's contract, which every call below relies on: no C++ exception
//! leaves it (each function catches everything and reports it through its
//! `error` out-pointer as a malloc'd C string, or as null), a function that
//! fails returns null (or -1) and nothing else, and a tensor it returns is a
//! new heap `at::Tensor` the caller owns.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::Path;

use tch::{Device, Tensor};

use crate::precision::DensePrecision;

#[repr(C)]
struct RawModule {
    _private: [u8; 0],
}

type RawTensor = torch_sys::C_tensor;

extern "C" {
    fn narsil_script_module_load(
        path: *const c_char,
        cuda_index: c_int,
        bf16: c_int,
        schema_json: *mut *mut c_char,
        bf16_lookups: *mut c_int,
        dict_signature: *mut c_int,
        managed_collision: *mut *mut c_char,
        error: *mut *mut c_char,
    ) -> *mut RawModule;
    fn narsil_script_module_forward_dict(
        module: *mut RawModule,
        num_inputs: c_int,
        names: *const *const c_char,
        inputs: *const *const RawTensor,
        num_outputs: c_int,
        output_names: *const *const c_char,
        outputs: *mut *mut RawTensor,
        error: *mut *mut c_char,
    ) -> c_int;
    fn narsil_script_module_forward(
        module: *mut RawModule,
        dense: *const RawTensor,
        lengths: *const RawTensor,
        ids: *const RawTensor,
        error: *mut *mut c_char,
    ) -> *mut RawTensor;
    fn narsil_script_module_forward_tensors(
        module: *mut RawModule,
        num_inputs: c_int,
        inputs: *const *const RawTensor,
        error: *mut *mut c_char,
    ) -> *mut RawTensor;
    fn narsil_script_module_free(module: *mut RawModule);
}

/// A loaded, frozen TorchScript module.
pub struct ScriptModule {
    raw: *mut RawModule,
}

// SAFETY: the module is a heap object no thread owns: any thread may run or
// free it; it is freed only by Drop, once.
unsafe impl Send for ScriptModule {}
// SAFETY: a torch::jit::Module may run forwards from several threads at once
// (TorchScript's interpreter keeps per-call state on the calling thread); the
// module is never mutated after loading, and no method takes `&mut self`.
unsafe impl Sync for ScriptModule {}

/// What loading found besides the module.
pub struct Loaded {
    pub module: ScriptModule,
    /// The JSON of the model's `narsil_schema()`, if it has that method.
    pub schema_json: Option<String>,
    /// INT8 embedding lookups switched to bf16 output (bf16 only).
    pub bf16_lookups: usize,
    /// Whether forward takes TorchRec's `Dict[str, Tensor]` (else Narsil's
    /// three positional tensors).
    pub dict_signature: bool,
    /// The tables of the TorchRec managed-collision modules it holds (found
    /// by their `_mch_sorted_raw_ids` buffers): the model remaps raw ids to
    /// rows itself. Empty for any other model.
    pub managed_collision_tables: Vec<String>,
}

/// The message libtorch raised (a C++ exception's `what()`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct LibtorchError(pub String);

impl ScriptModule {
    /// Loads `path` onto `device` in `precision` and freezes it.
    pub fn load(path: &Path, device: Device, precision: DensePrecision) -> Result<Loaded, LibtorchError> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| LibtorchError(format!("path with a NUL byte: {}", path.display())))?;
        let cuda_index = match device {
            Device::Cuda(index) => index as c_int,
            _ => -1,
        };
        let mut schema: *mut c_char = std::ptr::null_mut();
        let mut bf16_lookups: c_int = 0;
        let mut dict_signature: c_int = 0;
        let mut managed_collision: *mut c_char = std::ptr::null_mut();
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a valid C string and out-pointers that outlive the call;
        // the shim sets `error` or returns a module (and the strings), never
        // both, and throws nothing (module docs).
        let raw = unsafe {
            narsil_script_module_load(
                c_path.as_ptr(),
                cuda_index,
                (precision == DensePrecision::Bf16) as c_int,
                &mut schema,
                &mut bf16_lookups,
                &mut dict_signature,
                &mut managed_collision,
                &mut error,
            )
        };
        if raw.is_null() {
            return Err(LibtorchError(take_string(error).unwrap_or_else(|| "unknown error".into())));
        }
        Ok(Loaded {
            module: ScriptModule { raw },
            schema_json: take_string(schema),
            bf16_lookups: bf16_lookups.max(0) as usize,
            dict_signature: dict_signature != 0,
            managed_collision_tables: take_string(managed_collision)
                .map(|tables| tables.lines().map(String::from).collect())
                .unwrap_or_default(),
        })
    }

    /// `forward(dense, lengths, ids)`.
    pub fn forward(&self, dense: &Tensor, lengths: &Tensor, ids: &Tensor) -> Result<Tensor, LibtorchError> {
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live module (freed only by Drop); the
        // tensors and `error` outlive the call; the shim throws nothing.
        let output = unsafe {
            narsil_script_module_forward(self.raw, dense.as_ptr(), lengths.as_ptr(), ids.as_ptr(), &mut error)
        };
        if output.is_null() {
            return Err(LibtorchError(take_string(error).unwrap_or_else(|| "unknown error".into())));
        }
        // SAFETY: a non-null result is a new heap `at::Tensor` no one else
        // holds; its ownership passes to the returned Tensor.
        Ok(unsafe { Tensor::from_ptr(output) })
    }

    /// `forward(inputs...) -> Tensor`, tensors in, one tensor out (a split
    /// model's dense network: `forward(dense, pooled)`).
    pub fn forward_tensors(&self, inputs: &[&Tensor]) -> Result<Tensor, LibtorchError> {
        let raw: Vec<*const RawTensor> = inputs.iter().map(|t| t.as_ptr()).collect();
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live module; `raw` has the length passed
        // and it, the tensors it points at and `error` outlive the call; the
        // shim throws nothing.
        let output = unsafe {
            narsil_script_module_forward_tensors(self.raw, raw.len() as c_int, raw.as_ptr(), &mut error)
        };
        if output.is_null() {
            return Err(LibtorchError(take_string(error).unwrap_or_else(|| "unknown error".into())));
        }
        // SAFETY: a non-null result is a new heap `at::Tensor` no one else
        // holds; its ownership passes to the returned Tensor.
        Ok(unsafe { Tensor::from_ptr(output) })
    }

    /// `forward(batch: Dict[str, Tensor]) -> Dict[str, Tensor]`: `inputs`
    /// by name in, the tensors named `outputs` out, in that order.
    pub fn forward_dict(
        &self,
        inputs: &[(&CStr, &Tensor)],
        outputs: &[CString],
    ) -> Result<Vec<Tensor>, LibtorchError> {
        let names: Vec<*const c_char> = inputs.iter().map(|(name, _)| name.as_ptr()).collect();
        let tensors: Vec<*const RawTensor> = inputs.iter().map(|(_, t)| t.as_ptr()).collect();
        let output_names: Vec<*const c_char> = outputs.iter().map(|name| name.as_ptr()).collect();
        let mut raw_outputs: Vec<*mut RawTensor> = vec![std::ptr::null_mut(); outputs.len()];
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live module; every pointer array has the
        // length passed with it and outlives the call, as do the names and
        // tensors they point at; the shim throws nothing, and on failure
        // leaves every output null.
        let status = unsafe {
            narsil_script_module_forward_dict(
                self.raw,
                names.len() as c_int,
                names.as_ptr(),
                tensors.as_ptr(),
                output_names.len() as c_int,
                output_names.as_ptr(),
                raw_outputs.as_mut_ptr(),
                &mut error,
            )
        };
        if status != 0 {
            return Err(LibtorchError(take_string(error).unwrap_or_else(|| "unknown error".into())));
        }
        Ok(raw_outputs
            .into_iter()
            .map(|raw| {
                // SAFETY: on success each output is a new, non-null heap
                // `at::Tensor` no one else holds; its ownership passes to the
                // returned Tensor.
                unsafe { Tensor::from_ptr(raw) }
            })
            .collect())
    }
}

impl Drop for ScriptModule {
    fn drop(&mut self) {
        // SAFETY: `raw` came from the shim's load and is freed once, here;
        // no borrow of the module outlives `self`.
        unsafe { narsil_script_module_free(self.raw) }
    }
}

/// Takes ownership of a malloc'd C string from the shim.
pub(crate) fn take_string(ptr: *mut c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: a non-null string from the shim is NUL-terminated and ours
    // alone; it is copied out before it is freed.
    let text = unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned();
    // SAFETY: the shim allocates its strings with malloc and hands them
    // over: freed once, here, and not used after.
    unsafe { libc::free(ptr.cast()) };
    Some(text)
}
