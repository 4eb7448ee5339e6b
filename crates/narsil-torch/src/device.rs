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
    fn cuda_beyond_the_visible_devices_is_a_clear_error() {
        let err = parse_device("cuda:99").unwrap_err();
        assert!(err.to_string().contains("CUDA device(s)"), "{err}");
    }
}
