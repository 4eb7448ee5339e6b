//! The `--device` flag: `cpu`, `cuda` or `cuda:N`.

use narsil_core::BackendError;
use tch::Device;

/// Parses a device name and checks that the device exists in this process.
pub fn parse_device(name: &str) -> Result<Device, BackendError> {
    let device = match name {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => Device::Cuda(0),
        _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(index)) => Device::Cuda(index),
            _ => {
                return Err(BackendError::setup(format!("device `{name}` is not `cpu`, `cuda` or `cuda:N`")))
            }
        },
    };
    let visible = tch::Cuda::device_count();
    match device {
        Device::Cuda(index) if (index as i64) < visible => Ok(device),
        _ => Err(BackendError::setup(format!(
            "device `{name}` asked for, but libtorch sees {visible} CUDA device(s){}",
            if visible == 0 { " (no NVIDIA driver or GPU on this machine?)" } else { "" }
        ))),
    }
}

/// `name` for a split model: the CPU, or a CUDA device once CUDA is
/// registered in this process (opening `libtorch.so`, which loads
/// libtorch_cuda) and available; a clear error where it is not.
pub fn split_model_device(name: &str) -> Result<Device, BackendError> {
    if name == "cpu" {
        return Ok(Device::Cpu);
    }
    if name != "cuda" && !name.starts_with("cuda:") {
        return parse_device(name);
    }
    // libtorch_cuda registers CUDA with libtorch when loaded (the binary
    // links libtorch_cpu only): on a GPU machine it is LD_PRELOADed or found
    // beside libtorch.so.
    if let Err(why) = crate::fbgemm::open_global(&crate::libtorch_lib_dir().join("libtorch.so")) {
        tracing::debug!(reason = %why, "libtorch.so not opened");
    }
    if !tch::Cuda::is_available() {
        return Err(BackendError::setup(format!(
            "--device {name}: CUDA is not available in this process (libtorch sees {} CUDA device(s): no NVIDIA \
             driver or GPU here, or a libtorch without CUDA); serve with --device cpu",
            tch::Cuda::device_count()
        )));
    }
    parse_device(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_parses() {
        assert_eq!(parse_device("cpu").unwrap(), Device::Cpu);
    }

    #[test]
    fn malformed_names_are_rejected_with_the_name() {
        for bad in ["gpu", "cuda:x", "cuda:", "CPU"] {
            let err = parse_device(bad).unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[test]
    fn a_split_model_on_cuda_without_cuda_is_a_clear_error() {
        if tch::Cuda::is_available() {
            eprintln!(
                "skipped: a_split_model_on_cuda_without_cuda_is_a_clear_error: a CUDA device is present"
            );
            return;
        }
        let err = split_model_device("cuda").unwrap_err().to_string();
        assert!(err.contains("--device cuda") && err.contains("CUDA is not available"), "{err}");
        assert_eq!(split_model_device("cpu").unwrap(), Device::Cpu);
        assert!(split_model_device("gpu").unwrap_err().to_string().contains("gpu"));
    }

    #[test]
    fn cuda_beyond_the_visible_devices_is_a_clear_error() {
        let err = parse_device("cuda:99").unwrap_err();
        assert!(err.to_string().contains("CUDA device(s)"), "{err}");
    }
}
